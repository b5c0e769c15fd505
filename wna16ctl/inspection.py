"""`inspect`: the planner run over every MoE layer of a checkpoint at each requested TP size, for
one vLLM release (or every known release)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from wna16ctl import __version__, rules
from wna16ctl.checkpoint import Checkpoint, MoELayer, open_checkpoint
from wna16ctl.checkpoint.gidx import gate_up_g_idx_mismatch
from wna16ctl.errors import UsageError
from wna16ctl.plan import LayerPlan, plan_layer, release_differences
from wna16ctl.tpsizes import check_tp_sizes


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

    @property
    def loadable(self) -> bool:
        return _loadable(self.checkpoint, self.plans)

    def loadable_in(self, version: str) -> bool:
        return _loadable(self.checkpoint, self.versions[version])

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
            "engine": self.engine.to_json(),
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
            "warnings": list(ck.warnings),
            "layers": self._layers_json(self.plans),
        }
        if self.versions:
            out["versions"] = [
                {"vllm": v, "loadable": self.loadable_in(v), "layers": self._layers_json(self.versions[v])}
                for v in rules.RELEASES
            ]
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


def _loadable(ck: Checkpoint, plans: dict[str, list[LayerPlan]]) -> bool:
    layers = ck.quantized_layers
    return bool(layers) and all(p.loadable for lay in layers for p in plans[lay.prefix])


def _layer_key(lay: MoELayer) -> tuple:
    """Layers with equal keys get equal plans (names aside): plan each distinct one once."""
    return (lay.scheme, tuple((k, tuple(v)) for k, v in lay.scheme_sets.items()), lay.num_experts, lay.hidden_size,
            lay.intermediate_size, lay.scale_dtype, lay.zero_point_form)


def plan_all(layers: list[MoELayer], tps: tuple[int, ...], ep: bool, version: str, gpu: str,
             problems: dict[str, str | None] | None = None, with_differences: bool = True) -> dict[str, list[LayerPlan]]:
    """Plans of every layer at every TP size for one release; hazards include what other releases do.
    `problems`: a data-level error per layer (found in the tensors, not the headers) that every plan carries."""
    memo: dict[tuple, list[LayerPlan]] = {}
    out: dict[str, list[LayerPlan]] = {}
    for lay in layers:
        problem = (problems or {}).get(lay.prefix)
        key = (_layer_key(lay), problem)
        if key not in memo:
            plans = [plan_layer(lay, tp, ep, version, gpu) for tp in tps]
            if with_differences:
                for p in plans:
                    p.hazards[:0] = release_differences(lay, p.tp, ep, version, gpu)
            if problem is not None:
                for p in plans:
                    p.fail("load", "g_idx differ", problem)
            memo[key] = plans
        out[lay.prefix] = memo[key]
    return out


def inspect_checkpoint(path: str | os.PathLike[str], tps: tuple[int, ...] = (1,), ep: bool = False,
                       vllm: str | None = "installed", gpu: str = rules.DEFAULT_GPU,
                       revision: str | None = None) -> Inspection:
    """Plan every MoE layer of the checkpoint at `path` for each TP size in `tps`.

    `path`: a checkpoint directory, or a Hub model repo id ORG/NAME[@REVISION] (headers only).

    `vllm`: a release (`0.33.0`), `latest`, `installed` (the vllm package here, else the newest
    known release) or `all` (every known release; `plans` are then the newest's).
    """
    every = vllm == "all"
    engine = resolve(vllm, gpu)
    from wna16ctl.hub import open_hub_checkpoint, parse_ref

    ref = parse_ref(str(path), revision)
    ck = open_checkpoint(path) if ref is None else open_hub_checkpoint(ref)
    check_tp_sizes(ck.quantized_layers, tps, ep)
    # a data-level rule (reads the small g_idx vectors): the same check repack refuses with
    problems = {lay.prefix: gate_up_g_idx_mismatch(ck.files, lay) for lay in ck.quantized_layers}
    plans = plan_all(ck.layers, tps, ep, engine.version, gpu, problems)
    versions = {v: (plans if v == engine.version else plan_all(ck.layers, tps, ep, v, gpu, problems,
                                                                       with_differences=False))
                for v in rules.RELEASES} if every else {}
    return Inspection(checkpoint=ck, tps=tuple(tps), ep=ep, engine=engine, gpu=gpu, plans=plans, versions=versions)
