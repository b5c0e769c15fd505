"""The model around the experts: quantized linear layers, engine-level TP checks, MTP layers,
nested text configs and the legacy `compression_config` key, on header-only checkpoints at real
per-layer sizes (tests/modelckpt.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import modelckpt as m
from wna16ctl.planning import rules
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.model import COLUMN, ROW, VOCAB, LinearLayer, LinearShard
from wna16ctl.cli import cli
from wna16ctl.planning.inspection import inspect_checkpoint
from wna16ctl.planning.linear import (
    ALLSPARK, HUMMING, MACHETE, MARLIN, kernel_priority, model_checks, plan_linear,
)
from wna16ctl.sources.model import ModelDims


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")

    def kimi(c, q):
        return m.deepseek_v3(c["text_config"], q, "language_model.model", "language_model.lm_head")

    straddle = m.qwen3_30b_a3b(layers=1)
    straddle.update(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=80, num_experts=8)
    no_gate_ignore = m.qwen15_moe_a27b(layers=1)
    no_gate_ignore["quantization_config"] = m.w4a16(["lm_head"])
    router_q = m.qwen3_30b_a3b(layers=1)
    router_q["quantization_config"] = m.w4a16(["lm_head"])
    legacy = m.qwen3_30b_a3b(layers=1)
    legacy["compression_config"] = legacy.pop("quantization_config")
    specs = {
        "qwen3": (m.qwen3_30b_a3b(), m.qwen3_moe),
        "qwen35": (m.qwen35_35b_a3b(), m.qwen3_5_moe),
        "mixtral": (m.mixtral_8x7b(), m.mixtral),
        "dsv3": (m.deepseek_v3_671b(), m.deepseek_v3),
        "kimi25": (m.kimi_k25(), kimi),
        "glm45": (m.glm45_air(), m.glm4_moe),
        "qwen2moe": (m.qwen15_moe_a27b(), m.qwen3_moe),
        "straddle": (straddle, m.qwen3_moe),
        "gate_quantized": (no_gate_ignore, m.qwen3_moe),
        "gate_quantized_qwen3": (router_q, m.qwen3_moe),
        "legacy": (legacy, m.qwen3_moe),
    }
    out = {}
    for name, (config, family) in specs.items():
        q = config.get("quantization_config") or config.get("compression_config")
        out[name] = m.write(root / name, config, family(config, q), shards=2 if name == "dsv3" else 1)
    return out


def _doc(path: Path, tps=(1, 2, 4, 8), vllm="0.33.0", gpu="sm90") -> dict:
    return inspect_checkpoint(path, tps, vllm=vllm, gpu=gpu).to_json()


def _linear(doc: dict, name_end: str) -> list[dict]:
    return [lay for lay in doc["linear_layers"] if lay["name"].endswith(name_end)]


def _plan(lay: dict, tp: int) -> dict:
    return next(p for p in lay["plans"] if p["tp"] == tp)


# -- Qwen3.5: linear attention's 32-output projections, MTP, text_config ---------------------------
def test_qwen35_in_proj_ba_at_tp2_on_0_33_0(ckpts):
    doc = _doc(ckpts["qwen35"])
    ba = _linear(doc, "layers.0.linear_attn.in_proj_ba")[0]
    # in_proj_b and in_proj_a (32 outputs each) are one MergedColumnParallelLinear in vLLM:
    # 16 + 16 = 32 output features per rank at TP 2
    assert ba["modules"] == ["model.language_model.layers.0.linear_attn.in_proj_b",
                             "model.language_model.layers.0.linear_attn.in_proj_a"]
    assert ba["tp_role"] == "column" and ba["output_sizes"] == [32, 32]
    p = _plan(ba, 2)
    assert (p["k"], p["n"], p["vllm"], p["gpu"]) == (2048, 32, "0.33.0", "sm90")
    # Machete needs N % 128 on Hopper; 0.33.0 ranks Humming ahead of Marlin on sm90 and Humming takes it
    assert p["rejected"][MACHETE] == "Output features size must be divisible by 128"
    assert p["rejected"]["CutlassW4A8LinearKernel"] == "CUTLASS W4A8 only supports FP8 (e4m3) activations"
    assert p["kernel"] == HUMMING and p["loadable"] and p["errors"] == []
    assert p["rejected"][MARLIN] == f"lower priority than {HUMMING}"
    # releases before 0.32.0 put Marlin first: it pads N 32 -> 64 (a hazard, not an error)
    assert "vLLM 0.27.0–0.31.0: loads on MarlinLinearKernel (Marlin tile padding to (N, K) = (64, 2048))" in p["hazards"]


def test_qwen35_in_proj_ba_marlin_pads_on_ampere(ckpts):
    doc = _doc(ckpts["qwen35"], tps=(2, 4), gpu="sm80")
    ba = _linear(doc, "layers.0.linear_attn.in_proj_ba")[0]
    for tp, n in ((2, 32), (4, 16)):
        p = _plan(ba, tp)
        assert p["kernel"] == MARLIN and p["n"] == n and p["marlin_padded_nk"] == [64, 2048]
        assert p["rejected"][MACHETE].startswith(f"{MACHETE} requires capability 90")
        assert any("pads this layer's per-rank (N, K)" in h for h in p["hazards"])


def test_qwen35_whole_model_verdict_and_shared_expert_straddle(ckpts):
    doc = _doc(ckpts["qwen35"])
    assert doc["architecture"] == "Qwen3_5MoeForConditionalGeneration" and doc["model_type"] == "qwen3_5_moe"
    # the decoder's MoE layers only (MTP apart), each index once
    assert [lay["layer_index"] for lay in doc["layers"]] == [0, 1, 2, 3]
    assert [x["name"] for x in doc["mtp_layers"]] == ["mtp.layers.0.mlp.experts"]
    assert not any(lay["name"].startswith("mtp.") for lay in doc["linear_layers"])
    kinds = {lay["kind"] for lay in doc["linear_layers"]}
    assert {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.qkv_proj",
            "self_attn.o_proj", "shared_expert.gate_up_proj", "shared_expert.down_proj"} == kinds
    down3 = _linear(doc, "layers.3.mlp.shared_expert.down_proj")[0]
    p8 = _plan(down3, 8)
    assert p8["k"] == 64 and p8["kernel"] == MACHETE and not p8["loadable"]
    assert p8["errors"] == [
        "Weight input_size_per_partition=64 for layer 'model.language_model.layers.3.mlp.shared_expert.down_proj' is "
        "not divisible by group_size=128. This happens when tensor_parallel_size splits the layer input into shards "
        "that are not a whole number of quant groups. Consider reducing tensor_parallel_size."]
    # gated full attention: q_proj holds query and gate heads (2 x 16 x 256); 2 KV heads replicated at TP 8
    qkv = _linear(doc, "layers.3.self_attn.qkv_proj")[0]
    assert qkv["output_sizes"] == [8192, 512, 512]
    assert _plan(qkv, 8)["n"] == (32 // 8) * 256 + 2 * 256
    assert not doc["loadable"]


def test_qwen35_cli_exit_code_and_table(ckpts):
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["qwen35"]), "--tp", "2", "--vllm", "0.33.0"])
    assert res.exit_code == 0, res.output
    assert "quantized linear layers per TP size" in res.output
    assert "linear_attn.in_proj_ba" in res.output and "MTP layer mtp.layers.0.mlp.experts" in res.output
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["qwen35"]), "--tp", "8", "--vllm", "0.33.0", "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["loadable"] is False


# -- attention whose group straddles two ranks ----------------------------------------------------
def test_attention_group_straddles_at_tp8(ckpts):
    doc = _doc(ckpts["straddle"], tps=(4, 8))
    o = _linear(doc, "self_attn.o_proj")[0]
    assert _plan(o, 4)["loadable"] and _plan(o, 4)["k"] == 640
    p = _plan(o, 8)
    assert p["k"] == 320 and p["kernel"] == MACHETE and p["failure_stage"] == "create_weights"
    assert p["errors"][0].startswith("Weight input_size_per_partition=320 for layer 'model.layers.0.self_attn.o_proj' "
                                     "is not divisible by group_size=128.")
    ampere = _plan(_linear(_doc(ckpts["straddle"], tps=(8,), gpu="sm80"), "self_attn.o_proj")[0], 8)
    assert ampere["rejected"][MARLIN] == "in_features per partition 320 is not divisible by group_size = 128."
    assert ampere["rejected"]["TritonW4A16LinearKernel"] == "Input features 320 not divisible by group size 128"
    assert ampere["kernel"] == HUMMING and not ampere["loadable"]
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["straddle"]), "--tp", "8", "--vllm", "0.33.0"])
    assert res.exit_code == 1 and "o_proj" in res.output


# -- DeepSeek-V3 / Kimi-K2.5: MLA, dense layers, shared experts, MTP, nested text_config --------------
def test_deepseek_v3_mla_roles(ckpts):
    doc = _doc(ckpts["dsv3"])
    assert [lay["layer_index"] for lay in doc["layers"]] == [3, 4]
    assert [x["name"] for x in doc["mtp_layers"]] == ["model.layers.5.mlp.experts"]
    assert all(lay["layer_index"] < 5 for lay in doc["linear_layers"])
    by_kind = {lay["kind"]: lay for lay in doc["linear_layers"]}
    a = by_kind["self_attn.fused_qkv_a_proj"]
    assert a["tp_role"] == "replicated" and a["output_sizes"] == [1536, 576]
    assert {(p["k"], p["n"]) for p in a["plans"]} == {(7168, 2112)}
    assert _plan(a, 8)["rejected"][MACHETE] == "Output features size must be divisible by 128"
    assert by_kind["self_attn.q_b_proj"]["tp_role"] == COLUMN and _plan(by_kind["self_attn.q_b_proj"], 8)["n"] == 24576 // 8
    assert _plan(by_kind["self_attn.kv_b_proj"], 8)["n"] == 32768 // 8
    assert by_kind["self_attn.o_proj"]["tp_role"] == ROW and _plan(by_kind["self_attn.o_proj"], 8)["k"] == 16384 // 8
    dense = [lay["layer_index"] for lay in doc["linear_layers"] if lay["kind"] == "mlp.gate_up_proj"]
    assert dense == [0, 1, 2]
    shared = [lay["layer_index"] for lay in doc["linear_layers"] if lay["kind"] == "shared_experts.down_proj"]
    assert shared == [3, 4]
    assert doc["loadable"] is True


def test_kimi_k25_nested_text_config(ckpts):
    doc = _doc(ckpts["kimi25"], tps=(8,))
    assert doc["architecture"] == "KimiK25ForConditionalGeneration" and doc["model_type"] == "kimi_k25"
    assert [lay["name"] for lay in doc["layers"]] == ["language_model.model.layers.1.mlp.experts"]
    assert doc["layers"][0]["hidden_size"] == 7168 and doc["layers"][0]["num_experts"] == 384
    assert doc["linear_layers"] == []  # this recipe quantizes the routed experts only
    rules_seen = {c["rule"] for c in doc["model_checks"]}
    assert {"attention heads % TP", "vocabulary % TP"} <= rules_seen and "KV heads" not in rules_seen  # MLA


# -- GLM-4.5 and Qwen2-MoE: MTP layer, shared experts --------------------------------------------------
def test_glm45_mtp_layer_and_shared_expert(ckpts):
    doc = _doc(ckpts["glm45"], tps=(2, 8))
    assert [lay["layer_index"] for lay in doc["layers"]] == [1]
    assert [x["name"] for x in doc["mtp_layers"]] == ["model.layers.2.mlp.experts"]
    down = _linear(doc, "layers.1.mlp.shared_experts.down_proj")[0]
    assert _plan(down, 8)["k"] == 176 and not _plan(down, 8)["loadable"]
    assert _plan(down, 8)["errors"][0].startswith("Weight input_size_per_partition=176")


def test_qwen2_moe_shared_expert_and_gate(ckpts):
    doc = _doc(ckpts["qwen2moe"], tps=(4, 8))
    down = _linear(doc, "layers.0.mlp.shared_expert.down_proj")[0]
    assert _plan(down, 4)["loadable"] and _plan(down, 8)["k"] == 704 and not _plan(down, 8)["loadable"]
    assert not _linear(doc, "shared_expert_gate")  # ignored by the recipe
    bad = _doc(ckpts["gate_quantized"], tps=(1,))
    gate = _linear(bad, "layers.0.mlp.shared_expert_gate")[0]
    p = _plan(gate, 1)
    assert not p["loadable"] and p["failure_rule"] == "built unquantized"
    assert "builds the shared-expert gate unquantized" in p["errors"][0]
    assert bad["loadable"] is False
    assert "builds the MoE router unquantized" in _plan(_linear(bad, "layers.0.mlp.gate")[0], 1)["errors"][0]


def test_qwen3_moe_router_takes_the_quant_config(ckpts):
    doc = _doc(ckpts["gate_quantized_qwen3"], tps=(8,))
    gate = _linear(doc, "layers.0.mlp.gate")[0]
    p = _plan(gate, 8)
    assert gate["tp_role"] == "replicated" and (p["k"], p["n"]) == (2048, 128) and p["loadable"]


# -- Mixtral channel-wise, engine-level checks -------------------------------------------------------
def test_mixtral_channel_wise_row_parallel_repeats_scales(ckpts):
    doc = _doc(ckpts["mixtral"], tps=(8,))
    o = _linear(doc, "layers.0.self_attn.o_proj")[0]
    assert o["scheme"]["group_size"] == -1 and _plan(o, 8)["k"] == 512 and _plan(o, 8)["loadable"]
    assert _plan(_linear(doc, "layers.0.self_attn.qkv_proj")[0], 8)["n"] == (32 // 8 + 2) * 128


def test_attention_heads_not_divisible_refuses_before_weights(ckpts):
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["mixtral"]), "--tp", "3", "--vllm", "0.33.0", "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    bad = [c for c in doc["model_checks"] if not c["ok"]]
    assert bad[0]["error"] == "Total number of attention heads (32) must be divisible by tensor parallel size (3)."
    assert doc["loadable"] is False


def test_model_checks_kv_vocab_experts():
    dims = ModelDims("qwen3_moe", None, 48, 32, 4, 128, 151936, 128, False, None, None, None, None, None)
    checks = {c.rule: c for c in model_checks(dims, 8, False)}
    assert checks["KV heads"].ok and "replicated" in checks["KV heads"].detail
    assert checks["vocabulary % TP"].ok and checks["TP <= experts"].ok
    few = ModelDims("qwen3_moe", None, 2, 16, 16, 128, 1000, 4, False, None, None, None, None, None)
    checks = {c.rule: c for c in model_checks(few, 16, True)}
    assert checks["TP <= experts"].error == "Tensor parallel size 16 is greater than the number of experts 4."
    assert checks["vocabulary % TP"].ok  # 1000 pads to 1024
    assert not checks["experts % EP (EPLB)"].fatal and checks["experts % EP (EPLB)"].ok is False
    checks = {c.rule: c for c in model_checks(dims, 3, False)}
    assert checks["vocabulary % TP"].error == "AssertionError: 151936 is not divisible by 3"
    assert checks["KV heads"].error == "AssertionError: 4 is not divisible by 3"
    assert checks["attention heads % TP"].error.startswith("Total number of attention heads (32)")


def test_quantized_lm_head_shards_the_padded_vocabulary():
    s = WeightScheme(4, 128, True, "group", None, "pack-quantized")
    head = LinearLayer(name="lm_head", kind="lm_head", layer_index=None, tp_role=VOCAB, input_size=2048,
                       shards=[LinearShard("lm_head", (151900,), s)])
    p = plan_linear(head, 8, "0.33.0", "sm90")
    assert (p.k, p.n) == (2048, 151936 // 8)  # 151900 pads to 151936
    assert p.rejected[MACHETE] == "Output features size must be divisible by 128" and p.kernel == HUMMING


# -- compression_config -----------------------------------------------------------------------------
def test_compression_config_is_read(ckpts):
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["legacy"]), "--tp", "1", "--vllm", "0.33.0", "--json"])
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.stdout)
    assert doc["layers"][0]["scheme"]["num_bits"] == 4 and doc["quantization"]["format"] == "pack-quantized"
    assert doc["linear_layers"]


def test_plans_reused_across_layers_name_their_own_layer(ckpts):
    doc = _doc(ckpts["qwen35"], tps=(8,))
    for lay in _linear(doc, "shared_expert.down_proj"):
        err = _plan(lay, 8)["errors"][0]
        assert f"'{lay['name']}'" in err


# -- the rulebook's linear kernels by release ---------------------------------------------------------
def test_kernel_priority_by_release():
    assert ALLSPARK in kernel_priority(rules.release("0.30.0"), "sm80")
    assert ALLSPARK not in kernel_priority(rules.release("0.31.0"), "sm80")
    hopper = kernel_priority(rules.release("0.32.0"), "sm90")
    assert hopper.index(HUMMING) == hopper.index(MARLIN) - 1
    ampere = kernel_priority(rules.release("0.32.0"), "sm80")
    assert ampere[-1] == HUMMING
    old = kernel_priority(rules.release("0.31.0"), "sm90")
    assert old[-1] == HUMMING


def _row_layer(k: int, n: int, scheme: WeightScheme) -> LinearLayer:
    return LinearLayer(name="model.layers.0.self_attn.o_proj", kind="self_attn.o_proj", layer_index=0, tp_role=ROW,
                       input_size=k, shards=[LinearShard("model.layers.0.self_attn.o_proj", (n,), scheme)])


def test_act_order_linear_by_release():
    s = WeightScheme(4, 128, True, "group", "group", "pack-quantized")
    lay = _row_layer(4096, 4096, s)
    p = plan_linear(lay, 2, "0.29.0", "sm90")
    assert p.rejected[MACHETE].startswith("Act reordering currently not supported by Machete")
    assert p.kernel == MARLIN and p.loadable and p.padded_nk is None
    p = plan_linear(_row_layer(4096, 96, s), 2, "0.29.0", "sm90")  # strict Marlin shape: N 96 % 64
    assert p.rejected[MARLIN].startswith("Weight output_size_per_partition = 96 is not divisible by  min_thread_n = 64.")
    assert p.failure_rule == "no kernel"
    assert re.match(r"Failed to find a kernel that can implement the WNA16 linear layer\. Reasons: \n", p.errors[0])
    p = plan_linear(lay, 2, "0.30.0", "sm90")
    assert p.failure_stage == "config" and "no longer supported" in p.errors[0]
    dynamic = WeightScheme(4, 128, True, "group", "dynamic", "pack-quantized")
    # 'dynamic' is act-order as well for the linear scheme of 0.27-0.29 (its has_g_idx compares with the
    # enum member, whose alias-aware equality takes 'dynamic'): Machete refuses the row-split K, Marlin
    # takes the layer, and nothing is wrong with the checkpoint
    for version in ("0.27.1", "0.29.0"):
        p = plan_linear(_row_layer(4096, 4096, dynamic), 2, version, "sm90")
        assert p.rejected[MACHETE].startswith("Act reordering currently not supported by Machete")
        assert p.kernel == MARLIN and p.loadable and not p.hazards, p
    assert plan_linear(_row_layer(4096, 4096, dynamic), 1, "0.29.0", "sm90").kernel == MACHETE  # whole K


def test_zero_point_marlin_and_int8():
    asym = WeightScheme(4, 128, False, "group", None, "pack-quantized")
    p = plan_linear(_row_layer(4096, 4096, asym), 2, "0.33.0", "sm80")
    assert p.kernel == MARLIN  # uint4 with zero points
    int8 = WeightScheme(8, 128, False, "group", None, "pack-quantized")
    p = plan_linear(_row_layer(4096, 4096, int8), 2, "0.31.0", "sm80")
    assert p.rejected[MARLIN].startswith("Quant type (uint8) not supported by  Marlin")
    assert p.kernel == HUMMING


def test_release_matrix_covers_linear_layers(ckpts):
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["straddle"]), "--tp", "4,8", "--vllm", "all"])
    assert res.exit_code == 1, res.output
    assert "self_attn.o_proj (row)" in res.output and "✗ K/rank % group" in res.output
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["straddle"]), "--tp", "8", "--vllm", "all", "--json"])
    doc = json.loads(res.stdout)
    by_release = {v["vllm"]: v for v in doc["versions"]}
    o = next(lay for lay in by_release["0.31.0"]["linear_layers"] if lay["kind"] == "self_attn.o_proj")
    assert o["plans"][0]["kernel"] == MACHETE and not o["plans"][0]["loadable"]
    assert not any(v["loadable"] for v in doc["versions"])


def test_vision_tower_modules_are_reported_not_planned(tmp_path):
    c = m.qwen3_30b_a3b(layers=1)
    c["quantization_config"] = m.w4a16(m.RECIPE_IGNORE)
    tensors = list(m.qwen3_moe(c, c["quantization_config"]))
    tensors += list(m._mlp("model.visual.blocks.0.mlp", 1280, 3420, c["quantization_config"]))
    doc = _doc(m.write(tmp_path / "vl", c, iter(tensors)), tps=(2,))
    assert doc["unplaced_linear"] == [f"model.visual.blocks.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    assert not any("visual" in lay["name"] for lay in doc["linear_layers"])


def test_merge_text_config_keeps_the_checkpoints_own_keys():
    from wna16ctl.sources.config import merge_text_config, quantization_config_of

    raw = {"architectures": ["Outer"], "model_type": "outer", "quantization_config": {"a": 1},
           "text_config": {"architectures": ["Inner"], "model_type": "inner", "hidden_size": 8, "vocab_size": 9}}
    merged = merge_text_config(raw)
    assert merged["architectures"] == ["Outer"] and merged["model_type"] == "outer"
    assert merged["hidden_size"] == 8 and merged["vocab_size"] == 9 and merged["text_model_type"] == "inner"
    assert merged["quantization_config"] == {"a": 1}
    assert merge_text_config({"hidden_size": 4, "text_config": {"hidden_size": 8}})["hidden_size"] == 4
    assert quantization_config_of({"compression_config": {"b": 2}}) == {"b": 2}
    assert quantization_config_of({"compression_config": {"b": 2}, "quantization_config": {"a": 1}}) == {"a": 1}
