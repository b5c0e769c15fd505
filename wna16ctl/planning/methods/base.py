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


# the fused linear layers of the models planned here and the checkpoint modules each one loads
# (the model class's packed_modules_mapping, which the quantization config is given)
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # MARLIN_SUPPORTED_GROUP_SIZES
MARLIN_MIN_CAPABILITY = 75  # query_marlin_supported_quant_types: no type below it

# the linear methods of these formats
GPTQ_LINEAR, AWQ_MARLIN_LINEAR, AWQ_LINEAR = "AutoGPTQLinearMethod", "AutoAWQMarlinLinearMethod", "AutoAWQLinearMethod"
UNQUANTIZED_LINEAR, UNQUANTIZED_EMBEDDING = "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"


@dataclass
class LinearMethod:
    """The linear method a format's config builds for one layer (get_quant_method), and what its
    constructor makes of it.  A quantized method either chooses a kernel (`choose_mp_linear_kernel`
    with the weight type below; the scale rows are then K per rank // group, floored) or, for
    AutoAWQLinearMethod, runs AWQ's own GEMM after its create_weights' alignment checks."""

    vllm_class: str
    bits: int = 0
    group_size: int = -1
    zero_points: bool = False
    desc_act: bool = False  # act-order as the method's config holds it (0.27-0.29 build g_idx)
    why_unquantized: str | None = None  # the rule that left the layer unquantized
    error: tuple[str, str, str] | None = None  # (stage, rule, the engine's message)

    @property
    def quantized(self) -> bool:
        return self.vllm_class not in (UNQUANTIZED_LINEAR, UNQUANTIZED_EMBEDDING)

    @property
    def chooses_kernel(self) -> bool:
        return self.vllm_class in (GPTQ_LINEAR, AWQ_MARLIN_LINEAR)


def shard_prefixes(prefix: str) -> list[str] | None:
    """The checkpoint modules a fused layer `prefix` loads (None: not fused), as vLLM derives them."""
    leaf = prefix.rpartition(".")[2]
    parts = PACKED_MODULES.get(leaf)
    return None if parts is None else [prefix.replace(leaf, p) for p in parts]


def mixed_shards_error(prefix: str) -> str:
    """is_layer_skipped / is_layer_gptq_quantized: the shards of a fused layer disagree."""
    return (f"Detected some but not all shards of {prefix} are quantized. All shards of fused layers to have the "
            "same precision.")


def marlin_type_error(cc: int, bits: int, zero_points: bool, group_size: int) -> str | None:
    """verify_marlin_supported for a GPTQ (uint4b8/uint8b128) or AWQ (uint4, zero points) type on a
    GPU of capability `cc` (None: supported)."""
    if cc < MARLIN_MIN_CAPABILITY:
        kind = f"uint{bits}" if zero_points else f"uint{bits}b{2 ** (bits - 1)}"
        return (f"Marlin does not support weight_bits = {kind}. Only types = [] are supported (for group_size = "
                f"{group_size}, device_capability = {cc}, zp = {zero_points}).")
    if group_size not in MARLIN_GROUP_SIZES:
        return (f"Marlin does not support group_size = {group_size}. Only group_sizes = {list(MARLIN_GROUP_SIZES)} "
                "are supported.")
    return None


def marlin_type_supported(cc: int, bits: int, zero_points: bool) -> bool:
    """check_marlin_supported's type test: uint4 with zero points, uint4b8/uint8b128 without."""
    return cc >= MARLIN_MIN_CAPABILITY and (bits == 4 if zero_points else bits in (4, 8))
