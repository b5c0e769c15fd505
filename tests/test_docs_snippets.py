"""The user guide's "What to do with the output" snippet runs as written on a repacked demo."""

from __future__ import annotations

import textwrap

from tests.conftest import REPO_ROOT
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack


def test_output_snippet_runs(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=1, num_experts=4, top_k=2, vocab_size=64)
    run_repack(plan_repack(ck, RepackSettings(tp=2)), tmp_path / "tp2")
    guide = (REPO_ROOT / "docs" / "user-guide.md").read_text()
    code = textwrap.dedent(guide.split("## What to do with the output today")[1].split("```python")[1].split("```")[0])
    assert '"/fast/q3-tp2"' in code
    scope: dict = {}
    exec(compile(code.replace('"/fast/q3-tp2"', repr(str(tmp_path / "tp2"))), "user-guide.md", "exec"), scope)
    y = scope["y"]
    assert tuple(y.shape) == (4, scope["layer"]["hidden_size"]) and bool(y.isfinite().all())
