"""The Triton WNA16 MoE layout (N-first bytes) and its exact inverse.

Inputs are the K-first tensors of the engine's loader (packed int32 [..., K/pf, N] packed along K,
scales [..., G, N], zero points int32 [..., G, N/pf] packed along N). The kernel reads
* weights as uint8 [..., N, K·nb/8]: int4 byte k//2 of row n holds k even in the low nibble;
* scales as [..., N, G];
* zero points as uint8 [..., N·nb/8, G]: int4 byte n//2 holds z[n] at nibble (n mod 2)·4,
  int8 byte n holds z[n].
Both packings are little-endian bit streams, so every conversion is a transpose plus a
reinterpretation of the int32 words as bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from wna16ctl.layout.packing import pack_factor
from wna16ctl.layout.shard import ExpertTensors, shard_expert
from wna16ctl.layout.spec import RankLayout


def to_transposed_weight(packed_kfirst: Tensor) -> Tensor:
    """int32 [..., K/pf, N] -> uint8 [..., N, K·nb/8] (transpose, then the words' bytes)."""
    _check_int32(packed_kfirst, "packed weight")
    return _bytes_of(packed_kfirst.transpose(-1, -2).contiguous())


def from_transposed_weight(weight: Tensor) -> Tensor:
    """uint8 [..., N, K·nb/8] -> int32 [..., K/pf, N]."""
    words = _words_of(weight, "transposed weight")
    return words.transpose(-1, -2).contiguous()


def to_transposed_scales(scales_kfirst: Tensor) -> Tensor:
    """[..., G, N] -> [..., N, G]."""
    return scales_kfirst.transpose(-1, -2).contiguous()


def from_transposed_scales(scales: Tensor) -> Tensor:
    """[..., N, G] -> [..., G, N]."""
    return scales.transpose(-1, -2).contiguous()


def to_transposed_zero_points(zp_kfirst: Tensor, num_bits: int) -> Tensor:
    """int32 [..., G, N/pf] (packed along N) -> uint8 [..., N·nb/8, G].

    The packed words already hold z[n] at bit nb·n of the row's bit stream, so their bytes are
    the kernel's bytes; only the axes swap.
    """
    pack_factor(num_bits)
    _check_int32(zp_kfirst, "zero points")
    return _bytes_of(zp_kfirst.contiguous()).transpose(-1, -2).contiguous()


def from_transposed_zero_points(zero_points: Tensor, num_bits: int) -> Tensor:
    """uint8 [..., N·nb/8, G] -> int32 [..., G, N/pf]."""
    pack_factor(num_bits)
    return _words_of(zero_points.transpose(-1, -2).contiguous(), "transposed zero points")


def _check_int32(t: Tensor, name: str) -> None:
    if t.dtype != torch.int32 or t.ndim < 2:
        raise ValueError(f"{name} must be an int32 tensor with at least 2 dims, got {t.dtype} {tuple(t.shape)}")


def _require_little_endian() -> None:
    # The kernel's byte order is the little-endian order of the packed bit stream.
    if sys.byteorder != "little":
        raise NotImplementedError("the transposed layout code assumes a little-endian host")


def _bytes_of(words: Tensor) -> Tensor:
    _require_little_endian()
    return words.view(torch.uint8)


def _words_of(data: Tensor, name: str) -> Tensor:
    _require_little_endian()
    if data.dtype != torch.uint8 or data.ndim < 2:
        raise ValueError(f"{name} must be a uint8 tensor with at least 2 dims, got {data.dtype} {tuple(data.shape)}")
    if data.shape[-1] % 4 != 0:
        raise ValueError(f"{name} last dim {data.shape[-1]} is not a whole number of int32 words")
    return _with_standard_strides(data).view(torch.int32)


def _with_standard_strides(t: Tensor) -> Tensor:
    # A contiguous tensor may still carry odd strides on size-1 dims, which view(dtype) rejects.
    standard, step = [], 1
    for size in reversed(t.shape):
        standard.append(step)
        step *= size
    if t.stride() == tuple(reversed(standard)):
        return t
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    dense.copy_(t)
    return dense


# -- the layout (wna16ctl.layout.registry): one expert, forward and inverse ----------------------------

def forward(
    expert: ExpertTensors, spec: RankLayout, out: Mapping[str, Tensor], expert_id: int | None,
    repack: Any = None,
) -> None:
    """Fill `out` (one expert's slices, shaped as `spec.transposed_expert_shapes`) from the
    checkpoint expert: shard, then the N-first bytes (`repack` is Marlin's only: unused here)."""
    kfirst = shard_expert(expert, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2, expert_id=expert_id)
    for name, tensor in _transposed_expert(kfirst, spec).items():
        out[name].copy_(tensor)


def _each_tensor(tensors: Mapping[str, Tensor], spec: RankLayout, weight: Callable[[Tensor], Tensor],
                 scales: Callable[[Tensor], Tensor], zero_points: Callable[[Tensor, int], Tensor]) -> dict[str, Tensor]:
    """One expert's tensors, each converted by its kind's function (both directions use this)."""
    out = {f"{w}_weight_packed": weight(tensors[f"{w}_weight_packed"]) for w in ("w13", "w2")}
    out.update({f"{w}_weight_scale": scales(tensors[f"{w}_weight_scale"]) for w in ("w13", "w2")})
    if not spec.symmetric:
        out.update({f"{w}_weight_zero_point": zero_points(tensors[f"{w}_weight_zero_point"], spec.num_bits)
                    for w in ("w13", "w2")})
    return out


def _transposed_expert(kfirst: Mapping[str, Tensor], spec: RankLayout) -> dict[str, Tensor]:
    return _each_tensor(kfirst, spec, to_transposed_weight, to_transposed_scales, to_transposed_zero_points)


def inverse(tensors: Mapping[str, Tensor], spec: RankLayout, label: str) -> dict[str, Tensor]:
    """The exact inverse of `forward` on one expert's slices: the loader's K-first tensors."""
    return _each_tensor(tensors, spec, from_transposed_weight, from_transposed_scales, from_transposed_zero_points)
