import numpy as np
import pytest
import torch

from tests.layout import reference
from wna16ctl.layout.packing import pack_codes
from wna16ctl.layout.transposed import (
    from_transposed_scales,
    from_transposed_weight,
    from_transposed_zero_points,
    to_transposed_scales,
    to_transposed_weight,
    to_transposed_zero_points,
)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_weight_bytes_follow_kernel_addressing(num_bits):
    codes = torch.randint(0, 1 << num_bits, (3, 64, 40), dtype=torch.int32)  # [E, K, N]
    packed = pack_codes(codes, num_bits, dim=1)
    out = to_transposed_weight(packed)
    assert out.dtype == torch.uint8 and out.shape == (3, 40, 64 * num_bits // 8)
    for e in range(3):
        expected = reference.transposed_expert(
            {"w13_weight_packed": packed[e].numpy(), "w2_weight_packed": packed[e].numpy(),
             "w13_weight_scale": np.zeros((1, 1)), "w2_weight_scale": np.zeros((1, 1))}, num_bits)
        assert np.array_equal(out[e].numpy(), expected["w13_weight_packed"])
    # spot-check §7.2 directly: int4 byte k//2, nibble (k mod 2)·4; int8 byte k
    n, k = 7, 13
    byte = int(out[1, n, k * num_bits // 8])
    code = (byte >> ((k % 2) * 4)) & 0xF if num_bits == 4 else byte
    assert code == int(codes[1, k, n])
    assert torch.equal(from_transposed_weight(out), packed)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_zero_point_bytes_follow_kernel_addressing(num_bits):
    codes = torch.randint(0, 1 << num_bits, (2, 3, 64), dtype=torch.int32)  # [E, G, N]
    zp = pack_codes(codes, num_bits, dim=-1)
    out = to_transposed_zero_points(zp, num_bits)
    assert out.dtype == torch.uint8 and out.shape == (2, 64 * num_bits // 8, 3)
    n, g = 9, 2
    byte = int(out[1, n * num_bits // 8, g])
    code = (byte >> ((n % 2) * 4)) & 0xF if num_bits == 4 else byte
    assert code == int(codes[1, g, n])
    assert torch.equal(from_transposed_zero_points(out, num_bits), zp)


def test_scales_transpose():
    s = torch.randn(2, 3, 5).to(torch.bfloat16)
    out = to_transposed_scales(s)
    assert out.shape == (2, 5, 3) and out.is_contiguous()
    assert torch.equal(from_transposed_scales(out), s)


def test_misuse():
    with pytest.raises(ValueError):
        to_transposed_weight(torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        from_transposed_weight(torch.zeros(2, 3, dtype=torch.uint8))
