import numpy as np
import pytest
import torch

from tests.layout import reference
from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout.marlin import (
    marlin_moe_padded_intermediate,
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
from wna16ctl.layout.packing import pack_codes

# §9.3 (N, K) shapes
SPEC_SHAPES = [(256, 1024), (448, 640), (832, 1408), (1024, 1024), (1792, 640), (3328, 1408)]
TINY_SHAPES = [(64, 16), (128, 32), (192, 48)]


def _codes(size_k, size_n, num_bits, seed):
    return torch.randint(0, 1 << num_bits, (size_k, size_n), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int32)


def _act_order_perm(size_k, group_size, seed):
    """Sort indices of a random act-order g_idx, as the engine computes them."""
    g = torch.Generator().manual_seed(seed)
    g_idx = (torch.arange(size_k) // group_size)[torch.randperm(size_k, generator=g)]
    return sort_g_idx(g_idx)[1]


# ---------------------------------------------------------------------------------------------
# §9.2 padding

PADDED_TABLE = {
    64: {-1: 64, 32: 64, 64: 64},
    96: {-1: 128, 32: 128},
    100: {-1: 128},
    176: {-1: 192},
    192: {-1: 192, 32: 192, 64: 192},
    256: {-1: 256, 32: 256, 64: 256, 128: 256},
    2816: {-1: 2816, 32: 2816, 64: 2816, 128: 2816},
}


@pytest.mark.parametrize("i_p", sorted(PADDED_TABLE))
def test_padded_intermediate_table(i_p):
    for group_size, padded in PADDED_TABLE[i_p].items():
        assert marlin_moe_padded_intermediate(i_p, group_size) == padded
        assert padded == reference.padded_intermediate(i_p, group_size)


def test_padded_intermediate_rejects_straddling_groups():
    with pytest.raises(ValueError):
        marlin_moe_padded_intermediate(96, 64)


def test_pad_helper_case():
    w13 = torch.arange(1, 2 * 8 * 192 + 1, dtype=torch.float32).reshape(2, 8, 192)
    padded = pad_intermediate_halves(w13, 96, 128)
    assert padded.shape == (2, 8, 256)
    assert torch.equal(padded[..., :96], w13[..., :96])
    assert torch.equal(padded[..., 128:224], w13[..., 96:])
    assert not padded[..., 96:128].any() and not padded[..., 224:].any()
    assert torch.equal(unpad_intermediate_halves(padded, 96, 128, what="w13"), w13)

    w2 = torch.arange(1, 2 * 3 * 16 + 1, dtype=torch.int32).reshape(2, 3, 16)
    padded_rows = pad_intermediate_rows(w2, 3, 4)
    assert padded_rows.shape == (2, 4, 16)
    assert torch.equal(padded_rows[:, :3], w2) and not padded_rows[:, 3].any()
    assert torch.equal(unpad_intermediate_rows(padded_rows, 3, 4, what="w2"), w2)


def test_nonzero_padding_raises_with_coordinate():
    padded = pad_intermediate_halves(torch.ones(2, 8, 192), 96, 128)
    padded[1, 5, 230] = 3.0
    with pytest.raises(LayoutMismatch, match=r"w13 of expert 1.*\[1, 5, 230\]"):
        unpad_intermediate_halves(padded, 96, 128, what="w13 of expert 1")
    rows = pad_intermediate_rows(torch.ones(2, 3, 16, dtype=torch.int32), 3, 4)
    rows[0, 3, 7] = -1
    with pytest.raises(LayoutMismatch, match=r"\[0, 3, 7\]"):
        unpad_intermediate_rows(rows, 3, 4, what="w2")
    negative_zero = pad_intermediate_rows(torch.ones(3, 16), 3, 4)
    negative_zero[3, 0] = -0.0
    with pytest.raises(LayoutMismatch):
        unpad_intermediate_rows(negative_zero, 3, 4, what="w2 scale")


# ---------------------------------------------------------------------------------------------
# §6.3 act-order


def test_sort_g_idx_is_stable():
    g_idx = torch.tensor([[2, 0, 1, 0, 2, 1, 0]], dtype=torch.int32)
    sorted_g_idx, order = sort_g_idx(g_idx)
    assert order.dtype == torch.int32 and sorted_g_idx.dtype == torch.int32
    assert order.tolist() == [[1, 3, 6, 2, 5, 0, 4]]
    assert sorted_g_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    big = torch.randint(0, 4, (4096,), dtype=torch.int32)
    assert np.array_equal(sort_g_idx(big)[1].numpy(), np.argsort(big.numpy(), kind="stable"))


# ---------------------------------------------------------------------------------------------
# §6.4 repack


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("size_n,size_k", TINY_SHAPES)
def test_repack_tiny_equals_scalar_closed_form(num_bits, size_n, size_k):
    q = _codes(size_k, size_n, num_bits, seed=size_k)
    out = marlin_repack(pack_codes(q, num_bits, dim=0), num_bits)
    loops = np.array(reference.marlin_closed_form_loops(q.tolist(), num_bits), dtype=np.uint64)
    assert np.array_equal(out.numpy(), loops.astype(np.uint32).view(np.int32))


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("size_n,size_k", SPEC_SHAPES)
def test_repack_equals_references_on_spec_shapes(num_bits, act_order, size_n, size_k):
    q = _codes(size_k, size_n, num_bits, seed=size_n + num_bits)
    packed = pack_codes(q, num_bits, dim=0)
    perm = _act_order_perm(size_k, 128, seed=size_k) if act_order else None
    out = marlin_repack(packed, num_bits, perm)
    assert out.shape == (size_k // 16, size_n * 16 * num_bits // 32) and out.dtype == torch.int32
    q_sorted = q.numpy()[perm.numpy()] if act_order else q.numpy()
    assert np.array_equal(out.numpy(), reference.marlin_table_form(q_sorted, num_bits))
    assert np.array_equal(out.numpy(), reference.marlin_closed_form(q_sorted, num_bits))
    assert torch.equal(marlin_unrepack(out, num_bits, size_k, size_n, perm, native=False), packed)
    assert torch.equal(marlin_unrepack(out, num_bits, size_k, size_n, perm), packed)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("experts,size_k,size_n", [(1, 16, 64), (3, 64, 192), (2, 2048, 768), (1, 384, 2048)])
def test_native_untile_equals_the_torch_inverse_on_any_words(num_bits, experts, size_k, size_n):
    """Every int32 word is some Marlin tile's word, so arbitrary words check each bit's way back."""
    from wna16ctl.native.ops import marlin_untile_host, native_host_available

    if not native_host_available():
        pytest.skip("the native host library cannot be built here (no g++)")
    gen = torch.Generator().manual_seed(size_k * size_n + num_bits)
    words = torch.randint(-(2**31), 2**31, (experts, size_k // 16, size_n * 16 * num_bits // 32),
                          dtype=torch.int32, generator=gen)
    by_torch = marlin_unrepack(words, num_bits, size_k, size_n, native=False)
    out = torch.empty_like(by_torch)
    assert marlin_untile_host(words, out, num_bits, size_k, size_n)
    assert torch.equal(out, by_torch)
    # importing wna16ctl.native.ops installed it as the layout's un-tiling
    from wna16ctl.layout import marlin as marlin_layout

    assert marlin_layout._untile_accelerator is marlin_untile_host
    # an expert taken from a wider tensor (not contiguous) gives the same words
    wide = torch.cat([words, words], dim=-1)[..., : words.shape[-1]]
    assert torch.equal(marlin_unrepack(wide, num_bits, size_k, size_n), by_torch)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_repack_with_expert_dim_and_strided_input(num_bits):
    q = torch.randint(0, 1 << num_bits, (3, 64, 128), dtype=torch.int32)
    packed = pack_codes(q, num_bits, dim=1)
    perms = torch.stack([_act_order_perm(64, 32, seed=e) for e in range(3)])
    out = marlin_repack(packed, num_bits, perms)
    for e in range(3):
        expected = reference.marlin_table_form(q[e].numpy()[perms[e].numpy()], num_bits)
        assert np.array_equal(out[e].numpy(), expected)
    assert torch.equal(marlin_unrepack(out, num_bits, 64, 128, perms), packed)
    # a transposed (non-contiguous) view gives the same result as its contiguous copy
    n_first = packed[0].t().contiguous()
    assert torch.equal(marlin_repack(n_first.t(), num_bits), marlin_repack(packed[0], num_bits))


def test_repack_into_a_column_slice():
    packed = pack_codes(torch.randint(0, 16, (32, 128), dtype=torch.int32), 4, dim=0)
    wide = torch.zeros(2, 512, dtype=torch.int32)
    marlin_repack(packed, 4, out=wide[:, 256:])
    assert torch.equal(wide[:, 256:], marlin_repack(packed, 4)) and not wide[:, :256].any()
    with pytest.raises(ValueError):
        marlin_repack(packed, 4, out=wide)
    with pytest.raises(ValueError):
        marlin_repack(packed, 4, out=wide[:, ::2])


def test_repack_shape_errors_use_kernel_wording():
    with pytest.raises(ValueError, match="size_k = 8 is not divisible by tile_k_size = 16"):
        marlin_repack(torch.zeros(1, 64, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="size_n = 96 is not divisible by tile_n_size = 64"):
        marlin_repack(torch.zeros(2, 96, dtype=torch.int32), 4)
    with pytest.raises(ValueError):
        marlin_repack(torch.zeros(2, 64, dtype=torch.int64), 4)
    with pytest.raises(ValueError):
        marlin_repack(torch.zeros(2, 64, dtype=torch.int32), 4, perm=torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError):
        marlin_unrepack(torch.zeros(1, 128, dtype=torch.int32), 4, 32, 64)


# ---------------------------------------------------------------------------------------------
# §6.5 scales


@pytest.mark.parametrize(
    "size_k,group_size,grouped",
    [(1024, 128, True), (1024, 32, True), (128, 128, False), (1024, -1, False), (8, -1, False)],
)
def test_scale_permutation_matches_reference(size_k, group_size, grouped):
    groups = 1 if group_size == -1 else size_k // group_size
    s = torch.randn(groups, 256, dtype=torch.float32)
    out = marlin_permute_scales(s, size_k, 256, group_size)
    assert np.array_equal(out.numpy(), reference.permute_scales(s.numpy(), size_k, group_size))
    assert torch.equal(marlin_unpermute_scales(out, size_k, 256, group_size), s)
    single = reference.permute_scales(s.numpy(), size_k, -1)
    assert np.array_equal(out.numpy(), single) != grouped


def test_scale_permutation_keeps_dtype_and_expert_dim():
    s = torch.randn(3, 4, 128).to(torch.bfloat16)
    out = marlin_permute_scales(s, 512, 128, 128)
    assert out.dtype == torch.bfloat16 and out.shape == s.shape
    for e in range(3):
        expected = reference.permute_scales(s[e].view(torch.int16).numpy(), 512, 128)
        assert np.array_equal(out[e].view(torch.int16).numpy(), expected)


# ---------------------------------------------------------------------------------------------
# §6.6 zero points


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("groups", [1, 5])
def test_zero_points_match_reference(num_bits, groups):
    size_n = 192
    codes = torch.randint(0, 1 << num_bits, (groups, size_n), dtype=torch.int32)
    zp = pack_codes(codes, num_bits, dim=1)
    out = marlin_zero_points(zp, groups, size_n, num_bits)
    assert out.shape == zp.shape and out.dtype == torch.int32
    assert np.array_equal(out.numpy(), reference.marlin_zero_points(zp.numpy(), size_n, num_bits))
    assert torch.equal(marlin_zero_points_inverse(out, groups, size_n, num_bits), zp)


def test_zero_points_expert_dim():
    zp = pack_codes(torch.randint(0, 16, (2, 3, 128), dtype=torch.int32), 4, dim=-1)
    out = marlin_zero_points(zp, 3, 128, 4)
    for e in range(2):
        assert np.array_equal(out[e].numpy(), reference.marlin_zero_points(zp[e].numpy(), 128, 4))
    with pytest.raises(ValueError):
        marlin_zero_points(zp, 4, 128, 4)
