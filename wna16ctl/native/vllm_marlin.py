"""vLLM's compiled Marlin MoE GEMM, called on the weights, scales and zero points that
`wna16ctl.layout.marlin` writes: the check that the layout is the one vLLM's kernel reads, and
the kernel the GPU benchmark measures ours against.

The library is vLLM's `_moe_C` extension (`vllm/_moe_C_stable_libtorch.abi3.so` in a vLLM wheel,
built against torch's stable ABI): an installed vLLM's copy, or a path to one. Loading it
registers `torch.ops._moe_C.moe_wna16_marlin_gemm`. Everything here but the call itself runs on
the CPU: the routing metadata (`moe_align`), the weight type ids, the argument list (checked
against the op's schema before each call).

Facts taken from vLLM 0.33.0 (its python sources and the schema the library registers):
* the kernel walks `sorted_token_ids` in blocks of `moe_block_size` rows, each block of one
  expert (`expert_ids[block]`); an expert's slot list is padded to a whole number of blocks with
  the value M * top_k; only the first `num_tokens_post_padded` entries are read;
* weight types are ids of vLLM's ScalarType: GPTQ-style unsigned codes with a bias (uint4b8,
  uint8b128) without zero points, and uint4 with runtime zero points (no 8-bit zero-point type);
* the workspace is zeroed int32 locks, 4 per SM.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

# the op's parameters in order (vLLM 0.33.0); `call_args` fills them, `schema_mismatch` compares
# them with what the loaded library registered before any call
ARG_NAMES = (
    "a", "c_or_none", "b_q_weight", "b_bias_or_none", "b_scales", "a_scales", "global_scale", "b_zeros_or_none",
    "workspace", "sorted_token_ids", "expert_ids", "num_tokens_past_padded", "topk_weights", "moe_block_size",
    "top_k", "mul_topk_weights", "b_type_id", "size_m", "size_n", "size_k", "use_atomic_add", "use_fp32_reduce",
    "is_zp_float", "thread_k", "thread_n", "blocks_per_sm",
)
LOCKS_PER_SM = 4
BLOCK_SIZES = (8, 16, 32, 48, 64)
LIBRARY_NAME = "_moe_C_stable_libtorch.abi3.so"


def scalar_type_id(bits: int, bias: int) -> int:
    """vLLM's ScalarType id of an unsigned integer type of `bits` bits stored with `bias` (8 for
    int4 GPTQ codes, 128 for int8, 0 with zero points). Its bit fields, low to high: exponent (8
    bits, 0 for integers), mantissa (8: the size in bits), signed (1), bias (32), finite values
    only (1), NaN representation (8: IEEE 754 = 1, the class default)."""
    return bits << 8 | bias << 17 | 1 << 50


def weight_type_id(bits: int, zero_points: bool) -> Optional[int]:
    """The type id for our codes, or None where vLLM's Marlin has no such type (8-bit with zero
    points)."""
    if zero_points:
        return scalar_type_id(4, 0) if bits == 4 else None
    return scalar_type_id(bits, 1 << (bits - 1))


def block_size(m: int, top_k: int, experts: int) -> int:
    """The block height vLLM's fused Marlin MoE picks for M tokens: the smallest whose blocks
    would be less than 90 % full on average, else the largest."""
    for size in BLOCK_SIZES:
        if m * top_k / experts / size < 0.9:
            return size
    return BLOCK_SIZES[-1]


def moe_align(topk_ids: Tensor, block: int, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Routing metadata for the Marlin MoE kernel from topk_ids [M, top_k] (expert per slot):

    * sorted_token_ids int32 [M*top_k + E*(block-1)]: the slots (token * top_k + j) grouped by
      expert, ascending within an expert, each expert's run padded with M*top_k to a multiple of
      `block`; the tail past the last block is padding too;
    * expert_ids int32 [len(sorted_token_ids) // block]: the expert of each block (-1 past the
      used blocks);
    * num_tokens_post_padded int32 [1]: the used length of sorted_token_ids.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    slots = flat.numel()
    device = topk_ids.device
    counts = torch.bincount(flat, minlength=experts)
    blocks = (counts + block - 1) // block
    padded_start = torch.cumsum(blocks * block, 0) - blocks * block  # where each expert's run begins
    first_slot = torch.cumsum(counts, 0) - counts  # its first slot in expert-sorted order
    order = torch.argsort(flat, stable=True)  # slots by expert, ascending within one
    expert_of = flat[order]
    position = padded_start[expert_of] + torch.arange(slots, device=device) - first_slot[expert_of]
    capacity = slots + experts * (block - 1)
    sorted_ids = torch.full((capacity,), slots, dtype=torch.int32, device=device)
    sorted_ids[position] = order.to(torch.int32)
    used_blocks = int(blocks.sum())
    expert_ids = torch.full((capacity // block,), -1, dtype=torch.int32, device=device)
    expert_ids[:used_blocks] = torch.repeat_interleave(torch.arange(experts, device=device, dtype=torch.int32),
                                                       blocks)
    post_padded = torch.tensor([used_blocks * block], dtype=torch.int32, device=device)
    return sorted_ids, expert_ids, post_padded


def call_args(*, a: Tensor, b_q: Tensor, scales: Tensor, zero_points: Optional[Tensor], topk_ids: Tensor,
              topk_weights: Optional[Tensor], bits: int, workspace: Tensor, out: Optional[Tensor] = None,
              block: Optional[int] = None) -> list[tuple[str, Any]]:
    """The op's arguments, named and in order, for a = [M, K] activations, our Marlin-layout
    b_q [E, K/16, N*16/pf], scales [E, G, N] and zero points [E, G, N/pf] (or None), routing
    topk_ids [M, top_k] and router weights [M, top_k] (None: not applied)."""
    m, k = a.shape
    experts, n, top_k = b_q.shape[0], scales.shape[-1], topk_ids.shape[1]
    type_id = weight_type_id(bits, zero_points is not None)
    if type_id is None:
        raise ValueError(f"vLLM's Marlin MoE has no {bits}-bit type with zero points")
    block = block or block_size(m, top_k, experts)
    sorted_ids, expert_ids, post_padded = moe_align(topk_ids, block, experts)
    weights = (topk_weights if topk_weights is not None else torch.ones(m, top_k, device=a.device))
    values = (a, out, b_q, None, scales, None, None, zero_points, workspace, sorted_ids, expert_ids, post_padded,
              weights.to(torch.float32).contiguous(), block, top_k, topk_weights is not None, type_id, m, n, k,
              False, True, False, -1, -1, -1)
    return list(zip(ARG_NAMES, values))


def new_workspace(device: torch.device) -> Tensor:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms * LOCKS_PER_SM, dtype=torch.int32, device=device)


def _value_kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return "Tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return type(value).__name__


def schema_mismatch(schema: Any, args: Sequence[tuple[str, Any]]) -> Optional[str]:
    """Why `args` do not fit `schema` (a torch FunctionSchema), or None: the names in order, each
    value of the argument's type (None only where the type is optional)."""
    params = list(schema.arguments)
    if [p.name for p in params] != [name for name, _ in args]:
        return (f"the library's {schema.name} takes ({', '.join(p.name for p in params)}), "
                f"this check builds ({', '.join(name for name, _ in args)})")
    for p, (name, value) in zip(params, args):
        kind, declared = _value_kind(value), str(p.type)
        optional = declared.endswith("?") or declared.startswith("Optional[")
        base = declared.rstrip("?").removeprefix("Optional[").removesuffix("]")
        if kind == "None" and not optional or kind != "None" and kind != base:
            return f"{name}: {declared} expected, {kind} given"
    return None


