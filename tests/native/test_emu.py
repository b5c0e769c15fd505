"""The CUDA sources executed on the CPU emulation of intrinsics.cuh (kernels/emu/).

* the emulated intrinsics against independent references: mma fragments against a plain matmul
  (fp16, bf16), ldmatrix against the PTX ISA's fragment table, shuffles and ballot, prmt/lop3
  against Python bit math, packed fp16/bf16 arithmetic and conversions against numpy/torch;
* the emulation's checks: cp.async data arrives only at its wait, a cp.async source changed in
  flight aborts, a copy issued into a buffer still being read races, relaxed atomics order
  nothing, the block schedule follows its seed, shared memory starts poisoned, a divergent
  barrier and a misaligned ldmatrix abort;
* the real kernels (kernels/moe_gemm.cu, kernels/repack.cu, launchers included) on the test grid,
  against the torch ops, plain and under ThreadSanitizer / AddressSanitizer+UBSan;
* deliberately broken kernels (a removed barrier, an off-by-one read, a missing wait; also the
  real GEMM with one barrier removed and the real zero-point kernel with an off-by-one bound)
  fail under the sanitizer that should catch them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from tests.emu import harness as H
from tests.native.test_kernels import GEMM_CASES, TOL, _case_id, make_problem
from wna16ctl.native import ops as K
from wna16ctl.layout.marlin import (
    marlin_permute_scales,
    marlin_repack,
    marlin_zero_points,
    sort_g_idx,
)
from wna16ctl.layout.packing import pack_codes

POISON32 = 0x7FFF7FFF  # the emulator's shared-memory fill, read as one 32-bit word


@pytest.fixture(scope="session")
def drivers() -> dict[str, object]:
    """The three builds of the driver, compiled concurrently once per test run (cached by digest)."""
    if K.find_cxx() is None:
        pytest.skip("no g++ on PATH")

    def build(flavour: str) -> object:
        try:
            return H.build(flavour)
        except K.KernelBuildError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(H.FLAVOURS, pool.map(build, H.FLAVOURS)))


def _driver(drivers: dict[str, object], flavour: str) -> Path:
    got = drivers[flavour]
    if isinstance(got, Exception):
        if flavour != "plain" and re.search(r"cannot find .*(tsan|asan|ubsan)", str(got)):
            pytest.skip(f"the {flavour} runtime is not installed for this compiler: {str(got).splitlines()[0]}")
        raise got
    return Path(str(got))


@pytest.fixture(scope="session")
def plain(drivers) -> Path:
    return _driver(drivers, "plain")


@pytest.fixture(scope="session")
def tsan(drivers) -> Path:
    return _driver(drivers, "tsan")


@pytest.fixture(scope="session")
def asan(drivers) -> Path:
    return _driver(drivers, "asan")


def _ok(r: H.Result) -> H.Result:
    assert r.returncode == 0, f"driver exit {r.returncode}:\n{r.stderr[-3000:]}"
    assert r.rc == 0, r.message
    return r


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _u32(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.uint32)).view(np.int32))


def _np_u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


# ----------------------------------------------------------------------------------------------
# the sources are one: no CUDA-only constructs outside intrinsics.cuh


def test_kernel_sources_use_only_the_intrinsics_header() -> None:
    src = K.kernels_dir()
    banned = [(r"<<<", "a <<<>>> launch (use WNA16_LAUNCH)"), (r"\basm\b", "inline asm"),
              (r"__shared__", "static shared memory (use WNA16_SHARED_MEMORY)"),
              (r"__syncthreads|__shfl|__ballot|atomicAdd|#pragma unroll", "a raw CUDA intrinsic")]
    files = [p for p in (*src.glob("*.cu"), *src.glob("*.cuh")) if p.name != "intrinsics.cuh"]
    assert {p.name for p in files} >= {"moe_gemm.cu", "repack.cu", "moe_gemm.cuh", "layout.cuh"}
    for path in files:
        code = re.sub(r"//[^\n]*", "", path.read_text())  # comments may name them
        for pattern, what in banned:
            assert not re.search(pattern, code), f"{path.name}: {what}"


@pytest.mark.nvcc
def test_probes_are_valid_cuda() -> None:
    """The probe kernels build with nvcc too (so they can run on a GPU beside the emulation)."""
    nvcc = K.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-Xcompiler", "-Wall", "-Xcompiler", "-Wextra",
                               "--Werror", "all-warnings", "-I", str(K.kernels_dir()), "-c",
                               str(H.EMU_DIR / "probes.cu"), "-o", str(Path(tmp) / "probes.o")],
                              capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------------------------
# intrinsics against independent references


def _mma_fragments(A: np.ndarray, B: np.ndarray, C: np.ndarray):
    """Per-lane registers of mma.m16n8k16 from the PTX ISA fragment table (element form):
    A: a_i row = g + 8*((i//2)%2), col = 2t + (i%2) + 8*(i//4); B: b_i row = 2t + (i%2) + 8*(i//2),
    col = g; C/D: c_i row = g + 8*(i//2), col = 2t + (i%2); registers hold element pairs."""
    a = np.zeros((32, 8), np.uint16)
    b = np.zeros((32, 4), np.uint16)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):
            a[lane, i] = A[g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)]
        for i in range(4):
            b[lane, i] = B[2 * t + (i % 2) + 8 * (i // 2), g]
            c[lane, i] = C[g + 8 * (i // 2), 2 * t + (i % 2)]
    return a.view(np.uint32), b.view(np.uint32), c


def _mma_unfragment(d: np.ndarray) -> np.ndarray:
    D = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            D[g + 8 * (i // 2), 2 * t + (i % 2)] = d[lane, i]
    return D


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_fragments_match_a_plain_matmul(plain: Path, dtype: torch.dtype) -> None:
    g = _gen(3)
    for integral in (True, False):
        if integral:  # sums of small integers are exact: the result must be bit-identical
            A = torch.randint(-8, 9, (16, 16), generator=g).to(dtype)
            Bm = torch.randint(-8, 9, (16, 8), generator=g).to(dtype)
            C = torch.randint(-100, 100, (16, 8), generator=g).float()
        else:
            A, Bm = torch.randn(16, 16, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)
            C = torch.randn(16, 8, generator=g)
        a, b, c = _mma_fragments(A.view(torch.int16).numpy().view(np.uint16),
                                 Bm.view(torch.int16).numpy().view(np.uint16), C.numpy())
        r = _ok(H.run(plain, "mma", {"a": _u32(a), "b": _u32(b), "c": torch.from_numpy(c),
                                     "d": torch.zeros(32, 4)}, {"bf16": int(dtype == torch.bfloat16)}, ("d",)))
        D = torch.from_numpy(_mma_unfragment(r.tensor("d", torch.float32, (32, 4)).numpy()))
        want = (A.double() @ Bm.double() + C.double())
        if integral:
            assert torch.equal(D, want.float())
        else:
            assert torch.allclose(D.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant,nmat,trans", [(0, 4, False), (1, 2, False), (2, 4, True)])
def test_ldmatrix_matches_the_isa_table(plain: Path, variant: int, nmat: int, trans: bool) -> None:
    rng = np.random.default_rng(variant)
    n = 64 * 8  # 64 rows of 8 16-bit elements
    src = rng.integers(0, 1 << 16, n).astype(np.uint16)
    rows = rng.permutation(64)[:32]  # each lane's row: a random 16-byte row of shared memory
    r = _ok(H.run(plain, "ldmatrix",
                  {"src": torch.from_numpy(src.view(np.int16)), "offsets": torch.from_numpy((rows * 16).astype(np.int32)),
                   "out": torch.zeros(32, 4, dtype=torch.int32)},
                  {"variant": variant, "n": n}, ("out",)))
    got = r.tensor("out", torch.int32, (32, 4)).numpy().view(np.uint32)
    mat = src.reshape(64, 8)

    def elem(m: int, row: int, col: int) -> int:  # matrix m's row `row` is the row lane 8m + row named
        return int(mat[rows[8 * m + row], col])

    for lane in range(32):
        for m in range(nmat):
            if trans:  # the thread holds column lane/4, rows 2(lane%4) and 2(lane%4)+1
                lo, hi = elem(m, 2 * (lane % 4), lane // 4), elem(m, 2 * (lane % 4) + 1, lane // 4)
            else:  # row lane/4, columns 2(lane%4) and 2(lane%4)+1
                lo, hi = elem(m, lane // 4, 2 * (lane % 4)), elem(m, lane // 4, 2 * (lane % 4) + 1)
            assert got[lane, m] == lo | (hi << 16), (lane, m)


def test_ldmatrix_rejects_a_misaligned_row(plain: Path) -> None:
    offsets = torch.arange(32, dtype=torch.int32) * 16
    offsets[5] += 4
    r = H.run(plain, "ldmatrix", {"src": torch.zeros(512, dtype=torch.int16), "offsets": offsets,
                                  "out": torch.zeros(128, dtype=torch.int32)}, {"variant": 0, "n": 512}, ("out",))
    assert r.returncode != 0 and "16-byte aligned" in r.stderr


def test_shuffles_and_ballot(plain: Path) -> None:
    rng = np.random.default_rng(5)
    v = rng.integers(0, 1 << 32, 32, dtype=np.uint64).astype(np.uint32)
    arg = rng.integers(0, 32, 32).astype(np.int32)
    arg[0] = 13  # the xor mask every lane uses
    r = _ok(H.run(plain, "warp", {"v": _u32(v), "arg": torch.from_numpy(arg), "out": torch.zeros(96, dtype=torch.int32)},
                  outs=("out",)))
    got = r.tensor("out", torch.int32, (32, 3)).numpy().view(np.uint32)
    ballot = sum(int(v[l] & 1) << l for l in range(32))
    for lane in range(32):
        assert got[lane, 0] == v[arg[lane]]
        assert got[lane, 1] == v[lane ^ 13]
        assert got[lane, 2] == ballot


def _prmt(a: int, b: int, sel: int) -> int:
    data = a | (b << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 15
        byte = (data >> (8 * (n & 7))) & 255
        if n & 8:  # sign replication of the selected byte
            byte = 255 if byte & 128 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def test_prmt_and_lop3_are_bit_exact(plain: Path) -> None:
    rng = np.random.default_rng(11)
    n = 1024
    a, b, c, sel = (rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) for _ in range(4))
    sel[:256] = (sel[:256] & ~np.uint32(255)) | np.arange(256, dtype=np.uint32)  # every LUT
    r = _ok(H.run(plain, "bits", {"a": _u32(a), "b": _u32(b), "c": _u32(c), "sel": _u32(sel),
                                  "out": torch.zeros(2 * n, dtype=torch.int32)}, {"n": n}, ("out",)))
    got = r.tensor("out", torch.int32, (n, 2)).numpy().view(np.uint32)
    for i in range(n):
        assert got[i, 0] == _prmt(int(a[i]), int(b[i]), int(sel[i])), i
        assert got[i, 1] == _lop3(int(a[i]), int(b[i]), int(c[i]), int(sel[i]) & 255), i


def _f16_operands(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp16 a, b, c with a*b + c exact in float64 (so numpy's float64 -> float16 rounding is the
    reference): |a|, |b| in [2^-12, 2^7), c anywhere but its extremes, products down to the
    subnormal range, plus ties, overflow and signed zeros."""
    def rand(lo: int, hi: int, size: int) -> np.ndarray:
        m = rng.integers(1024, 2048, size) / 1024.0
        return (m * np.exp2(rng.integers(lo, hi, size)) * rng.choice([-1.0, 1.0], size)).astype(np.float16)
    a, b, c = rand(-12, 7, n), rand(-12, 7, n), rand(-24, 15, n)
    c[: n // 8] = 0.0  # pure products: subnormal and overflowing results
    special = np.array([[1.0, 1.0, 2.0 ** -11], [1.0, 1.0 + 2.0 ** -10, 2.0 ** -11], [256.0, 256.0, 0.0],
                        [2.0 ** -12, 2.0 ** -13, 0.0], [2.0 ** -12, 2.0 ** -12, -2.0 ** -24], [-1.0, 0.0, 0.0],
                        [65504.0, 1.0, 16.0], [65504.0, 1.0, 15.99]], np.float64).astype(np.float16)
    a[-len(special):], b[-len(special):], c[-len(special):] = special.T
    return a, b, c


def _exact_sum_mask(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Where p + c is exact in float64 (TwoSum error zero)."""
    s = p + c
    bb = s - p
    return ((p - (s - bb)) + (c - bb)) == 0


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits, nearest even, subnormals included: the 8-bit significand rounded in
    float64 (exact), after which float32 -> bf16 (torch) is exact."""
    m, e = np.frexp(x)
    q = np.maximum(e - 8, -133)  # the spacing of bf16 values near x (2^-133: the subnormal step)
    r = np.ldexp(np.rint(np.ldexp(x, -q)), q)
    with np.errstate(over="ignore"):
        f = r.astype(np.float32)
    return torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)  # numpy rounds float64 -> float16 directly


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_16bit_arithmetic_rounds_to_nearest_even(plain: Path, dtype: torch.dtype) -> None:
    """fma/sub/mul against float64 arithmetic rounded once (inputs where the float64 result is
    exact): subnormal results, ties, overflow and signed zeros included."""
    rng = np.random.default_rng(17)
    n = 4096
    if dtype == torch.float16:
        a, b, c = _f16_operands(rng, 2 * n)
        vals = [x.astype(np.float64) for x in (a, b, c)]
        round16 = _round_f16
    else:
        def rand(lo: int, hi: int, size: int) -> np.ndarray:
            m = rng.integers(128, 256, size) / 128.0
            return m * np.exp2(rng.integers(lo, hi, size)) * rng.choice([-1.0, 1.0], size)
        vals = [rand(-66, 64, 2 * n), rand(-66, 64, 2 * n), rand(-20, 20, 2 * n)]
        vals[2][: n // 4] = 0
        vals[0][:64], vals[1][:64] = 2.0 ** -66, 2.0 ** -66  # subnormal products (below 2^-126)
        vals[1][64:72] = 3.0 * 2.0 ** -70
        vals[0][72:80], vals[1][72:80] = 1.5 * 2.0 ** 64, 1.5 * 2.0 ** 63  # overflow to inf
        round16 = _round_bf16
    # keep a - b and a * b + c exact in float64 (else b := a, c := 0)
    vals[1] = np.where(_exact_sum_mask(vals[0], -vals[1]), vals[1], vals[0])
    vals[2] = np.where(_exact_sum_mask(vals[0] * vals[1], vals[2]), vals[2], 0.0)
    assert np.count_nonzero(vals[2]) > n // 2 and np.count_nonzero(vals[0] != vals[1]) > n // 2
    bits = [round16(v) for v in vals]  # the operands are representable: this is exact
    packed = [x.view(np.uint32) for x in bits]
    r = _ok(H.run(plain, "half2", {"a": _u32(packed[0]), "b": _u32(packed[1]), "c": _u32(packed[2]),
                                   "out": torch.zeros(3 * n, dtype=torch.int32)},
                  {"bf16": int(dtype == torch.bfloat16), "n": n}, ("out",)))
    got = r.tensor("out", torch.int32, (n, 3)).numpy().view(np.uint32)
    av, bv, cv = vals
    for col, want in enumerate((round16(av * bv + cv), round16(av - bv), round16(av * bv))):
        g16 = got[:, col].copy().view(np.uint16)
        bad = np.nonzero(g16 != want)[0]
        assert bad.size == 0, (col, bad[:5], g16[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conversions_match_torch(plain: Path, dtype: torch.dtype) -> None:
    g = _gen(7)
    x = torch.cat([
        torch.randn(20000, generator=g) * 10.0 ** torch.randint(-9, 6, (20000,), generator=g),
        torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, 2.0 ** -24, 2.0 ** -25,
                      3 * 2.0 ** -26, 2.0 ** -14 - 2.0 ** -26, 1e-39, -3e-40, 3.4e38, float("inf"), float("-inf"),
                      float("nan"), 1.0]),
    ]).float()
    n = x.numel() // 2
    r = _ok(H.run(plain, "convert", {"x": x, "packed": torch.zeros(n, dtype=torch.int32), "wide": torch.zeros(2 * n)},
                  {"bf16": int(dtype == torch.bfloat16), "n": n}, ("packed", "wide")))
    got = r.tensor("packed", torch.int16).view(dtype)
    want = x.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    wide = r.tensor("wide", torch.float32)
    assert torch.equal(wide[~nan], want[~nan].float())


def test_cp_async_data_arrives_at_the_wait(plain: Path) -> None:
    n = 64
    src = torch.arange(n * 4, dtype=torch.int32) + 1000
    chunks = src.reshape(n, 4)
    neighbour = torch.roll(chunks, -1, 0)
    for zfill in (0, 1):
        r = _ok(H.run(plain, "cp_async", {"src": src, "out": torch.zeros(n * 4, dtype=torch.int32)},
                      {"mode": 0, "zfill": zfill, "n": n}, ("out",)))
        got = r.tensor("out", torch.int32, (n, 4))
        want = neighbour.clone()
        if zfill:  # odd chunks were copied with pred false: 16 zero bytes
            want[(torch.arange(n) + 1) % n % 2 == 1] = 0
        assert torch.equal(got, want)
    # the wait after the reads: a thread whose neighbour has not passed its wait yet reads the
    # poison (the neighbours form a cycle, so at least one thread does)
    r = _ok(H.run(plain, "cp_async", {"src": src, "out": torch.zeros(n * 4, dtype=torch.int32)},
                  {"mode": 1, "zfill": 0, "n": n}, ("out",)))
    got = r.tensor("out", torch.int32, (n, 4))
    poisoned = (_np_u32(got) == POISON32).all(axis=1)
    assert poisoned.any()
    assert torch.equal(got[~torch.from_numpy(poisoned)], neighbour[~torch.from_numpy(poisoned)])


def test_cp_async_source_changed_in_flight_aborts(plain: Path) -> None:
    """cp.async reads its source at issue and again at its wait: a write in between is a race
    with the copy in flight, and the emulation stops on it."""
    bufs = {"src": torch.arange(256, dtype=torch.int32), "out": torch.zeros(256, dtype=torch.int32)}
    r = H.run(plain, "cp_async", bufs, {"mode": 2, "zfill": 0, "n": 64}, ("out",))
    assert r.returncode != 0 and "source changed between the issue and the wait" in r.stderr, r.stderr[-2000:]


def test_cp_async_into_a_buffer_after_a_barrier(plain: Path) -> None:
    n = 64
    src = torch.arange(n * 4, dtype=torch.int32) + 7
    r = _ok(H.run(plain, "cp_async", {"src": src, "out": torch.zeros(n * 4, dtype=torch.int32)},
                  {"mode": 4, "zfill": 0, "n": n}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32, (n, 4)), torch.roll(src.reshape(n, 4), -1, 0))


def test_block_schedule_is_seeded(plain: Path) -> None:
    """Seed 0 runs the blocks in index order; a seed deals them in its own order, the same each
    time it is given."""
    blocks = 24

    def order(seed: int, teams: int = 1) -> list[int]:
        r = _ok(H.run(plain, "order", {"counter": torch.zeros(1, dtype=torch.int32),
                                       "out": torch.full((blocks,), -1, dtype=torch.int32)},
                      {"blocks": blocks}, ("out",), dev={"blocks": teams, "seed": seed}))
        return r.tensor("out", torch.int32).tolist()

    assert order(0) == list(range(blocks))
    first = order(7)
    assert sorted(first) == list(range(blocks)) and first != list(range(blocks))
    assert order(7) == first and order(8) != first
    assert sorted(order(9, teams=3)) == list(range(blocks))  # side by side: every block once


def test_shared_memory_starts_poisoned(plain: Path) -> None:
    r = _ok(H.run(plain, "smem", {"src": torch.arange(128, dtype=torch.int32), "out": torch.zeros(128, dtype=torch.int32)},
                  {"mode": 2, "n": 128}, ("out",)))
    assert bool((_np_u32(r.tensor("out", torch.int32)) == POISON32).all())
    r = _ok(H.run(plain, "smem", {"src": torch.arange(128, dtype=torch.int32), "out": torch.zeros(128, dtype=torch.int32)},
                  {"mode": 0, "n": 128}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32), torch.roll(torch.arange(128, dtype=torch.int32), -1))


def test_divergent_barrier_aborts(plain: Path) -> None:
    r = H.run(plain, "smem", {"src": torch.arange(64, dtype=torch.int32), "out": torch.zeros(64, dtype=torch.int32)},
              {"mode": 3, "n": 64}, ("out",), timeout=60)
    assert r.returncode != 0 and "not reached by every thread" in r.stderr


def test_warp_collectives_must_be_reached_by_the_whole_warp(plain: Path) -> None:
    out = {"out": torch.zeros(32, dtype=torch.int32)}
    r = H.run(plain, "bad_warp", out, {"mode": 0}, ("out",), timeout=60)
    assert r.returncode != 0 and "lanes of one warp met at different collectives" in r.stderr
    r = H.run(plain, "bad_warp", out, {"mode": 1}, ("out",), timeout=60)
    assert r.returncode != 0 and "not reached by every thread" in r.stderr


def test_thread_and_block_indices_of_a_3d_launch(plain: Path) -> None:
    r = _ok(H.run(plain, "dims", {"out": torch.full((12 * 24 * 12,), -1, dtype=torch.int32)}, outs=("out",)))
    got = r.tensor("out", torch.int32, (12, 24, 12))
    for b in range(12):
        for t in range(24):
            want = [t % 4, (t // 4) % 2, t // 8, b % 2, (b // 2) % 3, b // 6, 4, 2, 3, 2, 3, 2]
            assert got[b, t].tolist() == want, (b, t)


def test_dynamic_shared_memory_above_48k_needs_the_opt_in(plain: Path) -> None:
    bufs = {"src": torch.arange(64, dtype=torch.int32), "out": torch.zeros(64, dtype=torch.int32)}
    big = 100 * 1024
    r = _ok(H.run(plain, "smem_limit", bufs, {"n": 64, "bytes": 48 * 1024, "optin": 0}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32), torch.roll(bufs["src"], -1))
    r = H.run(plain, "smem_limit", bufs, {"n": 64, "bytes": big, "optin": 0}, ("out",))
    assert r.returncode == 0 and r.rc == 1  # cudaErrorInvalidValue, nothing ran
    assert torch.equal(r.tensor("out", torch.int32), bufs["out"])
    r = _ok(H.run(plain, "smem_limit", bufs, {"n": 64, "bytes": big, "optin": big}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32), torch.roll(bufs["src"], -1))
    r = H.run(plain, "smem_limit", bufs, {"n": 64, "bytes": big, "optin": 300 * 1024}, ("out",))
    assert r.rc == 1001  # past the device's opt-in limit (227 KiB): the attribute call fails


def test_device_attributes_are_settable(plain: Path) -> None:
    r = _ok(H.run(plain, "device_info", {"info": torch.zeros(8, dtype=torch.int32)}, outs=("info",),
                  dev={"sms": 108, "cc": 80}))
    info = r.tensor("info", torch.int32).tolist()
    assert info[:3] == [8, 0, 108]
    r = _ok(H.run(plain, "device_info", {"info": torch.zeros(8, dtype=torch.int32)}, outs=("info",)))
    assert r.tensor("info", torch.int32).tolist()[:3] == [9, 0, 132]  # the default: sm_90, 132 SMs


# ----------------------------------------------------------------------------------------------
# the sanitizers catch broken kernels


def _race_reported(r: H.Result) -> bool:
    return r.returncode == 66 and "ThreadSanitizer: data race" in r.stderr


def test_tsan_reports_a_removed_barrier(tsan: Path) -> None:
    bufs = {"src": torch.arange(64, dtype=torch.int32), "out": torch.zeros(64, dtype=torch.int32)}
    assert _ok(H.run(tsan, "smem", bufs, {"mode": 0, "n": 64}, ("out",)))
    assert _race_reported(H.run(tsan, "smem", bufs, {"mode": 1, "n": 64}, ("out",)))


def test_tsan_reports_a_late_cp_async_wait(tsan: Path) -> None:
    bufs = {"src": torch.arange(256, dtype=torch.int32), "out": torch.zeros(256, dtype=torch.int32)}
    assert _ok(H.run(tsan, "cp_async", bufs, {"mode": 0, "zfill": 0, "n": 64}, ("out",)))
    assert _race_reported(H.run(tsan, "cp_async", bufs, {"mode": 1, "zfill": 0, "n": 64}, ("out",)))


def test_tsan_reports_a_cp_async_issued_into_a_buffer_still_read(tsan: Path) -> None:
    """A copy issued before the barrier that ends the reads of its destination: the copy may land
    at once, so the emulation writes the destination at issue and the reads race with it."""
    bufs = {"src": torch.arange(256, dtype=torch.int32), "out": torch.zeros(256, dtype=torch.int32)}
    assert _ok(H.run(tsan, "cp_async", bufs, {"mode": 4, "zfill": 0, "n": 64}, ("out",)))
    assert _race_reported(H.run(tsan, "cp_async", bufs, {"mode": 3, "zfill": 0, "n": 64}, ("out",)))


def test_tsan_reports_data_published_with_a_relaxed_atomic(tsan: Path) -> None:
    """atomicAdd is relaxed on the device and in the emulation: a flag raised and read with it
    orders nothing, unlike st.release / ld.acquire or a fence on both sides."""
    n = 16

    def run(mode: int) -> H.Result:
        bufs = {"data": torch.zeros(n, dtype=torch.int32), "flag": torch.zeros(1, dtype=torch.int32),
                "out": torch.zeros(n, dtype=torch.int32)}
        return H.run(tsan, "flag", bufs, {"mode": mode, "n": n}, ("out",), dev={"blocks": 2, "seed": 3})

    for mode in (0, 2):
        r = _ok(run(mode))
        assert r.tensor("out", torch.int32).tolist() == [1000 + i for i in range(n)]
    assert _race_reported(run(1))


def test_asan_reports_an_off_by_one_read(asan: Path) -> None:
    bufs = {"src": torch.arange(64, dtype=torch.int32), "out": torch.zeros(64, dtype=torch.int32)}
    r = _ok(H.run(asan, "offbyone", bufs, {"mode": 0, "n": 64}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32), bufs["src"])
    r = H.run(asan, "offbyone", bufs, {"mode": 1, "n": 64}, ("out",))
    assert r.returncode == 66 and "heap-buffer-overflow" in r.stderr


# ----------------------------------------------------------------------------------------------
# the real kernels: repack, scale and zero-point permutations


def _repack(exe: Path, packed: torch.Tensor, perm: Optional[torch.Tensor], num_bits: int) -> H.Result:
    experts, kw, size_n = packed.shape
    size_k = kw * 32 // num_bits
    out = torch.zeros(experts, size_k // 16, size_n * num_bits // 2, dtype=torch.int32)
    return H.run(exe, "repack", {"packed": packed, "perm": perm, "out": out},
                 {"num_experts": experts, "size_k": size_k, "size_n": size_n, "num_bits": num_bits}, ("out",))


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("size_n,size_k", [(448, 640), (832, 128), (64, 64)])
def test_emulated_repack_equals_torch(plain: Path, num_bits: int, size_n: int, size_k: int) -> None:
    q = torch.randint(0, 1 << num_bits, (2, size_k, size_n), generator=_gen(11), dtype=torch.int32)
    packed = pack_codes(q, num_bits, dim=-2)
    _, perm = sort_g_idx(torch.stack([torch.randperm(size_k, generator=_gen(e)) // 32 for e in range(2)]))
    for p in (None, perm.to(torch.int32)):
        r = _ok(_repack(plain, packed, p, num_bits))
        got = r.tensor("out", torch.int32).reshape(2, size_k // 16, -1)
        assert torch.equal(got, marlin_repack(packed, num_bits, p))


@pytest.mark.parametrize("num_bits", [4, 8])
def test_emulated_repack_tile_path_strides_and_unaligned_output(plain: Path, num_bits: int) -> None:
    """The kernel takes whole tiles per lane group with 16-byte stores, with and without
    act-order. On one SM's worth of blocks its grid-stride loop wraps across tile rows and
    experts (7 n-tiles, a stride of 256 tiles); an output 4 bytes off a 16-byte boundary takes the
    staged path instead. Both write the torch words, and nothing outside the output."""
    size_k, size_n, experts = 640, 448, 2
    q = torch.randint(0, 1 << num_bits, (experts, size_k, size_n), generator=_gen(5), dtype=torch.int32)
    packed = pack_codes(q, num_bits, dim=-2)
    _, perm = sort_g_idx(torch.stack([torch.randperm(size_k, generator=_gen(7 + e)) // 32 for e in range(experts)]))
    for p in (None, perm.to(torch.int32)):
        want = marlin_repack(packed, num_bits, p)
        words = want.numel()
        for shift in (0, 1):
            out = torch.full((words + 4,), -7, dtype=torch.int32)
            r = _ok(H.run(plain, "repack", {"packed": packed, "perm": p, "out": out},
                          {"num_experts": experts, "size_k": size_k, "size_n": size_n, "num_bits": num_bits,
                           "out_shift": shift}, ("out",), dev={"sms": 1}))
            got = r.tensor("out", torch.int32)
            assert torch.equal(got[shift:shift + words].reshape(want.shape), want)
            assert torch.equal(torch.cat([got[:shift], got[shift + words:]]), torch.full((4,), -7, dtype=torch.int32))
    # perm entries outside [0, size_k) read as code 0 on both paths (the C API does not validate them)
    bad = perm.to(torch.int32).clone()
    bad[0, 3], bad[1, 100], bad[1, 639] = -1, size_k, 1 << 30
    outs = []
    for shift in (0, 1):
        out = torch.zeros(words + 4, dtype=torch.int32)
        r = _ok(H.run(plain, "repack", {"packed": packed, "perm": bad, "out": out},
                      {"num_experts": experts, "size_k": size_k, "size_n": size_n, "num_bits": num_bits,
                       "out_shift": shift}, ("out",), dev={"sms": 1}))
        outs.append(r.tensor("out", torch.int32)[shift:shift + words])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0].reshape(want.shape), want)


def test_emulated_scales_and_zero_points_equal_torch(plain: Path) -> None:
    for dtype in (torch.float16, torch.float32):
        s = torch.randn(3, 4, 256, generator=_gen(1)).to(dtype)
        for grouped, gs in ((1, 128), (0, -1)):
            r = _ok(H.run(plain, "scales", {"in": s, "out": torch.zeros_like(s)},
                          {"rows": 12, "size_n": 256, "elem_bytes": s.element_size(), "grouped": grouped}, ("out",)))
            assert torch.equal(r.tensor("out", dtype).reshape(s.shape), marlin_permute_scales(s, 512, 256, gs))
    for num_bits in (4, 8):
        zp = pack_codes(torch.randint(0, 1 << num_bits, (2, 4, 256), generator=_gen(3), dtype=torch.int32), num_bits)
        r = _ok(H.run(plain, "zero_points", {"in": zp, "out": torch.zeros_like(zp)},
                      {"rows": 8, "size_n": 256, "num_bits": num_bits}, ("out",)))
        assert torch.equal(r.tensor("out", torch.int32).reshape(zp.shape), marlin_zero_points(zp, 4, 256, num_bits))


@pytest.mark.parametrize("flavour", ["tsan", "asan"])
def test_emulated_repack_under_sanitizers(drivers, flavour: str) -> None:
    exe = _driver(drivers, flavour)
    for num_bits in (4, 8):
        q = torch.randint(0, 1 << num_bits, (1, 64, 128), generator=_gen(2), dtype=torch.int32)
        packed = pack_codes(q, num_bits, dim=-2)
        _, perm = sort_g_idx(torch.randperm(64, generator=_gen(4)).reshape(1, 64) // 16)
        r = _ok(_repack(exe, packed, perm.to(torch.int32), num_bits))
        assert torch.equal(r.tensor("out", torch.int32).reshape(1, 4, -1), marlin_repack(packed, num_bits, perm))
    zp = pack_codes(torch.randint(0, 16, (2, 128), generator=_gen(3), dtype=torch.int32), 4)
    r = _ok(H.run(exe, "zero_points", {"in": zp, "out": torch.zeros_like(zp)},
                  {"rows": 2, "size_n": 128, "num_bits": 4}, ("out",)))
    assert torch.equal(r.tensor("out", torch.int32).reshape(zp.shape), marlin_zero_points(zp, 2, 128, 4))


# ----------------------------------------------------------------------------------------------
# the real GEMM on the test grid

MARKER = 0x3C01  # fp16 1.0009765625 / a bf16 subnormal: what unrouted rows must keep


def grid_problem(*, pad: int = 0, empty_ends: bool = False, **case) -> dict:
    """make_problem plus the routing shapes of a real caller: `pad` > 0 pads every expert's slice
    of sorted_ids to a multiple of `pad` with the sentinel num_slots (moe_align_block_size's
    convention); `empty_ends` adds an expert before the first and after the last that no token
    reaches."""
    prob = make_problem(**case)
    a, b_q, scales, ids, offs, top_k, num_bits, zp, g_idx, perm, tw, k_full = prob["args"]
    num_slots = a.shape[0] * top_k
    if empty_ends:
        def ends(t):
            return None if t is None else torch.cat([t[:1], t, t[-1:]])
        b_q, scales, zp, g_idx, perm = map(ends, (b_q, scales, zp, g_idx, perm))
        offs = torch.cat([offs[:1], offs, offs[-1:]])
    if pad:
        parts, new_offs = [], [0]
        for e in range(len(offs) - 1):
            part = ids[int(offs[e]): int(offs[e + 1])]
            fill = (-part.numel()) % pad
            parts.append(torch.cat([part, torch.full((fill,), num_slots, dtype=ids.dtype)]))
            new_offs.append(new_offs[-1] + parts[-1].numel())
        ids = torch.cat(parts)
        offs = torch.tensor(new_offs, dtype=torch.int32)
    prob["args"] = (a, b_q, scales, ids, offs, top_k, num_bits, zp, g_idx, perm, tw, k_full)
    return prob


def run_gemm_op(exe: Path, op: str, prob: dict, variant_code: int, dev: Optional[dict] = None,
                extra: Optional[dict] = None, ints: Optional[dict] = None) -> tuple[H.Result, torch.Tensor]:
    """Run the driver's GEMM op `op` ("gemm": v1, "gemm_v2", "gemm_v3") on `prob`; the output
    starts as MARKER everywhere, so rows the kernel must not touch show."""
    a, b_q, scales, ids, offs, top_k, num_bits, zp, g_idx, perm, tw, k_full = prob["args"]
    experts, size_k, size_n = b_q.shape[0], b_q.shape[1] * 16, scales.shape[2]
    num_slots = a.shape[0] * top_k
    c = torch.full((num_slots, size_n), MARKER, dtype=torch.int16).view(a.dtype)

    def i32(t):
        return None if t is None else t.to(torch.int32)
    r = H.run(exe, op,
              {"a": a, "b": b_q, "scales": scales, "zp": i32(zp), "g_idx": i32(g_idx), "perm": i32(perm),
               "sorted_ids": i32(ids), "offsets": i32(offs), "topk": None if tw is None else tw.float(),
               "c": c, **(extra or {})},
              {"num_slots": num_slots, "num_sorted": ids.numel(), "num_experts": experts, "size_n": size_n,
               "size_k": size_k, "num_groups": scales.shape[1], "top_k": top_k, "num_bits": num_bits,
               "dtype": K.DTYPE_CODES[a.dtype], "is_k_full": int(k_full), "variant": variant_code,
               **(ints or {})},
              ("c",), dev or {})
    out = r.tensor("c", a.dtype, (num_slots, size_n)) if "c" in r.outputs else c
    return r, out


def run_gemm(exe: Path, prob: dict, variant: str, dev: Optional[dict] = None) -> tuple[H.Result, torch.Tensor]:
    experts = prob["args"][1].shape[0]
    return run_gemm_op(exe, "gemm", prob, K.GEMM_VARIANTS[variant], dev,
                       {"ws": torch.zeros(experts + 1, dtype=torch.int32)})


def tile_rows(prob: dict, variant: str) -> int:
    """The tile height the launcher will pick (checks.h's rule), to show each variant is run."""
    ids, offs = prob["args"][3], prob["args"][4]
    mma = variant != "fma"
    return 64 if mma and ids.numel() >= 48 * (offs.numel() - 1) else 16


def check_gemm(prob: dict, r: H.Result, got: torch.Tensor) -> None:
    _ok(r)
    a, ids, offs, top_k = prob["args"][0], prob["args"][3], prob["args"][4], prob["args"][5]
    num_slots = a.shape[0] * top_k
    routed = torch.zeros(num_slots, dtype=torch.bool)
    listed = ids[int(offs[0]): int(offs[-1])].long()
    live = listed[(listed >= 0) & (listed < num_slots)]
    routed[live] = True
    # rows no slot reaches are not written
    assert bool((got[~routed].view(torch.int16) == MARKER).all())
    want = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
    tol = TOL[prob["dtype"]]
    exp = prob["expected"][routed]
    assert float((got[routed].float() - want[routed].float()).abs().max() / exp.abs().max()) < tol
    assert float((got[routed].float() - exp).abs().max() / exp.abs().max()) < tol


# K % 64 in {0, 16, 32, 48}; N in {64, 128, 256, 320}; fp16/bf16; 4/8 bit; zero points; act-order
# with a full K and with is_k_full false; sentinel padding; empty first/last experts; every kernel
# instance (mma BM 16, mma BM 64 -- large groups or padding -- and the FMA cross-check, each for
# both dtypes and both bit widths).
GRID = [
    ("mma", dict(size_k=128, size_n=64, group_size=64)),
    ("mma", dict(size_k=80, size_n=128, group_size=16, dtype=torch.float16, pad=16)),
    ("mma", dict(size_k=96, size_n=256, group_size=32, num_bits=8, zp=True, empty_ends=True)),
    ("mma", dict(size_k=112, size_n=320, group_size=16, dtype=torch.float16, num_bits=8, pad=8, empty_ends=True)),
    ("mma", dict(size_k=80, size_n=64, group_size=16, act_order=True, k_full=False, zp=True, pad=16)),
    ("mma", dict(size_k=96, size_n=128, group_size=32, act_order=True, dtype=torch.float16, num_bits=8)),
    ("mma", dict(size_k=112, size_n=256, group_size=-1, dtype=torch.float16, zp=True, router=False)),
    ("mma", dict(size_k=128, size_n=128, group_size=32, act_order=True, k_full=False, dtype=torch.float16,
                 num_bits=8, zp=True, empty_ends=True, pad=16)),
    # 64-row tiles: enough slots per expert, or the padding of a real caller
    ("mma", dict(size_k=80, size_n=128, group_size=16, skew=True, m=60, experts=2, top_k=2)),
    ("mma", dict(size_k=96, size_n=64, group_size=32, dtype=torch.float16, zp=True, pad=64, experts=2)),
    ("mma", dict(size_k=112, size_n=320, group_size=16, num_bits=8, act_order=True, k_full=False, pad=64, m=3,
                 experts=2)),
    ("mma", dict(size_k=128, size_n=256, group_size=64, dtype=torch.float16, act_order=True, k_full=False,
                 num_bits=8, skew=True, m=100, experts=2, top_k=2, empty_ends=True)),
    # the FMA variant (16-row tiles only)
    ("fma", dict(size_k=80, size_n=64, group_size=16, dtype=torch.float16, zp=True, pad=16, empty_ends=True)),
    ("fma", dict(size_k=112, size_n=320, group_size=16, num_bits=8, act_order=True, k_full=False)),
    ("fma", dict(size_k=96, size_n=256, group_size=32, act_order=True, dtype=torch.float16, num_bits=8,
                 zp=True, pad=64)),
    ("fma", dict(size_k=128, size_n=128, group_size=64, pad=16, zp=True)),
]


def _grid_id(item) -> str:
    variant, case = item
    parts = [variant] + [f"{k}={getattr(v, 'itemsize', v) if isinstance(v, torch.dtype) else v}"
                         for k, v in case.items()]
    return ",".join(parts)


def test_grid_covers_every_axis() -> None:
    ks = {c.get("size_k", 256) % 64 for _, c in GRID}
    ns = {c.get("size_n", 192) for _, c in GRID}
    # every kernel instance the launcher can pick: dtype x bits x (mma 16, mma 64, fma 16)
    instances = {(v, c.get("dtype", torch.bfloat16), c.get("num_bits", 4), tile_rows(grid_problem(**c), v))
                 for v, c in GRID}
    assert ks == {0, 16, 32, 48} and {64, 128, 256} <= ns and max(ns) > 256
    assert instances == {(v, d, b, bm) for d in (torch.float16, torch.bfloat16) for b in (4, 8)
                         for v, bm in (("mma", 16), ("mma", 64), ("fma", 16))}
    for key in ("zp", "pad", "empty_ends", "act_order"):
        assert any(c.get(key) for _, c in GRID), key
    assert any(c.get("act_order") and c.get("k_full") is False for _, c in GRID)
    assert {c.get("dtype", torch.bfloat16) for _, c in GRID} == {torch.float16, torch.bfloat16}
    assert {c.get("num_bits", 4) for _, c in GRID} == {4, 8}


@pytest.mark.parametrize("item", GRID, ids=_grid_id)
def test_emulated_gemm_grid(plain: Path, item) -> None:
    variant, case = item
    prob = grid_problem(**case)
    check_gemm(prob, *run_gemm(plain, prob, variant))


@pytest.mark.parametrize("variant", ["mma", "fma"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=_case_id)
def test_emulated_gemm_on_the_torch_op_cases(plain: Path, case: dict, variant: str) -> None:
    """The cases the torch op is checked on (test_kernels.py), through the real kernel."""
    prob = grid_problem(**case)
    check_gemm(prob, *run_gemm(plain, prob, variant))


# a few small cases per sanitizer: each tile variant once, the edge shapes
SAN_GRID = [
    ("mma", dict(size_k=80, size_n=64, group_size=16, m=3, experts=3, act_order=True, k_full=False, zp=True,
                 pad=16, empty_ends=True)),
    ("mma", dict(size_k=112, size_n=320, group_size=16, m=2, experts=2, dtype=torch.float16, num_bits=8, pad=64)),
    ("fma", dict(size_k=96, size_n=64, group_size=32, m=3, experts=3, num_bits=8, zp=True, empty_ends=True)),
]


@pytest.mark.parametrize("flavour", ["tsan", "asan"])
@pytest.mark.parametrize("item", SAN_GRID, ids=_grid_id)
def test_emulated_gemm_under_sanitizers(drivers, flavour: str, item) -> None:
    exe = _driver(drivers, flavour)
    variant, case = item
    prob = grid_problem(**case)
    # two blocks at a time, so that blocks of one launch can race with each other too
    check_gemm(prob, *run_gemm(exe, prob, variant, dev={"blocks": 2}))


def test_emulated_gemm_launcher_follows_the_device(plain: Path) -> None:
    prob = grid_problem(size_k=64, size_n=64, m=2, experts=2)
    r, _ = run_gemm(plain, prob, "mma", dev={"cc": 75})
    assert r.returncode == 0 and r.rc == 3 and "needs sm80+" in r.message
    r, got = run_gemm(plain, grid_problem(size_k=64, size_n=64, m=2, experts=2, dtype=torch.float16), "auto",
                      dev={"cc": 75, "sms": 1})  # auto on sm75: the FMA path, one SM's worth of blocks
    check_gemm(grid_problem(size_k=64, size_n=64, m=2, experts=2, dtype=torch.float16), r, got)


# ----------------------------------------------------------------------------------------------
# bad routing inputs are rejected before a launch


def test_gemm_rejects_out_of_range_g_idx_and_duplicate_slots() -> None:
    prob = make_problem(act_order=True, k_full=False, size_k=64, size_n=64)
    args = list(prob["args"])
    bad = args[8].clone()
    bad[0, 3] = args[2].shape[1]  # one past the last scale group
    with pytest.raises(ValueError, match=r"g_idx values lie in .* outside \[0, num_groups"):
        torch.ops.wna16ctl.moe_wna16_gemm(*args[:8], bad, *args[9:])
    ids = args[3].clone()
    ids[1] = ids[0]
    with pytest.raises(ValueError, match=f"sorted_token_ids lists slot {int(ids[0])} 2 times"):
        torch.ops.wna16ctl.moe_wna16_gemm(*args[:3], ids, *args[4:])
    # sentinels (>= num_slots) may repeat
    padded = grid_problem(act_order=True, k_full=False, size_k=64, size_n=64, pad=16)
    torch.ops.wna16ctl.moe_wna16_gemm(*padded["args"])


# ----------------------------------------------------------------------------------------------
# the real kernels, broken on purpose: the sanitizers must notice


def test_tsan_reports_the_gemm_without_its_staging_barrier(tmp_path: Path, drivers) -> None:
    _driver(drivers, "tsan")
    src = H.mutated_kernels(
        tmp_path, "moe_gemm.cu",
        "      Tile::decode_b(p, w, sh, tid, k0, kb);\n      wna16_syncthreads();\n",
        "      Tile::decode_b(p, w, sh, tid, k0, kb);\n")
    exe = H.build("tsan", src)
    prob = grid_problem(size_k=64, size_n=64, m=2, experts=2)
    r, _ = run_gemm(exe, prob, "mma")
    assert _race_reported(r), r.stderr[-2000:]


def test_emulation_notices_a_wrong_fragment_in_the_real_gemm(tmp_path: Path, plain: Path) -> None:
    """B fragment register 1 loaded from the k rows of register 0: the emulated mma (the ISA
    table) multiplies the wrong elements, so the real kernel's result is wrong."""
    src = H.mutated_kernels(tmp_path, "moe_gemm.cuh", "bf[1] = load_pair(&sh.Bs[nn][ks + 2 * tig + 8]);",
                            "bf[1] = load_pair(&sh.Bs[nn][ks + 2 * tig]);")
    exe = H.build("plain", src)
    prob = grid_problem(size_k=64, size_n=64, m=2, experts=2)
    r, got = run_gemm(exe, prob, "mma")
    _ok(r)
    exp = prob["expected"]
    assert float((got.float() - exp).abs().max() / exp.abs().max()) > 0.1


def test_asan_reports_the_zero_point_kernel_reading_one_past_the_end(tmp_path: Path, drivers) -> None:
    _driver(drivers, "asan")
    loop = "total;\n       i += (int64_t)gridDim.x * blockDim.x) {\n    const uint32_t* row"
    src = H.mutated_kernels(tmp_path, "repack.cu", f"i < {loop}", f"i <= {loop}")
    exe = H.build("asan", src)
    zp = pack_codes(torch.randint(0, 16, (2, 128), generator=_gen(3), dtype=torch.int32), 4)
    r = H.run(exe, "zero_points", {"in": zp, "out": torch.zeros_like(zp)}, {"rows": 2, "size_n": 128, "num_bits": 4},
              ("out",))
    assert r.returncode == 66 and "heap-buffer-overflow" in r.stderr, r.stderr[-2000:]
