"""Runs one vLLM release's own decision code for many MoE layer cases (a subprocess per release).

Started as `python _vllm_worker.py TREE EXTENSIONS_TXT [EXTRA_PATH ...]`: TREE holds the release's
extracted `vllm/` package, EXTENSIONS_TXT names its compiled modules, EXTRA_PATH its pinned
compressed-tensors.  Reads one JSON case per line on stdin, writes one JSON outcome per line;
vLLM's own log output goes to stderr.  The import environment is described in _stubs.py.

The engine steps driven for a compressed-tensors `pack-quantized` checkpoint, in the order vLLM's
model loader and its routed-experts layer run them on rank 0:

1. config: `CompressedTensorsConfig.from_config(quantization_config)`, with the
   `quantization_config` an llm-compressor export writes for the case's scheme (the pinned
   compressed-tensors validates the scheme; vLLM adds its own refusals).
2. method: the layer's `FusedMoEConfig` (MoE TP size = tp, or 1 under EP with ep_size = tp and
   rank 0's share of the experts under vLLM's linear placement), then
   `quant_config.get_quant_method(layer, prefix)` -> `CompressedTensorsMoEMethod.get_moe_method`
   -> the method constructor.
3. oracle: inside the constructor, `select_wna16_moe_backend`.
4. create_weights: `maybe_roundup_sizes`, then `create_weights` with the arguments the layer
   passes (`intermediate_size_full` only for the method classes the layer's own
   `_needs_intermediate_size_param` names), allocating real parameters on the CPU.
5. (Marlin only) `process_weights_after_loading` until its first compiled op.

How each field of the outcome is read:

* stage / error / error_type: the step whose call raised first, `str()` of the exception and its
  class name.  A failure inside the constructor is "oracle" when the traceback passes through
  `select_wna16_moe_backend`, otherwise "method" (the constructor's own asserts, and
  `FusedMoEConfig`'s divisibility assert, which the layer hits before asking for a method).
  An AttributeError on our stand-in layer is a harness gap and is reported as such, not as a stage.
* backend: the first element of what `select_wna16_moe_backend` returned (recorded by wrapping
  the name in the method module), lower-cased enum value; also set when the constructor failed
  after the oracle returned.  None when the oracle did not return.
* oracle_ran: whether the constructor called the oracle at all.
* rejected / rejected_reasons: every backend of the release's `_get_priority_backends()` that
  fails the two tests of the oracle's own loop -- `_backend_incompatibility_reason` (where the
  release has it) and then each kernel class's `is_supported_config` -- asked with the exact
  arguments the constructor gave the oracle.  Asked for all backends, also those after the
  winner (the loop itself stops at the winner).  An exception while asking counts as rejected
  ("raises ...").
* w2_scale_sharding: `[load_full_w2, w2_scales_size, is_k_full]` from the method class's
  `_w2_scale_sharding` called with what `create_weights` passes it (the method's actorder and
  group size, the layer's intermediate size per partition and full); None where the release has
  no such function or the method was not built.
* padded_intermediate: what `marlin_moe_padded_intermediate` returned when the release's own
  `process_weights_after_loading` called it (recorded by wrapping the name in the oracle module),
  i.e. with the arguments that release passes; only for Marlin outcomes that got through
  create_weights.  process_error / process_reached_op tell how that processing ended.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _stubs  # noqa: E402 - after the sys.path set-up above
import ckptcase  # noqa: E402 - after the sys.path set-up above

PREFIX = "model.layers.0.mlp.experts"
# the quantization modules, besides compressed-tensors', whose MoE methods call the WNA16 oracle
FORMAT_METHOD_MODULES = ("auto_gptq", "auto_awq", "moe_wna16")
TOP_K = 2


# The devices a case can name: compute capability, device name, memory (what the platform answers).
GPUS = {
    "sm75": ((7, 5), "Tesla T4", 16),
    "sm80": ((8, 0), "NVIDIA A100-SXM4-80GB", 80),
    "sm86": ((8, 6), "NVIDIA A10", 24),
    "sm89": ((8, 9), "NVIDIA L40S", 48),
    "sm90": ((9, 0), "NVIDIA H200", 141),
    "sm100": ((10, 0), "NVIDIA B200", 180),
    "sm120": ((12, 0), "NVIDIA RTX PRO 6000 Blackwell Server Edition", 96),
}
# Streaming multiprocessors of those devices (an attention backend sizes its work by them).
SM_COUNT = {"sm75": 40, "sm80": 108, "sm86": 72, "sm89": 142, "sm90": 132, "sm100": 148, "sm120": 188}
# The environment variables a case may set (every other VLLM_* variable keeps the release's default).
CASE_ENV = ("VLLM_USE_FLASHINFER_MOE_INT4", "VLLM_DISABLED_KERNELS", "VLLM_BATCH_INVARIANT")
_GPU = {"name": "sm90"}


def set_gpu(name: str) -> None:
    if name not in GPUS:
        raise ValueError(f"unknown gpu {name!r}; one of {sorted(GPUS)}")
    _GPU["name"] = name


def _install_cuda_platform() -> None:
    """vLLM's real CUDA platform class, answering for one device of the current case's GPU."""
    import vllm.platforms as platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    def spec():
        return GPUS[_GPU["name"]]

    class CudaOneDevice(cuda.CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            (major, minor), _, _ = spec()
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def has_device_capability(cls, capability, device_id: int = 0) -> bool:
            (major, minor), _, _ = spec()
            want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
            return major * 10 + minor >= want

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return spec()[1]

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return spec()[2] * 1024**3

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return _MODEL["devices"]

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return SM_COUNT[_GPU["name"]]

        @classmethod
        def current_device(cls):
            # layers that place a small tensor on "the current device" explicitly (a gated
            # norm's weight) get the meta device, as every other parameter of the build
            import torch

            return torch.device("meta")

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return "GPU-00000000-0000-0000-0000-000000000000"

    CudaOneDevice.__name__ = CudaOneDevice.__qualname__ = "NvmlCudaPlatform"
    platforms._current_platform = CudaOneDevice()
    # The model registry inspects a model class in a subprocess so that the parent never
    # initializes CUDA; here there is no CUDA to initialize, and a subprocess would import the
    # installed vllm (none) instead of this release: the same function runs in this process.
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    # Layers that overlap work on a second CUDA stream (shared experts) create it and its events
    # while they are built; these hold no parameter or buffer, so stand-ins leave every decision
    # read here unchanged.
    import torch

    torch.cuda.Stream = torch.cuda.Event = _StreamStandIn
    _gpu_buffers_on_meta(torch)


def _gpu_buffers_on_meta(torch) -> None:
    """Attention backends allocate workspaces explicitly on the GPU (`device="cuda"`, at import
    or while built); without a GPU those go to the meta device, as every parameter of the build
    does.  Buffers only: no quantized parameter is created with an explicit device."""
    import functools

    def on_meta(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "meta"
            return factory(*args, **kwargs)

        return make

    for name in ("empty", "zeros", "ones", "full", "arange", "tensor", "randn", "rand"):
        setattr(torch, name, on_meta(getattr(torch, name)))


class _StreamStandIn:
    """A CUDA stream or event that nothing is ever run on."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


