"""Pure tensor math that turns checkpoint experts into the tensors a serving engine's fused MoE
kernels consume on each tensor-parallel rank, and back. No I/O happens here.

* `packing`: int32 pack/unpack of 4/8-bit codes, LSB-first.
* `shard`: the loader's per-rank K-first tensors of one expert, its inverse, expert placement.
* `marlin`: Marlin padding, act-order sort, weight repack, scale and zero-point permutations.
* `transposed`: the Triton N-first byte layout.
* `rank`: `RankLayout` and the one entry point that chains the above for a rank.
"""

from wna16ctl.layout.packing import pack_codes, unpack_codes
from wna16ctl.layout.rank import (
    RankLayout,
    build_expert_tensors,
    build_rank_tensors,
    expected_expert_shapes,
    expected_rank_shapes,
    unbuild_expert_tensors,
    unbuild_rank_tensors,
)
from wna16ctl.layout.shard import ExpertTensors, ProjectionTensors, local_experts, shard_expert, unshard_expert

__all__ = [
    "ExpertTensors",
    "ProjectionTensors",
    "RankLayout",
    "build_expert_tensors",
    "build_rank_tensors",
    "expected_expert_shapes",
    "expected_rank_shapes",
    "local_experts",
    "pack_codes",
    "shard_expert",
    "unbuild_expert_tensors",
    "unbuild_rank_tensors",
    "unpack_codes",
    "unshard_expert",
]
