"""No function or method of the package is longer than MAX_LINES lines.

Its counterpart, a cyclomatic complexity (mccabe) of at most 35, is ruff's C901 (pyproject.toml,
`make lint`).  A function is measured from its `def` line to its last line, docstring and
comments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import wna16ctl

PACKAGE_DIR = Path(wna16ctl.__file__).resolve().parent
MAX_LINES = 120


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """'path:line name (N lines)' for every function under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1  # end_lineno: always set by ast.parse
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_over_the_limit() -> None:
    assert long_functions(PACKAGE_DIR) == [], f"split these into functions of at most {MAX_LINES} lines"


def _function(name: str, body_lines: int, indent: str = "") -> str:
    return f"{indent}def {name}():\n" + "".join(f"{indent}    x = {i}\n" for i in range(body_lines))


def test_the_measure_finds_long_functions_and_methods(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text(_function("fits", MAX_LINES - 1) + _function("too_long", MAX_LINES))
    (pkg / "sub" / "b.py").write_text("class C:\n" + _function("method", MAX_LINES, "    ")
                                      + "\n\nasync def outer():\n" + _function("inner", MAX_LINES, "    "))
    found = long_functions(pkg)
    assert sorted(f.split(" ")[1] for f in found) == ["inner", "method", "outer", "too_long"]
    assert found[0] == f"pkg/a.py:{MAX_LINES + 1} too_long ({MAX_LINES + 1} lines)"
