"""The engine's checks of `quantization_config` as a whole, before it looks at any layer.

vLLM parses every `config_groups` entry when it builds its compressed-tensors config
(`CompressedTensorsConfig._quantization_scheme_map_from_config`): each group that has targets has
its weights validated by compressed-tensors, and from 0.30.0 a group whose weights use actorder
'group' or 'dynamic' is refused outright.  Such a refusal stops the whole checkpoint, whether or
not the group matches a layer wna16ctl plans (a vision tower, an MTP layer, attention only), so
it is judged here once per release and the layer planners are then not reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wna16ctl.planning import rules
from wna16ctl.sources import formats
from wna16ctl.sources.config import QuantConfig, WeightScheme

NOT_REACHED = "not reached (checkpoint refused at config parse)"


@dataclass(frozen=True)
class ConfigRefusal:
    """The error the release raises while parsing quantization_config, and the group that caused it."""

    group: str  # the config_groups key
    targets: tuple[str, ...]
    rule: str  # a short name for tables
    error: str  # the engine's message

    def to_json(self) -> dict[str, Any]:
        return {"stage": "config", "group": self.group, "targets": list(self.targets), "rule": self.rule,
                "error": self.error}

    def text(self) -> str:
        return f"config group {self.group!r} (targets {', '.join(self.targets)}): {self.error}"


def scheme_refusal(s: WeightScheme, rel: rules.Release) -> tuple[str, str] | None:
    """(rule, error) when parsing a group with weights `s` raises in `rel` (None: it parses)."""
    if s.strategy == "channel" and s.actorder in ("group", "dynamic"):
        # compressed-tensors 0.17.0 (pinned by every known release) validates this at parse
        return ("actorder on channel", (
            "ValidationError (compressed-tensors QuantizationArgs): Must use group or tensor_group quantization "
            "strategy in order to apply group activation ordering"))
    if rel.has("config.refuse_group_actorder") and s.actorder in ("group", "dynamic"):
        return ("actorder refused", (
            f"Compressed-tensors group/dynamic activation ordering (actorder={s.actorder!r}) is no longer supported. "
            "Use a checkpoint with static/weight activation ordering or without activation ordering."))
    return None


def config_refusal(quant: QuantConfig | None, version: str) -> ConfigRefusal | None:
    """The first config group, in file order, whose parse raises in release `version`."""
    # only the compressed-tensors config parses config_groups; a GPTQ/AWQ/AutoRound config's own
    # refusals (desc_act, bits) are its method's (planning/methods)
    if quant is None or formats.of(quant) is not formats.DEFAULT:  # DEFAULT: compressed-tensors
        return None
    rel = rules.release(version)
    for g in quant.groups:
        # the engine validates a group once per target: a group without targets is never validated
        if not g.targets or g.scheme is None:
            continue
        found = scheme_refusal(g.scheme, rel)
        if found is not None:
            return ConfigRefusal(g.name, g.targets, found[0], found[1])
    return None
