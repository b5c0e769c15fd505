import dataclasses
import itertools

import numpy as np
import pytest
import torch

from tests.layout import reference
from tests.layout.data import assert_experts_equal, assert_tensors_equal, expert_to_numpy, random_expert, to_numpy
from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout.marlin import (
    marlin_moe_padded_intermediate,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_zero_points,
    marlin_zero_points_inverse,
)
from wna16ctl.layout.rank import (
    RankLayout,
    build_expert_tensors,
    build_rank_tensors,
    expected_rank_shapes,
    unbuild_rank_tensors,
)
from wna16ctl.layout.shard import shard_expert, unshard_expert

HIDDEN = 256
NUM_EXPERTS = 2


def _spec(layout, num_bits, group_size, symmetric, act_order, intermediate, tp, rank, load_full_w2,
          hidden=HIDDEN):
    i_p = intermediate // tp
    padded = i_p if layout == "transposed" or act_order else marlin_moe_padded_intermediate(i_p, group_size)
    return RankLayout(layout=layout, num_bits=num_bits, group_size=group_size, symmetric=symmetric,
                      act_order=act_order, hidden_size=hidden, intermediate_size=intermediate, tp=tp, rank=rank,
                      load_full_w2=load_full_w2, padded_intermediate=padded)


def _experts(num_bits, group_size, symmetric, act_order, intermediate, hidden=HIDDEN, count=NUM_EXPERTS,
             scale_dtype=torch.bfloat16):
    return [random_expert(hidden, intermediate, num_bits=num_bits, group_size=group_size, symmetric=symmetric,
                          act_order=act_order, scale_dtype=scale_dtype, seed=e) for e in range(count)]


def _round_trip(experts, specs):
    """Build every rank, compare with the reference and the expected shapes, invert, reassemble."""
    per_rank_expert = []
    for spec in specs:
        built = build_rank_tensors(experts, spec)
        expected_shapes = expected_rank_shapes(spec, len(experts), experts[0]["gate"]["weight_scale"].dtype)
        assert {k: (tuple(v.shape), v.dtype) for k, v in built.items()} == expected_shapes
        ref = reference.rank_tensors(
            [expert_to_numpy(e) for e in experts], layout=spec.layout, tp=spec.tp, rank=spec.rank,
            load_full_w2=spec.load_full_w2, group_size=spec.group_size, num_bits=spec.num_bits,
            act_order=spec.act_order)
        assert sorted(ref) == sorted(built)
        for name in built:
            assert np.array_equal(to_numpy(built[name]), ref[name]), name
        unbuilt = unbuild_rank_tensors(built, spec)
        for e, expert in enumerate(experts):
            kfirst = shard_expert(expert, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2)
            assert_tensors_equal(unbuilt[e], kfirst)
        per_rank_expert.append(unbuilt)
    for e, expert in enumerate(experts):
        assembled = unshard_expert([ranks[e] for ranks in per_rank_expert], tp=specs[0].tp,
                                   load_full_w2=specs[0].load_full_w2, group_size=specs[0].group_size)
        assert_experts_equal(assembled, expert)


def _grid_case_is_meaningful(layout, num_bits, group_size, symmetric, act_order, tp, load_full_w2):
    if act_order and (group_size == -1 or layout == "transposed"):
        return False  # act-order needs groups and only Marlin has an act-order form
    # load_full_w2 without act-order (the pre-fix engine behaviour): one TP size is enough
    return not (load_full_w2 and not act_order and tp != 2)


GRID = [
    case
    for case in itertools.product(
        ["marlin", "transposed"], [4, 8], [-1, 32, 64, 128], [True, False], [False, True], [1, 2, 4], [False, True]
    )
    if _grid_case_is_meaningful(*case)
]


