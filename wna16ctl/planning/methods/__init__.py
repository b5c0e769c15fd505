"""vLLM's quantization method of each checkpoint format: the steps that differ per format.

One module per format (`compressed_tensors`, `gptq`, `awq`, `auto_round`, and `moe_wna16`, the method GPTQ,
AWQ and AutoRound fall back to): config parsing as the format's vLLM `from_config` does it, the method the
config builds for a routed-experts layer, its constructor's checks and what it asks the backend
oracle, and its create_weights.  The oracle itself, keyed by the weight scheme, is shared by every
format (`moe.py`), as vLLM shares it.  These modules are the only planner files that name formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from wna16ctl.planning import rules
from wna16ctl.planning.methods import auto_round, awq, gptq, moe_wna16
from wna16ctl.planning.methods.base import LinearMethod, MoEMethod, OracleArgs
from wna16ctl.planning.methods.compressed_tensors import LINEAR_PARAMS, linear_stored_form_known, moe_format_refusal

__all__ = ["LINEAR_PARAMS", "linear_stored_form_known", "moe_format_refusal", "MoEMethod", "OracleArgs",
           "FORMAT_METHODS", "uses_format_method", "parse_config", "moe_method", "create_weights", "CreateWeights",
           "LinearMethod", "linear_method", "awq_gemm_error"]

# the quant_methods whose vLLM config is not compressed-tensors' (QuantConfig.quant_method values)
FORMAT_METHODS = (gptq.QUANT_METHOD, awq.QUANT_METHOD, auto_round.QUANT_METHOD)
# the Marlin gate (check_moe_marlin_supports_layer): group size, tile padding -> why it refuses, or None
Gate = Callable[[int, bool], "str | None"]


def uses_format_method(quant_method: str | None) -> bool:
    """Whether a layer of this quant_method is planned through a format method here (else the
    compressed-tensors steps of `moe.py`)."""
    return quant_method in FORMAT_METHODS


def parse_config(quant_method: str, raw: Mapping[str, Any], rel: rules.Release) -> tuple[Any, tuple[str, str] | None]:
    """The format's vLLM config from the raw quantization_config: (config, None) or (None, (rule, error))."""
    if quant_method == gptq.QUANT_METHOD:
        return gptq.parse(raw, rel)
    if quant_method == auto_round.QUANT_METHOD:
        return auto_round.parse(raw, rel)
    return awq.parse(raw)


def moe_method(quant_method: str, cfg: Any, raw: Mapping[str, Any], rel: rules.Release, prefix: str, cc: int,
               gate: Gate) -> MoEMethod:
    """get_quant_method for a routed-experts layer: the format's Marlin MoE method where the gate
    takes the layer, else MoeWNA16 (with the reason the gate gave)."""
    if quant_method == auto_round.QUANT_METHOD:
        return auto_round.moe_method(cfg, rel, prefix, cc, gate)
    fmt = gptq if quant_method == gptq.QUANT_METHOD else awq
    reason = gate(*fmt.gate(cfg))
    if reason is None:
        return fmt.native(cfg, prefix)
    out = moe_wna16.method(raw, rel, prefix, cc, reason)
    if out.error is None:
        hazard = moe_wna16.dropped_act_order(raw, rel) if fmt is gptq else None
        if hazard is not None:
            out.error = ("load", "act-order dropped", hazard)
        elif fmt is gptq:
            own = gptq.overridden(cfg, prefix)
            hazard = moe_wna16.dropped_dynamic(raw, own.bits, own.group_size)
            if hazard is not None:
                out.error = ("load", "dynamic dropped", hazard)
    return out


@dataclass
class CreateWeights:
    """What the method's create_weights makes of the layer: the w2 scale sharding
    (load_full_w2, rows' extent, is_k_full), or the error it raises."""

    w2: tuple[bool, int, bool] | None
    error: str | None = None
    group_size: int | None = None  # MoeWNA16's settled group size (it halves the config's to fit)
    hazard: str | None = None  # it builds, but the layer would compute wrong (the planner refuses it)


def create_weights(quant_method: str, cfg: Any, method: MoEMethod, raw: Mapping[str, Any], rel: rules.Release,
                   prefix: str, experts: int, hidden: int, i: int, i_p: int) -> CreateWeights:
    if quant_method == auto_round.QUANT_METHOD:
        # the GPTQ or AWQ config INC built for this layer (the method exists: its config resolved)
        lc = auto_round.layer_config(cfg, prefix)
        assert lc is not None
        quant_method, cfg, raw = auto_round.inner(lc)
    if method.vllm_class == "MoeWNA16Method":
        g, error = moe_wna16.create_weights(raw["group_size"], experts, hidden, i_p)
        return CreateWeights(None if error else (False, i_p, True), error, g)
    if quant_method == gptq.QUANT_METHOD:
        return CreateWeights(gptq.w2_sharding(cfg, prefix, rel, i_p, i),
                             hazard=gptq.floored_groups(cfg, prefix, hidden, i_p))
    error = awq.create_weights_error(cfg, experts, hidden, i_p)
    return CreateWeights(None if error else (False, i_p, True), error)


def linear_method(quant_method: str, cfg: Any, raw: Mapping[str, Any], rel: rules.Release, prefix: str, is_head: bool,
                  inner: Mapping[str, bool], cc: int, k: int, k_p: int, batch_invariant: bool) -> LinearMethod:
    """get_quant_method for a linear layer (or, `is_head`, the output projection) of K `k` (per rank
    `k_p`): the method the format's config builds, with its constructor's errors."""
    if quant_method == gptq.QUANT_METHOD:
        return gptq.linear_method(cfg, raw, prefix, is_head, inner, cc)
    if quant_method == auto_round.QUANT_METHOD:
        return auto_round.linear_method(cfg, rel, prefix, is_head, cc)
    return awq.linear_method(cfg, rel, prefix, is_head, inner, cc, k, k_p, batch_invariant)


awq_gemm_error = awq.gemm_error
