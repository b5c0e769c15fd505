"""The audit's adversarial checkpoints, as header-only fixtures read by wna16ctl's own reader,
against the verdicts each vLLM release's code gave them (pinned in
tests/conformance/adversarial_pins.json; the conformance suite re-derives the pins from the
releases' sources where they are cached)."""

from __future__ import annotations

import pytest

from tests.conformance import adversarial
from tests.conformance.ckptcase import planner_via_reader

PINS = adversarial.pins()


def _planner_verdict(version: str, name: str, tp: int) -> list:
    refusal, plan = planner_via_reader(adversarial.case(name, tp), version)
    if refusal is not None:
        return ["config", None]
    if plan.failure_stage == "load":  # wna16ctl's own load-time checks happen after what the pins cover
        return [None, plan.backend.value if plan.backend else None]
    return [plan.failure_stage, plan.backend.value if plan.loadable else None]


@pytest.mark.parametrize("name", sorted(adversarial.FIXTURES))
def test_planner_matches_the_pinned_vllm_verdicts(name: str) -> None:
    wrong = []
    for version, by_tp in PINS[name].items():
        for tp, want in by_tp.items():
            got = _planner_verdict(version, name, int(tp))
            if got != want:
                wrong.append(f"vLLM {version} TP {tp}: vLLM {want}, planner {got}")
    assert not wrong, "\n".join(wrong)


def test_the_pins_say_what_the_issue_reported() -> None:
    # a checkpoint whose act-order group targets no planned module: refused from 0.30.0 only
    unmatched = PINS["unmatched_actorder_group"]
    assert all(unmatched[v]["1"] == ["config", None] for v in ("0.30.0", "0.31.0", "0.32.0", "0.33.0"))
    assert unmatched["0.29.0"]["1"][0] is None
    # Kimi-K2 shapes on Blackwell: Marlin unless FlashInfer's int4 MoE is switched on
    assert PINS["kimi_sm100"]["0.33.0"]["8"] == [None, "marlin"]
    assert PINS["kimi_sm100_flashinfer"]["0.33.0"]["8"] == [None, "flashinfer_trtllm"]
