"""Checks of the data every format's reader applies as it reads a projection."""

from __future__ import annotations

import torch

from wna16ctl.errors import BadInput


def check_g_idx(g_idx: torch.Tensor, name: str, k: int, group_size: int) -> None:
    """An act-order g_idx assigns each of the K input columns to a group: values in [0, G) and
    every group holding exactly its group_size columns (the last one the remainder)."""
    groups = -(-k // group_size)
    g = g_idx.to(torch.int64) if g_idx.dtype != torch.int64 else g_idx
    if g.numel() != k:
        raise BadInput(f"tensor {name}: has {g.numel()} entries, expected {k}; the checkpoint is corrupt")
    out_of_range = (g < 0) | (g >= groups)
    if bool(out_of_range.any()):
        col = int(out_of_range.nonzero()[0])
        raise BadInput(f"tensor {name}: column {col} is assigned to group {int(g[col])}, outside [0, {groups}); "
                       "the checkpoint is corrupt")
    counts = torch.bincount(g, minlength=groups)
    want = torch.full((groups,), group_size, dtype=counts.dtype)
    want[-1] = k - (groups - 1) * group_size
    if not torch.equal(counts, want):
        grp = int((counts != want).nonzero()[0])
        raise BadInput(f"tensor {name}: group {grp} holds {int(counts[grp])} columns, expected {int(want[grp])}; "
                       "g_idx is not a valid act-order group assignment (the checkpoint is corrupt)")
