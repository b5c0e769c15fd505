"""Write a large but valid `pack-quantized` MoE checkpoint with random codes, quickly.

Quantizing gigabytes with compressed-tensors takes far longer than the repack being measured, so
the benchmark checkpoint holds random codes and scales in the exact on-disk form (same names,
dtypes, shapes, config) as a compressed-tensors W4A16 Qwen3-MoE checkpoint.

    python bench/synthetic_checkpoint.py OUT [--layers 4] [--experts 128] [--hidden 2048] [--intermediate 768]
                                             [--vocab 4096] [--top-k K] [--engine] [--group-size 128]
                                             [--experts-per-shard N] [--gptq]

--top-k is the number of experts each token is routed to (`num_experts_per_tok`): by default
Qwen3-30B-A3B's 8, or every expert when there are fewer.

--gptq writes the experts as a GPTQ checkpoint instead (GPTQModel's v1 storage, sym, no act-order,
float16 scales): the same random codes, put in GPTQ's stored form by the GPTQ format's own
`stored_form`, and the quantization_config GPTQModel writes.

--engine also writes what an engine needs to build and run the model (attention, the full
Qwen3-MoE config with Qwen3-30B-A3B's head counts); without it the checkpoint holds the expert
and router tensors a repack reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write(out: Path, *, layers: int = 4, experts: int = 128, hidden: int = 2048, intermediate: int = 768,
          num_bits: int = 4, group_size: int = 128, vocab: int = 4096, seed: int = 0, engine: bool = False,
          top_k: int | None = None, experts_per_shard: int | None = None, gptq: bool = False) -> Path:
    top_k = default_top_k(experts) if top_k is None else top_k
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the {experts} experts")
    out.mkdir(parents=True, exist_ok=True)
    pf = 32 // num_bits
    g = torch.Generator().manual_seed(seed)
    quant = _gptq_quant(num_bits, group_size) if gptq else None
    weight_map: dict[str, str] = {}
    total = 0
    # a layer's experts in slices of `experts_per_shard`, so that the writer holds one shard's tensors
    per = experts_per_shard or experts
    slices = [(L, range(e0, min(e0 + per, experts))) for L in range(layers) for e0 in range(0, experts, per)]
    shards = len(slices) + 1
    for s in range(shards):
        tensors: dict[str, torch.Tensor] = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16)
            tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            tensors["lm_head.weight"] = (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16)
        else:
            L, chosen = slices[s - 1]
            p = f"model.layers.{L}"
            if chosen.start == 0:
                tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
                tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
                tensors[f"{p}.mlp.gate.weight"] = (torch.randn(experts, hidden, generator=g) * 0.02).to(torch.bfloat16)
                if engine:
                    tensors |= _attention(p, hidden, g)
            for e in chosen:
                for proj, (n, k) in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                                     ("down_proj", (hidden, intermediate))):
                    m = f"{p}.mlp.experts.{e}.{proj}"
                    codes = torch.randint(-(2**31), 2**31 - 1, (n, k // pf), generator=g, dtype=torch.int32)
                    scales = torch.rand(n, k // group_size, generator=g) * 1e-3 + 1e-4
                    if quant is None:
                        tensors[f"{m}.weight_packed"] = codes
                        tensors[f"{m}.weight_scale"] = scales.to(torch.bfloat16)
                        tensors[f"{m}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
                    else:
                        tensors |= _gptq_tensors(quant, m, codes, scales)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "moe_intermediate_size": intermediate, "num_experts": experts, "num_experts_per_tok": top_k,
        "num_hidden_layers": layers, "vocab_size": vocab, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        "norm_topk_prob": True,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "version": "0.20.1",
            "config_groups": {"group_0": {
                "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                "weights": {"num_bits": num_bits, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": group_size, "dynamic": False},
                "format": "pack-quantized"}},
            "ignore": ["lm_head"],
        },
    }
    if quant is not None:
        config["quantization_config"] = quant[1]
    # the engine reads the model's shape from config.json (wna16ctl refuses a config without it)
    config["num_attention_heads"] = HEADS
    if engine:
        config = _engine_config(config, layers=layers, experts=experts, hidden=hidden, intermediate=intermediate,
                                vocab=vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _gptq_quant(num_bits: int, group_size: int) -> tuple[Any, dict, Any]:
    """(the GPTQ format, the quantization_config GPTQModel writes (v1, sym, no act-order), the
    scheme of every expert projection as the format reads that config)."""
    from wna16ctl.sources.formats import gptq

    qc = {"bits": num_bits, "group_size": group_size, "desc_act": False, "sym": True, "lm_head": False,
          "quant_method": gptq.QUANT_METHOD, "format": gptq.V1, "checkpoint_format": gptq.V1, "pack_dtype": "int32"}
    fmt, where = gptq.FORMAT, Path("config.json")
    resolve = fmt.resolver(fmt.parse_config(qc, where), qc, where)
    scheme = resolve(["model.layers.0.mlp.experts.0.gate_proj"])[0]
    return fmt, qc, scheme


def _gptq_tensors(quant: tuple[Any, dict, Any], module: str, codes: torch.Tensor,
                  scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """One projection's canonical codes and scales in GPTQ's stored form, by stored name."""
    from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS

    fmt, _, scheme = quant
    stored = fmt.stored_form({CODES: codes, SCALES: scales.to(torch.float16)}, scheme)
    return {fmt.names.tensor(module, role): stored[role] for role in (CODES, ZERO_POINTS, SCALES, G_IDX)
            if role in stored}


# Qwen3-30B-A3B routes each token to 8 experts
TOP_K = 8


def default_top_k(experts: int) -> int:
    """Qwen3-30B-A3B's top-k, or every expert of a smaller checkpoint (a config whose top-k exceeds
    its expert count is refused by inspect, as by transformers and vLLM)."""
    return min(TOP_K, experts)


# Qwen3-30B-A3B's attention: 32 query heads, 4 key/value heads of 128
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def _attention(prefix: str, hidden: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    tensors = {f"{prefix}.self_attn.{name}.weight": (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}
    tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
    tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
    return tensors


def _engine_config(config: dict, *, layers: int, experts: int, hidden: int, intermediate: int, vocab: int) -> dict:
    """The full Qwen3-MoE config an engine builds the model from (the demo's, which owns the
    architecture's fields), with this checkpoint's sizes and Qwen3-30B-A3B's attention."""
    from wna16ctl.demo import DemoSpec, model_config

    spec = DemoSpec(arch="qwen3_moe", num_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                    num_experts=experts, top_k=config["num_experts_per_tok"], vocab_size=vocab)
    return model_config(spec) | {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                 "quantization_config": config["quantization_config"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=None,
                    help=f"experts per token (num_experts_per_tok); default min({TOP_K}, --experts)")
    ap.add_argument("--engine", action="store_true", help="also attention and the full config, for an engine")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--experts-per-shard", type=int, default=None,
                    help="split each layer's experts over shards of this many (the writer holds one shard)")
    ap.add_argument("--gptq", action="store_true", help="a GPTQ checkpoint (v1, sym, float16 scales) of the same codes")
    a = ap.parse_args()
    if a.top_k is not None and not 1 <= a.top_k <= a.experts:
        ap.error(f"--top-k {a.top_k} must be between 1 and --experts ({a.experts})")
    p = write(a.out, layers=a.layers, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate, vocab=a.vocab,
              engine=a.engine, top_k=a.top_k, group_size=a.group_size, experts_per_shard=a.experts_per_shard, gptq=a.gptq)
    size = sum(f.stat().st_size for f in p.iterdir())
    print(f"wrote {p}: {size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
