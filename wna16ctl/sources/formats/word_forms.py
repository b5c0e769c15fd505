"""The canonical form of GPTQ's and AWQ's stored projections, computed on their int32 words with
numpy instead of torch (`convert`'s data path: importing torch costs more memory and time than
converting a checkpoint of a few GB).

The same transforms as the forms' `to_canonical` (gptq.py, awq.py), which stay the reference:
  GPTQ   codes: qweight [K·b/32, N] transposed word for word (the bit stream along K is
         compressed-tensors' packing); scales transposed in their dtype; a symmetric projection's
         qzeros compared with the packed midpoint word by word and dropped; an asymmetric one's
         zero points unpacked, v1's zero - 1 undone, checked and packed along N; the act-order
         g_idx checked and carried as int32;
  AWQ    the interleaved nibbles of each word put in column order and packed along K.
Where a check fails (or the stored tensors are not what the fast transform takes), `canonical_words`
returns None and the caller runs the reference, which names the tensor and the reason (or, where
the word-level check was stricter than the reference, converts it).
Arrays are little-endian: a float scale is carried as its bits (numpy has no bfloat16).
"""

from __future__ import annotations

from functools import lru_cache
import numpy as np

from wna16ctl.dtypes import FLOAT_EXPONENT_MASK
from wna16ctl.sources.formats import awq, gptq
from wna16ctl.sources.formats.bits import words_for
from wna16ctl.sources.formats.face import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.scheme import WeightScheme

_FORMS = (gptq.V1, gptq.V2, awq.STORED)


def handles(scheme: WeightScheme) -> bool:
    """Whether `canonical_words` converts projections of this scheme (else the reference does)."""
    return scheme.format in _FORMS and scheme.type == "int" and scheme.num_bits in (awq.BITS if scheme.format ==
                                                                                    awq.STORED else gptq.BITS)


def codes_moved_only(scheme: WeightScheme) -> bool:
    """Whether `canonical_words` only moves the codes' words (GPTQ: a transpose) without reading
    their values (AWQ reorders their nibbles), so that the caller may hand it codes it has not read."""
    return scheme.format != awq.STORED


def canonical_words(stored: dict[str, tuple[str, np.ndarray]], scheme: WeightScheme,
                    k: int) -> dict[str, tuple[str, np.ndarray]] | None:
    """One projection's stored tensors (role -> (safetensors dtype, array of its shape)) in the
    canonical form, role -> (dtype, array; a transposed view where the form is a transpose);
    None where a check fails or a tensor is not in the form this takes (the reference decides)."""
    if CODES not in stored or SCALES not in stored or stored[CODES][0] != "I32":
        return None
    scale_dtype, scales = stored[SCALES]
    if scale_dtype not in FLOAT_EXPONENT_MASK or scales.ndim != 2:
        return None
    mask = FLOAT_EXPONENT_MASK[scale_dtype]
    if bool(((scales & mask) == mask).any()):
        return None  # not finite
    out = {SCALES: (scale_dtype, scales.T)}
    if scheme.format == awq.STORED:
        rest = _awq(stored, scheme)
    else:
        rest = _gptq(stored, scheme, scales.shape[1], k)
    if rest is None:
        return None
    out.update(rest)
    return out


def _gptq(stored: dict[str, tuple[str, np.ndarray]], scheme: WeightScheme, n: int,
          k: int) -> dict[str, tuple[str, np.ndarray]] | None:
    b, v1 = scheme.num_bits, scheme.format == gptq.V1
    out: dict[str, tuple[str, np.ndarray]] = {CODES: ("I32", stored[CODES][1].T)}
    zeros = stored.get(ZERO_POINTS)
    if zeros is not None and (zeros[0] != "I32" or zeros[1].ndim != 2 or zeros[1].shape[1] != words_for(n, b)):
        return None
    if scheme.symmetric:
        if zeros is not None and not bool((zeros[1] == _midpoint_row(b, n, v1)).all()):
            return None
    else:
        if zeros is None:
            return None
        z = unpack(zeros[1], b, n).astype(np.int16) + (1 if v1 else 0)  # [G, N]
        if bool((z >= (1 << b)).any()):
            return None
        out[ZERO_POINTS] = ("I32", _pack_along_rows(z, b))
    if scheme.act_order:
        g_idx = _checked_g_idx(stored.get(G_IDX), k, scheme.group_size)
        if g_idx is None:
            return None
        out[G_IDX] = ("I32", g_idx)
    return out


