"""Which intermediate sizes to pad, and to what: the planner re-run with padded sizes.

An architecture reads its MLP widths from a few config fields (`WIDTH_FIELDS`): the routed
experts' width, the shared experts' (their own field, or a multiple of the routed width), the
dense MLPs'.  For each field whose MLPs do not load at TP N, the padded value is the smallest
that does under the release's rules (`--vllm`, `--gpu`, `--ep`), found by planning the padded
layers with the same planners `inspect` uses.  Sizes move in whole units: whole scale groups (so
the down projection gains whole groups) and whole int32 words of codes.

What padding cannot change (attention heads, KV heads, the vocabulary, the hidden size, a
refused scheme) is refused in one line naming the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from wna16ctl.errors import NotLoadable, UsageError
from wna16ctl.planning.inspection import Inspection, _params_dtype, plan_all, plan_all_linear, wrong_outputs
from wna16ctl.planning.linear import model_checks
from wna16ctl.sources import Checkpoint
from wna16ctl.sources.architectures import ARCHITECTURES, model_types
from wna16ctl.sources import formats
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.formats import CODES, WEIGHT, G_IDX, SCALES, SHAPE, ZERO_POINTS, InputFormat
from wna16ctl.sources.model import QKV, LinearLayer
from wna16ctl.sources.moe import MoELayer

ROUTED, SHARED, DENSE = "routed", "shared", "dense"

# model_type -> {kind: (config field, multiplier field)}: the width of that kind's MLPs is
# config[field] * config[multiplier] (multiplier None: 1), from the architecture table.
# DeepSeek-style shared experts are one MLP of n_shared_experts × the routed width.
WIDTH_FIELDS: dict[str, dict[str, tuple[str, str | None]]] = {
    m: ARCHITECTURES[m].width_fields() for m in model_types(pad=True)}
MLP_LEAVES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MAX_STEPS = 4096  # padded sizes tried per field, in whole units


@dataclass
class PaddedModule:
    """One projection module to pad: gate/up gain rows, down gains input columns."""

    module: str  # e.g. model.layers.1.mlp.experts.3.down_proj
    role: str  # gate | up | down
    kind: str  # routed | shared | dense
    width: int  # the intermediate size it has
    padded: int  # the intermediate size it gets
    scheme: WeightScheme | None  # None: stored unquantized (a `.weight`)
    fmt: InputFormat = field(default=formats.DEFAULT, compare=False)  # the checkpoint's format
    hidden: int = 0  # the model's hidden size (the projection's other dimension)

    def stored_kind(self, suffix: str) -> str:
        """What the module's stored tensor `suffix` is: a role of `sources.formats` (CODES, SCALES,
        ZERO_POINTS, G_IDX, SHAPE, WEIGHT), else the suffix itself (`bias`)."""
        return self.fmt.names.role_of(suffix) or suffix

    @property
    def stored_apart(self) -> bool:
        """Whether its quantized tensors are stored in a form other than the canonical one (the
        format converts them: `InputFormat.read_roles`), so they are padded through that form."""
        return self.scheme is not None and self.fmt.read_roles(self.scheme) is not None

    @property
    def nk(self) -> tuple[int, int]:
        """The projection's (N, K) before padding."""
        return (self.width, self.hidden) if self.role in ("gate", "up") else (self.hidden, self.width)


