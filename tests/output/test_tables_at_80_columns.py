"""Every table keeps its verdict column at 80 columns, on a terminal and in a pipe: less important
columns are left out (a caption names them), the verdict never is, and no line is wider."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import wna16ctl
from tests import modelckpt as m
from wna16ctl.render import render_inspection, render_verify
from wna16ctl.verification.checks import FAIL, PASS, LayerNumerics, VerifyReport

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def render(draw, terminal: bool, width: int = 80) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=terminal, color_system="standard" if terminal else None,
                      highlight=False, soft_wrap=False)
    draw(console)
    return [ANSI.sub("", line) for line in buf.getvalue().splitlines()]


def table_rows(lines: list[str], title: str, first: str) -> list[str]:
    """The body rows of the table titled `title` whose header starts with `first`."""
    start = lines.index(next(ln for ln in lines if ln.strip() == title))
    head = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith(first))
    rows = []
    for ln in lines[head + 1:]:
        if set(ln.strip()) <= {"─", " "} and ln.strip():
            continue  # the rule under a terminal's header
        if not ln.strip() or ln.startswith(("not shown", "  ", "verdict", "summary")) and not ln.startswith("   "):
            break
        rows.append(ln)
    return rows


def _report() -> VerifyReport:
    report = VerifyReport("/models/ckpt", "/fast/out", "cpu", "tokenizer.json", 64)
    for c in report.checks:
        c.status = PASS
    long_name = "model.language_model.layers.47.mlp.experts"
    ok = LayerNumerics(long_name, 3072, 0, 128, 128, status=PASS, max_abs_error=2.5e-4, rel_l2_error=5.5e-3,
                       cosine=0.999985, max_error_over_bound=1.0, elements=6291456, exact_elements=6000000,
                       max_offset=1.0, bound_used=0.0021, violations=0)
    bad = LayerNumerics("model.language_model.layers.48.mlp.experts", 3072, 12, 120, 128, status=FAIL,
                        reason="12 of 6291456 elements outside the rounding interval (max error 3.2 × the bound)",
                        max_abs_error=0.3, rel_l2_error=0.2, cosine=0.97, max_error_over_bound=3.2,
                        elements=6291456, exact_elements=6000000, max_offset=3.7, bound_used=37.0, violations=12)
    report.numerics = [ok, bad]
    report.check("numerics").status = FAIL
    return report


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_verify_numerics_keep_the_result(terminal):
    lines = render(lambda console: render_verify(console, _report()), terminal)
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    rows = table_rows(lines, "numerics per MoE layer (candidate vs fp32 dequantized reference)", "layer")
    text = "\n".join(rows)
    assert re.search(r"\bpass\b", text) and re.search(r"\bFAIL\b", text), "\n".join(lines)
    assert "bound used" in "\n".join(lines) and "0.0021" in text and re.search(r"\b37\b", text)
    # the reason is under the table, wrapped under itself, whole
    flat = " ".join(" ".join(ln.split()) for ln in lines)
    assert ("* model.language_model.layers.48.mlp.experts: 12 of 6291456 elements outside the rounding interval "
            "(max error 3.2 × the bound)") in flat, "\n".join(lines)
    assert any(ln.startswith("not shown at 80 columns:") for ln in lines)


def test_verify_numerics_show_every_column_where_they_fit():
    lines = render(lambda console: render_verify(console, _report()), False, width=200)
    assert not any(ln.startswith("not shown") for ln in lines)
    assert "rel L2" in "\n".join(lines) and "cosine" in "\n".join(lines)


@pytest.fixture(scope="module")
def with_linear(tmp_path_factory):
    """Qwen3-30B-A3B's shapes with quantized attention: a table of linear layers too."""
    q = m.qwen3_30b_a3b(layers=2)
    return m.write(tmp_path_factory.mktemp("q3") / "ckpt", q, m.qwen3_moe(q, q["quantization_config"]))


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_inspect_tables_keep_the_status(with_linear, terminal):
    insp = wna16ctl.inspect(with_linear, tp="1,2,4,8", vllm="0.33.0")
    lines = render(lambda console: render_inspection(console, insp), terminal)
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    for title, first in (("plan per TP size", "layers"), ("quantized linear layers per TP size", "layers")):
        rows = [r for r in table_rows(lines, title, first) if re.search(r"\b(1|2|4|8)\b", r)]
        assert rows, "\n".join(lines)
        assert all(re.search(r"\b(ok|fails)\b", r) for r in rows), (title, "\n".join(rows))


