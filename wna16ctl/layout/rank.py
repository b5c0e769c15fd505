"""One tensor-parallel rank's MoE tensors in a kernel layout, built from checkpoint experts, and
the exact inverse back to the loader's per-rank (K-first) tensors.

Marlin (16-bit activations): shard -> zero-pad the intermediate dim to the tile multiple ->
act-order sort -> repack (w13 as (K, N) = (H, 2P), w2 as (P, H)) -> scale permutation (w13 with
size_k = H, which is what the kernel reads: the engine's own choice of size_k = I_p gives the
channel-wise permutation when I_p == group_size while the kernel reads grouped scales) ->
zero points. Transposed (Triton): shard -> N-first bytes.

Every expert is handled on its own (`build_expert_tensors` / `unbuild_expert_tensors`), so a
caller can stream experts; the rank functions stack them on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import torch
from torch import Tensor

from wna16ctl.dtypes import st_dtype, torch_dtype
from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout._mismatch import first_difference
from wna16ctl.layout.marlin import (
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_zero_points,
    marlin_zero_points_inverse,
    pad_intermediate_halves,
    pad_intermediate_rows,
    sort_g_idx,
    unpad_intermediate_halves,
    unpad_intermediate_rows,
)
from wna16ctl.layout.shard import (
    G_IDX,
    PACKED,
    PROJECTIONS,
    SCALE,
    ZERO_POINT,
    ExpertTensors,
    gate_up_g_idx,
    shard_down,
    shard_expert,
    shard_gate_up,
)
from wna16ctl.layout.spec import LAYOUTS, MARLIN, TRANSPOSED, RankLayout, expert_shapes, w2_scale_size_k  # noqa: F401 - LAYOUTS and TRANSPOSED re-exported
from wna16ctl.layout.transposed import (
    from_transposed_scales,
    from_transposed_weight,
    from_transposed_zero_points,
    to_transposed_scales,
    to_transposed_weight,
    to_transposed_zero_points,
)

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
    if spec.layout == MARLIN:
        _marlin_expert_into(expert, spec, out, expert_id, repack or marlin_repack)
        return
    kfirst = shard_expert(expert, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2, expert_id=expert_id)
    for name, tensor in _transposed_expert(kfirst, spec).items():
        out[name].copy_(tensor)


def _marlin_expert_into(
    expert: ExpertTensors, spec: RankLayout, out: Mapping[str, Tensor], expert_id: int | None,
    repack: MarlinRepack,
) -> None:
    h, i_p, p, pf, nb, gs = (
        spec.hidden_size,
        spec.intermediate_per_partition,
        spec.padded_intermediate,
        spec.pack_factor,
        spec.num_bits,
        spec.group_size,
    )
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
    out["w2_weight_scale"].copy_(marlin_permute_scales(w2_scale, _w2_scale_size_k(spec), h, gs))

    if not spec.symmetric:
        w13_zp = torch.cat([gate[ZERO_POINT], up[ZERO_POINT]], dim=-1)
        w13_zp = pad_intermediate_halves(w13_zp, i_p // pf, p // pf)
        out["w13_weight_zero_point"].copy_(marlin_zero_points(w13_zp, spec.w13_groups, 2 * p, nb))
        w2_zp = down[ZERO_POINT]
        if gs > 0:
            w2_zp = pad_intermediate_rows(w2_zp, i_p // gs, p // gs)
        out["w2_weight_zero_point"].copy_(marlin_zero_points(w2_zp, spec.w2_zero_point_groups, h, nb))


_w2_scale_size_k = w2_scale_size_k


def _transposed_expert(kfirst: Mapping[str, Tensor], spec: RankLayout) -> dict[str, Tensor]:
    out = {
        "w13_weight_packed": to_transposed_weight(kfirst["w13_weight_packed"]),
        "w2_weight_packed": to_transposed_weight(kfirst["w2_weight_packed"]),
        "w13_weight_scale": to_transposed_scales(kfirst["w13_weight_scale"]),
        "w2_weight_scale": to_transposed_scales(kfirst["w2_weight_scale"]),
    }
    if not spec.symmetric:
        out["w13_weight_zero_point"] = to_transposed_zero_points(kfirst["w13_weight_zero_point"], spec.num_bits)
        out["w2_weight_zero_point"] = to_transposed_zero_points(kfirst["w2_weight_zero_point"], spec.num_bits)
    return out


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
    if spec.layout == MARLIN:
        return _unmarlin_expert(tensors, spec, label)
    return _untransposed_expert(tensors, spec)


def _unmarlin_expert(tensors: Mapping[str, Tensor], spec: RankLayout, label: str) -> dict[str, Tensor]:
    h, i_p, p, pf, nb, gs = (
        spec.hidden_size,
        spec.intermediate_per_partition,
        spec.padded_intermediate,
        spec.pack_factor,
        spec.num_bits,
        spec.group_size,
    )
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
    w2_scale = marlin_unpermute_scales(tensors["w2_weight_scale"], _w2_scale_size_k(spec), h, gs)
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


def _untransposed_expert(tensors: Mapping[str, Tensor], spec: RankLayout) -> dict[str, Tensor]:
    out = {
        "w13_weight_packed": from_transposed_weight(tensors["w13_weight_packed"]),
        "w2_weight_packed": from_transposed_weight(tensors["w2_weight_packed"]),
        "w13_weight_scale": from_transposed_scales(tensors["w13_weight_scale"]),
        "w2_weight_scale": from_transposed_scales(tensors["w2_weight_scale"]),
    }
    if not spec.symmetric:
        out["w13_weight_zero_point"] = from_transposed_zero_points(tensors["w13_weight_zero_point"], spec.num_bits)
        out["w2_weight_zero_point"] = from_transposed_zero_points(tensors["w2_weight_zero_point"], spec.num_bits)
    return out


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
