"""The planner: for one MoE layer at one parallel configuration, what a given vLLM release does.

One decision function, `plan_layer`, follows the steps the engine takes for a compressed-tensors
WNA16 MoE layer, in the engine's order, and stops where the engine stops:

  config parse → method dispatch → method constructor (backend oracle) → create_weights → load

Each step's rules come from the rulebook (`rules.py`) for the chosen release, so a rule that
changed between releases is written once with the release that changed it.  The result holds the
backend the release picks, a reason for every backend it passes over, the w2 scale sharding,
Marlin tile padding, every divisibility check with the release's own error text, and the known
engine bugs ("hazards") of that release.  Reads no files and imports no torch, so `inspect` stays
fast; repack and verify call the same function.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from wna16ctl.layout.spec import MARLIN, TRANSPOSED, marlin_moe_padded_intermediate  # marlin_moe_padded_intermediate: re-exported (the planner reports it)
from wna16ctl.planning import methods, rules
from wna16ctl.planning.config_parse import scheme_refusal
from wna16ctl.planning.engine_env import DEFAULT as DEFAULT_SWITCHES, EngineSwitches, wna16_moe_backends
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.moe import MoELayer

SUPPORTED_BITS = (4, 8)
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)


class Backend(str, Enum):
    """vLLM's WNA16 MoE backends (CUDA/ROCm list), by their lower-cased enum names."""

    RDNA3 = "rdna3"  # ROCm gfx1100 HIP kernel
    FLASHINFER_TRTLLM = "flashinfer_trtllm"  # TRT-LLM mxint4 MoE (Blackwell)
    MARLIN = "marlin"  # MarlinExperts: Marlin tile layout (repack layout "marlin")
    BATCHED_MARLIN = "batched_marlin"  # Marlin for batched activations (DeepEP low-latency)
    TRITON = "triton"  # TritonWNA16Experts: N-first uint8 layout (repack layout "transposed")
    HUMMING = "humming"  # Humming kernels (converted from the checkpoint at load)
    EMULATION = "emulation"  # dequantise to 16 bits and run the unquantized Triton MoE


# The layouts wna16ctl writes, and the backend that consumes each.
LAYOUT_OF_BACKEND = {Backend.MARLIN: MARLIN, Backend.TRITON: TRANSPOSED}
BACKEND_OF_LAYOUT = {v: k for k, v in LAYOUT_OF_BACKEND.items()}
# Where the engine raises: parsing quantization_config, the MoE method (dispatch and its
# constructor's own asserts), the backend oracle inside the constructor, create_weights, or (our
# own checks) when the weights are loaded.
STAGES = ("config", "method", "oracle", "create_weights", "load")


def backend_priority(rel: rules.Release, gpu: str) -> list[Backend]:
    """The release's auto-selection order on a CUDA GPU (`_get_priority_backends`)."""
    order = [Backend.FLASHINFER_TRTLLM, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.TRITON,
             Backend.HUMMING, Backend.EMULATION]
    if rel.has("oracle.rdna3"):
        order.insert(0, Backend.RDNA3)
    if rel.has("oracle.humming_first_on_sm90") and rules.GPUS[gpu] == 90:
        order.remove(Backend.HUMMING)
        order.insert(order.index(Backend.MARLIN), Backend.HUMMING)
    return order


@dataclass(frozen=True)
class W2ScaleSharding:
    load_full_w2: bool
    w2_scales_size: int
    is_k_full: bool

    def to_json(self) -> dict[str, Any]:
        return {"load_full_w2": self.load_full_w2, "w2_scales_size": self.w2_scales_size, "is_k_full": self.is_k_full}


def w2_scale_sharding(actorder: str | None, group_size: int, i_p: int, i: int) -> W2ScaleSharding:
    """vLLM's `_w2_scale_sharding` (PR #41161; releases before 0.30.0).

    Only act-order ("group"; "dynamic" is its alias) stores w2 scales by *global* group id, so
    only then must every rank hold all I/gs rows.  Static/weight act-order is format-identical
    to no act-order and shards like it.  Releases without act-order always shard.
    """
    act = actorder in ("group", "dynamic")
    load_full = act and group_size != -1
    return W2ScaleSharding(
        load_full_w2=load_full,
        w2_scales_size=i if load_full else i_p,
        is_k_full=(not act) or (i_p == i),
    )


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
    # vLLM's WNA16_SUPPORTED_TYPES_MAP: a symmetric b-bit code is stored unsigned with bias 2^(b-1)
    # (uint2b2 ... uint8b128); with zero points it is the plain unsigned type
    if scheme.symmetric:
        return f"uint{scheme.num_bits}b{1 << (scheme.num_bits - 1)}"
    return f"uint{scheme.num_bits}"


# -- weight keys (vLLM's QuantKey of the CT WNA16 MoE method) -----------------------------------
@dataclass(frozen=True)
class WeightKey:
    """What the backend classes match on: scalar type, scale group columns, symmetric.

    The compressed-tensors method builds one scale descriptor for every int4 group size but 32
    (and one for int8), so two int4 layers with group 64 and 128 have the same key.
    """

    dtype: str  # uint4b8 / uint4 / uint8b128 / uint8 / uint<n>b<bias> ...
    # scale group shape (1, group_cols): 32 for int4 group-32; -1 for the generic int4/int8
    # descriptors; other widths carry their own group size, or 0 for per-channel scales
    group_cols: int
    symmetric: bool

    @property
    def bits(self) -> int:
        return int(self.dtype[4:].split("b")[0])


def weight_key(s: WeightScheme) -> WeightKey:
    if s.num_bits == 4:
        cols = 32 if s.group_size == 32 else -1
    elif s.num_bits == 8:
        cols = -1
    else:
        cols = s.group_size if s.group_size > 0 else 0
    return WeightKey(quant_type(s), cols, s.symmetric)


_INT4, _INT4_32 = WeightKey("uint4b8", -1, True), WeightKey("uint4b8", 32, True)
_INT4_ASYM, _INT4_32_ASYM = WeightKey("uint4", -1, False), WeightKey("uint4", 32, False)
_INT8 = WeightKey("uint8b128", -1, True)
_MARLIN_KEYS = (_INT4, _INT8, _INT4_32, _INT4_ASYM, _INT4_32_ASYM)
_EMULATION_KEYS = (_INT4, _INT4_32, _INT4_ASYM, _INT4_32_ASYM)


