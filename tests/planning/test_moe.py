"""The planner's rules as functions: the acceptance tables of the spec (§9.1, §9.2, §9.6)."""

from __future__ import annotations

import pytest

from wna16ctl.planning.moe import marlin_moe_padded_intermediate, marlin_support_reason, w2_scale_sharding

# spec §9.1: (actorder, gs, I_p, I) -> (load_full_w2, w2_scales_size, is_k_full)
W2_TABLE = [
    ("group", 32, 64, 128, (True, 128, False)),
    ("group", 32, 128, 128, (True, 128, True)),
    ("group", -1, 64, 128, (False, 64, False)),
    ("static", 32, 64, 128, (False, 64, True)),
    ("weight", 32, 64, 128, (False, 64, True)),
    (None, 32, 64, 128, (False, 64, True)),
]

# spec §9.2: I -> {gs: padded or None (= "skip": the gate rejects it)}
PAD_TABLE = {
    64: {-1: 64, 32: 64, 64: 64, 128: None},
    96: {-1: 128, 32: 128, 64: None, 128: None},
    100: {-1: 128, 32: None, 64: None, 128: None},
    176: {-1: 192, 32: None, 64: None, 128: None},
    192: {-1: 192, 32: 192, 64: 192, 128: None},
    256: {-1: 256, 32: 256, 64: 256, 128: 256},
    2816: {-1: 2816, 32: 2816, 64: 2816, 128: 2816},
}

# spec §9.6 Marlin gate: (H, I, gs, allow_tile_padding) -> supported
GATE_CASES = [
    (2560, 640, 128, False, True), (2560, 640, 128, True, True),
    (2560, 320, 128, False, False), (2560, 320, 128, True, False),
    (2560, 640, 96, False, False), (2570, 640, 128, True, False),
    (2560, 32, 32, True, True), (2560, 32, 32, False, False),
    (2560, 640, -1, False, True), (2560, 640, -1, True, True),
]


@pytest.mark.parametrize("actorder,gs,i_p,i,expected", W2_TABLE)
def test_w2_scale_sharding_table(actorder, gs, i_p, i, expected):
    got = w2_scale_sharding(actorder, gs, i_p, i)
    assert (got.load_full_w2, got.w2_scales_size, got.is_k_full) == expected


def test_dynamic_is_treated_as_group():
    assert w2_scale_sharding("dynamic", 32, 64, 128) == w2_scale_sharding("group", 32, 64, 128)


@pytest.mark.parametrize("i,gs", [(i, gs) for i, row in PAD_TABLE.items() for gs in row])
def test_padded_intermediate_table(i, gs):
    expected = PAD_TABLE[i][gs]
    gate = marlin_support_reason(2560, i, gs, allow_tile_padding=True)
    if expected is None:
        assert gate is not None
    else:
        assert gate is None
        assert marlin_moe_padded_intermediate(i, gs) == expected


@pytest.mark.parametrize("h,i,gs,pad,ok", GATE_CASES)
def test_marlin_gate_cases(h, i, gs, pad, ok):
    assert (marlin_support_reason(h, i, gs, pad) is None) == ok


@pytest.mark.parametrize("bits,gs,sym,actorder,tp,ep", [
    (4, 128, True, None, 2, False), (8, -1, True, None, 1, False), (4, 32, False, None, 4, False),
    (4, 64, True, "group", 2, False), (4, 32, True, None, 4, True), (4, -1, True, None, 1, False),
])
def test_rank_bytes_equal_the_layout_shapes(bits, gs, sym, actorder, tp, ep):
    """planning/moe.py sizes ranks without torch (inspect's path); they must equal the layout's shapes."""
    import torch

    from wna16ctl.sources.config import WeightScheme
    from wna16ctl.sources.moe import MoELayer
    from wna16ctl.layout.rank import RankLayout, expected_rank_shapes
    from wna16ctl.planning.moe import plan_layer

    H, I, E = 256, 96 if gs == -1 else 256, 6
    scheme = WeightScheme(num_bits=bits, group_size=gs, symmetric=sym, strategy="group" if gs > 0 else "channel",
                          actorder=actorder, format="pack-quantized")
    layer = MoELayer(prefix="m.layers.0.mlp.experts", layer_index=0, family="gate_up_down", num_experts=E,
                     hidden_size=H, intermediate_size=I, scheme=scheme, scale_dtype="BF16",
                     scheme_sets={(scheme, scheme, scheme): list(range(E))})
    plan = plan_layer(layer, tp, ep, engine="0.29.0", gpu="sm80")  # a release that still has act-order
    assert plan.loadable, plan.errors
    for r in range(tp):
        spec = RankLayout(layout=plan.layout, num_bits=bits, group_size=gs, symmetric=sym, act_order=scheme.act_order,
                          hidden_size=H, intermediate_size=I, tp=plan.moe_tp, rank=0 if ep else r,
                          load_full_w2=plan.layout_w2.load_full_w2, padded_intermediate=plan.padded_intermediate)
        shapes = expected_rank_shapes(spec, plan.local_experts[r], torch.bfloat16)
        nbytes = sum(torch.empty(0, dtype=dt).element_size() * torch.Size(shape).numel() for shape, dt in shapes.values())
        assert plan.rank_bytes[r] == nbytes
