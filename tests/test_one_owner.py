"""Each concept is defined once: a second definition, where one can be recognised in the source,
fails here with the place it stands.

- the output format's name and manifest file name: wna16ctl/output/manifest.py
- the files copied beside the rank directories: the same module
- dtype-name maps (safetensors' names to sizes, torch dtypes or config names): wna16ctl/dtypes.py
- vLLM releases: wna16ctl/planning/rules.py
- layout names (marlin, transposed, vllm): wna16ctl/layout/spec.py
- architectures (config.json's model_type) and their facts: wna16ctl/sources/architectures.py; a
  model_type is named elsewhere only by the demo's writer of each family's config.json
"""

from __future__ import annotations

import ast
from pathlib import Path

import wna16ctl
from wna16ctl.sources.architectures import ARCHITECTURES, DEMO_ARCHITECTURES, model_types

PACKAGE = Path(wna16ctl.__file__).resolve().parent
_ST_NAMES = {"BF16", "F16", "F32", "I32", "I8", "U8", "I64"}
# maps keyed by dtype that are not a dtype fact: the C library's own codes for them
_ALLOWED_DTYPE_MAPS = {("repacking/native_path.py", "_SCALE_KIND")}


def _modules() -> list[tuple[str, ast.AST]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def second_definitions(modules: list[tuple[str, ast.AST]]) -> list[str]:
    found = []
    for rel, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in ("wna16ctl-repack", "wna16ctl.json") \
                    and rel != "output/manifest.py":
                found.append(f"{rel}:{node.lineno}: the output format's name {node.value!r} (output/manifest.py)")
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and rel != "output/manifest.py" and \
                    {"tokenizer_config.json", "generation_config.json"} <= {getattr(e, "value", None) for e in node.elts}:
                found.append(f"{rel}:{node.lineno}: a list of side files (output/manifest.py SIDE_FILES)")
            if isinstance(node, ast.Dict) and rel != "dtypes.py":
                names = {getattr(k, "value", None) for k in node.keys} | {getattr(v, "value", None) for v in node.values}
                if len(names & _ST_NAMES) >= 2 and (rel, _assigned_name(tree, node)) not in _ALLOWED_DTYPE_MAPS:
                    found.append(f"{rel}:{node.lineno}: a dtype-name map (dtypes.py)")
            if isinstance(node, ast.Tuple) and rel != "planning/rules.py" and \
                    sum(isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value.startswith("0.")
                        and e.value.count(".") == 2 for e in node.elts) >= 2:
                found.append(f"{rel}:{node.lineno}: a list of vLLM releases (planning/rules.py)")
    return found


_LAYOUT_NAMES = {"marlin", "transposed", "vllm"}


def _is_layout_name(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in _LAYOUT_NAMES


def _says_layout(node: ast.AST) -> bool:
    """A name or attribute that holds a layout (`layout`, `job.layout`, `VLLM_LAYOUT`, `requested_layout`)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "layout" in name.lower()


def retyped_layout_names(modules: list[tuple[str, ast.AST]]) -> list[str]:
    """Layout names written as string literals where the code means a layout: compared with or
    assigned to something named for a layout, passed as `layout=` or after `--layout`, or listed
    or keyed beside another layout name.  ("marlin" and "vllm" alone are also a backend and the
    engine: only these places say they are the layout.)"""
    found = []
    for rel, tree in modules:
        if rel == "layout/spec.py":
            continue
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_is_layout_name(a) for a in sides) and any(_says_layout(a) for a in sides):
                    hit = "compared with a layout"
            elif isinstance(node, ast.keyword) and node.arg == "layout" and _is_layout_name(node.value):
                hit = "passed as layout="
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_layout_name(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(_says_layout(t) for t in targets):
                    hit = "assigned to a layout"
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                elts = node.elts
                if sum(_is_layout_name(e) for e in elts) >= 2:
                    hit = "listed with another layout name"
                elif any(isinstance(a, ast.Constant) and a.value == "--layout" and _is_layout_name(b)
                         for a, b in zip(elts, elts[1:])):
                    hit = "after --layout"
            elif isinstance(node, ast.Dict):
                if sum(_is_layout_name(k) for k in node.keys) + sum(_is_layout_name(v) for v in node.values) >= 2:
                    hit = "keyed or mapped beside another layout name"
            if hit:
                found.append(f"{rel}:{node.lineno}: a layout name {hit} (layout/spec.py)")
    return found


def test_layout_names_are_imported_not_retyped():
    found = retyped_layout_names(_modules())
    assert not found, "retyped:\n" + "\n".join(found)


def test_a_retyped_layout_name_is_seen():
    src = '''
if job.layout == "marlin": pass
plan(layout="vllm")
VLLM_LAYOUT = "vllm"
CHOICES = ["auto", "marlin", "transposed"]
argv = ["repack", "--layout", "marlin"]
HINT = {"vllm": "a", "transposed": "b"}
MOE_BACKEND = "marlin"
ENGINE = {"name": "vllm"}
if backend == "marlin": pass
'''
    found = retyped_layout_names([("repacking/x.py", ast.parse(src))])
    assert sorted(int(f.split(":")[1]) for f in found) == [2, 3, 4, 5, 6, 7], found


# where a model_type may be written besides the table: the demo writes each family's config.json;
# the rulebook's checked (architecture, releases) pairs of the sharded_state contract, a written-out
# literal (tests/planning/test_rules.py), whose keys are checked against the table below
_ARCH_NAMES_ALLOWED = {"sources/architectures.py", "demo.py"}
_ARCH_TABLES_ALLOWED = {("planning/rules.py", "VLLM_STATE_SUPPORT")}


def architecture_facts_elsewhere(modules: list[tuple[str, ast.AST]]) -> list[str]:
    """Where a module other than the table names an architecture: a collection (tuple, list, set,
    dict keys) of model types anywhere, or one model type outside the demo's config writer."""
    found = []
    for rel, tree in modules:
        if rel == "sources/architectures.py":
            continue
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        in_tables: set[int] = set()
        for node in ast.walk(tree):
            elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or elts is None:
                continue
            named = [e for e in elts if isinstance(e, ast.Constant) and e.value in ARCHITECTURES]
            if named and (rel, _assigned_name(tree, node)) not in _ARCH_TABLES_ALLOWED:
                found.append(f"{rel}:{node.lineno}: a list of architectures (sources/architectures.py)")
            in_tables.update(id(e) for e in named)
        if rel in _ARCH_NAMES_ALLOWED:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in ARCHITECTURES and id(node) not in docstrings \
                    and id(node) not in in_tables:
                found.append(f"{rel}:{node.lineno}: the architecture {node.value!r} (sources/architectures.py)")
    return found


def _assigned_name(tree: ast.AST, value: ast.AST) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is value:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            return getattr(target, "id", None)
    return None


def test_each_concept_is_defined_once():
    found = second_definitions(_modules())
    assert not found, "defined again:\n" + "\n".join(found)


def test_each_architecture_is_described_once():
    found = architecture_facts_elsewhere(_modules())
    assert not found, "named outside the architecture table:\n" + "\n".join(found)


def test_the_lists_of_architectures_left_outside_the_table_follow_it():
    """The written-out lists the check lets stand name the architectures the table says."""
    from wna16ctl.planning import rules

    assert sorted(rules.VLLM_STATE_SUPPORT) == sorted(model_types(sharded_state=True))
    from wna16ctl.cli import cli

    (arch,) = [p for p in cli.commands["demo"].params if p.name == "arch"]
    assert tuple(arch.type.choices) == DEMO_ARCHITECTURES and arch.default in DEMO_ARCHITECTURES


def test_an_architecture_named_again_is_seen():
    src = '''
SHARED = ("deepseek_v3", "kimi_k2")
WIDTHS = {"mixtral": "intermediate_size"}
def renorm(model_type):
    return model_type == "qwen3_moe"
'''
    found = architecture_facts_elsewhere([("verification/x.py", ast.parse(src))])
    assert [f.split(": ", 1)[1] for f in found] == [
        "a list of architectures (sources/architectures.py)", "a list of architectures (sources/architectures.py)",
        "the architecture 'qwen3_moe' (sources/architectures.py)"]
    # the demo's config writer may compare with a model type, never list them
    assert [f.split(": ", 1)[1] for f in architecture_facts_elsewhere([("demo.py", ast.parse(src))])] == [
        "a list of architectures (sources/architectures.py)", "a list of architectures (sources/architectures.py)"]


def test_a_second_definition_is_seen():
    src = '''
FORMAT = "wna16ctl-repack"
COPY = ("config.json", "tokenizer_config.json", "generation_config.json")
SIZES = {"BF16": 2, "F32": 4}
OLD = ("0.27.0", "0.28.0", "0.29.0")
'''
    found = second_definitions([("repacking/x.py", ast.parse(src))])
    assert [f.split(": ", 1)[1].split(" (")[0] for f in found] == [
        "the output format's name 'wna16ctl-repack'", "a list of side files", "a dtype-name map", "a list of vLLM releases"]
