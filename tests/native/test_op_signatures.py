"""The torch ops' CPU and CUDA functions agree on their signatures, defaults included.

torch calls a registered kernel with only the arguments its caller passed, so a CUDA function
without the default the schema (and the CPU function) has fails only on a GPU. Both checks here
run without one: the signatures are compared, and the CUDA functions are called with every
optional argument omitted while the CUDA library is absent (they then run the CPU code)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch

from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack
from wna16ctl.layout.packing import pack_codes
from wna16ctl.native import ops


def _wna16ctl_ops() -> dict[str, Any]:
    from torch._library import custom_ops

    return {name: d for name, d in custom_ops.OPDEFS.items() if name.startswith("wna16ctl::")}


def _cuda_ops() -> dict[str, Any]:
    return {name: d for name, d in _wna16ctl_ops().items() if "cuda" in d._backend_fns}


def _defined(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a kernel was registered with, under torch's wrappers (which take *args)."""
    todo = [fn]
    while todo:
        f = todo.pop(0)
        if getattr(f, "__module__", "").startswith("wna16ctl."):
            return f
        todo.extend(c.cell_contents for c in (getattr(f, "__closure__", None) or []) if callable(c.cell_contents))
    raise AssertionError(f"no wna16ctl function under {fn}")


def test_every_op_has_its_cuda_kernel() -> None:
    assert set(_cuda_ops()) == {"wna16ctl::marlin_repack", "wna16ctl::marlin_permute_scales",
                                "wna16ctl::marlin_zero_points", "wna16ctl::moe_wna16_gemm"}


@pytest.mark.parametrize("name", sorted(_cuda_ops()))
def test_cuda_and_cpu_functions_have_the_same_signature(name: str) -> None:
    opdef = _cuda_ops()[name]
    cpu = inspect.signature(_defined(opdef._init_fn))
    cuda = inspect.signature(_defined(opdef._backend_fns["cuda"]))
    assert [(p.name, p.kind, p.default) for p in cuda.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in cpu.parameters.values()], name
    # every default of the schema is the functions' default
    for arg in opdef._opoverload._schema.arguments:
        if arg.has_default_value():
            assert cpu.parameters[arg.name].default == arg.default_value, (name, arg.name)


