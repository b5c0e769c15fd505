"""The serve path `inspect` offers agrees with what `repack` says of the output it writes: a Marlin
output is served by the `wna16ctl` load format wherever every layer loads on Marlin with the
backend pinned (as the load format pins it), whichever backend vLLM's oracle would pick itself."""

from __future__ import annotations

from pathlib import Path

from wna16ctl.planning.next_steps import MARLIN_LAYOUT, output_next_step


def test_inspect_offers_the_marlin_output_that_repack_says_the_plugin_serves(tmp_path: Path):
    """Qwen3.5-35B-A3B (no vllm-layout contract) on vLLM 0.32.0, sm90, where the oracle picks
    Humming by itself: inspect proposes the Marlin layout with the plugin, the step repack prints
    for that output, instead of "no pre-sharded layout applies"."""
    from tests.conformance.model_build import write_real
    from wna16ctl import inspect

    ck = write_real("qwen35_35b_a3b", tmp_path)
    insp = inspect(ck, tp=2, vllm="0.32.0")
    steps = insp.next_steps()
    assert [s.layout for s in steps] == [MARLIN_LAYOUT], [s.to_json() for s in steps]
    after_repack = output_next_step(ck, tmp_path / "out", MARLIN_LAYOUT, 2, False, "0.32.0",
                                    layers=[{"layout": MARLIN_LAYOUT, "scheme": {"actorder": None}}])
    assert after_repack.layout == steps[0].layout and after_repack.needs == steps[0].needs
    assert steps[0].serve.endswith("--load-format wna16ctl --tensor-parallel-size 2 --moe-backend marlin")
