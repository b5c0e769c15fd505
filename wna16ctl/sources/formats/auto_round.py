"""AutoRound's own format (`quant_method: auto-round`, older files `intel/auto-round`), as
auto-round writes it and vLLM reads it (model_executor/layers/quantization/inc/).

Its integer checkpoints store the tensors of another format, named by `packing_format`:
  "auto_round:auto_gptq" (the default when absent): GPTQ v1 (`gptq.py`: zero - 1 in qzeros, the
      writer clamping a zero of 0 to 0), no act-order;
  "auto_round:auto_awq": AWQ GEMM (`awq.py`, 4 bits);
  "auto_round" and "auto_round:gptqmodel": the GPTQ layout with the zero points themselves, the
      stored form `gptq_v2` (vLLM 0.27-0.33 refuse these packing formats).
Other packing formats (fp8, llm_compressor's, mlx, ...) and data types other than int are not
weight-only integer checkpoints and are refused by name.  Per-layer `extra_config` overrides
(bits, group_size, sym; 16 bits or more: not quantized) and `block_name_to_quantize` resolve a
module's scheme the way vLLM's INC config parser does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from wna16ctl.errors import BadInput
from wna16ctl.sources.formats import awq, gptq
from wna16ctl.sources.formats.qweight import (QweightFormat, Resolve, SchemeCache, boolean, group_size, int_choice,
                                              is_head, key_value, require)
from wna16ctl.sources.scheme import ParsedConfig, SchemeGroup, WeightScheme

QUANT_METHOD = "auto-round"
ALIASES = ("intel/auto-round",)  # older writers' quant_method
DEFAULT_PACKING = "auto_round:auto_gptq"
PACKINGS = {DEFAULT_PACKING: gptq.V1, "auto_round:auto_awq": awq.STORED, "auto_round": gptq.V2,
            "auto_round:gptqmodel": gptq.V2}
BITS = (2, 3, 4, 8)
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")


def stored_form_of(qc: Mapping[str, Any], path: Path) -> str:
    """The stored form the config's packing_format names (BadInput naming the key otherwise)."""
    packing = qc.get("packing_format") or DEFAULT_PACKING
    form = PACKINGS.get(str(packing))
    if form is None:
        raise BadInput(f"{path}: quantization_config.packing_format = {packing!r} is not a weight-only integer form "
                       f"wna16ctl reads ({', '.join(sorted(PACKINGS))})")
    return form


def _base(qc: Mapping[str, Any], path: Path) -> tuple[int, int, bool, str]:
    where = "quantization_config"
    data_type = str(qc.get("data_type", "int"))
    require(data_type == "int", path, f"{where}.data_type = {data_type!r}: only integer weights are read")
    form = stored_form_of(qc, path)
    allowed = awq.BITS if form == awq.STORED else BITS
    bits = int_choice(key_value(qc, ("bits",), path, QUANT_METHOD), f"{where}.bits", allowed, path)
    group = group_size(key_value(qc, ("group_size",), path, QUANT_METHOD), f"{where}.group_size", path)
    sym = boolean(qc.get("sym", True), f"{where}.sym", path)
    return bits, group, sym, form


def _extra(qc: Mapping[str, Any], path: Path, form: str) -> dict[str, dict[str, Any]]:
    raw = qc.get("extra_config") or {}
    require(isinstance(raw, dict), path, "quantization_config.extra_config must be an object of layer -> settings")
    allowed = awq.BITS if form == awq.STORED else BITS
    for key, body in raw.items():
        where = f"quantization_config.extra_config[{key!r}]"
        require(isinstance(body, dict), path, f"{where} must be an object")
        bits = body.get("bits")
        if bits is not None and not (isinstance(bits, int) and bits >= 16):
            int_choice(bits, f"{where}.bits", allowed, path)
        if "group_size" in body:
            group_size(body["group_size"], f"{where}.group_size", path)
        if "sym" in body:
            boolean(body["sym"], f"{where}.sym", path)
        if _is_regex(key):
            try:
                re.compile(key)
            except re.error as e:
                raise BadInput(f"{path}: {where} is not a valid regex: {e}") from None
    return dict(raw)


def _is_regex(key: str) -> bool:
    return any(c in _REGEX_CHARS for c in key)


def _blocks(qc: Mapping[str, Any], path: Path) -> list[str] | None:
    raw = key_value(qc, ("block_name_to_quantize", "to_quant_block_names"), path, QUANT_METHOD, None)
    if raw is None:
        return None
    if isinstance(raw, str):
        return [b.strip() for b in raw.split(",") if b.strip()]
    require(isinstance(raw, list), path, "quantization_config.block_name_to_quantize must be a list or a "
            "comma-separated string")
    return [str(b) for b in raw]


class AutoRound(QweightFormat):
    quant_method = QUANT_METHOD
    forms = {gptq.V1: gptq.GPTQ_V1, gptq.V2: gptq.GPTQ_V2, awq.STORED: awq.AWQ_GEMM}

    def parse_config(self, qc: Mapping[str, Any], path: Path) -> ParsedConfig:
        bits, group, sym, form = _base(qc, path)
        cache = SchemeCache()
        groups = [SchemeGroup(("Linear",), cache.get(bits, group, sym, False, form), "default")]
        ignore = []
        for key, body in _extra(qc, path, form).items():
            target = ("re:" + key) if _is_regex(key) else key
            b = body.get("bits", bits)
            if b >= 16:
                ignore.append(target)
            else:
                groups.append(SchemeGroup((target,), cache.get(b, body.get("group_size", group),
                                                               body.get("sym", sym), False, form), key))
        return ParsedConfig(quant_method=QUANT_METHOD, format=form, version=None, groups=tuple(groups),
                            ignore=tuple(ignore))

    def resolver(self, parsed: ParsedConfig, qc: Mapping[str, Any], path: Path) -> Resolve:
        bits, group, sym, form = _base(qc, path)
        extra = _extra(qc, path, form)
        regexes = [(re.compile(k), body) for k, body in extra.items() if _is_regex(k)]
        blocks = _blocks(qc, path)
        cache = SchemeCache()

        def settings(body: Mapping[str, Any] | None, quantized: bool) -> WeightScheme | None:
            body = body or {}
            b = body.get("bits", bits if quantized else 16)
            if b >= 16:
                return None
            return cache.get(b, body.get("group_size", group if quantized else -1),
                             body.get("sym", sym if quantized else True), False, form)

        def one(name: str) -> WeightScheme | None:
            # vLLM's INCConfigParser: an exact or dotted-suffix extra_config entry, else inside the
            # quantized blocks (lm_head outside them), then an exact entry, a regex entry, the default
            if name in extra:
                return settings(extra[name], True)
            suffixed = next((k for k in extra if name.endswith(f".{k}")), None)
            if suffixed is not None:
                return settings(extra[suffixed], True)
            quantized = not is_head(name)
            if blocks:
                quantized = any(name.startswith(b) for b in blocks)
            matched = next((body for r, body in regexes if r.search(name)), None)
            return settings(matched, quantized)

        return lambda names: [one(n) for n in names]


FORMAT = AutoRound()