def find_library(explicit: Optional[str] = None) -> tuple[Optional[Path], str]:
    """The library to load and where it was found, or (None, why not): `explicit` (a path to the
    .so, or a directory holding it), then $WNA16CTL_VLLM_MOE_LIB, then an importable vLLM's."""
    for given, origin in ((explicit, "--vllm-moe-lib"), (os.environ.get("WNA16CTL_VLLM_MOE_LIB"),
                                                           "$WNA16CTL_VLLM_MOE_LIB")):
        if given:
            path = Path(given)
            if path.is_dir():
                path = path / LIBRARY_NAME
            if not path.is_file():
                return None, f"{origin} {given}: no such file"
            return path, origin
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "no vLLM installed and no --vllm-moe-lib PATH to vllm/_moe_C_stable_libtorch.abi3.so"
    root = Path(list(spec.submodule_search_locations)[0])
    found = sorted(glob.glob(str(root / "_moe_C*.so")))
    if not found:
        return None, f"the installed vLLM ({root}) has no _moe_C library"
    return Path(found[0]), "the installed vLLM"


def load(explicit: Optional[str] = None) -> tuple[Optional[Any], str]:
    """torch.ops._moe_C.moe_wna16_marlin_gemm after loading the library, or (None, why not)."""
    path, origin = find_library(explicit)
    if path is None:
        return None, origin
    try:
        torch.ops.load_library(str(path))
        op = torch.ops._moe_C.moe_wna16_marlin_gemm
    except Exception as exc:  # whatever a foreign library raises on loading: the check does not run
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return None, f"{path} ({origin}) did not load: {first[:300]}"
    return op, f"{path} ({origin})"
