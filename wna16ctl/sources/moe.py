"""Finding the MoE layers of a checkpoint and checking their expert tensors against the config.

Routed experts are the per-expert Linears under `<block>.experts.<e>.<proj>` where proj is
gate_proj/up_proj/down_proj (Qwen, DeepSeek, Kimi, GLM, gpt-oss after linearisation) or
w1/w3/w2 (Mixtral).  Shared experts (`shared_expert(s).gate_proj`) and dense MLPs have no
expert index and are not routed experts.  Everything here works on headers only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from wna16ctl.sources import formats
from wna16ctl.sources.config import ModelConfig, WeightScheme
from wna16ctl.sources.formats import WEIGHT, InputFormat
from wna16ctl.sources.headers import CheckpointFiles
from wna16ctl.sources.model import moe_routing
from wna16ctl.sources.scan import scan_shard
from wna16ctl.errors import BadInput

ROLE_ORDER = ("gate", "up", "down")
_FAMILY_NAMES = {
    "gate_up_down": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "w1_w3_w2": {"gate": "w1", "up": "w3", "down": "w2"},
}


def _anchors(fmt: InputFormat) -> tuple[str, ...]:
    """Name endings of a gate projection's first tensor, packed or dense, in either family."""
    return tuple(f"{gate}.{suffix}" for gate in ("gate_proj", ".w1") for suffix in (fmt.names.codes, WEIGHT))


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class MoELayer:
    """One MoE block's routed experts, as found in the headers."""

    prefix: str  # the experts' module path, e.g. model.layers.3.mlp.experts
    layer_index: int | None
    family: str  # "gate_up_down" | "w1_w3_w2"
    num_experts: int
    hidden_size: int
    intermediate_size: int
    scheme: WeightScheme | None  # expert 0's scheme (what vLLM uses for the whole layer)
    scale_dtype: str | None
    # per distinct (scheme of gate, up, down) -> experts that use it; >1 key = per-expert mixed precision
    scheme_sets: dict[tuple[WeightScheme | None, ...], list[int]] = field(default_factory=dict)
    zero_point_form: str = "none"
    g_idx_form: str = "none"
    # how the packed int32 words are filled (sources/scan.py PACKINGS): "dense", "word", "same"
    # (the bit width packs alike either way: 2, 4, 8 bits), or "mixed:dense,word"
    packing: str = "same"
    # the schemes quantization_config gives expert 0 under the names gate_proj/up_proj/down_proj,
    # for a layer whose checkpoint names are others (Mixtral's w1/w3/w2): what releases without
    # the rule method.checkpoint_proj_names look up (None: the names are the checkpoint's own)
    default_name_schemes: tuple[WeightScheme | None, ...] | None = None
    router: str | None = None  # router weight tensor name
    routing: str | None = None  # vLLM's routing method for the layer (sources.model.moe_routing; None: not known)
    router_bias: str | None = None  # DeepSeek-V3 e_score_correction_bias
    norm: str | None = None  # post-attention RMSNorm weight
    warnings: list[str] = field(default_factory=list)
    fmt: InputFormat = field(default=formats.DEFAULT, repr=False, compare=False)  # the checkpoint's format
    # the checkpoint's quant_method and its quantization_config as written (QuantConfig.quant_method
    # and .raw): the planner's method steps of the format read them (None: no quantization_config)
    quant_method: str | None = field(default=None, compare=False)
    quant_raw: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    @property
    def proj_names(self) -> tuple[str, str, str]:
        """The checkpoint's gate, up and down projection names (gate_proj/up_proj/down_proj or w1/w3/w2)."""
        names = _FAMILY_NAMES[self.family]
        return names["gate"], names["up"], names["down"]

    def tensor_name(self, expert: int, role: str, suffix: str) -> str:
        return f"{self.prefix}.{expert}.{_FAMILY_NAMES[self.family][role]}.{suffix}"

    def stored_name(self, expert: int, role: str, kind: str) -> str:
        """The name of an expert projection's stored tensor of `kind` (a role of `sources.formats`:
        CODES, SCALES, ZERO_POINTS, G_IDX, SHAPE or WEIGHT) in the checkpoint's format."""
        return self.tensor_name(expert, role, self.fmt.names.suffix(kind))

    @property
    def block(self) -> str:
        return self.prefix.rsplit(".", 1)[0]

    @property
    def packed_bytes(self) -> int:
        """Bytes of the layer's packed codes (sum over experts and projections)."""
        if self.scheme is None:
            return 0
        per = 3 * self.hidden_size * self.intermediate_size
        total = 0
        for key, experts in self.scheme_sets.items():
            bits = key[0].num_bits if key[0] is not None else 16
            total += len(experts) * per * bits // 8
        return total


