"""The padding of a projection stored in a form other than the canonical one, as byte ranges.

A format whose stored tensors are not the canonical layout (GPTQ's qweight packed along K and
transposed, AWQ's packed along N in its interleaved order, zero points stored minus one, ...)
converts a projection exactly both ways (`InputFormat.canonical` and its inverse `stored_form`).
Its padding is the canonical padding (`tensors.pad_role`, the one statement of the values) written
back through `stored_form`, so no rule of a format is restated here.  What makes it a byte range,
as `blocks` states the canonical one, is found once per shape on probe projections: two random
projections of the module's [N, K] are stored, padded and stored again; in every stored tensor the
padded form must hold the original's bytes first along one dimension and, after each piece, added
bytes that are the same for both probes (they depend on the sizes alone, never on the values).
Where that does not hold (a code packed across the added boundary), there is no byte range and
`pad` refuses the projection in one line.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from wna16ctl.padding.blocks import TensorPadding
from wna16ctl.planning.padding import PaddedModule
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.dtypes import torch_dtype
from wna16ctl.sources.tensors import writable_view

ROLES = (CODES, SCALES, ZERO_POINTS, G_IDX)
_SEEDS = (1, 2)  # the probes: two projections of different values
_lock = threading.Lock()
_found: dict[tuple, dict[str, tuple[int, torch.Size, torch.Tensor] | None]] = {}


def stored_padding(m: PaddedModule, role: str, shape: tuple[int, ...], dtype: str) -> TensorPadding | None:
    """How the module's stored tensor of `role` (of `shape`, safetensors `dtype`) is padded, as
    `blocks.tensor_padding` answers it; None where the padding is no byte range."""
    found = _appended(m).get(role)
    if found is None:
        return None
    dim, before, added = found
    if tuple(before) != tuple(shape):
        return None  # the stored tensor is not the shape the format states for it
    try:
        added = added.to(torch_dtype(dtype)).contiguous()
    except (KeyError, ValueError, TypeError):
        return None
    size = added.element_size()
    rows = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:]) * size
    pieces = bytes(writable_view(added)) if added.numel() else b""
    per = len(pieces) // max(rows, 1)
    tails = [pieces[r * per:(r + 1) * per] for r in range(rows)]
    if rows == 0 or any(t != tails[0] for t in tails[:-1]):
        return None
    return TensorPadding(rows, shape[dim] * inner, shape[dim] * inner + per, tails[0], tails[-1])


def _appended(m: PaddedModule) -> dict[str, tuple[int, torch.Size, torch.Tensor] | None]:
    """role -> (the dimension that grows, the original's stored shape, the added part of the padded
    stored tensor), or None
    where the padded stored tensor is not the original's bytes with the same additions after them."""
    assert m.scheme is not None
    key = (m.fmt.quant_method, m.scheme, m.role, m.width, m.padded, m.hidden)
    with _lock:
        if key in _found:
            return _found[key]
    probes = [_stored_and_padded(m, seed) for seed in _SEEDS]
    out: dict[str, tuple[int, torch.Size, torch.Tensor] | None] = {}
    for role in probes[0][0]:
        out[role] = _one_role([(before[role], after.get(role)) for before, after in probes])
    with _lock:
        _found[key] = out
    return out


def _one_role(pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[int, torch.Size, torch.Tensor] | None:
    before, after = pairs[0]
    if after is None or after.ndim != before.ndim:
        return None
    grown = [d for d in range(before.ndim) if after.shape[d] != before.shape[d]]
    if not grown:
        return 0, before.shape, after.narrow(0, 0, 0)
    if len(grown) != 1 or after.shape[grown[0]] < before.shape[grown[0]]:
        return None
    dim = grown[0]
    extra = after.shape[dim] - before.shape[dim]
    added = None
    for b, a in pairs:
        if a is None or a.shape != after.shape or not torch.equal(a.narrow(dim, 0, b.shape[dim]), b):
            return None
        part = a.narrow(dim, b.shape[dim], extra)
        if added is not None and not torch.equal(part, added):
            return None  # the added bytes depend on the original's values
        added = part
    assert added is not None
    return dim, before.shape, added


def _stored_and_padded(m: PaddedModule, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random projection of the module's scheme and [N, K] in its stored form, and padded."""
    from wna16ctl.padding.tensors import pad_role

    assert m.scheme is not None
    canonical = _random_canonical(m, seed)
    n_rows = m.nk[0]
    padded = {role: pad_role(m, role, t, n_rows) for role, t in canonical.items()}
    return m.fmt.stored_form(canonical, m.scheme), m.fmt.stored_form(padded, m.scheme)


def _random_canonical(m: PaddedModule, seed: int) -> dict[str, torch.Tensor]:
    """A projection in the canonical form (`layout.spec`) with random codes, scales, zero points
    (asymmetric: never 0, which some stored forms cannot hold) and act-order g_idx."""
    from wna16ctl.sources.formats.bits import pack_bits

    s = m.scheme
    assert s is not None
    n, k = m.nk
    b = s.num_bits
    groups = -(-k // s.group_size) if s.group_size > 0 else 1
    gen = torch.Generator().manual_seed(seed)
    out = {CODES: pack_bits(torch.randint(0, 1 << b, (n, k), generator=gen, dtype=torch.int32), b, dim=1),
           SCALES: torch.rand(n, groups, generator=gen) + 0.5}
    if not s.symmetric:
        out[ZERO_POINTS] = pack_bits(torch.randint(1, 1 << b, (n, groups), generator=gen, dtype=torch.int32), b, dim=0)
    if s.act_order:
        out[G_IDX] = (torch.arange(k, dtype=torch.int32) // s.group_size)[torch.randperm(k, generator=gen)]
    return out
