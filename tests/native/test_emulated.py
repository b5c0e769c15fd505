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
    a, b_q, scales, ids, offs, top_k, num_bits, zp, g_idx, perm, tw, k_full = prob["args"]
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
    a, ids, offs, top_k = prob["args"][0], prob["args"][3], prob["args"][4], prob["args"][5]
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


def _counted(prob: dict) -> tuple[torch.Tensor, dict[str, int]]:
    before = emulated.emulation_counters()
    out, _ = _run(prob)
    after = emulated.emulation_counters()
    return out, {k: after[k] - before[k] for k in after}


@pytest.fixture
def restore_configuration():
    yield
    emulated.configure_emulation(concurrent_blocks=emulated.usable_cores(), fibers=1)  # the library's own


CASES = [dict(size_k=256, size_n=128, group_size=64), dict(size_k=96, size_n=128, group_size=32, num_bits=8, zp=True),
         dict(size_k=80, size_n=64, group_size=16, act_order=True, k_full=False, zp=True)]


@pytest.mark.parametrize("case", CASES)
def test_fibers_and_blocks_side_by_side_give_the_same_bits(case, restore_configuration):
    """The verify library runs each block's CUDA threads as fibers and several blocks at once (one
    OS thread each); the output equals, bit for bit, one OS thread per CUDA thread with the
    blocks one after another (the emulation's reference schedule)."""
    prob = grid_problem(**case)
    emulated.configure_emulation(concurrent_blocks=1, fibers=0)
    reference, counted = _counted(prob)
    assert counted["os_threads"] >= 32 * counted["launches"]  # an OS thread per CUDA thread
    for blocks in (2, 4):
        emulated.configure_emulation(concurrent_blocks=blocks, fibers=1)
        got, counted = _counted(prob)
        assert torch.equal(got.view(torch.int16), reference.view(torch.int16)), blocks
        # one OS thread per block side by side (v2 / v1 launch a small kernel before the GEMM)
        if counted["launches"] == 1:
            assert counted["os_threads"] == min(blocks, counted["blocks"])
        else:
            assert counted["launches"] <= counted["os_threads"] <= blocks * counted["launches"]


def test_launches_from_several_threads_give_each_its_own_bits():
    """verify launches the ranks' GEMMs from worker threads at once: each output equals, bit for
    bit, the same launch run alone (the emulator keeps no launch state outside the launch)."""
    from concurrent.futures import ThreadPoolExecutor

    probs = [grid_problem(**case) for case in CASES for _ in range(2)]
    alone = [_run(p)[0] for p in probs]
    with ThreadPoolExecutor(len(probs)) as pool:
        together = list(pool.map(lambda p: _run(p)[0], probs))
    for got, want in zip(together, alone):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_launch_runs_on_every_core():
    """As loaded, the library runs as many blocks side by side as the process has cores (its
    affinity), up to the grid's blocks: counted OS threads, not time."""
    prob = grid_problem(size_k=256, size_n=128, group_size=64)
    _, counted = _counted(prob)
    assert counted["launches"] == 1 and counted["blocks"] >= 2
    assert counted["os_threads"] == min(emulated.usable_cores(), counted["blocks"])


def test_mma_work_follows_the_routed_rows():
    """A tile holds 16 (or 32, 64) sorted rows; rows past an expert's routed ones are zero and
    not multiplied: the mma rows multiplied are the routed slots × N/8 × K/16, however few rows
    each expert has, while the tiles (16 rows per mma) stay one per expert and n-block."""
    from tests.native.test_kernels import make_problem

    k, n, experts = 256, 256, 8
    seen = {}
    for m in (4, 32):  # 1 and 8 slots per expert on average (top-2 of 8): 16-row tiles both
        prob = make_problem(size_k=k, size_n=n, group_size=64, experts=experts, m=m, top_k=2)
        _, counted = _counted(prob)
        slots = m * 2
        assert counted["mma_rows_multiplied"] == slots * (n // 8) * (k // 16)
        seen[m] = counted
    # the rows multiplied grew with the rows routed (8x), the mma instructions did not
    assert seen[32]["mma_rows_multiplied"] == 8 * seen[4]["mma_rows_multiplied"]
    assert seen[32]["mma_rows"] <= 16 * experts * (n // 8) * (k // 16) * 2
