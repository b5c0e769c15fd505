"""The planner for the model around the experts: quantized linear layers and the engine's
model-level tensor-parallel checks, for one vLLM release on one CUDA GPU architecture.

`plan_linear` follows what the engine does with one compressed-tensors WNA16 linear layer
(`CompressedTensorsWNA16.create_weights`): the layer class shards K or N per rank (its own
divisibility asserts), `choose_mp_linear_kernel` walks the release's CUDA kernel list and takes
the first kernel whose `can_implement` accepts the per-rank shape, and the scales are then
checked for groups straddling ranks.  `model_checks` are the checks that stop the engine before
any weight (attention heads, KV heads, vocabulary, experts).  A sibling of `moe.py` (the MoE
planner): the same rulebook, the same shape of result, no files read and no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wna16ctl.planning import methods, rules
from wna16ctl.planning.config_parse import scheme_refusal
from wna16ctl.planning.engine_env import DEFAULT as DEFAULT_SWITCHES, EngineSwitches
from wna16ctl.sources.architectures import model_types
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.model import COLUMN, QKV, REPLICATED, ROW, VOCAB, LinearLayer, ModelDims

# vLLM kernel class names, in the CUDA priority order of `_POSSIBLE_KERNELS`
CUTLASS_W4A8, MACHETE, ALLSPARK, MARLIN = "CutlassW4A8LinearKernel", "MacheteLinearKernel", "AllSparkLinearKernel", "MarlinLinearKernel"
CONCH, EXLLAMA, TRITON, HUMMING = "ConchLinearKernel", "ExllamaLinearKernel", "TritonW4A16LinearKernel", "HummingLinearKernel"
_MIN_CC = {CUTLASS_W4A8: 90, MACHETE: 90, ALLSPARK: 80, MARLIN: 75, CONCH: 80, EXLLAMA: 60, TRITON: 0, HUMMING: 75}
_UNQUANTIZED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
# what the engine logs instead of a kernel class when VLLM_BATCH_INVARIANT=1 bypasses the kernel choice
BATCH_INVARIANT = "dequantize + batch-invariant matmul"


def kernel_priority(rel: rules.Release, gpu: str) -> list[str]:
    order = [CUTLASS_W4A8, MACHETE, MARLIN, CONCH, EXLLAMA, TRITON, HUMMING]
    if rel.has("linear.allspark_kernel"):
        order.insert(order.index(MARLIN), ALLSPARK)
    if rel.has("linear.humming_first_on_sm90") and rules.GPUS[gpu] == 90:
        order.remove(HUMMING)
        order.insert(order.index(MARLIN), HUMMING)
    return order


@dataclass(frozen=True)
class KernelConfig:
    """vLLM's MPLinearLayerConfig, as far as kernel choice reads it."""

    k: int  # full input size (K)
    n: int  # full output size (N)
    k_p: int  # per-rank K
    n_p: int  # per-rank N
    weight_type: str  # uint4b8 / uint8b128 (symmetric) or uint4 / uint8 (zero points)
    bits: int
    act_type: str  # the model dtype: bfloat16 / float16 / float32
    group_size: int  # -1: channel-wise
    zero_points: bool
    has_g_idx: bool


def weight_type(s: WeightScheme) -> str:
    if s.symmetric:
        return f"uint{s.num_bits}b{2 ** (s.num_bits - 1)}"
    return f"uint{s.num_bits}"


def linear_has_g_idx(s: WeightScheme) -> bool:
    """Whether the release's linear scheme treats the layer as act-order (has_g_idx): vLLM 0.27-0.29
    compressed_tensors_wNa16.py compares the weights' actorder with the enum member
    ActivationOrdering.GROUP, whose alias-aware equality (compressed-tensors 0.17, which those
    releases pin) also takes 'dynamic'.  Later releases refuse both at config parse."""
    return s.act_order


