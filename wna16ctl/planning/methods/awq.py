"""vLLM's AWQ method (`auto_awq.py`: `AutoAWQConfig`, `AutoAWQMoEMethod`), for a checkpoint whose
quant_method is awq, on a CUDA GPU.

AutoAWQConfig takes 4-bit codes only; modules named (as a substring) in modules_to_not_convert
stay unquantized; its routed-experts layers get the AWQ Marlin MoE method when the shared Marlin
gate takes them, else `MoeWNA16`.  The AWQ MoE method claims zero points by `zero_point` and
expert bias always, and the oracle refuses the AutoAWQ layout for Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from wna16ctl.planning.methods.base import AWQ_LAYOUT, MoEMethod, OracleArgs, get_from_keys

QUANT_METHOD = "awq"


@dataclass
class AwqConfig:
    """`AutoAWQConfig` as `from_config` builds it."""

    bits: int
    group_size: int
    zero_point: bool
    modules_to_not_convert: tuple[str, ...]


def parse(raw: Mapping[str, Any]) -> tuple[AwqConfig | None, tuple[str, str] | None]:
    """(config, None), or (None, (rule, error)) where `AutoAWQConfig.from_config` raises."""
    try:
        cfg = AwqConfig(get_from_keys(raw, ["w_bit", "bits"]), get_from_keys(raw, ["q_group_size", "group_size"]),
                        get_from_keys(raw, ["zero_point"]), tuple(raw.get("modules_to_not_convert") or ()))
    except KeyError as exc:
        return None, ("missing key", str(exc.args[0]))
    if cfg.bits != 4:
        return None, ("bits", bits_error(cfg.bits))
    return cfg, None


def bits_error(bits: int) -> str:
    """AutoAWQConfig's refusal of a bit width other than 4 (its TYPE_MAP)."""
    return (f"Unsupported num_bits = {bits}. Supported: 4. For 8-bit AWQ, use Marlin backend by setting "
            "backend='awq:marlin' or backend='marlin'.")


def skipped(modules: tuple[str, ...], prefix: str) -> bool:
    """is_layer_skipped with match_mode substring: a listed name inside the module's path."""
    return any(m in prefix for m in modules)


def gate(cfg: AwqConfig) -> tuple[int, bool]:
    return cfg.group_size, True


def native(cfg: AwqConfig, prefix: str) -> MoEMethod:
    if skipped(cfg.modules_to_not_convert, prefix):
        return MoEMethod("UnquantizedFusedMoEMethod", "unquantized", error=(
            "load", "unquantized method", f"modules_to_not_convert names {prefix}: vLLM builds "
            "UnquantizedFusedMoEMethod and the checkpoint's packed expert tensors have no parameter to load into"))
    method = MoEMethod("AutoAWQMoEMethod", "awq_marlin")
    method.oracle = OracleArgs(4, False, bool(cfg.zero_point), True, AWQ_LAYOUT, cfg.group_size, False, True)
    return method


def create_weights_error(cfg: AwqConfig, experts: int, hidden: int, i_p: int) -> str | None:
    """The AWQ MoE method sizes its scales H // group_size: a channel-wise (-1) config asks for a
    tensor of negative size."""
    if cfg.group_size == -1:
        return f"Trying to create tensor with negative dimension {-hidden}: [{experts}, {-hidden}, {2 * i_p}]"
    return None
