"""The planner: for one MoE layer at one parallel configuration, what vLLM would do.

One decision function, `plan_layer`, reproduces the rules of vLLM's compressed-tensors WNA16 MoE
path (current era: the merged method + `fused_moe/oracle/int_wna16.py`): method checks, backend
selection with a reason string for each rejected backend, the w2 scale sharding, Marlin tile
padding, the divisibility checks of `create_weights`, and known engine bugs ("hazards") this
configuration would hit in some released versions.  Reads no files and imports no torch, so
`inspect` stays fast; repack and verify call the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from wna16ctl.checkpoint.config import PACK_QUANTIZED, WeightScheme
from wna16ctl.checkpoint.moe import MoELayer
from wna16ctl.errors import UsageError

SUPPORTED_BITS = (4, 8)
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)


class Backend(str, Enum):
    """Backends whose weight layout wna16ctl writes, in vLLM's auto-selection priority order."""

    MARLIN = "marlin"  # MarlinExperts: Marlin tile layout (repack layout "marlin")
    TRITON = "triton"  # TritonWNA16Experts: N-first uint8 layout (repack layout "transposed")


BACKEND_PRIORITY = (Backend.MARLIN, Backend.TRITON)
LAYOUT_OF_BACKEND = {Backend.MARLIN: "marlin", Backend.TRITON: "transposed"}


@dataclass(frozen=True)
class W2ScaleSharding:
    load_full_w2: bool
    w2_scales_size: int
    is_k_full: bool

    def to_json(self) -> dict[str, Any]:
        return {"load_full_w2": self.load_full_w2, "w2_scales_size": self.w2_scales_size, "is_k_full": self.is_k_full}


def w2_scale_sharding(actorder: str | None, group_size: int, i_p: int, i: int) -> W2ScaleSharding:
    """vLLM's `_w2_scale_sharding` (PR #41161).

    Only act-order ("group"; "dynamic" is its alias) stores w2 scales by *global* group id, so
    only then must every rank hold all I/gs rows.  Static/weight act-order is format-identical
    to no act-order and shards like it.
    """
    act = actorder in ("group", "dynamic")
    load_full = act and group_size != -1
    return W2ScaleSharding(
        load_full_w2=load_full,
        w2_scales_size=i if load_full else i_p,
        is_k_full=(not act) or (i_p == i),
    )


def marlin_moe_padded_intermediate(i_p: int, group_size: int) -> int:
    """The intermediate size Marlin MoE pads to: a multiple of lcm(64, group size)."""
    step = math.lcm(64, max(group_size, 1))
    return -(-i_p // step) * step


def marlin_support_reason(hidden: int, i_p: int, group_size: int, allow_tile_padding: bool) -> str | None:
    """`check_moe_marlin_supports_config` with the failing rule spelled out (None = supported)."""
    if hidden % 128:
        return f"hidden_size {hidden} is not a multiple of 128 (Marlin MoE thread tile)"
    if group_size not in MARLIN_GROUP_SIZES:
        return f"group_size {group_size} is not one of -1, 32, 64, 128 (compiled Marlin group sizes)"
    if not allow_tile_padding:
        step = max(64, group_size)
        if i_p % step:
            return (
                f"intermediate size per partition {i_p} is not a multiple of {step} "
                "(act-order disables tile padding)"
            )
    elif group_size > 0 and i_p % group_size:
        return f"intermediate size per partition {i_p} is not a multiple of group_size {group_size}"
    return None


def quant_type(scheme: WeightScheme) -> str:
    """Marlin scalar type name of the scheme (`uint4b8` = symmetric int4 with bias 8, ...)."""
    if scheme.symmetric:
        return {4: "uint4b8", 8: "uint8b128"}.get(scheme.num_bits, f"int{scheme.num_bits}")
    return f"uint{scheme.num_bits}"


@dataclass(frozen=True)
class Check:
    rule: str
    ok: bool
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "ok": self.ok, "detail": self.detail}


