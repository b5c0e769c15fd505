import itertools

import numpy as np
import pytest
import torch

from tests.layout import reference
from tests.layout.data import assert_experts_equal, expert_to_numpy, random_expert, to_numpy
from wna16ctl.errors import LayoutMismatch
from wna16ctl.layout.shard import local_experts, shard_expert, unshard_expert

HIDDEN, INTERMEDIATE = 256, 512

CASES = [
    (num_bits, group_size, symmetric, act_order, tp, load_full_w2)
    for num_bits, group_size, symmetric, act_order, tp, load_full_w2 in itertools.product(
        [4, 8], [-1, 32, 128], [True, False], [False, True], [1, 2, 4], [False, True]
    )
    if not (act_order and group_size == -1) and not (load_full_w2 and not act_order)
]


@pytest.mark.parametrize("num_bits,group_size,symmetric,act_order,tp,load_full_w2", CASES)
def test_shard_matches_table_and_unshard_inverts(num_bits, group_size, symmetric, act_order, tp, load_full_w2):
    expert = random_expert(HIDDEN, INTERMEDIATE, num_bits=num_bits, group_size=group_size, symmetric=symmetric,
                           act_order=act_order, seed=tp)
    as_numpy = expert_to_numpy(expert)
    ranks = []
    for rank in range(tp):
        shards = shard_expert(expert, tp=tp, rank=rank, load_full_w2=load_full_w2)
        expected = reference.shard(as_numpy, tp, rank, load_full_w2, group_size, num_bits)
        assert sorted(shards) == sorted(expected)
        for name, tensor in shards.items():
            assert tensor.is_contiguous(), name
            assert np.array_equal(to_numpy(tensor), expected[name]), name
        ranks.append(shards)
    i_p = INTERMEDIATE // tp
    assert ranks[0]["w13_weight_packed"].shape == (HIDDEN * num_bits // 32, 2 * i_p)
    assert ranks[0]["w2_weight_packed"].shape == (i_p * num_bits // 32, HIDDEN)
    assembled = unshard_expert(ranks, tp=tp, load_full_w2=load_full_w2, group_size=group_size)
    assert_experts_equal(assembled, expert)


def test_shard_shares_no_memory_with_checkpoint():
    expert = random_expert(HIDDEN, INTERMEDIATE, num_bits=4, group_size=128, symmetric=False, act_order=True)
    shards = shard_expert(expert, tp=1, rank=0, load_full_w2=True)
    for tensor in shards.values():
        tensor.zero_()
    assert expert["down"]["weight_scale"].float().abs().sum() > 0
    assert expert["up"]["weight_g_idx"].abs().sum() > 0


def test_gate_and_up_g_idx_must_agree():
    expert = random_expert(HIDDEN, INTERMEDIATE, num_bits=4, group_size=32, act_order=True)
    expert["gate"]["weight_g_idx"] = expert["gate"]["weight_g_idx"].clone()
    expert["gate"]["weight_g_idx"][17] += 1
    with pytest.raises(LayoutMismatch, match=r"expert 5.*weight_g_idx.*\[17\]"):
        shard_expert(expert, tp=2, rank=0, load_full_w2=True, expert_id=5)


@pytest.mark.parametrize("group_size,load_full_w2,key", [
    (128, True, "w2_weight_scale"),
    (-1, False, "w2_weight_scale"),
    (-1, False, "w2_weight_zero_point"),
    (128, True, "w13_weight_g_idx"),
])
def test_unshard_checks_replicated_parts(group_size, load_full_w2, key):
    act_order = key == "w13_weight_g_idx" or load_full_w2
    expert = random_expert(HIDDEN, INTERMEDIATE, num_bits=4, group_size=group_size, symmetric=False,
                           act_order=act_order)
    ranks = [shard_expert(expert, tp=4, rank=r, load_full_w2=load_full_w2) for r in range(4)]
    ranks[2][key].view(torch.uint8).view(-1)[0] ^= 1
    with pytest.raises(LayoutMismatch, match=rf"{key} of expert 9: rank 2 differs"):
        unshard_expert(ranks, tp=4, load_full_w2=load_full_w2, group_size=group_size, expert_id=9)


def test_misuse():
    expert = random_expert(HIDDEN, 96, num_bits=4, group_size=32)
    with pytest.raises(ValueError):
        shard_expert(expert, tp=2, rank=0, load_full_w2=False)  # I_p 48 splits groups of 32
    with pytest.raises(ValueError):
        shard_expert(expert, tp=2, rank=2, load_full_w2=False)
    with pytest.raises(ValueError):
        unshard_expert([shard_expert(expert, tp=1, rank=0, load_full_w2=False)], tp=2, load_full_w2=False,
                       group_size=32)
    del expert["up"]
    with pytest.raises(ValueError):
        shard_expert(expert, tp=1, rank=0, load_full_w2=False)


def test_local_experts_linear_placement():
    assert [local_experts(10, 4, r) for r in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert list(local_experts(8, 1, 0)) == list(range(8))
    for experts, ep in [(128, 3), (7, 7), (5, 8), (60, 16)]:
        placed = [e for r in range(ep) for e in local_experts(experts, ep, r)]
        assert placed == list(range(experts))
        sizes = [len(local_experts(experts, ep, r)) for r in range(ep)]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        local_experts(8, 2, 2)