def find_moe_layers(ckpt: CheckpointFiles, config: ModelConfig, scans: list[dict[str, Any]] | None = None,
                    intermediate: int | None = None) -> list[MoELayer]:
    """Every MoE layer's routed experts, from the per-shard scans (made here if not given)."""
    if scans is None:
        intermediate = intermediate or infer_intermediate(ckpt, config)
        scans = [scan_shard(str(sh.path), config, intermediate or 0, keep_entries=True, header=sh) for sh in ckpt.shards]
    merged: dict[str, dict[str, Any]] = {}
    for scan in scans:
        table = [None if t is None else _scheme(t) for t in scan["schemes"]]
        for prefix, lay in scan["layers"].items():
            m = merged.setdefault(prefix, {"family": lay["family"], "present": {}, "schemes": {}, "zp": set(), "scales": set(),
                                               "packing": set()})
            for key, experts in lay["present"].items():
                m["present"].setdefault(key, set()).update(experts)
            for role, pairs in lay["schemes"].items():
                m["schemes"].setdefault(role, {}).update((e, table[sid]) for e, sid in pairs)
            m["zp"].update(lay["zp"])
            m["scales"].update(lay["scales"])
            m["packing"].update(lay.get("packing", ()))
    layers = [_describe_layer(ckpt, config, prefix, m, intermediate) for prefix, m in merged.items()]
    layers.sort(key=lambda lay: (lay.layer_index if lay.layer_index is not None else 1 << 30, lay.prefix))
    return layers


_SCHEMES: dict[tuple, WeightScheme] = {}


def _scheme(fields: list | tuple) -> WeightScheme:
    """One WeightScheme object per distinct scheme, also for schemes sent back by a worker."""
    key = tuple(fields)
    s = _SCHEMES.get(key)
    if s is None:
        s = _SCHEMES[key] = WeightScheme(*key)
    return s


def infer_intermediate(ckpt: CheckpointFiles, config: ModelConfig) -> int | None:
    """The expert intermediate size: config.json's, else the rows of the first gate projection."""
    if config.moe_intermediate_size is not None:
        return config.moe_intermediate_size
    fmt = formats.of(config.quant)
    anchors = _anchors(fmt)
    for name in ckpt.names():
        if name.endswith(anchors) and ".experts." in name:
            e = ckpt.raw(name)
            if e is None:
                continue
            module, _, suffix = name.rpartition(".")
            if suffix == fmt.names.codes and len(e["shape"]) == 2 and config.quant is not None:
                return fmt.codes_nk(list(e["shape"]), config.quant.scheme_for(module))[0]
            return int(e["shape"][0])
    return None


def _layer_index(prefix: str) -> int | None:
    m = _LAYER_RE.search(prefix)
    return int(m.group(1)) if m else None


