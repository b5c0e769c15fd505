"""The CPU side of calling vLLM's Marlin MoE GEMM: routing metadata against a slow reference, the
weight type ids and the argument list against the schema vLLM 0.33.0's library registers. The
library itself needs a GPU (its CUDA runtime dependencies): gpu_check runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wna16ctl.native import vllm_marlin as V

# what vllm/_moe_C_stable_libtorch.abi3.so of the vLLM 0.33.0 wheel registers (read from the
# library's strings)
VLLM_0_33_SCHEMA = (
    "_moe_C::moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none, Tensor! b_q_weight, Tensor? b_bias_or_none, "
    "Tensor! b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor! workspace, "
    "Tensor sorted_token_ids, Tensor! expert_ids, Tensor! num_tokens_past_padded, Tensor! topk_weights, "
    "int moe_block_size, int top_k, bool mul_topk_weights, int b_type_id, int size_m, int size_n, int size_k, "
    "bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float, int thread_k, int thread_n, "
    "int blocks_per_sm) -> Tensor"
)


def slow_align(topk_ids: list[list[int]], block: int, experts: int) -> tuple[list[int], list[int], int]:
    """The routing metadata by hand: per expert its slots in order, padded to whole blocks."""
    slots = [s for row in topk_ids for s in row]
    pad = len(slots)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(experts):
        mine = [i for i, x in enumerate(slots) if x == e]
        while len(mine) % block:
            mine.append(pad)
        sorted_ids += mine
        expert_ids += [e] * (len(mine) // block)
    return sorted_ids, expert_ids, len(sorted_ids)


@pytest.mark.parametrize("m,top_k,experts,block", [(1, 8, 128, 8), (4, 2, 4, 4), (16, 8, 64, 16), (64, 6, 8, 48),
                                                   (33, 3, 5, 64), (7, 1, 3, 8)])
def test_moe_align_matches_a_slow_reference(m: int, top_k: int, experts: int, block: int) -> None:
    g = torch.Generator().manual_seed(m * 31 + experts)
    topk = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)])
    if m == 64:
        topk[:, 0] = 3  # one expert far above the rest
    sorted_ids, expert_ids, post = V.moe_align(topk, block, experts)
    want_ids, want_experts, want_post = slow_align(topk.tolist(), block, experts)
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == torch.int32
    assert int(post) == want_post
    assert sorted_ids.tolist()[:want_post] == want_ids
    assert set(sorted_ids.tolist()[want_post:]) <= {m * top_k}  # the tail is padding
    assert len(sorted_ids) == m * top_k + experts * (block - 1)
    assert expert_ids.tolist()[:want_post // block] == want_experts
    assert set(expert_ids.tolist()[want_post // block:]) <= {-1}
    assert len(expert_ids) == len(sorted_ids) // block


def test_a_worked_alignment_example() -> None:
    # slots 0..3 go to experts 1, 0, 0, 2; blocks of 2; padding value 4
    sorted_ids, expert_ids, post = V.moe_align(torch.tensor([[1, 0], [0, 2]]), 2, 3)
    assert sorted_ids.tolist() == [1, 2, 0, 4, 3, 4, 4]  # 4 slots + 3 experts * (2 - 1)
    assert expert_ids.tolist() == [0, 1, 2] and post.tolist() == [6]


def test_weight_type_ids_are_vllms() -> None:
    # scalar_types.uint4b8 / uint8b128 / uint4 / uint8 .id of vLLM 0.33.0
    assert V.weight_type_id(4, False) == 1125899907892224
    assert V.weight_type_id(8, False) == 1125899923621888
    assert V.weight_type_id(4, True) == 1125899906843648
    assert V.scalar_type_id(8, 0) == 1125899906844672
    assert V.weight_type_id(8, True) is None


def test_block_size_follows_the_token_load() -> None:
    assert V.block_size(1, 8, 128) == 8
    assert V.block_size(64, 8, 128) == 8
    assert V.block_size(256, 8, 128) == 32
    assert V.block_size(1024, 8, 128) == 64


@pytest.mark.parametrize("bits,zp", [(4, False), (8, False), (4, True)])
def test_call_args_fit_vllm_0_33_schema(bits: int, zp: bool) -> None:
    schema = torch._C.parse_schema(VLLM_0_33_SCHEMA)
    e, k, n, m, top_k = 4, 256, 128, 3, 2
    pf = 32 // bits
    topk = torch.tensor([[0, 1], [2, 3], [1, 2]])
    args = V.call_args(a=torch.zeros(m, k, dtype=torch.bfloat16), b_q=torch.zeros(e, k // 16, n * 16 // pf,
                       dtype=torch.int32), scales=torch.zeros(e, 2, n, dtype=torch.bfloat16),
                       zero_points=torch.zeros(e, 2, n // pf, dtype=torch.int32) if zp else None, topk_ids=topk,
                       topk_weights=torch.rand(m, top_k), bits=bits, workspace=torch.zeros(16, dtype=torch.int32))
    assert V.schema_mismatch(schema, args) is None
    named = dict(args)
    assert (named["size_m"], named["size_n"], named["size_k"], named["top_k"]) == (m, n, k, top_k)
    assert named["mul_topk_weights"] is True and named["b_type_id"] == V.weight_type_id(bits, zp)
    # a wrong argument is named, not called
    broken = [(name, None if name == "workspace" else value) for name, value in args]
    assert V.schema_mismatch(schema, broken) == "workspace: Tensor expected, None given"
    assert "takes (" in V.schema_mismatch(schema, args[:-1])


def test_an_int8_zero_point_problem_is_refused() -> None:
    with pytest.raises(ValueError, match="no 8-bit type with zero points"):
        V.call_args(a=torch.zeros(1, 64), b_q=torch.zeros(1, 4, 256, dtype=torch.int32), scales=torch.zeros(1, 1, 64),
                    zero_points=torch.zeros(1, 1, 16, dtype=torch.int32), topk_ids=torch.tensor([[0]]),
                    topk_weights=None, bits=8, workspace=torch.zeros(1))


def test_library_not_found_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WNA16CTL_VLLM_MOE_LIB", raising=False)
    op, why = V.load(str(tmp_path / "missing.so"))
    assert op is None and why == f"--vllm-moe-lib {tmp_path / 'missing.so'}: no such file"
    (tmp_path / V.LIBRARY_NAME).write_bytes(b"not a library")
    op, why = V.load(str(tmp_path))
    assert op is None and "did not load" in why
