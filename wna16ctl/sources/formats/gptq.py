"""GPTQ (`quant_method: gptq`, or a `quantize_config.json` beside config.json), as GPTQModel and
AutoGPTQ write it and vLLM reads it (model_executor/layers/quantization/auto_gptq.py,
utils/gptq_utils.py).

Stored form of a projection [N, K] with b bits, G = ceil(K / group) groups (1 channel-wise):
  qweight [K·b/32, N] int32: the unsigned codes packed along K, LSB first, as one bit stream per
          column (3 bits straddle words: 32 codes in 3 words), so its words are compressed-tensors'
          `weight_packed` transposed;
  qzeros  [G, N·b/32] int32: the zero points packed along N the same way; `checkpoint_format`
          "gptq" (v1) stores zero - 1, "gptq_v2" the zero point itself; a symmetric projection
          stores the midpoint 2^(b-1) (minus one in v1) and has no canonical zero points;
  scales  [G, N] float;
  g_idx   [K] int32: the group of each input column; with `desc_act` (act-order) a permutation of
          whole groups, else k // group (and ignored).
value = (q - z)·s.  Config: bits (2, 3, 4, 8), group_size (-1: channel), desc_act, sym,
checkpoint_format, GPTQModel's `dynamic` per-module overrides, `lm_head`,
`modules_in_block_to_quantize`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from wna16ctl.dtypes import FLOAT_ST
from wna16ctl.errors import BadInput
from wna16ctl.sources.formats.face import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.formats.qweight import (NAMES, QweightFormat, Resolve, SchemeCache, StoredForm, boolean,
                                              check_zero_range, group_size, groups_of, int_choice, is_head,
                                              key_value, missing, require)
from wna16ctl.sources.scheme import ParsedConfig, SchemeGroup, WeightScheme

QUANT_METHOD = "gptq"
V1, V2 = "gptq", "gptq_v2"  # checkpoint_format values, and the stored forms' names
QUANTIZE_CONFIG = "quantize_config.json"  # GPTQ's config beside config.json (older writers)
BITS = (2, 3, 4, 8)
_OVERRIDES = ("bits", "group_size", "desc_act", "sym")
# `dynamic` fields that steer GPTQModel's quantization and leave the stored form as the scheme says
_PROCESS_ONLY = frozenset({"damp_percent", "damp_auto_increment", "mse", "static_groups", "true_sequential", "v2",
                           "v2_alpha", "act_group_aware", "failsafe", "fail_safe", "hyb_act", "gar"})
_INT32 = "int32"  # the pack_dtype every reader here takes (qweight/qzeros of int32 words)


def _shapes(scheme: WeightScheme, n: int, k: int) -> dict[str, tuple]:
    from wna16ctl.sources.formats.bits import words_for

    g, b = groups_of(k, scheme), scheme.num_bits
    return {
        NAMES.codes: (("I32",), [words_for(k, b), n]),
        NAMES.zero_points: (("I32",), [g, words_for(n, b)]),
        NAMES.scales: (FLOAT_ST, [g, n]),
        NAMES.g_idx: (("I32", "I64"), [k]),
    }


def _codes_nk(shape: list[int], bits: int) -> tuple[int, int]:
    rows, cols = shape
    return int(cols), int(rows) * 32 // bits


def _to_canonical(stored: dict[str, Any], scheme: WeightScheme, names: Mapping[str, str]) -> dict[str, Any]:
    import torch

    from wna16ctl.sources.formats.bits import pack_bits, unpack_bits

    b = scheme.num_bits
    for role in (CODES, SCALES):
        if role not in stored:
            raise missing(names, role, "every quantized GPTQ projection stores it")
    qweight, scales = stored[CODES], stored[SCALES]
    n, k = scales.shape[1], qweight.shape[0] * 32 // b
    out = {CODES: qweight.t().contiguous(), SCALES: scales.t().contiguous()}
    qzeros = stored.get(ZERO_POINTS)
    if qzeros is None and not scheme.symmetric:
        raise missing(names, ZERO_POINTS, "an asymmetric (sym: false) GPTQ projection stores its zero points")
    if qzeros is not None and not (scheme.symmetric and _stores_midpoint(qzeros, b, n, scheme.format)):
        z = unpack_bits(qzeros, b, dim=1, size=n).to(torch.int64) + (1 if scheme.format == V1 else 0)
        if scheme.symmetric:
            _check_midpoint(z, b, names[ZERO_POINTS], scheme.format)
        else:
            check_zero_range(z, b, names[ZERO_POINTS], scheme.format == V1)
            out[ZERO_POINTS] = pack_bits(z.t(), b, dim=0)
    if scheme.act_order:
        g_idx = stored.get(G_IDX)
        if g_idx is None:
            raise missing(names, G_IDX, "desc_act (act-order) needs each column's group")
        from wna16ctl.sources.formats.checks import check_g_idx

        check_g_idx(g_idx, names[G_IDX], k, scheme.group_size)
        out[G_IDX] = g_idx.to(torch.int32).contiguous()
    return out


def _stores_midpoint(qzeros: Any, bits: int, n: int, form: str) -> bool:
    """Whether every word of a symmetric projection's qzeros is the packed midpoint, compared word
    by word (unpacking every zero point costs more than the rest of the conversion); where not,
    the unpacked check names the first value that differs."""
    import torch

    from wna16ctl.sources.formats.bits import pack_bits

    stored = (1 << (bits - 1)) - (1 if form == V1 else 0)
    row = pack_bits(torch.full((1, n), stored, dtype=torch.int64), bits, dim=1)
    return qzeros.dtype == torch.int32 and qzeros.shape[-1] == row.shape[-1] and bool((qzeros == row).all())


def _check_midpoint(z: Any, bits: int, name: str, form: str) -> None:
    mid = 1 << (bits - 1)
    off = z != mid
    if bool(off.any()):
        at = [int(i) for i in off.nonzero()[0]]
        stored = int(z[tuple(at)]) - (1 if form == V1 else 0)
        raise BadInput(f"tensor {name}: stores {stored} at {at}, not the symmetric midpoint "
                       f"{mid - (1 if form == V1 else 0)} of sym: true ({form}); the config and the tensors disagree")


def _from_canonical(canon: dict[str, Any], scheme: WeightScheme) -> dict[str, Any]:
    import torch

    from wna16ctl.sources.formats.bits import pack_bits, unpack_bits

    b, v1 = scheme.num_bits, scheme.format == V1
    codes, scales = canon[CODES], canon[SCALES]
    n, g = scales.shape
    k = canon[G_IDX].numel() if G_IDX in canon else codes.shape[1] * 32 // b
    if scheme.symmetric:
        z = torch.full((g, n), (1 << (b - 1)) - (1 if v1 else 0), dtype=torch.int64)
    else:
        z = unpack_bits(canon[ZERO_POINTS], b, dim=0, size=n).t().to(torch.int64) - (1 if v1 else 0)
        if bool((z < 0).any()):
            raise BadInput(f"a zero point of 0 cannot be stored in GPTQ v1 (it stores zero - 1); "
                           f"write checkpoint_format {V2}")
    if scheme.act_order:
        g_idx = canon[G_IDX].to(torch.int32)
    elif scheme.group_size > 0:
        g_idx = torch.arange(k, dtype=torch.int32) // scheme.group_size
    else:
        g_idx = torch.zeros(k, dtype=torch.int32)
    return {CODES: codes.t().contiguous(), SCALES: scales.t().contiguous(), ZERO_POINTS: pack_bits(z, b, dim=1),
            G_IDX: g_idx.contiguous()}


GPTQ_V1 = StoredForm(V1, frozenset(BITS), _shapes, _to_canonical, _from_canonical, _codes_nk)
GPTQ_V2 = StoredForm(V2, frozenset(BITS), _shapes, _to_canonical, _from_canonical, _codes_nk)


def _flatten(items: Any) -> list[str]:
    out: list[str] = []
    for item in items:
        out += _flatten(item) if isinstance(item, list) else [str(item)]
    return out


def _dynamic(qc: Mapping[str, Any], path: Path) -> list[tuple[str, re.Pattern[str], dict[str, Any]]]:
    """GPTQModel's `dynamic`: (key, compiled pattern, overrides) in the file's order."""
    raw = qc.get("dynamic") or {}
    require(isinstance(raw, dict), path, "quantization_config.dynamic must be an object of regex -> overrides")
    out = []
    for key, body in raw.items():
        where = f"quantization_config.dynamic[{key!r}]"
        require(isinstance(body, dict), path, f"{where} must be an object")
        try:
            pattern = re.compile(str(key).removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise BadInput(f"{path}: {where} is not a valid regex: {e}") from None
        for field in body:
            if field == "bits":
                int_choice(body[field], f"{where}.bits", BITS, path)
            elif field == "group_size":
                group_size(body[field], f"{where}.group_size", path)
            elif field in ("desc_act", "sym"):
                boolean(body[field], f"{where}.{field}", path)
        out.append((str(key), pattern, dict(body)))
    return out


def parse_base(qc: Mapping[str, Any], path: Path) -> tuple[int, int, bool, bool, str]:
    """(bits, group_size, desc_act, sym, stored form) of the config's top level."""
    where = "quantization_config"
    bits = int_choice(key_value(qc, ("bits",), path, QUANT_METHOD), f"{where}.bits", BITS, path)
    group = group_size(key_value(qc, ("group_size",), path, QUANT_METHOD), f"{where}.group_size", path)
    desc_act = boolean(key_value(qc, ("desc_act",), path, QUANT_METHOD), f"{where}.desc_act", path)
    sym = boolean(key_value(qc, ("sym",), path, QUANT_METHOD), f"{where}.sym", path)
    # absent or null (AutoGPTQ's configs, GPTQModel's older ones): the v1 form, as GPTQModel's own
    # loader reads it; vLLM never reads the key
    form = qc.get("checkpoint_format") or V1
    require(form in (V1, V2), path, f"{where}.checkpoint_format = {form!r} is not a stored form wna16ctl reads "
            f"({V1}, {V2})")
    require(not qc.get("is_marlin_format"), path, f"{where}.is_marlin_format is true: the Marlin-packed GPTQ "
            f"form is not read; use the {V1} checkpoint")
    return bits, group, desc_act, sym, str(form)


