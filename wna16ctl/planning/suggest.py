"""`inspect --suggest`: for each requested TP size that does not load, the nearest changes that do.

Every candidate is one change to what was inspected -- expert parallelism at the same TP size,
another TP size, another vLLM release, another GPU architecture, or a change of the weights'
scheme (act-order `static` instead of `group`, another group size, symmetric weights), or, where
no single change loads, a pair of changes of different kinds -- and is re-planned over the whole model with the same planners `inspect` uses (MoE layers, linear
layers, the engine's model checks).  Only candidates under which every layer loads are kept,
nearest first: changes to how the model is served before changes to the weights (for a proposed
scheme, nothing is quantized yet, so its scheme changes rank with the serving ones), and within
a kind the smallest step first.

Scheme changes are planned by giving every quantized layer the changed scheme, which is exactly
what the planner reads of a layer; `sources.proposed` builds the same layers from headers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from wna16ctl.planning import rules
from wna16ctl.planning.config_parse import config_refusal
from wna16ctl.planning.engine_env import MOE_BACKEND_SINCE
from wna16ctl.planning.inspection import Inspection, replan_loads
from wna16ctl.layout.registry import PLUGIN_LOAD_FORMAT
from wna16ctl.planning.next_steps import PLUGIN_INSTALL
from wna16ctl.planning.serving import plugin_fix
from wna16ctl.sources import Checkpoint
from wna16ctl.sources.config import QuantConfig, WeightScheme
from wna16ctl.sources.model import LinearLayer
from wna16ctl.sources.moe import MoELayer

TP_CANDIDATES = (1, 2, 4, 8, 16)
GROUP_SIZES = (32, 64, 128, -1)  # the group sizes the Marlin kernels are compiled for (-1: channel-wise)
MAX_PER_KIND = 2  # of each kind, the nearest that load

_GPU_NAMES = {"sm75": "Turing", "sm80": "Ampere A100", "sm86": "Ampere", "sm89": "Ada", "sm90": "Hopper",
              "sm100": "Blackwell", "sm120": "Blackwell (consumer)"}


@dataclass(frozen=True)
class Suggestion:
    """One change under which the model loads at `for_tp`'s place, re-planned."""

    for_tp: int  # the requested TP size that is refused
    kind: str  # ep | tp | vllm | gpu | actorder | group_size | symmetric | moe_backend | load_format
    change: str  # what changes, in words
    flags: str  # the exact change: inspect options for serving and proposal changes, the recipe line to requantize
    tp: int  # the deployment re-planned
    ep: bool
    vllm: str
    gpu: str
    vllm_flags: str | None = None  # what `vllm serve` takes for it, where it is a serving change
    recipe: str | None = None  # the recipe line, where it is a change of the weights
    requantize: bool = False  # the checkpoint must be quantized again
    refused: tuple[str, ...] = ()  # the rules that refuse the requested configuration (or its correctness hazard)
    loads: bool = True  # re-planned and loads (only such suggestions are listed)
    cost: float = 0.0  # nearness (lower first); not part of the JSON
    pad: dict[str, Any] | None = None  # kind "pad": the padded sizes, the extra bytes, the re-planned verdict
    memory: dict[str, Any] | None = None  # with a GPU's memory, kinds ep/tp/pad: the deployment's fit (planning.fit)

    def to_json(self) -> dict[str, Any]:
        return {"for_tp": self.for_tp, "kind": self.kind, "change": self.change, "flags": self.flags,
                "vllm_flags": self.vllm_flags, "recipe": self.recipe, "requantize": self.requantize,
                "tp": self.tp, "ep": self.ep, "vllm": self.vllm, "gpu": self.gpu, "refused": list(self.refused),
                "loads": self.loads, "pad": self.pad, "memory": self.memory}


# -- re-planning ------------------------------------------------------------------------------------
SchemeChange = Callable[[WeightScheme], WeightScheme]


