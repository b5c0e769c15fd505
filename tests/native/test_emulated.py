"""The emulated kernel library verify loads (wna16ctl/native/emulated.py): the real MoE GEMM
sources built with g++ against kernels/emu/, called in-process through ctypes.

Same problems and references as the driver tests of test_emu.py / test_emu_gemm_v2.py (the torch
op and an fp32 reference); here what is checked is the product path: the library builds, v3 runs
where it applies, v2 takes what v3 declines (act-order, small groups) and v1 what v2 declines,
and without g++ the reason is kept (callers report "not run")."""

from __future__ import annotations

import pytest
import torch

import wna16ctl.native.emulated as emulated
from tests.native.test_emu import TOL, grid_problem
from wna16ctl.native.build import KernelBuildError

pytestmark = pytest.mark.skipif(emulated.find_cxx() is None, reason="no g++: the emulated kernels cannot be built")


def _run(prob: dict) -> tuple[torch.Tensor, str]:
    a, b_q, scales, zp, g_idx, perm, ids, offs, tw, top_k, num_bits, k_full = prob["args"]
    return emulated.emulated_moe_gemm(a, b_q, scales, ids, offs, top_k=top_k, num_bits=num_bits, zero_points=zp,
                                      g_idx=g_idx, perm=perm, topk_weights=tw, is_k_full=k_full)


@pytest.mark.parametrize("case,kernel", [
    (dict(size_k=128, size_n=64, group_size=64), "v3"),  # the fast mode: v3, as on a GPU
    (dict(size_k=96, size_n=128, group_size=32, num_bits=8, zp=True, pad=16), "v2"),
    (dict(size_k=80, size_n=64, group_size=16, act_order=True, k_full=False, zp=True), "v2"),
])
def test_emulated_gemm_matches_the_references(case, kernel):
    prob = grid_problem(**case)
    got, which = _run(prob)
    assert which == kernel
    a, ids, offs, top_k = prob["args"][0], prob["args"][6], prob["args"][7], prob["args"][9]
    routed = torch.zeros(a.shape[0] * top_k, dtype=torch.bool)
    listed = ids[int(offs[0]): int(offs[-1])].long()
    routed[listed[(listed >= 0) & (listed < routed.numel())]] = True
    want = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
    exp = prob["expected"][routed]
    tol = TOL[prob["dtype"]]
    assert float((got[routed].float() - want[routed].float()).abs().max() / exp.abs().max()) < tol
    assert float((got[routed].float() - exp).abs().max() / exp.abs().max()) < tol
    assert not bool(got[~routed].float().any())  # rows no slot reaches stay as allocated (zero)


def test_without_a_compiler_the_reason_is_kept(monkeypatch):
    monkeypatch.setattr(emulated, "_state", {})
    monkeypatch.setattr(emulated, "find_cxx", lambda: None)
    assert emulated.emulated_gemm_lib() is None
    assert "no C++ compiler" in emulated.emulated_unavailable_reason()
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        _run(grid_problem(size_k=128, size_n=64, group_size=64))