def _triton_keys(rel: rules.Release) -> tuple[WeightKey, ...]:
    keys = (_INT4, _INT8, _INT4_32)
    return keys + ((_INT4_ASYM, _INT4_32_ASYM) if rel.has("oracle.triton_asymmetric") else ())


def _humming_accepts(rel: rules.Release, key: WeightKey) -> bool:
    if key in (_INT4, _INT8):
        return True
    # later releases: any unsigned integer type of 2-8 bits with per-channel or explicit column groups
    # (the generic int4/int8 descriptors have no column group and are not in that class)
    return rel.has("oracle.humming_group32_keys") and key.group_cols != -1 and 2 <= key.bits <= 8


def _key_text(key: WeightKey) -> str:
    g = {-1: "generic group", 0: "per-channel"}.get(key.group_cols, f"group-{key.group_cols}")
    return f"{key.dtype} {g}{'' if key.symmetric else ' with zero points'}"


# -- backend reasons ----------------------------------------------------------------------------
# The routing methods FlashInfer's TRT-LLM int4 MoE experts take (TrtLlmMxint4ExpertsMonolithic.
# _supports_routing_method, 0.27-0.33)
_TRTLLM_ROUTING = ("Renormalize", "RenormalizeNaive", "DeepSeekV3", "Llama4")


def _backend_reason(b: Backend, rel: rules.Release, gpu: str, s: WeightScheme, hidden: int, i_p: int,
                    allow_tile_padding: bool, switches: EngineSwitches = DEFAULT_SWITCHES,
                    routing: str | None = None, marlin_group: int | None = None) -> str | None:
    """Why `b` does not take this layer in `rel` on `gpu` (None: it does).  `marlin_group`: the
    group size the Marlin gate reads where it is not the key's (a GPTQ/AWQ config's).

    The oracle's own incompatibility reason first, then the experts class's support checks
    (device, weight key, activation format), as the release evaluates them.
    """
    cc = rules.GPUS[gpu]
    key = weight_key(s)
    if b is Backend.RDNA3:
        return "kernel does not support the current device (ROCm gfx1100 only)"
    if b is Backend.FLASHINFER_TRTLLM:
        if not s.symmetric:
            return "zero points and bias are not supported"
        if cc // 10 != 10:
            return "kernel does not support the current device (TRT-LLM mxint4 MoE needs a Blackwell sm100 GPU)"
        if not switches.flag("VLLM_USE_FLASHINFER_MOE_INT4", rel.version):
            return ("kernel does not support the current device (FlashInfer int4 MoE is off: "
                    "VLLM_USE_FLASHINFER_MOE_INT4 is 0 by default; --env VLLM_USE_FLASHINFER_MOE_INT4=1 turns it on)")
        if key != _INT4_32:
            return f"kernel does not support quantization scheme {_key_text(key)} (int4 symmetric group-32 only)"
        if routing is not None and routing not in _TRTLLM_ROUTING:
            return (f"kernel does not support routing method {routing} (the model's top-k routing: TRT-LLM takes "
                    f"{', '.join(_TRTLLM_ROUTING)}; a softmax top-k without norm_topk_prob is Default)")
        return None
    if b in (Backend.MARLIN, Backend.BATCHED_MARLIN):
        gate = marlin_support_reason(hidden, i_p, s.group_size if marlin_group is None else marlin_group,
                                     allow_tile_padding)
        if gate is not None:
            return f"Marlin not supported for this layer: {gate}"
        if cc < 75:
            return "kernel does not support the current device (compute capability >= 7.5)"
        if key not in _MARLIN_KEYS:
            return f"kernel does not support quantization scheme {_key_text(key)}"
        if b is Backend.BATCHED_MARLIN:
            return ("kernel does not support the standard activation format (batched Marlin serves the batched "
                    "all-to-all formats only)")
        return None
    if b is Backend.TRITON:
        if s.actorder == "group":  # the raw string: 'dynamic' passes this test
            return "group activation ordering is not supported"
        if key not in _triton_keys(rel):
            return f"kernel does not support quantization scheme {_key_text(key)}"
        return None
    if b is Backend.HUMMING:
        if cc < 75:
            return "kernel does not support the current device (compute capability >= 7.5)"
        if not _humming_accepts(rel, key):
            return f"kernel does not support quantization scheme {_key_text(key)}"
        return None
    if b is Backend.EMULATION:
        if key not in _EMULATION_KEYS:
            return f"kernel does not support quantization scheme {_key_text(key)} (int4 emulation only)"
        return None
    raise AssertionError(b)


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



@dataclass(frozen=True)
class Check:
    rule: str
    ok: bool
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "ok": self.ok, "detail": self.detail}


@dataclass
class LayerPlan:
    """Everything decided for one MoE layer at one parallel configuration in one release."""

    tp: int  # ranks requested (--tp)
    ep: bool  # expert parallelism: MoE TP is 1 and experts are split across ranks
    moe_tp: int
    intermediate_size_per_partition: int
    padded_intermediate: int | None  # Marlin tile-padded intermediate (None unless the layout is Marlin)
    backend: Backend | None  # what the release auto-selects (None: refused before or at selection)
    rejected: dict[str, str]
    w2: W2ScaleSharding | None  # as the release computes it in create_weights (None: refused before it)
    quant_type: str | None
    local_experts: list[int]  # experts per rank
    rank_bytes: list[int] | None  # bytes of each rank's expert tensors in the layout repack writes (None: no layout)
    vllm: str = rules.NEWEST
    gpu: str = rules.DEFAULT_GPU
    layout: str | None = None  # the layout repack writes: marlin, transposed, or None (none applies)
    layout_w2: W2ScaleSharding | None = None  # the w2 scale sharding repack writes in that layout
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failure_stage: str | None = None  # the step of the engine where the first error is raised
    failure_rule: str | None = None  # a short name of that error's rule
    hazards: list[str] = field(default_factory=list)
    # the MoE method a GPTQ/AWQ config builds (methods.MoEMethod.to_json(); None: compressed-tensors)
    method: dict[str, Any] | None = None

    @property
    def loadable(self) -> bool:
        return not self.errors and self.backend is not None

    def fail(self, stage: str, rule: str, text: str) -> None:
        """Record an error raised at `stage`; `rule` is a short name for tables."""
        if not self.errors:
            self.failure_stage, self.failure_rule = stage, rule
        self.errors.append(text)

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "ep": self.ep,
            "vllm": self.vllm,
            "gpu": self.gpu,
            "moe_tp": self.moe_tp,
            "intermediate_size_per_partition": self.intermediate_size_per_partition,
            "padded_intermediate": self.padded_intermediate,
            "backend": self.backend.value if self.backend is not None else None,
            "layout": self.layout,
            "rejected": dict(self.rejected),
            "w2_scale_sharding": None if self.w2 is None else self.w2.to_json(),
            "quant_type": self.quant_type,
            "local_experts": list(self.local_experts),
            "rank_bytes": None if self.rank_bytes is None else list(self.rank_bytes),
            "checks": [c.to_json() for c in self.checks],
            "errors": list(self.errors),
            "failure_stage": self.failure_stage,
            "failure_rule": self.failure_rule,
            "hazards": list(self.hazards),
            "loadable": self.loadable,
        } | ({} if self.method is None else {"method": dict(self.method)})


