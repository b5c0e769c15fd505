"""Codes of 1 to 8 bits as a little-endian bit stream in int32 words, along one dimension.

Code i of a row occupies bits [i·b, i·b + b) of the row's stream, word w holding stream bits
[32·w, 32·w + 32), LSB first: a code may straddle two words when 32 % b != 0 (GPTQ's 3-bit
packing, compressed-tensors' dense packing).  For 2, 4 and 8 bits this is the usual pf = 32 // b
whole codes per word.  The readers of `sources.formats` convert between stored forms with it, so it
takes every bit width the formats store (the layouts' own packing takes 4 and 8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where codes are converted: the header scan sizes tensors without it
    from torch import Tensor

_WORD = 1 << 32


def words_for(count: int, bits: int) -> int:
    """int32 words that hold `count` codes of `bits` bits."""
    return -(-count * bits // 32)


def _positions(count: int, bits: int) -> tuple[Tensor, Tensor]:
    import torch

    start = torch.arange(count, dtype=torch.int64) * bits
    return start // 32, start % 32


def unpack_bits(words: Tensor, bits: int, dim: int, size: int) -> Tensor:
    """The `size` unsigned codes along `dim` of int32 `words` (int32, contiguous)."""
    import torch

    w = words.movedim(dim, -1).to(torch.int64) & (_WORD - 1)
    index, shift = _positions(size, bits)
    lo = w[..., index] >> shift
    spill = shift + bits > 32
    if bool(spill.any()):
        nxt = (index + 1).clamp(max=w.shape[-1] - 1)
        hi = (w[..., nxt] << (32 - shift)) & (_WORD - 1)
        lo = torch.where(spill, lo | hi, lo)
    return (lo & ((1 << bits) - 1)).to(torch.int32).movedim(-1, dim).contiguous()


def pack_bits(codes: Tensor, bits: int, dim: int) -> Tensor:
    """Unsigned codes packed along `dim` into int32 words (the last word zero-filled)."""
    import torch

    c = codes.movedim(dim, -1).to(torch.int64) & ((1 << bits) - 1)
    count = c.shape[-1]
    index, shift = _positions(count, bits)
    out = torch.zeros(c.shape[:-1] + (words_for(count, bits),), dtype=torch.int64)
    last = out.ndim - 1
    out.index_add_(last, index, (c << shift) & (_WORD - 1))
    spill = shift + bits > 32
    if bool(spill.any()):
        high = torch.where(spill, c >> (32 - shift).clamp(min=0), torch.zeros_like(c))
        out.index_add_(last, (index + 1).clamp(max=out.shape[-1] - 1), high)
    out = torch.where(out >= (1 << 31), out - _WORD, out)  # the words' bits, as int32
    return out.to(torch.int32).movedim(-1, dim).contiguous()
