"""What a format's vLLM MoE method hands the shared planner: the method it builds, the arguments
its constructor gives the backend oracle, and the errors and hazards of its own steps.

vLLM's GPTQ and AWQ configs (`AutoGPTQConfig`, `AutoAWQConfig`) pick a routed-experts layer's
method in `get_quant_method`: their Marlin MoE method when the shared Marlin gate
(`check_moe_marlin_supports_layer`) takes the layer, else the `MoeWNA16` Triton-layout method.
Each method then asks the same oracle (`select_wna16_moe_backend`), with its own weight key and
its own claims (zero points, expert bias, the checkpoint layout, tile padding).  The planner
(`moe.py`) runs the gate and the oracle; the format modules here say what their methods ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# the layouts the oracle tells apart by the class of the quantization config it is given
GPTQ_LAYOUT, AWQ_LAYOUT, MOE_WNA16_LAYOUT = "AutoGPTQConfig", "AutoAWQConfig", "MoeWNA16Config"


@dataclass(frozen=True)
class OracleArgs:
    """What a method constructor passes `select_wna16_moe_backend`."""

    bits: int
    group32: bool  # the int4 group-32 scale descriptor (MoeWNA16 only; GPTQ/AWQ use the generic one)
    may_have_zp: bool
    may_have_bias: bool
    layout: str  # the config class: GPTQ_LAYOUT, AWQ_LAYOUT or MOE_WNA16_LAYOUT
    group_size: int  # the config's group size (the oracle's Marlin gate reads it)
    desc_act: bool  # GPTQ act-order, as the config holds it
    allow_tile_padding: bool


@dataclass
class MoEMethod:
    """The MoE method a format's config builds for one layer, and what its steps found."""

    vllm_class: str  # AutoGPTQMoEMethod, AutoAWQMoEMethod, MoeWNA16Method, UnquantizedFusedMoEMethod
    label: str  # the short name inspect prints: gptq_marlin, awq_marlin, moe_wna16, unquantized
    oracle: OracleArgs | None = None
    error: tuple[str, str, str] | None = None  # (stage, rule, the engine's message)
    hazards: list[str] = field(default_factory=list)
    fallback_reason: str | None = None  # why the Marlin gate sent the layer to MoeWNA16

    def to_json(self) -> dict[str, Any]:
        return {"class": self.vllm_class, "name": self.label, "fallback_reason": self.fallback_reason}


def missing_key_error(keys: list[str]) -> str:
    """`QuantizationConfig.get_from_keys`' error for a required key."""
    return f"Cannot find any of {keys} in the model's quantization config."


def get_from_keys(raw: Mapping[str, Any], keys: list[str]) -> Any:
    """The first of `keys` present in `raw` (KeyError with vLLM's message when none is)."""
    for k in keys:
        if k in raw:
            return raw[k]
    raise KeyError(missing_key_error(keys))
