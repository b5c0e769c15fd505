"""Write a checkpoint made of safetensors *headers* over sparse files (no tensor data).

The default is Kimi-K2-sized: 61 layers (layer 0 dense), 384 routed experts, hidden 7168,
expert intermediate 2048, int4 group-32 symmetric experts, ~60 shards.  Only headers are
real, so it costs a few MB of disk however large the model it describes; `inspect` reads
nothing else.

    python bench/synthetic_headers.py OUT [--layers 61] [--experts 384] [--shards 60] [--quantize-linear]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from pathlib import Path

DT = {"I32": 4, "BF16": 2, "I64": 8, "F32": 4}


def _dense(module: str, shape: list[int], quantized: bool, gs: int, bits: int):
    if not quantized:
        yield f"{module}.weight", "BF16", shape
        return
    n, k = shape
    yield f"{module}.weight_packed", "I32", [n, k * bits // 32]
    yield f"{module}.weight_scale", "BF16", [n, k // gs]
    yield f"{module}.weight_shape", "I64", [2]


def _tensors(layers: int, experts: int, hidden: int, inter: int, gs: int, bits: int, vocab: int,
             quantize_linear: bool = False):
    pf = 32 // bits
    q = quantize_linear
    yield "model.embed_tokens.weight", "BF16", [vocab, hidden]
    for L in range(layers):
        p = f"model.layers.{L}"
        yield f"{p}.input_layernorm.weight", "BF16", [hidden]
        yield f"{p}.post_attention_layernorm.weight", "BF16", [hidden]
        for proj, shape in (("q_a_proj", [1536, hidden]), ("q_b_proj", [12288, 1536]), ("kv_a_proj_with_mqa", [576, hidden]),
                            ("kv_b_proj", [16384, 512]), ("o_proj", [hidden, 8192])):
            yield from _dense(f"{p}.self_attn.{proj}", shape, q, gs, bits)
        if L == 0:
            for proj, shape in (("gate_proj", [18432, hidden]), ("up_proj", [18432, hidden]), ("down_proj", [hidden, 18432])):
                yield from _dense(f"{p}.mlp.{proj}", shape, q, gs, bits)
            continue
        yield f"{p}.mlp.gate.weight", "BF16", [experts, hidden]
        yield f"{p}.mlp.gate.e_score_correction_bias", "F32", [experts]
        for proj, shape in (("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]), ("down_proj", [hidden, inter])):
            yield from _dense(f"{p}.mlp.shared_experts.{proj}", shape, q, gs, bits)
        for e in range(experts):
            for proj, (n, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                m = f"{p}.mlp.experts.{e}.{proj}"
                yield f"{m}.weight_packed", "I32", [n, k // pf]
                yield f"{m}.weight_scale", "BF16", [n, k // gs]
                yield f"{m}.weight_shape", "I64", [2]
    yield "model.norm.weight", "BF16", [hidden]
    yield "lm_head.weight", "BF16", [vocab, hidden]


def write(out: Path, layers: int = 61, experts: int = 384, hidden: int = 7168, inter: int = 2048,
          gs: int = 32, bits: int = 4, shards: int = 60, vocab: int = 163840, quantize_linear: bool = False) -> Path:
    """`quantize_linear`: attention, the dense MLP and the shared experts are quantized too (the usual
    W4A16 recipe: every Linear but lm_head and the router), and config.json gets the MLA sizes."""
    out.mkdir(parents=True, exist_ok=True)
    items = list(_tensors(layers, experts, hidden, inter, gs, bits, vocab, quantize_linear))
    per = -(-len(items) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        chunk = items[s * per:(s + 1) * per]
        if not chunk:
            break
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
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
            f.truncate(8 + len(blob) + off)  # sparse: the data region is a hole
        total += off
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": 64, "moe_intermediate_size": inter, "intermediate_size": 18432,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": min(8, experts), "first_k_dense_replace": 1,
        "vocab_size": vocab, "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "version": "0.20.1",
            "config_groups": {"group_0": {
                "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": gs, "dynamic": False},
                "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$"],
        },
    }
    if quantize_linear:
        config.update(num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
        qc = config["quantization_config"]
        qc["config_groups"]["group_0"]["targets"] = ["Linear"]
        qc["ignore"] = ["lm_head", r"re:.*mlp\.gate$"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--shards", type=int, default=60)
    ap.add_argument("--quantize-linear", action="store_true", help="quantize attention, dense MLP and shared experts too")
    a = ap.parse_args()
    p = write(a.out, layers=a.layers, experts=a.experts, shards=a.shards, quantize_linear=a.quantize_linear)
    n = sum(1 for _ in os.scandir(p))
    print(f"wrote {p} ({n} files)")


if __name__ == "__main__":
    main()
