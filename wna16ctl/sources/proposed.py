"""A checkpoint that does not exist yet: an unquantized base model seen as llm-compressor would
write it under a proposed scheme or recipe.

The base's config and safetensors headers are read as usual; then every module the proposal
quantizes has its `weight` entry replaced by the entries `pack-quantized` stores for it
(`weight_packed`, `weight_scale`, `weight_shape`, and `weight_zero_point` / `weight_g_idx` where
the scheme has them), and the `quantization_config` the writer would add is put into the config.
The result is an ordinary `Checkpoint`, so the planner that judges a real quantized checkpoint
judges the proposal, rule for rule.

Which modules are quantized follows llm-compressor's defaults: the targets are every `Linear`
(headers cannot see module classes, so a Linear is a 2-D float `.weight` that is not an embedding),
minus the ignore list; the usual MoE ignore list leaves `lm_head`, the routers and the
shared-expert gate unquantized.  The presets (`W4A16`, `W4A16_ASYM`, `W8A16`) are read from
compressed-tensors' own preset table, imported only on this path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from wna16ctl.dtypes import FLOAT_ST
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.sources.config import parse_quantization_config
from wna16ctl.sources.formats import compressed_tensors

# the schemes the WNA16 planner judges (weight-only integer presets)
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16")
ACTORDERS = ("none", "weight", "static", "group")
# llm-compressor's usual ignore list for MoE models: the LM head, the routers (Qwen/DeepSeek
# `mlp.gate`, Mixtral `block_sparse_moe.gate`), Qwen's shared-expert gate and vision towers
DEFAULT_IGNORE = (
    "lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$", r"re:.*shared_expert_gate$",
    r"re:.*visual.*", r"re:.*vision_tower.*", r"re:.*multi_modal_projector.*",
)
# 2-D `.weight` tensors that are not Linear layers
_EMBEDDINGS = ("embed_tokens", "wte", "wpe", "word_embeddings", "tok_embeddings", "embed_positions", "embeddings",
               "position_embedding", "patch_embedding")
_FLOATS = FLOAT_ST


def preset_weights(name: str, where: str = "--scheme") -> dict[str, Any]:
    """The weight arguments of compressed-tensors' preset `name` (its own table, not a copy)."""
    upper = name.upper()
    if upper not in SCHEMES:
        raise UsageError(f"{where} {name!r}: wna16ctl plans the weight-only integer presets {', '.join(SCHEMES)}")
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    args = PRESET_SCHEMES[upper]["weights"]
    return {
        "num_bits": int(args.num_bits), "type": str(getattr(args.type, "value", args.type)),
        "symmetric": bool(args.symmetric), "strategy": str(getattr(args.strategy, "value", args.strategy)),
        "group_size": args.group_size, "dynamic": False,
        "actorder": None if args.actorder is None else str(getattr(args.actorder, "value", args.actorder)),
    }


def override_weights(weights: dict[str, Any], group_size: int | None, actorder: str | None) -> dict[str, Any]:
    """`weights` with `--group-size` (-1: channel-wise) and `--actorder` (none: no ordering) applied.

    Channel-wise is written `group_size: -1` (as a recipe saying so writes it): a config with
    `group_size: null` instead meets the Marlin gate crash of vLLM 0.27-0.29 (the planner reports it)."""
    w = dict(weights)
    if group_size is not None:
        if group_size == -1:
            w.update(strategy="channel", group_size=-1)
        elif group_size > 0:
            w.update(strategy="group", group_size=group_size)
        else:
            raise UsageError(f"--group-size {group_size}: a positive group size, or -1 for channel-wise")
    if actorder is not None:
        if actorder not in ACTORDERS:
            raise UsageError(f"--actorder {actorder!r}: one of {', '.join(ACTORDERS)}")
        w["actorder"] = None if actorder == "none" else actorder
    return w


