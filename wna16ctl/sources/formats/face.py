"""What every input format answers, and the roles of a projection's stored tensors.

Each format reads a projection into the canonical form the layouts take (`layout.spec`: its keys
`CODES`, `SCALES`, `ZERO_POINTS`, `G_IDX`, which are also the roles a stored tensor plays).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeGuard

from wna16ctl.layout.spec import CANONICAL, CODES, G_IDX, SCALES, ZERO_POINTS  # noqa: F401 - the roles, re-exported
from wna16ctl.sources.scheme import ParsedConfig, WeightScheme

SHAPE = "weight_shape"  # a stored [N, K] of the projection (a role of no canonical tensor)
WEIGHT = "weight"  # an unquantized module's weight: the model's own name, the same in every format


@dataclass(frozen=True)
class TensorNames:
    """A format's names of a projection's stored tensors, by role: `<module>.<suffix>`."""

    codes: str
    scales: str
    zero_points: str
    g_idx: str
    shape: str | None = None  # a stored [N, K], where the format keeps one

    def suffix(self, role: str) -> str:
        """The stored suffix of a role (a canonical key, `SHAPE` or `WEIGHT`)."""
        found = {CODES: self.codes, SCALES: self.scales, ZERO_POINTS: self.zero_points, G_IDX: self.g_idx,
                 SHAPE: self.shape, WEIGHT: WEIGHT}.get(role)
        if found is None:
            raise KeyError(f"no stored tensor has the role {role!r}")
        return found

    def role_of(self, suffix: str) -> str | None:
        """The role a stored suffix plays (a canonical key, `SHAPE` or `WEIGHT`); None for another."""
        return self._roles().get(suffix)

    def _roles(self) -> dict[str, str]:
        out = {self.codes: CODES, self.scales: SCALES, self.zero_points: ZERO_POINTS, self.g_idx: G_IDX, WEIGHT: WEIGHT}
        if self.shape is not None:
            out[self.shape] = SHAPE
        return out

    @property
    def quantized(self) -> tuple[str, ...]:
        """The suffixes of a quantized projection's stored tensors, the shape last where there is one."""
        return (self.codes, self.scales, self.zero_points, self.g_idx) + ((self.shape,) if self.shape else ())

    def tensor(self, module: str, role: str) -> str:
        """The name of `module`'s stored tensor of `role`."""
        return f"{module}.{self.suffix(role)}"

    def split(self, name: str) -> tuple[str, str] | None:
        """(module, role) of a stored tensor's name; None when its suffix has no role here."""
        module, _, suffix = name.rpartition(".")
        role = self.role_of(suffix)
        return (module, role) if module and role is not None else None


@dataclass(frozen=True)
class NativeInputs:
    """The stored tensors the native fast path reads in place (`repacking.native_path`): the codes
    and scales by suffix; the host kernel takes the codes as N-first rows of int32 words."""

    codes: str
    scales: str


class InputFormat:
    """One checkpoint format's facts (subclassed once per format, registered in `sources.formats`)."""

    quant_method: str = ""  # the `quantization_config.quant_method` it is detected by
    names: TensorNames
    # whether vLLM's method for the format decides a linear layer by the dtypes the checkpoint
    # stores for the modules around it (GPTQ/AWQ `maybe_update_config`): reading every tensor's
    # dtype costs a full header parse, so it is done only for such formats
    engine_reads_module_dtypes: bool = False

    def parse_config(self, qc: Mapping[str, Any], path: Path) -> ParsedConfig:
        """The format's `quantization_config` as groups of targets with their format-free scheme."""
        raise NotImplementedError

    def known_format(self, scheme: WeightScheme) -> bool:
        """Whether the format knows the scheme's stored form (a format with several says which)."""
        return True

    def stores_packed(self, scheme: WeightScheme | None) -> TypeGuard[WeightScheme]:
        """Whether the scheme stores packed tensors whose shapes the scan checks."""
        raise NotImplementedError

    def stored_tensors(self, scheme: WeightScheme, role: str, hidden: int, intermediate: int) -> dict[str, tuple]:
        """The tensors the scheme stores for a projection of `role` (gate, up, down), by suffix:
        (allowed safetensors dtypes, shape)."""
        raise NotImplementedError

    def canonical(self, stored: dict[str, Any], scheme: WeightScheme | None = None,
                  names: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One projection's stored tensors (by canonical role, as read and normalised) in the
        canonical form the layouts take; `names` (role -> tensor name) for the messages of a
        format that checks the data as it converts it."""
        raise NotImplementedError

    def stored_form(self, canonical: dict[str, Any], scheme: WeightScheme) -> dict[str, Any]:
        """The inverse of `canonical`: one projection's canonical tensors as the format stores
        them, by role (exact: `canonical(stored_form(c, s), s) == c`)."""
        raise NotImplementedError

    def read_roles(self, scheme: WeightScheme) -> tuple[str, ...] | None:
        """The roles whose stored tensors `canonical` takes exactly as read; None where the stored
        tensors already are the canonical layout (the reader then normalises the legacy forms)."""
        return None

    def stores_zero_points(self, scheme: WeightScheme) -> bool:
        """Whether a projection of `scheme` stores zero points (whose header the scan checks)."""
        return not scheme.symmetric

    def codes_nk(self, shape: list[int], scheme: WeightScheme | None) -> tuple[int, int]:
        """The projection's (N, K) from the shape of its stored codes (4 bits when no scheme)."""
        rows, cols = shape
        bits = scheme.num_bits if scheme is not None else 4
        return int(rows), int(cols) * 32 // bits

    def resolver(self, parsed: ParsedConfig, qc: Mapping[str, Any],
                 path: Path) -> Callable[[list[str]], list[WeightScheme | None]] | None:
        """How module names resolve to their schemes where the format has rules of its own (a
        function of many names at once); None: `sources.config`'s targets/ignore matching."""
        return None

    def unsayable(self, qc: Mapping[str, Any], path: Path) -> str | None:
        """Why the config `convert` writes (compressed-tensors', or GPTQ's for a compressed-tensors
        source) cannot say this config's per-module rules (an override or a quantization it has no
        field for), naming the key; None where it can."""
        return None

    def native_inputs(self, scheme: WeightScheme) -> NativeInputs | None:
        """What the native fast path reads in place for `scheme`; None: the torch path reads it."""
        raise NotImplementedError
