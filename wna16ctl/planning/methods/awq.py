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

from wna16ctl.planning import rules
from wna16ctl.planning.methods.base import (AWQ_LAYOUT, AWQ_LINEAR, AWQ_MARLIN_LINEAR, UNQUANTIZED_EMBEDDING,
                                             UNQUANTIZED_LINEAR, LinearMethod, MoEMethod, OracleArgs, get_from_keys,
                                             marlin_type_supported, mixed_shards_error, shard_prefixes)

QUANT_METHOD = "awq"


@dataclass
class AwqConfig:
    """`AutoAWQConfig` as `from_config` builds it."""

    bits: int
    group_size: int
    zero_point: bool
    modules_to_not_convert: tuple[str, ...]
    lm_head: bool = False


def parse(raw: Mapping[str, Any]) -> tuple[AwqConfig | None, tuple[str, str] | None]:
    """(config, None), or (None, (rule, error)) where `AutoAWQConfig.from_config` raises."""
    try:
        cfg = AwqConfig(get_from_keys(raw, ["w_bit", "bits"]), get_from_keys(raw, ["q_group_size", "group_size"]),
                        get_from_keys(raw, ["zero_point"]), tuple(raw.get("modules_to_not_convert") or ()),
                        bool(raw.get("lm_head", False)))
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


def _skipped_linear(skip: tuple[str, ...], prefix: str) -> bool | None:
    """is_layer_skipped(match_mode substring) with the fused layers' shards: None where the shards
    disagree (the engine raises)."""
    shards = shard_prefixes(prefix)
    if shards is None or skipped(skip, prefix):
        return skipped(skip, prefix)
    found = {skipped(skip, s) for s in shards}
    return None if len(found) > 1 else found.pop()


def linear_method(cfg: AwqConfig, rel: rules.Release, prefix: str, is_head: bool, inner: Mapping[str, bool], cc: int,
                  k: int, k_p: int, batch_invariant: bool) -> LinearMethod:
    """AutoAWQConfig.get_quant_method on CUDA for a linear layer (or the output projection) `prefix`
    with K `k` (per rank `k_p`): modules_to_not_convert (else, from maybe_update_config, every
    module of the checkpoint without integer tensors) matched as substrings, then the Marlin method
    where the type, group size and shard take it, else AWQ's own GEMM method."""
    if is_head and not cfg.lm_head:
        return LinearMethod(UNQUANTIZED_EMBEDDING, why_unquantized="quantization_config.lm_head is not true")
    listed = cfg.modules_to_not_convert
    skip = listed or tuple(m for m, integer in inner.items() if not integer)
    hit = _skipped_linear(skip, prefix)
    if hit is None:
        return LinearMethod(AWQ_LINEAR, error=("create_weights", "mixed shards", mixed_shards_error(prefix)))
    if hit:
        named = next(m for m in skip if m in prefix or any(m in s for s in shard_prefixes(prefix) or ()))
        return LinearMethod(UNQUANTIZED_LINEAR, why_unquantized=(
            f"modules_to_not_convert names {named!r}" if listed else
            f"modules_to_not_convert is empty, so vLLM fills it with the checkpoint's unquantized modules and "
            f"{named!r} is part of the name"))
    g = cfg.group_size
    # check_marlin_supported(uint4, group, zero_point): uint4 is a Marlin type with zero points only
    use_marlin = (not batch_invariant and bool(cfg.zero_point) and marlin_type_supported(cc, 4, True)
                  and g in (-1, 32, 64, 128))
    if use_marlin and is_head and not rel.has("linear.lm_head_output_size"):
        return LinearMethod(AWQ_MARLIN_LINEAR, error=("create_weights", "head shape",
                                                     "'ParallelLMHead' object has no attribute 'output_size'"))
    if use_marlin and (g == -1 or g >= k or k_p % g == 0):
        return LinearMethod(AWQ_MARLIN_LINEAR, 4, g, bool(cfg.zero_point))
    return LinearMethod(AWQ_LINEAR, 4, g, bool(cfg.zero_point))


def gemm_error(group_size: int, k: int, k_p: int, n_p: int) -> str | None:
    """AutoAWQLinearMethod.create_weights' alignment checks (None: it builds)."""
    if k_p % (group_size if group_size != -1 else k):
        return ("The input size is not aligned with the quantized weight shape. This can be caused by too large "
                "tensor parallel size.")
    if n_p % 8:
        return ("The output size is not aligned with the quantized weight shape. This can be caused by too large "
                "tensor parallel size.")
    return None
