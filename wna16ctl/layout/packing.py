"""Packing of 4/8-bit codes into int32 words, LSB-first.

Word j along the packed dimension holds codes j·pf + i in bits [nb·i, nb·i + nb), i = 0..pf-1,
pf = 32 // nb. This is the compressed-tensors `pack-quantized` layout (4 and 8 bits) and the
GPTQ K-first layout; a partial last word is zero-padded.

The int32 words are bit containers only. Codes are unsigned (offset-encoded) values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from wna16ctl.layout.spec import SUPPORTED_BITS


def check_num_bits(num_bits: int) -> None:
    if num_bits not in SUPPORTED_BITS:
        raise ValueError(f"num_bits must be one of {SUPPORTED_BITS}, got {num_bits}")


def pack_factor(num_bits: int) -> int:
    """Codes per int32 word."""
    check_num_bits(num_bits)
    return 32 // num_bits


def pack_codes(codes: Tensor, num_bits: int, dim: int = -1) -> Tensor:
    """Pack unsigned codes along `dim`, pf per int32 word, LSB-first.

    Only the low `num_bits` bits of each code are kept. A partial last word is zero-padded.
    Returns a contiguous int32 tensor whose `dim` has ceil(size / pf) words.
    """
    pf = pack_factor(num_bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    dim = _normalise_dim(dim, codes.ndim)
    size = codes.shape[dim]
    words = -(-size // pf)
    if words * pf != size:
        pad = [0, 0] * (codes.ndim - 1 - dim) + [0, words * pf - size]
        codes = torch.nn.functional.pad(codes.to(torch.int32), pad)
    # Split the packed dimension in place (words, pf) so no transposition is needed.
    grouped = codes.unflatten(dim, (words, pf))
    mask = (1 << num_bits) - 1
    # int32 left shifts wrap into the sign bit, which is what a bit container wants.
    packed = grouped.select(dim + 1, 0).to(torch.int32) & mask
    for i in range(1, pf):
        packed |= (grouped.select(dim + 1, i).to(torch.int32) & mask) << (num_bits * i)
    return packed.contiguous()


def unpack_codes(packed: Tensor, num_bits: int, dim: int = -1, size: int | None = None) -> Tensor:
    """Inverse of `pack_codes`: int32 codes along `dim`, cut to `size` (default: all pf·words)."""
    pf = pack_factor(num_bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed must be int32, got {packed.dtype}")
    dim = _normalise_dim(dim, packed.ndim)
    words = packed.shape[dim]
    if size is None:
        size = words * pf
    if size != words * pf and not words * pf - pf < size < words * pf:
        raise ValueError(f"size {size} does not fit {words} packed words of {pf} codes")
    shape = [1] * (packed.ndim + 1)
    shape[dim + 1] = pf
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device).view(shape)
    # Arithmetic right shift sign-extends negative words; the mask removes those bits.
    codes = (packed.unsqueeze(dim + 1) >> shifts) & ((1 << num_bits) - 1)
    codes = codes.flatten(dim, dim + 1)
    if size != words * pf:
        codes = codes.narrow(dim, 0, size)
    return codes.contiguous()


def _normalise_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def dequantize(codes: Tensor, scales: Tensor, groups: Tensor, num_bits: int, dtype: torch.dtype,
               zero_points: Tensor | None = None, zero_groups: Tensor | None = None) -> Tensor:
    """(q − z)·s of K-first logical codes [K, N] in `dtype`, one rounding: the kernels' contract.

    `scales` [G, N] and `zero_points` [G', N] (offset codes, like q; None: symmetric, z the midpoint
    2^(b-1)); `groups` [K] the scale row of each of the K rows, `zero_groups` the zero point's row
    where it differs (a rank's w2 with its scales loaded whole).  q − z is an integer difference,
    exact in fp16/bf16; the product is the one rounding."""
    if zero_points is None:
        z: Tensor | int = 1 << (num_bits - 1)
    else:
        z = zero_points[groups if zero_groups is None else zero_groups]
    return (codes - z).to(dtype) * scales.to(dtype)[groups]
