"""Input formats: each quantized checkpoint format's names, config keys, packing and zero-point
convention, behind one face (`face.InputFormat`), detected from `quantization_config`.

Formats register by their `quant_method`, the way compressed-tensors registers its compressors by
name; `detect` picks one for a config and refuses the others in one line, and `of` gives the format
of a parsed config.  Each answers for the rest of the tree: its config as format-free schemes, a
tensor name <-> (module, role), the tensors a scheme stores with shapes and dtypes, one projection
in the canonical form the layouts take, the native fast path's inputs, and (through the roles of its
stored tensors) what `pad` rewrites.  Nothing outside this package compares a format's name or a
stored tensor's suffix (tests/test_format_owner.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wna16ctl.errors import BadInput
from wna16ctl.sources.formats import auto_round, awq, gptq
from wna16ctl.sources.formats import compressed_tensors
from wna16ctl.sources.formats.compressed_tensors import COMPRESSED_TENSORS
from wna16ctl.sources.formats.face import (CANONICAL, CODES, WEIGHT, G_IDX, SCALES, SHAPE, ZERO_POINTS, InputFormat,
                                           NativeInputs, TensorNames)
from wna16ctl.sources.scheme import ParsedConfig

__all__ = ["CANONICAL", "CODES", "WEIGHT", "G_IDX", "SCALES", "SHAPE", "ZERO_POINTS", "InputFormat", "NativeInputs",
           "TensorNames", "FORMATS", "CONVERT_TARGETS", "convert_target", "FORMAT_FILES", "DEFAULT", "DEMO_FORMATS", "detect", "of", "parse"]

FORMATS: dict[str, InputFormat] = {f.quant_method: f for f in (COMPRESSED_TENSORS, gptq.FORMAT, awq.FORMAT,
                                                                 auto_round.FORMAT)}
FORMATS.update({alias: auto_round.FORMAT for alias in auto_round.ALIASES})
# the formats `wna16ctl demo` writes, its default first: compressed-tensors by the library itself,
# GPTQ and AWQ from that output through their `stored_form` (wna16ctl/demo.py)
DEMO_FORMATS: tuple[str, ...] = (COMPRESSED_TENSORS.quant_method, gptq.QUANT_METHOD, awq.QUANT_METHOD)
# Files beside config.json that hold the quantization config when config.json has none, with the
# quant_method a file without one is read in
SIDE_CONFIGS: tuple[tuple[str, str], ...] = ((gptq.QUANTIZE_CONFIG, gptq.QUANT_METHOD),)
# Files beside config.json in which a writer repeats its quantization config (GPTQModel's
# quantize_config.json, AutoRound's quantization_config.json): stale once the weights are converted
FORMAT_FILES: tuple[str, ...] = (gptq.QUANTIZE_CONFIG, "quantization_config.json")
# the format a checkpoint without `quantization_config` is read in (its packed tensors are refused by name)
DEFAULT: InputFormat = COMPRESSED_TENSORS


# the formats `wna16ctl convert` writes, by quant_method: (the format, its writer: the scheme in its
# stored form, what it cannot store, its tensors, its side files)
CONVERT_TARGETS: dict[str, tuple[InputFormat, Any]] = {
    COMPRESSED_TENSORS.quant_method: (COMPRESSED_TENSORS, compressed_tensors.WRITER),
    gptq.QUANT_METHOD: (gptq.FORMAT, gptq.WRITER),
}


def convert_target(source: InputFormat, to: str | None = None) -> tuple[InputFormat, Any]:
    """(format, writer) `convert` writes a checkpoint of `source` in: `to` (a CONVERT_TARGETS key),
    else compressed-tensors, or GPTQ for a compressed-tensors source (the one other target)."""
    if to is None:
        to = gptq.QUANT_METHOD if source is DEFAULT else DEFAULT.quant_method
    if to not in CONVERT_TARGETS:
        raise BadInput(f"--to {to!r}: convert writes {', '.join(CONVERT_TARGETS)}")
    return CONVERT_TARGETS[to]


def detect(qc: Any, path: Path, default: str | None = None) -> InputFormat:
    """The format of a `quantization_config` object, by its `quant_method` (`default` where it
    has none; BadInput naming `path` for anything else)."""
    if not isinstance(qc, dict):
        raise BadInput(f"{path}: quantization_config must be an object")
    method = str(qc.get("quant_method") or default or "")
    found = FORMATS.get(method)
    if found is None:
        raise BadInput(
            f"{path}: quantization_config.quant_method is {method or 'missing'!r}; wna16ctl reads "
            f"{', '.join(f.quant_method for f in dict.fromkeys(FORMATS.values()))} checkpoints"
        )
    return found


def parse(qc: Any, path: Path, default: str | None = None) -> ParsedConfig:
    """`quantization_config` parsed by its format."""
    return detect(qc, path, default).parse_config(qc, path)


def of(quant: Any) -> InputFormat:
    """The format of a parsed config (`sources.config.QuantConfig`, or anything with its
    `quant_method`); `DEFAULT` for a checkpoint without one."""
    method = getattr(quant, "quant_method", None)
    return DEFAULT if method is None else FORMATS.get(method, DEFAULT)