def linear_scheme_error(s: WeightScheme, rel: rules.Release) -> str | None:
    """The ValueError the release's linear scheme raises while it is built (None: it builds)."""
    if not 2 <= s.num_bits <= 8:
        return f"Unsupported num_bits = {s.num_bits}. Supported num_bits = [2, 3, 4, 5, 6, 7, 8]"
    if not s.symmetric and s.num_bits not in (4, 8) and not rel.has("method.zp_types_all_widths"):
        return f"Asymmetric quantization not supported for num_bits = {s.num_bits}. Supported: [4, 8]"
    return None


def _padded_nk(n: int, k: int, group_size: int) -> tuple[int, int]:
    """Marlin's thread-tile padding of (N, K): the cheaper of (n%64, k%lcm(128,g)) and (n%128, k%lcm(64,g))."""
    import math

    g = group_size if group_size > 0 else 1
    up = lambda x, m: -(-x // m) * m  # noqa: E731 - x rounded up to a multiple of m, for the line below
    cands = ((up(n, 64), up(k, math.lcm(128, g))), (up(n, 128), up(k, math.lcm(64, g))))
    return min(cands, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def _marlin_strict_shape(c: KernelConfig) -> str | None:
    """`verify_marlin_supports_shape` (act-order layers in releases with g_idx kernels)."""
    if c.n_p % 64:
        return (f"Weight output_size_per_partition = {c.n_p} is not divisible by  min_thread_n = 64. "
                "Consider reducing tensor_parallel_size or running with --quantization gptq.")
    if c.k_p % 128:
        return (f"Weight input_size_per_partition = {c.k_p} is not divisible by min_thread_k = 128. "
                "Consider reducing tensor_parallel_size or running with --quantization gptq.")
    if c.group_size < c.k and c.k_p % c.group_size:
        return _straddle_text(c.k_p, c.group_size, None, " or running with --quantization gptq")
    return None


def _straddle_text(k_p: int, group_size: int, layer: str | None, extra: str = "") -> str:
    where = f" for layer '{layer}'" if layer else ""
    return (f"Weight input_size_per_partition={k_p}{where} is not divisible by group_size={group_size}. This "
            "happens when tensor_parallel_size splits the layer input into shards that are not a whole number of "
            f"quant groups. Consider reducing tensor_parallel_size{extra}.")


def kernel_reason(kernel: str, rel: rules.Release, gpu: str, c: KernelConfig) -> str | None:
    """Why `kernel` cannot implement the layer (None: it can), in the order the release checks."""
    cc = rules.GPUS[gpu]
    if _MIN_CC[kernel] > cc:
        return f"{kernel} requires capability {_MIN_CC[kernel]}, current compute  capability is {cc}"
    return _CAN_IMPLEMENT[kernel](c, cc, c.has_g_idx and rel.has("linear.g_idx_kernels"))


# One function per kernel class: its `can_implement`, given the layer, the GPU's compute capability
# and whether the release builds the layer with g_idx (act-order).
def _cutlass_w4a8_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if cc != 90:
        return "CUTLASS W4A8 requires compute capability of 90 (Hopper)"
    if g_idx:
        return "Act reordering not supported by CUTLASS W4A8"
    return "CUTLASS W4A8 only supports FP8 (e4m3) activations"


def _machete_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if cc != 90:
        return "Machete requires compute capability of 90 (Hopper)"
    if g_idx and c.k_p != c.k:
        return "Act reordering currently not supported by Machete, when the input features are partitioned across devices"
    types = ["uint4", "uint8"] if c.zero_points else ["uint4b8", "uint8b128"]
    if c.weight_type not in types:
        return f"Quant type ({c.weight_type}) not supported by Machete, supported types are: {types}"
    sizes = [-1, 64, 128] if c.act_type in ("float16", "bfloat16") else [-1, 128]
    if c.group_size not in sizes:
        return f"Group size ({c.group_size}) not supported by Machete, supported group sizes are: {sizes}"
    if c.k_p % 64:
        return "Input features size must be divisible by 64"
    if c.n_p % 128:
        return "Output features size must be divisible by 128"
    return None


def _allspark_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if c.zero_points:
        return "Zero points currently not supported by AllSpark"
    if not 80 <= cc < 90:
        return f"AllSpark currently does not support device_capability = {cc}."
    if c.group_size != -1:
        return f"For Ampere GPU, AllSpark does not support group_size = {c.group_size}. Only group_size = -1 are supported."
    if c.weight_type != "uint8b128":
        return (f"For Ampere GPU, AllSpark does not support quant type ({c.weight_type}). Only quant type "
                "([uint8b128]) are supported.")
    if c.k_p % 16 or c.n_p % 16:
        return ("AllSpark needs input_size_per_partition % 16 = 0 and output_size_per_partition % 16 = 0 for "
                "Ampere GPU optimized kernels.")
    if c.act_type not in ("float16", "bfloat16"):
        return f"AllSpark only supports act_dtype = float16 or bfloat16,for Ampere GPU, but got act_dtype = {c.act_type}."
    return None


def _marlin_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    types = ["uint4"] if c.zero_points else ["uint4b8", "uint8b128"]
    if c.weight_type not in types:
        return f"Quant type ({c.weight_type}) not supported by  Marlin, supported types are: {types}"
    if c.group_size not in (-1, 32, 64, 128):
        return f"Group size ({c.group_size}) not supported by Marlin, supported group sizes are: [-1, 32, 64, 128]"
    if g_idx:
        return _marlin_strict_shape(c)
    if c.group_size != -1 and c.group_size < c.k and c.k_p % c.group_size:
        return f"in_features per partition {c.k_p} is not divisible by group_size = {c.group_size}."
    return None


def _conch_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if g_idx:
        return "Activation reordering (g_idx) is not supported by ConchLinearKernel"
    if c.weight_type not in ("uint4", "uint8", "uint4b8", "uint8b128"):
        return f"Weight type ({c.weight_type}) not supported by ConchLinearKernel"
    if c.group_size not in (-1, 128):
        return (f"Group size ({c.group_size}) not supported by ConchLinearKernel, supported group sizes are: "
                "[-1, 128]")
    return ("conch-triton-kernels is not installed, please install it via `pip install conch-triton-kernels` and "
            "try again! (an optional package; planned as absent)")


def _exllama_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if g_idx and c.k_p != c.k:
        return "Act reordering currently not supported by Exllama, when the input features are partitioned across devices"
    if c.n_p % (32 // c.bits):
        return ("Output features must be a multiple of the pack factor (32 / num_bits) so that we can correctly "
                "pack the zero points")
    if c.act_type != "float16":
        return "Exllama only supports float16 activations"
    if c.weight_type not in ("uint4b8", "uint8b128"):
        return f"Quant type ({c.weight_type}) not supported by Exllama, supported types are: [uint4b8, uint8b128]"
    if c.group_size <= 0:
        return f"Group size ({c.group_size}) must be positive, Exllama does not support channelwise quantization"
    if c.k % c.group_size:
        return f"Group size ({c.group_size}) does not evenly divide the number of input features ({c.k})"
    return None


def _triton_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if g_idx:
        return "Activation reordering (g_idx) is not supported by TritonW4A16LinearKernel"
    if c.weight_type not in ("uint4b8", "uint4"):
        return f"Quant type {c.weight_type} not supported; supported: [uint4b8, uint4]"
    if c.act_type not in ("float16", "bfloat16"):
        return "Only float16/bfloat16 activations are supported"
    if c.n_p % 8:
        return f"Output features ({c.n_p}) must be divisible by 8 (8 int4 values packed per int32)"
    if c.group_size not in (-1, 32, 64, 128, 256) and c.group_size != c.k:
        return f"Group size {c.group_size} not supported; supported: [-1, 32, 64, 128, 256] or full K ({c.k})"
    eff = c.group_size if c.group_size != -1 else c.k_p
    if c.k_p % eff:
        return f"Input features {c.k_p} not divisible by group size {eff}"
    return None


def _humming_reason(c: KernelConfig, cc: int, g_idx: bool) -> str | None:
    if g_idx:
        return "Humming does not support act-order (g_idx)"
    return None


_CAN_IMPLEMENT: dict[str, Callable[[KernelConfig, int, bool], str | None]] = {
    CUTLASS_W4A8: _cutlass_w4a8_reason, MACHETE: _machete_reason, ALLSPARK: _allspark_reason, MARLIN: _marlin_reason,
    CONCH: _conch_reason, EXLLAMA: _exllama_reason, TRITON: _triton_reason, HUMMING: _humming_reason,
}


@dataclass
class LinearPlan:
    """What one release does with one linear layer at one TP size."""

    tp: int
    vllm: str
    gpu: str
    k: int | None = None  # per-rank K
    n: int | None = None  # per-rank N
    kernel: str | None = None
    method: str | None = None  # the quant method class vLLM builds (GPTQ/AWQ/auto-round layers)
    rejected: dict[str, str] = field(default_factory=dict)
    padded_nk: tuple[int, int] | None = None  # Marlin's tile padding of (N, K), when it pads
    errors: list[str] = field(default_factory=list)
    failure_stage: str | None = None
    failure_rule: str | None = None
    hazards: list[str] = field(default_factory=list)

    @property
    def loadable(self) -> bool:
        return not self.errors and (self.kernel is not None or self.method in _UNQUANTIZED_METHODS)

    def fail(self, stage: str, rule: str, text: str) -> None:
        if not self.errors:
            self.failure_stage, self.failure_rule = stage, rule
        self.errors.append(text)

    def to_json(self) -> dict[str, Any]:
        return {
            "tp": self.tp, "vllm": self.vllm, "gpu": self.gpu, "k": self.k, "n": self.n, "kernel": self.kernel,
            "method": self.method,
            "rejected": dict(self.rejected),
            "marlin_padded_nk": list(self.padded_nk) if self.padded_nk else None,
            "errors": list(self.errors), "failure_stage": self.failure_stage, "failure_rule": self.failure_rule,
            "hazards": list(self.hazards), "loadable": self.loadable,
        }


def _divide(plan: LinearPlan, what: str, a: int, b: int) -> int | None:
    """vLLM's `divide` (ensure_divisibility): an AssertionError when `a` is not a multiple of `b`."""
    if a % b:
        plan.fail("create_weights", f"{what} % TP", f"AssertionError: {a} is not divisible by {b} ({what})")
        return None
    return a // b


def per_rank_shape(layer: LinearLayer, tp: int, plan: LinearPlan) -> tuple[int, int, int, int] | None:
    """(K, N, K per rank, N per rank) as the layer class shards it, or None after an assert."""
    k, n = layer.input_size, layer.output_size
    role = layer.tp_role
    if role == REPLICATED:
        return k, n, k, n
    if role == ROW:
        k_p = _divide(plan, "input size", k, tp)
        return None if k_p is None else (k, n, k_p, n)
    if role == VOCAB:
        padded = -(-n // VOCAB_PADDING) * VOCAB_PADDING
        n_p = _divide(plan, "padded vocabulary", padded, tp)
        return None if n_p is None else (k, padded, k, n_p)
    if role == QKV:
        hd, heads, kv = layer.head_dim or 0, layer.num_heads or 0, layer.num_kv_heads or 0
        if not (hd and heads and kv):
            plan.fail("create_weights", "heads", f"{layer.name}: cannot tell the head counts from config.json")
            return None
        q_p = _divide(plan, "attention heads", heads, tp)
        if q_p is None:
            return None
        kv_p: int | None
        if tp >= kv:
            if _divide(plan, "KV head replicas", tp, kv) is None:
                return None
            kv_p = 1
        else:
            kv_p = _divide(plan, "KV heads", kv, tp)
            if kv_p is None:
                return None
        sizes = layer.output_sizes
        v_hd = sizes[2] // kv if len(sizes) > 2 and sizes[2] else hd
        return k, (heads + kv) * hd + kv * v_hd, k, q_p * hd + kv_p * hd + kv_p * v_hd
    if role == COLUMN:
        n_p = 0
        for size in layer.output_sizes:
            part = _divide(plan, "output size", size, tp)
            if part is None:
                return None
            n_p += part
        return k, n, k, n_p
    raise AssertionError(role)


def choose_kernel(plan: LinearPlan, rel: rules.Release, c: KernelConfig, switches: EngineSwitches) -> bool:
    """choose_mp_linear_kernel: the first kernel of the release's list that can implement the layer
    (each other one with its reason in `plan.rejected`); False after the error it raises."""
    disabled = switches.names("VLLM_DISABLED_KERNELS", plan.vllm)
    for kern in ([] if plan.kernel else kernel_priority(rel, plan.gpu)):
        reason = (f"{kern} disabled by environment variable (VLLM_DISABLED_KERNELS)" if kern in disabled
                  else kernel_reason(kern, rel, plan.gpu, c))
        if plan.kernel is None and reason is None:
            plan.kernel = kern
        elif reason is not None:
            plan.rejected[kern] = reason
        else:
            plan.rejected[kern] = f"lower priority than {plan.kernel}"
    if plan.kernel is None:
        plan.fail("create_weights", "no kernel", (
            "Failed to find a kernel that can implement the WNA16 linear layer. Reasons: \n"
            + "\n".join(f" {kn} cannot implement due to: {r}" for kn, r in plan.rejected.items())))
        return False
    return True


def plan_linear(layer: LinearLayer, tp: int, engine: str = rules.NEWEST, gpu: str = rules.DEFAULT_GPU,
                dtype: str = "bfloat16", switches: EngineSwitches = DEFAULT_SWITCHES) -> LinearPlan:
    """The one decision function for a linear layer: what vLLM `engine` does with `layer` on `tp`
    ranks of a CUDA `gpu`, in the engine's order, stopping where it stops."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    rel = rules.release(engine)
    plan = LinearPlan(tp=tp, vllm=engine, gpu=gpu)
    if methods.uses_format_method(layer.quant_method):
        return plan_format_linear(layer, tp, rel, plan, dtype, switches)
    s = layer.scheme
    if layer.mixed_schemes:
        plan.fail("config", "mixed shards", (
            f"Found different quantization schemes for the shards of {layer.name}. vLLM requires all to use the same "
            f"scheme. ({', '.join(layer.modules)})"))
        return plan
    if s is None:
        plan.fail("config", "unquantized", f"{layer.name}: packed tensors but quantization_config does not quantize it")
        return plan
    if layer.refused:
        plan.fail("load", "built unquantized", (
            f"{layer.name}: vLLM builds {layer.refused} unquantized, so its weight_packed/weight_scale tensors have "
            f"no parameter to load into (There is no module or parameter named '{layer.modules[0]}.weight_packed'); "
            "keep it in quantization_config.ignore" + ("" if layer.kind != "lm_head" else
                                                       ", or add a target 'lm_head' to the config group that quantized it")))
        return plan
    refused = scheme_refusal(s, rel)
    if refused is not None:
        plan.fail("config", *refused)
        return plan
    if not methods.linear_stored_form_known(s):
        plan.fail("config", "not WNA16", (
            f"{layer.name}: scheme {s.describe()} format {s.format} is not a pack-quantized weight-only integer "
            "scheme; the WNA16 linear planner does not cover it"))
        return plan
    error = linear_scheme_error(s, rel)
    if error is not None:
        if layer.kind == "lm_head":
            # get_quant_method catches the scheme's ValueError for a ParallelLMHead and builds it
            # unquantized (vLLM 0.27-0.30 compressed_tensors.py): the packed tensors do not load
            plan.fail("load", "built unquantized", (
                f"{layer.name}: vLLM {engine} cannot build its scheme ({error}) and builds the output projection "
                f"unquantized, so its weight_packed/weight_scale tensors have no parameter to load into (There is "
                f"no module or parameter named '{layer.modules[0]}.weight_packed'); use vLLM 0.31.0 or later, or "
                "keep it in quantization_config.ignore"))
        else:
            plan.fail("config", "bits" if error.startswith("Unsupported") else "asym bits", error)
        return plan
    shape = per_rank_shape(layer, tp, plan)
    if shape is None:
        return plan
    k, n, k_p, n_p = shape
    plan.k, plan.n = k_p, n_p
    c = KernelConfig(k=k, n=n, k_p=k_p, n_p=n_p, weight_type=weight_type(s), bits=s.num_bits, act_type=dtype,
                     group_size=s.group_size, zero_points=not s.symmetric,
                     has_g_idx=linear_has_g_idx(s))
    # -- create_weights: choose_mp_linear_kernel ------------------------------------------------
    if switches.flag("VLLM_BATCH_INVARIANT", engine):
        plan.kernel = BATCH_INVARIANT  # no kernel is chosen: the checkpoint layout is kept and dequantized
    if not choose_kernel(plan, rel, c, switches):
        return plan
    # -- create_weights: scale sharding ---------------------------------------------------------
    row_parallel = k_p != k
    g_idx = c.has_g_idx and rel.has("linear.g_idx_kernels")
    repeat = g_idx or (s.group_size == -1 and row_parallel)
    gs = s.group_size if s.group_size != -1 else k
    if not repeat and k_p % gs:
        plan.fail("create_weights", "K/rank % group", _straddle_text(k_p, gs, layer.name))
        return plan
    kernel_hazards(plan, g_idx, s.group_size)
    if not s.symmetric and layer.tp_role == COLUMN and any((size // tp) * s.num_bits % 32
                                                            for size in layer.output_sizes if size):
        plan.hazards.append(
            f"zero points are packed along N ({s.num_bits}-bit codes in int32 words): an output shard whose per-rank "
            "size does not fill whole words starts inside a packed word when the fused layer is loaded")
    return plan


def kernel_hazards(plan: LinearPlan, g_idx: bool, group_size: int) -> None:
    """What the chosen kernel does to a layer that loads: Humming's unplanned limits, Marlin's tile padding."""
    if plan.kernel == HUMMING:
        plan.hazards.append(
            "runs on Humming, whose can_implement in vLLM accepts any 16-bit-activation layer; shape limits of the "
            "humming package itself (converted at load) are not in vLLM's sources and are not planned")
    # -- process_weights_after_loading ------------------------------------------------------------
    n_p, k_p = plan.n or 0, plan.k or 0
    if plan.kernel == MARLIN and not g_idx:
        padded = _padded_nk(n_p, k_p, group_size)
        if padded != (n_p, k_p):
            plan.padded_nk = padded
            plan.hazards.append(
                f"Marlin pads this layer's per-rank (N, K) from ({n_p}, {k_p}) to {padded} (thread tiles): activations "
                "and outputs are padded and sliced on every forward, and vLLM warns that performance may be degraded")


# what inspect names as the kernel of AWQ's own GEMM method (it chooses no kernel class)
AWQ_GEMM = "AWQ GEMM (awq_gemm / awq_dequantize)"


def plan_format_linear(layer: LinearLayer, tp: int, rel: rules.Release, plan: LinearPlan, dtype: str,
                       switches: EngineSwitches) -> LinearPlan:
    """A GPTQ/AWQ/auto-round linear layer: the format's config (methods.parse_config), the layer
    class's asserts, the method its get_quant_method builds (methods.linear_method), whether the
    checkpoint's tensors fit it, then its create_weights: AWQ's own alignment checks, or the kernel
    choice and the scale rows, which these methods floor (K per rank // group) where a group
    straddles two ranks instead of refusing as compressed-tensors does."""
    raw, qm = layer.quant_raw or {}, str(layer.quant_method)
    cfg, refused = methods.parse_config(qm, raw, rel)
    if refused is not None:
        plan.fail("config", *refused)
        return plan
    shape = per_rank_shape(layer, tp, plan)
    if shape is None:
        return plan
    k, n, k_p, n_p = shape
    plan.k, plan.n = k_p, n_p
    m = methods.linear_method(qm, cfg, raw, rel, layer.name, layer.kind == "lm_head", layer.inner_modules,
                              rules.GPUS[plan.gpu], k, k_p, switches.flag("VLLM_BATCH_INVARIANT", plan.vllm))
    plan.method = m.vllm_class
    if m.error is not None:
        plan.fail(*m.error)
        return plan
    if not _format_tensors_fit(layer, m, plan):
        return plan
    if not m.quantized:
        return plan
    if m.vllm_class == methods.base.AWQ_LINEAR:
        error = methods.awq_gemm_error(m.group_size, k, k_p, n_p)
        if error is not None:
            plan.fail("create_weights", "AWQ alignment", error)
        else:
            plan.kernel = AWQ_GEMM
        return plan
    wt = f"uint{m.bits}" if m.zero_points else f"uint{m.bits}b{2 ** (m.bits - 1)}"
    c = KernelConfig(k=k, n=n, k_p=k_p, n_p=n_p, weight_type=wt, bits=m.bits, act_type=dtype, group_size=m.group_size,
                     zero_points=m.zero_points, has_g_idx=m.desc_act)
    if not choose_kernel(plan, rel, c, switches):
        return plan
    g_idx = m.desc_act and rel.has("linear.g_idx_kernels")
    # marlin_repeat_scales_on_all_ranks (GPTQ): every rank keeps all scale rows with act-order, or
    # channel-wise on a row-parallel layer; otherwise the rows are K per rank // group, floored
    repeat = m.vllm_class == methods.base.GPTQ_LINEAR and (g_idx or (m.group_size == -1 and k_p != k))
    gs = m.group_size if m.group_size != -1 else k
    if not repeat and k_p % gs:
        plan.fail("load", "wrong scale groups", (
            f"{layer.name}: vLLM {plan.vllm} builds it with {m.vllm_class} on {plan.kernel} although its input size per "
            f"partition {k_p} is not a whole number of groups of {gs}: create_weights makes {k_p // gs} scale row(s) "
            "per rank and the weight loader slices the checkpoint's rows by that count, so the layer loads without "
            "error and computes with the wrong scale groups (outputs are wrong); use a TP size that divides the "
            "groups, or pad the checkpoint"))
        return plan
    kernel_hazards(plan, g_idx, m.group_size)
    return plan


def _format_tensors_fit(layer: LinearLayer, m: methods.LinearMethod, plan: LinearPlan) -> bool:
    """Whether the checkpoint's tensors of the layer have parameters to load into: packed shards
    for a quantized method of the same bits and group size, plain weights for an unquantized one."""
    packed = [sh for sh in layer.shards if sh.stored_packed]
    plain = [sh.module for sh in layer.shards if not sh.stored_packed]
    if not m.quantized and packed:
        plan.fail("load", "built unquantized", (
            f"{layer.name}: vLLM {plan.vllm} builds it with {m.vllm_class} ({m.why_unquantized}), so the checkpoint's "
            f"qweight/scales tensors have no parameter to load into (There is no module or parameter named "
            f"'{packed[0].module}.qweight')"))
        return False
    if m.quantized and plain:
        plan.fail("load", "built quantized", (
            f"{layer.name}: vLLM {plan.vllm} builds it with {m.vllm_class}, but the checkpoint stores {plain[0]} "
            f"unquantized: its weight has no parameter to load into (There is no module or parameter named "
            f"'{plain[0]}.weight')"))
        return False
    for sh in packed if m.quantized else ():
        if sh.scheme is not None and (sh.scheme.num_bits, sh.scheme.group_size) != (m.bits, m.group_size):
            plan.fail("load", "scheme differs", (
                f"{layer.name}: vLLM {plan.vllm} builds it with {m.bits}-bit codes, group {m.group_size} (the config "
                f"as it applies to the layer's own name), but the checkpoint stores {sh.module} with "
                f"{sh.scheme.num_bits}-bit codes, group {sh.scheme.group_size}: the tensors do not fit"))
            return False
    return True


def linear_outcome(p: LinearPlan) -> str:
    if p.loadable and p.kernel is None:
        return f"loads unquantized ({p.method})"
    if p.loadable:
        return f"loads on {p.kernel}" + (f" (Marlin tile padding to (N, K) = {p.padded_nk})" if p.padded_nk else "")
    return f"fails ({p.failure_stage}): {p.errors[0].splitlines()[0]}"


def linear_release_differences(layer: LinearLayer, tp: int, engine: str, gpu: str, dtype: str,
                               switches: EngineSwitches = DEFAULT_SWITCHES) -> list[str]:
    mine = linear_outcome(plan_linear(layer, tp, engine, gpu, dtype, switches))
    groups: dict[str, list[str]] = {}
    for v in rules.RELEASES:
        if v != engine:
            out = linear_outcome(plan_linear(layer, tp, v, gpu, dtype, switches))
            if out != mine:
                groups.setdefault(out, []).append(v)
    return [f"vLLM {rules.span(vs)}: {out}" for out, vs in groups.items()]


# -- model-level checks: the engine stops before any weight ---------------------------------------
@dataclass(frozen=True)
class ModelCheck:
    tp: int
    rule: str
    ok: bool
    detail: str
    error: str | None = None  # the engine's text when it refuses
    stage: str = "config"  # "config" (engine arguments) or "model" (model construction)
    fatal: bool = True  # False: a fact reported beside the verdict (e.g. EPLB only)

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "rule": self.rule, "ok": self.ok, "detail": self.detail, "error": self.error,
                "stage": self.stage, "fatal": self.fatal}


_EXPERTS_GT_TP = model_types(experts_at_least_tp=True)


def model_checks(dims: ModelDims, tp: int, ep: bool, engine: str = rules.NEWEST,
                 attention: bool = True) -> list[ModelCheck]:
    """The checks vLLM makes on the model's sizes for `tp` ranks before it loads a weight."""
    rules.release(engine)  # the texts below are the same in every release this rulebook plans
    out: list[ModelCheck] = []
    h = dims.num_attention_heads
    if h:
        ok = h % tp == 0
        out.append(ModelCheck(tp, "attention heads % TP", ok, f"{h} % {tp}", None if ok else (
            f"Total number of attention heads ({h}) must be divisible by tensor parallel size ({tp}).")))
    kv = dims.num_key_value_heads
    if attention and kv and not dims.mla:
        a, b = (tp, kv) if tp >= kv else (kv, tp)
        ok = a % b == 0
        how = "replicated" if tp >= kv else "sharded"
        out.append(ModelCheck(tp, "KV heads", ok, f"{kv} KV heads {how} over {tp} ranks ({a} % {b})",
                              None if ok else f"AssertionError: {a} is not divisible by {b}", stage="model"))
    if dims.vocab_size:
        padded = -(-dims.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        ok = padded % tp == 0
        out.append(ModelCheck(tp, "vocabulary % TP", ok, f"vocab {dims.vocab_size} padded to {padded}, % {tp}",
                              None if ok else f"AssertionError: {padded} is not divisible by {tp}", stage="model"))
    if dims.linear_num_value_heads:
        v = dims.linear_num_value_heads
        ok = v % tp == 0
        out.append(ModelCheck(tp, "linear-attention value heads % TP", ok, f"{v} % {tp}",
                              None if ok else f"AssertionError: {v} is not divisible by {tp}", stage="model"))
    E = dims.num_experts
    if E and (dims.model_type in _EXPERTS_GT_TP or dims.text_model_type in _EXPERTS_GT_TP):
        ok = tp <= E
        out.append(ModelCheck(tp, "TP <= experts", ok, f"{tp} <= {E}", None if ok else (
            f"Tensor parallel size {tp} is greater than the number of experts {E}."), stage="model"))
    if E and ep and tp > 1:
        ok = E % tp == 0
        out.append(ModelCheck(tp, "experts % EP (EPLB)", ok, f"{E} % {tp}", None if ok else (
            f"EPLB currently only supports even distribution of experts across ranks. Got {E} experts and {tp} EP "
            "ranks. (only with --enable-eplb; without it vLLM places the experts unevenly)"), stage="model",
            fatal=False))
    return out
