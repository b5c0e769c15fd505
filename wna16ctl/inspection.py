"""`inspect`: the planner run over every MoE layer of a checkpoint at each requested TP size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from wna16ctl import __version__
from wna16ctl.checkpoint import Checkpoint, open_checkpoint
from wna16ctl.plan import LayerPlan, plan_layer


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


def inspect_checkpoint(path: str | os.PathLike[str], tps: tuple[int, ...] = (1,), ep: bool = False,
                       revision: str | None = None) -> Inspection:
    """`path`: a checkpoint directory, or a Hub model repo id ORG/NAME[@REVISION] (headers only)."""
    from wna16ctl.hub import open_hub_checkpoint, parse_ref

    ref = parse_ref(str(path), revision)
    ck = open_checkpoint(path) if ref is None else open_hub_checkpoint(ref)
    plans = {lay.prefix: [plan_layer(lay, tp, ep) for tp in tps] for lay in ck.layers}
    return Inspection(checkpoint=ck, tps=tuple(tps), ep=ep, plans=plans)
