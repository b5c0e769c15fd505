"""The Marlin MoE layout (16-bit activations): padding, act-order sort, weight repack, scale and
zero-point permutations, and their exact inverses.

All functions take per-expert tensors with optional leading dimensions (experts) and work on
K-first data: packed weights are int32 [..., K/pf, N] with codes packed along K (the GPTQ layout
produced by sharding), scales are [..., G, N], zero points int32 [..., G, N/pf] packed along N.

Weight tile order (16×64 tiles, one row of K/16 output rows per k-tile): inside a tile write
k = 8a + 2·tr + b and n = 16w + 8·blk + tq with a, b, blk ∈ {0,1}, tr ∈ 0..3, tq ∈ 0..7,
w ∈ 0..3 (lane t = 4·tq + tr). From the closed form of the kernel's repack:
* 4-bit: output word 4·t + w of the n-tile holds nibble i = 4b + 2·blk + a;
* 8-bit: output word 8·t + 2w + blk holds byte 2b + a.
Both are pure axis permutations of the tile's code grid, so the repack needs no index tables: it
moves whole int32 words along axes (views + strided writes) and moves nibbles/bytes between
words with 2×2 bit-field transposes (see `_transpose_fields`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from wna16ctl.layout._mismatch import require_zero
from wna16ctl.layout.packing import pack_codes, pack_factor, unpack_codes

from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout import spec
from wna16ctl.layout._mismatch import first_difference
from wna16ctl.layout.shard import G_IDX, PACKED, SCALE, ZERO_POINT, ExpertTensors, gate_up_g_idx, shard_down, shard_gate_up
from wna16ctl.layout.spec import TILE_K, TILE_N, RankLayout, marlin_scales_grouped, w2_scale_size_k


# ----------------------------------------------------------------------------------------------
# §6.2 thread-tile padding of the intermediate dimension


def marlin_moe_padded_intermediate(i_p: int, group_size: int) -> int:
    """Intermediate size per partition after Marlin tile padding: round up to lcm(64, gs)."""
    if i_p <= 0:
        raise ValueError(f"intermediate size per partition must be positive, got {i_p}")
    if group_size > 0 and i_p % group_size != 0:
        raise ValueError(
            f"intermediate size per partition {i_p} is not divisible by group_size {group_size}; "
            "scale groups would straddle the padding"
        )
    return spec.marlin_moe_padded_intermediate(i_p, group_size)


def pad_intermediate_halves(t: Tensor, size: int, padded_size: int) -> Tensor:
    """Zero-pad the gate and up halves of the last dim separately: [..., 2·size] -> [..., 2·padded].

    Used for w13 packed weights and scales (size = I_p) and w13 zero points (size = I_p/pf).
    """
    if t.shape[-1] != 2 * size:
        raise ValueError(f"last dim {t.shape[-1]} is not 2 x {size}")
    if padded_size < size:
        raise ValueError(f"padded size {padded_size} < size {size}")
    if padded_size == size:
        return t
    halves = t.unflatten(-1, (2, size))
    padded = torch.nn.functional.pad(halves, (0, padded_size - size))
    return padded.flatten(-2)


def unpad_intermediate_halves(t: Tensor, size: int, padded_size: int, *, what: str) -> Tensor:
    """Inverse of `pad_intermediate_halves`; the padding must be all zero (else LayoutMismatch)."""
    if t.shape[-1] != 2 * padded_size:
        raise ValueError(f"last dim {t.shape[-1]} is not 2 x {padded_size}")
    if padded_size == size:
        return t
    halves = t.unflatten(-1, (2, padded_size))
    for half in range(2):
        pad = halves.select(-2, half)[..., size:]
        offset = (0,) * (t.ndim - 1) + (half * padded_size + size,)
        require_zero(pad, what, offset)
    return halves[..., :size].flatten(-2)


def pad_intermediate_rows(t: Tensor, rows: int, padded_rows: int) -> Tensor:
    """Zero-pad dim -2 from `rows` to `padded_rows` (w2 packed weights, scales, zero points)."""
    if t.shape[-2] != rows:
        raise ValueError(f"dim -2 is {t.shape[-2]}, expected {rows}")
    if padded_rows < rows:
        raise ValueError(f"padded rows {padded_rows} < rows {rows}")
    if padded_rows == rows:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, padded_rows - rows))


def unpad_intermediate_rows(t: Tensor, rows: int, padded_rows: int, *, what: str) -> Tensor:
    """Inverse of `pad_intermediate_rows`; the padding rows must be all zero (else LayoutMismatch)."""
    if t.shape[-2] != padded_rows:
        raise ValueError(f"dim -2 is {t.shape[-2]}, expected {padded_rows}")
    if padded_rows == rows:
        return t
    offset = (0,) * (t.ndim - 2) + (rows, 0)
    require_zero(t[..., rows:, :], what, offset)
    return t[..., :rows, :]


# ----------------------------------------------------------------------------------------------
# §6.3 act-order


def sort_g_idx(g_idx: Tensor) -> tuple[Tensor, Tensor]:
    """(sorted g_idx, sort indices), both int32, sorting the last dim.

    The argsort is stable on purpose: every group id appears group_size times, so ties are the
    rule; a stable order makes the output reproducible across runs and devices and matches the
    tie order of the CUDA radix sort the engine uses in practice.
    """
    sort_indices = torch.argsort(g_idx, dim=-1, stable=True)
    sorted_g_idx = torch.gather(g_idx, -1, sort_indices)
    return sorted_g_idx.to(torch.int32), sort_indices.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# §6.4 weight repack


def marlin_repack(
    packed_kfirst: Tensor, num_bits: int, perm: Tensor | None = None, *, out: Tensor | None = None
) -> Tensor:
    """K-first packed weights int32 [..., K/pf, N] -> Marlin tiles int32 [..., K/16, N·16/pf].

    With `perm` ([..., K], act-order sort indices) source rows are gathered first:
    q_s[k] = q[perm[k]]. Any strides are accepted (contiguous input is fastest). `out`, if
    given, receives the result; it may be a view such as a column slice of a wider tensor as
    long as its last dim is contiguous.
    """
    pf = pack_factor(num_bits)
    _check_int32(packed_kfirst, "b_q_weight")
    size_k = packed_kfirst.shape[-2] * pf
    size_n = packed_kfirst.shape[-1]
    _check_tile_shape(size_k, size_n)
    if perm is not None:
        packed_kfirst = _gather_k_rows(packed_kfirst, num_bits, _check_perm(perm, packed_kfirst, size_k))
    lead = packed_kfirst.shape[:-2]
    shape = (*lead, size_k // TILE_K, size_n * TILE_K // pf)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=packed_kfirst.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"out must be int32 {shape} with a contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    if num_bits == 4:
        _tiles_4bit(packed_kfirst, out, size_k, size_n)
    else:
        _tiles_8bit(packed_kfirst, out, size_k, size_n)
    return out


def marlin_unrepack(
    marlin: Tensor, num_bits: int, size_k: int, size_n: int, perm: Tensor | None = None, *, native: bool = True
) -> Tensor:
    """Exact inverse of `marlin_repack`: int32 [..., K/16, N·16/pf] -> K-first int32 [..., K/pf, N].

    On the CPU the tile order is undone by the installed accelerator where there is one (the
    native host library's kernels/untile.cpp: the same bit-field transposes as `_untiles_4bit` /
    `_untiles_8bit`, several times faster), else, or with `native=False`, by the torch code below."""
    pf = pack_factor(num_bits)
    _check_int32(marlin, "marlin weight")
    _check_tile_shape(size_k, size_n)
    expected = (size_k // TILE_K, size_n * TILE_K // pf)
    if tuple(marlin.shape[-2:]) != expected:
        raise ValueError(f"marlin weight shape {tuple(marlin.shape)} does not end in {expected}")
    lead = marlin.shape[:-2]
    out = torch.empty((*lead, size_k // pf, size_n), dtype=torch.int32, device=marlin.device)
    if not (native and _untiled_natively(marlin, out, num_bits, size_k, size_n)):
        (_untiles_4bit if num_bits == 4 else _untiles_8bit)(marlin, out, size_k, size_n)
    if perm is not None:
        perm = _check_perm(perm, out, size_k)
        out = _gather_k_rows(out, num_bits, _inverse_permutation(perm))
    return out


# A faster exact un-tiling of CPU tensors where one is installed: (marlin, out, num_bits, size_k,
# size_n) -> whether it ran (if not, the torch code below does). `wna16ctl.native.ops` installs the
# native host library's (kernels/untile.cpp) when it is imported, as verify does: the layout itself
# stays torch only and imports nothing from `native`.
UntileAccelerator = Callable[[Tensor, Tensor, int, int, int], bool]
_untile_accelerator: UntileAccelerator | None = None


def install_untile_accelerator(fn: UntileAccelerator | None) -> None:
    global _untile_accelerator
    _untile_accelerator = fn


def _untiled_natively(marlin: Tensor, out: Tensor, num_bits: int, size_k: int, size_n: int) -> bool:
    if _untile_accelerator is None or marlin.device.type != "cpu" or marlin.numel() == 0:
        return False
    return _untile_accelerator(marlin, out, num_bits, size_k, size_n)


def _check_tile_shape(size_k: int, size_n: int) -> None:
    if size_k % TILE_K != 0:
        raise ValueError(f"size_k = {size_k} is not divisible by tile_k_size = {TILE_K}")
    if size_n % TILE_N != 0:
        raise ValueError(f"size_n = {size_n} is not divisible by tile_n_size = {TILE_N}")


def _check_int32(t: Tensor, name: str) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims, got shape {tuple(t.shape)}")


def _check_perm(perm: Tensor, packed: Tensor, size_k: int) -> Tensor:
    if perm.shape[-1] != size_k or perm.shape[:-1] != packed.shape[:-2]:
        raise ValueError(f"perm shape {tuple(perm.shape)} does not match {tuple(packed.shape[:-2])} + ({size_k},)")
    if perm.is_floating_point():
        raise ValueError(f"perm must be an integer tensor, got {perm.dtype}")
    flat = perm.reshape(-1, size_k).to(torch.int64)
    expected = torch.arange(size_k, device=perm.device).expand_as(flat)
    if not torch.equal(torch.sort(flat, dim=-1).values, expected):
        raise ValueError("perm is not a permutation of range(size_k)")
    return perm


def _inverse_permutation(perm: Tensor) -> Tensor:
    perm = perm.to(torch.int64)
    inverse = torch.empty_like(perm)
    inverse.scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm))
    return inverse


def _gather_k_rows(packed: Tensor, num_bits: int, index: Tensor) -> Tensor:
    """Row gather on K-first packed data: out code row k = in code row index[k].

    Codes are spread to one byte each so the gather moves whole rows, then packed again.
    Byte j of a little-endian word holds codes pf·w + j (8-bit) or pf·w + 2j, 2j + 1 (4-bit).
    """
    pf = 32 // num_bits
    words, size_n = packed.shape[-2], packed.shape[-1]
    size_k = words * pf
    lead = packed.shape[:-2]
    source = _little_endian_bytes(packed.reshape(-1, words, size_n))  # [E, W, N·4]
    flat_index = index.reshape(-1, size_k).to(torch.int64)
    out = torch.empty((source.shape[0], words, size_n), dtype=torch.int32, device=packed.device)
    target = _little_endian_bytes(out)
    for e in range(source.shape[0]):
        src_bytes = source[e].view(words, size_n, 4).permute(0, 2, 1)  # [W, byte j, N]
        dst_bytes = target[e].view(words, size_n, 4).permute(0, 2, 1)
        if num_bits == 8:
            codes = src_bytes.reshape(size_k, size_n)
            dst_bytes.copy_(codes.index_select(0, flat_index[e]).view(words, 4, size_n))
        else:
            codes = torch.empty((words, 4, 2, size_n), dtype=torch.uint8, device=packed.device)
            torch.bitwise_and(src_bytes, 0x0F, out=codes[:, :, 0])
            torch.bitwise_right_shift(src_bytes, 4, out=codes[:, :, 1])
            gathered = codes.view(size_k, size_n).index_select(0, flat_index[e]).view(words, 4, 2, size_n)
            high = gathered[:, :, 1] << 4
            torch.bitwise_or(gathered[:, :, 0], high, out=dst_bytes)
    return out.reshape(*lead, words, size_n)


def _little_endian_bytes(words: Tensor) -> Tensor:
    if sys.byteorder != "little":
        raise NotImplementedError("the act-order row gather assumes a little-endian host")
    return words.contiguous().view(torch.uint8)


# The repack moves nibbles/bytes between int32 words with 2×2 transposes of bit fields. Each
# such step is its own inverse, so the inverse repack runs the same steps backwards.
# Fields are addressed by bit position, so host byte order does not matter here.


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


_EVEN_FIELDS = {4: _signed32(0x0F0F0F0F), 8: _signed32(0x00FF00FF), 16: _signed32(0x0000FFFF)}


def _transpose_fields(p: Tensor, q: Tensor, bits: int, out_p: Tensor, out_q: Tensor) -> None:
    """Transpose the 2×2 matrix [[p_lo, p_hi], [q_lo, q_hi]] of every `bits`-wide field pair:
    out_p takes (p_lo, q_lo), out_q takes (p_hi, q_hi), low field first.

    Done as a delta swap: delta = ((p >> bits) ^ q) & even exchanges p_hi with q_lo.
    """
    delta = p >> bits  # the arithmetic shift drags in sign bits; `even` masks them off
    delta ^= q
    delta &= _EVEN_FIELDS[bits]
    torch.bitwise_xor(q, delta, out=out_q)
    delta <<= bits
    torch.bitwise_xor(p, delta, out=out_p)


def _fields_transposed(p: Tensor, q: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    out_p = torch.empty(p.shape, dtype=torch.int32, device=p.device)
    out_q = torch.empty(p.shape, dtype=torch.int32, device=p.device)
    _transpose_fields(p, q, bits, out_p, out_q)
    return out_p, out_q


# 4-bit. K-first source words [KT, a, NT, w, blk, tq] hold nibbles j = 2·tr + b of k = 8a + j.
# Target words [KT, NT, tq, tr, w] hold nibbles i = 4b + 2·blk + a. Steps per (KT, NT, w, tq):
# nibble transpose over a (-> words y_b[blk], byte tr = nibbles a of b), byte transpose over blk,
# 16-bit transpose over b (-> word tr).


def _kfirst_words_4bit(words: Tensor, size_k: int, size_n: int) -> Tensor:
    """[..., K/8, N] -> [..., KT, a, NT, w, blk, tq] view."""
    return words.unflatten(-2, (size_k // TILE_K, 2)).unflatten(-1, (size_n // TILE_N, 4, 2, 8))


def _marlin_words_4bit(words: Tensor, size_k: int, size_n: int) -> Tensor:
    """[..., K/16, 2N] -> view indexed [..., KT, NT, w, tq, tr] (the order the steps produce)."""
    tiles = words.unflatten(-1, (size_n // TILE_N, 8, 4, 4))  # [.., KT, NT, tq, tr, w]
    return tiles.movedim(-1, -3)


def _tiles_4bit(source: Tensor, target: Tensor, size_k: int, size_n: int) -> None:
    src = _kfirst_words_4bit(source, size_k, size_n)
    a_axis = src.ndim - 5
    y0, y1 = _fields_transposed(src.select(a_axis, 0), src.select(a_axis, 1), 4)
    # y_b [..., KT, NT, w, blk, tq]
    c00, c01 = _fields_transposed(y0.select(-2, 0), y0.select(-2, 1), 8)
    c10, c11 = _fields_transposed(y1.select(-2, 0), y1.select(-2, 1), 8)
    dst = _marlin_words_4bit(target, size_k, size_n)
    _transpose_fields(c00, c10, 16, dst[..., 0], dst[..., 2])
    _transpose_fields(c01, c11, 16, dst[..., 1], dst[..., 3])


def _untiles_4bit(source: Tensor, target: Tensor, size_k: int, size_n: int) -> None:
    src = _marlin_words_4bit(source, size_k, size_n)
    c00, c10 = _fields_transposed(src[..., 0], src[..., 2], 16)
    c01, c11 = _fields_transposed(src[..., 1], src[..., 3], 16)
    b0_blk0, b0_blk1 = _fields_transposed(c00, c01, 8)
    b1_blk0, b1_blk1 = _fields_transposed(c10, c11, 8)
    dst = _kfirst_words_4bit(target, size_k, size_n)
    a_axis = dst.ndim - 5
    a0, a1 = dst.select(a_axis, 0), dst.select(a_axis, 1)
    _transpose_fields(b0_blk0, b1_blk0, 4, a0.select(-2, 0), a1.select(-2, 0))
    _transpose_fields(b0_blk1, b1_blk1, 4, a0.select(-2, 1), a1.select(-2, 1))


# 8-bit. K-first source words [KT, a, trh, NT, w, blk, tq] hold bytes j = 2·trl + b of
# k = 8a + 4·trh + j (tr = 2·trh + trl). Target words [KT, NT, tq, trh, trl, w, blk] hold
# bytes 2b + a. Steps per (KT, trh, NT, w, blk, tq): byte transpose over a, 16-bit over trl.


def _kfirst_words_8bit(words: Tensor, size_k: int, size_n: int) -> Tensor:
    """[..., K/4, N] -> [..., KT, a, trh, NT, w, blk, tq] view."""
    return words.unflatten(-2, (size_k // TILE_K, 2, 2)).unflatten(-1, (size_n // TILE_N, 4, 2, 8))


def _marlin_words_8bit(words: Tensor, size_k: int, size_n: int) -> Tensor:
    """[..., K/16, 4N] -> view indexed [..., KT, trh, NT, w, blk, tq, trl]."""
    tiles = words.unflatten(-1, (size_n // TILE_N, 8, 2, 2, 4, 2))  # [.., KT, NT, tq, trh, trl, w, blk]
    lead = tiles.ndim - 7
    order = (2, 0, 4, 5, 1, 3)
    return tiles.permute(*range(lead + 1), *(lead + 1 + i for i in order))


def _tiles_8bit(source: Tensor, target: Tensor, size_k: int, size_n: int) -> None:
    src = _kfirst_words_8bit(source, size_k, size_n)
    a_axis = src.ndim - 6
    lo, hi = _fields_transposed(src.select(a_axis, 0), src.select(a_axis, 1), 8)
    dst = _marlin_words_8bit(target, size_k, size_n)
    _transpose_fields(lo, hi, 16, dst[..., 0], dst[..., 1])


def _untiles_8bit(source: Tensor, target: Tensor, size_k: int, size_n: int) -> None:
    src = _marlin_words_8bit(source, size_k, size_n)
    lo, hi = _fields_transposed(src[..., 0], src[..., 1], 16)
    dst = _kfirst_words_8bit(target, size_k, size_n)
    a_axis = dst.ndim - 6
    _transpose_fields(lo, hi, 8, dst.select(a_axis, 0), dst.select(a_axis, 1))


# ----------------------------------------------------------------------------------------------
# §6.5 scales


def marlin_permute_scales(s: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
    """Scales [..., G, N] -> same shape, permuted in chunks along N.

    Grouped (gs < size_k, gs != -1): each 64-chunk is an 8×8 transpose
    (new[8i + j] = old[i + 8j]). Otherwise each 32-chunk takes new[8i + 2m + l] = old[8m + 2i + l],
    i.e. axes (m, i, l) -> (i, m, l).
    """
    return _scale_chunk_transpose(s, size_n, marlin_scales_grouped(size_k, group_size))


def marlin_unpermute_scales(s: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
    """Inverse of `marlin_permute_scales` (both chunk permutations are involutions)."""
    return _scale_chunk_transpose(s, size_n, marlin_scales_grouped(size_k, group_size))


def _scale_chunk_transpose(s: Tensor, size_n: int, grouped: bool) -> Tensor:
    if s.ndim < 2 or s.shape[-1] != size_n:
        raise ValueError(f"scale shape {tuple(s.shape)} does not end in size_n = {size_n}")
    chunk = 64 if grouped else 32
    if size_n % chunk != 0:
        raise ValueError(f"size_n = {size_n} is not divisible by the scale chunk {chunk}")
    lead = s.shape[:-1]
    if grouped:
        tiles = s.reshape(*lead, size_n // 64, 8, 8).transpose(-1, -2)
    else:
        tiles = s.reshape(*lead, size_n // 32, 4, 4, 2).transpose(-3, -2)
    return tiles.reshape(s.shape).contiguous()


# ----------------------------------------------------------------------------------------------
# §6.6 zero points


def marlin_zero_points(zp_kfirst: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
    """Zero points int32 [..., G, N/pf] packed along N -> Marlin order, same shape.

    Per 64-chunk along N, packed slot m takes code Z[idx[m]] with m = 8p + s:
    4-bit idx = p + 8c + 16d for s = 4c + d; 8-bit idx = p + 8c + 16d + 32e for s = 4e + 2c + d
    (the 64-scale permutation followed by the in-word interleave).
    """
    codes = _zero_point_codes(zp_kfirst, size_k, size_n, num_bits)
    lead = codes.shape[:-1]
    if num_bits == 4:
        # old chunk axes (d, c, p) -> new (p, c, d)
        chunks = codes.reshape(*lead, size_n // 64, 4, 2, 8).permute(*range(len(lead) + 1), -1, -2, -3)
    else:
        # old chunk axes (e, d, c, p) -> new (p, e, c, d)
        chunks = codes.reshape(*lead, size_n // 64, 2, 2, 2, 8).permute(*range(len(lead) + 1), -1, -4, -2, -3)
    return pack_codes(chunks.reshape(codes.shape), num_bits, dim=-1)


def marlin_zero_points_inverse(marlin_zp: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
    """Exact inverse of `marlin_zero_points`."""
    codes = _zero_point_codes(marlin_zp, size_k, size_n, num_bits)
    lead = codes.shape[:-1]
    base = tuple(range(len(lead) + 1))
    if num_bits == 4:
        # new chunk axes (p, c, d) -> old (d, c, p)
        chunks = codes.reshape(*lead, size_n // 64, 8, 2, 4).permute(*base, -1, -2, -3)
    else:
        # new chunk axes (p, e, c, d) -> old (e, d, c, p)
        chunks = codes.reshape(*lead, size_n // 64, 8, 2, 2, 2).permute(*base, -3, -1, -2, -4)
    return pack_codes(chunks.reshape(codes.shape), num_bits, dim=-1)


def _zero_point_codes(zp: Tensor, size_k: int, size_n: int, num_bits: int) -> Tensor:
    pf = pack_factor(num_bits)
    _check_int32(zp, "zero points")
    if size_n % 64 != 0:
        raise ValueError(f"size_n = {size_n} is not divisible by 64")
    if tuple(zp.shape[-2:]) != (size_k, size_n // pf):
        raise ValueError(f"zero point shape {tuple(zp.shape)} does not end in ({size_k}, {size_n // pf})")
    return unpack_codes(zp, num_bits, dim=-1, size=size_n)


__all__ = [
    "TILE_K",
    "TILE_N",
    "marlin_moe_padded_intermediate",
    "marlin_permute_scales",
    "marlin_repack",
    "marlin_scales_grouped",
    "marlin_unpermute_scales",
    "marlin_unrepack",
    "marlin_zero_points",
    "marlin_zero_points_inverse",
    "pad_intermediate_halves",
    "pad_intermediate_rows",
    "sort_g_idx",
    "unpad_intermediate_halves",
    "unpad_intermediate_rows",
]


# -- the layout (wna16ctl.layout.registry): one expert, forward and inverse ----------------------------

def _sizes(spec: RankLayout) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate per rank, padded intermediate, pack factor, bits, group size)."""
    return (spec.hidden_size, spec.intermediate_per_partition, spec.padded_intermediate, spec.pack_factor,
            spec.num_bits, spec.group_size)


