"""The tensor math of padding one projection module, per role of its stored tensors.

Each stored tensor is taken by the role its format gives it (`PaddedModule.stored_kind`), in the
canonical packing (`layout.spec`; compressed-tensors `pack-quantized` stores it as it is):
  codes [N, K/pf] int32 (along K, offset by 2^(b-1)),
  scales [N, G] (G = K/group, or 1 channel-wise),
  zero points [ceil(N/pf), G] int32 (asymmetric; offset codes packed along N),
  g_idx [K] int32 (act-order: the group of each input column),
  the stored shape [2].
Gate/up gain rows (N: I -> I'), down gains input columns (K: I -> I').  Every added weight code
is 2^(b-1), which is the signed value 0; an added zero point is the same code, so an added row
dequantises to (0 - 0)·s = 0 whatever its scale, and the added scales are 1 (finite).  The down
projection's added columns are whole new groups (G -> I'/group) in order, so act-order g_idx
names them G, G+1, ...; with act-order `group` vLLM loads every rank's w2 scales in full and
finds the new groups there.  Unquantized weights gain zero rows / columns.

A format that stores its projections in another form (GPTQ's qweight packed along K, AWQ's along
N, zero points minus one, ...) is padded by these same rules on the canonical form its reader gives,
written back through its `stored_form` (`pad_projection`; `stored` finds the bytes that adds).

`pad` writes these values through `blocks` (the same padding as byte ranges, without torch);
this statement on tensors is the reference it is tested against, and what it falls back on for
the forms that repack a partial int32 word.
"""

from __future__ import annotations

import torch

from wna16ctl.layout.packing import pack_codes, pack_factor, unpack_codes
from wna16ctl.padding.blocks import ADDED_SCALE, zero_code, zero_word  # noqa: F401 - the values, stated once
from wna16ctl.planning.padding import PaddedModule, canonical_padded_shape
from wna16ctl.sources.formats import CODES, WEIGHT, G_IDX, SCALES, SHAPE, ZERO_POINTS


def pad_tensor(m: PaddedModule, suffix: str, t: torch.Tensor, n_rows: int) -> torch.Tensor:
    """`t` (the module's tensor `suffix`, stored in the canonical form) padded from m.width to
    m.padded; `n_rows` is the projection's N before padding (what a packed zero point's words
    stand for)."""
    if m.stored_apart and m.stored_kind(suffix) in (CODES, SCALES, ZERO_POINTS, G_IDX):
        raise ValueError(f"{m.module}.{suffix}: stored in another form than the canonical one; pad_projection pads it")
    return pad_role(m, m.stored_kind(suffix), t, n_rows)


def pad_projection(m: PaddedModule, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized projection's stored tensors (by role, in its format's stored form) padded: read
    into the canonical form, padded there by the rules above, and written back in the stored form
    (`InputFormat.stored_form`, the exact inverse of the read).  Only the roles given are returned."""
    assert m.scheme is not None
    canonical = m.fmt.canonical(stored, m.scheme)
    n_rows = m.nk[0]
    padded = {role: pad_role(m, role, t, n_rows) for role, t in canonical.items()}
    out = m.fmt.stored_form(padded, m.scheme)
    return {role: out[role].to(stored[role].dtype) for role in stored}


def pad_role(m: PaddedModule, kind: str, t: torch.Tensor, n_rows: int) -> torch.Tensor:
    """`t`, the module's tensor of role `kind` in the canonical form, padded (`pad_tensor`)."""
    shape = canonical_padded_shape(m, kind, tuple(t.shape))
    s = m.scheme
    if kind == SHAPE:
        out = t.clone()
        out[0 if m.role in ("gate", "up") else 1] = m.padded
        return out
    if tuple(t.shape) == shape:
        return t
    rows = m.role in ("gate", "up")
    dim = 0 if rows or t.ndim == 1 else 1  # 1-d: a gate/up bias or the down projection's g_idx
    extra = shape[dim] - t.shape[dim]
    if kind in (WEIGHT, "bias"):
        return _cat(t, torch.zeros(_with(t.shape, dim, extra), dtype=t.dtype), dim)
    assert s is not None, f"{m.module}: a quantized tensor ({kind}) of an unquantized module"
    if kind == CODES:
        if rows:
            return _cat(t, torch.full((extra, t.shape[1]), zero_word(s.num_bits), dtype=torch.int32), 0)
        return _pad_packed_columns(t, m.width, m.padded, s.num_bits)
    if kind == SCALES:
        return _cat(t, torch.full(_with(t.shape, dim, extra), ADDED_SCALE, dtype=t.dtype), dim)
    if kind == ZERO_POINTS:
        return _pad_zero_point(t, m, shape, n_rows)
    if kind == G_IDX:  # down only: the added columns are whole groups after the last
        groups = -(-m.width // s.group_size)
        added = torch.arange(m.padded - m.width, dtype=torch.int64) // s.group_size + groups
        return torch.cat([t, added.to(t.dtype)])
    raise ValueError(f"{m.module}: no padding rule for a tensor of role {kind}")


def _with(shape: torch.Size, dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _cat(t: torch.Tensor, added: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, added], dim=dim)


def _pad_packed_columns(t: torch.Tensor, width: int, padded: int, num_bits: int) -> torch.Tensor:
    pf = pack_factor(num_bits)
    if width % pf == 0:  # whole words: append words of zero codes
        words = -(-padded // pf) - t.shape[1]
        return _cat(t, torch.full((t.shape[0], words), zero_word(num_bits), dtype=torch.int32), 1)
    codes = unpack_codes(t, num_bits, dim=1, size=width)
    codes = _cat(codes, torch.full((t.shape[0], padded - width), zero_code(num_bits), dtype=codes.dtype), 1)
    return pack_codes(codes, num_bits, dim=1)


def _pad_zero_point(t: torch.Tensor, m: PaddedModule, shape: tuple[int, ...], n_rows: int) -> torch.Tensor:
    s = m.scheme
    assert s is not None
    code = zero_code(s.num_bits)
    rows = m.role in ("gate", "up")
    if t.dtype != torch.int32 or t.shape[0] == n_rows != -(-n_rows // pack_factor(s.num_bits)):
        # the legacy unpacked form [N, G] of signed zero points: the added ones are 0
        dim = 0 if rows else 1
        return _cat(t, torch.zeros(_with(t.shape, dim, shape[dim] - t.shape[dim]), dtype=t.dtype), dim)
    if rows:  # packed along the rows being added: unpack, append, pack again
        codes = unpack_codes(t, s.num_bits, dim=0, size=n_rows)
        codes = _cat(codes, torch.full((m.padded - n_rows, t.shape[1]), code, dtype=codes.dtype), 0)
        return pack_codes(codes, s.num_bits, dim=0)
    # down: new group columns, each a packed column of N zero codes (a partial last word's
    # unused codes stay zero bits, as the packer leaves them)
    added = pack_codes(torch.full((n_rows, shape[1] - t.shape[1]), code, dtype=torch.int32), s.num_bits, dim=0)
    return _cat(t, added, 1)
