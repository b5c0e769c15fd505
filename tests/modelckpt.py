"""Header-only checkpoints of whole MoE models at real per-layer sizes (sparse files, no data).

Each family below derives its tensors from its config the way the architecture lays them out
(attention, dense MLPs, shared experts, routed experts, linear attention, MTP layers), so the
linear-layer planner sees the shapes a real checkpoint has.  Layer counts are cut down (the
verdicts depend on per-layer shapes, not on how many layers repeat them); everything else is
the published model's size.  Which modules are quantized follows the config's own targets and
ignore list, with a matcher written here (exact names and `re:` patterns, `re.match`), as the
usual llm-compressor W4A16 recipe writes them: every Linear except those ignored.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Iterator

DT = {"I32": 4, "BF16": 2, "I64": 8, "F32": 4}
Tensor = tuple[str, str, list[int]]


def w4a16(ignore: list[str], group_size: int = 128, symmetric: bool = True, num_bits: int = 4,
          targets: list[str] | None = None) -> dict[str, Any]:
    strategy = "group" if group_size > 0 else "channel"
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "version": "0.12.2",
        "config_groups": {"group_0": {
            "targets": targets or ["Linear"],
            "weights": {"num_bits": num_bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
                        "group_size": group_size if group_size > 0 else None, "dynamic": False, "actorder": None},
            "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
        "ignore": ignore,
    }


def _ignored(module: str, ignore: list[str]) -> bool:
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in ignore)


def _linear(module: str, n: int, k: int, quant: dict[str, Any] | None) -> Iterator[Tensor]:
    w = None if quant is None or _ignored(module, quant["ignore"]) else quant["config_groups"]["group_0"]["weights"]
    if w is None:
        yield f"{module}.weight", "BF16", [n, k]
        return
    pf = 32 // w["num_bits"]
    gs = w["group_size"] or k
    yield f"{module}.weight_packed", "I32", [n, -(-k // pf)]
    yield f"{module}.weight_scale", "BF16", [n, -(-k // gs)]
    yield f"{module}.weight_shape", "I64", [2]
    if not w["symmetric"]:
        yield f"{module}.weight_zero_point", "I32", [-(-n // pf), -(-k // gs)]


def _mlp(prefix: str, hidden: int, inter: int, q: dict | None, names=("gate_proj", "up_proj", "down_proj")) -> Iterator[Tensor]:
    g, u, d = names
    yield from _linear(f"{prefix}.{g}", inter, hidden, q)
    yield from _linear(f"{prefix}.{u}", inter, hidden, q)
    yield from _linear(f"{prefix}.{d}", hidden, inter, q)


def _experts(prefix: str, n: int, hidden: int, inter: int, q: dict | None, names=("gate_proj", "up_proj", "down_proj")) -> Iterator[Tensor]:
    for e in range(n):
        yield from _mlp(f"{prefix}.{e}", hidden, inter, q, names)


def _gqa(prefix: str, c: dict, q: dict | None, gate: bool = False) -> Iterator[Tensor]:
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, kv, H = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    yield from _linear(f"{prefix}.q_proj", h * hd * (2 if gate else 1), H, q)
    yield from _linear(f"{prefix}.k_proj", kv * hd, H, q)
    yield from _linear(f"{prefix}.v_proj", kv * hd, H, q)
    yield from _linear(f"{prefix}.o_proj", H, h * hd, q)


def _mla(prefix: str, c: dict, q: dict | None) -> Iterator[Tensor]:
    H, h = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    if c.get("q_lora_rank"):
        yield from _linear(f"{prefix}.q_a_proj", c["q_lora_rank"], H, q)
        yield f"{prefix}.q_a_layernorm.weight", "BF16", [c["q_lora_rank"]]
        yield from _linear(f"{prefix}.q_b_proj", h * qk, c["q_lora_rank"], q)
    else:
        yield from _linear(f"{prefix}.q_proj", h * qk, H, q)
    yield from _linear(f"{prefix}.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], H, q)
    yield f"{prefix}.kv_a_layernorm.weight", "BF16", [c["kv_lora_rank"]]
    yield from _linear(f"{prefix}.kv_b_proj", h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"], q)
    yield from _linear(f"{prefix}.o_proj", H, h * c["v_head_dim"], q)


def _gdn(prefix: str, c: dict, q: dict | None) -> Iterator[Tensor]:
    H = c["hidden_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    yield from _linear(f"{prefix}.in_proj_qkv", 2 * kd + vd, H, q)
    yield from _linear(f"{prefix}.in_proj_z", vd, H, q)
    yield from _linear(f"{prefix}.in_proj_b", c["linear_num_value_heads"], H, q)
    yield from _linear(f"{prefix}.in_proj_a", c["linear_num_value_heads"], H, q)
    yield f"{prefix}.conv1d.weight", "BF16", [2 * kd + vd, 1, c["linear_conv_kernel_dim"]]
    yield f"{prefix}.A_log", "F32", [c["linear_num_value_heads"]]
    yield from _linear(f"{prefix}.out_proj", H, vd, q)


def _norms(p: str, H: int) -> Iterator[Tensor]:
    yield f"{p}.input_layernorm.weight", "BF16", [H]
    yield f"{p}.post_attention_layernorm.weight", "BF16", [H]


def _embed_head(c: dict, q: dict | None, stem: str = "model", head: str = "lm_head") -> Iterator[Tensor]:
    yield f"{stem}.embed_tokens.weight", "BF16", [c["vocab_size"], c["hidden_size"]]
    yield f"{stem}.norm.weight", "BF16", [c["hidden_size"]]
    yield from _linear(head, c["vocab_size"], c["hidden_size"], q)


# -- families -------------------------------------------------------------------------------------
def qwen3_moe(c: dict, q: dict | None) -> Iterator[Tensor]:
    H = c["hidden_size"]
    yield from _embed_head(c, q)
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}"
        yield from _norms(p, H)
        yield from _gqa(f"{p}.self_attn", c, q)
        yield from _linear(f"{p}.mlp.gate", c["num_experts"], H, q)
        yield from _experts(f"{p}.mlp.experts", c["num_experts"], H, c["moe_intermediate_size"], q)
        if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE
            yield from _mlp(f"{p}.mlp.shared_expert", H, c["shared_expert_intermediate_size"], q)
            yield from _linear(f"{p}.mlp.shared_expert_gate", 1, H, q)


def mixtral(c: dict, q: dict | None) -> Iterator[Tensor]:
    H = c["hidden_size"]
    yield from _embed_head(c, q)
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}"
        yield from _norms(p, H)
        yield from _gqa(f"{p}.self_attn", c, q)
        yield from _linear(f"{p}.block_sparse_moe.gate", c["num_local_experts"], H, q)
        yield from _experts(f"{p}.block_sparse_moe.experts", c["num_local_experts"], H, c["intermediate_size"], q,
                            ("w1", "w3", "w2"))


def _deepseek_layer(p: str, L: int, c: dict, q: dict | None, attention) -> Iterator[Tensor]:
    H = c["hidden_size"]
    yield from _norms(p, H)
    yield from attention(f"{p}.self_attn", c, q)
    if L < c.get("first_k_dense_replace", 0):
        yield from _mlp(f"{p}.mlp", H, c["intermediate_size"], q)
        return
    E = c.get("n_routed_experts") or c["num_experts"]
    yield from _linear(f"{p}.mlp.gate", E, H, q)
    yield f"{p}.mlp.gate.e_score_correction_bias", "F32", [E]
    yield from _experts(f"{p}.mlp.experts", E, H, c["moe_intermediate_size"], q)
    yield from _mlp(f"{p}.mlp.shared_experts", H, c["moe_intermediate_size"] * c.get("n_shared_experts", 1), q)


def deepseek_v3(c: dict, q: dict | None, stem: str = "model", head: str = "lm_head") -> Iterator[Tensor]:
    """DeepSeek-V3 / Kimi-K2: MLA, dense first layers, shared experts, MTP layers after the decoder."""
    yield from _embed_head(c, q, stem, head)
    total = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)
    for L in range(total):
        p = f"{stem}.layers.{L}"
        yield from _deepseek_layer(p, L, c, q, _mla)
        if L >= c["num_hidden_layers"]:  # MTP block extras
            yield f"{p}.eh_proj.weight", "BF16", [c["hidden_size"], 2 * c["hidden_size"]]
            yield f"{p}.enorm.weight", "BF16", [c["hidden_size"]]


def glm4_moe(c: dict, q: dict | None) -> Iterator[Tensor]:
    yield from _embed_head(c, q)
    for L in range(c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)):
        yield from _deepseek_layer(f"model.layers.{L}", L, c, q, _gqa)


def qwen3_5_moe(c: dict, q: dict | None) -> Iterator[Tensor]:
    """Qwen3.5-MoE: gated delta-net linear attention on 3 of 4 layers, gated full attention on the
    4th, routed + shared experts, and an MTP layer under `mtp.`."""
    t = c["text_config"]
    H = t["hidden_size"]
    stem = "model.language_model"
    yield from _embed_head(t, q, stem)

    def block(p: str, kind: str) -> Iterator[Tensor]:
        yield from _norms(p, H)
        if kind == "linear_attention":
            yield from _gdn(f"{p}.linear_attn", t, q)
        else:
            yield from _gqa(f"{p}.self_attn", t, q, gate=True)
        yield from _linear(f"{p}.mlp.gate", t["num_experts"], H, q)
        yield from _experts(f"{p}.mlp.experts", t["num_experts"], H, t["moe_intermediate_size"], q)
        yield from _mlp(f"{p}.mlp.shared_expert", H, t["shared_expert_intermediate_size"], q)
        yield from _linear(f"{p}.mlp.shared_expert_gate", 1, H, q)

    for L, kind in enumerate(t["layer_types"]):
        yield from block(f"{stem}.layers.{L}", kind)
    for m in range(t.get("mtp_num_hidden_layers", 0)):
        yield from block(f"mtp.layers.{m}", "full_attention")
        yield "mtp.fc.weight", "BF16", [H, 2 * H]


def write(out: Path, config: dict[str, Any], tensors: Iterator[Tensor], shards: int = 1) -> Path:
    """Write `config.json` and the tensors' headers over sparse shards (plus an index when sharded)."""
    out.mkdir(parents=True, exist_ok=True)
    items = list(tensors)
    per = -(-len(items) // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        chunk = items[s * per:(s + 1) * per]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, dt, shape in chunk:
            n = DT[dt]
            for d in shape:
                n *= d
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            f.truncate(8 + len(blob) + off)
    if shards > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


# -- the configs (published sizes; layer counts cut down) ------------------------------------------
RECIPE_IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*block_sparse_moe\.gate$"]


def qwen3_30b_a3b(layers: int = 2, **quant: Any) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True,  # as the released config.json says (transformers' default is False)
            "vocab_size": 151936, "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE, **quant)}


def qwen15_moe_a27b(layers: int = 2) -> dict[str, Any]:
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16,
            "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "intermediate_size": 5632,
            "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False, "vocab_size": 151936,
            "torch_dtype": "bfloat16",
            "quantization_config": w4a16(RECIPE_IGNORE)}


