"""`inspect`: the planner run over every MoE layer of a checkpoint at each requested TP size, for
one vLLM release (or every known release)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from wna16ctl.version import __version__
from wna16ctl.planning import methods, rules
from wna16ctl.planning.config_parse import NOT_REACHED, ConfigRefusal, config_refusal
from wna16ctl.planning.engine_env import DEFAULT as DEFAULT_SWITCHES, EngineSwitches, make_switches
from wna16ctl.sources import Checkpoint, LinearLayer, MoELayer, open_checkpoint
from wna16ctl.sources.gidx import gate_up_g_idx_mismatch
from wna16ctl.sources.model import QKV
from wna16ctl.planning.linear import LinearPlan, ModelCheck, linear_release_differences, model_checks, plan_linear
from wna16ctl.errors import UsageError
from wna16ctl.planning.moe import LayerPlan, local_expert_counts, plan_layer, release_differences
from wna16ctl.planning.tpsizes import check_tp_sizes


# Hazard severities.  A correctness hazard means the engine loads the layer and computes wrong
# outputs (or cannot really load what it planned): `inspect` exits 1 on one, as on a refusal.
# Informational ones (other releases' outcomes, tile padding, another backend's conversion) do not
# change the exit code.  The planner states hazards as sentences; their severity is read here
# from what the sentence says happens.
CORRECTNESS = "correctness"
INFO = "info"
_WRONG = ("outputs are wrong", "outputs would be wrong", "wrong outputs", "garbage", "wrong bit width",
          "cannot load", "starts inside a packed word")
_OTHER_RELEASES = re.compile(r"vLLM \d+\.\d+\.\d+[^:]*: ")  # "vLLM 0.27.0–0.29.0: loads on marlin"


def hazard_severity(text: str) -> str:
    """`CORRECTNESS` when the hazard says this release computes wrong outputs, else `INFO`."""
    if _OTHER_RELEASES.match(text):
        return INFO
    return CORRECTNESS if any(w in text for w in _WRONG) else INFO


def wrong_outputs(hazards: Iterable[str]) -> bool:
    """The hazard verdict: whether a plan that loads computes wrong outputs (one of its hazards is
    a correctness hazard).  Every view of a verdict (the table, the release matrix, the summary,
    the exit code) asks this one question."""
    return any(hazard_severity(h) == CORRECTNESS for h in hazards)


# What one requested TP size gets in one release (`Inspection.outcomes`)
LOADS, WRONG, FAILS = "loads", "wrong outputs", "fails"


def _tp_text(tps: list[int]) -> str:
    return "TP " + ", ".join(map(str, tps))


@dataclass
class Inspection:
    checkpoint: Checkpoint
    tps: tuple[int, ...]
    ep: bool
    engine: rules.Engine
    gpu: str
    plans: dict[str, list[LayerPlan]]  # layer prefix -> one plan per TP size
    # every known release's plans, when all were asked for (release -> prefix -> plans)
    versions: dict[str, dict[str, list[LayerPlan]]] = field(default_factory=dict)
    linear_plans: dict[str, list[LinearPlan]] = field(default_factory=dict)  # linear layer name -> per TP
    linear_versions: dict[str, dict[str, list[LinearPlan]]] = field(default_factory=dict)
    checks: list[ModelCheck] = field(default_factory=list)  # model-level checks, every TP size
    # data-level errors per layer prefix (gate/up g_idx that differ), which every plan of the layer carries
    problems: dict[str, str | None] = field(default_factory=dict)
    proposal: Any = None  # a proposed quantization of an unquantized base (`sources.proposed.Proposal`)
    suggestions: list[Any] | None = None  # changes that load where a TP size is refused (`planning.suggest`)
    switches: EngineSwitches = DEFAULT_SWITCHES  # --env overrides and --moe-backend
    # the config-parse refusal of each planned release (None: quantization_config parses)
    refusals: dict[str, ConfigRefusal | None] = field(default_factory=dict)
    # TP size -> whether the model loads there with expert parallelism (re-planned on first need)
    _ep_replans: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)
    fits: list[Any] | None = None  # per TP size that loads, weights and KV cache against a GPU (planning.fit)
    fit_settings: Any = None  # the GPU and vLLM options those are judged against (planning.fit.FitSettings)

    @property
    def config_refusal(self) -> ConfigRefusal | None:
        return self.refusals.get(self.engine.version)

    @property
    def loadable(self) -> bool:
        return (self.config_refusal is None and _loadable(self.checkpoint, self.plans)
                and self.model_loadable(self.linear_plans))

    def loadable_in(self, version: str) -> bool:
        return (self.refusals.get(version) is None and _loadable(self.checkpoint, self.versions[version])
                and self.model_loadable(self.linear_versions[version]))

    def model_loadable(self, linear: dict[str, list[LinearPlan]]) -> bool:
        """The model around the experts: every quantized linear layer and every fatal model check."""
        return (all(p.loadable for plans in linear.values() for p in plans)
                and all(c.ok for c in self.checks if c.fatal))

    def ok_in(self, version: str) -> bool:
        """Every requested TP size loads in `version` and no correctness hazard applies."""
        return all(outcome == LOADS for outcome, _ in self.outcomes(version).values())

    @property
    def ok(self) -> bool:
        """Exit 0: every requested TP size loads and no correctness hazard applies, in the planned
        release, or in every known release when all were asked for (`--vllm all`)."""
        return all(self.ok_in(v) for v in (rules.RELEASES if self.versions else (self.engine.version,)))

    def outcomes(self, version: str | None = None) -> dict[int, tuple[str, list[str]]]:
        """Per requested TP size in `version` (default: the planned release): LOADS, WRONG (it loads,
        but `wrong_outputs`) or FAILS, with the rules that refuse it (empty unless FAILS)."""
        fatal = {c.tp: c.rule for c in self.checks if c.fatal and not c.ok}
        out: dict[int, tuple[str, list[str]]] = {}
        for tp in self.tps:
            plans = [p for _, _, p in self._all_plans(version) if p.tp == tp]
            failed = list(dict.fromkeys([p.failure_rule or "refused" for p in plans if not p.loadable]
                                        + ([fatal[tp]] if tp in fatal else [])))
            if failed or not self.checkpoint.quantized_layers:
                out[tp] = (FAILS, failed)
            else:
                out[tp] = (WRONG if wrong_outputs(h for p in plans for h in p.hazards) else LOADS, [])
        return out

    def _all_plans(self, version: str | None = None) -> list[tuple[str, str, Any]]:
        """(kind, layer name, plan) for every quantized MoE layer and linear layer at every TP size,
        in `version` (default: the planned release)."""
        moe, linear = ((self.plans, self.linear_plans) if version is None or version == self.engine.version
                       else (self.versions[version], self.linear_versions[version]))
        out: list[tuple[str, str, Any]] = [("moe", lay.prefix, p) for lay in self.checkpoint.quantized_layers
                                           for p in moe[lay.prefix]]
        out += [("linear", lay.name, p) for lay in self.checkpoint.linear_layers for p in linear[lay.name]]
        return out

    def hazards(self) -> list[dict[str, Any]]:
        """Each distinct hazard once, with its severity, the layers and the TP sizes it applies to."""
        grouped: dict[str, dict[str, Any]] = {}
        for _, name, p in self._all_plans():
            for text in p.hazards:
                h = grouped.setdefault(text, {"severity": hazard_severity(text), "text": text, "layers": [], "tp": []})
                if name not in h["layers"]:
                    h["layers"].append(name)
                if p.tp not in h["tp"]:
                    h["tp"].append(p.tp)
        return sorted(grouped.values(), key=lambda h: h["severity"] != CORRECTNESS)

    def loads_with_ep(self, tp: int) -> bool:
        """Whether the whole model loads at `tp` with expert parallelism (re-planned, as `--suggest`
        does); False when EP was inspected already or the release refuses the config."""
        if self.ep or self.config_refusal is not None or not self.checkpoint.quantized_layers:
            return False
        if tp not in self._ep_replans:
            self._ep_replans[tp] = replan_loads(self, tp, True, self.engine.version, self.gpu, problems=self.problems)
        return self._ep_replans[tp]

    def tp_loads(self, i: int) -> bool:
        """Whether the i-th requested TP size loads: every MoE layer, every linear layer, every fatal
        model check (correctness hazards aside)."""
        tp = self.tps[i]
        return (self.config_refusal is None and bool(self.checkpoint.quantized_layers)
                and all(self.plans[lay.prefix][i].loadable for lay in self.checkpoint.quantized_layers)
                and all(p[i].loadable for p in self.linear_plans.values())
                and all(c.ok for c in self.checks if c.fatal and c.tp == tp))

    def next_steps(self) -> list[Any]:
        """Per loadable TP size, the layout to write and the `repack` and `vllm serve` lines
        (`planning.next_steps`)."""
        from wna16ctl.planning.serving import inspect_next_steps

        return inspect_next_steps(self)

    def summary(self) -> dict[str, Any]:
        """Per TP size: loads, loads with wrong outputs, or fails (the rules, and whether --ep helps);
        `text` is the line that ends every inspect table, and `vllm` the release it is for."""
        loads: list[int] = []
        wrong: list[int] = []
        fails: dict[int, list[str]] = {}
        with_ep: list[int] = []
        for tp, (outcome, rules_failed) in self.outcomes().items():
            if outcome == FAILS:
                fails[tp] = rules_failed
                if self.loads_with_ep(tp):
                    with_ep.append(tp)
            else:
                (wrong if outcome == WRONG else loads).append(tp)
        parts = [f"loads at {_tp_text(loads)}"] if loads else [] if wrong else ["loads at no requested TP size"]
        if wrong:
            parts.append(f"{_tp_text(wrong)} load{'s' if len(wrong) == 1 else ''} but outputs would be wrong "
                         "(correctness hazard above)")
        failing = [tp for tp in fails if tp not in with_ep]
        if failing:
            why = ", ".join(dict.fromkeys(r for tp in failing for r in fails[tp]))
            parts.append(f"{_tp_text(failing)} do{'es' if len(failing) == 1 else ''} not load ({why})")
        if with_ep:
            why = ", ".join(dict.fromkeys(r for tp in with_ep for r in fails[tp]))
            parts.append(f"{_tp_text(with_ep)} need{'s' if len(with_ep) == 1 else ''} --ep ({why} without it)")
        return {"vllm": self.engine.version, "loads": loads, "wrong_outputs": wrong,
                "fails": {str(tp): r for tp, r in fails.items()}, "loads_with_ep": with_ep,
                "text": self._release_said() + "; ".join(parts)}

    def _release_said(self) -> str:
        """Where `--vllm` (or the installed package) named a release the rulebook does not know, the
        known one the verdict is for, so that nobody reads it as the named one's."""
        e = self.engine
        if e.note is None or e.source == "default" or e.requested == e.version:
            return ""
        return f"for vLLM {e.version} (the known release planned for {e.requested}): "

    def _linear_json(self, linear: dict[str, list[LinearPlan]]) -> list[dict[str, Any]]:
        return [
            {
                "name": lay.name,
                "kind": lay.kind,
                "layer_index": lay.layer_index,
                "modules": lay.modules,
                "tp_role": lay.tp_role,
                "input_size": lay.input_size,
                "output_sizes": list(lay.output_sizes),
                "scheme": None if lay.scheme is None else lay.scheme.to_json(),
                "plans": [p.to_json() for p in linear[lay.name]],
            }
            for lay in self.checkpoint.linear_layers
        ]

    def _layers_json(self, plans: dict[str, list[LayerPlan]]) -> list[dict[str, Any]]:
        return [
            {
                "name": lay.prefix,
                "layer_index": lay.layer_index,
                "num_experts": lay.num_experts,
                "hidden_size": lay.hidden_size,
                "intermediate_size": lay.intermediate_size,
                "scheme": None if lay.scheme is None else lay.scheme.to_json(),
                "scale_dtype": lay.scale_dtype,
                "zero_point_form": lay.zero_point_form,
                "packed_bytes": lay.packed_bytes,
                "plans": [p.to_json() for p in plans[lay.prefix]],
            }
            for lay in self.checkpoint.layers
        ]

    def to_json(self) -> dict[str, Any]:
        ck = self.checkpoint
        cfg = ck.config
        out: dict[str, Any] = {
            "wna16ctl_version": __version__,
            "engine": {**self.engine.to_json(), "env": self.switches.to_json(self.engine.version),
                       "moe_backend": self.switches.moe_backend},
            "gpu": self.gpu,
            "checkpoint": str(ck.root),
            **({"source": dict(ck.source)} if ck.source is not None else {}),
            "architecture": cfg.architectures[0] if cfg.architectures else None,
            "model_type": cfg.model_type,
            "quantization": None if cfg.quant is None else {
                "format": cfg.quant.format, "version": cfg.quant.version,
            },
            "tp": list(self.tps),
            "ep": self.ep,
            "loadable": self.loadable,
            "ok": self.ok,
            "summary": self.summary(),
            "hazards": self.hazards(),
            # "config": quantization_config itself is refused (config_refusal says which group)
            "failure_stage": None if self.config_refusal is None else "config",
            "config_refusal": None if self.config_refusal is None else self.config_refusal.to_json(),
            "warnings": list(ck.warnings),
            **({"memory": [f.to_json() for f in self.fits]} if self.fits is not None else {}),
            "layers": self._layers_json(self.plans),
            "linear_layers": self._linear_json(self.linear_plans),
            "model_checks": [c.to_json() for c in self.checks],
            "mtp_layers": [{"name": lay.prefix, "num_experts": lay.num_experts,
                            "scheme": None if lay.scheme is None else lay.scheme.to_json()} for lay in ck.mtp_layers],
            "unplaced_linear": list(ck.unplaced_linear),
            "proposed": self.proposal is not None,
        }
        if self.proposal is not None:
            out["proposal"] = self.proposal.to_json()
        if self.suggestions is not None:
            out["suggestions"] = [s.to_json() for s in self.suggestions]
        out["next_steps"] = [s.to_json() for s in self.next_steps()]
        if self.versions:
            out["versions"] = []
            for v in rules.RELEASES:
                refusal = self.refusals.get(v)
                out["versions"].append(
                    {"vllm": v, "loadable": self.loadable_in(v), "ok": self.ok_in(v),
                     "wrong_outputs": [tp for tp, (o, _) in self.outcomes(v).items() if o == WRONG],
                     "failure_stage": None if refusal is None else "config",
                     "config_refusal": None if refusal is None else refusal.to_json(),
                     "layers": self._layers_json(self.versions[v]),
                     "linear_layers": self._linear_json(self.linear_versions[v])})
        return out