@dataclass
class PadPlan:
    checkpoint: Checkpoint
    tp: int | None
    ep: bool
    vllm: str
    gpu: str
    fields: dict[str, tuple[int, int]]  # config field -> (original, padded), padded fields only
    modules: dict[str, PaddedModule] = field(default_factory=dict)  # module name -> what it gets
    verdict: dict[str, Any] = field(default_factory=dict)  # the re-planned model at tp
    original_verdict: dict[str, Any] = field(default_factory=dict)
    # the planned model's layers with the padded widths (what `--suggest` judges the memory of)
    padded_layers: list[MoELayer] = field(default_factory=list)
    padded_linear: list[LinearLayer] = field(default_factory=list)
    # the padded checkpoint's per-rank memory at tp (planning.deployment.planned_memory; None without tp)
    memory: dict[str, Any] | None = None

    @property
    def extra_bytes(self) -> int:
        """Bytes the padding adds (codes, scales, zero points, g_idx of the padded modules)."""
        return sum(_module_bytes(self.checkpoint, m, padded=True) - _module_bytes(self.checkpoint, m, padded=False)
                   for m in self.modules.values())

    @property
    def total_bytes(self) -> int:
        return sum(sh.size for sh in self.checkpoint.files.shards)

    def to_json(self) -> dict[str, Any]:
        extra = self.extra_bytes
        kinds: dict[str, dict[str, int]] = {}
        for m in self.modules.values():
            kinds.setdefault(m.kind, {"from": m.width, "to": m.padded, "modules": 0})["modules"] += 1
        return {"checkpoint": str(self.checkpoint.root), "tp": self.tp, "ep": self.ep, "vllm": self.vllm,
                "gpu": self.gpu, "fields": {k: {"from": a, "to": b} for k, (a, b) in self.fields.items()},
                "padded": kinds, "extra_bytes": extra,
                "extra_percent": round(100.0 * extra / max(1, self.total_bytes), 2),
                "original": self.original_verdict, "verdict": self.verdict}


# -- finding the MLP modules ---------------------------------------------------------------------------

def _module_schemes(ck: Checkpoint, modules: list[str]) -> dict[str, WeightScheme | None]:
    """module -> its weight scheme (None: stored unquantized, a `.weight`), every name matched at
    once against the quantization config's targets."""
    quant = ck.config.quant
    codes = formats.of(quant).names.codes
    packed = [mod for mod in modules if f"{mod}.{codes}" in ck.files]
    schemes = quant.schemes_for(packed) if quant is not None and packed else [None] * len(packed)
    found = dict(zip(packed, schemes))
    return {mod: found.get(mod) for mod in modules}


def _width_of(ck: Checkpoint, module: str, role: str, scheme: WeightScheme | None) -> int:
    fmt = formats.of(ck.config.quant)
    info = ck.files.info(fmt.names.tensor(module, CODES if scheme is not None else WEIGHT))
    n, k = fmt.codes_nk(list(info.shape), scheme) if scheme is not None else (int(info.shape[0]), int(info.shape[1]))
    return int(k if role == "down" else n)


def find_mlp_modules(ck: Checkpoint) -> dict[str, list[tuple[str, str, int, WeightScheme | None]]]:
    """kind -> [(module, role, width, scheme)] of every routed expert, shared expert and dense MLP."""
    routed: list[tuple[str, str, int]] = []
    for lay in [*ck.layers, *ck.mtp_layers]:
        for e in range(lay.num_experts):
            for role in ("gate", "up", "down"):
                routed.append((lay.tensor_name(e, role, "weight").removesuffix(".weight"), role, lay.intermediate_size))
    others: list[tuple[str, str, str]] = []  # (module, role, kind)
    seen: set[str] = set()
    stored = formats.of(ck.config.quant).names
    for name in ck.files.names():
        if ".experts." in name:
            continue
        module, _, suffix = name.rpartition(".")
        if suffix not in (WEIGHT, stored.codes) or module in seen:
            continue
        parent, _, leaf = module.rpartition(".")
        if leaf not in MLP_LEAVES or not parent.endswith(("mlp", ".shared_expert", ".shared_experts")):
            continue
        seen.add(module)
        others.append((module, MLP_LEAVES[leaf], SHARED if parent.endswith(("shared_expert", "shared_experts")) else DENSE))
    schemes = _module_schemes(ck, [mod for mod, *_ in routed] + [mod for mod, *_ in others])
    out: dict[str, list[tuple[str, str, int, WeightScheme | None]]] = {ROUTED: [], SHARED: [], DENSE: []}
    for module, role, width in routed:
        if schemes[module] is None and f"{module}.weight" not in ck.files:
            raise UsageError(f"{ck.root}: {module} has neither {stored.codes} nor {WEIGHT}; "
                             "pad rewrites per-expert projections only")
        out[ROUTED].append((module, role, width, schemes[module]))
    for module, role, kind in others:
        out[kind].append((module, role, _width_of(ck, module, role, schemes[module]), schemes[module]))
    return out