def _rescheme_layer(lay: MoELayer, f: SchemeChange) -> MoELayer:
    if lay.scheme is None:
        return lay
    sets = {tuple(None if s is None else f(s) for s in key): experts for key, experts in lay.scheme_sets.items()}
    new = f(lay.scheme)
    return replace(lay, scheme=new, scheme_sets=sets, zero_point_form="none" if new.symmetric else "packed",
                   g_idx_form="present" if new.act_order else "none")


def _rescheme_linear(lay: LinearLayer, f: SchemeChange) -> LinearLayer:
    return replace(lay, shards=[replace(sh, scheme=None if sh.scheme is None else f(sh.scheme)) for sh in lay.shards])


def _config_refusal(quant: QuantConfig | None, version: str, change: SchemeChange | None) -> object | None:
    """The release's config-parse refusal of the checkpoint's groups, after `change` (requantizing
    rewrites every group's weights, so a refused act-order group can go with it)."""
    if quant is not None and change is not None:
        groups = tuple(replace(g, scheme=None if g.scheme is None else change(g.scheme)) for g in quant.groups)
        quant = replace(quant, groups=groups)
    return config_refusal(quant, version)


def loads(insp: Inspection, tp: int, ep: bool, version: str, gpu: str, change: SchemeChange | None = None,
          moe_backend: str | None = None) -> bool:
    """Whether the inspected model loads at `tp` (EP if `ep`) in `version` on `gpu`, with every
    quantized layer's scheme changed by `change`: the same planners as `inspect`, every layer."""
    ck = insp.checkpoint
    # the release parses every config group first: a refused group stops the model at any TP
    if _config_refusal(ck.config.quant, version, change) is not None:
        return False
    layers = ck.layers if change is None else [_rescheme_layer(lay, change) for lay in ck.layers]
    # requantizing gives gate and up one order again: their old g_idx mismatch goes with it
    problems = insp.problems if change is None else None
    switches = insp.switches if moe_backend is None else replace(insp.switches, moe_backend=moe_backend)
    if not backend_known(switches.moe_backend, version):
        return False
    linear_layers = ck.linear_layers if change is None else [_rescheme_linear(lay, change) for lay in ck.linear_layers]
    return replan_loads(insp, tp, ep, version, gpu, layers=layers, linear_layers=linear_layers, problems=problems,
                        switches=switches)


def _refused_rules(insp: Inspection, i: int) -> tuple[str, ...]:
    """The short names of what refuses the i-th requested TP size (config parse, MoE, linear, model)."""
    if insp.config_refusal is not None:  # every layer is "not reached": the group is the reason
        return (f"config: {insp.config_refusal.rule}",)
    out: list[str] = []
    for lay in insp.checkpoint.quantized_layers:
        p = insp.plans[lay.prefix][i]
        if not p.loadable:
            out.append(p.failure_rule or "refused")
    for plans in insp.linear_plans.values():
        lp = plans[i]
        if not lp.loadable:
            out.append(f"linear: {lp.failure_rule or 'refused'}")
    tp = insp.tps[i]
    out += [f"model: {c.rule}" for c in insp.checks if c.tp == tp and c.fatal and not c.ok]
    return tuple(dict.fromkeys(out))


# -- candidates ---------------------------------------------------------------------------------------
def _schemes(insp: Inspection) -> list[WeightScheme]:
    ck = insp.checkpoint
    found = [lay.scheme for lay in ck.quantized_layers]
    found += [sh.scheme for lay in ck.linear_layers for sh in lay.shards if sh.scheme is not None]
    return list(dict.fromkeys(s for s in found if s is not None))


def _with_group(g: int) -> SchemeChange:
    def f(s: WeightScheme) -> WeightScheme:
        if s.strategy not in ("group", "channel"):
            return s
        if g == -1:
            actorder = s.actorder if s.actorder not in ("group", "dynamic") else None  # no groups to order
            return replace(s, group_size=-1, strategy="channel", group_size_null=False, actorder=actorder)
        return replace(s, group_size=g, strategy="group", group_size_null=False)
    return f


