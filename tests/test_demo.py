"""The demo checkpoints are what compressed-tensors writes, for every option the tests rely on."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import MakeCheckpoint
from wna16ctl.demo import (
    ARCHITECTURES,
    DEEPSEEK_V3_YARN,
    DemoSpec,
    demo_source_weights,
    expert_projection_names,
    library_dequantize,
    moe_layer_indices,
    write_demo_checkpoint,
)

SMALL = dict(hidden_size=128, intermediate_size=128, num_experts=4, vocab_size=320)


def read_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def quantization_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]


def expert_modules(spec: DemoSpec) -> list[str]:
    block = "block_sparse_moe" if spec.arch == "mixtral" else "mlp"
    return [
        f"model.layers.{layer}.{block}.experts.{expert}.{projection}"
        for layer in moe_layer_indices(spec)
        for expert in range(spec.num_experts)
        for projection in expert_projection_names(spec.arch)
    ]


def per_column_scale(tensors: dict[str, torch.Tensor], module: str, cols: int) -> torch.Tensor:
    """[N, K] scale of every weight element (through g_idx when there is one)."""
    scale = tensors[f"{module}.weight_scale"].float()
    if f"{module}.weight_g_idx" in tensors:
        group_of_column = tensors[f"{module}.weight_g_idx"].long()
    else:
        group_of_column = torch.arange(cols) // (cols // scale.shape[1])
    return scale[:, group_of_column]


# ---------------------------------------------------------------------------------------------
# files, names, config


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shards_and_index_cover_every_tensor(make_ckpt: MakeCheckpoint, arch: str) -> None:
    ckpt = make_ckpt(arch=arch)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == shard_names
    stored: dict[str, str] = {}
    total = 0
    for shard in shard_names:
        with safe_open(str(ckpt / shard), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            assert len(list(handle.keys())) > 0
            for name in handle.keys():
                stored[name] = shard
                tensor = handle.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tensor_names_and_dtypes_follow_the_architecture(make_ckpt: MakeCheckpoint, arch: str) -> None:
    spec = DemoSpec(arch=arch)
    tensors = read_tensors(make_ckpt(arch=arch))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        expected |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        if arch in ("deepseek_v3", "kimi_k2"):
            attention = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        elif arch == "deepseek_v2":  # no query LoRA
            attention = ["q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        else:
            attention = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if arch == "qwen3_moe" else [])
        expected |= {f"{prefix}self_attn.{name}.weight" for name in attention}
        if arch in ("qwen2_moe", "glm4_moe"):
            expected |= {f"{prefix}self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
        if layer not in moe_layer_indices(spec):
            expected |= {f"{prefix}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            continue
        expected.add(f"{prefix}{block}.gate.weight")
        if arch == "qwen2_moe":
            expected |= {f"{prefix}mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            expected.add(f"{prefix}mlp.shared_expert_gate.weight")
        if arch in ("deepseek_v3", "deepseek_v2", "kimi_k2", "glm4_moe"):
            expected |= {f"{prefix}mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            if arch != "deepseek_v2":  # greedy softmax routing has no correction bias
                expected.add(f"{prefix}mlp.gate.e_score_correction_bias")
    for module in expert_modules(spec):
        expected |= {f"{module}.{suffix}" for suffix in ("weight_packed", "weight_scale", "weight_shape")}
    assert set(tensors) == expected

    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and tensor.shape == (spec.num_experts,)
        elif not name.endswith(("weight_packed", "weight_shape")):
            assert tensor.dtype == torch.bfloat16, name
    assert tensors[f"model.layers.{moe_layer_indices(spec)[0]}.{block}.gate.weight"].shape == (spec.num_experts, spec.hidden_size)
    norm = tensors["model.norm.weight"].float()
    assert (norm - 1).abs().max() < 0.5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_is_the_real_architecture_plus_the_library_quantization_config(make_ckpt: MakeCheckpoint, arch: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    spec = DemoSpec(arch=arch)
    ckpt = make_ckpt(arch=arch)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["num_hidden_layers"] == spec.num_layers and config["hidden_size"] == spec.hidden_size
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert config["num_experts_per_tok"] == spec.top_k
    expert_count_key = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts", "mixtral": "num_local_experts",
                        "deepseek_v3": "n_routed_experts", "deepseek_v2": "n_routed_experts",
                        "kimi_k2": "n_routed_experts", "glm4_moe": "n_routed_experts"}[arch]
    assert config[expert_count_key] == spec.num_experts
    expert_size_key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
    assert config[expert_size_key] == spec.intermediate_size
    if arch == "qwen3_moe":
        assert config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1 and "head_dim" in config
    if arch == "qwen2_moe":
        assert config["shared_expert_intermediate_size"] > 0
    if arch in ("deepseek_v2", "kimi_k2", "glm4_moe"):
        assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] >= 1
    if arch == "deepseek_v3":
        assert config["first_k_dense_replace"] == 1 and config["scoring_func"] == "sigmoid"
        assert config["num_experts_per_tok"] <= config["topk_group"] * config["n_routed_experts"] // config["n_group"]

    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    raw = config["quantization_config"]
    assert raw["quant_method"] == "compressed-tensors" and raw["version"]
    # the library lists every other Linear (attention, routers, shared experts, dense MLP, lm_head)
    tensors = read_tensors(ckpt)
    linears = {n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2}
    assert set(raw["ignore"]) == linears - {"model.embed_tokens"}


# the usual llm-compressor W4A16 recipe: every Linear but its usual MoE ignore list
LINEAR_ARCHS = {arch: dict(group_size=32) if arch in ("deepseek_v3", "deepseek_v2", "kimi_k2") else {}
                for arch in ARCHITECTURES}  # MLA's latent (kv_lora_rank 32 at hidden 128) takes groups of 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_targets_linear_quantizes_every_linear_but_lm_head_and_the_routers(make_ckpt: MakeCheckpoint, arch: str) -> None:
    fields = dict(SMALL, arch=arch, targets="linear", **LINEAR_ARCHS[arch])
    ckpt = make_ckpt(**fields)
    raw = quantization_config(ckpt)
    assert [g["targets"] for g in raw["config_groups"].values()] == [["Linear"]]
    tensors = read_tensors(ckpt)
    packed = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}
    dense = {n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2}
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    routers = {f"model.layers.{layer}.{block}.gate" for layer in moe_layer_indices(DemoSpec(**fields))}
    shared_gates = {f"model.layers.{layer}.mlp.shared_expert_gate" for layer in range(2)} if arch == "qwen2_moe" else set()
    assert dense == {"model.embed_tokens", "lm_head"} | routers | shared_gates
    # the library writes the Linear layers the ignore list left out by name, as llm-compressor does
    assert set(raw["ignore"]) == dense - {"model.embed_tokens"}
    assert any(".self_attn.o_proj" in m for m in packed) and set(expert_modules(DemoSpec(**fields))) < packed
    # the library decompresses every one of them (attention too) within its quantization error
    spec, source = DemoSpec(**fields), demo_source_weights(DemoSpec(**fields))
    dequantized = library_dequantize(ckpt)
    assert set(dequantized) == {f"{m}.weight" for m in packed}
    for module in packed:
        weight = source[f"{module}.weight"].float()
        error = (weight - dequantized[f"{module}.weight"]).abs()
        scale = per_column_scale(tensors, module, weight.shape[1])
        assert (error <= scale * (0.5 + 2 ** (spec.num_bits - 1) * 0.01) + 1e-7).all(), module


def test_targets_linear_with_group_actorder_shares_one_g_idx_per_input(make_ckpt: MakeCheckpoint) -> None:
    # q, k and v read the same input (as gate and up do): GPTQ writes one act-order for them
    tensors = read_tensors(make_ckpt(**SMALL, targets="linear", actorder="group", group_size=32))
    attn = "model.layers.0.self_attn"
    q = tensors[f"{attn}.q_proj.weight_g_idx"]
    assert torch.equal(q, tensors[f"{attn}.k_proj.weight_g_idx"]) and torch.equal(q, tensors[f"{attn}.v_proj.weight_g_idx"])
    assert not torch.equal(q, tensors[f"{attn}.o_proj.weight_g_idx"])


# ---------------------------------------------------------------------------------------------
# expert tensors and decompression

VARIANTS = {
    "int4-g128-sym": dict(),
    "int4-g64-asym": dict(group_size=64, symmetric=False),
    "int8-channel-sym": dict(num_bits=8, group_size=-1),
    "int4-channel-asym-null": dict(group_size=-1, symmetric=False, channel_group_size_null=True),
    "int8-g32-asym": dict(num_bits=8, group_size=32, symmetric=False),
    "int4-g32-actorder-group-asym": dict(group_size=32, symmetric=False, actorder="group"),
    "int4-g128-actorder-static": dict(actorder="static"),
    "mixtral-int4-g64-asym-fp16": dict(arch="mixtral", group_size=64, symmetric=False, dtype="float16"),
    "deepseek-int4-channel-fp32": dict(arch="deepseek_v3", group_size=-1, dtype="float32"),
    # the other widths vLLM names, packed densely by compressed-tensors (codes straddle words)
    "int3-g64": dict(num_bits=3, group_size=64),
    "mixtral-int6-g32-asym": dict(arch="mixtral", num_bits=6, group_size=32, symmetric=False),
    "int2-channel": dict(num_bits=2, group_size=-1),
    "int5-g32-actorder-group": dict(num_bits=5, group_size=32, actorder="group"),
}


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_expert_tensor_layout(make_ckpt: MakeCheckpoint, fields: dict) -> None:
    spec = DemoSpec(**SMALL, **fields)
    tensors = read_tensors(make_ckpt(**SMALL, **fields))
    scale_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec.dtype]
    for module in expert_modules(spec):
        rows, cols = (spec.hidden_size, spec.intermediate_size) if module.endswith(("down_proj", "w2")) else (
            spec.intermediate_size, spec.hidden_size)
        groups = 1 if spec.group_size == -1 else cols // spec.group_size
        packed = tensors[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32 and packed.shape == (rows, cols * spec.num_bits // 32)
        scale = tensors[f"{module}.weight_scale"]
        assert scale.dtype == scale_dtype and scale.shape == (rows, groups)
        assert tensors[f"{module}.weight_shape"].tolist() == [rows, cols]
        assert f"{module}.weight" not in tensors
        zero_point = tensors.get(f"{module}.weight_zero_point")
        if spec.symmetric:
            assert zero_point is None
        else:
            assert zero_point.dtype == torch.int32 and zero_point.shape == (math.ceil(rows * spec.num_bits / 32), groups)
        g_idx = tensors.get(f"{module}.weight_g_idx")
        if spec.actorder == "group":
            assert g_idx.dtype == torch.int32 and g_idx.shape == (cols,)
            assert Counter(g_idx.tolist()) == {g: spec.group_size for g in range(groups)}
            assert not torch.equal(g_idx, torch.arange(cols, dtype=torch.int32) // spec.group_size)
        else:
            assert g_idx is None


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_library_decompression_is_within_quantization_error(make_ckpt: MakeCheckpoint, fields: dict) -> None:
    spec = DemoSpec(**SMALL, **fields)
    ckpt = make_ckpt(**SMALL, **fields)
    tensors = read_tensors(ckpt)
    source = demo_source_weights(spec)
    dequantized = library_dequantize(ckpt)
    assert set(dequantized) == {f"{m}.weight" for m in expert_modules(spec)}
    # the library quantizes in the weight dtype: w/s, +z and (q-z)*s each round to it
    eps = torch.finfo(source["lm_head.weight"].dtype).eps
    for module in expert_modules(spec):
        weight = source[f"{module}.weight"].float()
        approx = dequantized[f"{module}.weight"]
        assert approx.dtype == torch.float32 and approx.shape == weight.shape
        scale = per_column_scale(tensors, module, weight.shape[1])
        error = (weight - approx).abs()
        bound = scale / 2 + eps * (weight.abs() + approx.abs() + 2 ** (spec.num_bits - 1) * scale) + 1e-7 * scale
        assert (error <= bound).all(), f"{module}: worst excess {(error - bound).max():.3g}"
        assert (error / scale).mean() < 0.3  # rounding error is spread over [0, s/2]


def test_fp32_checkpoint_is_within_half_a_step(make_ckpt: MakeCheckpoint) -> None:
    fields = dict(SMALL, group_size=32, symmetric=False, dtype="float32")
    ckpt = make_ckpt(**fields)
    tensors, source = read_tensors(ckpt), demo_source_weights(DemoSpec(**fields))
    for name, approx in library_dequantize(ckpt).items():
        scale = per_column_scale(tensors, name.removesuffix(".weight"), approx.shape[1])
        assert ((source[name].float() - approx).abs() <= scale * (0.5 + 1e-5)).all()


def test_group_actorder_config_is_the_verbose_018_form(make_ckpt: MakeCheckpoint) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    ckpt = make_ckpt(**SMALL, group_size=32, actorder="group")
    raw = quantization_config(ckpt)
    assert raw["version"] == "0.18.0" and "moe_sparsity_config" not in raw
    weights = raw["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == "group" and weights["strategy"] == "group" and weights["group_size"] == 32
    assert {"block_structure", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"} <= set(weights)
    with pytest.raises(ValueError, match="actorder"):  # 0.19+ refuses such checkpoints
        QuantizationConfig.model_validate(raw)


def test_actorder_weight_is_stored_like_no_actorder(make_ckpt: MakeCheckpoint) -> None:
    plain = read_tensors(make_ckpt(**SMALL))
    ordered_ckpt = make_ckpt(**SMALL, actorder="weight")
    assert quantization_config(ordered_ckpt)["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    ordered = read_tensors(ordered_ckpt)
    assert plain.keys() == ordered.keys()
    assert all(torch.equal(plain[name], ordered[name]) for name in plain)


@pytest.mark.parametrize("null", [False, True])
def test_channel_group_size_is_written_as_asked(make_ckpt: MakeCheckpoint, null: bool) -> None:
    raw = quantization_config(make_ckpt(**SMALL, group_size=-1, channel_group_size_null=null))
    weights = raw["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] == "channel" and weights["group_size"] == (None if null else -1)


# ---------------------------------------------------------------------------------------------
# mixed precision


@pytest.mark.parametrize("mode", ["layer", "expert"])
def test_mixed_precision_puts_int8_where_asked(make_ckpt: MakeCheckpoint, mode: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    fields = dict(SMALL, mixed=mode, num_layers=3)
    spec = DemoSpec(**fields)
    ckpt = make_ckpt(**fields)
    raw = quantization_config(ckpt)
    QuantizationConfig.model_validate(raw)
    assert sorted(g["weights"]["num_bits"] for g in raw["config_groups"].values()) == [4, 8]
    tensors = read_tensors(ckpt)
    for module in expert_modules(spec):
        layer, expert = int(module.split(".")[2]), int(module.split(".")[5])
        odd = (layer if mode == "layer" else expert) % 2 == 1
        bits = 8 if odd else 4
        packed, shape = tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_shape"].tolist()
        assert packed.shape[1] == shape[1] * bits // 32, module
    # each group is decompressed with its own bit width: int8 experts come back closer
    source = demo_source_weights(spec)
    errors: dict[int, float] = {4: 0.0, 8: 0.0}
    for name, weight in library_dequantize(ckpt).items():
        bits = 8 if int(name.split(".")[2 if mode == "layer" else 5]) % 2 else 4
        errors[bits] = max(errors[bits], (source[name].float() - weight).abs().max().item())
    assert 0 < errors[8] < errors[4] / 4


# ---------------------------------------------------------------------------------------------
# determinism, options, errors


def test_same_spec_gives_identical_bytes(tmp_path: Path) -> None:
    for fields in (dict(SMALL, tokenizer=True), dict(SMALL, arch="deepseek_v3", actorder="group", group_size=32, symmetric=False)):
        first = write_demo_checkpoint(tmp_path / "a", DemoSpec(**fields))
        second = write_demo_checkpoint(tmp_path / "b", DemoSpec(**fields))
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
        other = write_demo_checkpoint(tmp_path / "c", DemoSpec(**fields, seed=1))
        assert (other / "model-00002-of-00002.safetensors").read_bytes() != (first / "model-00002-of-00002.safetensors").read_bytes()
        for folder in (first, second, other):
            for file in folder.iterdir():
                file.unlink()
            folder.rmdir()


def test_source_weights_do_not_depend_on_quantization_options() -> None:
    plain = demo_source_weights(DemoSpec(**SMALL))
    other = demo_source_weights(DemoSpec(**SMALL, num_bits=8, group_size=-1, symmetric=False, num_shards=3))
    assert all(torch.equal(plain[name], other[name]) for name in plain)


def test_deepseek_mla_sizes_and_yarn_rope_are_asked_for_else_the_small_defaults() -> None:
    from wna16ctl.demo import model_config

    default = model_config(DemoSpec(arch="deepseek_v3"))
    assert (default["kv_lora_rank"], default["qk_rope_head_dim"], default["rope_scaling"]) == (64, 16, None)
    spec = DemoSpec(arch="deepseek_v3", mla_kv_lora_rank=512, mla_qk_rope_head_dim=64, mla_yarn_rope=True)
    config = model_config(spec)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["head_dim"]) == (512, 64, 64)
    assert config["rope_scaling"] == DEEPSEEK_V3_YARN and config["max_position_embeddings"] == 4096 * 40
    weights = demo_source_weights(spec)
    assert weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 256)
    assert weights["model.layers.0.self_attn.kv_b_proj.weight"].shape[1] == 512
    assert weights["model.layers.0.self_attn.q_b_proj.weight"].shape[0] == 4 * (32 + 64)


def test_single_shard_is_one_model_safetensors(make_ckpt: MakeCheckpoint) -> None:
    ckpt = make_ckpt(**SMALL, num_shards=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]


def test_more_shards(make_ckpt: MakeCheckpoint) -> None:
    ckpt = make_ckpt(**SMALL, num_shards=5)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]


def test_tokenizer(make_ckpt: MakeCheckpoint) -> None:
    from tokenizers import Tokenizer

    ckpt = make_ckpt(**SMALL, tokenizer=True)
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    config = json.loads((ckpt / "config.json").read_text())
    assert 256 < tokenizer.get_vocab_size() <= config["vocab_size"]
    assert tokenizer.token_to_id("<|begin_of_text|>") == config["bos_token_id"]
    assert tokenizer.token_to_id("<|end_of_text|>") == config["eos_token_id"]
    # the held-out questions the demo writes for verify (GSM8K's stand-in when GSM8K is not found)
    records = [json.loads(line) for line in (ckpt / "demo_questions.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(records) == 256 and all(r["answer"].split("#### ")[-1] for r in records)
    _word_pieces(tokenizer, records[0]["question"], config["vocab_size"])


def _word_pieces(tokenizer, question: str, vocab_size: int) -> None:
    ids = tokenizer.encode(question).ids
    assert len(ids) < len(question.encode()) and all(i < vocab_size for i in ids)
    assert tokenizer.decode(ids) == question


def test_tokenizer_on_gsm8k(make_ckpt: MakeCheckpoint, gsm8k_test) -> None:
    from tokenizers import Tokenizer

    ckpt = make_ckpt(**SMALL, tokenizer=True)
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    question = json.loads(gsm8k_test.read_text(encoding="utf-8").splitlines()[0])["question"]
    _word_pieces(tokenizer, question, json.loads((ckpt / "config.json").read_text())["vocab_size"])


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(arch="llama"), "arch"),
        (dict(group_size=96), "multiple of group_size"),
        (dict(actorder="group", group_size=-1), "actorder"),
        (dict(num_bits=8, mixed="expert"), "mixed"),
        (dict(arch="deepseek_v3", mixed="layer", num_layers=2), "mixed"),
        (dict(arch="deepseek_v3", num_layers=1), "num_layers"),
        (dict(channel_group_size_null=True), "channel_group_size_null"),
        (dict(top_k=9), "top_k"),
        (dict(num_bits=9), "num_bits"),
        (dict(num_bits=1), "num_bits"),
        (dict(arch="deepseek_v3", mla_qk_rope_head_dim=15), "mla_qk_rope_head_dim"),
        (dict(arch="deepseek_v3", mla_kv_lora_rank=0), "mla_kv_lora_rank"),
        (dict(targets="attention"), "targets"),
        (dict(targets="linear", mixed="layer"), "routed experts only"),
        (dict(arch="deepseek_v3", targets="linear"), "kv_lora_rank 64 is not a multiple of group_size 128"),
        (dict(format="marlin"), "format 'marlin' is not one of"),
        (dict(format="gptq", num_bits=5), "format gptq stores 2, 3, 4, 8 bits, not 5"),
        (dict(format="awq", num_bits=8), "format awq stores 4 bits, not 8"),
        (dict(format="gptq", actorder="static"), "format gptq stores actorder none or group, not static"),
        (dict(format="awq", actorder="group"), "format awq stores actorder none, not group"),
        (dict(format="gptq", mixed="layer"), "mixed precision is written in format compressed-tensors only"),
        (dict(format="awq", group_size=-1, channel_group_size_null=True), "channel_group_size_null"),
    ],
)
def test_bad_specs_are_refused(tmp_path: Path, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_demo_checkpoint(tmp_path / "out", DemoSpec(**fields))
    assert not (tmp_path / "out").exists()


def test_refuses_a_folder_with_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        write_demo_checkpoint(tmp_path, DemoSpec(**SMALL))


def test_demo_files_get_the_umask_mode(tmp_path) -> None:
    """Like every other file the tools write: 0644 under umask 022 (safetensors alone makes 0600)."""
    import os
    import stat

    from wna16ctl.demo import DemoSpec, write_demo_checkpoint

    old = os.umask(0o022)
    try:
        ck = write_demo_checkpoint(tmp_path / "ck", DemoSpec(**SMALL, num_shards=2))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ck.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


# ---- `demo OUT --force`: what it may replace --------------------------------------------------------

TINY = ["--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128", "--no-tokenizer"]


def _demo(*args: object):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    return CliRunner().invoke(cli, ["demo", *map(str, args)])


def _one_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.exit_code, res.output)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], res.stderr
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_demo_force_replaces_only_a_demo_checkpoint(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "thesis.tex").write_text("x")
    line = _one_line(_demo(victim, "--force", *TINY))
    assert "victim" in line and "sub" in line and "--force" in line
    assert _tree(victim) == {"sub/thesis.tex": b"x"}
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    _one_line(_demo(a_file, "--force", *TINY))
    assert a_file.read_text() == "mine"

    from wna16ctl.output.outdir import DEMO_MARKER

    ck = tmp_path / "ck"
    assert _demo(ck, *TINY).exit_code == 0
    marker = json.loads((ck / DEMO_MARKER).read_bytes())
    assert sorted(p.name for p in ck.iterdir()) == sorted([*marker["files"], DEMO_MARKER])
    assert "--force" in _one_line(_demo(ck, *TINY))
    # an earlier demo checkpoint (of another spec) is replaced with --force
    res = _demo(ck, "--force", *TINY[:-1])
    assert res.exit_code == 0, res.output
    assert "tokenizer.json" in {p.name for p in ck.iterdir()}
    # ... unless something else was put there since
    (ck / "notes.md").write_text("mine")
    before = _tree(ck)
    assert "notes.md" in _one_line(_demo(ck, "--force", *TINY))
    assert _tree(ck) == before


def test_demo_links_devices_and_unwritable_places_get_one_line(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os
    import stat

    ck = tmp_path / "ck"
    assert _demo(ck, *TINY).exit_code == 0
    before = _tree(ck)
    link = tmp_path / "link"
    link.symlink_to(ck)
    assert "symbolic link" in _one_line(_demo(link, "--force", *TINY))
    assert _tree(ck) == before and link.is_symlink()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "symbolic link" in _one_line(_demo(dangling, *TINY))
    assert not (tmp_path / "nowhere").exists()
    # a device node (a stand-in for /dev/full: the same major/minor, in a folder of the test's own)
    device = tmp_path / "full"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e}); the rest of this test needs one")
    assert "not a folder" in _one_line(_demo(device, "--force", *TINY))
    assert stat.S_ISCHR(os.lstat(device).st_mode)
    assert "Not a directory" in _one_line(_demo(device / "sub", *TINY))

    # a read-only filesystem (simulated: root writes through permission bits, and a mount needs privileges)
    real_mkdir = Path.mkdir
    (tmp_path / "ro").mkdir()

    def read_only_mkdir(self, *a, **kw):
        if self.parent.name == "ro":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(Path, "mkdir", read_only_mkdir)
        assert "Read-only file system" in _one_line(_demo(tmp_path / "ro" / "ck", *TINY))
    assert list((tmp_path / "ro").iterdir()) == []

    # the disk fills up half way: one line, and nothing of the demo is left behind; over an earlier
    # demo (--force), that one stays as it was
    real_write = Path.write_bytes

    def full(self, data):
        if self.suffix == ".safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, data)

    with monkeypatch.context() as m:
        m.setattr(Path, "write_bytes", full)
        assert "No space left on device" in _one_line(_demo(tmp_path / "full-disk", *TINY))
        assert "No space left on device" in _one_line(_demo(ck, "--force", *TINY[:-1]))
    assert not (tmp_path / "full-disk").exists() and _tree(ck) == before
    assert sorted(p.name for p in tmp_path.iterdir() if "wna16ctl" in p.name) == []


def _demo_with_file_size_limit(out: Path, limit: int, *args: str):
    """`wna16ctl demo OUT` in a process whose files may not grow past `limit` bytes: the kernel
    refuses the write that would (EFBIG) as a full disk refuses it (ENOSPC), in Python's writes and
    in the libraries' own (safetensors, tokenizers); no privileges or mounts needed."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "wna16ctl", "demo", str(out), *args], capture_output=True, text=True,
                          timeout=300, preexec_fn=limit_files, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def test_demo_on_a_full_disk_is_one_line_and_out_stays_as_it_was(tmp_path: Path) -> None:
    """The disk fills while the shards are written: one line (exit 2, no "internal error"), no
    half-written checkpoint, and the rerun is not told that an earlier demo is there; with --force
    over an earlier demo, that demo stays whole."""
    out = tmp_path / "ck"
    for args in ([], ["--force"]):
        res = _demo_with_file_size_limit(out, 16 << 10, *args, *TINY)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert lines[0].startswith(f"error: {out}: cannot write the demo checkpoint (File too large)"), lines[0]
        assert "internal error" not in lines[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ([] if not args else ["ck"])
        if not args:
            assert _demo(out, *TINY).exit_code == 0  # not "holds an earlier demo checkpoint"
            before = _tree(out)
    assert _tree(out) == before


def test_demo_interrupted_leaves_out_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while the demo writes: exit 130, one line that says nothing was written to OUT, and
    nothing was (the next run needs no --force); over an earlier demo, that one stays whole."""
    import wna16ctl.demo as demo_mod

    real = demo_mod._save_file

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    out = tmp_path / "ck"
    for earlier in (False, True):
        if earlier:
            assert _demo(out, *TINY).exit_code == 0
            before = _tree(out)
        monkeypatch.setattr(demo_mod, "_save_file", interrupted)
        res = _demo(out, "--force", *TINY[:-1])
        monkeypatch.setattr(demo_mod, "_save_file", real)
        assert res.exit_code == 130, res.output
        assert res.stderr.strip() == f"error: interrupted; nothing was written to {out}", res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == (["ck"] if earlier else [])
    assert _tree(out) == before


def test_a_result_stdout_cannot_take_is_one_line(make_ckpt: MakeCheckpoint) -> None:
    import subprocess
    import sys

    ck = make_ckpt(**SMALL)
    for args in (["inspect", str(ck)], ["inspect", str(ck), "--json"]):
        with open("/dev/full", "w") as full:
            res = subprocess.run([sys.executable, "-m", "wna16ctl", *args], stdout=full, stderr=subprocess.PIPE,
                                 text=True, timeout=120)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert lines[0].startswith("error: stdout:") and "No space left on device" in lines[0], res.stderr


# ---- `demo --format gptq|awq`: the same quantization in another format ----------------------------


@pytest.mark.parametrize("fields", [dict(format="gptq"), dict(format="gptq", actorder="group", symmetric=False),
                                    dict(format="gptq", num_bits=8, targets="linear"), dict(format="gptq", num_bits=3),
                                    dict(format="awq", symmetric=False), dict(format="awq", targets="linear")])
def test_gptq_and_awq_store_the_compressed_tensors_quantization(make_ckpt: MakeCheckpoint, fields: dict) -> None:
    """Read back by the package, every expert of a GPTQ or AWQ demo holds the codes, zero points
    and g_idx of the compressed-tensors demo of the same spec, and its scales in float16 (the
    tools' dtype), and nothing but the quantized modules differs."""
    from wna16ctl.layout.spec import SCALES
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    base = {k: v for k, v in fields.items() if k != "format"}
    theirs, ours = open_checkpoint(make_ckpt(**SMALL, **base)), open_checkpoint(make_ckpt(**SMALL, **fields))
    assert ours.config.quant.quant_method == fields["format"]
    assert [layer.prefix for layer in ours.layers] == [layer.prefix for layer in theirs.layers]
    with TensorReader(theirs.files) as a, TensorReader(ours.files) as b:
        for layer, twin in zip(theirs.layers, ours.layers):
            assert twin.scheme.describe() == layer.scheme.describe()
            for expert in range(layer.num_experts):
                want, got = a.read_expert(layer, expert), b.read_expert(twin, expert)
                for role in want:
                    assert got[role].keys() == want[role].keys(), role
                    for key, tensor in want[role].items():
                        expected = tensor.to(torch.float16) if key == SCALES else tensor
                        assert got[role][key].dtype == expected.dtype and torch.equal(got[role][key], expected), key
    unquantized = {n: t for n, t in read_tensors(make_ckpt(**SMALL, **base)).items() if n.endswith((".weight", ".bias"))}
    stored = read_tensors(make_ckpt(**SMALL, **fields))
    assert all(torch.equal(stored[n], t) for n, t in unquantized.items())


def test_gptq_demo_keeps_each_module_in_one_shard(make_ckpt: MakeCheckpoint) -> None:
    index = json.loads((make_ckpt(**SMALL, format="gptq") / "model.safetensors.index.json").read_text())
    shards: dict[str, set[str]] = {}
    for name, shard in index["weight_map"].items():
        shards.setdefault(name.rpartition(".")[0], set()).add(shard)
    assert len(set().union(*shards.values())) == 2 and all(len(s) == 1 for s in shards.values())


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *map(str, args)], capture_output=True, text=True,
                          check=False, timeout=900)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_demo_format_then_inspect_repack_and_verify(tmp_path: Path, fmt: str) -> None:
    """`demo --format` on the command line, then what `make demo` runs on it: inspect reads the
    format; repack --tp 2 either writes an output that verify proves, or refuses in one line and
    writes nothing."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "tp2"
    wrote = _cli("demo", ckpt, "--format", fmt, "--asym")
    assert wrote.returncode == 0, wrote.stderr
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == fmt
    inspected = _cli("inspect", ckpt, "--tp", "1,2,4", "--json")
    assert inspected.returncode in (0, 1), inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["quantization"]["format"] == fmt and len(report["layers"]) == 2
    repacked = _cli("repack", ckpt, "--tp", 2, "-o", out)
    if repacked.returncode == 0:
        verified = _cli("verify", ckpt, out, "--num-samples", 4)  # the format's path, not the numerics' depth
        assert verified.returncode == 0, verified.stdout + verified.stderr
    else:
        lines = [ln for ln in repacked.stderr.splitlines() if ln.strip()]
        assert repacked.returncode in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "), repacked.stderr
        assert "internal error" not in lines[0] and not out.exists()


def test_demo_format_refusals_are_one_line(tmp_path: Path) -> None:
    line = _one_line(_demo(tmp_path / "out", "--format", "awq", "--bits", "8", *TINY))
    assert "format awq stores 4 bits, not 8" in line
    assert not (tmp_path / "out").exists()
