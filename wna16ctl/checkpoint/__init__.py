"""Reading a compressed-tensors checkpoint from its config and safetensors headers only."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from wna16ctl.checkpoint.config import ModelConfig, QuantConfig, WeightScheme, read_model_config
from wna16ctl.checkpoint.headers import CheckpointFiles, TensorInfo, read_checkpoint_files
from wna16ctl.checkpoint.moe import MoELayer, find_moe_layers

__all__ = [
    "Checkpoint", "CheckpointFiles", "ModelConfig", "MoELayer", "QuantConfig", "TensorInfo", "WeightScheme",
    "open_checkpoint",
]


@dataclass
class Checkpoint:
    root: Path
    config: ModelConfig
    files: CheckpointFiles
    layers: list[MoELayer]
    warnings: list[str] = field(default_factory=list)

    @property
    def quantized_layers(self) -> list[MoELayer]:
        return [lay for lay in self.layers if lay.quantized]


@contextmanager
def _no_cyclic_gc():
    """Pause the cyclic garbage collector: parsing ~10^5 header entries allocates millions of
    containers, which triggers collections that find nothing (they halve header parsing time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Config, headers and MoE layers of the checkpoint at `path` (BadInput when unusable)."""
    root = Path(path)
    with _no_cyclic_gc():
        config = read_model_config(root)
        files = read_checkpoint_files(root)
        layers = find_moe_layers(files, config)
    warnings = [w for lay in layers for w in lay.warnings]
    if config.quant is None:
        warnings.append(f"{root / 'config.json'}: no quantization_config; the experts are not quantized")
    return Checkpoint(root=root, config=config, files=files, layers=layers, warnings=warnings)
