"""vLLM's GPTQ method (`auto_gptq.py`: `AutoGPTQConfig`, `AutoGPTQMoEMethod`; GPTQModel's
`dynamic` rules in `utils/gptq_utils.py`), for a checkpoint whose quant_method is gptq.

Every known release maps quant_method gptq to `AutoGPTQConfig` (there is no separate exllama
GPTQ method any more): it takes symmetric 4- and 8-bit codes only, and its routed-experts layers
get the Marlin MoE method when the shared Marlin gate takes them, else `MoeWNA16`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from wna16ctl.planning import rules
from wna16ctl.planning.methods.base import (GPTQ_LAYOUT, GPTQ_LINEAR, UNQUANTIZED_EMBEDDING, UNQUANTIZED_LINEAR,
                                             LinearMethod, MoEMethod, OracleArgs, get_from_keys, marlin_type_error,
                                             mixed_shards_error, shard_prefixes)

QUANT_METHOD = "gptq"
_TYPES = {(4, True), (8, True)}  # AutoGPTQConfig.TYPE_MAP: (bits, sym)
_DESC_ACT_REFUSED = ("GPTQ group activation ordering (desc_act=True) is no longer supported. Use a checkpoint with "
                     "static activation ordering or desc_act=False.")


@dataclass
class GptqConfig:
    """`AutoGPTQConfig` as `from_config` builds it."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    dynamic: dict[str, Any] = field(default_factory=dict)
    lm_head: bool = False

    def type_error(self) -> str | None:
        if (self.bits, self.sym) not in _TYPES:
            return f"Unsupported quantization config: bits={self.bits}, sym={self.sym}"
        return None


def parse(raw: Mapping[str, Any], rel: rules.Release) -> tuple[GptqConfig | None, tuple[str, str] | None]:
    """(config, None), or (None, (rule, error)) where `AutoGPTQConfig.from_config` raises."""
    try:
        dynamic = raw.get("dynamic") or {}
        cfg = GptqConfig(get_from_keys(raw, ["bits"]), get_from_keys(raw, ["group_size"]),
                         get_from_keys(raw, ["desc_act"]), get_from_keys(raw, ["sym"]), dict(dynamic),
                         bool(raw.get("lm_head", False)))
    except KeyError as exc:
        return None, ("missing key", str(exc.args[0]))
    base_desc_act = cfg.desc_act
    if cfg.desc_act and cfg.group_size == -1:
        cfg.desc_act = False  # one group per output channel: act-order is a no-op
    if rel.has("gptq.desc_act_refused"):
        refused = _desc_act_refusal(cfg, base_desc_act)
        if refused is not None:
            return None, ("desc_act refused", refused)
    error = cfg.type_error()
    if error is not None:
        return None, ("bits/sym", error)
    return cfg, None


def _desc_act_refusal(cfg: GptqConfig, base_desc_act: bool) -> str | None:
    """normalize_and_validate_gptq_desc_act's refusal (None: it passes)."""
    if cfg.desc_act:
        return _DESC_ACT_REFUSED
    for pattern, overrides in cfg.dynamic.items():
        if pattern.startswith("-:") or not isinstance(overrides, Mapping):
            continue
        if overrides.get("desc_act", base_desc_act) and overrides.get("group_size", cfg.group_size) != -1:
            return ("GPTQ group activation ordering (desc_act=True) is no longer supported, but is enabled by dynamic "
                    f"rule {pattern!r}. Use a checkpoint with static activation ordering or desc_act=False.")
    return None


def dynamic_override(cfg: GptqConfig, prefix: str) -> dict[str, Any] | bool | None:
    """get_dynamic_override: False for a negative rule matching `prefix` (the module is not
    quantized), the first positive rule's overrides, or None."""
    for pattern, overrides in cfg.dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern.removeprefix("-:"), prefix):
                return False
        elif re.match(pattern.removeprefix("+:"), prefix):
            return overrides if isinstance(overrides, dict) else {}
    return None


def overridden(cfg: GptqConfig, prefix: str) -> GptqConfig:
    """override_config: the module's bits, group size, desc_act and sym after its dynamic rule."""
    found = dynamic_override(cfg, prefix)
    rule = found if isinstance(found, dict) else {}
    out = replace(cfg)
    if isinstance(rule.get("bits"), int):
        out.bits = rule["bits"]
    if isinstance(rule.get("group_size"), int):
        out.group_size = rule["group_size"]
    if isinstance(rule.get("desc_act"), bool):
        out.desc_act = rule["desc_act"]
    if out.desc_act and out.group_size == -1:
        out.desc_act = False
    if isinstance(rule.get("sym"), bool):
        out.sym = rule["sym"]
    return out