# -- planning ----------------------------------------------------------------------------------------------

def _unit(schemes: list[WeightScheme | None]) -> int:
    """The step a width moves in: whole scale groups and whole int32 words of codes."""
    unit = 1
    for s in schemes:
        if s is None:
            continue
        unit = math.lcm(unit, 32 // s.num_bits)
        if s.group_size > 0:
            unit = math.lcm(unit, s.group_size)
    return unit


def _resize_moe(lay: MoELayer, width: int) -> MoELayer:
    return replace(lay, intermediate_size=width)


def _resize_linear(lay: LinearLayer, old: int, new: int) -> LinearLayer:
    """A fused gate_up (column) or down (row) layer with its intermediate width changed."""
    if lay.kind.endswith("down_proj"):
        return replace(lay, input_size=new)
    shards = [replace(sh, output_sizes=tuple(new if n == old else n for n in sh.output_sizes)) for sh in lay.shards]
    return replace(lay, shards=shards)


def _mlp_linear(lay: LinearLayer, kind: str) -> bool:
    shared = ".shared_expert." in f".{lay.name}." or ".shared_experts." in f".{lay.name}."
    mlp = lay.kind.endswith(("gate_up_proj", "down_proj"))
    return mlp and (shared if kind == SHARED else not shared)


@dataclass
class _Model:
    """The model as planned: its MoE and linear layers, some with padded widths."""

    insp: Inspection
    moe: list[MoELayer]
    linear: list[LinearLayer]
    bare: dict[str, int]  # unquantized MLP kind -> width (no quantized plan: vLLM needs width % TP)

    def failures(self, tp: int, kinds: tuple[str, ...] | None = None) -> list[str]:
        """Why the model (or the MLPs of `kinds`) does not load correctly at tp: rule names (or the
        correctness hazard of a layer that loads), empty = loads correctly."""
        insp = self.insp
        version, gpu, ep = insp.engine.version, insp.gpu, insp.ep
        out: list[str] = []
        if kinds is None or ROUTED in kinds:
            moe = [lay for lay in self.moe if lay.quantized]
            if not ep and any(tp > lay.intermediate_size for lay in moe):
                out.append("TP > intermediate size")
            else:
                plans = plan_all(moe, (tp,), ep, version, gpu, insp.problems, with_differences=False,
                                 switches=insp.switches)
                out += [f"{lay.prefix}: {_why_not(plans[lay.prefix][0])}" for lay in moe
                        if _why_not(plans[lay.prefix][0])]
        linear = [lay for lay in self.linear if kinds is None or any(_mlp_linear(lay, k) for k in kinds)]
        plans_ = plan_all_linear(linear, (tp,), version, gpu, _params_dtype(insp.checkpoint.config.torch_dtype),
                                 with_differences=False, switches=insp.switches)
        out += [f"{name}: {_why_not(p[0])}" for name, p in plans_.items() if _why_not(p[0])]
        for kind, width in self.bare.items():  # under EP the routed experts stay whole
            if (kinds is None or kind in kinds) and not (ep and kind == ROUTED) and width % tp:
                out.append(f"{kind} MLP width {width} % TP {tp}")
        if kinds is None:
            dims = insp.checkpoint.dims
            attention = any(lay.tp_role == QKV for lay in insp.checkpoint.linear_layers) or dims.num_attention_heads
            out += [f"model: {c.rule}" for c in model_checks(dims, tp, ep, version, attention=bool(attention))
                    if c.fatal and not c.ok]
        return out


def _why_not(plan: Any) -> str:
    """Why a layer's plan does not count as loading: its refusal's rule, or the correctness hazard
    inspect would report for it (a layer that loads and computes wrong outputs is no rescue);
    empty where it loads correctly."""
    if not plan.loadable:
        return str(plan.failure_rule or "refused")
    if not wrong_outputs(plan.hazards):
        return ""
    return "correctness: " + next(h for h in plan.hazards if wrong_outputs([h]))


def _fields_of(ck: Checkpoint) -> dict[str, tuple[str, str | None]]:
    mt = ck.dims.text_model_type or ck.config.model_type
    fields = WIDTH_FIELDS.get(mt) or WIDTH_FIELDS.get(ck.config.model_type)
    if fields is None:
        raise UsageError(f"{ck.config.path}: pad knows which config fields set the MLP widths of "
                         f"{', '.join(WIDTH_FIELDS)}, not of model_type {mt!r}")
    return fields


def _config_int(ck: Checkpoint, key: str) -> int | None:
    v = ck.config.raw.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def plan_padding(insp: Inspection, tp: int | None, to: int | None = None, source: Checkpoint | None = None) -> PadPlan:
    """The padded sizes for the inspected checkpoint at `tp` (or the routed width `to`).

    `source`: the checkpoint that is written, where it is not the one planned (an unquantized base
    planned as its proposed quantization)."""
    ck = insp.checkpoint
    fields = _fields_of(ck)
    found = find_mlp_modules(ck)
    by_field: dict[str, list[tuple[str, int]]] = {}  # config field -> [(kind, multiplier)]
    for kind, (key, mult) in fields.items():
        if not found[kind]:
            continue
        m = 1 if mult is None else (_config_int(ck, mult) or 1)
        by_field.setdefault(key, []).append((kind, m))
    if not found[ROUTED]:
        raise UsageError(f"{ck.root}: no routed experts found; pad rewrites MoE checkpoints")
    model = _Model(insp, list(ck.layers), list(ck.linear_layers), {})
    quantized_linear = {mod for lay in ck.linear_layers for mod in lay.modules}
    for kind, mods in found.items():
        if kind != ROUTED and mods and not any(m in quantized_linear for m, *_ in mods):
            model.bare[kind] = mods[0][2]
        if kind == ROUTED and mods and all(s is None for *_, s in mods) and not any(lay.quantized for lay in ck.layers):
            model.bare[kind] = mods[0][2]
    refusal = insp.config_refusal if tp is not None else None
    if refusal is not None:
        raise NotLoadable(f"{ck.root}: vLLM {insp.engine.version} refuses its quantization_config ({refusal.rule}) "
                          "at any size; padding the intermediate sizes cannot fix it")
    original = model.failures(tp) if tp is not None else []
    if tp is not None:
        fatal = [f for f in original if f.startswith("model: ")]
        if fatal:
            raise NotLoadable(f"{ck.root}: at TP {tp} the rule '{fatal[0].removeprefix('model: ')}' refuses the "
                              "model; padding the intermediate sizes cannot fix it")
    sizes: dict[str, tuple[int, int]] = {}
    routed: tuple[str, list[tuple[str, int]], int, int] | None = None  # --to's field: key, kinds, base, unit
    for key, kinds in by_field.items():
        width_of = {kind: next(w for _, _, w, _ in found[kind]) for kind, _ in kinds}
        value = _config_int(ck, key)
        base = width_of[kinds[0][0]] // kinds[0][1]
        if value is not None and value != base:
            raise UsageError(f"{ck.config.path}: {key} = {value} but the {kinds[0][0]} MLP tensors are {base} wide; "
                             "fix config.json")
        unit = _unit([s for kind, _ in kinds for *_, s in found[kind]])
        if any(w % unit for w in width_of.values()):
            raise UsageError(f"{ck.root}: the {kinds[0][0]} width {base} is not a multiple of {unit} (whole scale "
                             "groups and int32 words); pad adds whole groups only")
        target: int | None = None
        if to is not None and fields[ROUTED][0] == key:
            if to < base or (to - base) % unit:
                raise UsageError(f"--to {to}: must be at least {base} and {base} plus a multiple of {unit} "
                                 "(whole scale groups)")
            target, routed = to, (key, kinds, base, unit)
        elif tp is None:
            continue
        else:
            target, limit = _smallest(model, ck, kinds, base, unit, tp)
            if target is None:
                why = model.failures(tp, tuple(kind for kind, _ in kinds))
                raise NotLoadable(f"{ck.root}: no padded {key} up to {limit} loads at TP {tp}: "
                                  f"{why[0] if why else 'refused'}; padding the intermediate size cannot fix this rule")
        _apply(model, ck, kinds, base, target)
        if target != base:
            sizes[key] = (base, target)
    if tp is not None:
        left = model.failures(tp)
        if left:
            _refuse_what_is_left(model, ck, tp, to, routed, left)
    if not sizes:  # the one decision: a dry run and a real run refuse alike
        raise UsageError(f"--to {to}: {ck.root}'s routed experts are {to} wide already; nothing to pad"
                         if to is not None else
                         f"{ck.root}: loads at TP {tp} as it is; nothing to pad (pass --to to pad anyway)")
    src = source or ck
    written = found if src is ck else find_mlp_modules(src)
    plan = PadPlan(src, tp, insp.ep, insp.engine.version, insp.gpu, sizes, padded_layers=model.moe,
                   padded_linear=model.linear)
    for key, (base, target) in sizes.items():
        for kind, m in by_field[key]:
            for module, role, width, scheme in written[kind]:
                plan.modules[module] = PaddedModule(module, role, kind, width, target * m, scheme,
                                                    formats.of(src.config.quant), src.config.hidden_size)
    if tp is not None:
        refused = [f for f in original if ": correctness: " not in f]
        plan.original_verdict = {"loads": not refused, "refused": refused[:8],
                                 "wrong_outputs": [f for f in original if ": correctness: " in f][:8]}
        plan.verdict = {"loads": True, "refused": [], **_backends(model, tp)}
    return plan


def _smallest(model: _Model, ck: Checkpoint, kinds: list[tuple[str, int]], base: int, unit: int,
              tp: int) -> tuple[int | None, int]:
    """The smallest width from `base` in steps of `unit` under which the MLPs of `kinds` load at
    `tp` (None where none does up to the limit, returned too); the model keeps that width."""
    names = tuple(kind for kind, _ in kinds)
    # a width that is a multiple of tp × (unit and the Marlin tiles) splits every way a width can:
    # past the next one, no larger width loads where it does not
    whole = tp * math.lcm(unit, 256)
    limit = -(-base // whole) * whole + whole
    for step in range(MAX_STEPS):
        cand = base + step * unit
        if cand > limit:
            break
        _apply(model, ck, kinds, base, cand)
        if not model.failures(tp, names):
            return cand, limit
    _apply(model, ck, kinds, base, base)
    return None, limit


def _refuse_what_is_left(model: _Model, ck: Checkpoint, tp: int, to: int | None,
                         routed: tuple[str, list[tuple[str, int]], int, int] | None, left: list[str]) -> None:
    """The padded model still does not load at `tp`.  Where `--to` chose the routed size and the
    search for the smallest that loads (what `--tp` alone pads to) finds one, the size was wrong:
    say so and name it; else padding cannot fix the rule."""
    if to is not None and routed is not None:
        key, kinds, base, unit = routed
        best, _ = _smallest(model, ck, kinds, base, unit, tp)
        if best is not None and not model.failures(tp):
            raise UsageError(f"--to {to}: {'too small' if best > to else 'does not load'} at TP {tp} ({left[0]}); "
                             f"the smallest {key} that loads there is {best}: pass --to {best}, or leave --to out")
    raise NotLoadable(f"{ck.root}: padded, it still does not load at TP {tp}: {left[0]}; padding the "
                      "intermediate sizes cannot fix this rule")


def _apply(model: _Model, ck: Checkpoint, kinds: list[tuple[str, int]], base: int, value: int) -> None:
    """Give the model's layers of `kinds` the width value × multiplier (from their originals)."""
    for kind, m in kinds:
        old, new = base * m, value * m
        if kind == ROUTED:
            model.moe = [_resize_moe(lay, new) if orig.intermediate_size == old else lay
                         for lay, orig in zip(model.moe, ck.layers)]
        model.linear = [_resize_linear(orig, old, new) if _mlp_linear(orig, kind) else lay
                        for lay, orig in zip(model.linear, ck.linear_layers)]
        if kind in model.bare:
            model.bare[kind] = new


def _backends(model: _Model, tp: int) -> dict[str, Any]:
    insp = model.insp
    moe = [lay for lay in model.moe if lay.quantized]
    if not moe:
        return {}
    plans = plan_all(moe, (tp,), insp.ep, insp.engine.version, insp.gpu, insp.problems, with_differences=False,
                     switches=insp.switches)
    chosen = (plans[lay.prefix][0].backend for lay in moe)
    backends = sorted({backend.value for backend in chosen if backend is not None})
    return {"moe_backends": backends}


def _module_bytes(ck: Checkpoint, m: PaddedModule, padded: bool) -> int:
    """Bytes of one module's tensors at its original or padded width (from the headers)."""
    total = 0
    stored = m.fmt.names
    for suffix in (stored.codes, stored.scales, stored.zero_points, stored.g_idx, WEIGHT, "bias"):
        e = ck.files.raw(f"{m.module}.{suffix}")
        if e is None:
            continue
        nbytes = e["data_offsets"][1] - e["data_offsets"][0]
        if padded and e["shape"]:
            shape = tuple(e["shape"])
            nbytes = math.prod(padded_shape(m, suffix, shape)) * (nbytes // max(1, math.prod(shape)))
        total += nbytes
    return total


def padded_shape(m: PaddedModule, suffix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A module tensor's shape once padded (the one statement of it: header planning and tensor math
    agree).  A quantized tensor of a form other than the canonical one has the shape its format
    stores for the padded projection."""
    s = m.scheme
    if m.stored_apart and len(shape) > 0:
        assert s is not None
        stored = m.fmt.stored_tensors(s, m.role, m.hidden, m.padded).get(suffix)
        if stored is not None:
            return tuple(int(d) for d in stored[1])
    kind = m.stored_kind(suffix)
    return canonical_padded_shape(m, kind, shape)


def canonical_padded_shape(m: PaddedModule, kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The padded shape of a module tensor of role `kind` in the canonical form (`layout.spec`;
    compressed-tensors stores it as it is)."""
    s = m.scheme
    if kind == SHAPE or len(shape) == 0:
        return shape
    if m.role in ("gate", "up"):  # rows: [I, ...]
        if kind == ZERO_POINTS and s is not None and shape[0] != m.width:
            pf = 32 // s.num_bits
            return (-(-m.padded // pf), *shape[1:])
        if kind == G_IDX:
            return shape
        return (m.padded, *shape[1:])
    # down: columns [H, I]
    if kind == G_IDX:
        return (m.padded,)
    if kind == "bias":
        return shape
    if kind == CODES:
        return (shape[0], m.padded * s.num_bits // 32) if s is not None else shape
    if kind in (SCALES, ZERO_POINTS):
        if s is not None and s.group_size > 0:
            return (shape[0], -(-m.padded // s.group_size))
        return shape
    if kind == WEIGHT:
        return (shape[0], m.padded)
    return shape


def open_for_padding(path: str, tp: int | None, ep: bool, vllm: str, gpu: str, env: Any = None,
                     moe_backend: str | None = None, proposal: Any = None) -> tuple[Inspection, Checkpoint]:
    """The checkpoint planned (a quantized checkpoint, or an unquantized base as `proposal` would
    quantize it) and the checkpoint written."""
    from wna16ctl.planning.inspection import inspect_checkpoint, resolve, resolve_switches
    from wna16ctl.sources import open_checkpoint

    tps = (tp,) if tp is not None else (1,)
    if proposal is not None:
        insp = inspect_checkpoint(path, tps, ep, vllm=vllm, gpu=gpu, env=env, moe_backend=moe_backend,
                                  proposal=proposal)
        return insp, open_checkpoint(path)
    ck = open_checkpoint(path)
    if ck.quantized_layers:  # planned and written alike: one scan of its tensors serves both
        insp = inspect_checkpoint(path, tps, ep, vllm=vllm, gpu=gpu, env=env, moe_backend=moe_backend)
        return insp, insp.checkpoint
    if not ck.layers:
        raise UsageError(f"{ck.root}: no routed-expert MoE layers found; pad rewrites MoE checkpoints")
    # an unquantized MoE without a proposed scheme: widths only need to split over the ranks
    insp = Inspection(checkpoint=ck, tps=tps, ep=ep, engine=resolve(vllm, gpu), gpu=gpu, plans={},
                      switches=resolve_switches(env, moe_backend))
    return insp, ck


def summary_lines(plan_json: dict[str, Any], out: str | None = None, ckpt: str | None = None,
                  moe_backend: str = "auto") -> list[str]:
    """What `pad` did (or would do, without `out`), for people; after a write, what to run next:
    `verify` of the padded checkpoint against `ckpt` (the original as the user named it), then its
    serve line."""
    import shlex

    from wna16ctl.planning.fit import memory_lines
    from wna16ctl.planning.next_steps import serve_command
    from wna16ctl.sink import human_bytes

    lines = []
    for key, v in plan_json["fields"].items():
        lines.append(f"{key}: {v['from']} -> {v['to']}")
    for kind, v in plan_json["padded"].items():
        lines.append(f"  {kind}: {v['modules']} projections, intermediate {v['from']} -> {v['to']}")
    lines.append(f"cost: {human_bytes(plan_json['extra_bytes'])} more ({plan_json['extra_percent']}% of the checkpoint); "
                 "MoE memory and bandwidth per token grow by the same share of the padded projections")
    tp, verdict = plan_json["tp"], plan_json["verdict"]
    if tp is not None:
        was = _original_was(plan_json["original"])
        backends = ", ".join(verdict.get("moe_backends", [])) or "-"
        lines.append(f"at TP {tp}{' EP' if plan_json['ep'] else ''} on vLLM {plan_json['vllm']} {plan_json['gpu']}: "
                     f"original {was}; padded {'loads' if verdict.get('loads') else 'refused'} (MoE backend {backends})")
    lines += memory_lines(plan_json.get("memory"))
    if out is not None:
        original = ckpt if ckpt is not None else plan_json["checkpoint"]
        lines += [f"wrote {out}",
                  "next: prove the padding (originals unchanged, additions the zero code, the same outputs)",
                  f"  {shlex.join(['wna16ctl', 'verify', str(original), str(out)])}"]
        step = padded_serve_path(out, plan_json, moe_backend) if tp is not None else None
        if step is not None:
            lines += [f"next: serve the padded checkpoint: {step.why}"] + [f"  {line}" for line in step.lines()]
        elif tp is not None:
            lines += ["next: serve the padded checkpoint as it is (stock vLLM, the default load format)",
                      f"  {serve_command(out, None, tp, ep=bool(plan_json['ep']), moe_backend=moe_backend)}"]
        else:
            lines += ["next: serve the padded checkpoint as it is", f"  {shlex.join(['vllm', 'serve', str(out)])}"]
    return lines


def padded_serve_path(out: str, plan_json: dict[str, Any], moe_backend: str) -> Any:
    """How the padded checkpoint at `out` is served: `planning.serving.serve_path`'s answer for it
    (the one `inspect` of the padded checkpoint prints); None where it cannot be read back."""
    from wna16ctl.errors import WnaError
    from wna16ctl.planning.engine_env import make_switches
    from wna16ctl.planning.serving import serve_path
    from wna16ctl.sources import open_checkpoint

    try:
        ck = open_checkpoint(out)
    except (WnaError, OSError):
        return None
    return serve_path(ck, int(plan_json["tp"]), ep=bool(plan_json["ep"]), version=str(plan_json["vllm"]),
                      gpu=str(plan_json["gpu"]), switches=make_switches(moe_backend=moe_backend))


def _original_was(verdict: dict[str, Any]) -> str:
    """The original's verdict in a few words: refused, loads with wrong outputs, or loads."""
    if not verdict.get("loads"):
        return "refused (" + "; ".join(verdict["refused"][:2]) + ")"
    if verdict.get("wrong_outputs"):
        return "loads but outputs would be wrong (" + verdict["wrong_outputs"][0].split(": correctness: ")[0] + ")"
    return "loads"
