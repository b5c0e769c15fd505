"""Checkpoints in the GPTQ, AWQ and AutoRound stored forms, built by hand for the readers' tests.

`header_only`: a whole model's headers at published sizes (tests/modelckpt.py's families, their
Linears turned into qweight/qzeros/scales/g_idx in the stored form's shapes).  `tiny`: a one-layer
Qwen3-MoE with real data, each expert projection stored from random canonical tensors by a packer
written here (independent of the package), so a test can compare what the reader gives back.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from tests import modelckpt

# Qwen's GPTQ/AWQ checkpoints quantize attention and experts, and keep the router, the embedding
# and the head in float
_KEPT = re.compile(r"(^|\.)(mlp\.gate|shared_expert_gate|block_sparse_moe\.gate|lm_head|embed_tokens)$")


def _qweight_tensors(module: str, n: int, k: int, form: str, bits: int, group: int) -> Iterator[modelckpt.Tensor]:
    g = -(-k // group) if group > 0 else 1
    if form == "awq":
        yield f"{module}.qweight", "I32", [k, n // 8]
        yield f"{module}.qzeros", "I32", [g, n // 8]
        yield f"{module}.scales", "BF16", [g, n]
        return
    yield f"{module}.qweight", "I32", [k * bits // 32, n]
    yield f"{module}.qzeros", "I32", [g, n * bits // 32]
    yield f"{module}.scales", "BF16", [g, n]
    yield f"{module}.g_idx", "I32", [k]


def header_only(out: Path, config: dict[str, Any], quantization_config: dict[str, Any], *, form: str = "gptq",
                bits: int = 4, group: int = 128, family=modelckpt.qwen3_moe, shards: int = 1,
                side_file: bool = False, keep: str | None = None) -> Path:
    """A header-only checkpoint of `config`'s family in a qweight form; `side_file`: the
    quantization config in quantize_config.json instead of config.json; `keep`: a pattern of
    further modules stored in float (those the quantization config leaves out)."""
    config = dict(config)
    config.pop("quantization_config", None)
    items: list[modelckpt.Tensor] = []
    for name, dt, shape in family(config, None):
        module = name[: -len(".weight")]
        kept = _KEPT.search(module) or (keep is not None and re.search(keep, module))
        if name.endswith(".weight") and len(shape) == 2 and not kept:
            items += _qweight_tensors(module, shape[0], shape[1], form, bits, group)
        else:
            items.append((name, dt, shape))
    if not side_file:
        config["quantization_config"] = quantization_config
    modelckpt.write(out, config, iter(items), shards=shards)
    if side_file:
        (out / "quantize_config.json").write_text(json.dumps(quantization_config, indent=1))
    return out


def fill_symmetric_zero_points(ck: Path) -> None:
    """A header-only checkpoint's data is zeros; GPTQ v1 symmetric qzeros hold the midpoint minus
    one (0x77777777 at 4 bits), which the reader checks where it reads data."""
    shard = ck / "model.safetensors"
    with open(shard, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        for name, e in header.items():
            if name.endswith(".qzeros"):
                start, end = e["data_offsets"]
                f.seek(8 + size + start)
                f.write(b"\x77" * (end - start))


# -- an independent packer, for the tiny checkpoints with data ------------------------------------
def bitstream_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R, ceil(C·bits/32)] int32, LSB-first bit stream per row (plain Python ints)."""
    rows = []
    for row in codes.tolist():
        acc, nbits, words = 0, 0, []
        for i, c in enumerate(row):
            acc |= (int(c) & ((1 << bits) - 1)) << (i * bits)
        nbits = len(row) * bits
        for w in range(-(-nbits // 32)):
            v = (acc >> (32 * w)) & 0xFFFFFFFF
            words.append(v - (1 << 32) if v >= 1 << 31 else v)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit codes -> [R, N/8] AWQ words: slot j of word w holds column 8w + (0,2,4,6,1,3,5,7)[j]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    out = []
    for row in codes.tolist():
        words = []
        for w in range(len(row) // 8):
            v = sum((int(row[8 * w + order[j]]) & 0xF) << (4 * j) for j in range(8))
            words.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(words)
    return torch.tensor(out, dtype=torch.int32)


def random_projection(n: int, k: int, bits: int, group: int, *, symmetric: bool, act_order: bool,
                      seed: int, zmin: int = 0) -> dict[str, torch.Tensor]:
    """Logical tensors of one projection: codes [N, K], zeros [N, G] (None when symmetric), scales
    [N, G] (bfloat16), g_idx [K] (a permutation of whole groups under act-order, else k // group)."""
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // group) if group > 0 else 1
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    zeros = None if symmetric else torch.randint(zmin, 1 << bits, (n, g), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, g, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    g_idx = (torch.arange(k, dtype=torch.int32) // group) if group > 0 else torch.zeros(k, dtype=torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {"codes": codes, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def store(p: dict[str, torch.Tensor], form: str, bits: int) -> dict[str, torch.Tensor]:
    """One projection's logical tensors in a stored form: "gptq" (v1), "gptq_v2" or "awq"."""
    codes, zeros, scales = p["codes"], p["zeros"], p["scales"]
    n, g = scales.shape
    z = zeros if zeros is not None else torch.full((n, g), 1 << (bits - 1), dtype=torch.int32)
    if form == "awq":
        return {"qweight": awq_pack(codes.t()), "qzeros": awq_pack(z.t()), "scales": scales.t().contiguous()}
    stored_z = z - 1 if form == "gptq" else z
    return {"qweight": bitstream_pack(codes, bits).t().contiguous(), "qzeros": bitstream_pack(stored_z.t(), bits),
            "scales": scales.t().contiguous(), "g_idx": p["g_idx"].clone()}


def tiny(out: Path, quantization_config: dict[str, Any], *, form: str, bits: int = 4, group: int = 32,
         symmetric: bool = True, act_order: bool = False, hidden: int = 64, intermediate: int = 96,
         experts: int = 2) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A one-layer Qwen3-MoE with real data; the logical tensors of each expert projection by module."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, hidden, generator=gen).to(torch.bfloat16),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(experts, hidden, generator=gen).to(torch.bfloat16),
    }
    logical = {}
    seed = 0
    for e in range(experts):
        for proj, (n, k) in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                             ("down_proj", (hidden, intermediate))):
            module = f"model.layers.0.mlp.experts.{e}.{proj}"
            seed += 1
            p = random_projection(n, k, bits, group, symmetric=symmetric, act_order=act_order, seed=seed,
                                  zmin=1 if form == "gptq" else 0)
            logical[module] = p
            tensors.update({f"{module}.{s}": t for s, t in store(p, form, bits).items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "moe_intermediate_size": intermediate, "num_experts": experts, "num_experts_per_tok": 1,
        "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 64, "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6, "quantization_config": quantization_config,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, logical