def local_expert_counts(num_experts: int, ep_size: int) -> list[int]:
    """vLLM's linear expert placement: E // ep each, the first E % ep ranks one more."""
    base, rem = divmod(num_experts, ep_size)
    return [base + (1 if r < rem else 0) for r in range(ep_size)]


def local_expert_ranges(num_experts: int, ep_size: int) -> list[range]:
    """The global experts each rank holds under that placement (determine_expert_map, "linear"):
    contiguous, so that local expert i of rank r is global expert ranges[r][i]."""
    counts = local_expert_counts(num_experts, ep_size)
    return [range(sum(counts[:r]), sum(counts[:r + 1])) for r in range(ep_size)]


def looked_up_schemes(layer: MoELayer, rel: rules.Release) -> tuple[WeightScheme | None, ...] | None:
    """The gate/up/down schemes the release's get_moe_method finds for expert 0 when they are not
    the checkpoint's own (method.checkpoint_proj_names not yet in force and the layer named
    w1/w3/w2); None when the release looks the checkpoint's own names up."""
    if layer.default_name_schemes is None or rel.has("method.checkpoint_proj_names"):
        return None
    return layer.default_name_schemes


def unquantized_lookup_error(layer: MoELayer, rel: rules.Release) -> str | None:
    """The load failure of a w1/w3/w2 layer whose gate_proj/up_proj/down_proj names the config does
    not quantize, in releases that look those names up (None: not this case)."""
    looked = looked_up_schemes(layer, rel)
    if looked is None or any(x is not None for x in looked) or layer.scheme is None:
        return None
    return (f"vLLM {rel} looks up expert 0's scheme under gate_proj/up_proj/down_proj, which this config does not "
            f"target (its experts are {'/'.join(layer.proj_names)}): "
            "it builds UnquantizedFusedMoEMethod and the packed expert tensors do not load ('RoutedExperts' object has "
            "no attribute 'w13_weight_packed'); target the experts with the class Linear or a pattern that also "
            "matches gate_proj/up_proj/down_proj, or use vLLM 0.32.0 or later")


@dataclass
class _LayerFacts:
    """What every step of `plan_layer` reads, and what the earlier steps hand to the later ones."""

    layer: MoELayer
    s: WeightScheme
    rel: rules.Release
    engine: str
    gpu: str
    switches: EngineSwitches
    tp: int
    ep: bool
    moe_tp: int
    i_p: int
    plan: LayerPlan
    mixed_experts: str | None = None  # set by the method step: the experts that use another scheme
    allow_tile_padding: bool = True  # set by the constructor step
    # each backend's own reason (None: it takes the layer), as far as the oracle asked
    own: dict[Backend, str | None] = field(default_factory=dict)
    # what a GPTQ/AWQ/MoeWNA16 method constructor asks the oracle (None: compressed-tensors)
    oracle_args: methods.OracleArgs | None = None

    @property
    def chosen(self) -> Backend | None:
        return self.plan.backend

    def reason(self, b: Backend) -> str | None:
        """`b`'s own reason for this layer (`_backend_reason` with this layer's facts)."""
        if self.oracle_args is not None:
            return _format_backend_reason(b, self.rel, self.gpu, self.oracle_args, self.layer.hidden_size, self.i_p,
                                          self.switches, self.layer.routing)
        return _backend_reason(b, self.rel, self.gpu, self.s, self.layer.hidden_size, self.i_p,
                               self.allow_tile_padding, self.switches, self.layer.routing)