# The number of devices the platform reports: a model case sets it to its TP size (one node).
_MODEL = {"devices": 1}


class _FakeProcessGroup:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _FakeGroupCoordinator:
    """What model construction reads of vLLM's GroupCoordinator: sizes and this process's rank.
    No collective runs while a model is built on the meta device; one that did would fail here
    (no such method), not answer."""

    def __init__(self, name: str, size: int, rank: int) -> None:
        self.unique_name = name
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device_group = self.cpu_group = _FakeProcessGroup(size, rank)
        self.device_communicator = None
        self.use_device_communicator = False
        # where a weight loader moves a checkpoint tensor before slicing it (MoeWNA16's does): the
        # files are read on the CPU, and the built parameters are on the meta device
        self.device = "cpu"


def _fake_parallel_state(tp: int, rank: int) -> None:
    """One process standing for rank `rank` of `tp` tensor-parallel ranks (one pipeline stage,
    one data-parallel replica; the expert-parallel group spans the TP ranks, as vLLM forms it)."""
    from vllm.distributed import parallel_state as ps

    sizes = {"_WORLD": tp, "_TP": tp, "_EP": tp, "_PP": 1, "_DP": 1, "_DCP": 1, "_PCP": 1, "_EPLB": 1,
             "_INNER_DP_WORLD": tp, "_ETP": 1}
    for name, size in sizes.items():
        if hasattr(ps, name):
            setattr(ps, name, _FakeGroupCoordinator(name.strip("_").lower(), size, rank if size > 1 else 0))
    if hasattr(ps, "_NODE_COUNT"):
        ps._NODE_COUNT = 1