def _required_args() -> dict[str, dict[str, Any]]:
    """For each op, values of the arguments that have no default."""
    g = torch.Generator().manual_seed(0)
    k, n, bits, e = 128, 64, 4, 2
    q = torch.randint(0, 16, (e, k, n), generator=g, dtype=torch.int32)
    packed = pack_codes(q, bits, dim=-2)
    scales = torch.rand(e, k // 64, n, generator=g).to(torch.bfloat16)
    zp = pack_codes(torch.randint(0, 16, (e, k // 64, n), generator=g, dtype=torch.int32), bits)
    a = torch.randn(3, k, generator=g).to(torch.bfloat16)
    gemm = dict(a=a, b_q=marlin_repack(packed, bits), scales=marlin_permute_scales(scales, k, n, 64),
                sorted_token_ids=torch.tensor([0, 2, 4, 1, 3, 5], dtype=torch.int32),
                expert_offsets=torch.tensor([0, 3, 6], dtype=torch.int32), top_k=2, num_bits=bits)
    return {
        "wna16ctl::marlin_repack": dict(packed=packed, num_bits=bits),
        "wna16ctl::marlin_permute_scales": dict(s=scales, size_k=k, size_n=n, group_size=64),
        "wna16ctl::marlin_zero_points": dict(zp=zp, size_k=k // 64, size_n=n, num_bits=bits),
        "wna16ctl::moe_wna16_gemm": gemm,
    }


@pytest.mark.parametrize("name", sorted(_cuda_ops()))
def test_op_and_cuda_function_called_with_every_optional_omitted(name: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    opdef = _cuda_ops()[name]
    args = _required_args()[name]
    schema_args = [a.name for a in opdef._opoverload._schema.arguments]
    assert not any(opdef._opoverload._schema.arguments[schema_args.index(a)].has_default_value() for a in args)
    op: Callable[..., torch.Tensor] = getattr(torch.ops.wna16ctl, name.split("::")[1])
    via_op = op(*args.values())
    # the CUDA function as torch would call it, without the library (it then runs the CPU code)
    monkeypatch.setattr(ops, "cuda_lib", lambda: None)
    monkeypatch.setattr(ops, "_notice", lambda message: None)
    via_cuda = _defined(opdef._backend_fns["cuda"])(*args.values())
    assert torch.equal(via_op, via_cuda)


def test_every_optional_argument_has_its_default() -> None:
    """An optional tensor (`Tensor?`) without a default must be passed, even as None: every one has
    None, and the optional arguments follow the required ones (a positional call can omit them)."""
    for name, opdef in _wna16ctl_ops().items():
        arguments = opdef._opoverload._schema.arguments
        for arg in arguments:
            if isinstance(arg.real_type, torch.OptionalType):
                assert arg.has_default_value() and arg.default_value is None, (name, arg.name)
        defaults = [arg.has_default_value() for arg in arguments]
        assert defaults == sorted(defaults), (name, [arg.name for arg in arguments])


@pytest.mark.parametrize("name", sorted(_cuda_ops()))
def test_op_called_with_every_optional_omitted_by_keyword_and_by_position(name: str) -> None:
    """The required arguments alone, named or in order, give what the documented wrapper gives
    with its defaults."""
    args = _required_args()[name]
    op: Callable[..., torch.Tensor] = getattr(torch.ops.wna16ctl, name.split("::")[1])
    by_name, by_position = op(**args), op(*args.values())
    assert torch.equal(by_name, by_position)
    if name == "wna16ctl::moe_wna16_gemm":
        tensors = [args[k] for k in ("a", "b_q", "scales", "sorted_token_ids", "expert_offsets")]
        wrapper = ops.moe_wna16_gemm(*tensors, top_k=args["top_k"], num_bits=args["num_bits"])
        assert torch.equal(by_name, wrapper)


_EAGER_CHILD = """
import sys, torch
from tests.native.test_kernels import make_problem
from wna16ctl.native import ops
for case in ({}, {"zp": True}, {"act_order": True}):
    a, b_q, s, ids, offs, top_k, bits, zp, g_idx, perm, w, k_full = make_problem(**case)["args"]
    kw = dict(zero_points=zp, g_idx=g_idx, perm=perm, topk_weights=w, is_k_full=k_full)
    got = ops.moe_wna16_gemm(a, b_q, s, ids, offs, top_k=top_k, num_bits=bits, **kw)
    seen = "torch._dynamo" in sys.modules
    want = torch.ops.wna16ctl.moe_wna16_gemm(a, b_q, s, ids, offs, top_k, bits, **kw)
    assert torch.equal(got, want), case
    print(seen)
"""


def test_the_gemm_called_on_plain_tensors_skips_the_dispatcher_and_gives_its_result() -> None:
    """`ops.moe_wna16_gemm` on plain CPU tensors calls the kernel itself: the first call does not
    import torch._dynamo (seconds of every verify's start, through the custom op's dispatch) and
    gives the registered op's result bit for bit."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _EAGER_CHILD], capture_output=True, text=True, cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True", "True"], run.stdout  # imported by the dispatched call only


def test_the_gemm_on_fake_tensors_still_goes_through_the_dispatcher() -> None:
    """A tracer's tensors (torch's FakeTensor here) take the registered op's fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.native.test_kernels import make_problem

    a, b_q, s, ids, offs, top_k, bits, zp, g_idx, perm, w, k_full = make_problem()["args"]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fa, fb, fs, fi, fo = (mode.from_tensor(t) for t in (a, b_q, s, ids, offs))
        out = ops.moe_wna16_gemm(fa, fb, fs, fi, fo, top_k=top_k, num_bits=bits, topk_weights=mode.from_tensor(w))
    assert out.shape == (a.shape[0] * top_k, s.shape[-1]) and type(out) is not torch.Tensor