def plan_layer(layer: MoELayer, tp: int, ep: bool = False, engine: str = rules.NEWEST,
               gpu: str = rules.DEFAULT_GPU, switches: EngineSwitches = DEFAULT_SWITCHES) -> LayerPlan:
    """The one decision function: what vLLM `engine` does with `layer` on `tp` ranks (EP if `ep`)
    of a CUDA GPU of architecture `gpu`, step by step, stopping where the engine stops.
    `switches`: the engine's environment overrides and `--moe-backend` (defaults: none, auto).

    Each step is one function below, in the engine's order (the `STAGES` where it raises); a step
    returns False where the engine stops, and the layout step runs on whatever loading found."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    rel = rules.release(engine)
    if gpu not in rules.GPUS:
        raise ValueError(f"unknown GPU architecture {gpu!r} (one of {', '.join(rules.GPUS)})")
    moe_tp = 1 if ep else tp
    experts_per_rank = local_expert_counts(layer.num_experts, tp) if ep else [layer.num_experts] * tp
    i_p = layer.intermediate_size // moe_tp
    plan = LayerPlan(
        tp=tp, ep=ep, moe_tp=moe_tp, intermediate_size_per_partition=i_p, padded_intermediate=None,
        backend=None, rejected={}, w2=None, quant_type=None,
        local_experts=experts_per_rank, rank_bytes=None, vllm=engine, gpu=gpu,
    )
    if layer.scheme is None:
        plan.fail("method", "unquantized", "experts are not quantized (no compressed-tensors scheme targets them); nothing to plan")
        return plan
    facts = _LayerFacts(layer, layer.scheme, rel, engine, gpu, switches, tp, ep, moe_tp, i_p, plan)
    if methods.uses_format_method(layer.quant_method):
        _plan_format_layer(facts)
        return plan
    for step in (_config_step, _method_step, _constructor_step, _oracle_step, _constructor_asserts_step,
                 _create_weights_step):
        if not step(facts):
            return plan
    _load_step(facts)
    _layout_step(facts)
    return plan


_MIXED_SCHEMES = "All MoE projections need to have same quantization scheme but found multiple"


def _config_step(f: _LayerFacts) -> bool:
    """Config parse (CompressedTensorsConfig): refuses the whole checkpoint.  The layer's own
    group here; inspect judges every group of the config (config_parse.py)."""
    refused = scheme_refusal(f.s, f.rel)
    if refused is not None:
        f.plan.fail("config", *refused)
        return False
    return True


def moe_tp_divides(plan: LayerPlan, I: int, moe_tp: int) -> bool:
    """FusedMoEConfig's assert, before any method is asked (every format): the intermediate size
    splits evenly over the MoE tensor-parallel ranks."""
    ok = I % moe_tp == 0
    plan.checks.append(Check("intermediate_size % moe_tp == 0", ok, f"{I} % {moe_tp}"))
    if not ok:
        plan.fail("method", "I % TP", (
            f"AssertionError (assert intermediate_size % tp_size == 0: intermediate_size {I} is not divisible by the "
            f"MoE tensor-parallel size {moe_tp}; FusedMoEConfig)"))
    return ok


def _method_step(f: _LayerFacts) -> bool:
    """The MoE layer and its method (FusedMoEConfig, get_moe_method)."""
    plan, layer, s, I, moe_tp = f.plan, f.layer, f.s, f.layer.intermediate_size, f.moe_tp
    if not moe_tp_divides(plan, I, moe_tp):
        return False
    looked = looked_up_schemes(layer, f.rel)
    if looked is not None:
        # releases before 0.32 (vLLM 0.31 compressed_tensors_moe.py get_moe_method) look expert 0
        # up under gate_proj/up_proj/down_proj whatever the checkpoint calls its projections
        if len(set(looked)) > 1:
            plan.fail("method", "mixed schemes", _MIXED_SCHEMES)
            return False
        error = unquantized_lookup_error(layer, f.rel)
        if error is not None:
            plan.fail("load", "unquantized method", error)
            return False
    if len(layer.scheme_sets) > 1:
        first_key = next(iter(layer.scheme_sets))
        others = [(k, v) for k, v in layer.scheme_sets.items() if k != first_key]
        f.mixed_experts = "; ".join(
            f"experts {_ranges(v)} use {'/'.join(x.describe() if x else 'unquantized' for x in dict.fromkeys(k))}"
            for k, v in others
        )
        plan.hazards.append(
            "per-expert mixed precision in one MoE layer: vLLM's get_moe_method looks only at expert 0's "
            "gate/up/down schemes; other experts' tensors are loaded with the wrong bit width or shapes "
            "(load failure or garbage). Quantize every expert of a layer with one scheme."
        )
        if len(set(first_key)) > 1:
            plan.fail("method", "mixed schemes", _MIXED_SCHEMES)
            return False
    elif layer.scheme_sets and len(set(next(iter(layer.scheme_sets)))) > 1:
        plan.fail("method", "mixed schemes", _MIXED_SCHEMES)
        return False
    if not s.is_wna16:
        plan.fail("method", "not WNA16", (
            f"scheme {s.type} strategy={s.strategy} is not a weight-only integer group/channel scheme (WNA16); "
            "not handled by the WNA16 MoE method"))
        return False
    refused = methods.moe_format_refusal(f.rel, s)
    if refused is not None:
        plan.fail("method", "format/bits", refused)
        return False
    plan.quant_type = quant_type(s)
    return True


def _constructor_step(f: _LayerFacts) -> bool:
    """The method constructor's own checks, before it asks the backend oracle."""
    plan, s, rel = f.plan, f.s, f.rel
    if not s.symmetric and s.num_bits not in SUPPORTED_BITS and not rel.has("method.zp_types_all_widths"):
        plan.fail("method", "zp type", (
            f"KeyError: {s.num_bits} (the release's zero-point type table has int4 and int8 only: an asymmetric "
            f"{s.num_bits}-bit MoE layer cannot be built)"))
        return False
    if s.num_bits not in SUPPORTED_BITS and not rel.has("oracle.humming_group32_keys"):
        plan.fail("method", "bits", "CompressedTensorsWNA16MoEMethod only supports int4 and int8 now.")
        return False
    if rel.has("ctor.int8_channel_only") and s.num_bits == 8 and (s.group_size != -1 or s.group_size_null):
        plan.fail("method", "int8 grouped", "AssertionError (assert group_size == -1: grouped int8 experts are refused; vllm PR #52002)")
        return False
    f.allow_tile_padding = not (rel.has("ctor.actorder_strict_tiles") and s.act_order)
    return True


def _oracle_order(f: _LayerFacts) -> list[Backend] | None:
    """The backends the oracle asks, in its order: the release's priority, or only the one
    `--moe-backend` names (None: the engine raises because it maps no such name)."""
    forced = f.switches.moe_backend
    if forced == "auto":
        return backend_priority(f.rel, f.gpu)
    # --moe-backend: the oracle maps the engine's name, asks that one backend and raises when it
    # does not fit; no other backend is considered
    mapped = wna16_moe_backends(f.engine)
    for other in backend_priority(f.rel, f.gpu):
        if other.value != forced or forced not in mapped:
            f.plan.rejected[other.value] = f"not considered (--moe-backend {forced})"
    if forced not in mapped:
        f.plan.fail("oracle", "moe_backend", (
            f"moe_backend='{forced}' is not supported for WNA16 MoE. Expected one of {mapped}."))
        return None
    return [Backend(forced)]


def _marlin_gate_crash(f: _LayerFacts, b: Backend) -> str | None:
    """The TypeError the Marlin gate raises for a channel-wise scheme written with group_size null
    (None: it does not raise for `b` here)."""
    if (b in (Backend.MARLIN, Backend.BATCHED_MARLIN) and f.s.group_size_null
            and f.rel.has("ctor.group_size_none_crash") and f.layer.hidden_size % 128 == 0):
        # the gate's `H % 128 == 0 and ...` short-circuits for other H: then None is only "not a
        # Marlin group size" and the layer goes on to the next backend
        return ("TypeError: '<=' not supported between instances of 'NoneType' and 'int'" if f.allow_tile_padding
                else "TypeError: '>' not supported between instances of 'NoneType' and 'int'")
    return None


