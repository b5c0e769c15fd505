"""The engine loader's per-rank view of one expert (tensor parallelism) and its inverse, plus the
linear expert placement under expert parallelism.

Checkpoint tensors are N-first ([N, K/pf] packed along K). The loader transposes every 2-D
tensor to K-first and slices the intermediate dim for the rank:
gate/up (N = I) are cut along N and land side by side in w13 (gate in columns [0, I_p), up in
[I_p, 2·I_p)); down (K = I) is cut along K. Per-channel w2 scales and zero points, and w2 scales
loaded "full" (act-order with groups), are copied whole to every rank; w2 zero points are never
loaded full. The w13 g_idx is the full [H] vector (up's copy wins in the engine, so gate's must
equal it); the w2 g_idx is the rank's slice and keeps global group ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout.spec import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.layout._mismatch import first_difference

ProjectionTensors = dict[str, Tensor]
"""One projection's checkpoint tensors: weight_packed, weight_scale[, weight_zero_point][, weight_g_idx]."""

ExpertTensors = dict[str, ProjectionTensors]
"""One expert: "gate", "up", "down"."""

PROJECTIONS = ("gate", "up", "down")
# the canonical form's keys (`layout.spec`)
PACKED, SCALE, ZERO_POINT, G_IDX = CODES, SCALES, ZERO_POINTS, G_IDX