def resolve(vllm: str | None, gpu: str) -> rules.Engine:
    """The release for `--vllm` (`all` plans the newest first) after checking `--gpu`; bad values are
    usage errors."""
    if gpu not in rules.GPUS:
        raise UsageError(f"--gpu {gpu!r} is not one of {', '.join(rules.GPUS)}")
    try:
        return rules.resolve_engine("latest" if vllm == "all" else vllm)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resolve_switches(env: Iterable[str] | dict[str, str] | None, moe_backend: str | None) -> EngineSwitches:
    """`--env` items and `--moe-backend` -> the engine switches; bad values are usage errors."""
    try:
        return make_switches(env, moe_backend)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _loadable(ck: Checkpoint, plans: dict[str, list[LayerPlan]]) -> bool:
    layers = ck.quantized_layers
    return bool(layers) and all(p.loadable for lay in layers for p in plans[lay.prefix])


def _layer_key(lay: MoELayer) -> tuple:
    """Layers with equal keys get equal plans (names aside): plan each distinct one once."""
    return (lay.scheme, tuple((k, tuple(v)) for k, v in lay.scheme_sets.items()), lay.num_experts, lay.hidden_size,
            lay.intermediate_size, lay.scale_dtype, lay.zero_point_form)


def not_reached_plan(lay: MoELayer, tp: int, ep: bool, version: str, gpu: str, refusal: ConfigRefusal) -> LayerPlan:
    """The row of an MoE layer in a checkpoint the release refuses at config parse: nothing after
    the parse is computed, so every later field is null."""
    moe_tp = 1 if ep else tp
    plan = LayerPlan(tp=tp, ep=ep, moe_tp=moe_tp, intermediate_size_per_partition=lay.intermediate_size // moe_tp,
                     padded_intermediate=None, backend=None, rejected={}, w2=None, quant_type=None,
                     local_experts=local_expert_counts(lay.num_experts, tp) if ep else [lay.num_experts] * tp,
                     rank_bytes=None, vllm=version, gpu=gpu)
    plan.fail("config", "not reached", f"{NOT_REACHED}: {refusal.text()}")
    return plan


