import numpy as np
import pytest
import torch

from tests.layout import reference
from wna16ctl.layout.packing import pack_codes, pack_factor, unpack_codes


def _u32(word: torch.Tensor) -> int:
    return int(word) & 0xFFFFFFFF


def test_int4_worked_example():
    codes = torch.tensor([-8, -7, -1, 0, 1, 2, 3, 7]) + 8
    packed = pack_codes(codes, 4)
    assert packed.dtype == torch.int32 and packed.shape == (1,)
    assert _u32(packed[0]) == 0xFBA98710
    assert unpack_codes(packed, 4).tolist() == codes.tolist()


def test_int8_worked_example():
    codes = torch.tensor([-128, -1, 0, 127]) + 128
    packed = pack_codes(codes, 8)
    assert _u32(packed[0]) == 0xFF807F00
    assert unpack_codes(packed, 8).tolist() == codes.tolist()


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_round_trip_any_dim_with_partial_words(num_bits, dim):
    codes = torch.randint(0, 1 << num_bits, (5, 13, 7), dtype=torch.int32)
    packed = pack_codes(codes, num_bits, dim=dim)
    size = codes.shape[dim]
    assert packed.shape[dim] == -(-size // pack_factor(num_bits))
    assert torch.equal(unpack_codes(packed, num_bits, dim=dim, size=size), codes)
    expected = reference.pack(codes.numpy(), num_bits, axis=dim)
    assert np.array_equal(packed.numpy(), expected)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_partial_word_is_zero_padded(num_bits):
    pf = pack_factor(num_bits)
    codes = torch.full((pf + 1,), (1 << num_bits) - 1, dtype=torch.int32)
    packed = pack_codes(codes, num_bits)
    assert _u32(packed[1]) == (1 << num_bits) - 1
    assert unpack_codes(packed, num_bits).tolist() == [(1 << num_bits) - 1] * (pf + 1) + [0] * (pf - 1)


def test_accepts_uint8_and_int64_codes():
    codes = torch.randint(0, 16, (4, 16))
    assert torch.equal(pack_codes(codes.to(torch.uint8), 4), pack_codes(codes, 4))


def test_misuse_raises_value_error():
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(8), 4)
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(8, dtype=torch.int32), 3)
    with pytest.raises(ValueError):
        unpack_codes(torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError):
        unpack_codes(torch.zeros(2, dtype=torch.int32), 4, size=30)


@pytest.fixture(scope="module")
def library_packer():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    return helpers


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_matches_compressed_tensors(library_packer, num_bits, packed_dim):
    offset = 1 << (num_bits - 1)
    shape = (24, 36) if packed_dim == 1 else (36, 24)
    signed = torch.randint(-offset, offset, shape, dtype=torch.int8)
    ours = pack_codes(signed.to(torch.int32) + offset, num_bits, dim=packed_dim)
    theirs = library_packer.pack_to_int32(signed, num_bits, packed_dim=packed_dim)
    assert torch.equal(ours, theirs)
    back = library_packer.unpack_from_int32(ours, num_bits, torch.Size(shape), packed_dim=packed_dim)
    assert torch.equal(unpack_codes(ours, num_bits, dim=packed_dim, size=shape[packed_dim]) - offset, back.to(torch.int32))
