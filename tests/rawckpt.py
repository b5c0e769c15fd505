"""Hand-built checkpoints for shapes compressed-tensors refuses to write.

compressed-tensors cannot quantize a layer whose input size is not a multiple of the group size
(e.g. group 96, or hidden 2570 with group 128), yet the planner must still answer for such
configurations.  These checkpoints have the exact on-disk form of `pack-quantized` (random codes,
real headers), with a config written in the library's terse form.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_raw_checkpoint(
    out: Path,
    *,
    hidden: int,
    intermediate: int,
    group_size: int,
    num_bits: int = 4,
    num_experts: int = 2,
    symmetric: bool = True,
    actorder: str | None = None,
    extra_weights: dict | None = None,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pf = 32 // num_bits
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, hidden, generator=g).to(torch.bfloat16),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(num_experts, hidden, generator=g).to(torch.bfloat16),
    }
    for e in range(num_experts):
        for proj, (n, k) in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                             ("down_proj", (hidden, intermediate))):
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            groups = -(-k // group_size) if group_size > 0 else 1
            tensors[f"{m}.weight_packed"] = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // pf)), generator=g, dtype=torch.int32)
            tensors[f"{m}.weight_scale"] = (torch.rand(n, groups, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
            tensors[f"{m}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not symmetric:
                tensors[f"{m}.weight_zero_point"] = torch.randint(-(2**31), 2**31 - 1, (-(-n // pf), groups), generator=g, dtype=torch.int32)
            if actorder == "group":
                tensors[f"{m}.weight_g_idx"] = (torch.arange(k, dtype=torch.int32) // group_size)[torch.randperm(k, generator=g)]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    weights = {"num_bits": num_bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "group" if group_size > 0 else "channel", "group_size": group_size}
    if actorder:
        weights["actorder"] = actorder
    weights.update(extra_weights or {})
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "moe_intermediate_size": intermediate, "num_experts": num_experts, "num_experts_per_tok": 1,
        "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 64, "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                          "weights": weights, "format": "pack-quantized"}},
            "ignore": [],
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
