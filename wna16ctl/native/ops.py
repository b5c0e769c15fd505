"""Native kernels: the `wna16ctl::*` torch ops over the libraries in `kernels/`, which
`wna16ctl.native.build` builds and loads without torch (its API is re-exported here).

Two shared libraries are compiled on first use into a per-user cache
(`$XDG_CACHE_HOME/wna16ctl` or `~/.cache/wna16ctl`), keyed by a hash of the sources, the compiler
and the target, built in a temporary directory and renamed into place (concurrent first uses are
safe), and loaded with ctypes:

* the host library (g++): the fast multi-threaded CPU Marlin repack and index queries;
* the CUDA library (nvcc): repack, scale / zero-point permutation and the MoE GEMM (the fast
  Marlin-style kernel of `moe_gemm_v2.cu`, with the simple kernel of `moe_gemm.cu` kept as the
  reference and for what the fast ones do not take, and the one-launch kernel of `moe_gemm_v3.cu`,
  the first choice in its fast mode; `$WNA16CTL_GEMM_KERNEL` picks one).

Nothing here is required: without g++ / nvcc / a GPU, or with `WNA16CTL_NO_NATIVE=1`, every
entry point falls back to the torch code of `wna16ctl.layout` after one logged notice. The CPU
implementations of the torch ops *are* that torch code, so CPU results define correctness and
the native paths are checked against them bit for bit (repack) or against an fp32 reference
(GEMM).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Callable, Optional, Sequence, overload

import torch
from torch import Tensor

from wna16ctl.layout import marlin as marlin_layout
from wna16ctl.native import simd
from wna16ctl.native.build import (  # noqa: F401 - the build and load API, re-exported
    ABI_VERSION,
    HOST_SOURCES,
    CUDA_SOURCES,
    WNA16_OK,
    KernelBuildError,
    KernelError,
    NativeLib,
    build_cuda,
    build_host,
    cache_dir,
    cuda_available,
    cuda_lib,
    detect_archs,
    find_cxx,
    find_nvcc,
    host_lib,
    kernels_dir,
    native_disabled,
    native_host_available,
    _build_dir,
    _digest,
    _libs,
    _load,
    _notice,
    _run,
    _tool_version,
)

log = logging.getLogger(__name__)

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
GEMM_VARIANTS = {"auto": 0, "fma": 1, "mma": 2}
# the v2 kernel also takes a forced tile height (rows of sorted slots per tile)
GEMM_V2_TILES = {"tile16": 16, "tile32": 32, "tile64": 64}
# auto = v3 where it applies (the fast mode: no act-order, scale groups of whole 64-row stages)
# and its tile is not the 64 x 64 one, else v2, else v1. v3 is first because none of its sm_80 /
# sm_90 instances spills (tests/native/test_kernels.py) and the roofline model has it ahead of v2
# at M = 1, 16 and 64 on H100 and H200 -- the 16 x 256 tile -- and with the 32 x 128 tile
# (bench/roofline.py, tests/test_roofline.py); with the 64 x 64 tile (more than 32 sorted rows per
# expert) the model has v2 ahead, so auto keeps v2 there. v3's output equals v2's bit for bit
# (tests/native/test_emu_gemm_v3.py). No GPU has measured it yet (docs/performance.md, "GEMM
# kernel"); WNA16CTL_GEMM_KERNEL=v2 keeps v2 everywhere.
GEMM_KERNELS = ("auto", "v1", "v2", "v3")
FAST_GEMM_ORDER = {"v3": ("v3", "v2"), "v2": ("v2",), "v1": ()}


def fast_gemm_order(which: str, num_sorted: int, num_experts: int, variant: int) -> tuple[str, ...]:
    """The fast kernels to try in order for WNA16CTL_GEMM_KERNEL=`which` (v1 follows them). auto:
    v3 then v2, except where the tile has 64 rows (forced, or the launchers' choice for more than
    32 sorted rows per expert: kernels/moe_gemm_v3.cu make_config), where only v2."""
    if which != "auto":
        return FAST_GEMM_ORDER[which]
    if variant in GEMM_V2_TILES.values():
        rows = variant
    else:
        per_expert = -(-num_sorted // num_experts) if num_experts else 0
        rows = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return ("v2",) if rows == 64 else ("v3", "v2")
WNA16_ENOTSUP = 3


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


# ----------------------------------------------------------------------------------------------
# shape helpers


def _repack_dims(packed: Tensor, num_bits: int) -> tuple[int, int, int]:
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    if packed.dtype != torch.int32 or packed.ndim < 2:
        raise ValueError(f"packed weights must be int32 [..., K/pf, N], got {packed.dtype} {tuple(packed.shape)}")
    pf = 32 // num_bits
    experts = 1
    for d in packed.shape[:-2]:
        experts *= d
    return experts, packed.shape[-2] * pf, packed.shape[-1]


def _marlin_shape(packed: Tensor, num_bits: int) -> tuple[int, ...]:
    _, k, n = _repack_dims(packed, num_bits)
    return (*packed.shape[:-2], k // 16, n * 16 // (32 // num_bits))


def _perm_int32(perm: Optional[Tensor], packed: Tensor, size_k: int) -> Optional[Tensor]:
    if perm is None:
        return None
    if perm.shape[:-1] != packed.shape[:-2] or perm.shape[-1] != size_k:
        raise ValueError(f"perm shape {tuple(perm.shape)} does not match {tuple(packed.shape[:-2])} + ({size_k},)")
    if perm.numel() and (int(perm.min()) < 0 or int(perm.max()) >= size_k):
        raise ValueError(f"perm values must lie in [0, {size_k})")
    # the same rule as the torch path: a gather by anything but a permutation loses rows
    flat = perm.reshape(-1, size_k)
    if flat.numel() and not torch.equal(torch.sort(flat, dim=-1).values,
                                        torch.arange(size_k, device=perm.device, dtype=perm.dtype).expand_as(flat)):
        raise ValueError("perm is not a permutation of range(size_k)")
    return perm.to(device=packed.device, dtype=torch.int32).contiguous()


# ----------------------------------------------------------------------------------------------
# repack: fast helpers


def marlin_repack_fast(
    packed: Tensor, num_bits: int, perm: Optional[Tensor] = None, *, out: Optional[Tensor] = None
) -> Tensor:
    """K-first packed int32 [..., K/pf, N] (+ act-order perm [..., K]) -> Marlin int32
    [..., K/16, N*16/pf], bit-identical to `wna16ctl.layout.marlin.marlin_repack`.

    CPU tensors use the native host library when available (multi-threaded, memory-bound), CUDA
    tensors the CUDA kernel; otherwise the torch code. `out` (contiguous int32 of the result's
    shape) lets a caller reuse one buffer: fresh pages cost about as much as the repack itself."""
    if packed.is_cuda:
        result = torch.ops.wna16ctl.marlin_repack(packed, num_bits, perm)
        return out.copy_(result) if out is not None else result
    lib = host_lib()
    if lib is None:
        from wna16ctl.layout.marlin import marlin_repack

        result = marlin_repack(packed, num_bits, perm)
        return out.copy_(result) if out is not None else result
    experts, size_k, size_n = _repack_dims(packed, num_bits)
    if size_k % 16 or size_n % 64:
        raise ValueError(f"size_k = {size_k} / size_n = {size_n} are not multiples of 16 / 64")
    shape = _marlin_shape(packed, num_bits)
    # Strided source and output are read/written in place (a transposed view of the checkpoint's
    # N-first words, a column block of a wider output): no copies on the hot path.
    src = packed.reshape(-1, *packed.shape[-2:]) if packed.ndim > 2 else packed.unsqueeze(0)
    p = _perm_int32(perm, packed, size_k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32)
    if tuple(out.shape) != shape or out.dtype != torch.int32 or out.is_cuda or out.stride(-1) != 1:
        raise ValueError(f"out must be a CPU int32 tensor of shape {shape} with unit stride in its last dim")
    out3 = out.view(-1, *out.shape[-2:]) if out.ndim > 2 else out.unsqueeze(0)
    lib.call("wna16_marlin_repack_host_strided", _ptr(src), _ptr(p), _ptr(out3), experts, size_k, size_n, num_bits,
             src.stride(0), src.stride(1), src.stride(2), out3.stride(0), out3.stride(1),
             simd.resolve()[0], torch.get_num_threads())  # WNA16CTL_SIMD: the vector tile loops for N-first sources
    return out


def marlin_unrepack_fast(
    marlin: Tensor, num_bits: int, size_k: int, size_n: int, perm: Optional[Tensor] = None
) -> Tensor:
    """Inverse of `marlin_repack_fast` (same contract as `layout.marlin.marlin_unrepack`)."""
    lib = None if marlin.is_cuda else host_lib()
    if lib is None:
        from wna16ctl.layout.marlin import marlin_unrepack

        return marlin_unrepack(marlin, num_bits, size_k, size_n, perm)
    pf = 32 // num_bits
    if marlin.dtype != torch.int32 or tuple(marlin.shape[-2:]) != (size_k // 16, size_n * 16 // pf):
        raise ValueError(f"marlin weight {marlin.dtype} {tuple(marlin.shape)} does not end in "
                         f"({size_k // 16}, {size_n * 16 // pf})")
    src = marlin.contiguous()
    out = torch.empty((*src.shape[:-2], size_k // pf, size_n), dtype=torch.int32)
    p = _perm_int32(perm, out, size_k)
    lib.call("wna16_marlin_unrepack_host", _ptr(src), _ptr(p), _ptr(out), out.numel() // max(1, size_k // pf * size_n),
             size_k, size_n, num_bits, torch.get_num_threads())
    return out


def marlin_untile_host(marlin: Tensor, out: Tensor, num_bits: int, size_k: int, size_n: int) -> bool:
    """The Marlin tile order undone on the CPU by kernels/untile.cpp, into the contiguous K-first
    `out`: True when done, False where it cannot run (no host library, not on the CPU), and the
    caller's torch code does it instead. One thread: verify runs experts side by side."""
    if marlin.device.type != "cpu" or not out.is_contiguous() or out.device.type != "cpu":
        return False
    lib = host_lib()
    if lib is None:
        return False
    src = marlin.contiguous()
    per_expert = size_k // (32 // num_bits) * size_n
    lib.call("wna16_marlin_untile_host", _ptr(src), _ptr(out), out.numel() // max(1, per_expert),
             size_k, size_n, num_bits)
    return True


