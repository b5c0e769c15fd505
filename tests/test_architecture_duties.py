"""What docs/architecture.md says `planning/`, `sources/` and the API hold or must not do, checked
against the package's sources with `ast`: the doc names every exception the code has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import wna16ctl
from wna16ctl.planning import rules

PACKAGE_DIR = Path(wna16ctl.__file__).resolve().parent
DOC = PACKAGE_DIR.parent / "docs" / "architecture.md"

# the sources/ functions that read a checkpoint's files (config, headers, g_idx vectors)
CHECKPOINT_READERS = {"open_checkpoint", "open_hub_checkpoint", "open_proposed", "gate_up_g_idx_mismatch"}
FILE_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "open"}
DIRECTORY_CALLS = {"listdir", "scandir", "iterdir", "glob", "rglob", "isfile", "isdir"}
HEAVY_IMPORTS = {"torch", "safetensors", "compressed_tensors", "numpy"}


def table_rows() -> dict[str, tuple[str, str]]:
    """Each row of the doc's tables: its first cell (`planning/`, `planning/rules.py`) -> (owns, does not)."""
    rows = re.findall(r"^\| `([\w/.]+)` \| (.*) \| (.*) \|$", DOC.read_text(), re.M)
    return {name: (owns, does_not) for name, owns, does_not in rows}


def calls(tree: ast.AST) -> set[str]:
    """The names of the functions a module calls (`os.listdir(...)` -> `listdir`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def imported(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def planning_modules() -> dict[str, ast.AST]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted((PACKAGE_DIR / "planning").glob("*.py"))}


def test_the_api_row_and_the_readme_name_every_public_function():
    functions = [n for n in wna16ctl.__all__ if n.islower() and not n.startswith("_")]
    owns, _ = table_rows()["__init__.py"]
    assert functions and not [n for n in functions if f"`{n}`" not in owns], (functions, owns)
    readme = " ".join((PACKAGE_DIR.parent / "README.md").read_text().split())
    python = readme[readme.index("The same from Python:"):].split("(docs/python-api.md)")[0]
    assert not [n for n in functions if f"`wna16ctl.{n}(...)`" not in python], python


def test_planning_reads_files_only_where_the_doc_says():
    """No planning module opens a file or imports torch; those that read a checkpoint (through
    sources/) or the installed vLLM's package metadata are the ones the doc names, and a module row
    that says "read files" holds neither."""
    rows = table_rows()
    readers, metadata = set(), set()
    for name, tree in planning_modules().items():
        called, imports = calls(tree), imported(tree)
        assert "open" not in called and not called & FILE_METHODS, f"planning/{name} opens a file itself"
        assert not {m.split(".")[0] for m in imports} & HEAVY_IMPORTS, f"planning/{name} imports {imports}"
        if called & CHECKPOINT_READERS:
            readers.add(name)
        if called & DIRECTORY_CALLS or "importlib.metadata" in imports:
            metadata.add(name)
    _, planning_does_not = rows["planning/"]
    assert planning_does_not.startswith("open a file itself") and "import torch" in planning_does_not
    for name in readers | metadata:
        assert f"`{name}`" in planning_does_not, f"docs/architecture.md's planning/ row should name {name}"
        assert "read files" not in rows[f"planning/{name}"][1], f"planning/{name} reads files"
    assert metadata == {"rules.py"} and "package metadata" in planning_does_not, metadata


def test_sources_holds_no_rule_of_one_release():
    """sources/ imports nothing of planning/, and no string of its code (docstrings aside) names a
    known release: what differs between releases is decided in planning/."""
    _, does_not = table_rows()["sources/"]
    assert "hold a rule that differs between releases" in does_not and "name a release" in does_not
    for path in sorted((PACKAGE_DIR / "sources").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        assert not [m for m in imported(tree) if m.startswith("wna16ctl.planning")], path.name
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)}
        named = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str) and id(n) not in docstrings
                 and any(re.search(rf"(?<![\d.]){re.escape(r)}(?![\d])", n.value) for r in rules.RELEASES)]
        assert not named, f"sources/{path.name} names a release: {named}"
