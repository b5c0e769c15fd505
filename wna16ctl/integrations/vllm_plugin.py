"""vLLM load format `wna16ctl`: serves a `repack --layout marlin` output directly
(`vllm serve OUT --load-format wna16ctl --moe-backend marlin -tp N`).

Installed by `pip install 'wna16ctl[vllm]'`: the `vllm.general_plugins` entry point calls
`register()` in every vLLM process, which registers the loader with vLLM's `register_model_loader`.

How a rank is loaded (vLLM 0.32 / 0.33):

1. The output's manifest is checked against the engine: release, GPU, MoE backend, TP size
   (`marlin_serving.check_engine`; one line each).
2. The model's MoE layers are pinned to vLLM's Marlin backend (`kernel_config.moe_backend`): from
   0.32 on, vLLM prefers its Humming kernels on sm90, which read another layout.
3. vLLM builds the model and loads the non-expert tensors of `rank-R/` through the model's own
   `load_weights` (they are the checkpoint's tensors, byte for byte; vLLM slices them per rank).
4. vLLM runs its own `process_weights_after_loading`. The expert parameters were never filled, so
   this only gives them their processed (Marlin) shapes and builds the kernel object, which keeps
   references to the scale tensors.
5. The repacked tensors are copied into those processed parameters in place, each checked against
   the manifest's shape and the parameter's shape and dtype first.

The w13 scales differ on purpose from what vLLM's own processing makes when the intermediate size
per rank is at most the group size (and the group size below the hidden size): vLLM permutes
them with the rule of a single group there (it passes the intermediate size as the scales' K),
while the K of the w13 scales is the hidden size; the output carries the permutation of that K.
See docs/user-guide.md, "Serve it".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wna16ctl.dtypes import st_dtype
from wna16ctl.errors import UsageError
from wna16ctl.integrations.marlin_serving import (
    LOAD_FORMAT,
    MarlinOutput,
    check_engine,
    check_tensor,
    read_marlin_output,
    served_layer_tensors,
)



def register() -> None:
    """The `vllm.general_plugins` entry point: register the load format `wna16ctl`."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(marlin_loader_class())


def _st_dtype(t: Any) -> str:
    try:
        return st_dtype(t.dtype)
    except KeyError:
        return str(t.dtype)


def _platform() -> Any:
    from vllm.platforms import current_platform

    return current_platform


def _cuda_capability() -> int | None:
    """Compute capability x 10 of the platform vLLM runs on, None when it is not CUDA."""
    platform = _platform()
    if not platform.is_cuda():
        return None
    cc = platform.get_device_capability()
    return None if cc is None else cc.to_int()


def _rank_index(out: MarlinOutput, rank: int) -> dict[str, str]:
    """name -> file of rank `rank` (the rank's safetensors index)."""
    index = out.rank_dir(rank) / "model.safetensors.index.json"
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"{index}: unreadable rank index ({type(exc).__name__}); `wna16ctl verify` the output") from None


def _by_file(names: list[str], index: dict[str, str]) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for name in names:
        files.setdefault(index[name], []).append(name)
    return files


