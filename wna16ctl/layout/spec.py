"""What decides one tensor-parallel rank's MoE tensors (`RankLayout`) and their shapes, without
torch: repack plans every output file from these before any tensor exists, and a repack that runs
on the native path never imports torch.  Dtypes are safetensors dtype strings here ("I32", "BF16");
`wna16ctl.layout.rank` maps them to torch dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_BITS = (4, 8)

# The canonical form of one projection [N, K] that every layout takes, whatever the checkpoint's
# format (`sources.formats` reads each into it): the codes packed LSB-first along K in int32 words
# [N, K/pf] (offset by 2^(b-1)), the scales [N, G], the zero points as offset codes packed along N
# [ceil(N/pf), G], act-order's g_idx [K].  Its keys are the names compressed-tensors, the first
# format read, gave these tensors, so that a compressed-tensors projection is canonical as stored.
CODES, SCALES, ZERO_POINTS, G_IDX = "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"
CANONICAL = (CODES, SCALES, ZERO_POINTS, G_IDX)
TILE_K = 16
TILE_N = 64


def marlin_moe_padded_intermediate(i_p: int, group_size: int) -> int:
    """The intermediate size Marlin MoE pads to: a multiple of lcm(64, group size).  The planner
    reports it and the layout pads to it, so both read this one definition."""
    step = math.lcm(64, max(group_size, 1))
    return -(-i_p // step) * step


def marlin_scales_grouped(size_k: int, group_size: int) -> bool:
    """Whether the grouped (64) scale permutation applies rather than the single (32) one."""
    return group_size != -1 and group_size < size_k


# The layout names, defined here once (the registry, `wna16ctl.layout.registry`, says what each is).
MARLIN = "marlin"
TRANSPOSED = "transposed"
VLLM = "vllm"  # each rank's whole-model state for vLLM's sharded_state loader
AUTO = "auto"  # not a layout: repack picks marlin or transposed per layer from the planned backend
LAYOUTS = (MARLIN, TRANSPOSED)  # the layouts of a `RankLayout` (one rank's MoE tensors)


@dataclass(frozen=True)
class RankLayout:
    """Everything that decides the shapes and contents of one rank's MoE tensors."""

    layout: str  # "marlin" | "transposed"
    num_bits: int
    group_size: int  # -1 = channel-wise
    symmetric: bool
    act_order: bool  # actorder "group": g_idx present
    hidden_size: int  # H
    intermediate_size: int  # full I
    tp: int  # MoE TP size (1 under expert parallelism)
    rank: int  # TP rank (0 under expert parallelism)
    load_full_w2: bool
    padded_intermediate: int  # P (== I_p unless Marlin tile padding applies)

    def __post_init__(self) -> None:
        problems = _layout_problems(self)
        if problems:
            raise ValueError(f"invalid RankLayout {self}: " + "; ".join(problems))

    @property
    def pack_factor(self) -> int:
        return 32 // self.num_bits

    @property
    def intermediate_per_partition(self) -> int:
        return self.intermediate_size // self.tp

    @property
    def channelwise(self) -> bool:
        return self.group_size == -1

    @property
    def padded(self) -> bool:
        return self.padded_intermediate != self.intermediate_per_partition

    @property
    def w13_groups(self) -> int:
        """G13: scale rows of w13 (groups along H)."""
        return 1 if self.channelwise else self.hidden_size // self.group_size

    @property
    def w2_scale_groups(self) -> int:
        """Scale rows of w2 as stored: all I/gs when loaded full, else the (padded) rank's groups."""
        if self.channelwise:
            return 1
        if self.load_full_w2:
            return self.intermediate_size // self.group_size
        return self.padded_intermediate // self.group_size

    @property
    def w2_zero_point_groups(self) -> int:
        """Zero-point rows of w2: never loaded full."""
        return 1 if self.channelwise else self.padded_intermediate // self.group_size