# the layout's inverse un-tiles through the host library from now on, where it builds
marlin_layout.install_untile_accelerator(marlin_untile_host)


# ----------------------------------------------------------------------------------------------
# torch ops

_REGISTERED = hasattr(torch.ops, "wna16ctl") and hasattr(torch.ops.wna16ctl, "moe_wna16_gemm")


def _cpu_fallback(op_name: str, tensors: Sequence[Optional[Tensor]], fn: Callable[..., Tensor],
                  device: torch.device) -> Tensor:
    _notice(f"wna16ctl::{op_name}: CUDA kernels unavailable for {device}")
    moved = [None if t is None else t.cpu() for t in tensors]
    return fn(*moved).to(device)


def _repack_cpu(packed: Tensor, num_bits: int, perm: Optional[Tensor] = None) -> Tensor:
    from wna16ctl.layout.marlin import marlin_repack

    return marlin_repack(packed, num_bits, perm)


def _permute_scales_cpu(s: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
    from wna16ctl.layout.marlin import marlin_permute_scales

    return marlin_permute_scales(s, size_k, size_n, group_size)


def _zero_points_cpu(zp: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
    from wna16ctl.layout.marlin import marlin_zero_points

    return marlin_zero_points(zp, size_k, size_n, num_bits)


def _gemm_dims(a: Tensor, b_q: Tensor, scales: Tensor, num_bits: int, top_k: int) -> tuple[int, int, int, int]:
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits must be 4 or 8, got {num_bits}")
    if a.dtype not in DTYPE_CODES:
        raise ValueError(f"activations must be fp16 or bf16, got {a.dtype}")
    if scales.dtype != a.dtype:
        raise ValueError(f"scales dtype {scales.dtype} must equal the activation dtype {a.dtype}")
    if b_q.ndim != 3 or scales.ndim != 3 or a.ndim != 2:
        raise ValueError("expected a [M, K], b_q [E, K/16, N*16/pf], scales [E, G, N]")
    experts, size_k, size_n = b_q.shape[0], b_q.shape[1] * 16, scales.shape[2]
    if b_q.shape[2] != size_n * 16 // (32 // num_bits) or scales.shape[0] != experts:
        raise ValueError(f"b_q {tuple(b_q.shape)} and scales {tuple(scales.shape)} disagree")
    if a.shape[1] != size_k:
        raise ValueError(f"a has {a.shape[1]} columns, the weights have size_k = {size_k}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return experts, size_k, size_n, scales.shape[1]


def _check_gemm_extras(
    a: Tensor, b_q: Tensor, scales: Tensor, zero_points: Optional[Tensor], g_idx: Optional[Tensor],
    perm: Optional[Tensor], sorted_token_ids: Tensor, expert_offsets: Tensor,
    topk_weights: Optional[Tensor], top_k: int, num_bits: int, is_k_full: bool,
) -> None:
    """Shapes of the optional and routing inputs, the scale-group layout, and the index values:
    the CUDA kernel trusts them."""
    experts, size_k, size_n, groups = _gemm_dims(a, b_q, scales, num_bits, top_k)
    if zero_points is not None and tuple(zero_points.shape) != (experts, groups, size_n * num_bits // 32):
        raise ValueError(f"zero_points {tuple(zero_points.shape)} != {(experts, groups, size_n * num_bits // 32)}")
    for name, t in (("g_idx", g_idx), ("perm", perm)):
        if t is not None and tuple(t.shape) != (experts, size_k):
            raise ValueError(f"{name} {tuple(t.shape)} != {(experts, size_k)}")
    if (perm is None) != (g_idx is None):
        raise ValueError("act-order needs both g_idx and perm (or neither)")
    if sorted_token_ids.ndim != 1 or expert_offsets.shape != (experts + 1,):
        raise ValueError(f"sorted_token_ids must be 1-D and expert_offsets [{experts + 1}]")
    if topk_weights is not None and topk_weights.numel() != a.shape[0] * top_k:
        raise ValueError(f"topk_weights has {topk_weights.numel()} entries, expected {a.shape[0] * top_k}")
    if perm is not None and is_k_full and groups <= 1:
        raise ValueError("For act_order, num_groups must be > 1")
    if not (perm is not None and not is_k_full) and size_k % groups:
        raise ValueError(f"size_k = {size_k}, is not divisible by b_scales.size(1) = {groups}")
    if a.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # the value checks below read the tensors back; a graph capture cannot
    _check_gemm_values(g_idx, perm, sorted_token_ids, groups, size_k, a.shape[0] * top_k)


def _check_gemm_values(g_idx: Optional[Tensor], perm: Optional[Tensor], sorted_token_ids: Tensor,
                       groups: int, size_k: int, num_slots: int) -> None:
    """Index values the kernels would otherwise clamp or race on: a scale group outside the scales,
    a column outside K, a slot listed twice (two tiles would write the same output row)."""
    if g_idx is not None and g_idx.numel():
        lo, hi = int(g_idx.min()), int(g_idx.max())
        if lo < 0 or hi >= groups:
            raise ValueError(f"g_idx values lie in [{lo}, {hi}], outside [0, num_groups = {groups}) "
                             "of the scales: pass the scales g_idx refers to (all groups of the full K)")
    if perm is not None and perm.numel():
        lo, hi = int(perm.min()), int(perm.max())
        if lo < 0 or hi >= size_k:
            raise ValueError(f"perm values lie in [{lo}, {hi}], outside [0, size_k = {size_k})")
    ids = sorted_token_ids.reshape(-1).to(torch.int64)
    ids = ids[(ids >= 0) & (ids < num_slots)]  # the rest are padding sentinels
    if ids.numel():
        counts = torch.bincount(ids, minlength=num_slots)
        if int(counts.max()) > 1:
            slot = int(torch.argmax(counts))
            raise ValueError(f"sorted_token_ids lists slot {slot} {int(counts[slot])} times: each slot "
                             f"(token * top_k + j) may appear once; padding entries must be >= {num_slots}")


def _gemm_cpu(
    a: Tensor, b_q: Tensor, scales: Tensor, sorted_token_ids: Tensor, expert_offsets: Tensor, top_k: int,
    num_bits: int, zero_points: Optional[Tensor] = None, g_idx: Optional[Tensor] = None,
    perm: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, is_k_full: bool = True,
) -> Tensor:
    """Reference semantics of the MoE GEMM, in torch: Marlin layout -> codes (layout inverses),
    dequantise in the activation dtype, fp32 matmul, optional router weight, one rounding."""
    from wna16ctl.layout.marlin import marlin_unpermute_scales, marlin_unrepack, marlin_zero_points_inverse
    from wna16ctl.layout.packing import dequantize, unpack_codes

    experts, size_k, size_n, groups = _gemm_dims(a, b_q, scales, num_bits, top_k)
    _check_gemm_extras(a, b_q, scales, zero_points, g_idx, perm, sorted_token_ids, expert_offsets,
                       topk_weights, top_k, num_bits, is_k_full)
    # act-order with K split across ranks: the group of each row comes from g_idx (present iff perm is)
    gidx = g_idx if perm is not None and not is_k_full else None
    dtype = a.dtype
    num_slots = a.shape[0] * top_k
    out = torch.zeros(num_slots, size_n, dtype=dtype)
    ids = sorted_token_ids.to(torch.int64)
    offs = expert_offsets.to(torch.int64).clamp(0, ids.numel())
    # the producer's scale layout the kernel reads: grouped iff more than one scale row (§6.8)
    scale_gs = 1 if groups > 1 else -1
    logical_scales = marlin_unpermute_scales(scales, 2, size_n, scale_gs)
    zeros = None
    if zero_points is not None:
        zeros = unpack_codes(marlin_zero_points_inverse(zero_points, groups, size_n, num_bits),
                             num_bits, dim=-1, size=size_n)
    for e in range(experts):
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi <= lo:
            continue
        slots = ids[lo:hi]
        slots = slots[(slots >= 0) & (slots < num_slots)]
        if slots.numel() == 0:
            continue
        # rows stay in the Marlin (act-order sorted) order: no perm passed to the inverse
        codes = unpack_codes(marlin_unrepack(b_q[e], num_bits, size_k, size_n), num_bits, dim=0, size=size_k)
        if gidx is not None:
            grp = gidx[e].to(torch.int64)
        else:
            grp = torch.arange(size_k) // (size_k // groups)
        w = dequantize(codes, logical_scales[e], grp, num_bits, dtype, zeros[e] if zeros is not None else None)
        rows = a[slots // top_k]
        if perm is not None:
            rows = rows[:, perm[e].to(torch.int64)]
        acc = rows.float() @ w.float()
        if topk_weights is not None:
            acc = acc * topk_weights.reshape(-1)[slots].float().unsqueeze(1)
        out[slots] = acc.to(dtype)
    return out


def _repack_cuda(packed: Tensor, num_bits: int, perm: Optional[Tensor] = None) -> Tensor:
    lib = cuda_lib()
    if lib is None:
        return _cpu_fallback("marlin_repack", [packed, perm], lambda p, q: _repack_cpu(p, num_bits, q), packed.device)
    experts, size_k, size_n = _repack_dims(packed, num_bits)
    if size_k % 16 or size_n % 64:
        raise ValueError(f"size_k = {size_k} / size_n = {size_n} are not multiples of 16 / 64")
    src = packed.contiguous()
    p = _perm_int32(perm, src, size_k)
    out = torch.empty(_marlin_shape(src, num_bits), dtype=torch.int32, device=src.device)
    with torch.cuda.device(src.device):
        lib.call("wna16_cuda_marlin_repack", _ptr(src), _ptr(p), _ptr(out), experts, size_k, size_n,
                 num_bits, _stream(src))
    return out


def _permute_scales_cuda(s: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
    lib = cuda_lib()
    if lib is None:
        return _cpu_fallback("marlin_permute_scales", [s],
                             lambda x: _permute_scales_cpu(x, size_k, size_n, group_size), s.device)
    if s.shape[-1] != size_n or s.element_size() not in (2, 4):
        raise ValueError(f"scales {s.dtype} {tuple(s.shape)} do not end in size_n = {size_n}")
    src = s.contiguous()
    out = torch.empty_like(src)
    grouped = int(group_size != -1 and group_size < size_k)
    with torch.cuda.device(src.device):
        lib.call("wna16_cuda_permute_scales", _ptr(src), _ptr(out), src.numel() // max(size_n, 1), size_n,
                 src.element_size(), grouped, _stream(src))
    return out


def _zero_points_cuda(zp: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
    lib = cuda_lib()
    if lib is None:
        return _cpu_fallback("marlin_zero_points", [zp],
                             lambda x: _zero_points_cpu(x, size_k, size_n, num_bits), zp.device)
    pf = 32 // num_bits
    if zp.dtype != torch.int32 or zp.shape[-1] * pf != size_n:
        raise ValueError(f"zero points {zp.dtype} {tuple(zp.shape)} do not end in size_n / pf = {size_n // pf}")
    src = zp.contiguous()
    out = torch.empty_like(src)
    with torch.cuda.device(src.device):
        lib.call("wna16_cuda_zero_points", _ptr(src), _ptr(out), src.numel() // max(size_n // pf, 1), size_n,
                 num_bits, _stream(src))
    return out


def gemm_variant() -> int:
    """$WNA16CTL_GEMM_VARIANT: auto (mma on sm80+), mma or fma; the v2 kernel also takes tile16,
    tile32 or tile64 (a forced tile height)."""
    name = os.environ.get("WNA16CTL_GEMM_VARIANT", "auto").strip().lower() or "auto"
    if name in GEMM_V2_TILES:
        return GEMM_V2_TILES[name]
    if name not in GEMM_VARIANTS:
        raise ValueError(f"WNA16CTL_GEMM_VARIANT={name!r}: expected one of "
                         f"{sorted(GEMM_VARIANTS) + sorted(GEMM_V2_TILES)}")
    return GEMM_VARIANTS[name]


def gemm_kernel() -> str:
    """$WNA16CTL_GEMM_KERNEL: auto (v3 where it applies and is ahead, else v2, else v1; see
    fast_gemm_order), v1 (the simple
    reference kernel), v2 (the fast kernel; errors instead of falling back) or v3 (the one-launch
    kernel of the fast mode; what it declines -- act-order, groups of 16 / 32 rows -- goes to v2,
    then v1)."""
    name = os.environ.get("WNA16CTL_GEMM_KERNEL", "auto").strip().lower() or "auto"
    if name not in GEMM_KERNELS:
        raise ValueError(f"WNA16CTL_GEMM_KERNEL={name!r}: expected one of {list(GEMM_KERNELS)}")
    return name


@overload
def _i32(t: Tensor, device: torch.device) -> Tensor: ...
@overload
def _i32(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]: ...
def _i32(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    return None if t is None else t.to(device=device, dtype=torch.int32).contiguous()


@overload
def _aligned16(t: Tensor) -> Tensor: ...
@overload
def _aligned16(t: Optional[Tensor]) -> Optional[Tensor]: ...
def _aligned16(t: Optional[Tensor]) -> Optional[Tensor]:
    """Contiguous and 16-byte aligned (the v2 kernel moves 16 bytes at a time)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# v3's workspace per (device, stream): its counters must be zero before a call and every call
# leaves them zero, so one zeroed buffer serves every later call on that stream with no reset
# launch; it is replaced (zeroed again) only when a call needs more words.
_V3_WORKSPACES: dict[tuple[int, int], Tensor] = {}


def _v3_workspace(dev: torch.device, stream: int, words: int) -> Tensor:
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), stream)
    ws = _V3_WORKSPACES.get(key)
    if ws is None or ws.numel() < words:
        ws = torch.zeros(max(words, 1), dtype=torch.int32, device=dev)
        _V3_WORKSPACES[key] = ws
    return ws


def _gemm_cuda(
    a: Tensor, b_q: Tensor, scales: Tensor, sorted_token_ids: Tensor, expert_offsets: Tensor, top_k: int,
    num_bits: int, zero_points: Optional[Tensor] = None, g_idx: Optional[Tensor] = None,
    perm: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, is_k_full: bool = True,
) -> Tensor:
    lib = cuda_lib()
    if lib is None:
        def on_cpu(a: Tensor, b_q: Tensor, scales: Tensor, ids: Tensor, offs: Tensor, zp: Optional[Tensor],
                   gi: Optional[Tensor], pm: Optional[Tensor], tw: Optional[Tensor]) -> Tensor:
            return _gemm_cpu(a, b_q, scales, ids, offs, top_k, num_bits, zp, gi, pm, tw, is_k_full)
        return _cpu_fallback(
            "moe_wna16_gemm",
            [a, b_q, scales, sorted_token_ids, expert_offsets, zero_points, g_idx, perm, topk_weights],
            on_cpu, a.device)
    experts, size_k, size_n, groups = _gemm_dims(a, b_q, scales, num_bits, top_k)
    _check_gemm_extras(a, b_q, scales, zero_points, g_idx, perm, sorted_token_ids, expert_offsets,
                       topk_weights, top_k, num_bits, is_k_full)
    dev = a.device
    num_slots = a.shape[0] * top_k
    out = torch.zeros(num_slots, size_n, dtype=a.dtype, device=dev)
    ids = _i32(sorted_token_ids, dev)
    tw = None if topk_weights is None else topk_weights.to(device=dev, dtype=torch.float32).contiguous()
    a_c, b_c, s_c = _aligned16(a), _aligned16(b_q), _aligned16(scales)
    zp_c, gi, pm, offs = (_aligned16(_i32(zero_points, dev)), _aligned16(_i32(g_idx, dev)), _i32(perm, dev),
                          _i32(expert_offsets, dev))
    variant, which = gemm_variant(), gemm_kernel()
    order = fast_gemm_order(which, ids.numel(), experts, variant)
    tail = (_ptr(a_c), _ptr(b_c), _ptr(s_c), _ptr(zp_c), _ptr(gi), _ptr(pm), _ptr(ids), _ptr(offs), _ptr(tw),
            _ptr(out))
    sizes = (num_slots, ids.numel(), experts, size_n, size_k, groups, top_k, num_bits, DTYPE_CODES[a.dtype],
             int(is_k_full), variant, _stream(a_c))
    with torch.cuda.device(dev):
        if "v3" in order and variant != GEMM_VARIANTS["fma"]:
            try:
                words = ctypes.c_int64(0)
                lib.call("wna16_cuda_moe_gemm_v3_workspace", ids.numel(), experts, size_n, size_k, groups,
                         num_bits, int(perm is not None), variant, ctypes.byref(words))
                ws = _v3_workspace(dev, sizes[-1] or 0, words.value)
                lib.call("wna16_cuda_moe_gemm_v3", *tail, _ptr(ws), *sizes)
                return out
            except KernelError as exc:
                if exc.code != WNA16_ENOTSUP:
                    raise
                log.debug("v3 GEMM declined (%s): trying the v2 kernel", exc)
        if which != "v1" and variant != GEMM_VARIANTS["fma"]:
            try:
                words = ctypes.c_int64(0)
                lib.call("wna16_cuda_moe_gemm_v2_workspace", ids.numel(), experts, size_n, size_k, groups,
                         num_bits, int(perm is not None), variant, ctypes.byref(words))
                ws = torch.empty(max(words.value, 1), dtype=torch.int32, device=dev)
                lib.call("wna16_cuda_moe_gemm_v2", *tail, _ptr(ws), *sizes)
                return out
            except KernelError as exc:
                if which == "v2" or exc.code != WNA16_ENOTSUP:
                    raise
                log.debug("v2 GEMM declined (%s): using the v1 kernel", exc)
        if variant in GEMM_V2_TILES.values():
            raise ValueError("WNA16CTL_GEMM_VARIANT=tile16/32/64 applies to the v2 / v3 kernels only")
        ws = torch.empty(experts + 1, dtype=torch.int32, device=dev)
        lib.call("wna16_cuda_moe_gemm", *tail, _ptr(ws), *sizes)
    return out


def _register_ops() -> None:
    # torch calls a kernel with only the arguments its caller passed: an argument the schema
    # gives a default must have that default in the CPU and the CUDA function alike
    # (tests/native/test_op_signatures.py)
    lib = "wna16ctl"

    repack = torch.library.custom_op(
        f"{lib}::marlin_repack", mutates_args=(),
        schema="(Tensor packed, int num_bits, Tensor? perm=None) -> Tensor",
    )(_repack_cpu)
    repack.register_kernel("cuda")(_repack_cuda)

    @repack.register_fake
    def _(packed: Tensor, num_bits: int, perm: Optional[Tensor] = None) -> Tensor:
        return packed.new_empty(_marlin_shape(packed, num_bits))

    scales = torch.library.custom_op(
        f"{lib}::marlin_permute_scales", mutates_args=(),
        schema="(Tensor s, int size_k, int size_n, int group_size) -> Tensor",
    )(_permute_scales_cpu)
    scales.register_kernel("cuda")(_permute_scales_cuda)

    @scales.register_fake
    def _(s: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
        return torch.empty_like(s)

    zps = torch.library.custom_op(
        f"{lib}::marlin_zero_points", mutates_args=(),
        schema="(Tensor zp, int size_k, int size_n, int num_bits) -> Tensor",
    )(_zero_points_cpu)
    zps.register_kernel("cuda")(_zero_points_cuda)

    @zps.register_fake
    def _(zp: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
        return torch.empty_like(zp)

    gemm = torch.library.custom_op(
        f"{lib}::moe_wna16_gemm", mutates_args=(),
        schema=(
            "(Tensor a, Tensor b_q, Tensor scales, Tensor sorted_token_ids, Tensor expert_offsets, int top_k, "
            "int num_bits, Tensor? zero_points=None, Tensor? g_idx=None, Tensor? perm=None, "
            "Tensor? topk_weights=None, bool is_k_full=True) -> Tensor"
        ),
    )(_gemm_cpu)
    gemm.register_kernel("cuda")(_gemm_cuda)

    @gemm.register_fake
    def _(a, b_q, scales, sorted_token_ids, expert_offsets, top_k, num_bits, zero_points=None, g_idx=None,
          perm=None, topk_weights=None, is_k_full=True):
        return a.new_empty(a.shape[0] * top_k, scales.shape[-1])


if not _REGISTERED:
    _register_ops()


def moe_wna16_gemm(
    a: Tensor, b_q: Tensor, scales: Tensor, sorted_token_ids: Tensor, expert_offsets: Tensor, *,
    top_k: int, num_bits: int, zero_points: Optional[Tensor] = None, g_idx: Optional[Tensor] = None,
    perm: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, is_k_full: bool = True,
) -> Tensor:
    """MoE GEMM over Marlin-layout weights (see `torch.ops.wna16ctl.moe_wna16_gemm`).

    a [M, K] fp16/bf16; b_q [E, K/16, N*16/pf]; scales [E, G, N] (a's dtype, Marlin order);
    zero_points int32 [E, G, N/pf] (Marlin order) for asymmetric weights; act-order: g_idx (sorted)
    and perm (sort indices) [E, K], with is_k_full False meaning g_idx holds global group ids into
    full scales. Slots s = token * top_k + j are grouped per expert: expert e owns
    sorted_token_ids[expert_offsets[e] : expert_offsets[e+1]]; A row = s // top_k. Returns
    [M * top_k, N] in a's dtype (rows no slot reaches are zero), each row scaled by
    topk_weights[s] when given.
    """
    if _eager(a, b_q, scales):
        # the kernel itself: torch's custom-op dispatch imports torch._dynamo on its first call
        # (seconds of a verify's start) for what only a compiled caller needs
        kernel = _gemm_cuda if a.device.type == "cuda" else _gemm_cpu
        return kernel(a, b_q, scales, sorted_token_ids, expert_offsets, top_k, num_bits, zero_points=zero_points,
                      g_idx=g_idx, perm=perm, topk_weights=topk_weights, is_k_full=is_k_full)
    return torch.ops.wna16ctl.moe_wna16_gemm(
        a, b_q, scales, sorted_token_ids, expert_offsets, top_k, num_bits,
        zero_points=zero_points, g_idx=g_idx, perm=perm, topk_weights=topk_weights, is_k_full=is_k_full,
    )


def _eager(*tensors: Tensor) -> bool:
    """Whether a call can go straight to the kernel: plain tensors on the CPU or a CUDA device,
    outside torch.compile / export tracing, none asking for a gradient (the op has no backward);
    anything else (fake or meta tensors, a tracer's subclasses) goes through torch's dispatcher."""
    if torch.compiler.is_compiling():
        return False
    return all(type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") and not t.requires_grad for t in tensors)


__all__ = [
    "KernelBuildError",
    "KernelError",
    "build_cuda",
    "build_host",
    "cuda_available",
    "marlin_repack_fast",
    "marlin_unrepack_fast",
    "marlin_untile_host",
    "moe_wna16_gemm",
    "native_host_available",
]
