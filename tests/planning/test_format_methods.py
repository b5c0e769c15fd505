"""GPTQ and AWQ MoE layers: the method, backend and verdict vLLM's own code gives them
(checked against each release's code by tests/conformance/test_vllm_conformance.py)."""

from __future__ import annotations

from tests.conformance import format_cases
from wna16ctl.planning.moe import plan_layer

QWEN3 = format_cases.REAL["Qwen3-30B-A3B-GPTQ-Int4"]


def _qwen3_plan(tp: int, version: str, gpu: str = "sm90", **raw):
    case = format_cases.case(dict(QWEN3["raw"], **raw), QWEN3["hidden_size"], QWEN3["intermediate_size"],
                             QWEN3["num_experts"], tp, gpu)
    return plan_layer(format_cases.layer_of(case), tp, False, version, gpu)


def test_qwen3_gptq_at_tp4_falls_back_to_moe_wna16():
    # I 768 / 4 = 192 is not a multiple of group 128: the Marlin gate refuses, AutoGPTQConfig
    # builds MoeWNA16Method, and the oracle picks Triton (0.27.1, and 0.33.0 on an A100) or
    # Humming (0.33.0 on an H100: Humming ahead of Marlin on sm90)
    for version, gpu, backend in (("0.27.1", "sm90", "triton"), ("0.33.0", "sm80", "triton"),
                                  ("0.33.0", "sm90", "humming")):
        p = _qwen3_plan(4, version, gpu)
        assert p.loadable, (version, p.errors)
        assert p.method == {"class": "MoeWNA16Method", "name": "moe_wna16",
                            "fallback_reason": "intermediate size per partition 192 is not a multiple of group_size 128"}
        assert p.backend.value == backend, (version, gpu)
        assert p.rejected["marlin"] == "the MoeWNA16 checkpoint layout is not supported"
        assert p.w2.to_json() == {"load_full_w2": False, "w2_scales_size": 192, "is_k_full": True}
        assert any("falls back to the MoeWNA16 method" in h for h in p.hazards)


def test_qwen3_gptq_at_tp2_is_gptq_marlin():
    p = _qwen3_plan(2, "0.27.1", "sm80")
    assert p.loadable and p.method["class"] == "AutoGPTQMoEMethod" and p.backend.value == "marlin"
    # GPTQ and AWQ methods claim expert bias: the oracle turns Triton and TRT-LLM away
    assert p.rejected["triton"] == "expert bias is not supported"
    assert p.rejected["flashinfer_trtllm"] == "zero points and bias are not supported"
    assert p.padded_intermediate == 384


def test_gptq_act_order_per_release():
    # 0.27-0.29 load act-order on Marlin with the w2 scales whole; on the MoeWNA16 fallback its
    # g_idx is skipped (a correctness hazard); 0.30+ refuse it when parsing the config
    p = _qwen3_plan(2, "0.27.1", "sm80", desc_act=True)
    assert p.loadable and p.w2.to_json() == {"load_full_w2": True, "w2_scales_size": 768, "is_k_full": False}
    p = _qwen3_plan(4, "0.27.1", "sm80", desc_act=True)
    assert p.failure_stage == "load" and "skips the g_idx tensors" in p.errors[0]
    p = _qwen3_plan(1, "0.33.0", "sm80", desc_act=True)
    assert p.failure_stage == "config" and "desc_act=True) is no longer supported" in p.errors[0]


def test_gptq_asymmetric_and_awq_channelwise_are_refused():
    p = _qwen3_plan(1, "0.33.0", sym=False)
    assert p.failure_stage == "config" and p.errors == ["Unsupported quantization config: bits=4, sym=False"]
    awq = format_cases.REAL["DeepSeek-R1-AWQ"]
    case = format_cases.case(dict(awq["raw"], group_size=-1), 2048, 768, 8, 1, "sm80")
    p = plan_layer(format_cases.layer_of(case), 1, False, "0.27.1", "sm80")
    assert p.failure_stage == "create_weights" and "negative dimension -2048" in p.errors[0]


def _auto_round_plan(tp: int, version: str, gpu: str = "sm80", **raw):
    real = format_cases.REAL["AutoRound auto_round:auto_gptq sym4 g128"]
    case = format_cases.case(dict(real["raw"], **raw), real["hidden_size"], real["intermediate_size"],
                             real["num_experts"], tp, gpu)
    return plan_layer(format_cases.layer_of(case), tp, False, version, gpu)


def test_auto_round_routes_by_packing_format_to_gptq_or_awq_marlin():
    # INCConfig: "gptq" in packing_format -> the GPTQ Marlin MoE method; auto_round:auto_awq -> AWQ's
    p = _auto_round_plan(2, "0.27.1")
    assert p.loadable and p.method["class"] == "AutoGPTQMoEMethod" and p.backend.value == "marlin"
    p = _auto_round_plan(2, "0.33.0", packing_format="auto_round:auto_awq", sym=False)
    assert p.loadable and p.method["class"] == "AutoAWQMoEMethod" and p.backend.value == "marlin"
    # I 768 / 4 = 192 is not a multiple of 128: the Marlin gate refuses, MoeWNA16 from the layer's config
    p = _auto_round_plan(4, "0.33.0")
    assert p.loadable and p.method["class"] == "MoeWNA16Method" and p.backend.value == "triton"