def _static_actorder(s: WeightScheme) -> WeightScheme:
    return replace(s, actorder="static") if s.actorder in ("group", "dynamic") else s


def _symmetric(s: WeightScheme) -> WeightScheme:
    return replace(s, symmetric=True)


def _group_distance(a: int, b: int) -> float:
    """Steps between two group sizes on a log scale (channel-wise counts as a group of 2048)."""
    return abs(math.log2(a if a > 0 else 2048) - math.log2(b if b > 0 else 2048))


def _group_text(g: int) -> str:
    return "channel-wise scales (group size -1)" if g == -1 else f"group size {g}"


# the backends a GPU deployment would name (EMULATION is a slow test path, RDNA3 an AMD GPU)
SUGGESTED_MOE_BACKENDS = ("marlin", "triton", "humming", "flashinfer_trtllm")


def backend_known(backend: str, version: str) -> bool:
    return backend == "auto" or rules.version_key(version) >= rules.version_key(MOE_BACKEND_SINCE[backend])


@dataclass(frozen=True)
class _Option:
    """One change to what was inspected: a serving setting, or a change of the weights' scheme."""

    kind: str
    text: str
    cost: float
    tp: int | None = None
    ep: bool | None = None
    version: str | None = None
    gpu: str | None = None
    group_size: int | None = None
    actorder: str | None = None
    symmetric: bool = False
    unordered: bool = False  # channel-wise scales: act-order 'group' goes with them
    moe_backend: str | None = None

    def scheme_change(self) -> SchemeChange | None:
        if self.group_size is not None:
            return _with_group(self.group_size)
        if self.actorder is not None:
            return _static_actorder
        return _symmetric if self.symmetric else None

    def recipe_line(self) -> str | None:
        if self.group_size is not None:
            line = "strategy: channel, group_size: -1" if self.group_size == -1 else f"group_size: {self.group_size}"
            return line + (", actorder: null" if self.unordered else "")
        if self.actorder is not None:
            return f"actorder: {self.actorder}"
        return "symmetric: true" if self.symmetric else None


LIMITS = {"moe_backend": 1, "ep": 1, "tp": MAX_PER_KIND, "vllm": 1, "gpu": 1, "actorder": 1, "group_size": MAX_PER_KIND, "symmetric": 1}
# the kinds of change the search tries, as the table names them when none loads
KINDS_TRIED = {"ep": "TP/EP", "tp": "TP size", "vllm": "vLLM release", "gpu": "GPU", "moe_backend": "--moe-backend",
               "pad": "padding (wna16ctl pad)", "group_size": "group size", "actorder": "act-order",
               "symmetric": "symmetric weights"}
MAX_PAIRS = 4  # pairs of changes listed when no single change loads


