"""One tensor-parallel rank's MoE tensors in a kernel layout, built from checkpoint experts, and
the exact inverse back to the loader's per-rank (K-first) tensors.

Marlin (16-bit activations): shard -> zero-pad the intermediate dim to the tile multiple ->
act-order sort -> repack (w13 as (K, N) = (H, 2P), w2 as (P, H)) -> scale permutation (w13 with
size_k = H, which is what the kernel reads: the engine's own choice of size_k = I_p gives the
channel-wise permutation when I_p == group_size while the kernel reads grouped scales) ->
zero points. Transposed (Triton): shard -> N-first bytes.  Each layout's own module holds its
`forward` and `inverse` of one expert (`layout.marlin`, `layout.transposed`); this module reaches
them through the registry (`layout.registry.layout_of`).

Every expert is handled on its own (`build_expert_tensors` / `unbuild_expert_tensors`), so a
caller can stream experts; the rank functions stack them on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import torch
from torch import Tensor

from wna16ctl.dtypes import st_dtype, torch_dtype
from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout.shard import (
    G_IDX,
    PACKED,
    PROJECTIONS,
    SCALE,
    ZERO_POINT,
    ExpertTensors,
)
from wna16ctl.layout.registry import expert_shapes, layout_of
from wna16ctl.layout.spec import RankLayout

ShapeAndDtype = tuple[tuple[int, ...], torch.dtype]
# (packed K-first int32, num_bits, act-order perm or None, *, out=) -> out
MarlinRepack = Callable[..., Tensor]


def expected_rank_shapes(spec: RankLayout, num_local_experts: int, scale_dtype: torch.dtype) -> dict[str, ShapeAndDtype]:
    """name -> (shape, dtype) of every tensor `build_rank_tensors` returns, without computing any."""
    return {
        name: ((num_local_experts, *shape), dtype) for name, (shape, dtype) in expected_expert_shapes(spec, scale_dtype).items()
    }


def expected_expert_shapes(spec: RankLayout, scale_dtype: torch.dtype) -> dict[str, ShapeAndDtype]:
    """name -> (shape, dtype) of one expert's slice of the rank tensors (`spec.expert_shapes`)."""
    return {name: (shape, torch_dtype(dt)) for name, (shape, dt) in
            expert_shapes(spec, st_dtype(scale_dtype)).items()}


# ----------------------------------------------------------------------------------------------
# forward


def build_rank_tensors(
    experts: Sequence[ExpertTensors],
    spec: RankLayout,
    *,
    expert_ids: Sequence[int] | None = None,
    scale_dtype: torch.dtype | None = None,
    repack: MarlinRepack | None = None,
) -> dict[str, Tensor]:
    """The rank's tensors for `experts` (its local experts, in order), stacked on dim 0.

    Names carry no module prefix. `expert_ids` (global ids) only label error messages.
    Scales keep the checkpoint dtype unless `scale_dtype` is given; then they are cast the way
    the engine's loader casts them into its model-dtype parameters (bf16 -> fp16 rounds).
    `repack` replaces the torch Marlin weight repack with a bit-identical implementation (the
    native CPU or CUDA kernels of `wna16ctl.native.ops`), called as `repack(packed, nb, perm, out=)`.
    """
    if not experts:
        raise ValueError("no experts to lay out")
    ids = _expert_ids(expert_ids, len(experts))
    shapes = expected_rank_shapes(spec, len(experts), scale_dtype or experts[0]["gate"][SCALE].dtype)
    device = experts[0]["gate"][PACKED].device
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
    for e, (expert, expert_id) in enumerate(zip(experts, ids)):
        _build_expert_into(expert, spec, {name: t[e] for name, t in out.items()}, expert_id, repack)
    return out