def _humming_key_crash(f: _LayerFacts, b: Backend) -> str | None:
    """The TypeError Humming's weight-key check raises for a group_size null scheme of a width
    without a fixed scale descriptor (None: it does not raise for `b` here)."""
    # the method builds a scale group shape (1, None) for those widths, and Humming's weight-key
    # check compares that column with 0 (vLLM 0.29 fused_humming_moe.py: _is_supported_wna16_weight_key)
    if (b is Backend.HUMMING and f.s.group_size_null and f.s.num_bits not in SUPPORTED_BITS
            and f.rel.has("ctor.group_size_none_crash") and rules.GPUS[f.gpu] >= 75):
        return "TypeError: '>' not supported between instances of 'NoneType' and 'int'"
    return None


def _stop_at_crash(f: _LayerFacts, order: list[Backend], b: Backend, crashing: tuple[Backend, ...], said: str) -> None:
    """Record what each backend from `b` on would say, for the report: `said` for the ones in
    `crashing`, their own reason for the others (the engine stops at the crash)."""
    for rest in order[order.index(b):]:
        reason = said if rest in crashing else f.reason(rest)
        if reason is not None:
            f.plan.rejected[rest.value] = reason


def _oracle_step(f: _LayerFacts) -> bool:
    """The backend oracle inside the method constructor: the first backend in the release's order
    that takes the layer, and why each other one does not."""
    plan = f.plan
    order = _oracle_order(f)
    if order is None:
        return False
    for b in order:
        crash = _marlin_gate_crash(f, b)
        if crash is not None:
            plan.fail("oracle", "group_size null", (
                f"{crash} (the Marlin gate receives group_size None for a channel-wise scheme written with "
                "group_size null; vllm #52713, fixed by PR #53163)"))
            _stop_at_crash(f, order, b, (Backend.MARLIN, Backend.BATCHED_MARLIN), f"crashes the Marlin gate: {crash}")
            return False
        crash = _humming_key_crash(f, b)
        if crash is not None:
            if plan.backend is not None:  # the oracle stopped at the winner: Humming is never asked
                plan.rejected[b.value] = f"raises {crash}"
                continue
            plan.fail("oracle", "group_size null", (
                f"{crash} (Humming's weight-key check receives the scale group size None of a channel-wise scheme "
                "written with group_size null; fixed in vLLM 0.30.0)"))
            _stop_at_crash(f, order, b, (Backend.HUMMING,), f"raises {crash}")
            return False
        own = f.own[b] = f.reason(b)
        if own is not None:
            plan.rejected[b.value] = own
        elif plan.backend is None:
            plan.backend = b
        else:
            plan.rejected[b.value] = f"lower priority than {plan.backend.value}"
    # the layouts wna16ctl writes are those of the Marlin and Triton backends
    for b in (Backend.MARLIN, Backend.TRITON):
        if b not in f.own:
            f.own[b] = f.reason(b)
    forced = f.switches.moe_backend
    if plan.backend is None and forced != "auto":
        plan.fail("oracle", "forced backend", (
            f"WNA16 MoE backend '{forced.upper()}' does not support the deployment configuration since "
            f"{plan.rejected[forced]}."))
        return False
    if plan.backend is None:
        plan.fail("oracle", "no backend", "No WNA16 MoE backend supports the deployment configuration.")
        return False
    return True


def _constructor_asserts_step(f: _LayerFacts) -> bool:
    """The constructor's asserts after the oracle chose a backend other than Marlin."""
    plan, s, rel, chosen = f.plan, f.s, f.rel, f.chosen
    assert chosen is not None  # the oracle step stops without one
    if chosen in (Backend.MARLIN, Backend.BATCHED_MARLIN):
        return True
    if rel.has("ctor.nonmarlin_group_strategy_only") and s.strategy != "group":
        plan.fail("method", "channel assert", (
            f"AssertionError (assert strategy == 'group': the {chosen.value} backend does not take channel-wise "
            "experts; only Marlin does)"))
    elif rel.has("ctor.nonmarlin_rejects_group_actorder") and s.actorder == "group":
        plan.fail("method", "actorder assert", f"AssertionError (assert actorder != 'group': the {chosen.value} backend has no act-order)")
    elif rel.has("ctor.nonmarlin_symmetric_only") and not s.symmetric:
        plan.fail("method", "asym assert", "Only symmetric quantization is supported for MoE")
    return not plan.errors


def _create_weights_step(f: _LayerFacts) -> bool:
    """create_weights: the w2 scale sharding and the divisibility checks of the parameter shapes."""
    plan, s, rel, i_p = f.plan, f.s, f.rel, f.i_p
    H, I, gs, checks = f.layer.hidden_size, f.layer.intermediate_size, s.group_size, f.plan.checks
    # releases without `_w2_scale_sharding` always shard the w2 scales by rank
    plan.w2 = (vllm_w2_scale_sharding(s.actorder, gs, i_p, I) if rel.has("weights.w2_scale_sharding")
               else W2ScaleSharding(False, i_p, True))
    if s.strategy != "channel":
        ok = H % gs == 0
        checks.append(Check("hidden_size % group_size == 0", ok, f"{H} % {gs}"))
        if not ok:
            plan.fail("create_weights", "H % group", (
                f"CompressedTensors WNA16 MoE requires hidden_size ({H}) to be divisible by group_size ({gs})."))
        ok = plan.w2.load_full_w2 or i_p % gs == 0
        checks.append(Check("load_full_w2 or intermediate_size_per_partition % group_size == 0", ok, f"{i_p} % {gs}"))
        if not ok and not plan.errors:
            plan.fail("create_weights", "I_p % group", (
                "CompressedTensors WNA16 MoE with static group scales requires the MoE intermediate size per "
                f"tensor-parallel partition ({i_p}) to be divisible by group_size ({gs}). Scale groups would "
                "otherwise cross TP shard boundaries; use a compatible TP size or enable expert parallelism."))
    if rel.has("weights.asym_pack_checks") and not s.symmetric:
        _zero_point_pack_checks(f)
    if (rel.has("weights.untransposed_zp_keyerror") and not s.symmetric and not plan.errors
            and f.chosen in (Backend.HUMMING, Backend.FLASHINFER_TRTLLM)):
        plan.fail("create_weights", "zp shape KeyError", (
            "KeyError: 'Flashinfer' (the untransposed parameter shapes the Humming backend is given have no entry "
            "for zero points; asymmetric layers cannot be created on it in this release)"))
    if plan.errors:
        if (plan.failure_rule == "I_p % group" and not f.ep and f.tp > 1
                and plan_layer(f.layer, f.tp, True, f.engine, f.gpu, f.switches).loadable):
            plan.hazards.append(f"with expert parallelism (wna16ctl --ep, vLLM --enable-expert-parallel) this layer "
                                f"loads at {f.tp} ranks: each expert stays whole on one rank")
        return False
    return True


