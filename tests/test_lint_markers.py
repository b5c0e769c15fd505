"""Every `# noqa` and `# type: ignore` left in the code names what it silences and why.

A marker is a promise that a linter's finding on that line was read and is wrong there. The
promise holds only when the marker names the rule (ruff's code, mypy's error code), says why
in a few words, and silences a rule the committed configuration actually runs: a marker for a
rule nothing checks is noise that hides nothing and misleads the reader.

The forms (the reason after the code):
    # noqa: E402 - the path is set up first
    # type: ignore[attr-defined]  # torch adds it at run time
"""

from __future__ import annotations

import fnmatch
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the lint environment is 3.11+
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
# what `make lint` runs ruff on
LINTED = ("wna16ctl", "tests", "bench", "scripts")

NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)", re.IGNORECASE)
NOQA_FORM = re.compile(r":\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)\s+-\s+(?P<reason>\S.*)")
IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<rest>.*)")
IGNORE_FORM = re.compile(r"\[(?P<codes>[a-z][a-z-]*(?:\s*,\s*[a-z][a-z-]*)*)\]\s*#\s*(?P<reason>\S.*)")


def _comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment token: markers in strings and docstrings are not markers."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


def marker_problems(rel: str, comments: list[tuple[int, str]], ruff: dict) -> list[str]:
    """What is wrong with the markers of one file (`rel`, relative to the root, as ruff's
    per-file-ignores patterns read it)."""
    problems = []
    for line, text in comments:
        where = f"{rel}:{line}"
        for m in NOQA.finditer(text):
            form = NOQA_FORM.match(m["rest"])
            if form is None:
                problems.append(f"{where}: `{m.group(0).strip()}` is not `# noqa: CODE - reason`")
                continue
            for code in re.split(r"\s*,\s*", form["codes"]):
                if not rule_runs(code, rel, ruff):
                    problems.append(f"{where}: noqa for {code}, a rule the ruff configuration does not run here")
        for m in IGNORE.finditer(text):
            if IGNORE_FORM.match(m["rest"].strip()) is None:
                problems.append(f"{where}: `{m.group(0).strip()}` is not `# type: ignore[code]  # reason`")
    return problems


def rule_runs(code: str, rel: str, ruff: dict) -> bool:
    """Whether ruff's configuration (the [tool.ruff.lint] table) runs rule `code` on file `rel`:
    the longest matching prefix among select / ignore decides, as in ruff."""
    lint = ruff.get("lint", {})
    select = [*lint.get("select", ["E4", "E7", "E9", "F"]), *lint.get("extend-select", [])]
    ignore = list(lint.get("ignore", []))
    for pattern, codes in lint.get("per-file-ignores", {}).items():
        if fnmatch.fnmatch(rel, pattern):
            ignore += codes

    def longest(prefixes: list[str]) -> int:
        return max((len(p) for p in prefixes if p == "ALL" or code.startswith(p)), default=-1)

    chosen, dropped = longest(select), longest(ignore)
    return chosen >= 0 and chosen > dropped


def _ruff_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]


@pytest.mark.skipif(tomllib is None, reason="tomllib (Python 3.11+) reads pyproject.toml")
def test_every_marker_names_its_rule_and_a_reason() -> None:
    ruff = _ruff_config()
    problems = []
    for top in LINTED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            problems += marker_problems(rel, _comments(path), ruff)
    assert not problems, "\n".join(problems)


RUFF = {"lint": {"select": ["E4", "E7", "F"], "ignore": ["E741"], "per-file-ignores": {"tests/**": ["F811"]}}}


@pytest.mark.parametrize("comment, rel, problem", [
    ("# noqa", "wna16ctl/a.py", "is not `# noqa: CODE - reason`"),
    ("# noqa: E402", "wna16ctl/a.py", "is not `# noqa: CODE - reason`"),
    ("# noqa: E402 -", "wna16ctl/a.py", "is not `# noqa: CODE - reason`"),
    ("# noqa:E731 (a lambda)", "wna16ctl/a.py", "is not `# noqa: CODE - reason`"),
    ("# noqa: ANN001 - a Checkpoint", "wna16ctl/a.py", "noqa for ANN001, a rule the ruff configuration"),
    ("# noqa: BLE001 - reported later", "wna16ctl/a.py", "noqa for BLE001"),
    ("# noqa: E741 - `l` is a layer", "wna16ctl/a.py", "noqa for E741"),
    ("# noqa: F811 - a fixture", "tests/test_a.py", "noqa for F811"),
    ("# noqa: E402, ANN202 - path first", "wna16ctl/a.py", "noqa for ANN202"),
    ("# type: ignore", "wna16ctl/a.py", "is not `# type: ignore[code]  # reason`"),
    ("# type: ignore[assignment]", "wna16ctl/a.py", "is not `# type: ignore[code]  # reason`"),
    ("# type: ignore  # a reason without a code", "wna16ctl/a.py", "is not `# type: ignore[code]"),
    ("# why  # type: ignore[arg-type]", "wna16ctl/a.py", "is not `# type: ignore[code]  # reason`"),
])
def test_a_marker_without_rule_or_reason_is_found(comment: str, rel: str, problem: str) -> None:
    found = marker_problems(rel, [(1, comment)], RUFF)
    assert len(found) == 1 and problem in found[0], found


@pytest.mark.parametrize("comment, rel", [
    ("# noqa: E402 - the path is set up first", "wna16ctl/a.py"),
    ("# noqa: E731, F401 - kept as a name", "wna16ctl/a.py"),
    ("# noqa: F811 - a fixture", "wna16ctl/a.py"),
    ("# type: ignore[attr-defined]  # torch adds it at run time", "wna16ctl/a.py"),
    ("# type: ignore[arg-type, union-attr]  # checked above", "wna16ctl/a.py"),
    ("# a comment that mentions neither", "wna16ctl/a.py"),
])
def test_a_marker_with_rule_and_reason_passes(comment: str, rel: str) -> None:
    assert marker_problems(rel, [(1, comment)], RUFF) == []


def test_markers_in_strings_are_not_markers(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('TEXT = "# noqa"\n"""# type: ignore"""\nx = 1  # noqa\n')
    assert _comments(src) == [(3, "# noqa")]
