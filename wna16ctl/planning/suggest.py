"""`inspect --suggest`: for each requested TP size that does not load, the nearest changes that do.

Every candidate is one change to what was inspected -- expert parallelism at the same TP size,
another TP size, another vLLM release, another GPU architecture, or a change of the weights'
scheme (act-order `static` instead of `group`, another group size, symmetric weights) -- and is
re-planned over the whole model with the same planners `inspect` uses (MoE layers, linear
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
from wna16ctl.planning.inspection import Inspection, _params_dtype, plan_all, plan_all_linear
from wna16ctl.planning.linear import model_checks
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.model import QKV, LinearLayer
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
    kind: str  # ep | tp | vllm | gpu | actorder | group_size | symmetric
    change: str  # what changes, in words
    flags: str  # the exact change: inspect options for serving and proposal changes, the recipe line to requantize
    tp: int  # the deployment re-planned
    ep: bool
    vllm: str
    gpu: str
    vllm_flags: str | None = None  # what `vllm serve` takes for it, where it is a serving change
    recipe: str | None = None  # the recipe line, where it is a change of the weights
    requantize: bool = False  # the checkpoint must be quantized again
    refused: tuple[str, ...] = ()  # the rules that refuse the requested configuration
    loads: bool = True  # re-planned and loads (only such suggestions are listed)
    cost: float = 0.0  # nearness (lower first); not part of the JSON

    def to_json(self) -> dict[str, Any]:
        return {"for_tp": self.for_tp, "kind": self.kind, "change": self.change, "flags": self.flags,
                "vllm_flags": self.vllm_flags, "recipe": self.recipe, "requantize": self.requantize,
                "tp": self.tp, "ep": self.ep, "vllm": self.vllm, "gpu": self.gpu, "refused": list(self.refused),
                "loads": self.loads}


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


def loads(insp: Inspection, tp: int, ep: bool, version: str, gpu: str, change: SchemeChange | None = None) -> bool:
    """Whether the inspected model loads at `tp` (EP if `ep`) in `version` on `gpu`, with every
    quantized layer's scheme changed by `change`: the same planners as `inspect`, every layer."""
    ck = insp.checkpoint
    if not ep and any(tp > lay.intermediate_size for lay in ck.quantized_layers):
        return False  # a rank would hold no column (inspect refuses such a size outright)
    layers = ck.layers if change is None else [_rescheme_layer(lay, change) for lay in ck.layers]
    # requantizing gives gate and up one order again: their old g_idx mismatch goes with it
    problems = insp.problems if change is None else None
    plans = plan_all(layers, (tp,), ep, version, gpu, problems, with_differences=False)
    quantized = [lay for lay in layers if lay.quantized]
    if not quantized or not all(plans[lay.prefix][0].loadable for lay in quantized):
        return False
    linear_layers = ck.linear_layers if change is None else [_rescheme_linear(lay, change) for lay in ck.linear_layers]
    linear = plan_all_linear(linear_layers, (tp,), version, gpu, _params_dtype(ck.config.torch_dtype),
                             with_differences=False)
    if not all(p.loadable for plans_ in linear.values() for p in plans_):
        return False
    dims = ck.dims
    attention = any(lay.tp_role == QKV for lay in ck.linear_layers) or dims.num_attention_heads is not None
    return all(c.ok for c in model_checks(dims, tp, ep, version, attention=attention) if c.fatal)


def _refused_rules(insp: Inspection, i: int) -> tuple[str, ...]:
    """The short names of what refuses the i-th requested TP size (MoE, linear, model)."""
    out: list[str] = []
    for lay in insp.checkpoint.quantized_layers:
        p = insp.plans[lay.prefix][i]
        if not p.loadable:
            out.append(p.failure_rule or "refused")
    for plans in insp.linear_plans.values():
        p = plans[i]
        if not p.loadable:
            out.append(f"linear: {p.failure_rule or 'refused'}")
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