def _describe_layer(ckpt: CheckpointFiles, config: ModelConfig, prefix: str, m: dict[str, Any],
                    intermediate: int | None) -> MoELayer:
    where = ckpt.root
    family = m["family"]
    names = _FAMILY_NAMES[family]
    present = m["present"]
    fmt = formats.of(config.quant)
    stored = fmt.names
    anchors = present.get(f"gate.{stored.codes}", set()) | present.get(f"gate.{WEIGHT}", set())
    if not anchors:
        raise ckpt.missing(f"{prefix}.0.{names['gate']}.{stored.codes}")
    num = max(anchors) + 1
    everything = set().union(*present.values())
    if max(everything) + 1 > num:
        num = max(everything) + 1
    missing = sorted(set(range(num)) - everything)
    if missing:
        raise BadInput(f"{where}: {prefix}.{missing[0]} has no tensors (experts must be numbered 0..{num - 1})")
    if config.num_experts is not None and num != config.num_experts:
        raise BadInput(
            f"{where}: {prefix} holds {num} experts but config.json says {config.num_experts}; "
            "the checkpoint and its config do not belong together"
        )
    H = config.hidden_size
    I = intermediate
    if I is None:
        raise BadInput(f"{where}: cannot tell the expert intermediate size of {prefix}")
    g0 = ckpt.raw(f"{prefix}.0.{names['gate']}.{WEIGHT}")
    if g0 is not None and int(g0["shape"][0]) != I:  # unquantized experts are not shape-checked by the scan
        raise BadInput(
            f"{where}: {prefix}.0.{names['gate']} has {g0['shape'][0]} output rows but config.json's expert intermediate "
            f"size is {I}; the checkpoint and its config do not belong together"
        )
    layer = MoELayer(prefix=prefix, layer_index=_layer_index(prefix), family=family, num_experts=num,
                     hidden_size=H, intermediate_size=I, scheme=None, scale_dtype=None, routing=moe_routing(config),
                     fmt=fmt, quant_method=config.quant.quant_method if config.quant is not None else None,
                     quant_raw=config.quant.raw if config.quant is not None else None)
    block = layer.block
    for cand in (f"{block}.gate.weight", f"{block}.router.weight", f"{block}.gate.wg.weight"):
        if cand in ckpt:
            layer.router = cand
            break
    if f"{block}.gate.e_score_correction_bias" in ckpt:
        layer.router_bias = f"{block}.gate.e_score_correction_bias"
    if layer.layer_index is not None:
        stem = prefix[: prefix.index(f"layers.{layer.layer_index}.")] + f"layers.{layer.layer_index}"
        if f"{stem}.post_attention_layernorm.weight" in ckpt:
            layer.norm = f"{stem}.post_attention_layernorm.weight"

    # every projection of every expert must exist with the tensors its scheme stores
    per_role: dict[str, list[WeightScheme | None]] = {}
    zp_forms, gidx_forms = set(m["zp"]), set()
    all_experts = set(range(num))
    for role in ROLE_ORDER:
        schemes = m["schemes"].get(role, {})
        lacking = sorted(all_experts - set(schemes))
        if lacking:
            raise ckpt.missing(f"{prefix}.{lacking[0]}.{names[role]}.{stored.codes}")
        per_role[role] = [schemes[e] for e in range(num)]
        # the predicates once per distinct scheme (schemes are shared objects), not per expert
        distinct = {id(s): s for s in schemes.values()}
        if len(distinct) == 1:  # the usual case: one scheme for every expert of the role
            only = next(iter(distinct.values()))
            packed = set(schemes) if fmt.stores_packed(only) else set()
            asym = packed if packed and not only.symmetric else set()
            act = packed if packed and only.act_order else set()
        else:
            packed = {e for e, s in schemes.items() if fmt.stores_packed(s)}
            asym = {e for e in packed if not schemes[e].symmetric}
            act = {e for e in packed if schemes[e].act_order}
        if packed:
            for suffix in (stored.codes, stored.scales):
                lacking = sorted(packed - present.get(f"{role}.{suffix}", set()))
                if lacking:
                    raise ckpt.missing(f"{prefix}.{lacking[0]}.{names[role]}.{suffix}")
            if asym - present.get(f"{role}.{stored.zero_points}", set()):
                zp_forms.add("missing")
            if act:
                have = act & present.get(f"{role}.{stored.g_idx}", set())
                if have:
                    gidx_forms.add("present")
                if act - have:
                    gidx_forms.add("missing")
    groups: dict[tuple[int, ...], tuple[tuple, list[int]]] = {}
    for e, key in enumerate(zip(*(per_role[r] for r in ROLE_ORDER))):
        ident = tuple(map(id, key))
        g = groups.get(ident)
        if g is None:
            groups[ident] = g = (key, [])
        g[1].append(e)
    for key, experts in groups.values():
        layer.scheme_sets.setdefault(key, []).extend(experts)
    first = next(iter(layer.scheme_sets))
    layer.scheme = first[0]
    scale_dtypes = m["scales"]
    layer.scale_dtype = min(scale_dtypes) if len(scale_dtypes) == 1 else (",".join(sorted(scale_dtypes)) or None)
    layer.zero_point_form = _one_form(zp_forms or {"none"})
    layer.g_idx_form = _one_form(gidx_forms or {"none"})
    layer.packing = _one_form(m["packing"] or {"same"})
    if family != "gate_up_down" and config.quant is not None:
        layer.default_name_schemes = tuple(config.quant.schemes_for(
            [f"{prefix}.0.{p}" for p in _FAMILY_NAMES["gate_up_down"].values()]))
    if "unpacked" in zp_forms:
        layer.warnings.append(f"{prefix}: zero points are stored unpacked (int8, compressed-tensors <= 0.9.3); read as packed")
    if "missing" in zp_forms:
        layer.warnings.append(
            f"{prefix}: asymmetric experts without {stored.zero_points} (old writers skipped all-zero ones); treated as zero"
        )
    if "missing" in gidx_forms:
        layer.warnings.append(
            f"{prefix}: actorder 'group' without {stored.g_idx} (old writers skipped unset ones); treated as k // group_size"
        )
    if len(scale_dtypes) > 1:
        layer.warnings.append(f"{prefix}: expert scales use several dtypes ({', '.join(sorted(scale_dtypes))})")
    return layer


def _one_form(forms: set[str]) -> str:
    if len(forms) == 1:
        return next(iter(forms))
    return "mixed:" + ",".join(sorted(forms))
