"""The padded form of a stored tensor as byte ranges: which bytes are kept where, and which are added.

Padding only ever appends: gate/up gain rows at the end of the tensor, the down projection's
rows each gain columns at their end, g_idx gains entries.  So a padded tensor is its original
bytes cut into `rows` pieces of `row_in` bytes, each followed by `row_out - row_in` added bytes
(one piece for an append at the end).  The added bytes depend on the sizes alone, never on the
values, so the writer builds them once per shape and copies the original bytes around them
(in the kernel, or read straight into place), with no torch and no per-value work.

The values are `tensors.pad_tensor`'s (the tensor math, stated on torch tensors): the zero code,
the added scale, zero points of the zero code in their packed form, g_idx of whole new groups.
What cannot be stated this way (the values of a stored shape; codes or zero points whose
original ends in a partial int32 word, which the padding repacks) is rewritten from its values.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from wna16ctl.dtypes import ARRAY_TYPECODES, ST_BITS, float_bytes
from wna16ctl.planning.padding import PaddedModule, padded_shape
from wna16ctl.sources.formats import CODES, WEIGHT, G_IDX, SCALES, SHAPE, ZERO_POINTS

ADDED_SCALE = 1.0  # any finite scale gives 0 on the zero code; 1 keeps the tensor's range as it was


def zero_code(num_bits: int) -> int:
    """The stored (offset) code of the value 0."""
    return 1 << (num_bits - 1)


def _word(num_bits: int, codes: int) -> int:
    """The unsigned int32 word holding `codes` zero codes from its lowest bits up (the rest 0)."""
    word = 0
    for i in range(codes):
        word |= zero_code(num_bits) << (num_bits * i)
    return word


def zero_word(num_bits: int) -> int:
    """An int32 word of zero codes, as a signed int32 value."""
    word = _word(num_bits, 32 // num_bits)
    return word - (1 << 32) if word >= 1 << 31 else word


def _word_bytes(num_bits: int, codes: int | None = None) -> bytes:
    return _word(num_bits, 32 // num_bits if codes is None else codes).to_bytes(4, "little")


@dataclass(frozen=True)
class TensorPadding:
    """One tensor's padding: `rows` pieces of `row_in` bytes become `row_out` bytes each, the
    original piece first, then `tail` (`last_tail` after the last piece: a packed zero point's
    last word may hold fewer codes)."""

    rows: int
    row_in: int
    row_out: int
    tail: bytes
    last_tail: bytes

    @property
    def unchanged(self) -> bool:
        return self.row_in == self.row_out

    def added(self) -> bytes:
        """Every piece's added bytes, piece after piece."""
        return self.tail * (self.rows - 1) + self.last_tail if self.rows else b""


def tensor_padding(m: PaddedModule, suffix: str, shape: tuple[int, ...], dtype: str,
                   n_rows: int) -> TensorPadding | None:
    """How the module's tensor `suffix` (of `shape`, safetensors `dtype`) is padded from m.width to
    m.padded; `n_rows` is the projection's N before padding (what a packed zero point's words
    stand for).  None where the tensor is rewritten from its values instead (`tensors.pad_tensor`)."""
    bits = ST_BITS.get(dtype)
    if bits is None or bits % 8:
        return None
    size = bits // 8
    nbytes = size
    for d in shape:
        nbytes *= d
    kind = m.stored_kind(suffix)
    if kind == SHAPE:
        return None
    new = padded_shape(m, suffix, shape)
    if new == shape:
        return TensorPadding(1, nbytes, nbytes, b"", b"")
    if len(new) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(shape, new)) if i != _dim(m, shape)):
        return None
    s = m.scheme
    dim = _dim(m, shape)
    # the tensor as pieces that each grow at their end: the rows of a down projection, or the
    # whole tensor when rows are appended
    inner = size
    for d in shape[dim + 1:]:
        inner *= d
    rows = nbytes // (shape[dim] * inner) if shape[dim] else 0
    row_in, row_out = shape[dim] * inner, new[dim] * inner
    grow = (row_out - row_in) // size  # elements added after each piece

    def filled(unit: bytes) -> TensorPadding:  # every added element the same value
        return TensorPadding(rows, row_in, row_out, unit * grow, unit * grow)

    if kind in (WEIGHT, "bias"):
        return filled(bytes(size))
    if s is None:
        return None
    if kind == CODES:
        if dtype != "I32" or (dim == 1 and (m.width % (32 // s.num_bits) or m.padded % (32 // s.num_bits))):
            return None  # a partial last word of codes: repacked from the values
        return filled(_word_bytes(s.num_bits))
    if kind == SCALES:
        unit = float_bytes(ADDED_SCALE, dtype)
        return None if unit is None else filled(unit)
    if kind == ZERO_POINTS:
        pf = 32 // s.num_bits
        if dtype != "I32" or shape[0] == n_rows != -(-n_rows // pf):  # the legacy unpacked form: 0
            return filled(bytes(size))
        if dim == 0:  # packed along the rows being added: whole words only when N fills its last word
            whole = n_rows % pf == 0 and m.padded % pf == 0 and len(shape) == 2
            return filled(_word_bytes(s.num_bits)) if whole else None
        if len(shape) != 2 or shape[0] != -(-n_rows // pf):
            return None
        # new group columns, each a packed column of N zero codes: the last word holds N % pf of
        # them (its unused codes zero bits, as the packer leaves them)
        last = _word_bytes(s.num_bits, n_rows % pf or pf)
        return TensorPadding(rows, row_in, row_out, _word_bytes(s.num_bits) * grow, last * grow)
    if kind == G_IDX:  # down only: the added columns are whole groups after the last
        code = ARRAY_TYPECODES.get(dtype)
        if code is None or s.group_size <= 0 or shape != (m.width,):
            return None
        groups = -(-m.width // s.group_size)
        values = _little(array(code, (i // s.group_size + groups for i in range(m.padded - m.width))))
        return TensorPadding(1, row_in, row_out, values, values)
    return None


def padded_weight_shape(m: PaddedModule, data: bytes, dtype: str) -> bytes:
    """A stored shape (the projection's [N, K]) with the padded intermediate size in its place."""
    values = array(ARRAY_TYPECODES[dtype])
    values.frombytes(data)
    if _big_endian():
        values.byteswap()
    values[0 if m.role in ("gate", "up") else 1] = m.padded
    return _little(values)


def _dim(m: PaddedModule, shape: tuple[int, ...]) -> int:
    """The dimension that grows: rows for gate/up (and any 1-d tensor), columns for down."""
    return 0 if m.role in ("gate", "up") or len(shape) == 1 else 1


def _big_endian() -> bool:
    return array("H", b"\x01\x00")[0] != 1


def _little(values: array) -> bytes:
    if _big_endian():
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()