def _zero_point_pack_checks(f: _LayerFacts) -> None:
    """create_weights' checks that the packed zero points of an asymmetric layer split into whole words."""
    plan, s, i_p, H = f.plan, f.s, f.i_p, f.layer.hidden_size
    pf = _pack_factor_text(s.num_bits)
    ok = (2 * i_p * s.num_bits) % 32 == 0
    plan.checks.append(Check("2 * intermediate_size_per_partition % pack_factor == 0 (zero points)", ok, f"{2 * i_p} % {pf}"))
    if not ok and not plan.errors:
        plan.fail("create_weights", "2·I_p % pf", (
            f"CompressedTensors WNA16 MoE: gate+up output channels per TP rank (2 * intermediate_size_per_partition "
            f"= {2 * i_p}) must be divisible by packed_factor ({pf}). Use a TP size where 2 * intermediate_size is "
            f"divisible by {pf}."))
    ok = (H * s.num_bits) % 32 == 0
    plan.checks.append(Check("hidden_size % pack_factor == 0 (zero points)", ok, f"{H} % {pf}"))
    if not ok and not plan.errors:
        plan.fail("create_weights", "H % pf", (
            f"CompressedTensors WNA16 MoE: hidden_size ({H}) must be divisible by packed_factor ({pf}) for correct "
            "ZP unpacking."))


def _load_step(f: _LayerFacts) -> None:
    """Weight loading: wna16ctl's own checks, where the engine floors and slices silently."""
    plan, s, i_p, layer = f.plan, f.s, f.i_p, f.layer
    if f.mixed_experts:
        plan.fail("load", "mixed experts", (
            f"per-expert mixed precision: expert 0 uses {s.describe()} but {f.mixed_experts}; vLLM builds one fused "
            "parameter per layer from expert 0's scheme, so the other experts cannot load"))
    whole_words = (i_p * s.num_bits) % 32 == 0
    # releases that round packed extents up load one whole partition (the loader's slice is the
    # whole tensor); under MoE TP the per-rank slices still start inside a word
    ok = whole_words or (f.rel.has("weights.ceil_packed_dim") and f.moe_tp == 1)
    plan.checks.append(Check("intermediate_size_per_partition % pack_factor == 0" + ("" if whole_words or not ok else
                             " (or one partition: packed extents are rounded up)"), ok,
                             f"{i_p} % {_pack_factor_text(s.num_bits)}"))
    if not ok:
        plan.fail("load", "I_p % pf", (
            f"intermediate size per partition ({i_p}) is not a multiple of the pack factor "
            f"({_pack_factor_text(s.num_bits)}): each rank's slice of the packed down_proj would start inside an int32 word"))
    if layer.packing != "same" and layer.packing != "dense":
        # vLLM sizes every packed expert parameter as ceil(size * bits / 32) words (the dense
        # packing of compressed-tensors >= 0.20; compressed_tensors_moe_wna16.py: _packed_dim):
        # words that hold 32 // bits whole codes have another extent and another bit layout
        plan.fail("load", "word packing", (
            f"the expert tensors hold {32 // s.num_bits} whole {s.num_bits}-bit codes per int32 word (compressed-tensors "
            f"<= 0.19); vLLM reads {s.num_bits}-bit codes densely packed (ceil(n * {s.num_bits} / 32) words, "
            "compressed-tensors >= 0.20): the weight loader's copy fails or reads other codes. Re-save the checkpoint "
            "with compressed-tensors 0.20 or later"))
    if s.act_order and not s.symmetric and f.moe_tp > 1:
        # g_idx of a rank's K slice names groups of the whole row, but zero points (unlike w2
        # scales) are never loaded in full: the rank would dequantize with other groups' zeros.
        plan.fail("load", "actorder+zp TP", (
            "act-order (actorder=group) with asymmetric zero points under tensor parallelism: vLLM loads only "
            "each rank's slice of the w2 zero points while g_idx references every group, so outputs would be "
            "wrong; use expert parallelism (--ep) or TP 1"))


def _tile_padding_hazard(i_p: int, padded: int) -> str:
    return (f"needs Marlin tile padding of the intermediate size per partition from {i_p} to {padded} "
            "(marlin_moe_padded_intermediate): activations are padded and sliced on every forward, and vLLM warns "
            "that performance may be degraded")


def _choose_layout(f: _LayerFacts) -> None:
    """The layout repack writes (plan.layout), or the hazard of a partial last packed word, where
    repack writes none."""
    plan, s, i_p, chosen = f.plan, f.s, f.i_p, f.chosen
    if (i_p * s.num_bits) % 32:
        # repack writes whole packed words per rank: no layout for a partial last word
        plan.hazards.append(
            f"the intermediate size ({i_p}) is not a multiple of the pack factor ({_pack_factor_text(s.num_bits)}): "
            "vLLM loads this one partition with its last packed word partly filled, but wna16ctl repack does not "
            "write such layers")
        if chosen is Backend.MARLIN:  # the engine's own Marlin processing still pads it
            plan.padded_intermediate = marlin_moe_padded_intermediate(i_p, s.group_size)
            if plan.padded_intermediate != i_p:
                plan.hazards.append(_tile_padding_hazard(i_p, plan.padded_intermediate))
    elif chosen in (Backend.MARLIN, Backend.TRITON):
        plan.layout = LAYOUT_OF_BACKEND[chosen]
    elif f.own[Backend.MARLIN] is None and s.num_bits in SUPPORTED_BITS:
        plan.layout = MARLIN
    elif f.own[Backend.TRITON] is None and s.num_bits in SUPPORTED_BITS:
        plan.layout = TRANSPOSED
    if plan.layout is not None and chosen not in (Backend.MARLIN, Backend.TRITON):
        assert chosen is not None  # a layout is chosen only after the oracle chose a backend
        plan.hazards.append(
            f"vLLM {f.engine} on {f.gpu} runs this layer on the {chosen.value} backend, which converts the checkpoint's "
            f"own tensors at load; the {plan.layout} layout that repack writes is what its "
            f"{BACKEND_OF_LAYOUT[plan.layout].value} backend (--moe-backend {BACKEND_OF_LAYOUT[plan.layout].value}) "
            "and wna16ctl's MoE GEMM consume"
        )