def _layout_problems(spec: RankLayout) -> list[str]:
    problems: list[str] = []
    if spec.layout not in LAYOUTS:
        problems.append(f"layout must be one of {LAYOUTS}")
    if spec.num_bits not in SUPPORTED_BITS:
        problems.append(f"num_bits must be one of {SUPPORTED_BITS}")
        return problems
    h, i, tp, pf, gs = spec.hidden_size, spec.intermediate_size, spec.tp, spec.pack_factor, spec.group_size
    if h <= 0 or i <= 0:
        problems.append("hidden and intermediate sizes must be positive")
        return problems
    if tp <= 0 or not 0 <= spec.rank < tp:
        problems.append("rank must lie in [0, tp)")
        return problems
    if i % tp != 0:
        problems.append("intermediate_size is not divisible by tp")
        return problems
    i_p = spec.intermediate_per_partition
    if h % pf != 0 or i_p % pf != 0:
        problems.append(f"hidden size and intermediate size per partition must be multiples of {pf}")
    if gs != -1 and gs <= 0:
        problems.append("group_size must be -1 or positive")
    if gs > 0:
        if h % gs != 0:
            problems.append("hidden_size is not divisible by group_size")
        if spec.load_full_w2 and i % gs != 0:
            problems.append("intermediate_size is not divisible by group_size")
        if not spec.load_full_w2 and i_p % gs != 0:
            problems.append("intermediate size per partition is not divisible by group_size")
    if spec.act_order and gs <= 0:
        problems.append("act-order needs group-wise scales")
    p = spec.padded_intermediate
    if p < i_p:
        problems.append("padded_intermediate is smaller than the intermediate size per partition")
    if spec.layout == TRANSPOSED:
        if p != i_p:
            problems.append("the transposed layout is never padded")
        if spec.act_order:
            problems.append("the transposed layout has no act-order form")
    if spec.layout == MARLIN:
        if p != i_p and spec.act_order:
            problems.append("Marlin tile padding is not applied with act-order")
        if p != i_p and gs > 0 and p % gs != 0:
            problems.append("padded_intermediate is not a multiple of group_size")
        if p % TILE_N != 0 or h % TILE_N != 0:
            # The kernel's thread tiles need both; gate and up then fill whole n-tiles each.
            problems.append(f"Marlin needs the hidden size and padded intermediate to be multiples of {TILE_N}")
    return problems


StShape = tuple[tuple[int, ...], str]


def marlin_expert_shapes(spec: RankLayout, scale_dtype: str) -> dict[str, StShape]:
    """The marlin layout: name -> (shape, safetensors dtype) of one expert's slice of the rank
    tensors, in file order (`wna16ctl.layout.registry.expert_shapes` asks the layout's own)."""
    h, pf = spec.hidden_size, spec.pack_factor
    p, g13 = spec.padded_intermediate, spec.w13_groups
    g2, g2_zp = spec.w2_scale_groups, spec.w2_zero_point_groups
    shapes: dict[str, StShape] = {}
    shapes["w13_weight_packed"] = ((h // TILE_K, 2 * p * TILE_K // pf), "I32")
    shapes["w2_weight_packed"] = ((p // TILE_K, h * TILE_K // pf), "I32")
    shapes["w13_weight_scale"] = ((g13, 2 * p), scale_dtype)
    shapes["w2_weight_scale"] = ((g2, h), scale_dtype)
    if not spec.symmetric:
        shapes["w13_weight_zero_point"] = ((g13, 2 * p // pf), "I32")
        shapes["w2_weight_zero_point"] = ((g2_zp, h // pf), "I32")
    if spec.act_order:
        shapes["w13_weight_g_idx"] = ((h,), "I32")
        shapes["w2_weight_g_idx"] = ((p,), "I32")
        shapes["w13_g_idx_sort_indices"] = ((h,), "I32")
        shapes["w2_g_idx_sort_indices"] = ((p,), "I32")
    return shapes


def transposed_expert_shapes(spec: RankLayout, scale_dtype: str) -> dict[str, StShape]:
    """The transposed layout: name -> (shape, safetensors dtype) of one expert's slice, in file order."""
    h, nb = spec.hidden_size, spec.num_bits
    p, g13 = spec.padded_intermediate, spec.w13_groups
    g2, g2_zp = spec.w2_scale_groups, spec.w2_zero_point_groups
    shapes: dict[str, StShape] = {}
    shapes["w13_weight_packed"] = ((2 * p, h * nb // 8), "U8")
    shapes["w2_weight_packed"] = ((h, p * nb // 8), "U8")
    shapes["w13_weight_scale"] = ((2 * p, g13), scale_dtype)
    shapes["w2_weight_scale"] = ((h, g2), scale_dtype)
    if not spec.symmetric:
        shapes["w13_weight_zero_point"] = ((2 * p * nb // 8, g13), "U8")
        shapes["w2_weight_zero_point"] = ((h * nb // 8, g2_zp), "U8")
    return shapes


def vllm_rank_shapes(plan: Any, rank: int) -> dict[str, StShape]:
    """The vllm layout: key -> (shape, safetensors dtype) of every tensor of `rank`, in file order
    (`plan`: a `wna16ctl.planning.vllm_state.VllmStatePlan`)."""
    return {t.key: (t.shape, t.dtype) for t in plan.keys[rank]}


def w2_scale_size_k(spec: RankLayout) -> int:
    """The K the w2 scale rows cover (the size_k of their Marlin permutation): G2 groups of gs, or
    a stand-in of pf when channel-wise (any size_k > -1 selects the single permutation then)."""
    if spec.channelwise:
        return spec.pack_factor
    return spec.w2_scale_groups * spec.group_size
