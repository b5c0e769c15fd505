"""Pure tensor math that turns checkpoint experts into the tensors a serving engine's fused MoE
kernels consume on each tensor-parallel rank, and back. No I/O happens here.

* `packing`: int32 pack/unpack of 4/8-bit codes, LSB-first.
* `shard`: the loader's per-rank K-first tensors of one expert, its inverse, expert placement.
* `marlin`: Marlin padding, act-order sort, weight repack, scale and zero-point permutations.
* `transposed`: the Triton N-first byte layout.
* `spec`: the layout names, `RankLayout` and the shapes each layout implies (no torch).
* `registry`: the layouts by name, each with its forward, inverse, per-rank shapes and serve hint
  (no torch; the math is imported on first use).  Adding a layout is a change in this folder.
* `rank`: the one entry point that chains the above for a rank.
* `vllm_state`: vLLM's per-rank parameter state (the `vllm` layout) and its inverse.
"""

# Names resolve on first use (PEP 562): `wna16ctl.layout.spec` is torch-free and importing it
# must not pull torch in through this package.
_HOME = {
    "pack_codes": "packing", "unpack_codes": "packing",
    "RankLayout": "rank", "build_expert_tensors": "rank", "build_rank_tensors": "rank",
    "expected_expert_shapes": "rank", "expected_rank_shapes": "rank", "unbuild_expert_tensors": "rank",
    "unbuild_rank_tensors": "rank",
    "ExpertTensors": "shard", "ProjectionTensors": "shard", "local_experts": "shard", "shard_expert": "shard",
    "unshard_expert": "shard",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


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
