"""What the GPTQ, AWQ and AutoRound formats share: a projection stored as `qweight`, `qzeros`,
`scales` (and GPTQ's `g_idx`), in one of a few stored forms, and module rules of their own.

Each stored form (`StoredForm`: GPTQ v1 and v2 in `gptq.py`, AWQ GEMM in `awq.py`) says the
tensors' shapes and dtypes for a projection [N, K] and converts them to and from the canonical
form exactly.  A format (`QweightFormat`) parses its config into format-free schemes whose
`format` names the stored form, and answers a module's scheme by its own rules (`resolver`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeGuard

from wna16ctl.errors import BadInput
from wna16ctl.sources.formats.face import CODES, G_IDX, SCALES, ZERO_POINTS, InputFormat, NativeInputs, TensorNames
from wna16ctl.sources.scheme import ParsedConfig, WeightScheme

NAMES = TensorNames(codes="qweight", scales="scales", zero_points="qzeros", g_idx="g_idx")

Shapes = Callable[[WeightScheme, int, int], dict[str, tuple]]
ToCanonical = Callable[[dict[str, Any], WeightScheme, Mapping[str, str]], dict[str, Any]]
FromCanonical = Callable[[dict[str, Any], WeightScheme], dict[str, Any]]
NK = Callable[[list[int], int], tuple[int, int]]
Resolve = Callable[[list[str]], list[WeightScheme | None]]


@dataclass(frozen=True)
class StoredForm:
    """One stored form of the qweight formats: its tensors per projection and its conversions."""

    name: str  # WeightScheme.format of the schemes stored in it
    bits: frozenset[int]  # the bit widths it stores
    shapes: Shapes  # (scheme, N, K) -> suffix -> (allowed dtypes, shape)
    to_canonical: ToCanonical
    from_canonical: FromCanonical
    codes_nk: NK  # (shape of qweight, bits) -> (N, K)


def require(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise BadInput(f"{path}: {what}")


def key_value(qc: Mapping[str, Any], keys: tuple[str, ...], path: Path, fmt: str, default: Any = ...) -> Any:
    """The first of `keys` in the config (vLLM's `get_from_keys`); BadInput naming the key when
    none is there and there is no default."""
    for k in keys:
        if k in qc:
            return qc[k]
    if default is ...:
        raise BadInput(f"{path}: quantization_config.{keys[0]} is missing; a {fmt} config states it "
                       "(vLLM refuses the config without it)")
    return default


def int_choice(value: Any, where: str, allowed: tuple[int, ...], path: Path) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value in allowed, path,
            f"{where} = {value!r} is not one of {', '.join(map(str, allowed))}")
    return int(value)


def group_size(value: Any, where: str, path: Path) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value > 0), path,
            f"{where} = {value!r} is not a positive group size or -1 (channel-wise)")
    return int(value)


def boolean(value: Any, where: str, path: Path) -> bool:
    require(isinstance(value, bool), path, f"{where} = {value!r} is not true or false")
    return bool(value)


class SchemeCache:
    """One WeightScheme object per distinct scheme: the scan groups projections by identity."""

    def __init__(self) -> None:
        self._seen: dict[tuple, WeightScheme] = {}

    def get(self, bits: int, group: int, symmetric: bool, act_order: bool, form: str) -> WeightScheme:
        act = act_order and group != -1  # act-order is a no-op channel-wise (vLLM drops it too)
        key = (bits, group, symmetric, act, form)
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = WeightScheme(
                num_bits=bits, group_size=group, symmetric=symmetric,
                strategy="channel" if group == -1 else "group", actorder="group" if act else None,
                format=form, type="int")
        return found


def groups_of(k: int, scheme: WeightScheme) -> int:
    return -(-k // scheme.group_size) if scheme.group_size > 0 else 1


def is_head(name: str) -> bool:
    """Whether a module is the output projection (vLLM's ParallelLMHead)."""
    return name.rpartition(".")[2] == "lm_head"


class QweightFormat(InputFormat):
    """A format storing qweight/qzeros/scales/g_idx in the stored forms `forms` (by scheme.format)."""

    names = NAMES
    forms: dict[str, StoredForm] = {}
    engine_reads_module_dtypes = True

    def _form(self, scheme: WeightScheme) -> StoredForm:
        return self.forms[scheme.format]

    def known_format(self, scheme: WeightScheme) -> bool:
        return scheme.format in self.forms

    def stores_packed(self, scheme: WeightScheme | None) -> TypeGuard[WeightScheme]:
        return (scheme is not None and scheme.format in self.forms and scheme.is_wna16
                and scheme.num_bits in self.forms[scheme.format].bits)

    def stores_zero_points(self, scheme: WeightScheme) -> bool:
        return True  # symmetric projections store the constant midpoint

    def stored_tensors(self, scheme: WeightScheme, role: str, hidden: int, intermediate: int) -> dict[str, tuple]:
        N, K = (intermediate, hidden) if role in ("gate", "up") else (hidden, intermediate)
        out = self._form(scheme).shapes(scheme, N, K)
        out[f"{NAMES.zero_points}@unpacked"] = out[NAMES.zero_points]  # no other form: its mismatch is named
        out["@NK"] = (N, K)
        return out

    def read_roles(self, scheme: WeightScheme) -> tuple[str, ...] | None:
        return (CODES, SCALES, ZERO_POINTS, G_IDX)

    def canonical(self, stored: dict[str, Any], scheme: WeightScheme | None = None,
                  names: Mapping[str, str] | None = None) -> dict[str, Any]:
        if scheme is None:
            raise ValueError("the qweight formats convert with the projection's scheme")
        where = dict(names or {})
        for role in (CODES, SCALES, ZERO_POINTS, G_IDX):
            where.setdefault(role, NAMES.suffix(role))
        return self._form(scheme).to_canonical(stored, scheme, where)

    def stored_form(self, canonical: dict[str, Any], scheme: WeightScheme) -> dict[str, Any]:
        return self._form(scheme).from_canonical(canonical, scheme)

    def codes_nk(self, shape: list[int], scheme: WeightScheme | None) -> tuple[int, int]:
        form = self.forms.get(scheme.format) if scheme is not None else None
        form = form or next(iter(self.forms.values()))
        return form.codes_nk(shape, scheme.num_bits if scheme is not None else 4)

    def native_inputs(self, scheme: WeightScheme) -> NativeInputs | None:
        return None  # the torch path converts these stored forms

    def resolver(self, parsed: ParsedConfig, qc: Mapping[str, Any], path: Path) -> Resolve | None:
        raise NotImplementedError


def missing(names: Mapping[str, str], role: str, why: str) -> BadInput:
    return BadInput(f"tensor {names[role]}: missing; {why}")


def check_zero_range(z: Any, bits: int, name: str, v1: bool) -> None:
    """Zero points must fit the bit width (a v1 zero of 0 wraps to 2^b - 1 when stored, and reads
    back as 2^b, which no b-bit canonical zero point holds)."""
    bad = z >= (1 << bits)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        extra = " (GPTQ v1 stores zero - 1: a true zero point of 0 wrapped)" if v1 else ""
        raise BadInput(f"tensor {name}: zero point {int(z[tuple(at)])} at {at} is outside the {bits}-bit range"
                       f"{extra}; the checkpoint cannot be read exactly")