def mixtral_8x7b(layers: int = 2) -> dict[str, Any]:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
            "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE, group_size=-1)}


def deepseek_v3_671b(layers: int = 5, dense: int = 3) -> dict[str, Any]:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
            "num_hidden_layers": layers, "first_k_dense_replace": dense, "num_nextn_predict_layers": 1,
            "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "vocab_size": 129280, "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE)}


def kimi_k25(layers: int = 2) -> dict[str, Any]:
    text = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
            "num_hidden_layers": layers, "first_k_dense_replace": 1, "num_attention_heads": 64,
            "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "vocab_size": 163840,
            "torch_dtype": "bfloat16"}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "torch_dtype": "bfloat16",
            "quantization_config": w4a16(RECIPE_IGNORE + [r"re:.*lm_head$", r"re:.*self_attn.*", r"re:.*shared_experts.*",
                                                          r"re:.*mlp\.(gate|up|down)_proj$"], group_size=32)}


def glm45_air(layers: int = 2) -> dict[str, Any]:
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
            "num_hidden_layers": layers, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
            "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "vocab_size": 151552, "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE)}


def qwen35_35b_a3b(layers: int = 4) -> dict[str, Any]:
    text = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": layers,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "vocab_size": 248320,
            "mtp_num_hidden_layers": 1, "dtype": "bfloat16"}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "torch_dtype": "bfloat16",
            "quantization_config": w4a16(RECIPE_IGNORE + [r"re:.*visual.*"])}