def local_experts(num_experts: int, ep_size: int, rank: int) -> range:
    """Global expert ids held by `rank` under linear expert placement.

    Each rank gets E // ep contiguous experts; the first E % ep ranks get one more.
    """
    if num_experts <= 0 or ep_size <= 0:
        raise ValueError(f"num_experts ({num_experts}) and ep_size ({ep_size}) must be positive")
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank {rank} is outside [0, {ep_size})")
    base, extra = divmod(num_experts, ep_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def shard_gate_up(projection: ProjectionTensors, *, tp: int, rank: int, pack: int) -> dict[str, Tensor]:
    """K-first views of the rank's columns of gate or up: weight_packed [H/pf, I_p],
    weight_scale [G13, I_p], weight_zero_point [G13, I_p/pf], weight_g_idx [H] (whole)."""
    _check_rank(tp, rank)
    full = projection[PACKED].shape[0]
    per_rank = _per_rank(full, tp, "gate/up rows (intermediate size)")
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {
        PACKED: projection[PACKED][rows].transpose(0, 1),
        SCALE: projection[SCALE][rows].transpose(0, 1),
    }
    if ZERO_POINT in projection:
        if per_rank % pack != 0:
            raise ValueError(f"intermediate size per partition {per_rank} is not a multiple of {pack} (zero point words)")
        zp_rows = per_rank // pack
        out[ZERO_POINT] = projection[ZERO_POINT][rank * zp_rows : (rank + 1) * zp_rows].transpose(0, 1)
    if G_IDX in projection:
        out[G_IDX] = projection[G_IDX]
    return out


def shard_down(
    projection: ProjectionTensors, *, tp: int, rank: int, pack: int, load_full_w2: bool
) -> dict[str, Tensor]:
    """K-first views of the rank's rows of down: weight_packed [I_p/pf, H], weight_scale [G2, H],
    weight_zero_point [G2', H/pf], weight_g_idx [I_p]."""
    _check_rank(tp, rank)
    packed = projection[PACKED].transpose(0, 1)
    words = _per_rank(packed.shape[0], tp, "down packed rows (intermediate size / pack factor)")
    out = {PACKED: packed[rank * words : (rank + 1) * words]}
    scale = projection[SCALE].transpose(0, 1)
    # One scale row means per-channel: the engine copies it whole to every rank.
    if scale.shape[0] == 1 or load_full_w2:
        out[SCALE] = scale
    else:
        groups = _per_rank(scale.shape[0], tp, "down scale groups")
        out[SCALE] = scale[rank * groups : (rank + 1) * groups]
    if ZERO_POINT in projection:
        zp = projection[ZERO_POINT].transpose(0, 1)
        if zp.shape[0] == 1:
            out[ZERO_POINT] = zp
        else:
            groups = _per_rank(zp.shape[0], tp, "down zero point groups")
            out[ZERO_POINT] = zp[rank * groups : (rank + 1) * groups]
    if G_IDX in projection:
        per_rank = _per_rank(projection[G_IDX].shape[0], tp, "down g_idx length")
        out[G_IDX] = projection[G_IDX][rank * per_rank : (rank + 1) * per_rank]
    return out


def shard_expert(
    expert: ExpertTensors, *, tp: int, rank: int, load_full_w2: bool, expert_id: int | None = None
) -> dict[str, Tensor]:
    """The rank's K-first tensors of one expert, exactly as the engine's loader fills them:
    w13_weight_packed [H/pf, 2·I_p], w2_weight_packed [I_p/pf, H], w13_weight_scale [G13, 2·I_p],
    w2_weight_scale [G2, H], and when present w13/w2_weight_zero_point, w13_weight_g_idx [H],
    w2_weight_g_idx [I_p]. All results are contiguous and share no memory with the input."""
    pack = expert_pack_factor(expert)
    gate = shard_gate_up(expert["gate"], tp=tp, rank=rank, pack=pack)
    up = shard_gate_up(expert["up"], tp=tp, rank=rank, pack=pack)
    down = shard_down(expert["down"], tp=tp, rank=rank, pack=pack, load_full_w2=load_full_w2)
    out = {
        "w13_weight_packed": torch.cat([gate[PACKED], up[PACKED]], dim=-1),
        "w2_weight_packed": down[PACKED].clone(memory_format=torch.contiguous_format),
        "w13_weight_scale": torch.cat([gate[SCALE], up[SCALE]], dim=-1),
        "w2_weight_scale": down[SCALE].clone(memory_format=torch.contiguous_format),
    }
    if ZERO_POINT in gate:
        out["w13_weight_zero_point"] = torch.cat([gate[ZERO_POINT], up[ZERO_POINT]], dim=-1)
        out["w2_weight_zero_point"] = down[ZERO_POINT].clone(memory_format=torch.contiguous_format)
    if G_IDX in gate:
        out["w13_weight_g_idx"] = gate_up_g_idx(expert, expert_id=expert_id).clone()
        out["w2_weight_g_idx"] = down[G_IDX].clone()
    return out


def gate_up_g_idx(expert: ExpertTensors, *, expert_id: int | None = None) -> Tensor:
    """The w13 g_idx (up's copy). gate's must be identical: the engine silently keeps up's."""
    gate, up = expert["gate"][G_IDX], expert["up"][G_IDX]
    where = first_difference(gate, up) if gate.shape == up.shape else (min(gate.shape[0], up.shape[0]),)
    if where is not None:
        raise LayoutMismatch(
            f"{_expert_name(expert_id)}: gate_proj.weight_g_idx and up_proj.weight_g_idx differ at "
            f"{list(where)}; the engine would keep up_proj's and mis-scale gate_proj"
        )
    return up


def expert_pack_factor(expert: ExpertTensors) -> int:
    """Codes per int32 word, from the shapes: down packs I codes into I/pf words per row."""
    _check_expert(expert)
    intermediate = expert["gate"][PACKED].shape[0]
    words = expert["down"][PACKED].shape[1]
    hidden = expert["down"][PACKED].shape[0]
    for pack in (8, 4):
        if words * pack == intermediate and expert["gate"][PACKED].shape[1] * pack == hidden:
            return pack
    raise ValueError(
        f"packed shapes gate {tuple(expert['gate'][PACKED].shape)} / down "
        f"{tuple(expert['down'][PACKED].shape)} fit neither 4- nor 8-bit packing"
    )


def unshard_expert(
    per_rank: Sequence[dict[str, Tensor]],
    *,
    tp: int,
    load_full_w2: bool,
    group_size: int,
    expert_id: int | None = None,
) -> ExpertTensors:
    """Exact inverse of `shard_expert` over all `tp` ranks (group_size -1 = channel-wise).

    Replicated parts (full or per-channel w2 scales, per-channel w2 zero points, the w13 g_idx)
    must be identical on every rank, else LayoutMismatch naming the rank.
    """
    if len(per_rank) != tp:
        raise ValueError(f"expected {tp} ranks, got {len(per_rank)}")
    name = _expert_name(expert_id)
    first = per_rank[0]

    def halves(key: str) -> tuple[Tensor, Tensor]:
        parts = [r[key] for r in per_rank]
        width = parts[0].shape[-1] // 2
        gate = torch.cat([p[..., :width] for p in parts], dim=-1)
        up = torch.cat([p[..., width:] for p in parts], dim=-1)
        return gate.transpose(0, 1).contiguous(), up.transpose(0, 1).contiguous()

    def rows(key: str, replicated: bool) -> Tensor:
        parts = [r[key] for r in per_rank]
        if replicated:
            return _replicated(parts, key, name).transpose(0, 1).contiguous()
        return torch.cat(parts, dim=0).transpose(0, 1).contiguous()

    gate: ProjectionTensors = {}
    up: ProjectionTensors = {}
    down: ProjectionTensors = {}
    gate[PACKED], up[PACKED] = halves("w13_weight_packed")
    gate[SCALE], up[SCALE] = halves("w13_weight_scale")
    down[PACKED] = rows("w2_weight_packed", replicated=False)
    channelwise = group_size == -1
    down[SCALE] = rows("w2_weight_scale", replicated=channelwise or load_full_w2)
    if "w13_weight_zero_point" in first:
        gate[ZERO_POINT], up[ZERO_POINT] = halves("w13_weight_zero_point")
        down[ZERO_POINT] = rows("w2_weight_zero_point", replicated=channelwise)
    if "w13_weight_g_idx" in first:
        g_idx = _replicated([r["w13_weight_g_idx"] for r in per_rank], "w13_weight_g_idx", name)
        gate[G_IDX] = g_idx.clone()
        up[G_IDX] = g_idx.clone()
        down[G_IDX] = torch.cat([r["w2_weight_g_idx"] for r in per_rank])
    return {"gate": gate, "up": up, "down": down}


def _replicated(parts: Sequence[Tensor], key: str, name: str) -> Tensor:
    for rank, part in enumerate(parts[1:], start=1):
        if part.shape != parts[0].shape:
            raise LayoutMismatch(
                f"{key} of {name}: rank {rank} has shape {tuple(part.shape)}, rank 0 {tuple(parts[0].shape)}"
            )
        where = first_difference(parts[0], part)
        if where is not None:
            raise LayoutMismatch(
                f"{key} of {name}: rank {rank} differs from rank 0 at {list(where)} although every "
                "rank holds the same copy"
            )
    return parts[0]


def _check_expert(expert: ExpertTensors) -> None:
    for projection in PROJECTIONS:
        if projection not in expert:
            raise ValueError(f"expert tensors lack the {projection!r} projection")
        for key in (PACKED, SCALE):
            if key not in expert[projection]:
                raise ValueError(f"{projection} lacks {key}")
    for key in (ZERO_POINT, G_IDX):
        present = [key in expert[p] for p in PROJECTIONS]
        if any(present) and not all(present):
            raise ValueError(f"{key} is present for some projections only: {dict(zip(PROJECTIONS, present))}")
    for key in expert["gate"]:
        if expert["gate"][key].shape != expert["up"][key].shape:
            raise ValueError(
                f"gate and up {key} shapes differ: {tuple(expert['gate'][key].shape)} vs "
                f"{tuple(expert['up'][key].shape)}"
            )


def _check_rank(tp: int, rank: int) -> None:
    if tp <= 0 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside [0, {tp})")


def _per_rank(size: int, tp: int, what: str) -> int:
    if size % tp != 0:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size {tp}")
    return size // tp


def _expert_name(expert_id: int | None) -> str:
    return "expert" if expert_id is None else f"expert {expert_id}"
