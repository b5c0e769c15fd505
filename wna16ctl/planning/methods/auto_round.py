"""vLLM's AutoRound method (`inc/inc.py`: `INCConfig`, `inc/config_parser.py`: `INCConfigParser`,
`inc/schemes/inc_wna16_scheme.py`, and since 0.33 `inc/schemes/inc_wna16_moe.py`), for a checkpoint
whose quantization_config says quant_method "auto-round", on a CUDA GPU.

The engine hands such a file to `INCConfig` (its `override_quantization_method` takes the exact
string "auto-round"; "intel/auto-round" is not taken over and is an unknown method).  Each layer's
bits, group size and symmetry come from `extra_config` (exact name, a name's suffix, or a regex
key), else from the base config; `block_name_to_quantize` limits what is quantized.  A quantized
integer layer then goes, by `packing_format` and `backend` ("gptq" in either: the GPTQ path, else
"awq"), to the GPTQ or AWQ Marlin method where the Marlin gate takes it (symmetric 4/8-bit for
GPTQ; 4/8-bit for AWQ, whose config then refuses 8 bits), else to `MoeWNA16`, built from the
layer's own resolved config.  Since 0.30, 2/3/5/6/7-bit layers go to the Humming method instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from wna16ctl.planning import rules
from wna16ctl.planning.methods import awq, gptq, moe_wna16
from wna16ctl.planning.methods.base import (AWQ_LINEAR, AWQ_MARLIN_LINEAR, GPTQ_LINEAR, PACKED_MODULES,
                                             UNQUANTIZED_LINEAR, LinearMethod, MoEMethod, get_from_keys,
                                             marlin_type_supported)

QUANT_METHOD = "auto-round"
INT_FORMATS = ("auto_round:auto_gptq", "auto_round:auto_awq")
_FORMATS_OLD = {"auto_round:auto_gptq", "auto_round:auto_awq", "auto_round:llm_compressor"}
_FORMATS = _FORMATS_OLD | {"auto_round:fp8"}
_BACKENDS = {"auto", "gptq", "gptq:marlin", "awq", "awq:marlin", "marlin"}
_HUMMING_BITS = {2, 3, 5, 6, 7}  # no Marlin/GPTQ/AWQ CUDA kernel: Humming (inc.low_bits_humming)
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")
UNQUANTIZED_BITS = 16


@dataclass
class IncConfig:
    """`INCConfig` as `from_config` builds it (integer data types only: the planner's schemes)."""

    bits: int
    group_size: int
    sym: bool
    packing_format: str
    backend: str
    data_type: str
    block_names: list[str] | None
    extra_config: dict[str, Any] | None


@dataclass(frozen=True)
class LayerConfig:
    """`INCLayerConfig`: one module's resolved quantization."""

    bits: int
    group_size: int
    sym: bool
    is_gptq: bool

    @property
    def quantized(self) -> bool:
        return self.bits < UNQUANTIZED_BITS


def _supported_bits(rel: rules.Release) -> set[int]:
    return {2, 3, 4, 5, 6, 7, 8} if rel.has("inc.low_bits_humming") else {2, 3, 4, 8}


def parse(raw: Mapping[str, Any], rel: rules.Release) -> tuple[IncConfig | None, tuple[str, str] | None]:
    """(config, None), or (None, (rule, error)) where the engine refuses the file's config."""
    if raw.get("quant_method") != QUANT_METHOD:
        # only the exact "auto-round" is taken over by INCConfig; anything else is looked up by name
        return None, ("quant_method", f"Invalid quantization method: {raw.get('quant_method')}")
    new = rel.has("inc.int_format_checked")
    try:
        bits, group = get_from_keys(raw, ["bits"]), get_from_keys(raw, ["group_size"])
        sym = raw.get("sym", True) if new else get_from_keys(raw, ["sym"])
    except KeyError as exc:
        return None, ("missing key", str(exc.args[0]))
    data_type = str(raw.get("data_type", "int"))
    # a packing_format of null: the default since 0.29, an unknown format before
    packing = raw.get("packing_format") if new else raw.get("packing_format", INT_FORMATS[0])
    cfg = IncConfig(bits, group, bool(sym), str(packing or INT_FORMATS[0]) if new else str(packing),
                    _first(raw, ("backend", "vllm_backend"), "auto"), data_type,
                    _block_names(_first(raw, ("block_name_to_quantize", "to_quant_block_names"), None)),
                    _first(raw, ("extra_config",), None))
    error = _constructor_error(cfg, rel)
    return (None, error) if error is not None else (cfg, None)


def _first(raw: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """get_from_keys_or: the first key present, else the default."""
    for k in keys:
        if k in raw:
            return raw[k]
    return default


def _block_names(value: Any) -> list[str] | None:
    return value.split(",") if isinstance(value, str) else value


def _constructor_error(cfg: IncConfig, rel: rules.Release) -> tuple[str, str] | None:
    """INCConfig.__init__'s checks, in its order, for an integer config."""
    supported = _supported_bits(rel)
    if cfg.bits not in supported:
        return "bits", f"Unsupported weight_bits: {cfg.bits}, currently only support {supported}."
    if cfg.data_type != "int":
        return "data_type", (f"data_type {cfg.data_type!r} is not an integer weight-only scheme; wna16ctl plans "
                             "data_type 'int' only")
    formats = _FORMATS if rel.has("inc.int_format_checked") else _FORMATS_OLD
    if cfg.packing_format not in formats:
        return "packing_format", (f"Unsupported packing_format: {cfg.packing_format}, currently only support "
                                  f"{formats}.")
    if cfg.backend not in _BACKENDS:
        return "backend", f"Unsupported backend: {cfg.backend}, currently only support {_BACKENDS}."
    if cfg.packing_format in INT_FORMATS:
        return None
    if rel.has("inc.int_format_checked"):
        return "packing_format", ("AssertionError: INC int quantization only supports packing_format in "
                                  f"{sorted(INT_FORMATS)!r}, but found packing_format={cfg.packing_format!r}.")
    return "packing_format", f"packing_format={cfg.packing_format!r} requires an 'mx_fp' data_type."


def _pattern_hits(pattern: Any, name: str) -> bool:
    """A regex key of extra_config (one with a regex special character) that matches `name`."""
    if not isinstance(pattern, str) or not any(c in _REGEX_CHARS for c in pattern):
        return False
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _entry(cfg: IncConfig, name: str, quantized: bool) -> tuple[int, int, bool]:
    """get_config: (bits, group size, sym) of `name` from its extra_config entry, else the base."""
    base = (cfg.bits, cfg.group_size, cfg.sym) if quantized else (UNQUANTIZED_BITS, -1, True)
    extra = cfg.extra_config or {}
    found = extra.get(name) if name in extra else next(
        (e for p, e in extra.items() if _pattern_hits(p, name)), None)
    if not isinstance(found, Mapping):
        return base
    return found.get("bits", base[0]), found.get("group_size", base[1]), found.get("sym", base[2])


def resolve(cfg: IncConfig, prefix: str, is_head: bool = False,
            fused: Mapping[str, Any] | None = None) -> LayerConfig | str:
    """INCConfigParser.resolve for the module `prefix` (its class: not named FusedMoE in any known
    release, so per-expert entries never reach the experts layer): the layer config, or the error
    it raises for a fused module whose parts disagree."""
    extra = cfg.extra_config or {}
    is_gptq = "gptq" in cfg.packing_format or "gptq" in cfg.backend

    def made(t: tuple[int, int, bool]) -> LayerConfig:
        return LayerConfig(t[0], t[1], t[2], is_gptq)

    if prefix in extra:
        return made(_entry(cfg, prefix, True))
    for key in extra:
        if prefix.endswith(f".{key}"):
            return made(_entry(cfg, key, True))
    quantized = not is_head
    if cfg.block_names:
        quantized = any(prefix.startswith(n) for n in cfg.block_names)
    for fusion_key, parts in (fused or {}).items() if extra else ():
        if fusion_key in prefix and prefix.count(fusion_key) == 1:
            names = [prefix.replace(fusion_key, p) for p in parts]
            if not any(n in extra or any(_pattern_hits(k, n) for k in extra) for n in names):
                continue
            found = {_entry(cfg, n, quantized) for n in names}
            if len(found) == 1:
                return made(found.pop())
            return f"Fused module '{prefix}' requires consistent quant config for {names}"
    return made(_entry(cfg, prefix, quantized))


def skipped_by_name(cfg: IncConfig, prefix: str) -> bool:
    """get_quant_method's first check: an extra_config entry named exactly the module (or with
    "model." before it) whose bits are 16 or more."""
    for name, entry in (cfg.extra_config or {}).items():
        if name in (prefix, f"model.{prefix}") and isinstance(entry, Mapping) and \
                entry.get("bits", UNQUANTIZED_BITS) >= UNQUANTIZED_BITS:
            return True
    return False


def layer_config(cfg: IncConfig, prefix: str) -> LayerConfig | None:
    """The resolved config of a routed-experts layer, None where vLLM leaves it unquantized."""
    if skipped_by_name(cfg, prefix):
        return None
    lc = resolve(cfg, prefix)
    assert isinstance(lc, LayerConfig)  # the experts layer has no fused parts
    return lc if lc.quantized else None


def inner(lc: LayerConfig) -> tuple[str, Any, dict[str, Any]]:
    """The GPTQ or AWQ config INC builds for the layer: (its quant_method, the config, the raw dict
    MoeWNA16Config.from_config would be given)."""
    if lc.is_gptq:
        raw = {"quant_method": gptq.QUANT_METHOD, "bits": lc.bits, "group_size": lc.group_size, "sym": lc.sym,
               "lm_head": False}
        return gptq.QUANT_METHOD, gptq.GptqConfig(lc.bits, lc.group_size, False, lc.sym), raw
    raw = {"quant_method": awq.QUANT_METHOD, "bits": lc.bits, "group_size": lc.group_size, "zero_point": not lc.sym,
           "lm_head": False}
    return awq.QUANT_METHOD, awq.AwqConfig(lc.bits, lc.group_size, not lc.sym, ()), raw


def moe_method(cfg: IncConfig, rel: rules.Release, prefix: str, cc: int,
               gate: Callable[[int, bool], str | None]) -> MoEMethod:
    """INCWna16Scheme.get_moe_method on CUDA for the routed-experts layer `prefix`."""
    lc = layer_config(cfg, prefix)
    if lc is None:
        return MoEMethod("UnquantizedFusedMoEMethod", "unquantized", error=(
            "load", "unquantized method", f"extra_config or block_name_to_quantize leaves {prefix} unquantized: vLLM "
            "builds UnquantizedFusedMoEMethod and the checkpoint's packed expert tensors have no parameter to load into"))
    if rel.has("inc.low_bits_humming") and lc.bits in _HUMMING_BITS:
        return MoEMethod("HummingMoEMethod", "humming", error=(
            "method", "humming method", f"vLLM builds HummingMoEMethod for the {lc.bits}-bit experts of an auto-round "
            "checkpoint; wna16ctl does not plan that method"))
    qm, own, raw = inner(lc)
    types = {(4, True), (8, True)} if lc.is_gptq else {(4, True), (4, False), (8, True), (8, False)}
    reason = (f"{lc.bits}-bit {'symmetric' if lc.sym else 'asymmetric'} weights have no Marlin type"
              if (lc.bits, lc.sym) not in types else gate(lc.group_size, False))
    if reason is None:
        if not lc.is_gptq and lc.bits != 4:
            return MoEMethod("AutoAWQMoEMethod", "awq_marlin", error=("method", "bits", awq.bits_error(lc.bits)))
        return gptq.native(own, prefix) if lc.is_gptq else awq.native(own, prefix)
    return moe_wna16.method(raw, rel, prefix, cc, reason)


def linear_method(cfg: IncConfig, rel: rules.Release, prefix: str, is_head: bool, cc: int) -> LinearMethod:
    """INCConfig.get_quant_method on CUDA for a linear layer (or the output projection): a 16-bit
    extra_config entry named exactly the layer, the layer's resolved config (a fused layer's parts
    must agree), then INCWNA16LinearScheme's inner GPTQ or AWQ method.  That method is built
    directly: no shard check of the Marlin gate (AWQ), no straddle check (GPTQ)."""
    if skipped_by_name(cfg, prefix):
        return LinearMethod(UNQUANTIZED_LINEAR, why_unquantized=f"extra_config gives {prefix} 16 bits")
    lc = resolve(cfg, prefix, is_head, PACKED_MODULES)
    if isinstance(lc, str):
        return LinearMethod(GPTQ_LINEAR, error=("create_weights", "inconsistent fused", lc))
    if not lc.quantized:
        return LinearMethod(UNQUANTIZED_LINEAR, why_unquantized=(
            "extra_config or block_name_to_quantize leaves it unquantized" if not is_head else
            "the output projection is quantized only through block_name_to_quantize or extra_config"))
    if rel.has("inc.low_bits_humming") and lc.bits in _HUMMING_BITS:
        return LinearMethod("HummingLinearMethod", lc.bits, lc.group_size, not lc.sym, error=(
            "create_weights", "humming method", f"vLLM builds the Humming linear method for the {lc.bits}-bit layers of "
            "an auto-round checkpoint; wna16ctl does not plan that method"))
    marlin_backend = cfg.backend == "auto" or "marlin" in cfg.backend
    g = lc.group_size
    if lc.is_gptq:
        if marlin_backend and lc.bits in (4, 8) and lc.sym and marlin_type_supported(cc, lc.bits, False) \
                and g in (-1, 32, 64, 128):
            return LinearMethod(GPTQ_LINEAR, lc.bits, g, False)
        return LinearMethod(GPTQ_LINEAR, lc.bits, g, not lc.sym, error=("create_weights", "no marlin type", (
            f"INC quantization with bits={lc.bits}, sym={lc.sym} is not supported. Only 4-bit and 8-bit symmetric "
            "quantization is supported with Marlin kernels.")))
    # AWQ: check_marlin_supported with uint4/uint8 and zero points = not sym takes 4-bit asymmetric only
    if marlin_backend and lc.bits == 4 and not lc.sym and marlin_type_supported(cc, 4, True) and g in (-1, 32, 64, 128):
        return LinearMethod(AWQ_MARLIN_LINEAR, 4, g, True)
    out = LinearMethod(AWQ_LINEAR, lc.bits, g, not lc.sym)
    if lc.bits != 4:
        out.error = ("create_weights", "bits", awq.bits_error(lc.bits))
    return out