def not_reached_linear(tp: int, version: str, gpu: str, refusal: ConfigRefusal) -> LinearPlan:
    plan = LinearPlan(tp=tp, vllm=version, gpu=gpu)
    plan.fail("config", "not reached", f"{NOT_REACHED}: {refusal.text()}")
    return plan


def plan_all(layers: list[MoELayer], tps: tuple[int, ...], ep: bool, version: str, gpu: str,
             problems: dict[str, str | None] | None = None, with_differences: bool = True,
             switches: EngineSwitches = DEFAULT_SWITCHES,
             refusal: ConfigRefusal | None = None) -> dict[str, list[LayerPlan]]:
    """Plans of every layer at every TP size for one release; hazards include what other releases do.
    `problems`: a data-level error per layer (found in the tensors, not the headers) that every plan carries.
    `refusal`: the release refuses quantization_config itself, so no layer is reached."""
    if refusal is not None:
        return {lay.prefix: [not_reached_plan(lay, tp, ep, version, gpu, refusal) for tp in tps] for lay in layers}
    memo: dict[tuple, list[LayerPlan]] = {}
    out: dict[str, list[LayerPlan]] = {}
    for lay in layers:
        problem = (problems or {}).get(lay.prefix)
        key = (_layer_key(lay), problem)
        if key not in memo:
            plans = [plan_layer(lay, tp, ep, version, gpu, switches) for tp in tps]
            if with_differences:
                for p in plans:
                    p.hazards[:0] = release_differences(lay, p.tp, ep, version, gpu, switches)
            if problem is not None:
                for p in plans:
                    p.fail("load", "g_idx differ", problem)
            memo[key] = plans
        out[lay.prefix] = memo[key]
    return out


