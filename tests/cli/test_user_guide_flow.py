"""The user guide's fix for "it won't load at my TP size", command after command, on a checkpoint of
the usual llm-compressor W4A16 recipe (every Linear but lm_head and the routers quantized, attention
included): inspect refuses TP 2, pad fixes it, verify proves the padding, repack writes the padded
checkpoint's TP 2 layout and verify proves that too."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.conftest import QUESTIONS
from wna16ctl.cli import cli

# I = 128 with groups of 128 does not split over 2 ranks; o_proj's input (256) does
STANDARD = dict(targets="linear", hidden_size=256, intermediate_size=128, num_experts=4, num_layers=1, num_shards=1)
RELEASE = ["--vllm", "0.32.0"]  # 0.27.0-0.31.0 compute the padded layer wrongly at TP 2 (vLLM #50196)
SAMPLES = ["--samples", str(QUESTIONS), "--num-samples", "4"]


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_inspect_pad_verify_repack_verify_on_the_usual_recipe(make_ckpt, tmp_path):
    ckpt = make_ckpt(**STANDARD)
    quantized = json.loads((ckpt / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["targets"] for g in quantized.values()] == [["Linear"]]

    # 1. the refusal, with the rule
    res = invoke("inspect", ckpt, "--tp", "2", *RELEASE)
    assert res.exit_code == 1, res.output
    assert "summary: loads at no requested TP size; TP 2 needs --ep (I_p % group without it)" in res.stdout

    # 3. pad (2., --suggest, is the guide's list of fixes)
    padded = tmp_path / "padded"
    res = invoke("pad", ckpt, "--tp", "2", *RELEASE, "-o", padded)
    assert res.exit_code == 0, res.output
    assert "moe_intermediate_size: 128 -> 256" in res.stdout

    # 4. prove it: the attention is the original's, byte for byte; the experts' numerics ran and passed
    res = invoke("verify", ckpt, padded, *SAMPLES)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith(("FAIL", "NOT RUN", "PARTIAL"))], res.stdout
    assert any(ln.startswith("PASS tensors: ") for ln in lines)
    assert any(ln.startswith("PASS numerics model.layers.0.mlp.experts: padded at TP 2") for ln in lines)
    proven = " ".join(res.stdout.replace("\\\n", " ").split())

    # the padded checkpoint loads at TP 2, attention included, and verify named the serve path inspect gives it
    res = invoke("inspect", padded, "--tp", "2", *RELEASE)
    assert res.exit_code == 0 and "summary: loads at TP 2" in res.stdout, res.output
    (step,) = json.loads(invoke("inspect", padded, "--tp", "2", *RELEASE, "--json").stdout)["next_steps"]
    assert step["serve"].startswith("vllm serve ") and step["serve"] in proven, (step, proven)

    # 5. or repack it first, and verify that
    out = tmp_path / "tp2"
    res = invoke("repack", padded, "--tp", "2", *RELEASE, "-o", out)
    assert res.exit_code == 0, res.output
    res = invoke("verify", padded, out, *SAMPLES)
    assert res.exit_code == 0, res.output
    assert "verdict: verified" in res.stdout