def _options(insp: Inspection, tp: int, weight_cost: float) -> list[_Option]:
    """Every single change tried for a refused `tp`, in the order of nearness within its kind."""
    ep, version, gpu = insp.ep, insp.engine.version, insp.gpu
    schemes = _schemes(insp)
    out = [_Option("ep", f"serve with expert parallelism at TP {tp}: each expert stays whole on one rank"
                   if not ep else f"serve without expert parallelism at TP {tp}", 1.0, ep=not ep)]
    for t in sorted((t for t in TP_CANDIDATES if t != tp), key=lambda t: (abs(math.log2(t) - math.log2(tp)), t)):
        out.append(_Option("tp", f"serve at TP {t} instead of {tp}", 3.0 + abs(math.log2(t) - math.log2(tp)), tp=t))
    for v in reversed(rules.RELEASES):  # the newest first
        if v != version:
            newer = rules.version_key(v) > rules.version_key(version)
            out.append(_Option("vllm", f"use vLLM {v}", 6.0 if newer else 6.5, version=v))
    cc = rules.GPUS[gpu]
    for g in sorted((g for g in rules.GPUS if g != gpu), key=lambda g: (abs(rules.GPUS[g] - cc), rules.GPUS[g])):
        out.append(_Option("gpu", f"run on {g} ({_GPU_NAMES.get(g, g)}) GPUs instead of {gpu}: the release ranks its "
                           "backends by device", 8.0, gpu=g))
    for b in SUGGESTED_MOE_BACKENDS:
        if b != insp.switches.moe_backend:
            out.append(_Option("moe_backend", f"tell vLLM --moe-backend {b} instead of "
                               f"{'its automatic choice' if insp.switches.moe_backend == 'auto' else insp.switches.moe_backend}",
                               2.0, moe_backend=b))
    verb = "quantize" if insp.proposal is not None else "requantize"
    if any(s.act_order for s in schemes):
        out.append(_Option("actorder", f"{verb} with act-order 'static' instead of 'group' (the same accuracy recipe "
                           "without g_idx at run time)", weight_cost + 1.0, actorder="static"))
    current = sorted({s.group_size for s in schemes if s.strategy in ("group", "channel")})
    if current:
        ref = current[0]
        for size in sorted((g for g in GROUP_SIZES if g not in current), key=lambda g: (_group_distance(g, ref), g)):
            unordered = size == -1 and any(s.act_order for s in schemes)
            out.append(_Option("group_size", f"{verb} with {_group_text(size)}"
                               + (" without act-order groups" if unordered else ""),
                               weight_cost + 1.0 + _group_distance(size, ref), group_size=size, unordered=unordered))
    if any(not s.symmetric for s in schemes):
        out.append(_Option("symmetric", f"{verb} with symmetric weights (no zero points)", weight_cost + 3.0,
                           symmetric=True))
    return out


def _compose(changes: list[SchemeChange]) -> SchemeChange | None:
    if not changes:
        return None

    def f(s: WeightScheme) -> WeightScheme:
        for c in changes:
            s = c(s)
        return s
    return f


def _try(insp: Inspection, tp: int, opts: tuple[_Option, ...]) -> tuple[int, bool, str, str] | None:
    """The deployment `opts` give, if the model loads under it (None otherwise)."""
    tp_ = next((o.tp for o in opts if o.tp is not None), tp)
    ep_ = next((o.ep for o in opts if o.ep is not None), insp.ep)
    version = next((o.version for o in opts if o.version is not None), insp.engine.version)
    gpu = next((o.gpu for o in opts if o.gpu is not None), insp.gpu)
    backend = next((o.moe_backend for o in opts if o.moe_backend is not None), None)
    change = _compose([c for c in (o.scheme_change() for o in opts) if c is not None])
    return (tp_, ep_, version, gpu) if loads(insp, tp_, ep_, version, gpu, change, backend) else None