def forward(
    expert: ExpertTensors, spec: RankLayout, out: Mapping[str, Tensor], expert_id: int | None,
    repack: Callable[..., Tensor] | None = None,
) -> None:
    """Fill `out` (one expert's slices, shaped as `spec.marlin_expert_shapes`) from the checkpoint
    expert: shard, zero-pad to the tile multiple, act-order sort, repack, permute scales and zero
    points.  `repack` replaces `marlin_repack` with a bit-identical implementation (the native ones)."""
    repack = repack or marlin_repack
    h, i_p, p, pf, nb, gs = _sizes(spec)
    gate = shard_gate_up(expert["gate"], tp=spec.tp, rank=spec.rank, pack=pf)
    up = shard_gate_up(expert["up"], tp=spec.tp, rank=spec.rank, pack=pf)
    down = shard_down(expert["down"], tp=spec.tp, rank=spec.rank, pack=pf, load_full_w2=spec.load_full_w2)

    w13_perm = w2_perm = None
    if spec.act_order:
        w13_sorted, w13_perm = sort_g_idx(gate_up_g_idx(expert, expert_id=expert_id))
        w2_sorted, w2_perm = sort_g_idx(down[G_IDX])
        out["w13_weight_g_idx"].copy_(w13_sorted)
        out["w2_weight_g_idx"].copy_(w2_sorted)
        out["w13_g_idx_sort_indices"].copy_(w13_perm)
        out["w2_g_idx_sort_indices"].copy_(w2_perm)

    # gate and up fill whole 64-wide n-tiles each (P % 64 == 0), so each half is repacked on its
    # own into its columns of the output. Without padding the K-first sources are passed as
    # transposed views of the checkpoint's N-first words (the native repack reads them in place);
    # with padding a zero-padded contiguous copy is made.
    w13_out = out["w13_weight_packed"]
    half = w13_out.shape[-1] // 2
    for h_index, part in enumerate((gate, up)):
        source = part[PACKED]
        if p != i_p:  # padding the K-first columns = padding the checkpoint's N-first rows
            source = pad_intermediate_rows(source.transpose(0, 1), i_p, p).transpose(0, 1).contiguous()
        repack(source, nb, w13_perm, out=w13_out[:, h_index * half : (h_index + 1) * half])
    w2 = down[PACKED] if p == i_p else pad_intermediate_rows(down[PACKED].contiguous(), i_p // pf, p // pf)
    repack(w2, nb, w2_perm, out=out["w2_weight_packed"])

    w13_scale = pad_intermediate_halves(torch.cat([gate[SCALE], up[SCALE]], dim=-1), i_p, p)
    out["w13_weight_scale"].copy_(marlin_permute_scales(w13_scale, h, 2 * p, gs))
    w2_scale = down[SCALE]
    if gs > 0 and not spec.load_full_w2:
        w2_scale = pad_intermediate_rows(w2_scale, i_p // gs, p // gs)
    out["w2_weight_scale"].copy_(marlin_permute_scales(w2_scale, w2_scale_size_k(spec), h, gs))

    if not spec.symmetric:
        w13_zp = torch.cat([gate[ZERO_POINT], up[ZERO_POINT]], dim=-1)
        w13_zp = pad_intermediate_halves(w13_zp, i_p // pf, p // pf)
        out["w13_weight_zero_point"].copy_(marlin_zero_points(w13_zp, spec.w13_groups, 2 * p, nb))
        w2_zp = down[ZERO_POINT]
        if gs > 0:
            w2_zp = pad_intermediate_rows(w2_zp, i_p // gs, p // gs)
        out["w2_weight_zero_point"].copy_(marlin_zero_points(w2_zp, spec.w2_zero_point_groups, h, nb))


def inverse(tensors: Mapping[str, Tensor], spec: RankLayout, label: str) -> dict[str, Tensor]:
    """The exact inverse of `forward` on one expert's slices: the loader's K-first tensors.
    Raises LayoutMismatch where the tensors cannot come from `forward`."""
    h, i_p, p, pf, nb, gs = _sizes(spec)
    out: dict[str, Tensor] = {}
    w13_perm = w2_perm = None
    if spec.act_order:
        out["w13_weight_g_idx"], w13_perm = _unsorted_g_idx(tensors, "w13", label)
        out["w2_weight_g_idx"], w2_perm = _unsorted_g_idx(tensors, "w2", label)

    def what(name: str, stage: str) -> str:
        return f"{name} of {label} ({stage})"

    w13 = marlin_unrepack(tensors["w13_weight_packed"], nb, h, 2 * p, w13_perm)
    out["w13_weight_packed"] = unpad_intermediate_halves(
        w13, i_p, p, what=what("w13_weight_packed", "K-first [H/pf, 2P] before repack")
    ).contiguous()
    w2 = marlin_unrepack(tensors["w2_weight_packed"], nb, p, h, w2_perm)
    out["w2_weight_packed"] = unpad_intermediate_rows(
        w2, i_p // pf, p // pf, what=what("w2_weight_packed", "K-first [P/pf, H] before repack")
    ).contiguous()

    w13_scale = marlin_unpermute_scales(tensors["w13_weight_scale"], h, 2 * p, gs)
    out["w13_weight_scale"] = unpad_intermediate_halves(
        w13_scale, i_p, p, what=what("w13_weight_scale", "before permutation")
    ).contiguous()
    w2_scale = marlin_unpermute_scales(tensors["w2_weight_scale"], w2_scale_size_k(spec), h, gs)
    if gs > 0 and not spec.load_full_w2:
        w2_scale = unpad_intermediate_rows(
            w2_scale, i_p // gs, p // gs, what=what("w2_weight_scale", "before permutation")
        )
    out["w2_weight_scale"] = w2_scale.contiguous()

    if not spec.symmetric:
        w13_zp = marlin_zero_points_inverse(tensors["w13_weight_zero_point"], spec.w13_groups, 2 * p, nb)
        out["w13_weight_zero_point"] = unpad_intermediate_halves(
            w13_zp, i_p // pf, p // pf, what=what("w13_weight_zero_point", "packed along N before permutation")
        ).contiguous()
        w2_zp = marlin_zero_points_inverse(tensors["w2_weight_zero_point"], spec.w2_zero_point_groups, h, nb)
        if gs > 0:
            w2_zp = unpad_intermediate_rows(
                w2_zp, i_p // gs, p // gs, what=what("w2_weight_zero_point", "before permutation")
            )
        out["w2_weight_zero_point"] = w2_zp.contiguous()
    return out


def _unsorted_g_idx(tensors: Mapping[str, Tensor], prefix: str, label: str) -> tuple[Tensor, Tensor]:
    """(original g_idx, sort indices) from the stored sorted g_idx and sort indices, checking that
    the sort indices are exactly the stable argsort of the g_idx they restore."""
    sorted_name, perm_name = f"{prefix}_weight_g_idx", f"{prefix}_g_idx_sort_indices"
    sorted_g_idx, perm = tensors[sorted_name], tensors[perm_name]
    size = perm.shape[-1]
    descending = torch.nonzero(sorted_g_idx[1:] < sorted_g_idx[:-1])
    if descending.numel():
        k = int(descending[0, 0]) + 1
        raise LayoutMismatch(
            f"{sorted_name} of {label} is not sorted: [{k}] = {int(sorted_g_idx[k])} < "
            f"[{k - 1}] = {int(sorted_g_idx[k - 1])}"
        )
    seen = torch.zeros(size, dtype=torch.bool, device=perm.device)
    in_range = (perm >= 0) & (perm < size)
    if not bool(in_range.all()):
        k = int(torch.nonzero(~in_range)[0, 0])
        raise LayoutMismatch(f"{perm_name} of {label}: [{k}] = {int(perm[k])} is outside [0, {size})")
    seen[perm.long()] = True
    if not bool(seen.all()):
        k = int(torch.nonzero(~seen)[0, 0])
        raise LayoutMismatch(f"{perm_name} of {label} is not a permutation: row {k} is never used")
    original = torch.empty_like(sorted_g_idx)
    original[perm.long()] = sorted_g_idx
    _, expected_perm = sort_g_idx(original)
    where = first_difference(expected_perm, perm.to(torch.int32))
    if where is not None:
        k = where[0]
        raise LayoutMismatch(
            f"{perm_name} of {label}: [{k}] = {int(perm[k])}, but the stable argsort of the restored "
            f"g_idx gives {int(expected_perm[k])}"
        )
    return original, perm