def _marlin_checks(f: _LayerFacts) -> None:
    """Marlin's shape checks (reported for every layer), and its tile padding where the layout is Marlin."""
    plan, i_p, H, gs, checks = f.plan, f.i_p, f.layer.hidden_size, f.s.group_size, f.plan.checks
    checks.append(Check("hidden_size % 128 == 0 (Marlin)", H % 128 == 0, f"{H} % 128"))
    checks.append(Check("group_size in {-1, 32, 64, 128} (Marlin)", gs in MARLIN_GROUP_SIZES, str(gs)))
    if not f.allow_tile_padding:
        step = max(64, gs)
        checks.append(Check(f"intermediate_size_per_partition % {step} == 0 (Marlin, act-order)", i_p % step == 0,
                            f"{i_p} % {step}"))
    if plan.layout != MARLIN:
        return
    P = marlin_moe_padded_intermediate(i_p, gs)
    plan.padded_intermediate = P
    checks.append(Check("Marlin repack: hidden_size % 16 == 0 and padded intermediate % 64 == 0",
                        H % 16 == 0 and P % 64 == 0, f"{H}, {P}"))
    if P != i_p:
        plan.hazards.append(_tile_padding_hazard(i_p, P))
    if (f.chosen is Backend.MARLIN and f.rel.has("process.w13_scales_size_k_quirk") and gs > 0 and H // gs > 1
            and not gs < i_p):
        plan.hazards.append(
            f"vLLM permutes w13 scales with size_k = intermediate size per partition ({i_p}) instead of "
            f"hidden_size ({H}); with {i_p} <= group_size {gs} the grouped scales get the channel-wise "
            "permutation and outputs are wrong (vllm PR #50196, open). wna16ctl repack writes the corrected "
            "layout; an engine that repacks itself needs that fix"
        )


def _layout_step(f: _LayerFacts) -> None:
    """The layout repack writes, Marlin processing, the hazards of the loaded layer, and each rank's bytes."""
    plan, s, chosen, layer = f.plan, f.s, f.chosen, f.layer
    assert chosen is not None  # the oracle step stops without one
    _choose_layout(f)
    _marlin_checks(f)
    if s.actorder == "dynamic" and chosen not in (Backend.MARLIN, Backend.BATCHED_MARLIN):
        plan.hazards.append(
            f"actorder 'dynamic' is the alias of 'group', but the {chosen.value} backend's act-order refusal compares "
            "the string with 'group': it loads the layer and ignores g_idx, so outputs are wrong. Rewrite the "
            "config's actorder as 'group' (the tensors are the same)"
        )
    elif s.actorder == "dynamic" and f.rel.has("weights.w2_scale_sharding") and f.moe_tp > 1 and s.group_size > 0:
        plan.hazards.append(
            "actorder 'dynamic' is the alias of 'group', but vLLM's w2 scale sharding compares the string with "
            "'group': it shards the act-order w2 scales by rank and sets is_k_full, so the layer loads and computes "
            "wrong outputs. Rewrite the config's actorder as 'group' (the tensors are the same)"
        )
    if layer.zero_point_form == "unpacked":
        plan.hazards.append(
            "zero points stored unpacked (compressed-tensors <= 0.9.3): vLLM's loader expects packed int32 "
            "[N/pack_factor, G] zero points and fails on these; wna16ctl repack converts them"
        )
    if plan.layout is not None:
        plan.layout_w2 = layout_w2_sharding(s, f.i_p, layer.intermediate_size, f.rel)
        plan.rank_bytes = _rank_bytes(BACKEND_OF_LAYOUT[plan.layout], s, layer.hidden_size, f.i_p,
                                      plan.padded_intermediate, plan.layout_w2, plan.local_experts,
                                      _scale_bytes(layer.scale_dtype))


def vllm_w2_scale_sharding(actorder: str | None, group_size: int, i_p: int, i: int) -> W2ScaleSharding:
    """`_w2_scale_sharding` exactly as the releases that have it compute it: the actorder string is
    compared with 'group' as written, so the alias 'dynamic' shards like no act-order."""
    load_full = actorder == "group" and group_size != -1
    return W2ScaleSharding(load_full, i if load_full else i_p, actorder != "group" or i_p == i)


def layout_w2_sharding(s: WeightScheme, i_p: int, i: int, rel: rules.Release) -> W2ScaleSharding:
    """The w2 scale sharding repack writes: act-order (either spelling) keeps every group on every rank."""
    if not rel.has("weights.w2_scale_sharding"):
        return W2ScaleSharding(False, i_p, True)
    return w2_scale_sharding(s.actorder if s.act_order else None, s.group_size, i_p, i)


def _pack_factor_text(num_bits: int) -> str:
    """32 / num_bits as a reduced fraction ("8", "16/3")."""
    g = math.gcd(32, num_bits)
    return f"{32 // g}" if g == num_bits else f"{32 // g}/{num_bits // g}"


def _scale_bytes(dtype: str | None) -> int:
    return 4 if dtype == "F32" else 2


