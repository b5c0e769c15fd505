"""llm-compressor recipes (YAML) read as a `Proposal`: the quantization a recipe would apply.

A recipe nests its modifiers under stage names (`quant_stage: quant_modifiers: GPTQModifier: …`);
the one quantization modifier (`GPTQModifier`, `QuantizationModifier`, or `AWQModifier` carrying
a scheme) is found wherever it sits.  Its fields are resolved the way llm-compressor resolves
them:

* `scheme` and `config_groups` exclude each other;
* `scheme: W4A16` is that preset on `targets` (default `["Linear"]`); `scheme: {W4A16: [targets]}`
  names a preset per target list; the groups are called `group_0`, `group_1`, … in that order;
* `config_groups` are used as written (their weights' missing fields take the library's defaults);
* `ignore` defaults to nothing;
* GPTQModifier orders columns by activation: its `actorder` (default `static`) fills every
  group whose weights do not set one; a group that sets a different one is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wna16ctl.errors import BadInput, UsageError
from wna16ctl.sources.proposed import Proposal, override_weights, preset_weights, proposal_from_flags

QUANT_MODIFIERS = ("GPTQModifier", "QuantizationModifier", "AWQModifier")
_GPTQ_DEFAULT_ACTORDER = "static"


def _modifiers(node: Any, found: list[tuple[str, dict[str, Any]]]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in QUANT_MODIFIERS and isinstance(value, dict):
                found.append((key, value))
            else:
                _modifiers(value, found)
    elif isinstance(node, list):
        for item in node:
            _modifiers(item, found)


def _string_list(value: Any, where: str, path: Path) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{path}: {where} must be a string or a list of strings")
    return list(value)


def _actorder_text(value: Any) -> str | None:
    if value is None or value is False:
        return None
    if value is True:
        return "group"
    return str(value).lower()


def read_recipe(path: str | Path) -> Proposal:
    """The proposal of the recipe file at `path` (BadInput naming the file when it is unusable)."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise BadInput(f"{p}: not found; pass an llm-compressor recipe (.yaml)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{p}: cannot read the recipe ({e})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadInput(f"{p}: not valid YAML{at}; fix the recipe") from None
    found: list[tuple[str, dict[str, Any]]] = []
    _modifiers(doc, found)
    found = [(k, v) for k, v in found if k != "AWQModifier" or "scheme" in v or "config_groups" in v]
    if not found:
        raise BadInput(f"{p}: no GPTQModifier or QuantizationModifier; wna16ctl plans the quantization a recipe applies")
    if len(found) > 1:
        raise BadInput(f"{p}: {len(found)} quantization modifiers ({', '.join(k for k, _ in found)}); keep the one "
                       "that quantizes the weights")
    name, mod = found[0]
    return _resolve(p, name, mod)


def _resolve(p: Path, name: str, mod: dict[str, Any]) -> Proposal:
    targets = _string_list(mod.get("targets", ["Linear"]), f"{name}.targets", p)
    ignore = _string_list(mod.get("ignore", []), f"{name}.ignore", p)
    scheme = mod.get("scheme")
    config_groups = mod.get("config_groups")
    if scheme is not None and config_groups is not None:
        raise BadInput(f"{p}: {name} sets both scheme and config_groups; llm-compressor accepts one of them")
    groups: dict[str, dict[str, Any]] = {}
    presets: list[str] = []
    if scheme is not None:
        if isinstance(scheme, str):
            scheme = {scheme: targets}
        if not isinstance(scheme, dict) or not scheme:
            raise BadInput(f"{p}: {name}.scheme must be a preset name or a mapping of preset names to targets")
        for i, (preset, tgt) in enumerate(scheme.items()):
            try:
                weights = preset_weights(str(preset), where=f"{name}.scheme")
            except UsageError as e:
                raise BadInput(f"{p}: {e.message}") from None
            groups[f"group_{i}"] = {"targets": _string_list(tgt, f"{name}.scheme.{preset}", p), "weights": weights}
            presets.append(str(preset).upper())
    elif config_groups is not None:
        if not isinstance(config_groups, dict) or not config_groups:
            raise BadInput(f"{p}: {name}.config_groups must be a mapping of group names to schemes")
        for gname, body in config_groups.items():
            where = f"{name}.config_groups.{gname}"
            if not isinstance(body, dict):
                raise BadInput(f"{p}: {where} must be a mapping with targets and weights")
            if body.get("input_activations") is not None or body.get("output_activations") is not None:
                raise BadInput(f"{p}: {where} quantizes activations; wna16ctl plans weight-only (WNA16) schemes")
            written = body.get("weights")
            if not isinstance(written, dict):
                raise BadInput(f"{p}: {where}.weights must be a mapping (num_bits, type, symmetric, strategy, group_size)")
            if str(written.get("type", "int")).lower() != "int":
                raise BadInput(f"{p}: {where}.weights.type is {written.get('type')!r}; wna16ctl plans integer weights")
            groups[str(gname)] = {"targets": _string_list(body.get("targets", targets), f"{where}.targets", p),
                                  "weights": {"type": "int", **written}}
    else:
        raise BadInput(f"{p}: {name} has neither scheme nor config_groups; nothing to plan")
    if name == "GPTQModifier":
        wanted = _actorder_text(mod.get("actorder", _GPTQ_DEFAULT_ACTORDER))
        explicit = "actorder" in mod
        for gname, g in groups.items():
            have = _actorder_text(g["weights"].get("actorder"))
            if have is None and (wanted is not None or explicit):
                g["weights"] = override_weights(g["weights"], None, wanted or "none")
            elif explicit and wanted is not None and have != wanted:
                raise BadInput(f"{p}: GPTQModifier.actorder ({wanted}) and {gname}'s actorder ({have}) differ; "
                               "llm-compressor refuses the recipe: keep one of them")
    scheme_name = presets[0] if len(set(presets)) == 1 and len(presets) == len(groups) else None
    return Proposal(groups=groups, ignore=tuple(ignore), origin=f"{p} ({name})", scheme=scheme_name, recipe=str(p),
                    modifier=name)


def make_proposal(scheme: str | None, recipe: str | Path | None, group_size: int | None = None,
                  actorder: str | None = None, ignore: list[str] | None = None) -> Proposal | None:
    """The proposal of `inspect`'s options (None: the checkpoint is inspected as it is).

    `--scheme` or `--recipe`; `--group-size` and `--actorder` change every group's weights of
    either; `--ignore` replaces the default ignore list of `--scheme` (a recipe has its own)."""
    if scheme is not None and recipe is not None:
        raise UsageError("--scheme and --recipe exclude each other: the recipe names its own scheme")
    if recipe is None:
        if scheme is not None:
            return proposal_from_flags(scheme, group_size, actorder, ignore)
        given = [name for name, v in (("--group-size", group_size), ("--actorder", actorder), ("--ignore", ignore))
                 if v]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{', '.join(given)} {verb} only to a proposed quantization: add --scheme or --recipe")
        return None
    if ignore:
        raise UsageError("--ignore applies with --scheme; a recipe's own ignore list is used as written")
    proposal = read_recipe(recipe)
    if group_size is not None or actorder is not None:
        proposal = proposal.with_weights(group_size=group_size, actorder=actorder)
    return proposal