def _attention_backend(case: dict[str, Any]) -> str | None:
    """The release's own attention backend choice, except on Blackwell, where it is FlashInfer
    (or CUTLASS MLA), whose layers call into the flashinfer package while they are built (here a
    placeholder): the Triton backends instead.  The attention backend owns no quantized layer."""
    if GPUS[case.get("gpu", "sm90")][0][0] != 10:
        return None
    with open(os.path.join(case["ckpt"], "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config") or config
    return "TRITON_MLA" if text.get("kv_lora_rank") else "TRITON_ATTN"


def _forget_attention_backends() -> None:
    """The release caches its attention backend choice per process; each case has its own GPU."""
    selector = sys.modules.get("vllm.v1.attention.selector")
    for value in vars(selector).values() if selector is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _expert_maps_on_cpu() -> None:
    """The expert-placement maps of EP (small integer tensors, which the engine keeps on the
    GPU and reads back with `nonzero`) are built on the CPU instead of the meta device, which
    has no values to read: the same values as on the GPU."""
    import functools
    import importlib

    import torch

    try:
        mod = importlib.import_module("vllm.model_executor.layers.fused_moe.expert_map_manager")
    except ImportError:
        return
    cls = getattr(mod, "ExpertMapManager", None)
    if cls is None or getattr(cls.__init__, "_on_cpu", False):
        return
    real_init = cls.__init__

    @functools.wraps(real_init)
    def init_on_cpu(self, *args, **kwargs):
        with torch.device("cpu"):
            real_init(self, *args, **kwargs)

    init_on_cpu._on_cpu = True
    cls.__init__ = init_on_cpu


def _set_case_env(env: dict[str, str]) -> None:
    """The case's environment, read lazily by the release's envs module on each access."""
    for name in CASE_ENV:
        if name in env:
            os.environ[name] = str(env[name])
        else:
            os.environ.pop(name, None)
    # the release caches this answer for the process: each case asks afresh
    mod = sys.modules.get("vllm.model_executor.layers.quantization.utils.flashinfer_mxint4_moe")
    fn = getattr(mod, "is_flashinfer_mxint4_moe_available", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


class Release:
    """The imported decision code of one release."""

    def __init__(self) -> None:
        _install_cuda_platform()
        from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

        self.ct = ct
        from vllm.model_executor.layers.fused_moe import config as moe_config_mod

        self.moe_config_mod = moe_config_mod
        import importlib

        self.routed_experts_cls = _find_routed_experts_class()
        self.oracle = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.int_wna16")
        self.marlin_utils = importlib.import_module("vllm.model_executor.layers.quantization.utils.marlin_utils")
        self.wna16_mod = importlib.import_module(
            "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
            "compressed_tensors_moe_wna16"
        )
        self.activation_mod = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")
        from vllm.version import __version__

        self.version = __version__
        # The flashinfer package is not installed here; a Blackwell deployment has it, so its
        # presence is answered yes and only the release's own switches and device checks decide.
        fi = importlib.import_module("vllm.model_executor.layers.quantization.utils.flashinfer_mxint4_moe")
        fi.has_flashinfer_trtllm_fused_moe = lambda: True
        # Record the arguments of the oracle call the method constructor makes: the same
        # arguments then tell which backends the release rejects (see `_rejected`).
        self.oracle_calls: list[dict[str, Any]] = []
        real_select = self.oracle.select_wna16_moe_backend

        def recording_select(*args, **kwargs):
            call = {"args": args, "kwargs": kwargs, "result": None}
            self.oracle_calls.append(call)
            call["result"] = real_select(*args, **kwargs)
            return call["result"]

        self.wna16_mod.select_wna16_moe_backend = recording_select
        self.real_select = real_select
        # the GPTQ, AWQ and MoeWNA16 methods import the oracle by name too: record their calls alike
        for name in FORMAT_METHOD_MODULES:
            mod = importlib.import_module(f"vllm.model_executor.layers.quantization.{name}")
            if hasattr(mod, "select_wna16_moe_backend"):
                mod.select_wna16_moe_backend = recording_select
        self.quantization = importlib.import_module("vllm.model_executor.layers.quantization")
        # its first call imports every config module (some probe a compiled op at import): done
        # here, so that no case's decision is charged with it
        self.quantization.get_quantization_config("gptq")

    # -- building the engine's objects ---------------------------------------------------------

    def quantization_config(self, case: dict[str, Any]) -> dict[str, Any]:
        """The `quantization_config` an llm-compressor W{4,8}A16 export writes for this scheme, with
        the case's extra config groups: the same dict wna16ctl's reader gets (ckptcase.py)."""
        return ckptcase.quantization_config(case)

    def format_config(self, case: dict[str, Any]):
        """The release's own config object of the case's format: compressed-tensors built from the
        export's quantization_config, or (a case with `quant_method` gptq/awq and its `raw`
        quantization_config) the class the release maps that quant_method to on CUDA, built by its
        `from_config` from the raw dict."""
        method = case.get("quant_method")
        if method in (None, "compressed-tensors"):
            return self.ct.CompressedTensorsConfig.from_config(self.quantization_config(case))
        # the engine asks each config class whether it takes over the file's quant_method (INCConfig
        # does for "auto-round"), and otherwise looks the file's own quant_method up
        raw_method = str(case["raw"].get("quant_method", method)).lower()
        inc = self.quantization.get_quantization_config("inc")
        if inc.override_quantization_method(dict(case["raw"]), None) is not None:
            return inc.from_config(dict(case["raw"]))
        cls = self.quantization.get_quantization_config(raw_method)
        return cls.from_config(dict(case["raw"]))

    def moe_config(self, case: dict[str, Any]):
        """The layer's FusedMoEConfig on rank 0 (fields filled by name: they vary by release)."""
        m = self.moe_config_mod
        tp, ep = case["tp"], case["ep"]
        E = case["num_experts"]
        moe_tp = 1 if ep else tp
        ep_size = tp if ep else 1
        local = E // ep_size + (1 if 0 < E % ep_size else 0)
        par_values = {
            "tp_size": moe_tp, "pcp_size": 1, "dp_size": 1, "ep_size": ep_size, "tp_rank": 0,
            "pcp_rank": 0, "dp_rank": 0, "ep_rank": 0, "sp_size": 1, "use_ep": ep,
            "all2all_backend": "allgather_reducescatter", "enable_eplb": False,
        }
        par = _build_dataclass(m.FusedMoEParallelConfig, par_values)
        import torch

        values = {
            "num_experts": E, "experts_per_token": TOP_K, "hidden_dim": case["hidden_size"],
            "intermediate_size": case["intermediate_size"], "num_local_experts": local,
            "num_logical_experts": E, "activation": self.activation_mod.MoEActivation.SILU,
            "device": "cuda", "routing_method": m.RoutingMethodType.Renormalize,
            "moe_parallel_config": par, "in_dtype": torch.bfloat16, "moe_backend": case.get("moe_backend", "auto"),
        }
        return _build_dataclass(m.FusedMoEConfig, values)

    def layer(self, moe_config, case: dict[str, Any] | None = None):
        """A routed-experts module as far as the quantization code looks at it."""
        import torch

        cls = self.routed_experts_cls
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.moe_config = moe_config
        layer.layer_name = PREFIX
        layer.hidden_size = moe_config.hidden_dim
        layer.global_num_experts = moe_config.num_experts
        layer.local_num_experts = moe_config.num_local_experts
        layer.params_dtype = torch.bfloat16
        # what the layer constructor stores before asking for the quant method
        names = ckptcase.PROJ_NAMES[(case or {}).get("names", "gate_up_down")]
        layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = names
        layer.is_fused_checkpoint_transposed = False
        layer.quant_config = None
        layer.top_k = moe_config.experts_per_token
        layer.activation = moe_config.activation
        layer.renormalize = True
        layer.use_grouped_topk = False
        layer.apply_router_weight_on_input = False
        layer.e_score_correction_bias = None
        return layer

    # -- one case --------------------------------------------------------------------------------

    def outcome(self, case: dict[str, Any]) -> dict[str, Any]:
        import torch

        set_gpu(case.get("gpu", "sm90"))
        _set_case_env(case.get("env") or {})
        _stubs.OPS_CALLED.clear()

        out: dict[str, Any] = {
            "stage": None, "error": None, "error_type": None, "backend": None, "rejected": [],
            "w2_scale_sharding": None, "padded_intermediate": None, "version": self.version,
            "oracle_ran": False, "gpu": case.get("gpu", "sm90"),
        }

        def ops_called() -> None:
            # a compiled op called while deciding would have answered with a placeholder: the
            # decision would not be the release's; the test asserts this list is empty
            out["ops_called"] = list(_stubs.OPS_CALLED)

        def fail(stage: str, exc: BaseException) -> dict[str, Any]:
            ops_called()
            if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), torch.nn.Module):
                # our stand-in layer lacks something the release reads: a harness gap, not an outcome
                raise RuntimeError(f"stand-in layer incomplete for this release: {exc}") from exc
            out["stage"] = stage
            out["error"] = _exception_text(exc)
            out["error_type"] = type(exc).__name__
            out["traceback"] = traceback.format_exc(limit=-4)
            return out

        # 1. config parse
        try:
            qc = self.format_config(case)
        except Exception as exc:  # the first failure is the outcome
            return fail("config", exc)

        if case.get("lm_head"):
            out["head_quantized"] = self._head_quantized(qc)
        # 2./3. the layer's MoE config, method dispatch, method constructor (with the oracle)
        self.oracle_calls.clear()
        method = None
        try:
            moe = self.moe_config(case)
            layer = self.layer(moe, case)
            method = qc.get_quant_method(layer, PREFIX)
        except Exception as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            if any(fr.filename.endswith("unquantized_fused_moe_method.py") for fr in frames):
                # get_moe_method chose UnquantizedFusedMoEMethod (a CustomOp, whose constructor
                # needs the engine's config context, which this harness does not set up): the
                # layer gets unquantized 16-bit parameters, and the checkpoint's packed expert
                # tensors then have none to load into
                ops_called()
                out.update(stage="load", method_class="UnquantizedFusedMoEMethod", error_type="UnquantizedFusedMoEMethod",
                           error="the release builds UnquantizedFusedMoEMethod: no parameter takes the packed experts")
                return out
            in_oracle = any(fr.name == "select_wna16_moe_backend" for fr in frames)
            fail("oracle" if in_oracle else "method", exc)
            self._oracle_fields(out)
            return out
        out["method_class"] = type(method).__name__
        self._oracle_fields(out)
        if out["backend"] is None:
            out["backend"] = _backend_name(getattr(method, "wna16_backend", None))

        # 4. create_weights, as the layer calls it
        try:
            hidden, i_p = method.maybe_roundup_sizes(
                layer.hidden_size, moe.intermediate_size_per_partition, moe.in_dtype, moe.moe_parallel_config,
            )
            moe.hidden_dim = hidden
            moe.intermediate_size_per_partition = i_p
            layer.hidden_size = hidden
            layer.intermediate_size_per_partition = i_p
            params: dict[str, Any] = {
                "num_experts": moe.num_local_experts,
                "hidden_size": hidden,
                "unpadded_hidden_size": moe.hidden_dim_unpadded,
                "intermediate_size_per_partition": i_p,
                "params_dtype": torch.bfloat16,
                "weight_loader": lambda *a, **k: None,
                "global_num_experts": moe.num_experts,
            }
            needs_full = getattr(self.routed_experts_cls, "_needs_intermediate_size_param", None)
            if needs_full is not None and needs_full(layer, method):
                params["intermediate_size_full"] = moe.intermediate_size
            with torch.device("cpu"):
                method.create_weights(layer=layer, **params)
        except Exception as exc:
            fail("create_weights", exc)
        finally:
            out["w2_scale_sharding"] = self._w2_sharding(method, moe, case)
            if out["w2_scale_sharding"] is None and case.get("quant_method") not in (None, "compressed-tensors"):
                out["w2_scale_sharding"] = self._format_w2_sharding(method, layer, moe)

        # Marlin tile padding: run the release's own `process_weights_after_loading` on the CPU
        # parameters until its first compiled op (the Marlin repack), and read what its call of
        # `marlin_moe_padded_intermediate` returned -- with the arguments that release passes.
        ops_called()
        if out["stage"] is None and case.get("load_check"):
            out["load_check"] = self._load_check(method, layer, moe, case)
        if out["stage"] is None and out["backend"] in ("marlin", "batched_marlin"):
            self._process_until_first_op(method, layer, out)
        return out

    def _head_quantized(self, qc) -> bool | str:
        """Whether the release gives the output projection (a ParallelLMHead named `lm_head`) a
        quantized method: what its get_quant_method returns for a stand-in of that class."""
        import importlib

        import torch

        vpe = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
        head = vpe.ParallelLMHead.__new__(vpe.ParallelLMHead)
        torch.nn.Module.__init__(head)
        try:
            method = qc.get_quant_method(head, "lm_head")
        except Exception as exc:
            return f"raises {type(exc).__name__}: {_exception_text(exc)}"
        return type(method).__name__ == "CompressedTensorsLinearMethod"

    def linear_outcome(self, case: dict[str, Any]) -> dict[str, Any]:
        """`choose_mp_linear_kernel` for one linear layer's per-rank shape on the case's GPU: the
        kernel class it returns, or its ValueError (every kernel's reason)."""
        import importlib

        import torch

        set_gpu(case.get("gpu", "sm90"))
        _set_case_env(case.get("env") or {})
        _stubs.OPS_CALLED.clear()
        lin = importlib.import_module("vllm.model_executor.kernels.linear")
        mp = importlib.import_module("vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel")
        from vllm.scalar_type import scalar_types

        bits, sym = case["num_bits"], case["symmetric"]
        # (releases before 0.31 have no uint2/3/5/6/7 scalar type: their scheme refuses those below)
        wtype = getattr(scalar_types, f"uint{bits}b{2 ** (bits - 1)}" if sym else f"uint{bits}", None)
        has_g_idx = case.get("has_g_idx", False)
        out: dict[str, Any] = {"kernel": None, "error": None}
        if "actorder" in case:
            # the release's own linear scheme, built from the weights as its config parse validates
            # them: its quant type and its act-order answer (has_g_idx where it has one)
            scheme_mod = importlib.import_module(
                "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16")
            from compressed_tensors.quantization import QuantizationArgs

            strategy = "channel" if case["group_size"] == -1 else "group"
            args = QuantizationArgs(num_bits=bits, strategy=strategy, symmetric=sym, actorder=case["actorder"],
                                    group_size=None if strategy == "channel" else case["group_size"])
            try:
                scheme = _call_with(scheme_mod.CompressedTensorsWNA16, {
                    "strategy": args.strategy, "num_bits": bits, "group_size": args.group_size, "symmetric": sym,
                    "actorder": args.actorder, "layer_name": "model.layers.0.self_attn.o_proj"})
            except ValueError as exc:
                out["error"] = f"scheme ValueError: {_exception_text(exc)}"
                out["ops_called"] = list(_stubs.OPS_CALLED)
                return out
            wtype, has_g_idx = scheme.quant_type, bool(getattr(scheme, "has_g_idx", False))
            out["has_g_idx"] = has_g_idx
        config = _build_dataclass(mp.MPLinearLayerConfig, {
            "full_weight_shape": (case["k"], case["n"]), "partition_weight_shape": (case["k_p"], case["n_p"]),
            "weight_type": wtype, "act_type": getattr(torch, case.get("act_type", "bfloat16")),
            "group_size": case["group_size"], "zero_points": not sym, "has_g_idx": has_g_idx})
        (major, minor), _, _ = GPUS[_GPU["name"]]
        try:
            out["kernel"] = lin.choose_mp_linear_kernel(config, compute_capability=major * 10 + minor).__name__
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {_exception_text(exc)}"
        out["ops_called"] = list(_stubs.OPS_CALLED)
        return out

    def format_linear_outcome(self, case: dict[str, Any]) -> dict[str, Any]:
        """One linear layer of a GPTQ/AWQ/auto-round checkpoint, built by the release's own layer
        class (`ColumnParallelLinear`, `MergedColumnParallelLinear`, `QKVParallelLinear`,
        `RowParallelLinear`; `ParallelLMHead` for the output projection) with the format's config
        from the raw quantization_config, as rank 0 of `tp` ranks, on the meta device: the layer's
        own divisibility asserts, the config's get_quant_method, the method's constructor and
        create_weights (choose_mp_linear_kernel among them).  method: the quant method class;
        kernel: the kernel class create_weights chose (None where the method chooses none);
        params: the shapes of the parameters it created."""
        import importlib

        import torch

        set_gpu(case.get("gpu", "sm90"))
        _set_case_env(case.get("env") or {})
        _stubs.OPS_CALLED.clear()
        tp = case["tp"]
        _MODEL["devices"] = tp
        _fake_parallel_state(tp, 0)
        out: dict[str, Any] = {"stage": None, "error": None, "error_type": None, "method": None, "kernel": None,
                               "params": {}}
        lin = importlib.import_module("vllm.model_executor.layers.linear")
        chosen: list[str] = []
        for modname in ("vllm.model_executor.layers.quantization.auto_gptq",
                        "vllm.model_executor.layers.quantization.auto_awq"):
            mod = importlib.import_module(modname)
            real_choose = getattr(mod, "_real_choose_mp_linear_kernel", None) or mod.choose_mp_linear_kernel
            mod._real_choose_mp_linear_kernel = real_choose

            def recording(config, *a, _real=real_choose, **k):
                kern = _real(config, *a, **k)
                chosen.append(kern.__name__)
                return kern
            mod.choose_mp_linear_kernel = recording
        try:
            qc = self.format_config(case)
        except Exception as exc:
            out.update(stage="config", error=_exception_text(exc), error_type=type(exc).__name__)
            return out
        packed = case.get("packed_modules_mapping") or {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                                        "gate_up_proj": ["gate_proj", "up_proj"]}
        qc.packed_modules_mapping = dict(packed)
        if case.get("checkpoint_tensors") is not None:
            # the engine's maybe_update_config reads the checkpoint's safetensors metadata (GPTQ: the
            # modules with integer tensors when modules_in_block_to_quantize is empty; AWQ: the modules
            # without any, as modules_to_not_convert, when that is empty): given the case's tensors
            mod = sys.modules[type(qc).__module__]
            if hasattr(mod, "get_safetensors_params_metadata"):
                tensors = dict(case["checkpoint_tensors"])
                mod.get_safetensors_params_metadata = lambda *a, **k: {n: {"dtype": d} for n, d in tensors.items()}
                qc.maybe_update_config("checkpoint")
        k, sizes, role, prefix = case["k"], case["output_sizes"], case["role"], case["prefix"]
        from vllm.config import VllmConfig, set_current_vllm_config

        dtype = getattr(torch, case.get("act_type", "bfloat16"))
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with set_current_vllm_config(VllmConfig()), torch.device("meta"):
                if role == "row":
                    layer = lin.RowParallelLinear(k, sizes[0], bias=False, quant_config=qc, prefix=prefix,
                                                  params_dtype=dtype)
                elif role == "qkv":
                    layer = lin.QKVParallelLinear(k, case["head_dim"], case["num_heads"], case["num_kv_heads"],
                                                  bias=False, quant_config=qc, prefix=prefix, params_dtype=dtype)
                elif role == "lm_head":
                    vpe = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
                    layer = vpe.ParallelLMHead(sizes[0], k, quant_config=qc, prefix=prefix, params_dtype=dtype)
                elif len(sizes) > 1:
                    layer = lin.MergedColumnParallelLinear(k, list(sizes), bias=False, quant_config=qc, prefix=prefix,
                                                           params_dtype=dtype)
                else:
                    layer = lin.ColumnParallelLinear(k, sizes[0], bias=False, quant_config=qc, prefix=prefix,
                                                     params_dtype=dtype)
        except Exception as exc:
            out.update(stage="create_weights", error=_exception_text(exc), error_type=type(exc).__name__,
                       traceback=traceback.format_exc(limit=-4))
            return out
        finally:
            torch.set_default_dtype(default_dtype)
            out["ops_called"] = list(_stubs.OPS_CALLED)
            out["kernel"] = chosen[-1] if chosen else None
        method = getattr(layer, "quant_method", None)
        out["method"] = type(method).__name__
        scheme = getattr(method, "scheme", None)
        inner = getattr(scheme, "linear_method", None) or getattr(scheme, "inner_method", None)
        if inner is not None:  # INC's wrapper around the GPTQ/AWQ linear method
            out["method"] = type(inner).__name__
        out["params"] = {n: list(p.shape) for n, p in layer.named_parameters()}
        return out

    # -- the whole model ----------------------------------------------------------------------

    def model_outcome(self, case: dict[str, Any]) -> dict[str, Any]:
        """The release's model class for the checkpoint `case["ckpt"]`, built as its engine builds it
        on one rank: `EngineArgs(...).create_engine_config()` (config parse and the engine's checks of
        the model's sizes), then `initialize_model` on the meta device inside a parallel state of
        `tp` ranks seen from rank `rank` (EP: the experts spread over those ranks), then, with
        `load`, the release's default weight loader reading the checkpoint's files.

        stage: None (built, and loaded when asked), "config", "model" or "load": where the first
        exception was raised (error / error_type).  moe: per routed-experts module, its quant
        method class, the oracle's backend and rejected set (as in `outcome`), `_w2_scale_sharding`
        where the release has it, and the w2 scale parameter's shape.  linear: per linear module
        with a compressed-tensors method, the kernel class its scheme chose and the per-rank
        (K, N) of the module; lm_head_method: the output projection's quant method class."""
        import torch

        set_gpu(case.get("gpu", "sm90"))
        _set_case_env(case.get("env") or {})
        _stubs.OPS_CALLED.clear()
        tp, rank, ep = case["tp"], case.get("rank", 0), bool(case.get("ep"))
        out: dict[str, Any] = {"stage": None, "error": None, "error_type": None, "version": self.version,
                               "gpu": case.get("gpu", "sm90"), "moe": {}, "linear": {}, "lm_head_method": None}

        def fail(stage: str, exc: BaseException) -> dict[str, Any]:
            out.update(stage=stage, error=_exception_text(exc), error_type=type(exc).__name__,
                       traceback=traceback.format_exc(limit=-6), ops_called=list(_stubs.OPS_CALLED))
            return out

        _MODEL["devices"] = tp
        _fake_parallel_state(tp, rank)
        _expert_maps_on_cpu()
        _forget_attention_backends()
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import initialize_model

        try:
            config = EngineArgs(model=case["ckpt"], tensor_parallel_size=tp, enable_expert_parallel=ep,
                                dtype="auto", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
                                load_format="safetensors", attention_backend=_attention_backend(case),
                                ).create_engine_config()
        except Exception as exc:  # the first failure is the outcome
            return fail("config", exc)
        self.oracle_calls.clear()
        default_dtype = torch.get_default_dtype()
        try:
            with set_current_vllm_config(config):
                torch.set_default_dtype(config.model_config.dtype)  # as the release's loader does
                with torch.device("meta"):
                    model = initialize_model(vllm_config=config)
        except Exception as exc:  # a harness failure, reported as such
            return fail("model", exc)
        finally:
            torch.set_default_dtype(default_dtype)
        self._read_model(model, out)
        out["tensors"] = _tensor_bytes(model)
        out["kv_spec"] = _kv_specs(model, config)
        out["ops_called"] = list(_stubs.OPS_CALLED)
        # the checkpoint's module names as the model class renames them (its hf_to_vllm_mapper)
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        out["name_map"] = {}
        for name in case.get("ckpt_names") or ():
            mapped = mapper._map_name(name + ".weight") if mapper is not None else name + ".weight"
            out["name_map"][name] = mapped.removesuffix(".weight") if mapped else None
        if case.get("process"):
            with set_current_vllm_config(config):
                out["experts_processed"] = self._processed_expert_bytes(model)
        if case.get("load"):
            try:
                with set_current_vllm_config(config):
                    _load_recorded(get_model_loader(config.load_config), model, config.model_config, out)
            except Exception as exc:  # the release's weight loader refused: the outcome
                return fail("load", exc)
        return out

    def _read_model(self, model, out: dict[str, Any]) -> None:
        experts = [(name, mod) for name, mod in model.named_modules()
                   if isinstance(mod, self.routed_experts_cls)]
        if len(self.oracle_calls) not in (0, len(experts)) and any(
                type(m.quant_method).__name__.startswith("CompressedTensorsWNA16") for _, m in experts):
            raise RuntimeError(f"{len(self.oracle_calls)} oracle calls for {len(experts)} routed-experts modules")
        calls = list(self.oracle_calls)
        for name, mod in experts:
            method = getattr(mod, "quant_method", None)
            entry: dict[str, Any] = {"method_class": type(method).__name__, "backend": None, "rejected": [],
                                     "oracle_ran": False, "w2_scale_sharding": None, "w2_scale_shape": None,
                                     "local_experts": getattr(mod, "local_num_experts", None)}
            wna16 = type(method).__name__.startswith("CompressedTensorsWNA16")
            if wna16 and calls:
                self.oracle_calls[:] = [calls.pop(0)]
                self._oracle_fields(entry)
            if wna16 and entry["backend"] is None:
                entry["backend"] = _backend_name(getattr(method, "wna16_backend", None))
            scale = getattr(mod, "w2_weight_scale", None)
            if scale is not None:
                entry["w2_scale_shape"] = list(scale.shape)
            fn = getattr(type(method), "_w2_scale_sharding", None)
            if wna16 and fn is not None:
                moe = mod.moe_config
                res = fn(method.actorder, method.group_size, moe.intermediate_size_per_partition, moe.intermediate_size)
                entry["w2_scale_sharding"] = [bool(res[0]), int(res[1]), bool(res[2])]
            out["moe"][name] = entry
        for name, mod in model.named_modules():
            method = getattr(mod, "quant_method", None)
            if name.split(".")[-1] == "lm_head" and method is not None:
                out["lm_head_method"] = type(method).__name__
            if type(method).__name__ != "CompressedTensorsLinearMethod":
                continue
            scheme = getattr(mod, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            out["linear"][name] = {
                "scheme": type(scheme).__name__, "kernel": type(kernel).__name__ if kernel is not None else None,
                "k_p": getattr(mod, "input_size_per_partition", None),
                "n_p": getattr(mod, "output_size_per_partition", None),
            }

    def _processed_expert_bytes(self, model) -> list[list]:
        """Per routed-experts module of a WNA16 method: the release's `process_weights_after_loading`
        run on the built (meta) tensors, compiled ops answering with meta scalars, then the bytes of
        the module's parameters, buffers and Marlin workspace: [name, backend, bytes, error]; error
        is what the processing raised (None: it completed)."""
        out: list[list] = []
        for name, mod in model.named_modules():
            method = getattr(mod, "quant_method", None)
            if not isinstance(mod, self.routed_experts_cls) or not type(method).__name__.startswith(
                    "CompressedTensorsWNA16"):
                continue
            error = None
            _stubs.OPS_META = True
            try:
                method.process_weights_after_loading(mod)
            except Exception as exc:  # reported: the test says which step stopped it
                error = f"{type(exc).__name__}: {_exception_text(exc)}"
            finally:
                _stubs.OPS_META = False
            seen: set[int] = set()
            total = 0
            tensors = [*mod.parameters(recurse=False), *mod.buffers(recurse=False), getattr(mod, "workspace", None)]
            for t in tensors:
                if t is not None and hasattr(t, "element_size") and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
            out.append([name, _backend_name(getattr(method, "wna16_backend", None)), total, error])
        return out

    def _load_check(self, method, layer, moe, case) -> str:
        """Drive the release's own expert weight loader with down_proj's packed weight of expert 0
        on the last MoE TP rank (small CPU tensors with a known code in every position) and say
        whether the rank's parameter then holds exactly its slice of the codes.

        "ok", "wrong codes: ..." (it loads, but another slice of the codes), or "raises ...".
        Only the expert placement is answered by the harness (expert 0 is local to rank 0 and,
        without EP, to every rank); the slicing and copying are the release's."""
        import torch

        bits, H, I = case["num_bits"], case["hidden_size"], case["intermediate_size"]
        packing = case.get("packing", "dense")
        par = moe.moe_parallel_config
        tp = par.tp_size
        rank = tp - 1
        try:
            object.__setattr__(par, "tp_rank", rank)
        except Exception as exc:
            return f"harness: cannot set tp_rank ({exc})"
        codes = (torch.arange(H * I, dtype=torch.int64).reshape(H, I) * 7 + 3) % (1 << bits)
        packed = ckptcase.pack_rows(codes, bits, packing)
        param = layer.w2_weight_packed
        param.data.zero_()
        layer.quant_method = method
        for name, value in (("_fused_shared_expert_quantizer", None), ("_loaded_expert_biases", set())):
            if not hasattr(layer, name):
                setattr(layer, name, value)
        layer._map_global_expert_id_to_local_expert_id = lambda expert_id: expert_id
        try:
            type(layer).weight_loader(layer, param, packed, f"{PREFIX}.0.down_proj.weight_packed", "w2", 0)
        except Exception as exc:
            return f"raises {type(exc).__name__}: {_exception_text(exc)}"
        finally:
            object.__setattr__(par, "tp_rank", 0)
        data = param.data[0]
        if data.shape[0] != H:  # K-first parameter: words along dim 0
            data = data.t()
        # the parameter's words as the release reads them: ceil(n * bits / 32) words per row, the
        # codes back to back (its _packed_dim); releases before 0.29 take only 4 and 8 bits, where
        # every packing is the same
        got = ckptcase.unpack_rows(data, bits, "dense")
        i_p = I // tp
        want = codes[:, rank * i_p:(rank + 1) * i_p]
        if got.shape[1] < i_p:
            return f"wrong codes: the parameter holds {got.shape[1]} codes per row, the rank needs {i_p}"
        if not torch.equal(got[:, :i_p], want):
            first = int((got[:, :i_p] != want).nonzero()[0, 1])
            return f"wrong codes: rank {rank} column {first} holds another column's code"
        return "ok"

    def _process_until_first_op(self, method, layer, out: dict[str, Any]) -> None:
        helper = getattr(self.oracle, "marlin_moe_padded_intermediate", None)
        calls: list[Any] = []
        if helper is not None:
            def recording_pad(*args, **kwargs):
                calls.append((args, kwargs))
                result = helper(*args, **kwargs)
                calls[-1] = (args, kwargs, result)
                return result

            self.oracle.marlin_moe_padded_intermediate = recording_pad
        if not hasattr(layer, "_loaded_expert_biases"):
            # the loader records the expert biases a checkpoint held (the GPTQ method reads it):
            # these cases hold none
            layer._loaded_expert_biases = set()
        _stubs.OPS_RAISE = True
        try:
            method.process_weights_after_loading(layer)
            out["process_error"] = "completed without a compiled op (unexpected for Marlin)"
        except _stubs.ExtensionOpCalled as stop:
            out["process_reached_op"] = str(stop)
        except Exception as exc:  # a failure of the release's weight processing
            out["process_error"] = f"{type(exc).__name__}: {_exception_text(exc)}"
        finally:
            _stubs.OPS_RAISE = False
            if helper is not None:
                self.oracle.marlin_moe_padded_intermediate = helper
        done = [c for c in calls if len(c) == 3]
        if done:
            out["padded_intermediate"] = int(done[0][2])

    def _w2_sharding(self, method, moe, case) -> list | None:
        """`_w2_scale_sharding` with the arguments `create_weights` passes (None where absent)."""
        fn = getattr(type(method), "_w2_scale_sharding", None) if method is not None else None
        if fn is None:
            return None
        try:
            res = fn(method.actorder, method.group_size, moe.intermediate_size_per_partition, moe.intermediate_size)
        except Exception as exc:
            return [f"{type(exc).__name__}: {exc}"]
        return [bool(res[0]), int(res[1]), bool(res[2])]

    def _format_w2_sharding(self, method, layer, moe) -> list | None:
        """[load_full_w2, w2_scales_size, is_k_full] of a GPTQ/AWQ/MoeWNA16 method, read from what
        its create_weights made: the w2 scales' `load_full_w2` attribute, their rows times the
        method's group size (the extent the rows cover), and the method's `is_k_full` (True where
        the method has none: it keeps no act-order)."""
        scales = getattr(layer, "w2_scales", None)
        if method is None or scales is None:
            return None
        gs = getattr(getattr(method, "quant_config", None), "group_size", -1)
        load_full = bool(getattr(scales, "load_full_w2", False))
        size = moe.intermediate_size if load_full else moe.intermediate_size_per_partition
        if type(method).__name__ != "MoeWNA16Method" and gs > 0:
            size = int(scales.shape[1]) * gs
        return [load_full, size, bool(getattr(method, "is_k_full", True))]

    def _oracle_fields(self, out: dict[str, Any]) -> None:
        """backend: what the method constructor's oracle call returned (also when the
        constructor then failed); oracle_ran: whether the constructor got to the oracle."""
        out["oracle_ran"] = bool(self.oracle_calls)
        if self.oracle_calls and self.oracle_calls[-1]["result"] is not None:
            out["backend"] = _backend_name(self.oracle_calls[-1]["result"][0])
        out["rejected_reasons"] = self._rejected()
        out["rejected"] = sorted(out["rejected_reasons"])

    def _rejected(self) -> dict[str, str]:
        """Backends of the CUDA priority list that fail the oracle's own two tests.

        The auto loop stops at the first backend that passes, so for the backends after it the
        same two tests are asked here with the arguments the method constructor gave the oracle:
        `_backend_incompatibility_reason` (where the release has it) and every kernel class's
        `is_supported_config`.  A backend is rejected when a reason is returned, or no kernel
        class supports the configuration, or asking raises.
        """
        if not self.oracle_calls:
            return {}
        call = self.oracle_calls[-1]
        bound = _bind(self.real_select, call["args"], call["kwargs"])
        o = self.oracle
        mk = sys.modules["vllm.model_executor.layers.fused_moe.modular_kernel"]
        config = bound["config"]
        fmt = (
            mk.FusedMoEActivationFormat.BatchedExperts
            if config.moe_parallel_config.use_batched_activation_format
            else mk.FusedMoEActivationFormat.Standard
        )
        reason_fn = getattr(o, "_backend_incompatibility_reason", None)
        rejected: dict[str, str] = {}
        for backend in o._get_priority_backends():
            name = _backend_name(backend)
            try:
                if reason_fn is not None:
                    reason = _call_with(reason_fn, {"backend": backend, "moe_config": config, **bound})
                    if reason is not None:
                        rejected[name] = reason
                        continue
                why = []
                for k_cls in o.backend_to_kernel_cls(backend):
                    supported, reason = k_cls.is_supported_config(k_cls, config, bound["weight_key"], None, fmt)
                    if supported:
                        break
                    why.append(f"{k_cls.__name__}: {reason}")
                else:
                    rejected[name] = "; ".join(why)
            except Exception as exc:  # asking raised: the real loop would raise too
                rejected[name] = f"raises {type(exc).__name__}: {exc}"
        return rejected


def _load_recorded(loader, model, model_config, out: dict[str, Any]) -> None:
    """The release's `loader.load_weights(model, ...)`, recording in `out["loaded"]` the checkpoint
    tensors its weight iterator handed the model (names_read), and the parameters with a weight
    loader of their own that no call of it wrote (not_written: never called, or every call
    answered False, as MoE loaders answer for a tensor they do not take).  Quantized models are
    loaded without the release's own check that every parameter was."""
    read: list[str] = []
    written: set[str] = set()
    all_weights = loader.get_all_weights

    def recording_weights(*args, **kwargs):
        for name, tensor in all_weights(*args, **kwargs):
            read.append(name)
            yield name, tensor

    def recording(name: str, fn):
        def weight_loader(*args, **kwargs):
            res = fn(*args, **kwargs)
            if res is not False:
                written.add(name)
            return res
        return weight_loader

    own = {}
    for name, param in model.named_parameters():
        attr = "_weight_loader" if "_weight_loader" in vars(param) else "weight_loader"
        fn = vars(param).get(attr)
        if callable(fn):
            own[name] = (param, attr, fn)
            setattr(param, attr, recording(name, fn))
    loader.get_all_weights = recording_weights
    try:
        loader.load_weights(model, model_config)
    finally:
        del loader.get_all_weights
        for param, attr, fn in own.values():
            setattr(param, attr, fn)
        out["loaded"] = {"names_read": sorted(read), "not_written": sorted(set(own) - written)}


def _tensor_bytes(model) -> dict[str, list]:
    """Every parameter and buffer of the built model (each storage once, as `named_parameters` and
    `named_buffers` list them): name -> [shape, dtype, bytes].  Built on the meta device, these are
    what the rank allocates on its GPU before weight processing."""
    out: dict[str, list] = {}
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            out[name] = [list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size(), kind]
    return out


def _kv_specs(model, config) -> dict[str, Any]:
    """Per attention layer, the KV-cache spec the layer reports (`get_kv_cache_spec`): its class,
    page size in bytes and block size; the bytes per token of one layer are page / block."""
    from vllm.config import set_current_vllm_config

    out: dict[str, Any] = {}
    with set_current_vllm_config(config):
        for name, mod in model.named_modules():
            fn = getattr(mod, "get_kv_cache_spec", None)
            if fn is None or not callable(fn):
                continue
            try:
                spec = fn(config)
            except Exception as exc:  # reported, not raised: the comparison names it
                out[name] = {"error": f"{type(exc).__name__}: {_exception_text(exc)}"}
                continue
            if spec is None:
                continue
            out[name] = {"class": type(spec).__name__, "page_size_bytes": int(spec.page_size_bytes),
                         "block_size": int(spec.block_size),
                         "sliding_window": getattr(spec, "sliding_window", None)}
    return out


def _bind(fn, args, kwargs) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _call_with(fn, values: dict[str, Any]):
    import inspect

    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in values.items() if k in params})