def _suggestion(insp: Inspection, tp: int, refused: tuple[str, ...], opts: tuple[_Option, ...],
                where: tuple[int, bool, str, str], best_release: bool) -> Suggestion:
    tp_, ep_, version, gpu = where
    proposal = insp.proposal
    kinds = [o.kind for o in opts]
    parts: list[str] = []
    if "ep" in kinds or "tp" in kinds:
        parts.append(f"--tp {tp_}" + (" --ep" if ep_ else ""))
    if "vllm" in kinds:
        parts.append(f"--vllm {version}")
    if "gpu" in kinds:
        parts.append(f"--gpu {gpu}")
    backend = next((o.moe_backend for o in opts if o.moe_backend is not None), None)
    if backend is not None:
        parts.append(f"--moe-backend {backend}")
    weights = [o for o in opts if o.scheme_change() is not None]
    lines = [line for line in (o.recipe_line() for o in weights) if line]
    if weights and proposal is None:  # the serving options, then the recipe line to requantize with
        parts = [" ".join(parts) + ";"] if parts else []
        parts.append(", ".join(lines))
    elif weights:
        group = next((o.group_size for o in weights if o.group_size is not None), None)
        actorder = next((o.actorder for o in weights if o.actorder is not None), None)
        if actorder is None and any(o.unordered for o in weights):
            actorder = "none"
        symmetric = any(o.symmetric for o in weights)
        if symmetric and (proposal.scheme != "W4A16_ASYM" or proposal.recipe is not None):
            parts.append("symmetric: true")  # no option says it for a recipe or a custom scheme
            symmetric = False
        changed = proposal.with_weights(group_size=group, actorder=actorder, symmetric=True if symmetric else None)
        if group is not None or actorder is not None or symmetric:
            parts.append(changed.command_flags())
    texts = [o.text for o in opts]
    if best_release and "vllm" in kinds:
        texts = [t + (", the newest known release that loads it" if o.kind == "vllm" else "") for t, o in zip(texts, opts)]
    serving = "ep" in kinds or "tp" in kinds
    vllm_flags = " ".join(([f"--tensor-parallel-size {tp_}" + (" --enable-expert-parallel" if ep_ else "")]
                           if serving else []) + ([f"--moe-backend {backend}"] if backend is not None else []))
    return Suggestion(for_tp=tp, kind="+".join(kinds), change="; ".join(texts), flags=" ".join(parts), tp=tp_, ep=ep_,
                      vllm=version, gpu=gpu,
                      vllm_flags=vllm_flags or None,
                      recipe=", ".join(lines) or None, requantize=proposal is None and bool(weights), refused=refused,
                      cost=sum(o.cost for o in opts))


def suggest(insp: Inspection) -> list[Suggestion]:
    """Changes under which the model loads, for every requested TP size that is refused, nearest
    first: single changes; where none loads, pairs of changes of different kinds."""
    # weights not yet quantized change as cheaply as a serving flag; a checkpoint must be requantized
    weight_cost = 1.5 if insp.proposal is not None else 20.0
    out: list[Suggestion] = []
    converted: list[Checkpoint] | None = None  # what `convert` would write, built once where a TP size is refused
    for i, tp in enumerate(insp.tps):
        refused = _refused_rules(insp, i)
        if not refused:
            fix = plugin_fix(insp, i)
            if fix is not None:  # loads with wrong outputs, and the Marlin output served by the plugin is right
                out.append(Suggestion(
                    for_tp=tp, kind="load_format",
                    change="write the Marlin layout and serve it with the wna16ctl load format: it carries the "
                           "corrected w13 scale permutation, where vLLM's own processing gives wrong outputs",
                    flags=fix.repack or "", tp=tp, ep=False, vllm=insp.engine.version, gpu=insp.gpu,
                    vllm_flags=f"--load-format {PLUGIN_LOAD_FORMAT} --moe-backend marlin (after {PLUGIN_INSTALL})",
                    refused=("correctness: w13 scales (PR #50196)",)))
            continue
        options = _options(insp, tp, weight_cost)
        found: list[Suggestion] = []
        taken: dict[str, int] = {}
        for o in options:
            if taken.get(o.kind, 0) >= LIMITS[o.kind]:
                continue
            where = _try(insp, tp, (o,))
            if where is not None:
                taken[o.kind] = taken.get(o.kind, 0) + 1
                found.append(_suggestion(insp, tp, refused, (o,), where, best_release=True))
        if not found:
            pairs = sorted(((a, b) for j, a in enumerate(options) for b in options[j + 1:] if a.kind != b.kind),
                           key=lambda ab: ab[0].cost + ab[1].cost)
            kinds_taken: set[tuple[str, str]] = set()  # the nearest pair of each two kinds only
            for a, b in pairs:
                if len(found) >= MAX_PAIRS:
                    break
                if (a.kind, b.kind) in kinds_taken:
                    continue
                where = _try(insp, tp, (a, b))
                if where is not None:
                    kinds_taken.add((a.kind, b.kind))
                    found.append(_suggestion(insp, tp, refused, (a, b), where, best_release=False))
        padded = _pad_suggestion(insp, tp, refused)
        if padded is not None:
            found.append(padded)
        if converted is None:
            converted = _converted(insp)
        if converted and converted_loads(insp, converted, tp):
            found.append(_convert_suggestion(insp, tp, refused, converted[0]))
        found.sort(key=lambda s: s.cost)
        out += _ranked_by_memory(insp, found)
    return out


