"""`inspect --json` of header-only copies of the published GPTQ and AWQ MoE checkpoints of the
conformance cases (tests/conformance/format_cases.py REAL) gives every MoE layer the method,
backend and verdict the planner gives those cases, which the conformance tier checks against each
release's own code: the reader, the scheme it resolves and the command agree with the checked path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import modelckpt
from tests.conformance import format_cases
from tests.sources.qweight_ckpt import header_only
from wna16ctl.planning.moe import plan_layer

TPS = (1, 2, 4, 8)
RELEASES = ("0.27.1", "0.33.0")
GPU = "sm90"


def _mixtral_7bx2() -> dict:
    return dict(modelckpt.mixtral_8x7b(layers=1), num_local_experts=2)


# REAL name -> (the published config's family, its stored form, modules it leaves in float)
CHECKPOINTS = {
    "Qwen3-30B-A3B-GPTQ-Int4": (lambda: modelckpt.qwen3_30b_a3b(layers=1), "gptq", None),
    "Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4": (lambda: modelckpt.qwen15_moe_a27b(layers=1), "gptq", None),
    "DeepSeek-R1-AWQ": (lambda: modelckpt.deepseek_v3_671b(layers=4, dense=3), "awq", r"self_attn\.kv_a_proj_with_mqa$"),
    "Mixtral_7Bx2_MoE-AWQ": (_mixtral_7bx2, "awq", None),
}
FAMILIES = {"Mixtral_7Bx2_MoE-AWQ": modelckpt.mixtral, "DeepSeek-R1-AWQ": modelckpt.deepseek_v3}


def _conformance_plan(name: str, tp: int, vllm: str) -> tuple:
    real = format_cases.REAL[name]
    case = format_cases.case(real["raw"], real["hidden_size"], real["intermediate_size"], real["num_experts"], tp, GPU)
    p = plan_layer(format_cases.layer_of(case), tp, False, vllm, GPU)
    return p.method["class"], p.method["name"], p.backend.value if p.backend else None, p.loadable


def _inspected(ck: Path, vllm: str) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(ck), "--tp", ",".join(map(str, TPS)),
                        "--vllm", vllm, "--gpu", GPU, "--json"], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)["layers"]


@pytest.mark.parametrize("vllm", RELEASES)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_inspect_of_a_published_gptq_or_awq_checkpoint_agrees_with_its_conformance_case(tmp_path, name, vllm):
    config, form, keep = CHECKPOINTS[name]
    real = format_cases.REAL[name]
    ck = header_only(tmp_path / "ck", config(), dict(real["raw"]), form=form, keep=keep,
                     family=FAMILIES.get(name, modelckpt.qwen3_moe))
    layers = _inspected(ck, vllm)
    assert layers
    for layer in layers:
        assert (layer["hidden_size"], layer["intermediate_size"], layer["num_experts"]) == \
            (real["hidden_size"], real["intermediate_size"], real["num_experts"]), layer["name"]
        got = {p["tp"]: (p["method"]["class"], p["method"]["name"], p["backend"], p["loadable"]) for p in layer["plans"]}
        want = {tp: _conformance_plan(name, tp, vllm) for tp in TPS}
        assert got == want, (layer["name"], vllm)