def non_expert_tensors(out: MarlinOutput, rank: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's non-expert tensors of rank `rank` under their checkpoint names, for the
    model's own `load_weights` (file by file, each file opened once)."""
    from safetensors import safe_open

    index = _rank_index(out, rank)
    experts = out.expert_tensor_names()
    names = [n for n in index if n not in experts]
    for file, file_names in _by_file(names, index).items():
        with safe_open(str(out.rank_dir(rank) / file), framework="pt") as f:
            for name in file_names:
                yield name, f.get_tensor(name)


def find_expert_module(model: Any, layer_name: str) -> Any:
    """The module holding the expert parameters of the checkpoint's MoE layer `layer_name`: the
    layer itself, or the one module below it that has them (`…experts.routed_experts` from 0.31 on)."""
    found = [m for n, m in model.named_modules()
             if (n == layer_name or n.startswith(layer_name + ".")) and "w13_weight_packed" in m._parameters]
    if len(found) != 1:
        raise UsageError(f"{layer_name}: the engine's model has {len(found)} expert modules there, expected 1; "
                         f"the output was repacked for another model")
    return found[0]


def check_marlin_backend(module: Any, layer_name: str, root: Path) -> None:
    backend = getattr(getattr(module, "quant_method", None), "wna16_backend", None)
    name = getattr(backend, "value", None)
    if name != "MARLIN":
        raise UsageError(f"{root}: layer {layer_name} runs on vLLM's {name or type(getattr(module, 'quant_method', None)).__name__} "
                         f"MoE backend, not Marlin; serve with --moe-backend marlin")


def copy_expert_tensors(model: Any, out: MarlinOutput, rank: int) -> int:
    """Copy rank `rank`'s repacked tensors into the processed expert parameters of `model`, in place
    (the kernel object holds references to them); returns the number of tensors copied."""
    import torch
    from safetensors import safe_open

    index = _rank_index(out, rank)
    copied = 0
    for layer in out.layers:
        module = find_expert_module(model, layer.name)
        check_marlin_backend(module, layer.name, out.root)
        tensors = served_layer_tensors(layer, out.root)
        expected = layer.rank_shapes(rank, out.scale_dtype)
        if set(expected) != set(tensors):
            raise UsageError(f"{out.root}: layer {layer.name} lists {sorted(tensors)}, its scheme needs "
                             f"{sorted(expected)}; `wna16ctl verify` the output")
        for name in tensors:
            full = f"{layer.name}.{name}"
            if full not in index:
                raise UsageError(f"{out.rank_dir(rank)}: {full} is missing; `wna16ctl verify` the output")
        for file, names in _by_file([f"{layer.name}.{t}" for t in tensors], index).items():
            with safe_open(str(out.rank_dir(rank) / file), framework="pt") as f:
                for full in names:
                    name = full[len(layer.name) + 1:]
                    param = module._parameters.get(name)
                    if param is None:
                        raise UsageError(f"{full}: vLLM's processed layer has no parameter {name}; the output "
                                         f"was repacked for another configuration")
                    sl = f.get_slice(full)
                    check_tensor(full, (tuple(sl.get_shape()), sl.get_dtype()), expected[name], "the file's tensor")
                    check_tensor(full, (tuple(param.shape), _st_dtype(param)), expected[name],
                                 "vLLM's processed parameter")
                    with torch.no_grad():
                        param.data.copy_(f.get_tensor(full))
                    copied += 1
        _fill_weight_shapes(module, layer)
    return copied


def _fill_weight_shapes(module: Any, layer: Any) -> None:
    """compressed-tensors' `weight_shape` parameters: vLLM fills them from the checkpoint's
    per-expert `weight_shape` (gate/up [I, H], down [H, I]) and nothing reads them after
    processing; repack does not copy them, so they are set from the manifest to the same values."""
    import torch

    spec = layer.specs[0]
    for name, value in (("w13_weight_shape", (spec.intermediate_size, spec.hidden_size)),
                        ("w2_weight_shape", (spec.hidden_size, spec.intermediate_size))):
        param = module._parameters.get(name)
        if param is not None:
            with torch.no_grad():
                param.data.copy_(torch.tensor(value, dtype=param.dtype).expand(param.shape))


def force_marlin_backend(vllm_config: Any) -> None:
    """Pin the MoE layers to vLLM's Marlin backend where the user left the choice to vLLM: the MoE
    layers read `kernel_config.moe_backend` of the current config when they are built."""
    from vllm.config import get_current_vllm_config

    configs = [vllm_config]
    try:
        current = get_current_vllm_config()
    except Exception:  # no current config outside an engine: nothing else to pin
        current = None
    if current is not None and current is not vllm_config:
        configs.append(current)
    for config in configs:
        kernel = getattr(config, "kernel_config", None)
        if kernel is not None and kernel.moe_backend == "auto":
            kernel.moe_backend = "marlin"


def _parallel(vllm_config: Any) -> tuple[int, int, bool]:
    """(tensor parallel size, pipeline stages, expert parallelism) of the engine."""
    p = vllm_config.parallel_config
    return p.tensor_parallel_size, p.pipeline_parallel_size, bool(p.enable_expert_parallel)


@functools.cache
def marlin_loader_class() -> type:
    """The loader class (made on first use: vLLM is imported only inside vLLM's processes)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class Wna16ctlMarlinLoader(DefaultModelLoader):
        """Serves a `wna16ctl repack --layout marlin` output (see the module's docstring)."""

        def download_model(self, model_config: Any) -> None:
            read_marlin_output(model_config.model)  # local only: refuses anything else with one line

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            import vllm
            from vllm.distributed import get_tensor_model_parallel_rank

            out = read_marlin_output(model_config.model)
            tp, pp, ep = _parallel(vllm_config)
            check_engine(out, vllm_version=vllm.__version__, capability=_cuda_capability(),
                         moe_backend=vllm_config.kernel_config.moe_backend, tp=tp, pp=pp, ep=ep)
            force_marlin_backend(vllm_config)
            self._output = out
            # builds the model, calls load_weights below, then vLLM's own processing
            model = super().load_model(vllm_config, model_config, prefix)
            copy_expert_tensors(model, out, get_tensor_model_parallel_rank())
            return model

        def load_weights(self, model: Any, model_config: Any) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank

            out = getattr(self, "_output", None) or read_marlin_output(model_config.model)
            model.load_weights(non_expert_tensors(out, get_tensor_model_parallel_rank()))

    return Wna16ctlMarlinLoader