def _backend_name(backend) -> str | None:
    if backend is None:
        return None
    return str(backend.value if isinstance(backend, enum.Enum) else backend).lower()


def _exception_text(exc: BaseException) -> str:
    # ValueError("a ", "b") (vLLM's get_moe_method passes several arguments) prints as a tuple;
    # str() is what a user sees in the traceback, so that is the text compared.
    return str(exc)


def _find_routed_experts_class():
    import importlib

    for name in ("vllm.model_executor.layers.fused_moe.routed_experts", "vllm.model_executor.layers.fused_moe.layer"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for cls_name in ("RoutedExperts", "FusedMoE"):
            cls = getattr(mod, cls_name, None)
            if cls is not None:
                return cls
    raise ImportError("no RoutedExperts/FusedMoE class in this release")


def _build_dataclass(cls, values: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {k: v for k, v in values.items() if k in fields}
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(f"{cls.__name__}: no value for required fields {missing} (release changed its config)")
    return cls(**kwargs)


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything vLLM prints goes to stderr; stdout carries only the protocol
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    tree, extensions_file, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        with open(extensions_file) as f:
            extensions = [line.strip() for line in f if line.strip()]
        import glob

        meta = glob.glob(os.path.join(tree, "vllm-*.dist-info", "METADATA"))
        metadata_text = open(meta[0]).read() if meta else ""
        _stubs.install(tree, extra, extensions, metadata_text)
        release = Release()
    except Exception as exc:
        proto.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "version": release.version}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        try:
            kind = case.get("kind")
            res = (release.linear_outcome(case) if kind == "linear" else release.format_linear_outcome(case)
                   if kind == "format_linear" else release.model_outcome(case) if kind == "model"
                   else release.outcome(case))
        except Exception as exc:  # a harness failure, reported as such
            res = {"harness_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(res, default=str) + "\n")
    proto.flush()
    os._exit(0)  # the release's modules need no teardown (it can take seconds)


if __name__ == "__main__":
    sys.exit(main())
