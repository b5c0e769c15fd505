"""A conformance case as a checkpoint on disk, read back through wna16ctl's own reader.

`quantization_config(case)` is the config both sides get: the case's scheme as an llm-compressor
W{4,8}A16 export writes it (group_0, targets Linear), plus the case's extra config groups (a
second scheme for the experts, act-order in attention only, a group for modules the model does
not have).  `write_case(case, dir)` writes it as `config.json` with the header of one sparse
safetensors shard holding one Qwen3-MoE decoder layer; `planner_via_reader(case, version)`
opens that directory with `open_checkpoint` (the CLI's path: config parsing, target matching,
header scan, MoE discovery) and plans its layer, after the checkpoint-level config-parse check.
"""

from __future__ import annotations

import copy
import json
import struct
import tempfile
from pathlib import Path
from typing import Any

PREFIX = "model.layers.0.mlp.experts"
_BYTES = {"I32": 4, "BF16": 2, "I64": 8}


def _weights(case: dict[str, Any]) -> dict[str, Any]:
    group_size: int | None = case["group_size"]
    if case["strategy"] == "channel" and case.get("group_size_null", False):
        group_size = None
    return {"num_bits": case["num_bits"], "type": "int", "symmetric": case["symmetric"], "strategy": case["strategy"],
            "group_size": group_size, "actorder": case["actorder"], "dynamic": False, "observer": "minmax",
            "block_structure": None}


# group_0's targets: the class Linear (llm-compressor's default), or patterns that name the
# checkpoint's own expert projections only (w1/w3/w2 for Mixtral names), plus `lm_head` by name
# where the case asks for it
EXPERT_NAME_TARGETS = {"gate_up_down": r"re:.*experts\.\d+\.(gate_proj|up_proj|down_proj)$",
                       "w1_w3_w2": r"re:.*experts\.\d+\.w[123]$"}
PROJ_NAMES = {"gate_up_down": ("gate_proj", "up_proj", "down_proj"), "w1_w3_w2": ("w1", "w3", "w2")}


def quantization_config(case: dict[str, Any]) -> dict[str, Any]:
    names = case.get("names", "gate_up_down")
    targets = ["Linear"] if case.get("targets", "Linear") == "Linear" else [EXPERT_NAME_TARGETS[names]]
    head = case.get("lm_head")  # None: lm_head is unquantized and ignored; "packed" / "packed+target"
    if head == "packed+target":
        targets.append("lm_head")
    groups = {"group_0": {"targets": targets, "weights": _weights(case), "input_activations": None,
                          "output_activations": None, "format": "pack-quantized"}}
    for i, extra in enumerate(case.get("extra_groups") or (), start=1):
        groups[f"group_{i}"] = {"targets": list(extra["targets"]), "weights": _weights({**case, **extra["weights"]}),
                                "input_activations": None, "output_activations": None, "format": "pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": [] if head else ["lm_head"], "kv_cache_scheme": None}


def expert_scheme(case: dict[str, Any]) -> dict[str, Any]:
    """The weights the experts get: the last extra group that targets them by regex (a regex
    target outranks the class name Linear), else group_0's."""
    chosen = {}
    for extra in case.get("extra_groups") or ():
        if any(t.startswith("re:") and "experts" in t for t in extra["targets"]):
            chosen = extra["weights"]
    return {**case, **chosen}