def shown_suggestions(found: list[Suggestion], shown: int) -> list[Suggestion]:
    """Of one TP size's suggestions (nearest first), those the table lists: the `shown` nearest,
    and padding in its place among them wherever it is found (`wna16ctl pad` is the fix that keeps
    the deployment asked for, as is expert parallelism); the others are in --json."""
    return [s for i, s in enumerate(found) if i < shown or s.kind == "pad"]


# Padding costs memory and bandwidth in proportion to the bytes it adds: a third more expert bytes
# ranks after expert parallelism and a backend switch, beside another TP size; doubling them ranks
# with requantizing a checkpoint.
PAD_BASE_COST, PAD_COST_PER_GROWTH = 1.0, 10.0


def _pad_suggestion(insp: Inspection, tp: int, refused: tuple[str, ...]) -> Suggestion | None:
    """`wna16ctl pad --tp N`: the smallest exact zero-padding under which the model loads at `tp`,
    re-planned by the padding planner (None where padding does not fix the refusal)."""
    from wna16ctl.errors import WnaError
    from wna16ctl.planning.padding import plan_padding
    from wna16ctl.sink import human_bytes

    try:
        plan = plan_padding(insp, tp)
    except WnaError:
        return None
    if not plan.fields or not plan.verdict.get("loads"):
        return None
    j = plan.to_json()
    growth = max((b - a) / a for a, b in plan.fields.values())
    sizes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in plan.fields.items())
    where = f"--tp {tp}" + (" --ep" if insp.ep else "") + f" --vllm {insp.engine.version} --gpu {insp.gpu}"
    proposal = f" {insp.proposal.command_flags()}" if insp.proposal is not None else ""
    return Suggestion(
        for_tp=tp, kind="pad",
        change=(f"zero-pad the MLP intermediate sizes ({sizes}): exact; {human_bytes(j['extra_bytes'])} more "
                f"({j['extra_percent']}% of the checkpoint): the padded MLPs grow {growth:.0%}, and their memory and "
                "bandwidth per token with them"),
        flags=f"wna16ctl pad CKPT {where}{proposal} -o OUT", tp=tp, ep=insp.ep, vllm=insp.engine.version, gpu=insp.gpu,
        vllm_flags=f"--tensor-parallel-size {tp}" + (" --enable-expert-parallel" if insp.ep else ""),
        refused=refused, cost=PAD_BASE_COST + PAD_COST_PER_GROWTH * growth,
        pad={"fields": j["fields"], "extra_bytes": j["extra_bytes"], "extra_percent": j["extra_percent"],
             "verdict": j["verdict"]})


# Converting keeps every weight exactly, as padding does, and changes only the stored form and the
# quantization method vLLM builds: it ranks just after padding that adds nothing.
CONVERT_COST = 1.0


def _converted(insp: Inspection) -> list[Checkpoint]:
    """[the checkpoint `wna16ctl convert` would write, headers only: compressed-tensors of a GPTQ,
    AWQ or AutoRound source, GPTQ of a compressed-tensors one], or [] where convert does not apply
    (a proposal, a source the target cannot express)."""
    from wna16ctl.conversion.plan import converted_checkpoint
    from wna16ctl.errors import WnaError

    if insp.proposal is not None:
        return []
    try:
        return [converted_checkpoint(insp.checkpoint)]
    except WnaError:
        return []


def converted_loads(insp: Inspection, converted: list[Checkpoint], tp: int) -> bool:
    """Whether the converted checkpoint loads at `tp` with right outputs: its own config parse and
    the planners `inspect` uses over every layer, in the inspected release and GPU."""
    ck = converted[0]
    version = insp.engine.version
    if config_refusal(ck.config.quant, version) is not None:
        return False
    return replan_loads(replace(insp, checkpoint=ck), tp, insp.ep, version, insp.gpu, problems=insp.problems)