BACKENDS = ("marlin", "humming", "triton", "batched_marlin", "flashinfer", "none")


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_suggestions_and_status_cells_at_80_columns(with_linear, terminal):
    """`--suggest` at 80 columns: every line fits; each status cell stays on its row ("ok, 2
    notes", never "ok, 2" over "notes"); a row that fails names no backend (it would read as
    "loads on it"); and padding, the fix that keeps TP 4, is listed in the text, not only in --json."""
    insp = wna16ctl.inspect(with_linear, tp="1,2,4,8", vllm="0.31.0", suggest=True)
    assert any(s.kind == "pad" and s.for_tp == 4 for s in insp.suggestions)
    lines = render(lambda console: render_inspection(console, insp), terminal)
    assert all(len(ln) <= 80 for ln in lines), "\n".join(ln for ln in lines if len(ln) > 80)
    for title, first in (("plan per TP size", "layers"), ("quantized linear layers per TP size", "layers")):
        rows = table_rows(lines, title, first)
        status = re.compile(r"\b(ok|wrong outputs|fails)(, \d+ notes?)?\s*$")
        assert all(status.search(r) for r in rows if r.strip()), (title, "\n".join(rows))
        for r in rows:
            if re.search(r"\bfails\b", r):
                assert not any(re.search(rf"\b{b}\b", r) for b in BACKENDS), r
    text = " ".join(" ".join(ln.split()) for ln in lines)
    assert "TP 4: suggest zero-pad the MLP intermediate sizes" in text and "wna16ctl pad CKPT --tp 4" in text


def test_time_left_comes_from_the_throughput_measured_over_the_step():
    from wna16ctl.sink import time_left

    assert time_left(0, 100, 5.0) is None and time_left(10, 100, None) is None
    # 1.5 experts/s measured over 20 s: 90 experts left take 60 s, whatever the last jump was
    assert time_left(30, 120, 20.0) == pytest.approx(60.0)


def test_the_whole_run_time_left_holds_from_its_first_step():
    """Hashing (bytes) then the round trip (experts), each priced up front in bytes read: after the
    first step at 10 units/s the whole run's time left is that of later steps at the same cost per
    unit (within a factor 1.25), unknown before any work, and one line of unit RUN shows it."""
    from wna16ctl.sink import RUN, WholeRun

    lines: list[tuple[str, int, str]] = []
    moved: dict[str, int] = {}

    def start(description: str, total: int, *, unit: str = "bytes"):
        lines.append((description, total, unit))
        moved.setdefault(description, 0)
        return lambda n: moved.__setitem__(description, moved[description] + n)

    run = WholeRun(start, "whole verify", {"hashing output files": 100.0, "round trip": 900.0})
    assert lines == [("whole verify", 1000, RUN)]
    assert run.left(None) is None and run.left(30.0) is None  # nothing measured yet: no figure
    hashing = run.start("hashing output files", 100 << 20)
    assert run.left(5.0) is None
    hashing(100 << 20)  # the first step's work, done in 10 s (fake clock: elapsed given)
    left = run.left(10.0)
    assert left is not None and 900 / 10 / 1.25 <= left <= 900 / 10 * 1.25  # the round trip's 900 units at 10/s
    assert moved["whole verify"] == 100
    experts = run.start("round trip", 30, unit="experts")
    for _ in range(10):  # 300 units in the next 30 s: the same cost per unit
        experts(1)
    assert run.left(40.0) == pytest.approx(60.0) and moved["whole verify"] == 400
    run.restate("round trip", 1200.0)  # the step's work better known: the line's total follows
    assert lines[-1] == ("whole verify", 1300, RUN)


@pytest.mark.parametrize("width", [60, 80])
def test_a_progress_line_stays_one_line(width, monkeypatch):
    """The amount ("1.0 GiB/3.0 GiB 8.0 MiB/s") and the time left never wrap onto a line of their own."""
    from wna16ctl.sink import Sink

    monkeypatch.setenv("COLUMNS", str(width))
    sink = Sink()
    buf = io.StringIO()
    sink.err = Console(file=buf, width=width, force_terminal=True, color_system=None)
    monkeypatch.setattr(sink, "progress_enabled", lambda: True)
    with sink.tasks() as start:
        advance = start("round trip and numerics of every expert", 3 << 30)
        advance(1 << 30)
    frames = [f for f in re.split(r"\r|\n", ANSI.sub("", buf.getvalue())) if f.strip()]
    assert frames and all(len(f) <= width for f in frames), frames
    assert any("GiB/3.0 GiB" in f and " left" in f for f in frames), frames


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_memory_lines_at_80_columns(with_linear, terminal):
    """Will it fit, at 80 columns: each TP size's figures wrap under themselves, and a range whose
    ends agree is one figure."""
    insp = wna16ctl.inspect(with_linear, tp="1,2", vllm="0.33.0", gpu_mem="a100-40")
    assert insp.fits
    lines = render(lambda console: render_inspection(console, insp), terminal)
    assert all(len(ln) <= 80 for ln in lines), "\n".join(ln for ln in lines if len(ln) > 80)
    text = " ".join(" ".join(ln.split()) for ln in lines)
    assert "TP 1: weights" in text and "concurrent" in text
    assert not re.search(r"\b(\d+)-\1\b", text), text