@pytest.mark.parametrize("layout,num_bits,group_size,symmetric,act_order,tp,load_full_w2", GRID)
def test_round_trip_grid(layout, num_bits, group_size, symmetric, act_order, tp, load_full_w2):
    intermediate = 512
    experts = _experts(num_bits, group_size, symmetric, act_order, intermediate)
    specs = [_spec(layout, num_bits, group_size, symmetric, act_order, intermediate, tp, r, load_full_w2)
             for r in range(tp)]
    _round_trip(experts, specs)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("group_size,i_p,padded", [(-1, 96, 128), (32, 96, 128), (-1, 104, 128), (64, 192, 192)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip_with_tile_padding(num_bits, group_size, i_p, padded, symmetric):
    tp = 2
    experts = _experts(num_bits, group_size, symmetric, False, i_p * tp)
    specs = [_spec("marlin", num_bits, group_size, symmetric, False, i_p * tp, tp, r, False) for r in range(tp)]
    assert specs[0].padded_intermediate == padded
    _round_trip(experts, specs)


@pytest.mark.parametrize("layout", ["marlin", "transposed"])
def test_expert_slices_equal_rank_tensors(layout):
    experts = _experts(4, 64, False, False, 512, count=3)
    spec = _spec(layout, 4, 64, False, False, 512, 2, 1, False)
    built = build_rank_tensors(experts, spec, expert_ids=[7, 8, 9])
    for e, expert in enumerate(experts):
        assert_tensors_equal(build_expert_tensors(expert, spec), {k: v[e] for k, v in built.items()})


def test_fp16_scales_keep_dtype():
    experts = _experts(4, 128, False, True, 512, scale_dtype=torch.float16)
    _round_trip(experts, [_spec("marlin", 4, 128, False, True, 512, 2, r, True) for r in range(2)])


@pytest.mark.parametrize("layout", ["marlin", "transposed"])
def test_scales_cast_to_requested_dtype(layout):
    experts = _experts(4, 128, True, False, 512)  # bf16 scales
    spec = _spec(layout, 4, 128, True, False, 512, 2, 0, False)
    cast = build_rank_tensors(experts, spec, scale_dtype=torch.float16)
    kept = build_rank_tensors(experts, spec)
    for name in ("w13_weight_scale", "w2_weight_scale"):
        assert kept[name].dtype == torch.bfloat16 and cast[name].dtype == torch.float16
        assert torch.equal(cast[name], kept[name].to(torch.float16))
    assert torch.equal(cast["w13_weight_packed"], kept["w13_weight_packed"])


def test_w13_scales_use_hidden_size_not_intermediate():
    # I_p == group_size: the engine's size_k = I_p would pick the single permutation; the kernel
    # reads G13 = H/gs > 1 groups, so the grouped permutation (size_k = H) is the one written.
    experts = _experts(4, 128, True, False, 512)
    spec = _spec("marlin", 4, 128, True, False, 512, 4, 1, False)
    assert spec.intermediate_per_partition == 128
    built = build_rank_tensors(experts, spec)
    kfirst = shard_expert(experts[0], tp=4, rank=1, load_full_w2=False)["w13_weight_scale"]
    grouped = reference.permute_scales(to_numpy(kfirst), HIDDEN, 128)
    single = reference.permute_scales(to_numpy(kfirst), 128, 128)
    assert np.array_equal(to_numpy(built["w13_weight_scale"][0]), grouped)
    assert not np.array_equal(grouped, single)


def test_worked_example_shapes():
    # H 2048, I 768, int4 g128, TP 2 -> I_p 384 (few experts instead of 128)
    experts = _experts(4, 128, True, False, 768, hidden=2048)
    spec = _spec("marlin", 4, 128, True, False, 768, 2, 1, False, hidden=2048)
    assert spec.padded_intermediate == 384
    pre = shard_expert(experts[0], tp=2, rank=1, load_full_w2=False)
    assert {k: tuple(v.shape) for k, v in pre.items()} == {
        "w13_weight_packed": (256, 768), "w13_weight_scale": (16, 768),
        "w2_weight_packed": (48, 2048), "w2_weight_scale": (3, 2048)}
    post = build_rank_tensors(experts, spec)
    assert {k: tuple(v.shape) for k, v in post.items()} == {
        "w13_weight_packed": (2, 128, 1536), "w13_weight_scale": (2, 16, 768),
        "w2_weight_packed": (2, 24, 4096), "w2_weight_scale": (2, 3, 2048)}
    assert {k: s for k, (s, _) in expected_rank_shapes(spec, 128, torch.bfloat16).items()} == {
        "w13_weight_packed": (128, 128, 1536), "w13_weight_scale": (128, 16, 768),
        "w2_weight_packed": (128, 24, 4096), "w2_weight_scale": (128, 3, 2048)}


def test_channelwise_check_case_shapes():
    experts = _experts(4, -1, True, False, 512)
    post = build_rank_tensors(experts, _spec("marlin", 4, -1, True, False, 512, 1, 0, False))
    assert {k: tuple(v.shape) for k, v in post.items()} == {
        "w13_weight_packed": (2, 16, 2048), "w2_weight_packed": (2, 32, 512),
        "w13_weight_scale": (2, 1, 1024), "w2_weight_scale": (2, 1, 256)}


def test_act_order_outputs_sorted_g_idx_and_stable_argsort():
    experts = _experts(8, 32, True, True, 256)
    built = build_rank_tensors(experts, _spec("marlin", 8, 32, True, True, 256, 2, 1, True))
    for e, expert in enumerate(experts):
        g_idx = expert["up"]["weight_g_idx"].numpy()
        order = np.argsort(g_idx, kind="stable")
        assert np.array_equal(built["w13_g_idx_sort_indices"][e].numpy(), order)
        assert np.array_equal(built["w13_weight_g_idx"][e].numpy(), g_idx[order])
        assert np.array_equal(built["w2_weight_g_idx"][e].numpy(), np.sort(expert["down"]["weight_g_idx"][128:].numpy()))


# ---------------------------------------------------------------------------------------------
# corrupted data


def _built(layout="marlin", group_size=32, symmetric=False, act_order=False, intermediate=192, tp=2, rank=1):
    experts = _experts(4, group_size, symmetric, act_order, intermediate)
    spec = _spec(layout, 4, group_size, symmetric, act_order, intermediate, tp, rank, act_order)
    return experts, spec, build_rank_tensors(experts, spec)


def _flat_bytes(tensors):
    return torch.cat([v.contiguous().view(torch.uint8).view(-1) for _, v in sorted(tensors.items())])


@pytest.mark.parametrize("layout", ["marlin", "transposed"])
@pytest.mark.parametrize("name", ["w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale",
                                  "w13_weight_zero_point", "w2_weight_zero_point"])
def test_corruption_is_detected_by_comparison(layout, name):
    experts, spec, built = _built(layout=layout, intermediate=256)
    tensor = built[name]
    bits = tensor.view(torch.uint8).view(-1)
    bits[bits.numel() // 3] ^= 0x10  # one nibble / one scale bit
    unbuilt = unbuild_rank_tensors(built, spec)
    differs = [
        not torch.equal(_flat_bytes(unbuilt[e]), _flat_bytes(shard_expert(x, tp=2, rank=1, load_full_w2=False)))
        for e, x in enumerate(experts)
    ]
    assert differs.count(True) == 1


def test_nonzero_weight_padding_raises():
    _, spec, built = _built(group_size=32, intermediate=192)  # I_p 96 -> P 128
    assert spec.padded_intermediate == 128
    kfirst = marlin_unrepack(built["w2_weight_packed"][1], 4, 128, HIDDEN)
    kfirst[15, 3] = 1  # rows 12..15 of 16 are padding (K-first words of 8 codes)
    built["w2_weight_packed"][1] = marlin_repack(kfirst, 4)
    with pytest.raises(LayoutMismatch, match=r"w2_weight_packed of expert 1 .*\[15, 3\]"):
        unbuild_rank_tensors(built, spec)


def test_nonzero_w13_weight_padding_raises():
    _, spec, built = _built(group_size=-1, intermediate=192)
    kfirst = marlin_unrepack(built["w13_weight_packed"][0], 4, HIDDEN, 256)
    kfirst[0, 250] = 7  # up half: columns 128+96 .. 255 are padding
    built["w13_weight_packed"][0] = marlin_repack(kfirst, 4)
    with pytest.raises(LayoutMismatch, match=r"w13_weight_packed of expert 0 .*\[0, 250\]"):
        unbuild_rank_tensors(built, spec)


def test_nonzero_scale_and_zero_point_padding_raise():
    _, spec, built = _built(group_size=32, intermediate=192)
    scale = marlin_unpermute_scales(built["w13_weight_scale"][0], HIDDEN, 256, 32)
    scale[2, 100] = 1.0
    built["w13_weight_scale"][0] = marlin_permute_scales(scale, HIDDEN, 256, 32)
    with pytest.raises(LayoutMismatch, match=r"w13_weight_scale of expert 0 .*\[2, 100\]"):
        unbuild_rank_tensors(built, spec)

    _, spec, built = _built(group_size=32, intermediate=192)
    zp = marlin_zero_points_inverse(built["w2_weight_zero_point"][1], 4, HIDDEN, 4)
    zp[3, 0] = 1
    built["w2_weight_zero_point"][1] = marlin_zero_points(zp, 4, HIDDEN, 4)
    with pytest.raises(LayoutMismatch, match=r"w2_weight_zero_point of expert 1 .*\[3, 0\]"):
        unbuild_rank_tensors(built, spec)


def test_act_order_metadata_is_checked():
    _, spec, built = _built(group_size=32, act_order=True, intermediate=256)
    good = {k: v.clone() for k, v in built.items()}

    tie = dict(good)  # swap two rows of equal group id: same g_idx, not the stable order
    perm = good["w13_g_idx_sort_indices"].clone()
    perm[0, [0, 1]] = perm[0, [1, 0]]
    tie["w13_g_idx_sort_indices"] = perm
    with pytest.raises(LayoutMismatch, match=r"w13_g_idx_sort_indices of expert 0: \[0\].*stable argsort"):
        unbuild_rank_tensors(tie, spec)

    unsorted = dict(good)
    g_idx = good["w2_weight_g_idx"].clone()
    g_idx[1, [0, -1]] = g_idx[1, [-1, 0]]
    unsorted["w2_weight_g_idx"] = g_idx
    with pytest.raises(LayoutMismatch, match=r"w2_weight_g_idx of expert 1 is not sorted"):
        unbuild_rank_tensors(unsorted, spec)

    duplicate = dict(good)
    perm = good["w2_g_idx_sort_indices"].clone()
    perm[0, 5] = perm[0, 6]
    duplicate["w2_g_idx_sort_indices"] = perm
    with pytest.raises(LayoutMismatch, match="not a permutation"):
        unbuild_rank_tensors(duplicate, spec)

    wrong_shape = dict(good)
    wrong_shape["w2_weight_scale"] = good["w2_weight_scale"][:, :-1]
    with pytest.raises(LayoutMismatch, match="w2_weight_scale of expert 0"):
        unbuild_rank_tensors(wrong_shape, spec)


# ---------------------------------------------------------------------------------------------
# misuse


def test_rank_layout_validation():
    base = _spec("marlin", 4, 128, True, False, 512, 2, 0, False)
    for change in [
        dict(layout="humming"), dict(num_bits=3), dict(rank=2), dict(group_size=0), dict(group_size=96),
        dict(act_order=True, group_size=-1), dict(padded_intermediate=200), dict(padded_intermediate=128),
        dict(layout="transposed", padded_intermediate=384), dict(layout="transposed", act_order=True),
        dict(act_order=True, padded_intermediate=384), dict(hidden_size=200),
    ]:
        with pytest.raises(ValueError):
            dataclasses.replace(base, **change)
    assert base.pack_factor == 8 and base.intermediate_per_partition == 256


def test_build_rejects_experts_that_do_not_match_the_spec():
    experts = _experts(4, 128, True, False, 512)
    with pytest.raises(ValueError):
        build_rank_tensors(experts, _spec("marlin", 4, 128, False, False, 512, 1, 0, False))
    with pytest.raises(ValueError):
        build_rank_tensors(experts, _spec("marlin", 4, 64, True, False, 512, 1, 0, False))
    with pytest.raises(ValueError):
        build_rank_tensors(experts, _spec("marlin", 8, 128, True, False, 512, 1, 0, False))
    with pytest.raises(ValueError):
        build_rank_tensors([], _spec("marlin", 4, 128, True, False, 512, 1, 0, False))