def _ranges(ids: list[int]) -> str:
    out: list[str] = []
    start = prev = ids[0]
    for x in ids[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def indices_text(noun: str, indices: list[int]) -> str:
    """'layers 0-3,7' / 'expert 2': the noun, plural unless one, and the indices as ranges."""
    return f"{noun}{'s' if len(indices) != 1 else ''} {_ranges(indices)}"


def _outcome(p: LayerPlan) -> str:
    if p.loadable:
        return f"loads on {p.backend.value}"  # type: ignore[union-attr]  # a plan that loads has a backend
    where = {"config": "refused at config parse", "method": "refused by the MoE method",
             "oracle": "refused at backend selection", "create_weights": "refused in create_weights",
             "load": "fails at weight loading"}[p.failure_stage or "load"]
    return f"{where}: {p.errors[0]}"


def release_differences(layer: MoELayer, tp: int, ep: bool, engine: str, gpu: str,
                        switches: EngineSwitches = DEFAULT_SWITCHES) -> list[str]:
    """What the other known releases do differently with this layer, computed from the rulebook:
    one line per group of releases whose outcome differs from `engine`'s."""
    mine = _outcome(plan_layer(layer, tp, ep, engine, gpu, switches))
    groups: dict[str, list[str]] = {}
    for v in rules.RELEASES:
        if v == engine:
            continue
        out = _outcome(plan_layer(layer, tp, ep, v, gpu, switches))
        if out != mine:
            groups.setdefault(out, []).append(v)
    return [f"vLLM {rules.span(vs)}: {out}" for out, vs in groups.items()]


# -- GPTQ / AWQ: the format's own method steps (planning/methods/), the shared gate and oracle ------
def _format_backend_reason(b: Backend, rel: rules.Release, gpu: str, oa: methods.OracleArgs, hidden: int, i_p: int,
                           switches: EngineSwitches, routing: str | None) -> str | None:
    """Why `b` does not take a layer whose GPTQ/AWQ/MoeWNA16 method asked the oracle with `oa`:
    the oracle's `_backend_incompatibility_reason` for that config class first, then the experts
    class's checks with the method's weight key (the generic symmetric int4/int8 descriptor; int4
    group-32 for MoeWNA16)."""
    wna16 = oa.layout == methods.base.MOE_WNA16_LAYOUT
    if b is Backend.RDNA3 and rel.has("oracle.rdna3"):
        return "only compressed-tensors checkpoints are supported"
    if b is Backend.FLASHINFER_TRTLLM and (oa.may_have_zp or oa.may_have_bias):
        return "zero points and bias are not supported"
    if b is Backend.TRITON:
        if oa.may_have_bias:
            return "expert bias is not supported"
        if oa.layout == methods.base.AWQ_LAYOUT:
            return "the AutoAWQ weight layout is not supported"
        if oa.layout == methods.base.GPTQ_LAYOUT and oa.desc_act:
            return "GPTQ activation ordering is not supported"
    if wna16 and b in (Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.EMULATION):
        return "the MoeWNA16 checkpoint layout is not supported"
    s = WeightScheme(num_bits=oa.bits, group_size=32 if oa.group32 else oa.group_size, symmetric=True,
                     strategy="group" if oa.group_size > 0 else "channel", actorder=None, format="")
    # the key's group columns: the generic descriptor unless the method named group 32
    if not oa.group32 and s.group_size == 32:
        s = WeightScheme(num_bits=oa.bits, group_size=-1, symmetric=True, strategy="channel", actorder=None, format="")
    return _backend_reason(b, rel, gpu, s, hidden, i_p, oa.allow_tile_padding, switches, routing,
                           marlin_group=oa.group_size)


def _plan_format_layer(f: _LayerFacts) -> None:
    """A GPTQ/AWQ layer: config parse, the FusedMoEConfig assert, the format's method (or its
    MoeWNA16 fallback), the shared oracle, the method's create_weights, and Marlin's tile padding."""
    plan, layer, rel = f.plan, f.layer, f.rel
    raw, qm = layer.quant_raw or {}, str(layer.quant_method)
    cfg, refused = methods.parse_config(qm, raw, rel)
    if refused is not None:
        plan.fail("config", *refused)
        return
    I, moe_tp, H = layer.intermediate_size, f.moe_tp, layer.hidden_size
    if not moe_tp_divides(plan, I, moe_tp):
        return
    method = methods.moe_method(qm, cfg, raw, rel, layer.prefix, rules.GPUS[f.gpu],
                                lambda gs, pad: marlin_support_reason(H, f.i_p, gs, pad))
    plan.method = method.to_json()
    if method.fallback_reason is not None:
        plan.hazards.append(f"vLLM's Marlin gate refuses this layer ({method.fallback_reason}): the {qm} config falls "
                            "back to the MoeWNA16 method, which converts the experts to the Triton WNA16 layout at load")
    if method.oracle is None:
        assert method.error is not None  # a method without an oracle call stopped with an error
        plan.fail(*method.error)
        return
    f.oracle_args, f.allow_tile_padding = method.oracle, method.oracle.allow_tile_padding
    plan.quant_type = (f"uint{method.oracle.bits}" if method.oracle.may_have_zp
                       else f"uint{method.oracle.bits}b{1 << (method.oracle.bits - 1)}")
    if not _oracle_step(f):
        return
    made = methods.create_weights(qm, cfg, method, raw, rel, layer.prefix, f.plan.local_experts[0], H, I, f.i_p)
    plan.w2 = None if made.w2 is None else W2ScaleSharding(*made.w2)
    if made.error is not None:
        plan.fail("create_weights", "shape", made.error)
        return
    if method.error is not None:  # loads, but computes wrong: a correctness hazard the planner refuses
        plan.fail(*method.error)
    if made.hazard is not None:
        plan.fail("load", "scale groups floored", made.hazard)
    if f.chosen is Backend.MARLIN:
        _format_marlin_padding(f, method.oracle.group_size)
    if not plan.errors:
        _format_layout(f)


def _format_layout(f: _LayerFacts) -> None:
    """The layout repack writes for a GPTQ/AWQ/AutoRound layer that loads: the same rule as for a
    compressed-tensors one, on the canonical tensors the format's reader gives (the Marlin and
    Triton layouts hold codes, scales, zero points and g_idx, whatever form the file stored)."""
    plan, layer = f.plan, f.layer
    padded = plan.padded_intermediate
    _choose_layout(f)
    plan.padded_intermediate = padded  # the format's own Marlin padding step decided it
    if plan.layout is not None:
        plan.layout_w2 = layout_w2_sharding(f.s, f.i_p, layer.intermediate_size, f.rel)
        plan.rank_bytes = _rank_bytes(BACKEND_OF_LAYOUT[plan.layout], f.s, layer.hidden_size, f.i_p,
                                      plan.padded_intermediate, plan.layout_w2, plan.local_experts,
                                      _scale_bytes(layer.scale_dtype))


def _format_marlin_padding(f: _LayerFacts, group_size: int) -> None:
    """Marlin's tile padding of the intermediate size, and the shared w13 scale permutation bug."""
    plan, i_p, H = f.plan, f.i_p, f.layer.hidden_size
    plan.padded_intermediate = marlin_moe_padded_intermediate(i_p, group_size)
    if plan.padded_intermediate != i_p:
        plan.hazards.append(_tile_padding_hazard(i_p, plan.padded_intermediate))
    if f.rel.has("process.w13_scales_size_k_quirk") and group_size > 0 and H // group_size > 1 and not group_size < i_p:
        plan.hazards.append(
            f"vLLM permutes w13 scales with size_k = intermediate size per partition ({i_p}) instead of "
            f"hidden_size ({H}); with {i_p} <= group_size {group_size} the grouped scales get the channel-wise "
            "permutation and outputs are wrong (vllm PR #50196, open)")