def gate(cfg: GptqConfig) -> tuple[int, bool]:
    """The group size and tile-padding switch get_quant_method gives the Marlin gate (the base
    config's, before any dynamic rule)."""
    return cfg.group_size, not cfg.desc_act


def native(cfg: GptqConfig, prefix: str) -> MoEMethod:
    """get_moe_quant_method: the layer's method where the Marlin gate took it."""
    if dynamic_override(cfg, prefix) is False:
        return MoEMethod("UnquantizedFusedMoEMethod", "unquantized", error=(
            "load", "unquantized method", f"a negative dynamic rule matches {prefix}: vLLM builds "
            "UnquantizedFusedMoEMethod and the checkpoint's packed expert tensors have no parameter to load into"))
    own = overridden(cfg, prefix)
    method = MoEMethod("AutoGPTQMoEMethod", "gptq_marlin")
    error = own.type_error()
    if error is not None:
        method.error = ("method", "bits/sym", error)
        return method
    method.oracle = OracleArgs(own.bits, False, not own.sym, True, GPTQ_LAYOUT, own.group_size, own.desc_act,
                               not own.desc_act)
    return method


def w2_sharding(cfg: GptqConfig, prefix: str, rel: rules.Release, i_p: int, i: int) -> tuple[bool, int, bool]:
    """create_weights' w2 scales: (load_full_w2, rows' extent, is_k_full).  Releases that load
    act-order keep every group of the w2 scales on every rank."""
    own = overridden(cfg, prefix)
    gs = own.group_size
    if not rel.has("gptq.desc_act_refused") and own.desc_act and gs != -1:
        return True, i // gs * gs, i_p == i
    # the scale rows are size // group_size, floored
    return False, i_p // gs * gs if gs > 0 else i_p, True


def floored_groups(cfg: GptqConfig, prefix: str, hidden: int, i_p: int) -> str | None:
    """The correctness hazard of scale rows that create_weights floors: a dynamic rule's group
    size that does not divide the sizes the Marlin gate checked with the base group size."""
    gs = overridden(cfg, prefix).group_size
    if gs > 0 and (i_p % gs or hidden % gs):
        return (f"the layer's group size {gs} (its dynamic rule) does not divide the intermediate size per partition "
                f"{i_p} or hidden_size {hidden}; vLLM's Marlin gate checked the base group size {cfg.group_size}, and "
                "create_weights floors the scale rows: the layer loads and computes with the wrong scale groups")
    return None



def _flatten(items: Any) -> list[str]:
    out: list[str] = []
    for item in items or ():
        out += _flatten(item) if isinstance(item, list) else [str(item)]
    return out


def linear_method(cfg: GptqConfig, raw: Mapping[str, Any], prefix: str, is_head: bool,
                  inner: Mapping[str, bool], cc: int) -> LinearMethod:
    """get_linear_quant_method for the linear layer (or the output projection) `prefix`: its module
    list (`modules_in_block_to_quantize`, else what maybe_update_config reads from the checkpoint:
    every module with integer tensors; matched as substrings, per shard of a fused layer), the
    dynamic rules on the layer's own (fused) name, then AutoGPTQLinearMethod's constructor."""
    if is_head and not cfg.lm_head:
        return LinearMethod(UNQUANTIZED_EMBEDDING, why_unquantized="quantization_config.lm_head is not true")
    listed = _flatten(raw.get("modules_in_block_to_quantize")) or [m for m, integer in inner.items() if integer]
    shards = shard_prefixes(prefix)
    found = {any(m in s for m in listed) for s in (shards or [prefix])} if listed else {True}
    if len(found) > 1:
        return LinearMethod(GPTQ_LINEAR, error=("create_weights", "mixed shards", mixed_shards_error(prefix)))
    unquantized = UNQUANTIZED_EMBEDDING if is_head else UNQUANTIZED_LINEAR
    if dynamic_override(cfg, prefix) is False:
        return LinearMethod(unquantized, why_unquantized=f"a negative dynamic rule matches {prefix}")
    if found == {False}:
        return LinearMethod(unquantized, why_unquantized=(
            "modules_in_block_to_quantize does not name it" if raw.get("modules_in_block_to_quantize")
            else "the checkpoint stores no integer tensor for it"))
    own = overridden(cfg, prefix)
    out = LinearMethod(GPTQ_LINEAR, own.bits, own.group_size, False, own.desc_act)
    error = own.type_error() or marlin_type_error(cc, own.bits, False, own.group_size)
    if error is not None:
        out.error = ("create_weights", "bits/sym" if error.startswith("Unsupported") else "marlin type", error)
    return out
