"""The import environment in which one vLLM release's decision code runs on a machine without GPU.

Only vLLM's own `.py` files are present (no compiled extensions, no engine dependencies).  The
machine modelled is a stock `pip install vllm==X` on CUDA: every *unconditional* requirement of
the wheel (its METADATA) is installed, nothing else.  Replacements:

* each required third-party package that is missing here (zmq, msgspec, flashinfer, humming, ...)
  becomes a placeholder module whose every attribute is a placeholder class, with the version the
  wheel pins; an optional package stays missing, so vLLM's `has_*` probes see it absent;
* Humming: its `config.GemmType` enum is real (vLLM compares its values with strings to pick the
  Humming experts class); the rest of the package is placeholders;
* Triton: a small stand-in with one active CUDA driver (what vLLM checks for HAS_TRITON);
* the wheel's compiled modules and their torch.ops namespaces: empty stand-ins (never called by
  the decisions; calls are recorded, and can be made to raise);
* the platform: vLLM's real CUDA platform class answering for one device of the case's compute
  capability (set per case, see `set_gpu`).

`WNA16CTL_CONFORMANCE_ABSENT` (comma list of module names) removes required packages from the
modelled machine, e.g. `humming,flashinfer` for an install without them.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import types

# Never present on the machine modelled (they are not requirements of the CUDA wheel); listed so a
# future release that adds one to its requirements does not silently change the model.
MUST_STAY_ABSENT = frozenset({
    "deep_gemm", "deep_ep", "pplx_kernels", "aiter", "triton_kernels", "flydsl", "nixl", "nixl_ep",
    "mori", "helion", "xformers", "flash_attn", "intel_extension_for_pytorch", "habana_frameworks",
    "torch_xla", "amdsmi", "pynvml", "vllm_xpu_kernels", "runai_model_streamer", "tensorizer",
    "ray", "lmcache", "cupy", "qutlass", "fbgemm_gpu", "mamba_ssm", "causal_conv1d", "bitsandbytes",
    "gguf", "modelopt", "tpu_info", "libtpu", "tpu_inference", "sgl_kernel", "torchao",
})


def _absent_by_request() -> frozenset[str]:
    raw = os.environ.get("WNA16CTL_CONFORMANCE_ABSENT", "")
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


class _PlaceholderMeta(type):
    """Class-level attribute access also yields placeholders (`zmq.Context.instance`)."""

    def __new__(mcs, name, bases, namespace, **kwargs):
        return super().__new__(mcs, name, bases, namespace)

    def __init__(cls, name, bases, namespace, **kwargs):
        super().__init__(name, bases, namespace)

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder_class(f"{cls.__name__}.{name}")

    def __or__(cls, other):  # `Foo | None` in annotations evaluated at import time
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, item):  # `Foo[int]` in annotations
        return cls

    def __iter__(cls):
        return iter(())


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init_subclass__(cls, **kwargs):  # `class S(msgspec.Struct, omit_defaults=True)`
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # used as a field type of a model
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        # decorator use: `@stub.thing` returns the function unchanged
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Placeholder()

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    # a tracing span (`with tracer.start_as_current_span(...)` around model construction) that
    # records nothing
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _placeholder_class(name: str) -> type:
    return _PlaceholderMeta(name.rsplit(".", 1)[-1], (_Placeholder,), {})


class _PlaceholderModule(types.ModuleType):
    def __init__(self, name: str, version: str = "0.0.0"):
        super().__init__(name)
        self.__path__ = []  # a package: submodules are placeholders too
        self.__version__ = version

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _PlaceholderLoader(importlib.abc.Loader):
    def __init__(self, version: str = "0.0.0") -> None:
        self.version = version

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name, self.version)
        fill = _REAL_PARTS.get(spec.name)
        if fill is not None:
            fill(module)
        return module

    def exec_module(self, module):
        pass


# Module names of distributions whose import name differs from the distribution name.
_MODULE_OF_DIST = {
    "pyzmq": "zmq", "pillow": "PIL", "opencv-python-headless": "cv2", "py-cpuinfo": "cpuinfo",
    "python-json-logger": "pythonjsonlogger", "pyyaml": "yaml", "openai-harmony": "openai_harmony",
    "oss-harmony": "openai_harmony", "lm-format-enforcer": "lmformatenforcer", "protobuf": "google",
    "apache-tvm-ffi": "tvm_ffi", "nvidia-cudnn-frontend": "cudnn", "quack-kernels": "quack",
    "humming-kernels": "humming", "flashinfer-python": "flashinfer", "nvidia-cutlass-dsl": "cutlass",
    "prometheus-client": "prometheus_client", "opentelemetry-sdk": "opentelemetry",
    "opentelemetry-api": "opentelemetry", "opentelemetry-exporter-otlp": "opentelemetry",
    "opentelemetry-semantic-conventions-ai": "opentelemetry",
}
# Pulled in by the requirements above (requests -> urllib3, ...) and imported by vLLM directly.
_TRANSITIVE = ("urllib3", "anyio", "httpx", "uvicorn", "uvloop", "jinja2", "markupsafe")


def required_modules(metadata_text: str) -> dict[str, str]:
    """Top-level modules of the release's unconditional requirements, with the pinned version."""
    mods = {m: "0.0.0" for m in _TRANSITIVE}
    for line in metadata_text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        dist = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].strip()
        pinned = re.search(r"==\s*([0-9][^,;\s]*)", req)
        key = dist.lower().replace("_", "-")
        mods[_MODULE_OF_DIST.get(key, key.replace("-", "_"))] = pinned.group(1) if pinned else "0.0.0"
    return mods