def packed_words(codes: int, bits: int, packing: str) -> int:
    """int32 words holding `codes` codes of `bits` bits: dense (compressed-tensors >= 0.20) or
    32 // bits whole codes per word (older releases)."""
    return -(-codes * bits // 32) if packing == "dense" else -(-codes // (32 // bits))


def pack_rows(codes, bits: int, packing: str):
    """int32 words of each row of `codes` (int64 tensor of unsigned codes), LSB first, in a packing."""
    import torch

    rows, n = codes.shape
    if packing == "dense":
        words = packed_words(n, bits, "dense")
        acc = torch.zeros(rows, words + 1, dtype=torch.int64)
        for j in range(n):  # code j occupies bits [j*bits, (j+1)*bits) of the row's bit string
            w, off = divmod(j * bits, 32)
            acc[:, w] |= (codes[:, j] << off) & 0xFFFFFFFF
            if off + bits > 32:
                acc[:, w + 1] |= codes[:, j] >> (32 - off)
        acc = acc[:, :words]
    else:
        pf = 32 // bits
        words = packed_words(n, bits, "word")
        padded = torch.zeros(rows, words * pf, dtype=torch.int64)
        padded[:, :n] = codes
        acc = torch.zeros(rows, words, dtype=torch.int64)
        for j in range(pf):
            acc |= padded[:, j::pf] << (bits * j)
    return ((acc + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # the int32 bit pattern


def unpack_rows(words, bits: int, packing: str):
    """The codes `pack_rows` wrote (every code the words can hold), as an int64 tensor."""
    import torch

    w = words.to(torch.int64) & 0xFFFFFFFF
    rows, nw = w.shape
    mask = (1 << bits) - 1
    if packing == "word":
        pf = 32 // bits
        return torch.stack([(w >> (bits * j)) & mask for j in range(pf)], dim=-1).reshape(rows, -1)
    n = nw * 32 // bits
    ext = torch.cat([w, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
    out = torch.empty(rows, n, dtype=torch.int64)
    for j in range(n):
        i, off = divmod(j * bits, 32)
        out[:, j] = ((ext[:, i] >> off) | (ext[:, i + 1] << (32 - off))) & mask
    return out


def _projection(name: str, n: int, k: int, s: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
    bits, packing = s["num_bits"], s.get("packing", "dense")
    groups = -(-k // s["group_size"]) if s["strategy"] == "group" else 1
    out = [(f"{name}.weight_packed", "I32", [n, packed_words(k, bits, packing)]),
           (f"{name}.weight_scale", "BF16", [n, groups]), (f"{name}.weight_shape", "I64", [2])]
    if not s["symmetric"]:
        out.append((f"{name}.weight_zero_point", "I32", [packed_words(n, bits, packing), groups]))
    if s["strategy"] == "group" and s["actorder"] in ("group", "dynamic", True):  # true: the old form of group
        out.append((f"{name}.weight_g_idx", "I32", [k]))
    return out


def write_case(case: dict[str, Any], out: Path) -> Path:
    H, I, E = case["hidden_size"], case["intermediate_size"], case["num_experts"]
    s = expert_scheme(case)
    head = (_projection("lm_head", 64, H, {**case, "actorder": None}) if case.get("lm_head")
            else [("lm_head.weight", "BF16", [64, H])])
    tensors: list[tuple[str, str, list[int]]] = [
        ("model.embed_tokens.weight", "BF16", [64, H]), ("model.norm.weight", "BF16", [H]),
        *head, ("model.layers.0.mlp.gate.weight", "BF16", [E, H]),
        ("model.layers.0.input_layernorm.weight", "BF16", [H]),
        ("model.layers.0.post_attention_layernorm.weight", "BF16", [H]),
    ]
    for e in range(E):
        gate, up, down = PROJ_NAMES[case.get("names", "gate_up_down")]
        for proj, (n, k) in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
            tensors += _projection(f"{PREFIX}.{e}.{proj}", n, k, s)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, shape in tensors:
        size = _BYTES[dt]
        for d in shape:
            size *= d
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    out.mkdir(parents=True, exist_ok=True)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)
    # no attention tensors in this one-layer model (every module the config quantizes is an
    # expert), but a config.json without its heads is refused: vLLM would build transformers' default
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
              "num_hidden_layers": 1, "num_attention_heads": 16, "moe_intermediate_size": I, "intermediate_size": 4 * H, "num_experts": E,
              "num_experts_per_tok": min(2, E), "vocab_size": 64, "torch_dtype": "bfloat16",
              # renormalized top-k routing (what the worker's stand-in layer is given)
              "norm_topk_prob": True,
              "quantization_config": copy.deepcopy(quantization_config(case))}
    (out / "config.json").write_text(json.dumps(config))
    return out


def planner_via_reader(case: dict[str, Any], version: str):
    """(config refusal or None, the plan of the checkpoint's one MoE layer or None) for the case
    written to disk and read by `open_checkpoint`."""
    from wna16ctl.planning.config_parse import config_refusal
    from wna16ctl.planning.engine_env import make_switches
    from wna16ctl.planning.moe import plan_layer
    from wna16ctl.sources import open_checkpoint

    with tempfile.TemporaryDirectory(prefix="wna16ctl-case-") as tmp:
        ck = open_checkpoint(write_case(case, Path(tmp) / "ckpt"))
        refusal = config_refusal(ck.config.quant, version)
        (layer,) = ck.layers
        if refusal is not None:
            return refusal, None
        switches = make_switches(case.get("env") or {}, case.get("moe_backend", "auto"))
        return None, plan_layer(layer, case["tp"], case["ep"], version, case.get("gpu", "sm90"), switches)


def planner_head_quantized(case: dict[str, Any], version: str) -> bool:
    """Whether wna16ctl plans the case's packed lm_head as vLLM `version`'s quantized output
    projection (the reader's layer, then the linear planner's verdict for that release)."""
    from wna16ctl.planning.linear import plan_linear
    from wna16ctl.sources import open_checkpoint

    with tempfile.TemporaryDirectory(prefix="wna16ctl-case-") as tmp:
        ck = open_checkpoint(write_case(case, Path(tmp) / "ckpt"))
        (head,) = [lay for lay in ck.linear_layers if lay.kind == "lm_head"]
        plan = plan_linear(head, 1, version, case.get("gpu", "sm90"), "bfloat16")
        # "unquantized": no config group quantizes it at all; "built unquantized": vLLM's rules
        # for a ParallelLMHead leave it unquantized
        return plan.failure_rule not in ("unquantized", "built unquantized")
