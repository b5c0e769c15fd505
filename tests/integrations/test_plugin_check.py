"""The GPU check of the load format `wna16ctl` (wna16ctl/integrations/plugin_check.py), as far as
it runs without a GPU: it reports "not run" with its reason, and its verdict on two runs."""

from __future__ import annotations

import sys

import pytest
import torch

from wna16ctl.integrations import plugin_check
from wna16ctl.native import gpucheck


def _run(tokens, lps):
    return {"tokens": tokens, "logprobs": [[{str(t): lp for t, lp in step.items()} for step in p] for p in lps]}


def test_the_verdict_on_two_runs():
    ref = _run([[5, 6]], [[{5: -0.1, 7: -2.0}, {6: -0.3}]])
    assert plugin_check.compare_plugin_runs(ref, ref)["ok"]
    close = _run([[5, 6]], [[{5: -0.1 + 1e-3, 7: -2.0}, {6: -0.3}]])
    assert plugin_check.compare_plugin_runs(ref, close)["ok"]
    far = _run([[5, 6]], [[{5: -0.2, 7: -2.0}, {6: -0.3}]])
    verdict = plugin_check.compare_plugin_runs(ref, far)
    assert not verdict["ok"] and verdict["max_logprob_diff"] == pytest.approx(0.1)
    other_token = _run([[5, 8]], [[{5: -0.1, 7: -2.0}, {6: -0.3}]])
    assert not plugin_check.compare_plugin_runs(ref, other_token)["ok"]
    assert not plugin_check.compare_plugin_runs(ref, {"tokens": [[5, 6]], "logprobs": []})["ok"]  # nothing compared


def test_without_vllm_the_reason_names_the_python(monkeypatch):
    monkeypatch.setenv("WNA16CTL_VLLM_PYTHON", sys.executable)
    python, why = plugin_check.find_vllm_python()
    if python is not None:
        pytest.skip("vLLM imports in this python")
    assert sys.executable in why and "wna16ctl[vllm]" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_the_check_is_not_run(tmp_path):
    assert plugin_check.check(300, tmp_path) == {"not_run": "no CUDA GPU (torch sees none)"}
    assert plugin_check.main(["--out", str(tmp_path / "r.json")]) == 2
    report = {"status": "not-run", "vllm_plugin": {"not_run": "no CUDA GPU (torch sees none)"}}
    assert "--load-format wna16ctl vs default load: not run (no CUDA GPU" in gpucheck.summary(report)
