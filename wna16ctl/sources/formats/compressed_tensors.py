"""compressed-tensors (`quant_method: compressed-tensors`), its `pack-quantized` form in particular.

Its config is parsed tolerantly, without the library: compressed-tensors itself costs ~5 s to
import and (from 0.19 on) rejects `actorder: "group"` checkpoints that exist in the wild.  Every
real-world form is accepted: terse 0.20 fields, verbose <= 0.18 fields, `group_size: null` for
channel, actorder null/false/true/"weight"/"static"/"group"/"dynamic", preset-name groups.

`pack-quantized` stores a projection [N, K] as
  weight_packed [N, K/pf] int32 (codes along K, offset by 2^(b-1)),
  weight_scale [N, G] (G = K/group, or 1 channel-wise),
  weight_zero_point [ceil(N/pf), G] int32 (asymmetric; offset codes packed along N),
  weight_g_idx [K] int32 (act-order: the group of each input column),
  weight_shape [2],
which is the canonical form as it is (`face`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, TypeGuard

from wna16ctl.dtypes import FLOAT_ST
from wna16ctl.errors import BadInput
from wna16ctl.sources.formats.face import InputFormat, NativeInputs, TensorNames
from wna16ctl.sources.scheme import ParsedConfig, SchemeGroup, WeightScheme

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
NAMES = TensorNames(codes="weight_packed", scales="weight_scale", zero_points="weight_zero_point",
                    g_idx="weight_g_idx", shape="weight_shape")

# Formats compressed-tensors writes; anything else is not a compressed-tensors checkpoint we know.
KNOWN_FORMATS = frozenset({
    "pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "dense", "mixed-precision",
    "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized", "marlin-24", "sparse-24-bitmask",
    "sparse-bitmask", "sparse-24", "mxfp4-quantized", "mxfp6-quantized",
})

# Preset schemes that a config group may name instead of spelling out its args
# (compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES, weight part only).
_PRESETS: dict[str, dict[str, Any]] = {
    "W4A16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=None),
}


def _expect(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise BadInput(f"{path}: {what}")


def _parse_actorder(value: Any, where: str, path: Path) -> str | None:
    if value is None or value is False:
        return None
    if value is True:  # historic JSON form of "group"
        return "group"
    if isinstance(value, str) and value.lower() in ("group", "dynamic", "weight", "static"):
        return value.lower()
    raise BadInput(f"{path}: {where}.actorder = {value!r} is not one of null, weight, static, group, dynamic")


def _parse_weights(args: Any, fmt: str, where: str, path: Path) -> WeightScheme | None:
    if args is None:
        return None
    _expect(isinstance(args, dict), path, f"{where} must be an object")
    try:
        num_bits = int(args.get("num_bits", 8))
    except (TypeError, ValueError):
        raise BadInput(f"{path}: {where}.num_bits = {args.get('num_bits')!r} is not an integer") from None
    qtype = str(args.get("type", "int")).lower()
    symmetric = bool(args.get("symmetric", True))
    raw_gs = args.get("group_size")
    strategy = args.get("strategy")
    if strategy is None:  # the library infers it the same way
        strategy = "tensor" if raw_gs is None else ("channel" if raw_gs == -1 else "group")
    strategy = str(strategy).lower()
    if strategy == "group":
        _expect(isinstance(raw_gs, int) and raw_gs > 0, path, f"{where}: strategy 'group' needs a positive group_size, got {raw_gs!r}")
        group_size = int(raw_gs)
    else:
        group_size = -1
    return WeightScheme(
        num_bits=num_bits,
        group_size=group_size,
        symmetric=symmetric,
        strategy=strategy,
        actorder=_parse_actorder(args.get("actorder"), where, path),
        format=fmt,
        type=qtype,
        group_size_null=(strategy == "channel" and raw_gs is None),
    )


def _parse_groups(qc: Mapping[str, Any], top_format: str, path: Path) -> list[SchemeGroup]:
    groups_raw = qc.get("config_groups") or {}
    _expect(isinstance(groups_raw, dict), path, "quantization_config.config_groups must be an object")
    groups: list[SchemeGroup] = []
    for name, body in groups_raw.items():
        where = f"config_groups.{name}"
        if isinstance(body, list):  # "W4A16": ["Linear"] preset form
            preset = _PRESETS.get(str(name).upper())
            if preset is None:
                raise BadInput(f"{path}: {where} names an unknown preset scheme; spell out its weights")
            scheme = _parse_weights(preset, top_format, where, path)
            groups.append(SchemeGroup(tuple(str(t) for t in body), scheme, str(name)))
            continue
        _expect(isinstance(body, dict), path, f"{where} must be an object")
        targets = body.get("targets") or []
        _expect(isinstance(targets, list), path, f"{where}.targets must be a list")
        fmt = body.get("format") or top_format
        if fmt == "mixed-precision":  # only meaningful at the top; a group needs a real one
            fmt = top_format
        scheme = _parse_weights(body.get("weights"), str(fmt), where, path)
        groups.append(SchemeGroup(tuple(str(t) for t in targets), scheme, str(name)))
    return groups


def packed_words(codes: int, num_bits: int, packing: str) -> int:
    """int32 words that hold `codes` codes of `num_bits` bits in a packing (PACKINGS)."""
    if packing == "dense":
        return -(-codes * num_bits // 32)
    return -(-codes // (32 // num_bits))


# How `pack-quantized` fills its int32 words: "dense" (compressed-tensors >= 0.20: codes back to
# back, a code may straddle two words; ceil(n * bits / 32) words) or "word" (earlier releases:
# 32 // bits whole codes per word, the rest of each word unused).  For 1, 2, 4 and 8 bits the two
# are the same words; for 3, 5, 6 and 7 bits they differ in extent and in content.
PACKINGS = ("dense", "word")


def packings_differ(num_bits: int) -> bool:
    return 32 % num_bits != 0


def written_config(groups: Mapping[str, Mapping[str, Any]], ignore: tuple[str, ...]) -> dict[str, Any]:
    """The `quantization_config` llm-compressor writes for config groups (targets, weights) and an
    ignore list, in the `pack-quantized` form."""
    return {
        "quant_method": QUANT_METHOD, "format": PACK_QUANTIZED, "quantization_status": "compressed",
        "config_groups": {name: {"targets": list(g["targets"]), "weights": dict(g["weights"]),
                                 "input_activations": None, "output_activations": None, "format": PACK_QUANTIZED}
                          for name, g in groups.items()},
        "ignore": list(ignore),
    }


def written_tensors(module: str, entry: Mapping[str, Any], weights: Mapping[str, Any]) -> list[tuple[str, str, list[int]]]:
    """The tensors `pack-quantized` stores for one [N, K] Linear whose float weight is `entry`
    (name, dtype, shape), as llm-compressor writes them (the dense packing)."""
    n, k = (int(x) for x in entry["shape"])
    bits = int(weights["num_bits"])
    groups = -(-k // int(weights["group_size"])) if weights["strategy"] == "group" else 1
    out = [(f"{module}.{NAMES.codes}", "I32", [n, packed_words(k, bits, "dense")]),
           (f"{module}.{NAMES.scales}", entry["dtype"], [n, groups]),
           (f"{module}.{NAMES.shape}", "I64", [2])]
    if not weights["symmetric"]:
        out.append((f"{module}.{NAMES.zero_points}", "I32", [packed_words(n, bits, "dense"), groups]))
    if weights["strategy"] == "group" and weights.get("actorder") == "group":
        out.append((f"{module}.{NAMES.g_idx}", "I32", [k]))
    return out


def weights_of(s: WeightScheme) -> dict[str, Any]:
    """A scheme as the `weights` of a config group llm-compressor writes (channel-wise: group_size -1)."""
    return {"num_bits": s.num_bits, "type": "int", "symmetric": s.symmetric, "strategy": s.strategy,
            "group_size": s.group_size if s.strategy == "group" else -1, "block_structure": None,
            "dynamic": False, "actorder": "group" if s.act_order else None, "observer": "minmax",
            "observer_kwargs": {}}


class PackQuantizedWriter:
    """compressed-tensors `pack-quantized` as a conversion writes it (llm-compressor's tensors)."""

    written_form = f"{QUANT_METHOD} {PACK_QUANTIZED}"

    @property
    def fmt(self) -> "CompressedTensors":
        return COMPRESSED_TENSORS

    def stored_as(self, scheme: WeightScheme) -> WeightScheme:
        return scheme

    def cannot_store(self, scheme: WeightScheme, n: int, k: int) -> str | None:
        if scheme.type != "int" or not 1 <= scheme.num_bits <= 8:
            return (f"{scheme.num_bits}-bit {scheme.type} weights: compressed-tensors' {PACK_QUANTIZED} stores "
                    "integers of 1 to 8 bits only")
        return None

    def written_tensors(self, module: str, scheme: WeightScheme, n: int, k: int,
                        scale_dtype: str) -> list[tuple[str, str, list[int]]]:
        return written_tensors(module, {"shape": [n, k], "dtype": scale_dtype}, weights_of(scheme))

    def side_files(self, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {}  # the config is config.json's alone


class CompressedTensors(InputFormat):
    quant_method = QUANT_METHOD
    names = NAMES

    def parse_config(self, qc: Mapping[str, Any], path: Path) -> ParsedConfig:
        top_format = str(qc.get("format") or "dense")
        groups = _parse_groups(qc, top_format, path)
        ignore = qc.get("ignore") or []
        _expect(isinstance(ignore, list), path, "quantization_config.ignore must be a list")
        return ParsedConfig(
            quant_method=str(qc.get("quant_method", "")),
            format=top_format,
            version=(str(qc["version"]) if qc.get("version") is not None else None),
            groups=tuple(groups),
            ignore=tuple(str(t) for t in ignore),
        )

    def unsayable(self, qc: Mapping[str, Any], path: Path) -> str | None:
        """Activation quantization (W4A8 and the like): the weight-only formats convert writes have no
        field for it."""
        for name, body in (qc.get("config_groups") or {}).items():
            if isinstance(body, dict) and body.get("input_activations"):
                return (f"{path}: quantization_config.config_groups.{name}.input_activations quantizes the "
                        "activations; GPTQ stores weight-only quantization, so no GPTQ config can say it")
        return None

    def known_format(self, scheme: WeightScheme) -> bool:
        """Whether the scheme's per-group format is one compressed-tensors writes."""
        return scheme.format in KNOWN_FORMATS

    def stores_packed(self, scheme: WeightScheme | None) -> TypeGuard[WeightScheme]:
        return (scheme is not None and scheme.format == PACK_QUANTIZED and scheme.is_wna16
                and 1 <= scheme.num_bits <= 8)

    def stored_tensors(self, scheme: WeightScheme, role: str, hidden: int, intermediate: int) -> dict[str, tuple]:
        """suffix -> (allowed dtypes, shape) of a `pack-quantized` projection's tensors; the packed
        tensors in the dense packing, and under `<suffix>@word` in the word packing where it differs;
        `@NK` the projection's (N, K)."""
        N, K = (intermediate, hidden) if role in ("gate", "up") else (hidden, intermediate)
        bits = scheme.num_bits
        # ceil: writers older than compressed-tensors 0.20 accepted a partial last group; the planner
        # reports vLLM's divisibility errors for such layers instead of rejecting the file.
        G = -(-K // scheme.group_size) if scheme.group_size > 0 else 1
        out = {
            "weight_packed": (("I32",), [N, packed_words(K, bits, "dense")]),
            "weight_scale": (FLOAT_ST, [N, G]),
            "weight_zero_point": (("I32",), [packed_words(N, bits, "dense"), G]),
            "weight_zero_point@unpacked": (("I8", "U8", "I32"), [N, G]),
            "weight_g_idx": (("I32", "I64"), [K]),
            "weight_shape": (("I64", "I32"), [2]),
            "@NK": (N, K),
        }
        if packings_differ(bits):
            out["weight_packed@word"] = (("I32",), [N, packed_words(K, bits, "word")])
            out["weight_zero_point@word"] = (("I32",), [packed_words(N, bits, "word"), G])
        return out

    def canonical(self, stored: dict[str, Any], scheme: WeightScheme | None = None,
                  names: Mapping[str, str] | None = None) -> dict[str, Any]:
        return stored  # the stored form is the canonical one

    def stored_form(self, canonical: dict[str, Any], scheme: WeightScheme) -> dict[str, Any]:
        return canonical

    def native_inputs(self, scheme: WeightScheme) -> NativeInputs | None:
        return NativeInputs(codes=NAMES.codes, scales=NAMES.scales)


COMPRESSED_TENSORS = CompressedTensors()
WRITER = PackQuantizedWriter()
