"""The reference agrees with the spec's own numbers before it is used to judge production code."""

import numpy as np
import pytest

from tests.layout import reference


@pytest.mark.parametrize("num_bits", [4, 8])
def test_weight_perm_matches_appendix_a_checksum(num_bits):
    perm = reference.weight_perm(num_bits)
    assert sorted(perm) == list(range(1024))
    assert reference.weight_perm_sha256(num_bits) == reference.WEIGHT_PERM_SHA256[num_bits]


def test_weight_perm_first_rows_as_printed():
    assert reference.weight_perm(4)[:8] == [0, 128, 8, 136, 16, 144, 24, 152]
    assert reference.weight_perm(8)[:8] == [0, 128, 16, 144, 8, 136, 24, 152]
    assert reference.weight_perm(4)[-4:] == [887, 1015, 895, 1023]


def test_scale_perms_match_text():
    perm = reference.scale_perm()
    assert perm[:16] == reference.SCALE_PERM_TEXT
    assert perm[-8:] == [7, 15, 23, 31, 39, 47, 55, 63]
    assert reference.scale_perm_single() == reference.SCALE_PERM_SINGLE_TEXT


@pytest.mark.parametrize("num_bits", [4, 8])
def test_zero_point_lists_match_two_step_rule(num_bits):
    assert reference.zero_point_index_two_step(num_bits) == reference.ZERO_POINT_INDEX[num_bits]


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("size_k,size_n", [(16, 64), (32, 128), (48, 192)])
def test_closed_form_and_table_form_agree(num_bits, size_k, size_n):
    q = np.random.default_rng(size_k + size_n).integers(0, 1 << num_bits, (size_k, size_n))
    loops = np.array(reference.marlin_closed_form_loops(q.tolist(), num_bits), dtype=np.uint64)
    loops = loops.astype(np.uint32).view(np.int32)
    assert np.array_equal(loops, reference.marlin_closed_form(q, num_bits))
    assert np.array_equal(loops, reference.marlin_table_form(q, num_bits))
