"""The input formats have one owner: `wna16ctl/sources/formats/`.

No format name (a `quant_method` or stored-form value such as "compressed-tensors",
"pack-quantized", "gptq", "awq") and no stored tensor's suffix (`weight_packed`, `weight_scale`,
`weight_zero_point`, `weight_g_idx`, `weight_shape`, also as `.weight_packed` or in an f-string
that builds a tensor name) is written as a string outside that package and the planner's method
steps (`planning/methods/`): everywhere else asks the format (`sources.formats.of(...)`, its
`names`, the canonical keys `CODES`/`SCALES`/`ZERO_POINTS`/`G_IDX`).  Messages and docstrings that
mention a name inside a longer text are not names compared, and are not flagged.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import wna16ctl

PACKAGE = Path(wna16ctl.__file__).resolve().parent
OWNERS = ("sources/formats/", "planning/methods/")
FORMAT_NAMES = {"compressed-tensors", "compressed_tensors", "pack-quantized", "gptq", "gptq_v2", "awq", "auto-round",
                "intel/auto-round", "gptq_marlin", "awq_marlin"}
_SUFFIX = re.compile(r"(^|\.)(weight_packed|weight_scale|weight_zero_point|weight_g_idx|weight_shape)(@\w+)?$")
# Places that keep a format's names for a reason of their own, each with it.
EXEMPT_FILES = {
    # the canonical form's keys: the layouts' own definition of what every format reads into; they
    # are the names compressed-tensors gave these tensors, so its projections are canonical as stored
    "layout/spec.py": {"weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"},
    # a Python package's name in the environment report (its version), not a checkpoint's format
    "envreport.py": {"compressed-tensors"},
    # the demo writes its checkpoints with compressed-tensors itself and reads them back with the
    # library's own unpacking, as a reference independent of the package's readers
    "demo.py": None,
}


def format_names_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal (or f-string piece) that is a format name or ends in a
    stored tensor's suffix."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.lower() in FORMAT_NAMES or _SUFFIX.search(text):
                found.append((node.lineno, text))
    return found


def test_no_format_name_outside_the_format_owner():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(OWNERS) or "kernel_sources" in rel:
            continue
        allowed = EXEMPT_FILES.get(rel, set())
        for line, text in format_names_in(ast.parse(path.read_text(), str(path))):
            if allowed is not None and text not in allowed:
                wrong.append(f"{rel}:{line}: {text!r}")
    assert not wrong, "format names outside sources/formats/ (ask the format instead):\n" + "\n".join(wrong)


def test_the_check_sees_a_format_name():
    tree = ast.parse('x = name.endswith(".weight_packed")\ny = f"{m}.weight_scale"\nz = q == "gptq"\n'
                     'w = "w13_weight_packed"\nmsg = "the weight_packed tensor is missing"\n')
    assert [line for line, _ in format_names_in(tree)] == [1, 2, 3]


def test_every_exemption_is_still_needed():
    for rel, allowed in EXEMPT_FILES.items():
        found = {t for _, t in format_names_in(ast.parse((PACKAGE / rel).read_text()))}
        assert found and (allowed is None or allowed <= found), f"{rel} no longer needs (all of) its exemption"
