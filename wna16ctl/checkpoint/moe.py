"""Finding the MoE layers of a checkpoint and checking their expert tensors against the config.

Routed experts are the per-expert Linears under `<block>.experts.<e>.<proj>` where proj is
gate_proj/up_proj/down_proj (Qwen, DeepSeek, Kimi, GLM, gpt-oss after linearisation) or
w1/w3/w2 (Mixtral).  Shared experts (`shared_expert(s).gate_proj`) and dense MLPs have no
expert index and are not routed experts.  Everything here works on headers only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from wna16ctl.checkpoint.config import PACK_QUANTIZED, ModelConfig, WeightScheme
from wna16ctl.checkpoint.headers import DTYPE_SIZES, CheckpointFiles
from wna16ctl.errors import BadInput

# checkpoint projection name -> role; the role names are the layout package's keys
PROJECTION_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
ROLE_ORDER = ("gate", "up", "down")
_FAMILY_NAMES = {
    "gate_up_down": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "w1_w3_w2": {"gate": "w1", "up": "w3", "down": "w2"},
}
_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>[A-Za-z_]+)$")
_ANCHORS = ("gate_proj.weight_packed", "gate_proj.weight", ".w1.weight_packed", ".w1.weight")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FLOAT_DTYPES = ("BF16", "F16", "F32")
# Formats compressed-tensors writes; anything else is not a compressed-tensors checkpoint we know.
KNOWN_FORMATS = frozenset({
    "pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "dense", "mixed-precision",
    "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized", "marlin-24", "sparse-24-bitmask",
    "sparse-bitmask", "sparse-24", "mxfp4-quantized", "mxfp6-quantized",
})


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
    router: str | None = None  # router weight tensor name
    router_bias: str | None = None  # DeepSeek-V3 e_score_correction_bias
    norm: str | None = None  # post-attention RMSNorm weight
    warnings: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def tensor_name(self, expert: int, role: str, suffix: str) -> str:
        return f"{self.prefix}.{expert}.{_FAMILY_NAMES[self.family][role]}.{suffix}"

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


def find_moe_layers(ckpt: CheckpointFiles, config: ModelConfig) -> list[MoELayer]:
    """Discover every MoE layer's routed experts and check their headers against the config."""
    found: dict[str, tuple[str, set[int]]] = {}
    for name in ckpt.names():
        # cheap filter first: one tensor per expert identifies it (its gate projection's weight)
        if not name.endswith(_ANCHORS) or ".experts." not in name:
            continue
        m = _EXPERT_RE.match(name)
        if m is None:
            continue
        prefix = m.group("prefix")
        family = "w1_w3_w2" if m.group("proj").startswith("w") else "gate_up_down"
        entry = found.get(prefix)
        if entry is None:
            found[prefix] = entry = (family, set())
        entry[1].add(int(m.group("e")))
    layers = [_describe_layer(ckpt, config, prefix, fam, experts) for prefix, (fam, experts) in found.items()]
    layers.sort(key=lambda lay: (lay.layer_index if lay.layer_index is not None else 1 << 30, lay.prefix))
    return layers


def _layer_index(prefix: str) -> int | None:
    m = _LAYER_RE.search(prefix)
    return int(m.group(1)) if m else None