class GPTQ(QweightFormat):
    quant_method = QUANT_METHOD
    forms = {V1: GPTQ_V1, V2: GPTQ_V2}

    def parse_config(self, qc: Mapping[str, Any], path: Path) -> ParsedConfig:
        bits, group, desc_act, sym, form = parse_base(qc, path)
        cache = SchemeCache()
        base = cache.get(bits, group, sym, desc_act, form)
        groups = [SchemeGroup(("Linear",), base, "default")]
        ignore = []
        for key, _, body in _dynamic(qc, path):
            if key.startswith("-:"):
                ignore.append("re:" + key[2:])
                continue
            over = {f: body.get(f, v) for f, v in zip(_OVERRIDES, (bits, group, desc_act, sym))}
            groups.append(SchemeGroup(("re:" + key.removeprefix("+:"),),
                                      cache.get(over["bits"], over["group_size"], over["sym"], over["desc_act"], form),
                                      key))
        mods = qc.get("modules_in_block_to_quantize")
        require(mods is None or isinstance(mods, list), path,
                "quantization_config.modules_in_block_to_quantize must be a list (of lists) of module names")
        return ParsedConfig(quant_method=QUANT_METHOD, format=form, version=None, groups=tuple(groups),
                            ignore=tuple(ignore))

    def unsayable(self, qc: Mapping[str, Any], path: Path) -> str | None:
        for key, _, body in _dynamic(qc, path):
            for field, value in body.items():
                if field in _OVERRIDES or field in _PROCESS_ONLY or (field == "pack_dtype" and value == _INT32):
                    continue
                return (f"{path}: quantization_config.dynamic[{key!r}].{field} = {value!r}: compressed-tensors has no "
                        f"field for a per-module {field}, so no config group can say this rule")
        return None

    def resolver(self, parsed: ParsedConfig, qc: Mapping[str, Any], path: Path) -> Resolve:
        bits, group, desc_act, sym, form = parse_base(qc, path)
        rules = _dynamic(qc, path)
        cache = SchemeCache()
        base = cache.get(bits, group, sym, desc_act, form)
        head = bool(qc.get("lm_head", False))
        blocks = _flatten(qc.get("modules_in_block_to_quantize") or [])

        def one(name: str) -> WeightScheme | None:
            # vLLM's get_linear_quant_method: the block's module list (substrings; the MoE method
            # never consults it), lm_head only when stated, then the first dynamic rule that matches
            if blocks and ".experts." not in name and not any(m in name for m in blocks):
                return None
            if is_head(name) and not head:
                return None
            for key, pattern, body in rules:
                if pattern.match(name):
                    if key.startswith("-:"):
                        return None
                    return cache.get(body.get("bits", bits), body.get("group_size", group), body.get("sym", sym),
                                     body.get("desc_act", desc_act), form)
            return base

        return lambda names: [one(n) for n in names]


FORMAT = GPTQ()