def _fill_humming_config(module: types.ModuleType) -> None:
    # vLLM picks the Humming experts class by comparing `GemmType.<X>.value.lower()` with
    # "indexed" / "grouped_contiguous" (fused_humming_moe.get_humming_moe_gemm_type).
    class GemmType(enum.Enum):
        INDEXED = "indexed"
        GROUPED_CONTIGUOUS = "grouped_contiguous"
        GROUPED_MASKED = "grouped_masked"

    module.GemmType = GemmType


_REAL_PARTS = {"humming.config": _fill_humming_config}


class MissingPackageFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a placeholder for a missing module that vLLM requires.

    Only the release's unconditional requirements (minus MUST_STAY_ABSENT) get one; an optional
    package stays missing, so vLLM's `has_*` probes and `try: import` guards see it absent, as on
    a machine with a plain `pip install vllm`.
    """

    def __init__(self, tree: str, required: dict[str, str]) -> None:
        self.tree = tree
        absent = MUST_STAY_ABSENT | _absent_by_request()
        self.required = {m: v for m, v in required.items() if m not in absent}
        self.placeholdered: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".", 1)[0]
        if top not in self.required:
            return None
        if "." in fullname and not isinstance(sys.modules.get(top), _PlaceholderModule):
            return None  # a missing submodule of a real package stays missing
        self.placeholdered.add(top)
        return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(self.required[top]), is_package=True)


def install_triton() -> None:
    """A Triton with one active driver: what `vllm.triton_utils` checks to set HAS_TRITON."""

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return True

    class _Backend:
        driver = _Driver

    triton = _PlaceholderModule("triton")
    triton.__version__ = "3.6.0"
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    backends = _PlaceholderModule("triton.backends")
    backends.backends = {"nvidia": _Backend()}
    triton.backends = backends
    language = _PlaceholderModule("triton.language")
    triton.language = language

    def _jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def _autotune(*args, **kwargs):
        return lambda f: f

    class Config:
        """A kernel launch configuration (module-level autotune lists filter on its fields)."""

        def __init__(self, kwargs=None, num_warps=4, num_stages=3, num_ctas=1, maxnreg=None, pre_hook=None, **extra):
            self.kwargs = dict(kwargs or {})
            self.num_warps, self.num_stages, self.num_ctas = num_warps, num_stages, num_ctas
            self.maxnreg, self.pre_hook = maxnreg, pre_hook

    triton.Config = Config
    triton.jit = _jit
    triton.autotune = _autotune
    triton.heuristics = _autotune
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << max(0, (n - 1).bit_length())
    language.constexpr = _placeholder_class("constexpr")
    for name, mod in (("triton", triton), ("triton.backends", backends), ("triton.language", language)):
        sys.modules[name] = mod


class _TritonFinder(importlib.abc.MetaPathFinder):
    """`triton.<anything else>` submodules: placeholders under the stand-in package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, _PlaceholderLoader(), is_package=True)
        return None