def _convert_suggestion(insp: Inspection, tp: int, refused: tuple[str, ...], converted: Checkpoint) -> Suggestion:
    from wna16ctl.sources import formats

    quant = insp.checkpoint.config.quant
    source = quant.quant_method if quant is not None else "source"
    target = formats.of(converted.config.quant)
    to = "" if target is formats.DEFAULT else f" --to {target.quant_method}"
    return Suggestion(
        for_tp=tp, kind="convert",
        change=(f"convert to {formats.CONVERT_TARGETS[target.quant_method][1].written_form}: exact (every code, "
                f"scale and zero point kept); vLLM {insp.engine.version} loads it at TP {tp} through "
                f"the {target.quant_method} method, where the {source} path is refused"),
        flags=f"wna16ctl convert CKPT{to} -o OUT", tp=tp, ep=insp.ep, vllm=insp.engine.version, gpu=insp.gpu,
        vllm_flags=f"--tensor-parallel-size {tp}" + (" --enable-expert-parallel" if insp.ep else ""),
        refused=refused, cost=CONVERT_COST)


# the suggestions whose memory is judged: they hold the same model at another layout of the ranks
_MEMORY_KINDS = ("ep", "tp", "pad")
_FIT_ORDER = {"yes": 0, "maybe": 1, "no": 2, "not_judged": 3}


def _ranked_by_memory(insp: Inspection, found: list[Suggestion]) -> list[Suggestion]:
    """With a GPU's memory (`insp.fit_settings`): each EP, TP and pad suggestion gets its fit, and
    among themselves they are ranked by whether they fit, then by the KV tokens a rank holds (the
    high estimate of the rest of a start), in the places they held by nearness; the others keep
    theirs."""
    if insp.fit_settings is None:
        return found
    judged = {i: _with_memory(insp, s) for i, s in enumerate(found) if s.kind in _MEMORY_KINDS}
    order = sorted(judged.values(), key=_memory_rank)
    slots = iter(order)
    return [next(slots) if i in judged else s for i, s in enumerate(found)]


def _memory_rank(s: Suggestion) -> tuple[int, int]:
    memory = s.memory or {}
    tokens = (memory.get("kv_tokens") or {}).get("value") or [0]
    return _FIT_ORDER[memory.get("fits", "not_judged")], -tokens[0]


def _with_memory(insp: Inspection, s: Suggestion) -> Suggestion:
    from wna16ctl.planning.deployment import deployment_fit
    from wna16ctl.planning.padding import plan_padding

    ck = insp.checkpoint
    if s.kind == "pad":
        plan = plan_padding(insp, s.tp)
        ck = replace(ck, layers=plan.padded_layers, linear_layers=plan.padded_linear)
    f = deployment_fit(ck, s.tp, s.ep, s.vllm, s.gpu, insp.switches, insp.fit_settings, problems=insp.problems)
    j = f.to_json()
    memory = {k: j[k] for k in ("fits", "not_judged", "weights", "kv_tokens", "max_concurrency",
                                "largest_max_model_len", "short_by")}
    lo, hi = f.rest.low, f.rest.high
    if f.not_judged:
        why = f"memory not judged ({f.not_judged})"
    elif f.fits() == "no":
        why = f"does not fit: short by at least {f.short_by() >> 20} MiB for one {f.max_model_len}-token request"
    else:
        why = (f"{'fits' if f.fits() == 'yes' else 'fits only if the rest of a start stays small'}: "
               f"weights {f.weights.loaded_bytes / (1 << 30):.1f} GiB per GPU, KV tokens "
               f"{f.kv_tokens(hi)}-{f.kv_tokens(lo)}, {f.concurrency(hi)}-{f.concurrency(lo)} concurrent "
               f"{f.max_model_len}-token requests")
    return replace(s, memory=dict(memory, why=why), change=f"{s.change}; {why}")