def _linear_key(lay: LinearLayer) -> tuple:
    """Linear layers with equal keys get equal plans (names aside)."""
    # a GPTQ/AWQ/auto-round layer's method follows its own name (dynamic rules, module lists): one plan each
    own = lay.name if methods.uses_format_method(lay.quant_method) else None
    return (lay.tp_role, lay.input_size, lay.output_sizes, tuple(s.scheme for s in lay.shards), lay.head_dim,
            lay.num_heads, lay.num_kv_heads, lay.refused, own)


def plan_all_linear(layers: list[LinearLayer], tps: tuple[int, ...], version: str, gpu: str, dtype: str,
                    with_differences: bool = True, switches: EngineSwitches = DEFAULT_SWITCHES,
                    refusal: ConfigRefusal | None = None) -> dict[str, list[LinearPlan]]:
    """Plans of every linear layer at every TP size for one release; each distinct shape is planned once."""
    if refusal is not None:
        return {lay.name: [not_reached_linear(tp, version, gpu, refusal) for tp in tps] for lay in layers}
    memo: dict[tuple, tuple[str, list[LinearPlan]]] = {}
    out: dict[str, list[LinearPlan]] = {}
    for lay in layers:
        key = _linear_key(lay)
        if key not in memo:
            plans = [plan_linear(lay, tp, version, gpu, dtype, switches) for tp in tps]
            if with_differences:
                for p in plans:
                    p.hazards[:0] = linear_release_differences(lay, p.tp, version, gpu, dtype, switches)
            memo[key] = (lay.name, plans)
            out[lay.name] = plans
            continue
        first, plans = memo[key]
        # the engine's texts name the layer: a reused plan names this one
        out[lay.name] = [p if not any(first in t for t in p.errors + p.hazards) else
                         replace(p, errors=[t.replace(first, lay.name) for t in p.errors],
                                 hazards=[t.replace(first, lay.name) for t in p.hazards])
                         for p in plans]
    return out


