"""AWQ (`quant_method: awq`), version GEMM, as AutoAWQ and AutoRound write it and vLLM reads it
(model_executor/layers/quantization/auto_awq.py; moe_wna16.py's AWQ conversion).

Stored form of a projection [N, K], 4 bits, G = ceil(K / group) groups (1 channel-wise):
  qweight [K, N/8] int32: the unsigned codes packed along N, eight per word, word slot j
          (bits 4j..4j+3) holding column 8·w + (0, 2, 4, 6, 1, 3, 5, 7)[j];
  qzeros  [G, N/8] int32: the zero points themselves, packed along N in the same order;
  scales  [G, N] float;
value = (q - z)·s.  `zero_point: false` is symmetric (midpoint 8, no canonical zero points).
Other versions (GEMV, its column-major words; exllama, IPEX, ...) store other forms and are refused
by name.  Config: w_bit/bits (4), q_group_size/group_size, zero_point, version,
modules_to_not_convert, lm_head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from wna16ctl.dtypes import FLOAT_ST
from wna16ctl.sources.formats.face import CODES, SCALES, ZERO_POINTS
from wna16ctl.sources.formats.qweight import (NAMES, QweightFormat, Resolve, SchemeCache, StoredForm, boolean,
                                              check_zero_range, group_size, groups_of, int_choice, is_head,
                                              key_value, missing, require)
from wna16ctl.sources.scheme import ParsedConfig, SchemeGroup, WeightScheme

QUANT_METHOD = "awq"
STORED = "awq"  # the GEMM stored form's name (WeightScheme.format)
VERSION = "gemm"
BITS = (4,)
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each word slot holds, within eight columns
REVERSE = tuple(ORDER.index(c) for c in range(8))  # the slot each column sits in: 0, 4, 1, 5, 2, 6, 3, 7


def _shapes(scheme: WeightScheme, n: int, k: int) -> dict[str, tuple]:
    g = groups_of(k, scheme)
    return {
        NAMES.codes: (("I32",), [k, -(-n // 8)]),
        NAMES.zero_points: (("I32",), [g, -(-n // 8)]),
        NAMES.scales: (FLOAT_ST, [g, n]),
        NAMES.g_idx: (("I32", "I64"), [k]),
    }


def _codes_nk(shape: list[int], bits: int) -> tuple[int, int]:
    rows, cols = shape
    return int(cols) * 8, int(rows)


def unpack_columns(words: Any) -> Any:
    """[R, C] AWQ words -> [R, 8·C] unsigned codes in column order."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    slots = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] by slot
    return slots[..., list(REVERSE)].reshape(words.shape[0], -1).to(torch.int32)


def pack_columns(codes: Any) -> Any:
    """[R, N] unsigned 4-bit codes (N a multiple of 8) -> [R, N/8] AWQ words."""
    import torch

    slots = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)[..., list(ORDER)] & 0xF
    words = (slots << torch.arange(0, 32, 4, dtype=torch.int64)).sum(dim=-1)
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32).contiguous()


def _to_canonical(stored: dict[str, Any], scheme: WeightScheme, names: Mapping[str, str]) -> dict[str, Any]:
    from wna16ctl.sources.formats.bits import pack_bits

    for role in (CODES, SCALES):
        if role not in stored:
            raise missing(names, role, "every quantized AWQ projection stores it")
    q = unpack_columns(stored[CODES])  # [K, N]
    out = {CODES: pack_bits(q.t(), 4, dim=1), SCALES: stored[SCALES].t().contiguous()}
    if not scheme.symmetric:
        if ZERO_POINTS not in stored:
            raise missing(names, ZERO_POINTS, "an AWQ projection with zero_point: true stores its zero points")
        z = unpack_columns(stored[ZERO_POINTS])  # [G, N]
        check_zero_range(z, 4, names[ZERO_POINTS], False)
        out[ZERO_POINTS] = pack_bits(z.t(), 4, dim=0)
    return out


def _from_canonical(canon: dict[str, Any], scheme: WeightScheme) -> dict[str, Any]:
    import torch

    from wna16ctl.sources.formats.bits import unpack_bits

    scales = canon[SCALES]
    n, g = scales.shape
    k = canon[CODES].shape[1] * 8
    q = unpack_bits(canon[CODES], 4, dim=1, size=k).t()  # [K, N]
    if scheme.symmetric:
        z = torch.full((g, n), 8, dtype=torch.int32)
    else:
        z = unpack_bits(canon[ZERO_POINTS], 4, dim=0, size=n).t()
    return {CODES: pack_columns(q), SCALES: scales.t().contiguous(), ZERO_POINTS: pack_columns(z)}


AWQ_GEMM = StoredForm(STORED, frozenset(BITS), _shapes, _to_canonical, _from_canonical, _codes_nk)


def parse_base(qc: Mapping[str, Any], path: Path) -> tuple[int, int, bool]:
    """(bits, group_size, zero_point) of an AWQ config, its version checked."""
    where = "quantization_config"
    version = qc.get("version", VERSION)
    require(isinstance(version, str) and version.lower() == VERSION, path,
            f"{where}.version = {version!r}: wna16ctl reads the awq GEMM version only (the form vLLM loads); "
            "re-export the checkpoint as GEMM")
    bits = int_choice(key_value(qc, ("w_bit", "bits"), path, QUANT_METHOD), f"{where}.bits", BITS, path)
    group = group_size(key_value(qc, ("q_group_size", "group_size"), path, QUANT_METHOD), f"{where}.group_size", path)
    zero = boolean(key_value(qc, ("zero_point",), path, QUANT_METHOD), f"{where}.zero_point", path)
    return bits, group, zero


def _not_converted(qc: Mapping[str, Any], path: Path) -> list[str]:
    mods = qc.get("modules_to_not_convert") or []
    require(isinstance(mods, list) and all(isinstance(m, str) for m in mods), path,
            "quantization_config.modules_to_not_convert must be a list of module names")
    return list(mods)


class AWQ(QweightFormat):
    quant_method = QUANT_METHOD
    forms = {STORED: AWQ_GEMM}

    def parse_config(self, qc: Mapping[str, Any], path: Path) -> ParsedConfig:
        bits, group, zero = parse_base(qc, path)
        base = SchemeCache().get(bits, group, not zero, False, STORED)
        return ParsedConfig(quant_method=QUANT_METHOD, format=STORED, version=None,
                            groups=(SchemeGroup(("Linear",), base, "default"),),
                            ignore=tuple(_not_converted(qc, path)))

    def resolver(self, parsed: ParsedConfig, qc: Mapping[str, Any], path: Path) -> Resolve:
        bits, group, zero = parse_base(qc, path)
        base = SchemeCache().get(bits, group, not zero, False, STORED)
        skipped = _not_converted(qc, path)
        head = bool(qc.get("lm_head", False))

        def one(name: str) -> WeightScheme | None:
            # vLLM skips a module whose name contains an entry of modules_to_not_convert
            if any(m in name for m in skipped) or (is_head(name) and not head):
                return None
            return base

        return lambda names: [one(n) for n in names]


FORMAT = AWQ()
