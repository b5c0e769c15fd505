"""One module prints: `wna16ctl/sink.py`.  Every command hands its results, warnings and errors
to the sink (JSON or rich for people; results on stdout, the rest on stderr), so a direct print,
stream write or console anywhere else in the package fails here with the place it stands."""

from __future__ import annotations

import ast
from pathlib import Path

import wna16ctl

PACKAGE = Path(wna16ctl.__file__).resolve().parent
# Places that print without the sink, each with the reason it cannot use it.
ALLOWED = {
    # a Ctrl-C while the program starts, before the sink (or anything) is imported
    ("__init__.py", "_interrupted_while_starting"),
    ("cli.py", "<module>"),
    # programs of their own, run as processes and read by their callers, not `wna16ctl` commands
    ("native/gpucheck.py", "*"),
    ("integrations/plugin_check.py", "*"),
}


def _function_of(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the name of the top-level function (or class) it stands in; '<module>' else."""
    owner: dict[int, str] = {}
    for top in ast.iter_child_nodes(tree):
        name = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else "<module>"
        for node in ast.walk(top):
            owner[id(node)] = name
    return owner


def _what(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name) and f.id in ("print", "Console"):
        return f"{f.id}()"
    if isinstance(f, ast.Attribute):
        target = ast.unparse(f.value)
        if f.attr == "write" and target in ("sys.stdout", "sys.stderr"):
            return f"{target}.write()"
        if f.attr == "write" and target == "os" and node.args and ast.unparse(node.args[0]) in ("1", "2"):
            return "os.write() to stdout/stderr"
        if f.attr in ("print_exc", "print_exception", "print_stack") and target == "traceback":
            return f"traceback.{f.attr}()"
        if f.attr == "Console":
            return "Console()"
    return None


def direct_output(modules: list[tuple[str, ast.AST]]) -> list[str]:
    found = []
    for rel, tree in modules:
        if rel == "sink.py":
            continue
        owner = _function_of(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (what := _what(node)):
                if (rel, "*") in ALLOWED or (rel, owner.get(id(node), "<module>")) in ALLOWED:
                    continue
                found.append(f"{rel}:{node.lineno}: {what} outside the sink")
    return found


def test_only_the_sink_prints():
    modules = [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(), str(p)))
               for p in sorted(PACKAGE.rglob("*.py"))]
    found = direct_output(modules)
    assert not found, "hand it to wna16ctl.sink.Sink instead:\n" + "\n".join(found)


def test_a_direct_print_is_seen():
    src = '''
import sys, os, traceback
from rich.console import Console
def render(x):
    print(x)
    sys.stdout.write(x)
    os.write(2, b"x")
    traceback.print_exc()
    Console().print(x)
    console.print(x)  # a console handed over by the sink: fine
'''
    found = direct_output([("repacking/x.py", ast.parse(src))])
    assert [int(f.split(":")[1]) for f in found] == [5, 6, 7, 8, 9], found