def _describe_layer(ckpt: CheckpointFiles, config: ModelConfig, prefix: str, family: str, experts: set[int]) -> MoELayer:
    where = ckpt.root
    num = max(experts) + 1
    missing = sorted(set(range(num)) - experts)
    if missing:
        raise BadInput(f"{where}: {prefix}.{missing[0]} has no tensors (experts must be numbered 0..{num - 1})")
    if config.num_experts is not None and num != config.num_experts:
        raise BadInput(
            f"{where}: {prefix} holds {num} experts but config.json says {config.num_experts}; "
            "the checkpoint and its config do not belong together"
        )
    names = _FAMILY_NAMES[family]
    H = config.hidden_size
    quant = config.quant

    # The intermediate size: config if it says, else the shapes; the two must agree.
    g0 = ckpt.raw(f"{prefix}.0.{names['gate']}.weight_packed") or ckpt.raw(f"{prefix}.0.{names['gate']}.weight")
    if g0 is None:
        raise ckpt.missing(f"{prefix}.0.{names['gate']}.weight_packed")
    I = int(g0["shape"][0])
    if config.moe_intermediate_size is not None and config.moe_intermediate_size != I:
        raise BadInput(
            f"{where}: {prefix}.0.{names['gate']} has {I} output rows but config.json's expert intermediate size is "
            f"{config.moe_intermediate_size}; the checkpoint and its config do not belong together"
        )

    layer = MoELayer(
        prefix=prefix,
        layer_index=_layer_index(prefix),
        family=family,
        num_experts=num,
        hidden_size=H,
        intermediate_size=I,
        scheme=None,
        scale_dtype=None,
    )
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

    # Check every projection of every expert, in bulk per (role, scheme): this loop runs over
    # every expert tensor of the model and dominates inspect's time on large checkpoints.
    zp_forms: set[str] = set()
    gidx_forms: set[str] = set()
    scale_dtypes: set[str] = set()
    per_role: dict[str, list[WeightScheme | None]] = {}
    for role in ROLE_ORDER:
        modules = [f"{prefix}.{e}.{names[role]}" for e in range(num)]
        schemes = quant.schemes_for(modules) if quant is not None else [None] * num
        per_role[role] = schemes
        by_scheme: dict[WeightScheme | None, list[str]] = {}
        for m, sch in zip(modules, schemes):
            by_scheme.setdefault(sch, []).append(m)
        for sch, mods in by_scheme.items():
            facts = _check_projections(ckpt, mods, role, sch, H, I, scale_dtypes)
            zp_forms |= facts[0]
            gidx_forms |= facts[1]
    # group experts by their (gate, up, down) schemes; keyed by identity (schemes come from the
    # config's matcher, so equal schemes are the same objects) to avoid rehashing dataclasses
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
    layer.scale_dtype = min(scale_dtypes) if len(scale_dtypes) == 1 else (",".join(sorted(scale_dtypes)) or None)
    layer.zero_point_form = _one_form(zp_forms)
    layer.g_idx_form = _one_form(gidx_forms)
    if "unpacked" in zp_forms:
        layer.warnings.append(f"{prefix}: zero points are stored unpacked (int8, compressed-tensors <= 0.9.3); read as packed")
    if "missing" in zp_forms:
        layer.warnings.append(
            f"{prefix}: asymmetric experts without weight_zero_point (old writers skipped all-zero ones); treated as zero"
        )
    if "missing" in gidx_forms:
        layer.warnings.append(
            f"{prefix}: actorder 'group' without weight_g_idx (old writers skipped unset ones); treated as k // group_size"
        )
    if len(scale_dtypes) > 1:
        layer.warnings.append(f"{prefix}: expert scales use several dtypes ({', '.join(sorted(scale_dtypes))})")
    return layer


def _one_form(forms: set[str]) -> str:
    if len(forms) == 1:
        return next(iter(forms))
    return "mixed:" + ",".join(sorted(forms))