@dataclass
class LayerPlan:
    """Everything decided for one MoE layer at one parallel configuration."""

    tp: int  # ranks requested (--tp)
    ep: bool  # expert parallelism: MoE TP is 1 and experts are split across ranks
    moe_tp: int
    intermediate_size_per_partition: int
    padded_intermediate: int | None  # Marlin tile-padded intermediate (None unless backend is Marlin)
    backend: Backend | None
    rejected: dict[str, str]
    w2: W2ScaleSharding
    quant_type: str | None
    local_experts: list[int]  # experts per rank
    rank_bytes: list[int]  # bytes of each rank's expert tensors in the chosen layout
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)

    @property
    def loadable(self) -> bool:
        return not self.errors and self.backend is not None

    @property
    def layout(self) -> str | None:
        return LAYOUT_OF_BACKEND[self.backend] if self.backend is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "ep": self.ep,
            "moe_tp": self.moe_tp,
            "intermediate_size_per_partition": self.intermediate_size_per_partition,
            "padded_intermediate": self.padded_intermediate,
            "backend": self.backend.value if self.backend is not None else None,
            "layout": self.layout,
            "rejected": dict(self.rejected),
            "w2_scale_sharding": self.w2.to_json(),
            "quant_type": self.quant_type,
            "local_experts": list(self.local_experts),
            "rank_bytes": list(self.rank_bytes),
            "checks": [c.to_json() for c in self.checks],
            "errors": list(self.errors),
            "hazards": list(self.hazards),
            "loadable": self.loadable,
        }


def check_parallel_size(layer: MoELayer, tp: int, ep: bool) -> None:
    """Refuse rank counts beyond anything the layer can be split into (bad input, not a plan):
    past both the expert count and the intermediate size every further rank is empty whether
    experts or columns are split, and per-rank lists of that length would only exhaust memory."""
    limit = max(layer.num_experts, layer.intermediate_size)
    if tp > limit:
        raise UsageError(
            f"--tp {tp}{' --ep' if ep else ''}: more ranks than {layer.prefix} has experts ({layer.num_experts}) "
            f"or intermediate columns ({layer.intermediate_size}); choose at most {limit}"
        )


def local_expert_counts(num_experts: int, ep_size: int) -> list[int]:
    """vLLM's linear expert placement: E // ep each, the first E % ep ranks one more."""
    base, rem = divmod(num_experts, ep_size)
    return [base + (1 if r < rem else 0) for r in range(ep_size)]


def _backend_reason(backend: Backend, s: WeightScheme, hidden: int, i_p: int) -> str | None:
    if s.num_bits not in SUPPORTED_BITS:
        return f"no {backend.value} kernel for {s.num_bits}-bit weights"
    if backend is Backend.MARLIN:
        if s.num_bits == 8 and not s.symmetric:
            return "MarlinExperts has no asymmetric int8 kernel (uint8 with zero points is not built)"
        reason = marlin_support_reason(hidden, i_p, s.group_size, allow_tile_padding=not s.act_order)
        return None if reason is None else f"Marlin not supported for this layer: {reason}"
    if backend is Backend.TRITON:
        if s.act_order:
            return "the Triton WNA16 kernel does not support compressed-tensors act-order (actorder=group)"
        if s.num_bits == 8 and not s.symmetric:
            return "TritonWNA16Experts accepts int4 (sym/asym) and symmetric int8 only"
        return None
    raise AssertionError(backend)


def _rank_bytes(backend: Backend | None, s: WeightScheme, hidden: int, i_p: int, pad: int | None,
                sharding: W2ScaleSharding, experts_per_rank: list[int], scale_bytes: int) -> list[int]:
    """Bytes of each rank's expert tensors in the backend's layout (sizes only, no tensors)."""
    if backend is None:
        return [0 for _ in experts_per_rank]
    n = pad or i_p  # the (padded) intermediate extent every rank tensor uses
    gs = s.group_size
    g13 = hidden // gs if gs > 0 else 1
    g2_scale = (sharding.w2_scales_size if sharding.load_full_w2 else n) // gs if gs > 0 else 1
    g2_zp = n // gs if gs > 0 else 1  # zero points are never loaded "full"
    per = 3 * n * hidden * s.num_bits // 8
    per += (g13 * 2 * n + g2_scale * hidden) * scale_bytes
    if not s.symmetric:
        per += (g13 * 2 * n + g2_zp * hidden) * s.num_bits // 8
    if backend is Backend.MARLIN and s.act_order:
        per += 2 * 4 * (hidden + n)  # sorted g_idx + sort indices, int32, w13 and w2
    return [per * e for e in experts_per_rank]


