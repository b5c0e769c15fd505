"""Shared checks that turn impossible inverse inputs into LayoutMismatch errors."""

from __future__ import annotations

import torch
from torch import Tensor

from wna16ctl.errors import LayoutMismatch


def first_difference(a: Tensor, b: Tensor) -> tuple[int, ...] | None:
    """Index of the first element where a and b differ (bitwise for floats), or None."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.is_floating_point():
        # Compare bit patterns so NaN payloads and signed zeros count as data, as on disk.
        a, b = _bits(a), _bits(b)
    if torch.equal(a, b):  # the common case, without the element-wise mask below
        return None
    diff = torch.ne(a, b)
    if not bool(diff.any()):
        return None
    flat = int(torch.argmax(diff.reshape(-1).to(torch.uint8)))  # first True
    index = []
    for size in reversed(a.shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def first_nonzero(t: Tensor) -> tuple[int, ...] | None:
    """Index of the first nonzero element of t (bitwise for floats, so -0.0 counts), or None."""
    return first_difference(t, torch.zeros_like(t))


def require_zero(t: Tensor, what: str, offset: tuple[int, ...] | None = None) -> None:
    """Raise LayoutMismatch unless every element of t (a padding region) is zero.

    `offset` is added to the reported index so it names the coordinate in the whole tensor.
    """
    where = first_nonzero(t)
    if where is None:
        return
    if offset is not None:
        where = tuple(i + o for i, o in zip(where, offset))
    raise LayoutMismatch(f"{what}: padding at {list(where)} is {t[_local(where, offset)].item()!r}, expected 0")


def _local(where: tuple[int, ...], offset: tuple[int, ...] | None) -> tuple[int, ...]:
    if offset is None:
        return where
    return tuple(i - o for i, o in zip(where, offset))


def _bits(t: Tensor) -> Tensor:
    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.contiguous().view(as_int)
