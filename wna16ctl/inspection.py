"""`inspect`: the planner run over every MoE layer of a checkpoint at each requested TP size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from wna16ctl import __version__
from wna16ctl.checkpoint import Checkpoint, open_checkpoint
from wna16ctl.checkpoint.gidx import gate_up_g_idx_mismatch
from wna16ctl.plan import LayerPlan, plan_layer
from wna16ctl.tpsizes import check_tp_sizes


@dataclass
class Inspection:
    checkpoint: Checkpoint
    tps: tuple[int, ...]
    ep: bool
    plans: dict[str, list[LayerPlan]]  # layer prefix -> one plan per TP size

    @property
    def loadable(self) -> bool:
        layers = self.checkpoint.quantized_layers
        return bool(layers) and all(p.loadable for lay in layers for p in self.plans[lay.prefix])

    def to_json(self) -> dict[str, Any]:
        ck = self.checkpoint
        cfg = ck.config
        return {
            "wna16ctl_version": __version__,
            "checkpoint": str(ck.root),
            "architecture": cfg.architectures[0] if cfg.architectures else None,
            "model_type": cfg.model_type,
            "quantization": None if cfg.quant is None else {
                "format": cfg.quant.format, "version": cfg.quant.version,
            },
            "tp": list(self.tps),
            "ep": self.ep,
            "loadable": self.loadable,
            "warnings": list(ck.warnings),
            "layers": [
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
                    "plans": [p.to_json() for p in self.plans[lay.prefix]],
                }
                for lay in ck.layers
            ],
        }


def inspect_checkpoint(path: str | os.PathLike[str], tps: tuple[int, ...] = (1,), ep: bool = False) -> Inspection:
    ck = open_checkpoint(path)
    check_tp_sizes(ck.quantized_layers, tps, ep)
    plans = {lay.prefix: [plan_layer(lay, tp, ep) for tp in tps] for lay in ck.layers}
    for lay in ck.quantized_layers:
        # data-level rule (reads the small g_idx vectors): the same check repack refuses with
        problem = gate_up_g_idx_mismatch(ck.files, lay)
        if problem is not None:
            for p in plans[lay.prefix]:
                p.errors.append(problem)
    return Inspection(checkpoint=ck, tps=tuple(tps), ep=ep, plans=plans)