def replan_loads(insp: Inspection, tp: int, ep: bool, version: str, gpu: str, *,
                 layers: list[MoELayer] | None = None, linear_layers: list[LinearLayer] | None = None,
                 problems: dict[str, str | None] | None = None, switches: EngineSwitches | None = None) -> bool:
    """Whether the inspected model loads at `tp` (EP if `ep`) in `version` on `gpu` with right
    outputs, re-planned with the planners `inspect` uses over every MoE layer, every linear layer
    and the engine's model checks.  `layers`/`linear_layers`: the layers with a changed scheme (default: the checkpoint's);
    `problems`: the data-level errors that still apply; `switches`: the engine's (default: inspected).
    `--suggest` and the summary's "needs --ep" both ask this one question."""
    ck = insp.checkpoint
    layers = ck.layers if layers is None else layers
    quantized = [lay for lay in layers if lay.quantized]
    if not quantized or (not ep and any(tp > lay.intermediate_size for lay in quantized)):
        return False  # a rank would hold no column (inspect refuses such a size outright)
    switches = insp.switches if switches is None else switches
    plans = plan_all(layers, (tp,), ep, version, gpu, problems, with_differences=False, switches=switches)
    # loads, and with right outputs: the hazard verdict of inspect's own table (`wrong_outputs`)
    if not all(plans[lay.prefix][0].loadable and not wrong_outputs(plans[lay.prefix][0].hazards) for lay in quantized):
        return False
    linear = plan_all_linear(ck.linear_layers if linear_layers is None else linear_layers, (tp,), version, gpu,
                             _params_dtype(ck.config.torch_dtype), with_differences=False, switches=switches)
    if not all(p.loadable and not wrong_outputs(p.hazards) for plans_ in linear.values() for p in plans_):
        return False
    return all(c.ok for c in checkpoint_model_checks(ck, tp, ep, version) if c.fatal)


