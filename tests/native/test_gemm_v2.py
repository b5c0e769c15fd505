"""The fast MoE GEMM (kernels/moe_gemm_v2.cu) where no GPU is needed, and against the CPU op on one.

* its register dequantisation (kernels/dequant.cuh), compiled for the host (the emulated
  intrinsics) and checked exhaustively against the plain conversion (tests/native/dequant_test.cpp);
* the kernel selection switches;
* gpu: the v2 kernel against the torch op and the v1 kernel for every tile variant and mode; the
  v3 kernel (the automatic choice in its fast mode) equal to v2 bit for bit, twice on one
  workspace.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.native.test_kernels import GEMM_CASES, TOL, _case_id, _rel_err, make_problem
from wna16ctl.native import ops as K

NATIVE = Path(__file__).resolve().parent


def test_dequant_bit_tricks_equal_plain_conversion(tmp_path: Path) -> None:
    cxx = K.find_cxx()
    if cxx is None:
        pytest.skip("no g++ on PATH")
    exe = tmp_path / "dequant_test"
    # the intrinsics of the host build: kernels/emu/intrinsics_host.h
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", "-Wall", "-Wextra", "-Werror", "-I",
                            str(K.kernels_dir()), str(NATIVE / "dequant_test.cpp"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    assert run.stdout.startswith("ok "), run.stdout
    assert int(run.stdout.split()[1]) > 1_000_000  # every code x zero x scale was checked


def test_kernel_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v1")
    assert K.gemm_kernel() == "v1"
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "fastest")
    with pytest.raises(ValueError, match="WNA16CTL_GEMM_KERNEL"):
        K.gemm_kernel()
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", "tile32")
    assert K.gemm_variant() == 32
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", "tile48")
    with pytest.raises(ValueError, match="tile16"):
        K.gemm_variant()


# ----------------------------------------------------------------------------------------------
# GPU

V2_CASES = GEMM_CASES + [
    {"size_k": 272, "group_size": -1},                    # K % 64 == 16
    {"size_k": 288, "group_size": 32},                    # K % 64 == 32, general mode
    {"size_k": 304, "group_size": 16, "num_bits": 8},     # K % 64 == 48
    {"size_n": 64, "zp": True},                           # one n-tile
    {"size_n": 320, "dtype": torch.float16, "num_bits": 8, "zp": True},
    {"skew": True, "m": 70, "experts": 2, "size_n": 128, "zp": True, "dtype": torch.float16},
    {"skew": True, "m": 40, "experts": 3, "act_order": True, "k_full": False, "num_bits": 8},
]


def _cuda_problem(case: dict) -> tuple[dict, list]:
    """The problem of `case` and its arguments on the GPU, or a skip saying why there is none."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    if not K.cuda_available():
        pytest.skip("CUDA library unavailable (nvcc missing or build failed; see the log)")
    prob = make_problem(**case)
    return prob, [x.cuda() if isinstance(x, torch.Tensor) else x for x in prob["args"]]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "tile16", "tile32", "tile64"])
@pytest.mark.parametrize("case", V2_CASES, ids=_case_id)
def test_cuda_gemm_v2_matches_cpu_and_v1(case: dict, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prob, cuda_args = _cuda_problem(case)
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v2")
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", variant)
    got = torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu()
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v1")
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", "auto")
    v1 = torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu()
    expected = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
    assert _rel_err(got, expected.float()) < TOL[prob["dtype"]]
    assert _rel_err(got, v1.float()) < TOL[prob["dtype"]]
    assert _rel_err(got, prob["expected"]) < TOL[prob["dtype"]]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "tile16", "tile32", "tile64"])
@pytest.mark.parametrize("case", V2_CASES, ids=_case_id)
def test_cuda_gemm_v3_equals_v2(case: dict, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """v3 adds in v2's order: the same output bit for bit, on the second call on its workspace too
    (its counters return to zero); what it declines (act-order, small groups) v2 computes."""
    prob, cuda_args = _cuda_problem(case)
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", variant)
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v2")
    v2 = torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu()
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v3")
    for _ in range(2):
        assert torch.equal(torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu(), v2)
    monkeypatch.delenv("WNA16CTL_GEMM_KERNEL")  # auto: v3 first
    assert torch.equal(torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu(), v2)
