"""The package's import graph: no cycles, layers import downwards only, no API name is a submodule.

Read from the sources with `ast`, so imports inside functions and under TYPE_CHECKING count too: a
cycle that only closes at call time is still a cycle in the design.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import wna16ctl

PACKAGE_DIR = Path(wna16ctl.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py")) if "kernel_sources" not in p.parts}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (a `from P import X` names module P.X when there is one)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# Which layer may import which: the command line on top, then the three jobs, then what they share.
LAYERS = [
    {"wna16ctl.cli", "wna16ctl.__main__", "wna16ctl", "wna16ctl.render", "wna16ctl.summary", "wna16ctl.demo",
     "wna16ctl.envreport"},
    {"planning", "repacking", "verification", "integrations", "padding", "conversion"},
    {"sources", "output", "native", "layout"},
]


def layer_of(module: str) -> int:
    if module in LAYERS[0]:
        return 0
    sub = module.split(".")[1]
    for i, layer in enumerate(LAYERS[1:], start=1):
        if sub in layer:
            return i
    return 3  # errors, sink, version: shared by every layer


def test_layers_import_downwards_only():
    wrong = []
    for module, targets in import_graph().items():
        for target in targets:
            if layer_of(target) < layer_of(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering (docs/architecture.md): " + ", ".join(sorted(wrong))


def test_no_public_name_is_a_submodule_and_the_top_level_stays_small():
    mods = modules()
    assert not [n for n in wna16ctl.__all__ if f"wna16ctl.{n}" in mods]
    top = [p for p in PACKAGE_DIR.glob("*.py")]
    assert len(top) <= 12, sorted(p.name for p in top)
    for package in (p for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{package.name}/__init__.py should say what the sub-package is"


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph one level up: `wna16ctl.layout.rank -> wna16ctl.sources.tensors` is an edge
    layout -> sources. Top-level modules stand for themselves."""
    def sub(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(sub(module), set()).update(sub(t) for t in targets if sub(t) != sub(module))
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_the_sub_packages_have_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(subpackage_graph(graph))
    if cycle:
        edges = [f"{m} -> {t}" for a, b in zip(cycle, cycle[1:]) for m, ts in sorted(graph.items())
                 for t in sorted(ts) if m.split(".")[1:2] == [a] and t.split(".")[1:2] == [b]]
        raise AssertionError("sub-package cycle " + " -> ".join(cycle) + ": " + ", ".join(edges))


def test_the_sub_package_graph_folds_modules():
    graph = {"wna16ctl.a.x": {"wna16ctl.b.y"}, "wna16ctl.b.y": {"wna16ctl.a.z"}, "wna16ctl.a.z": set()}
    assert find_cycle(subpackage_graph(graph)) == ["a", "b", "a"]
    assert find_cycle(subpackage_graph({"wna16ctl.a.x": {"wna16ctl.a.z"}, "wna16ctl.a.z": set()})) is None


def test_docs_architecture_names_every_module():
    """docs/architecture.md's module table names every module of the package (its path below
    wna16ctl/), and no module that is gone."""
    text = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    every = {p.relative_to(PACKAGE_DIR).as_posix() for p in PACKAGE_DIR.rglob("*.py") if "kernel_sources" not in p.parts}
    # a sub-package's __init__ is described by its folder's line in the table when it holds only the docstring
    required = {m for m in every if not (m.endswith("/__init__.py"))}
    in_table = set(re.findall(r"^\| `([\w/]+\.py)`", text, re.M))
    assert not required - in_table, f"modules missing from docs/architecture.md: {sorted(required - in_table)}"
    assert not in_table - every, f"docs/architecture.md names modules that are gone: {sorted(in_table - every)}"