def _params_dtype(torch_dtype: str) -> str:
    """The activation dtype the linear kernels see (vLLM's params_dtype from the model dtype)."""
    t = torch_dtype.lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(t, t)


def checkpoint_model_checks(ck: Checkpoint, tp: int, ep: bool, version: str) -> list[ModelCheck]:
    """The engine's checks on the model's sizes (heads, KV heads, vocabulary, ...) for `ck` at `tp` ranks."""
    dims = ck.dims
    has_attention = any(lay.tp_role == QKV for lay in ck.linear_layers) or dims.num_attention_heads is not None
    return model_checks(dims, tp, ep, version, attention=has_attention)


def model_refusal(ck: Checkpoint, tp: int, ep: bool, version: str, gpu: str,
                  switches: EngineSwitches = DEFAULT_SWITCHES) -> str | None:
    """What stops release `version` at `tp` outside the routed experts, as the engine says it: the
    first fatal model check (engine arguments before model construction), else the first quantized
    linear layer no kernel takes.  None when the model around the experts loads.  These are the
    checks behind inspect's verdict, for the commands that write or certify an output."""
    failed = sorted((c for c in checkpoint_model_checks(ck, tp, ep, version) if c.fatal and not c.ok),
                    key=lambda c: c.stage != "config")
    if failed:
        return f"{failed[0].rule}: {(failed[0].error or '').rstrip('.')}"
    linear = plan_all_linear(ck.linear_layers, (tp,), version, gpu, _params_dtype(ck.config.torch_dtype),
                             with_differences=False, switches=switches)
    for name, (plan,) in linear.items():
        if not plan.loadable:
            why = plan.errors[0] if plan.errors else "no kernel takes it"
            return why if name in why else f"{name}: {why}"
    return None