def test_auto_round_refusals_per_release():
    # 8-bit AWQ-packed experts that the gate takes: AutoAWQConfig refuses 8 bits
    p = _auto_round_plan(1, "0.33.0", packing_format="auto_round:auto_awq", bits=8)
    assert p.failure_stage == "method" and p.errors[0].startswith("Unsupported num_bits = 8")
    # 3-bit: MoeWNA16 refuses it until 0.30; since then INC sends it to the Humming method
    p = _auto_round_plan(1, "0.29.0", bits=3)
    assert p.failure_stage == "method" and p.errors == ["MoeWNA16Method only supports int4 and int8 now."]
    p = _auto_round_plan(1, "0.30.0", bits=3)
    assert p.failure_stage == "method" and p.method["class"] == "HummingMoEMethod"
    # only the exact "auto-round" is taken over by INCConfig; sym is required before 0.29
    p = _auto_round_plan(1, "0.33.0", quant_method="intel/auto-round")
    assert p.failure_stage == "config" and "intel/auto-round" in p.errors[0]
    raw = {k: v for k, v in format_cases.REAL["AutoRound auto_round:auto_gptq sym4 g128"]["raw"].items() if k != "sym"}
    case = format_cases.case(raw, 2048, 768, 128, 1, "sm80")
    assert plan_layer(format_cases.layer_of(case), 1, False, "0.28.0", "sm80").failure_stage == "config"
    assert plan_layer(format_cases.layer_of(case), 1, False, "0.29.0", "sm80").loadable
    # an extra_config entry of 16 bits named exactly the experts layer: UnquantizedFusedMoEMethod
    p = _auto_round_plan(1, "0.33.0", extra_config={"model.layers.0.mlp.experts": {"bits": 16}})
    assert p.failure_stage == "load" and p.method["class"] == "UnquantizedFusedMoEMethod"


def _linear_plans(tmp_path, raw, form: str, version: str = "0.33.0") -> dict[tuple[str, int], dict]:
    """inspect --json of a header-only Qwen1.5-MoE-shaped checkpoint (shared expert I 5632) at TP 4/8."""
    import json
    import os
    import subprocess
    import sys

    from tests import modelckpt
    from tests.sources.qweight_ckpt import header_only

    ck = header_only(tmp_path / form, modelckpt.qwen15_moe_a27b(layers=1), dict(raw), form=form)
    out = subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(ck), "--tp", "4,8", "--vllm", version,
                          "--gpu", "sm90", "--json"], capture_output=True, text=True, env=dict(os.environ))
    doc = json.loads(out.stdout)
    return {(lay["name"].rpartition("layers.0.")[2], p["tp"]): p for lay in doc["linear_layers"] for p in lay["plans"]}


def test_gptq_linear_group_straddling_ranks_is_a_correctness_hazard(tmp_path):
    # shared_expert.down_proj K 5632 at TP 8: 704 rows per rank, 5.5 groups of 128.  AutoGPTQLinearMethod
    # has no straddle check: Machete takes it and create_weights floors the scale rows to 5
    plans = _linear_plans(tmp_path, format_cases._QWEN_GPTQ, "gptq")
    ok, bad = plans[("mlp.shared_expert.down_proj", 4)], plans[("mlp.shared_expert.down_proj", 8)]
    assert ok["loadable"] and ok["method"] == "AutoGPTQLinearMethod" and ok["kernel"] == "MacheteLinearKernel"
    assert not bad["loadable"] and bad["failure_rule"] == "wrong scale groups"
    assert bad["method"] == "AutoGPTQLinearMethod" and bad["kernel"] == "MacheteLinearKernel"
    assert "makes 5 scale row(s)" in bad["errors"][0] and "vLLM 0.33.0" in bad["errors"][0]
    assert plans[("self_attn.qkv_proj", 8)]["loadable"]


def test_awq_linear_group_straddling_ranks_falls_back_and_is_refused(tmp_path):
    # the AWQ config's Marlin gate turns the same shape away: AutoAWQLinearMethod refuses it
    plans = _linear_plans(tmp_path, format_cases._AWQ, "awq")
    assert plans[("mlp.shared_expert.down_proj", 4)]["method"] == "AutoAWQMarlinLinearMethod"
    bad = plans[("mlp.shared_expert.down_proj", 8)]
    assert bad["method"] == "AutoAWQLinearMethod" and bad["failure_stage"] == "create_weights"
    assert bad["errors"][0].startswith("The input size is not aligned with the quantized weight shape")