def qwen3_235b_a22b(layers: int = 2) -> dict[str, Any]:
    """Qwen/Qwen3-235B-A22B's published config.json (94 decoder layers, 64 query heads, 4 KV heads
    of 128, 128 experts of 1536), with the W4A16 recipe in place of the FP8 or BF16 weights: the
    KV cache does not depend on the weight format."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
            "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
            "moe_intermediate_size": 1536, "intermediate_size": 12288, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
            "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE)}


def kimi_k2_thinking(layers: int = 2) -> dict[str, Any]:
    """moonshotai/Kimi-K2-Thinking's published config.json: the DeepSeek-V3 layout (61 decoder
    layers, MLA with kv_lora_rank 512 and qk_rope_head_dim 64, 384 experts of 2048) not nested in a
    text_config, int4 experts in groups of 32."""
    text = dict(kimi_k25(layers)["text_config"], max_position_embeddings=262144)
    text["quantization_config"] = w4a16(RECIPE_IGNORE + [r"re:.*self_attn.*", r"re:.*shared_experts.*",
                                                         r"re:.*mlp\.(gate|up|down)_proj$"], group_size=32)
    return text


def qwen3_coder_480b_a35b(layers: int = 2) -> dict[str, Any]:
    """Qwen/Qwen3-Coder-480B-A35B-Instruct's published config.json (its model page on the Hub): 62
    decoder layers, hidden 6144, 96 query heads and 8 KV heads of head_dim 128, 160 experts of 2560
    (8 per token), vocabulary 151936, max_position_embeddings 262144; the W4A16 recipe in place of
    the FP8 or BF16 weights, which does not change the KV cache."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 6144,
            "num_hidden_layers": layers, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
            "moe_intermediate_size": 2560, "intermediate_size": 8192, "num_experts": 160, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 262144,
            "torch_dtype": "bfloat16", "quantization_config": w4a16(RECIPE_IGNORE)}