def build_expert_tensors(
    expert: ExpertTensors,
    spec: RankLayout,
    *,
    expert_id: int | None = None,
    scale_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """One expert's slice of the rank tensors (no leading expert dim); see `build_rank_tensors`."""
    shapes = expected_expert_shapes(spec, scale_dtype or expert["gate"][SCALE].dtype)
    device = expert["gate"][PACKED].device
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
    _build_expert_into(expert, spec, out, expert_id)
    return out


def _build_expert_into(
    expert: ExpertTensors, spec: RankLayout, out: Mapping[str, Tensor], expert_id: int | None,
    repack: MarlinRepack | None = None,
) -> None:
    """Fill `out` (one expert's slices, shaped as `expected_expert_shapes`); copy_ casts scales
    to the dtype of their `out` tensor."""
    _check_expert_matches(expert, spec)
    layout_of(spec.layout).forward(expert, spec, out, expert_id, repack)


def _check_expert_matches(expert: ExpertTensors, spec: RankLayout) -> None:
    """The checkpoint expert has the shapes and optional tensors the spec promises."""
    h, i, pf = spec.hidden_size, spec.intermediate_size, spec.pack_factor
    g13 = spec.w13_groups
    g2 = 1 if spec.channelwise else i // spec.group_size
    expected = {
        "gate": {PACKED: (i, h // pf), SCALE: (i, g13), ZERO_POINT: (i // pf, g13), G_IDX: (h,)},
        "up": {PACKED: (i, h // pf), SCALE: (i, g13), ZERO_POINT: (i // pf, g13), G_IDX: (h,)},
        "down": {PACKED: (h, i // pf), SCALE: (h, g2), ZERO_POINT: (h // pf, g2), G_IDX: (i,)},
    }
    for projection in PROJECTIONS:
        if projection not in expert:
            raise ValueError(f"expert tensors lack the {projection!r} projection")
        tensors = expert[projection]
        wanted = {PACKED, SCALE}
        if not spec.symmetric:
            wanted.add(ZERO_POINT)
        if spec.act_order:
            wanted.add(G_IDX)
        missing = wanted - set(tensors)
        unexpected = {ZERO_POINT, G_IDX} & set(tensors) - wanted
        if missing or unexpected:
            raise ValueError(
                f"{projection} has tensors {sorted(tensors)}, the layout needs {sorted(wanted)}"
                + (" (zero points mean asymmetric, g_idx means act-order)" if unexpected else "")
            )
        for key in wanted:
            tensor = tensors[key]
            if tuple(tensor.shape) != expected[projection][key]:
                raise ValueError(
                    f"{projection}.{key} has shape {tuple(tensor.shape)}, expected {expected[projection][key]}"
                )
            if key in (PACKED, ZERO_POINT) and tensor.dtype != torch.int32:
                raise ValueError(f"{projection}.{key} must be int32, got {tensor.dtype}")


# ----------------------------------------------------------------------------------------------
# inverse


def unbuild_rank_tensors(
    tensors: Mapping[str, Tensor], spec: RankLayout, *, expert_ids: Sequence[int] | None = None
) -> list[dict[str, Tensor]]:
    """Exact inverse of `build_rank_tensors`: per local expert, the K-first `shard_expert` dict.

    Raises LayoutMismatch when the tensors cannot come from `build_rank_tensors` (wrong shapes,
    nonzero padding, unsorted g_idx, sort indices that are not its stable argsort, ...).
    """
    if not tensors:
        raise ValueError("no tensors to invert")
    counts = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(counts.values())) != 1:
        raise LayoutMismatch(f"tensors disagree on the number of experts: {counts}")
    count = next(iter(counts.values()))
    ids = _expert_ids(expert_ids, count)
    return [
        unbuild_expert_tensors({name: t[e] for name, t in tensors.items()}, spec, expert_id=ids[e])
        for e in range(count)
    ]


def unbuild_expert_tensors(
    tensors: Mapping[str, Tensor], spec: RankLayout, *, expert_id: int | None = None
) -> dict[str, Tensor]:
    """Exact inverse of `build_expert_tensors` on one expert's slices -> the `shard_expert` dict."""
    label = "expert" if expert_id is None else f"expert {expert_id}"
    expected = expected_expert_shapes(spec, _scale_dtype(tensors))
    if set(tensors) != set(expected):
        raise LayoutMismatch(f"{label}: tensors {sorted(tensors)} do not match the layout's {sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise LayoutMismatch(
                f"{name} of {label}: {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}"
            )
    return layout_of(spec.layout).inverse(tensors, spec, label)


def _scale_dtype(tensors: Mapping[str, Tensor]) -> torch.dtype:
    scale = tensors.get("w13_weight_scale")
    if scale is None:
        raise LayoutMismatch("w13_weight_scale is missing")
    if not scale.is_floating_point():
        raise LayoutMismatch(f"w13_weight_scale has dtype {scale.dtype}, expected a float type")
    return scale.dtype


def _expert_ids(expert_ids: Sequence[int] | None, count: int) -> list[int]:
    if expert_ids is None:
        return list(range(count))
    if len(expert_ids) != count:
        raise ValueError(f"{len(expert_ids)} expert ids for {count} experts")
    return list(expert_ids)
