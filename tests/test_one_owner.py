"""Each concept is defined once: a second definition, where one can be recognised in the source,
fails here with the place it stands.

- the output format's name and manifest file name: wna16ctl/output/manifest.py
- the files copied beside the rank directories: the same module
- dtype-name maps (safetensors' names to sizes, torch dtypes or config names): wna16ctl/dtypes.py
- vLLM releases: wna16ctl/planning/rules.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import wna16ctl

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
                        and e.value.count(".") == 2 for e in node.elts) >= 3:
                found.append(f"{rel}:{node.lineno}: a list of vLLM releases (planning/rules.py)")
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