def suggest(insp: Inspection) -> list[Suggestion]:
    """Changes under which the model loads, for every requested TP size that is refused, nearest first."""
    proposal = insp.proposal
    version, gpu = insp.engine.version, insp.gpu
    # weights not yet quantized change as cheaply as a serving flag; a checkpoint must be requantized
    weight_cost = 1.5 if proposal is not None else 20.0
    out: list[Suggestion] = []
    schemes = _schemes(insp)
    for i, tp in enumerate(insp.tps):
        refused = _refused_rules(insp, i)
        if not refused:
            continue
        ep = insp.ep
        found: list[Suggestion] = []

        def add(kind: str, change: str, flags: str, cost: float, *, tp_: int = tp, ep_: bool = ep,
                version_: str = version, gpu_: str = gpu, vllm_flags: str | None = None, recipe: str | None = None,
                requantize: bool = False) -> None:
            found.append(Suggestion(for_tp=tp, kind=kind, change=change, flags=flags, tp=tp_, ep=ep_, vllm=version_,
                                    gpu=gpu_, vllm_flags=vllm_flags, recipe=recipe, requantize=requantize,
                                    refused=refused, cost=cost))

        # 1. expert parallelism at the same number of GPUs (or without it, if it was asked for)
        if loads(insp, tp, not ep, version, gpu):
            if not ep:
                add("ep", f"serve with expert parallelism at TP {tp}: each expert stays whole on one rank",
                    f"--tp {tp} --ep", 1.0, ep_=True,
                    vllm_flags=f"--tensor-parallel-size {tp} --enable-expert-parallel")
            else:
                add("ep", f"serve without expert parallelism at TP {tp}", f"--tp {tp}", 1.0, ep_=False,
                    vllm_flags=f"--tensor-parallel-size {tp}")
        # 2. another TP size, nearest first (the smaller of two equally near ones first)
        others = sorted((t for t in TP_CANDIDATES if t != tp), key=lambda t: (abs(math.log2(t) - math.log2(tp)), t))
        n = 0
        for t in others:
            if n < MAX_PER_KIND and loads(insp, t, ep, version, gpu):
                add("tp", f"serve at TP {t} instead of {tp}" + (" (expert parallel)" if ep else ""),
                    f"--tp {t}" + (" --ep" if ep else ""), 3.0 + abs(math.log2(t) - math.log2(tp)), tp_=t,
                    vllm_flags=f"--tensor-parallel-size {t}" + (" --enable-expert-parallel" if ep else ""))
                n += 1
        # 3. another vLLM release: the newest that loads
        for v in reversed(rules.RELEASES):
            if v != version and loads(insp, tp, ep, v, gpu):
                newer = rules.version_key(v) > rules.version_key(version)
                add("vllm", f"use vLLM {v}, the {'newest' if newer else 'newest earlier'} known release that loads it "
                    f"at TP {tp}", f"--vllm {v}", 6.0 if newer else 6.5, version_=v)
                break
        # 4. another GPU architecture, the nearest in compute capability
        cc = rules.GPUS[gpu]
        for g in sorted((g for g in rules.GPUS if g != gpu), key=lambda g: (abs(rules.GPUS[g] - cc), rules.GPUS[g])):
            if loads(insp, tp, ep, version, g):
                add("gpu", f"run on {g} ({_GPU_NAMES.get(g, g)}) GPUs instead of {gpu}: the release ranks "
                    "its backends by device", f"--gpu {g}", 8.0, gpu_=g)
                break
        # 5. the weights: act-order static instead of group, another group size, symmetric
        if any(s.act_order for s in schemes) and loads(insp, tp, ep, version, gpu, _static_actorder):
            add(*_weight_change(proposal, "actorder", "static", "act-order 'static' instead of 'group' (the same "
                                "accuracy recipe without g_idx at run time)"), weight_cost + 1.0,
                recipe="actorder: static", requantize=proposal is None)
        current = sorted({s.group_size for s in schemes if s.strategy in ("group", "channel")})
        if current:
            ref = current[0]
            n = 0
            for g in sorted((g for g in GROUP_SIZES if g not in current), key=lambda g: (_group_distance(g, ref), g)):
                if n < MAX_PER_KIND and loads(insp, tp, ep, version, gpu, _with_group(g)):
                    # channel-wise scales have no groups to order: act-order 'group' goes with them
                    unordered = g == -1 and any(s.act_order for s in schemes)
                    add(*_weight_change(proposal, "group_size", str(g), _group_text(g)
                                        + (" without act-order groups" if unordered else ""), unordered),
                        weight_cost + 1.0 + _group_distance(g, ref),
                        recipe=("strategy: channel, group_size: -1" if g == -1 else f"group_size: {g}")
                        + (", actorder: null" if unordered else ""), requantize=proposal is None)
                    n += 1
        if any(not s.symmetric for s in schemes) and loads(insp, tp, ep, version, gpu, _symmetric):
            add(*_weight_change(proposal, "symmetric", "true", "symmetric weights (no zero points)"), weight_cost + 3.0,
                recipe="symmetric: true", requantize=proposal is None)
        found.sort(key=lambda s: s.cost)
        out += found
    return out


def _weight_change(proposal: Any, kind: str, value: str, what: str, unordered: bool = False) -> tuple[str, str, str]:
    """(kind, change, flags) of a change to the weights (`unordered`: act-order dropped as well)."""
    if proposal is None:
        line = {"actorder": f"actorder: {value}", "group_size": "strategy: channel, group_size: -1" if value == "-1" else
                f"group_size: {value}", "symmetric": f"symmetric: {value}"}[kind]
        return kind, f"requantize with {what}", line + (", actorder: null" if unordered else "")
    if kind == "symmetric":
        if proposal.scheme != "W4A16_ASYM" or proposal.recipe is not None:
            return kind, f"quantize with {what}", "symmetric: true"
        changed = replace(proposal.with_weights(symmetric=True), scheme="W4A16")
    elif kind == "actorder":
        changed = proposal.with_weights(actorder=value)
    else:
        changed = proposal.with_weights(group_size=int(value), actorder="none" if unordered else None)
    return kind, f"quantize with {what}", changed.command_flags()