def plan_layer(layer: MoELayer, tp: int, ep: bool = False) -> LayerPlan:
    """The one decision function: vLLM's behaviour for `layer` on `tp` ranks (EP if `ep`)."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    H, I, E = layer.hidden_size, layer.intermediate_size, layer.num_experts
    check_parallel_size(layer, tp, ep)
    moe_tp = 1 if ep else tp
    experts_per_rank = local_expert_counts(E, tp) if ep else [E] * tp
    i_p = I // moe_tp
    s = layer.scheme
    plan = LayerPlan(
        tp=tp, ep=ep, moe_tp=moe_tp, intermediate_size_per_partition=i_p, padded_intermediate=None,
        backend=None, rejected={}, w2=w2_scale_sharding(None, -1, i_p, I), quant_type=None,
        local_experts=experts_per_rank, rank_bytes=[0] * tp,
    )
    if s is None:
        plan.errors.append("experts are not quantized (no compressed-tensors scheme targets them); nothing to plan")
        return plan

    # -- method dispatch (get_moe_method) ------------------------------------------------------
    if len(layer.scheme_sets) > 1:
        first_key = next(iter(layer.scheme_sets))
        if len(set(first_key)) > 1:
            plan.errors.append("All MoE projections need to have same quantization scheme but found multiple")
        others = [(k, v) for k, v in layer.scheme_sets.items() if k != first_key]
        desc = "; ".join(
            f"experts {_ranges(v)} use {'/'.join(x.describe() if x else 'unquantized' for x in dict.fromkeys(k))}"
            for k, v in others
        )
        plan.errors.append(
            f"per-expert mixed precision: expert 0 uses {s.describe()} but {desc}; vLLM builds one fused "
            "parameter per layer from expert 0's scheme, so the other experts cannot load"
        )
        plan.hazards.append(
            "per-expert mixed precision in one MoE layer: vLLM's get_moe_method looks only at expert 0's "
            "gate/up/down schemes; other experts' tensors are loaded with the wrong bit width or shapes "
            "(load failure or garbage). Quantize every expert of a layer with one scheme."
        )
    elif len(set(next(iter(layer.scheme_sets)))) > 1:
        plan.errors.append("All MoE projections need to have same quantization scheme but found multiple")
    if not s.is_wna16:
        plan.errors.append(
            f"scheme {s.type} strategy={s.strategy} is not a weight-only integer group/channel scheme (WNA16); "
            "not handled by the WNA16 MoE method"
        )
        return plan
    if s.format != PACK_QUANTIZED or s.num_bits not in SUPPORTED_BITS:
        plan.errors.append(
            "For Fused MoE layers, only format 'pack-quantized' and bits [4, 8] are supported, but got "
            f"format {s.format} and bits {s.num_bits}"
        )
        return plan
    gs = s.group_size
    plan.quant_type = quant_type(s)
    plan.w2 = w2_scale_sharding(s.actorder, gs, i_p, I)

    # -- divisibility (loader + create_weights) ----------------------------------------------
    checks = plan.checks
    checks.append(Check("intermediate_size % moe_tp == 0", I % moe_tp == 0, f"{I} % {moe_tp}"))
    if I % moe_tp:
        plan.errors.append(f"intermediate_size ({I}) is not divisible by the MoE tensor-parallel size ({moe_tp})")
    pf = s.pack_factor
    ok = i_p % pf == 0
    checks.append(Check("intermediate_size_per_partition % pack_factor == 0", ok, f"{i_p} % {pf}"))
    if not ok:
        plan.errors.append(
            f"intermediate size per partition ({i_p}) is not a multiple of the pack factor ({pf}): each rank's "
            "slice of the packed down_proj would start inside an int32 word"
        )
    if gs > 0:
        ok = H % gs == 0
        checks.append(Check("hidden_size % group_size == 0", ok, f"{H} % {gs}"))
        if not ok:
            plan.errors.append(
                f"CompressedTensors WNA16 Marlin MoE requires hidden_size ({H}) to be divisible by group_size ({gs})."
            )
        ok = plan.w2.load_full_w2 or i_p % gs == 0
        checks.append(Check("load_full_w2 or intermediate_size_per_partition % group_size == 0", ok, f"{i_p} % {gs}"))
        if not ok:
            plan.errors.append(
                "CompressedTensors WNA16 Marlin MoE with static group scales requires the MoE intermediate size "
                f"per tensor-parallel partition ({i_p}) to be divisible by group_size ({gs}). Scale groups would "
                "otherwise cross TP shard boundaries; use a compatible TP size or enable expert parallelism."
            )

    if s.act_order and not s.symmetric and moe_tp > 1:
        # g_idx of a rank's K slice names groups of the whole row, but zero points (unlike w2
        # scales) are never loaded in full: the rank would dequantize with other groups' zeros.
        plan.errors.append(
            "act-order (actorder=group) with asymmetric zero points under tensor parallelism: vLLM loads only "
            "each rank's slice of the w2 zero points while g_idx references every group, so outputs would be "
            "wrong; use expert parallelism (--ep) or TP 1"
        )

    # -- backend oracle ------------------------------------------------------------------------
    checks.append(Check("hidden_size % 128 == 0 (Marlin)", H % 128 == 0, f"{H} % 128"))
    checks.append(Check("group_size in {-1, 32, 64, 128} (Marlin)", gs in MARLIN_GROUP_SIZES, str(gs)))
    if s.act_order:
        step = max(64, gs)
        checks.append(Check(f"intermediate_size_per_partition % {step} == 0 (Marlin, act-order)", i_p % step == 0, f"{i_p} % {step}"))
    for backend in BACKEND_PRIORITY:
        reason = _backend_reason(backend, s, H, i_p)
        if reason is None and plan.backend is None:
            plan.backend = backend
        elif reason is not None:
            plan.rejected[backend.value] = reason
        else:
            plan.rejected[backend.value] = f"lower priority than {plan.backend.value}"
    if plan.backend is None:
        plan.errors.append("No WNA16 MoE backend supports the deployment configuration.")

    if plan.backend is Backend.MARLIN:
        P = marlin_moe_padded_intermediate(i_p, gs)
        plan.padded_intermediate = P
        checks.append(Check("Marlin repack: hidden_size % 16 == 0 and padded intermediate % 64 == 0", H % 16 == 0 and P % 64 == 0, f"{H}, {P}"))
        if P != i_p:
            plan.hazards.append(
                f"needs Marlin tile padding of the intermediate size per partition from {i_p} to {P} "
                "(marlin_moe_padded_intermediate); vLLM releases without MoE tile padding reject this layer"
            )
        if gs > 0 and H // gs > 1 and not gs < i_p:
            plan.hazards.append(
                f"vLLM permutes w13 scales with size_k = intermediate size per partition ({i_p}) instead of "
                f"hidden_size ({H}); with {i_p} <= group_size {gs} the grouped scales get the channel-wise "
                "permutation and outputs are wrong (vllm PR #50196, open). wna16ctl repack writes the corrected "
                "layout; an engine that repacks itself needs that fix"
            )

    # -- hazards by engine version --------------------------------------------------------------
    if s.num_bits == 8 and gs != -1:
        plan.hazards.append(
            f"grouped int8 experts (group_size {gs}): vLLM v0.27.0-v0.27.1 reject them with a bare AssertionError "
            "(assert group_size == -1); fixed by vllm PR #52002 - use v0.25.1-v0.26.x or a release with that fix"
        )
    if s.actorder in ("weight", "static") and gs > 0 and i_p != I:
        full = I // gs
        implied = i_p // full if full else 0
        plan.hazards.append(
            f"actorder={s.actorder!r}: vLLM before PR #41161 treats it as act-order and loads all {full} w2 scale "
            f"groups on every rank; the kernel then infers group_size {implied} over K={i_p} and fails with "
            "'Invalid thread config' (vllm #41161); releases with `_w2_scale_sharding` shard it correctly"
        )
    if s.group_size_null:
        plan.hazards.append(
            "channel-wise scheme written with group_size null: vLLM v0.27.x (after the E3 merge, before PR #53163) "
            "crashes in WNA16 backend selection comparing None with an int (vllm #52713); fixed by PR #53163"
        )
    if s.actorder == "dynamic":
        plan.hazards.append(
            "actorder 'dynamic' is the alias of 'group': vLLM's w2 scale sharding compares the string with 'group', "
            "so a version that does not normalise the alias shards act-order w2 scales by rank (wrong); "
            "planned here as 'group'"
        )
    if layer.zero_point_form == "unpacked":
        plan.hazards.append(
            "zero points stored unpacked (compressed-tensors <= 0.9.3): vLLM's loader expects packed int32 "
            "[N/pack_factor, G] zero points and fails on these; wna16ctl repack converts them"
        )

    plan.rank_bytes = _rank_bytes(plan.backend, s, H, i_p, plan.padded_intermediate, plan.w2,
                                  experts_per_rank, _scale_bytes(layer.scale_dtype))
    return plan


def _scale_bytes(dtype: str | None) -> int:
    return 4 if dtype == "F32" else 2


def _ranges(ids: list[int]) -> str:
    out: list[str] = []
    start = prev = ids[0]
    for x in ids[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)