@dataclass(frozen=True)
class Proposal:
    """The quantization llm-compressor would apply: its config groups and ignore list.

    `groups`: group name -> {"targets": [...], "weights": {...}} as `quantization_config` writes
    them; `origin`: how it was given (`--scheme W4A16` or the recipe file and its modifier);
    `scheme`: the preset name when one preset covers every group, else None.
    """

    groups: dict[str, dict[str, Any]]
    ignore: tuple[str, ...]
    origin: str
    scheme: str | None = None
    recipe: str | None = None  # the recipe file, when the proposal came from one
    modifier: str | None = None  # GPTQModifier / QuantizationModifier
    flags: tuple[str, ...] = field(default=())  # the options that override the groups' weights

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` the quantized checkpoint's config.json would hold."""
        return compressed_tensors.written_config(self.groups, self.ignore)

    def with_weights(self, group_size: int | None = None, actorder: str | None = None,
                     symmetric: bool | None = None) -> Proposal:
        """The same proposal with every group's weights changed (what `--suggest` tries)."""
        groups = {}
        for name, g in self.groups.items():
            w = override_weights(g["weights"], group_size, actorder)
            if symmetric is not None:
                w["symmetric"] = symmetric
            groups[name] = {**g, "weights": w}
        scheme = self.scheme
        if symmetric and scheme == "W4A16_ASYM":
            scheme = "W4A16"
        flags = list(self.flags)
        if group_size is not None:
            flags = [f for f in flags if not f.startswith("--group-size")] + [f"--group-size {group_size}"]
        if actorder is not None:
            flags = [f for f in flags if not f.startswith("--actorder")] + [f"--actorder {actorder}"]
        return replace(self, groups=groups, scheme=scheme, flags=tuple(flags))

    def command_flags(self) -> str:
        """The inspect options that give this proposal."""
        head = f"--recipe {self.recipe}" if self.recipe is not None else f"--scheme {self.scheme}"
        ignore = [] if self.recipe is not None or self.ignore == DEFAULT_IGNORE else [f"--ignore '{p}'" for p in self.ignore]
        return " ".join([head, *self.flags, *ignore])

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "origin": self.origin, "recipe": self.recipe, "modifier": self.modifier,
                "flags": self.command_flags(), "quantization_config": self.quantization_config()}


def proposal_from_flags(scheme: str, group_size: int | None = None, actorder: str | None = None,
                        ignore: list[str] | tuple[str, ...] | None = None) -> Proposal:
    """`--scheme NAME [--group-size N] [--actorder A] [--ignore P ...]`: the preset on every Linear.

    `ignore`, when given, is the whole ignore list (as a recipe's `ignore:` is); by default the
    usual MoE list (`DEFAULT_IGNORE`)."""
    weights = override_weights(preset_weights(scheme), group_size, actorder)
    flags = tuple(([f"--group-size {group_size}"] if group_size is not None else [])
                  + ([f"--actorder {actorder}"] if actorder is not None else []))
    origin = " ".join([f"--scheme {scheme.upper()}", *flags])
    return Proposal(groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                    ignore=tuple(ignore) if ignore else DEFAULT_IGNORE, origin=origin, scheme=scheme.upper(),
                    flags=flags)


def is_linear_weight(name: str, entry: dict[str, Any] | None) -> bool:
    """Whether a stored tensor is the float weight of a module a `Linear` target matches (2-D,
    not an embedding)."""
    if not name.endswith(".weight") or entry is None:
        return False
    if entry["dtype"] not in _FLOATS or len(entry["shape"]) != 2:
        return False
    leaf = name[: -len(".weight")].rpartition(".")[2]
    return leaf not in _EMBEDDINGS


def _quantized_entries(module: str, entry: dict[str, Any], weights: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
    """The tensors `pack-quantized` stores for one [N, K] Linear (name, dtype, shape)."""
    return compressed_tensors.written_tensors(module, entry, weights)


def _nbytes(dtype: str, shape: list[int]) -> int:
    from wna16ctl.sources.headers import DTYPE_BITS

    n = DTYPE_BITS.get(dtype, 16)
    for d in shape:
        n *= d
    return -(-n // 8)


def open_proposed(path: str | os.PathLike[str], proposal: Proposal, revision: str | None = None) -> Any:
    """The `Checkpoint` llm-compressor would write from the unquantized base at `path` (a directory
    or a Hub repo id) under `proposal`; headers only, nothing is written."""
    from wna16ctl.sources import HeaderSource, open_checkpoint
    from wna16ctl.sources.headers import ShardHeader, ShardList
    from wna16ctl.sources.hub import open_hub_checkpoint, parse_ref

    ref = parse_ref(str(path), revision)
    base = open_checkpoint(path) if ref is None else open_hub_checkpoint(ref)
    cfg = base.config
    if cfg.quant is not None:
        raise BadInput(f"{cfg.path}: already has a quantization_config; --scheme/--recipe plan an unquantized "
                       "base model (inspect this checkpoint without them)")
    qc = proposal.quantization_config()
    quant = parse_quantization_config(qc, Path(proposal.recipe) if proposal.recipe else cfg.path)
    files = base.files
    names = list(files.names())
    candidates = [n for n in names if n.endswith(".weight")]
    linear = [n[: -len(".weight")] for n in candidates if is_linear_weight(n, files.raw(n))]
    schemes = dict(zip(linear, quant.schemes_for(linear)))
    warnings: list[str] = []
    indivisible: list[str] = []
    new_shards: dict[Path, ShardHeader] = {}
    for sh in files.shards:
        entries: dict[str, dict[str, Any]] = {}
        offset = 0
        for name in sh.entries:
            e = files.entry(name)
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is not None and schemes.get(module) is not None:
                w = _weights_of(schemes[module])
                if w["strategy"] == "group" and int(e["shape"][1]) >= int(w["group_size"]) \
                        and int(e["shape"][1]) % int(w["group_size"]):
                    indivisible.append(f"{module} ({e['shape'][1]} columns)")
                items = _quantized_entries(module, e, w)
            else:
                items = [(name, e["dtype"], list(e["shape"]))]
            for n, dt, shape in items:
                size = _nbytes(dt, shape)
                entries[n] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
        new_shards[sh.path] = ShardHeader(sh.path, sh.data_start + offset, sh.data_start, entries, dict(sh.metadata))
    if indivisible:
        shown = ", ".join(indivisible[:3]) + (f" and {len(indivisible) - 3} more" if len(indivisible) > 3 else "")
        warnings.append(f"llm-compressor refuses to quantize layers whose input columns are not a multiple of the "
                        f"group size before calibrating: {shown}; add them to the ignore list (or set "
                        "bypass_divisibility_checks)")
    if any(g["weights"].get("actorder") == "group" for g in proposal.groups.values()):
        warnings.append("actorder group: current llm-compressor (with compressed-tensors >= 0.19) no longer writes it "
                        "(GPTQ orders by 'weight' or 'static'); the plan shows what a checkpoint from an older release "
                        "would meet")
    for t in (t for g in proposal.groups.values() for t in g["targets"]):
        if t != "Linear" and not t.startswith("re:") and t not in schemes:
            warnings.append(f"target {t!r} names no Linear module of the base model (module classes other than "
                            "Linear cannot be seen in the headers); it quantizes nothing here")
    if not any(s is not None for s in schemes.values()):
        raise BadInput(f"{base.root}: the proposal quantizes no module of this model (its targets match nothing, or "
                       "the ignore list covers them)")
    paths = [sh.path for sh in files.shards]
    config = replace(cfg, raw={**cfg.raw, "quantization_config": qc}, quant=quant)
    ck = open_checkpoint(base.root, HeaderSource(locate=lambda r: ShardList(r, paths), read=lambda p: new_shards[p]),
                         config=config)
    ck.source = base.source
    ck.warnings[:0] = [w for w in base.warnings if "no quantization_config" not in w] + warnings
    return ck


def _weights_of(s: Any) -> dict[str, Any]:
    """A parsed scheme as the weights fields `_quantized_entries` reads."""
    return {"num_bits": s.num_bits, "symmetric": s.symmetric, "strategy": s.strategy,
            "group_size": s.group_size if s.group_size > 0 else None, "actorder": s.actorder}