def _expected(scheme: WeightScheme, role: str, H: int, I: int) -> dict[str, tuple]:
    N, K = (I, H) if role in ("gate", "up") else (H, I)
    pf = scheme.pack_factor
    # ceil: writers older than compressed-tensors 0.20 accepted a partial last group; the planner
    # reports vLLM's divisibility errors for such layers instead of rejecting the file.
    G = -(-K // scheme.group_size) if scheme.group_size > 0 else 1
    return {
        "weight_packed": (("I32",), [N, -(-K // pf)]),
        "weight_scale": (_FLOAT_DTYPES, [N, G]),
        "weight_zero_point": (("I32",), [-(-N // pf), G]),
        "weight_zero_point@unpacked": (("I8", "U8", "I32"), [N, G]),
        "weight_g_idx": (("I32", "I64"), [K]),
        "weight_shape": (("I64", "I32"), [2]),
        "@NK": (N, K),
    }


def _check_projections(
    ckpt: CheckpointFiles,
    modules: list[str],
    role: str,
    scheme: WeightScheme | None,
    H: int,
    I: int,
    scale_dtypes: set[str],
) -> tuple[set[str], set[str]]:
    """Check the headers of `modules` (one role, one scheme); return their zero-point/g_idx forms."""
    raw = ckpt.raw
    if scheme is None:
        for module in modules:
            if raw(f"{module}.weight") is None:
                if raw(f"{module}.weight_packed") is not None:
                    raise BadInput(
                        f"{ckpt.root}: {module}.weight_packed exists but quantization_config does not quantize {module}; "
                        "the config's targets/ignore do not match the tensors"
                    )
                raise ckpt.missing(f"{module}.weight_packed")
        return {"none"}, {"none"}
    if scheme.format not in KNOWN_FORMATS:
        raise BadInput(
            f"{ckpt.root / 'config.json'}: {modules[0]} uses quantization format "
            f"{scheme.format!r}, which is not a compressed-tensors format wna16ctl knows"
        )
    if scheme.format != PACK_QUANTIZED or not scheme.is_wna16 or not 1 <= scheme.num_bits <= 8:
        # Not a WNA16 packed layout: the planner reports why it cannot load; nothing to check here.
        return {"none"}, {"none"}
    exp = _expected(scheme, role, H, I)
    _bulk_check(ckpt, modules, "weight_packed", exp, required=True)
    scale_dtypes |= _bulk_check(ckpt, modules, "weight_scale", exp, required=True)
    zp: set[str] = {"none"}
    if not scheme.symmetric:
        zp = set()
        packed_shape = exp["weight_zero_point"][1]
        for module in modules:
            z = raw(f"{module}.weight_zero_point")
            if z is None:
                zp.add("missing")
            elif z["dtype"] == "I32" and z["shape"] == packed_shape:
                _check(ckpt, module, "weight_zero_point", exp, required=True)
                zp.add("packed")
            else:
                _check(ckpt, module, "weight_zero_point@unpacked", exp, required=True, stored="weight_zero_point")
                zp.add("unpacked")
    gi: set[str] = {"none"}
    if scheme.act_order:
        found = _bulk_check(ckpt, modules, "weight_g_idx", exp, required=False)
        gi = {"present"} if found else set()
        if any(raw(f"{m}.weight_g_idx") is None for m in modules):
            gi.add("missing")
    return zp, gi


def _bulk_check(ckpt: CheckpointFiles, modules: list[str], suffix: str, exp: dict, *, required: bool) -> set[str]:
    """Fast path over many modules; on the first bad one, `_check` produces the precise error."""
    dtypes, shape = exp[suffix]
    numel = 1
    for d in shape:
        numel *= d
    sizes = {dt: numel * DTYPE_SIZES[dt] for dt in dtypes}
    get = ckpt.raw
    seen: set[str] = set()
    for module in modules:
        e = get(f"{module}.{suffix}")
        if e is None:
            if required:
                _check(ckpt, module, suffix, exp, required=True)
            continue
        dt = e["dtype"]
        off = e["data_offsets"]
        if dt not in sizes or e["shape"] != shape or off[1] - off[0] != sizes[dt]:
            _check(ckpt, module, suffix, exp, required=required)
        seen.add(dt)
    return seen


def _check(ckpt: CheckpointFiles, module: str, suffix: str, exp: dict, *, required: bool, stored: str | None = None) -> str | None:
    name = f"{module}.{stored or suffix}"
    e = ckpt.raw(name)
    if e is None:
        if required:
            raise ckpt.missing(name)
        return None
    dtypes, shape = exp[suffix]
    if e["dtype"] not in dtypes or e["shape"] != shape:
        N, K = exp["@NK"]
        raise BadInput(
            f"{ckpt.shard_of(name).path}: tensor {name} is {e['dtype']}{list(e['shape'])}, expected "
            f"{'/'.join(dtypes)}{shape} for a [{N}, {K}] projection; the tensors contradict config.json"
        )
    start, end = e["data_offsets"]
    numel = 1
    for d in shape:
        numel *= d
    if end - start != numel * DTYPE_SIZES[e["dtype"]]:
        raise BadInput(f"{ckpt.shard_of(name).path}: tensor {name} spans {end - start} bytes, not {numel * DTYPE_SIZES[e['dtype']]}; the shard is corrupt")
    return e["dtype"]