def _awq(stored: dict[str, tuple[str, np.ndarray]], scheme: WeightScheme) -> dict[str, tuple[str, np.ndarray]] | None:
    codes = _columns(stored[CODES][1])  # [K, N]
    out = {CODES: ("I32", pack(np.ascontiguousarray(codes.T), 4))}
    if not scheme.symmetric:
        zeros = stored.get(ZERO_POINTS)
        if zeros is None or zeros[0] != "I32" or zeros[1].ndim != 2:
            return None
        z = _columns(zeros[1])  # [G, N]
        out[ZERO_POINTS] = ("I32", _pack_along_rows(z, 4))
    return out


def _columns(words: np.ndarray) -> np.ndarray:
    """[R, C] AWQ words -> [R, 8·C] uint8 codes in column order (word slot j holds column ORDER[j])."""
    w = words.view("<u4")
    out = np.empty((w.shape[0], w.shape[1], 8), dtype=np.uint8)
    for slot, column in enumerate(awq.ORDER):
        out[:, :, column] = (w >> (4 * slot)) & 0xF
    return out.reshape(w.shape[0], -1)


def unpack(words: np.ndarray, bits: int, size: int) -> np.ndarray:
    """The `size` unsigned codes of each row of int32 `words` (the bit stream LSB first, as
    `bits.unpack_bits` along the last dimension), as uint8."""
    stream = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    code_bits = stream[..., :size * bits].reshape(*words.shape[:-1], size, bits)
    return np.packbits(code_bits, axis=-1, bitorder="little")[..., 0]


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes (< 2^bits) packed along the last dimension into int32 words (the last word
    zero-filled), as `bits.pack_bits`."""
    count = codes.shape[-1]
    code_bits = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = code_bits.reshape(*codes.shape[:-1], count * bits)
    padded = np.zeros((*codes.shape[:-1], words_for(count, bits) * 32), dtype=np.uint8)
    padded[..., :count * bits] = stream
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4")


def _pack_along_rows(z: np.ndarray, bits: int) -> np.ndarray:
    """[G, N] codes -> [words(N), G] int32 (a transposed view): packed along N, as
    compressed-tensors stores zero points."""
    return pack(np.ascontiguousarray(z), bits).T


@lru_cache(maxsize=64)
def _midpoint_row(bits: int, n: int, v1: bool) -> np.ndarray:
    """A symmetric projection's qzeros row: the midpoint (minus one in v1) packed along N."""
    return pack(np.full((1, n), (1 << (bits - 1)) - (1 if v1 else 0), dtype=np.uint8), bits)


def _checked_g_idx(g: tuple[str, np.ndarray] | None, k: int, group_size: int) -> np.ndarray | None:
    """The act-order g_idx as int32 where it assigns each column a group in [0, G) and every group
    its group_size columns (the last one the remainder), as `checks.check_g_idx`; else None."""
    if g is None or g[0] not in ("I32", "I64") or g[1].size != k:
        return None
    groups = -(-k // group_size)
    idx = g[1].reshape(-1)
    if bool(((idx < 0) | (idx >= groups)).any()):
        return None
    want = np.full(groups, group_size, dtype=np.int64)
    want[-1] = k - (groups - 1) * group_size
    if not np.array_equal(np.bincount(idx, minlength=groups), want):
        return None
    return idx.astype("<i4")