def inspect_checkpoint(path: str | os.PathLike[str], tps: tuple[int, ...] = (1,), ep: bool = False,
                       vllm: str | None = "installed", gpu: str = rules.DEFAULT_GPU,
                       revision: str | None = None, env: Iterable[str] | dict[str, str] | None = None,
                       moe_backend: str | None = None, proposal: Any = None) -> Inspection:
    """Plan every MoE layer of the checkpoint at `path` for each TP size in `tps`.

    `path`: a checkpoint directory, or a Hub model repo id ORG/NAME[@REVISION] (headers only).
    `proposal`: plan the unquantized base at `path` as `sources.proposed` quantizes it.

    `vllm`: a release (`0.33.0`), `latest`, `installed` (the vllm package here, else the newest
    known release) or `all` (every known release; `plans` are then the newest's).

    `env`: the engine's environment overrides (`NAME=VALUE` items or a mapping, e.g.
    VLLM_USE_FLASHINFER_MOE_INT4=1); `moe_backend`: the engine's `--moe-backend` (default auto).
    """
    every = vllm == "all"
    engine = resolve(vllm, gpu)
    switches = resolve_switches(env, moe_backend)
    if proposal is not None:
        from wna16ctl.sources.proposed import open_proposed

        ck = open_proposed(path, proposal, revision)
        ck.require_shape_keys()
    elif revision is None and os.path.exists(path):  # a local checkpoint: no need of the Hub module
        ck = open_checkpoint(path)
        ck.require_wna16_moe()
    else:
        from wna16ctl.sources.hub import open_hub_checkpoint, parse_ref

        ref = parse_ref(str(path), revision)
        ck = open_checkpoint(path) if ref is None else open_hub_checkpoint(ref)
        ck.require_wna16_moe()
    check_tp_sizes(ck.quantized_layers, tps, ep)
    # a data-level rule (reads the small g_idx vectors): the same check repack refuses with; a
    # proposal has no tensors yet (GPTQ gives gate and up, which share their input, one order)
    problems = {} if proposal is not None else {
        lay.prefix: gate_up_g_idx_mismatch(ck.files, lay) for lay in ck.quantized_layers}
    refusals = {v: config_refusal(ck.config.quant, v) for v in (rules.RELEASES if every else (engine.version,))}
    plans = plan_all(ck.layers, tps, ep, engine.version, gpu, problems, switches=switches,
                     refusal=refusals[engine.version])
    versions = {v: (plans if v == engine.version else plan_all(ck.layers, tps, ep, v, gpu, problems,
                                                                       with_differences=False, switches=switches,
                                                                       refusal=refusals[v]))
                for v in rules.RELEASES} if every else {}
    dtype = _params_dtype(ck.config.torch_dtype)
    linear = plan_all_linear(ck.linear_layers, tps, engine.version, gpu, dtype, switches=switches,
                             refusal=refusals[engine.version])
    linear_versions = {v: (linear if v == engine.version else
                           plan_all_linear(ck.linear_layers, tps, v, gpu, dtype, with_differences=False,
                                           switches=switches, refusal=refusals[v]))
                       for v in rules.RELEASES} if every else {}
    checks = [c for tp in tps for c in checkpoint_model_checks(ck, tp, ep, engine.version)]
    return Inspection(checkpoint=ck, tps=tuple(tps), ep=ep, engine=engine, gpu=gpu, plans=plans, versions=versions,
                      linear_plans=linear, linear_versions=linear_versions, checks=checks, problems=problems,
                      proposal=proposal, switches=switches, refusals=refusals)