class _ExtensionFinder(importlib.abc.MetaPathFinder):
    """The wheel's compiled modules (vllm._C_stable_libtorch, ...): empty modules.

    On import they only register torch ops, which the decision code never calls.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            return importlib.machinery.ModuleSpec(fullname, _EmptyLoader())
        return None


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


# torch.ops namespaces the compiled extensions would fill.  Some modules call an op at import
# time (e.g. asking the CUTLASS build whether it has fp8 for this capability); none of those
# answers enters the WNA16 MoE decisions, and every call is recorded so that a worker can report
# if one ever does run during a case.
EXTENSION_OP_NAMESPACES = (
    "_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_rocm_C", "_qutlass_C", "_flashmla_C",
    "_flashmla_extension_C", "_vllm_fa2_C", "_vllm_fa3_C", "_C_stable_libtorch",
    "_moe_C_stable_libtorch", "_flashkda_C", "_C_utils",
)
OPS_CALLED: list[str] = []


class ExtensionOpCalled(Exception):
    """Raised by a compiled op while `OPS_RAISE` is set: the release's Python code got that far."""


OPS_RAISE = False
# while set, a compiled op returns a zero scalar: the release's Python code around it runs with the
# shapes it computes, as in weight processing where each op's output is written into a tensor the
# Python code allocated
OPS_META = False


class _OpNamespace:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, op: str):
        if op.startswith("__"):
            raise AttributeError(op)
        return _Op(f"{self._name}.{op}")


class _Op:
    """One compiled op: calls are recorded (and raise while `OPS_RAISE` is set).  Its overloads
    (`.default`, `.out`, ...) are the same op: compile-pass pattern tables, imported while the
    engine config is built, reference them without calling them."""

    def __init__(self, qual: str) -> None:
        self._qual = qual

    def __call__(self, *args, **kwargs):
        OPS_CALLED.append(self._qual)
        if OPS_RAISE:
            raise ExtensionOpCalled(self._qual)
        if OPS_META:
            import torch

            return torch.zeros(())
        return _Placeholder()

    def __getattr__(self, overload: str):
        if overload.startswith("__"):
            raise AttributeError(overload)
        return self


def install_op_namespaces() -> None:
    import torch

    for name in EXTENSION_OP_NAMESPACES:
        setattr(torch.ops, name, _OpNamespace(name))
    # fake (meta) kernels for those ops cannot be registered: the ops do not exist
    real_register_fake = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.split("::", 1)[0] in EXTENSION_OP_NAMESPACES:
            return (lambda fn: fn) if not args else args[0]
        return real_register_fake(op, *args, **kwargs)

    torch.library.register_fake = register_fake


def install(tree: str, extra_paths: list[str], extensions: list[str], metadata_text: str) -> MissingPackageFinder:
    """Put the release tree (and its pinned compressed-tensors) first on sys.path, add the stand-ins."""
    for p in reversed([tree, *extra_paths]):
        sys.path.insert(0, p)
    import torch  # the real CPU torch, imported before any placeholder exists
    # vLLM patches inductor at import; inductor must see the real (absent) Triton, not ours.
    import torch._inductor.lowering  # noqa: F401 - imported for its effect: vLLM patches inductor at import
    install_triton()
    install_op_namespaces()
    finder = MissingPackageFinder(tree, required_modules(metadata_text))
    sys.meta_path.insert(0, _ExtensionFinder(extensions))
    sys.meta_path.append(_TritonFinder())
    sys.meta_path.append(finder)
    return finder
