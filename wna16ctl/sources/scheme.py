"""The format-free weight scheme of one module, and a config group's targets with their scheme.

Every input format (`sources/formats/`) parses its `quantization_config` into these; the planner,
the layouts, `pad` and `verify` read them and never the format's own keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightScheme:
    """The weight quantization of one module, normalised for planning.

    `group_size` is -1 for channel-wise (whether the file said -1 or null); `actorder` keeps the
    file's string ("static" stays "static") so hazards can quote it; `act_order` is the one
    predicate for "g_idx-permuted groups".
    """

    num_bits: int
    group_size: int
    symmetric: bool
    strategy: str
    actorder: str | None
    format: str
    type: str = "int"
    group_size_null: bool = False  # channel strategy written with group_size null (PR #53163 hazard)

    @property
    def act_order(self) -> bool:
        return self.strategy == "group" and self.actorder in ("group", "dynamic")

    @property
    def pack_factor(self) -> int:
        return 32 // self.num_bits

    @property
    def is_wna16(self) -> bool:
        return self.type == "int" and self.strategy in ("group", "channel")

    def to_json(self) -> dict[str, Any]:
        return {
            "num_bits": self.num_bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "actorder": self.actorder,
            "format": self.format,
        }

    def describe(self) -> str:
        gs = "channel" if self.group_size == -1 else f"g{self.group_size}"
        sym = "sym" if self.symmetric else "asym"
        ao = f" actorder={self.actorder}" if self.actorder else ""
        return f"int{self.num_bits} {gs} {sym}{ao}"


@dataclass(frozen=True)
class SchemeGroup:
    """One group of a quantization config: the modules it targets and their weight scheme."""

    targets: tuple[str, ...]
    scheme: WeightScheme | None  # None: weights not quantized by this group
    name: str = ""  # its key in the config (engines name the group when they refuse it)


@dataclass(frozen=True)
class ParsedConfig:
    """A `quantization_config` as its format reads it: the groups in the file's order and the
    ignored modules; `sources.config` resolves a module's scheme from them."""

    quant_method: str
    format: str
    version: str | None
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...]
