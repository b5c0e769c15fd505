"""The native kernels (`kernels/`) and the `wna16ctl::*` torch ops.

* nvcc: every CUDA source compiles warning-free (as errors) for sm_80 and sm_90, the fast GEMMs
  (moe_gemm_v2.cu; moe_gemm_v3.cu under the `kernels` marker) also without spills;
* host library: layout.cuh's index math equals the Python layout code and the spec tables, and
  the native repack equals the torch repack bit for bit (the CUDA kernels themselves run on the
  CPU emulation in test_emu.py);
* torch ops on CPU: the GEMM against an fp32 reference built from logical codes;
* gpu: CUDA ops against the CPU ops (skipped without a GPU).
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.layout import reference as ref
from wna16ctl.native import ops as K
from wna16ctl.layout.marlin import (
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_zero_points,
    marlin_zero_points_inverse,
    sort_g_idx,
)
from wna16ctl.layout.packing import pack_codes, unpack_codes

# §9.3 (N, K) shapes: K = 128·kf, N = n_chunk·nf
SHAPES_93 = [(256, 1024), (448, 640), (832, 1408), (1024, 1024), (1792, 640), (3328, 1408)]
BITS = (4, 8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _codes(shape: tuple[int, ...], num_bits: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << num_bits, shape, generator=_gen(seed), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# (a) compilation

_WERROR_HOST = ("-Wall", "-Wextra", "-Werror")


def _nvcc_werror_flags(nvcc: str) -> list[str]:
    flags = ["-Xcompiler", "-Wall", "-Xcompiler", "-Wextra", "-Xcompiler", "-Werror"]
    help_text = subprocess.run([nvcc, "--help"], capture_output=True, text=True).stdout
    if "all-warnings" in help_text:
        flags += ["--Werror", "all-warnings"]
    return flags


@pytest.fixture(scope="session")
def cuda_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Both architectures built once per session, concurrently (the slow part of this file)."""
    nvcc = K.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): CUDA sources not compiled")
    out = tmp_path_factory.mktemp("cuda-werror")
    flags = _nvcc_werror_flags(nvcc)

    def build(arch: str) -> object:
        try:
            return K.build_cuda(arch, extra_flags=flags, out_dir=out)
        except K.KernelBuildError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(("80", "90"), pool.map(build, ("80", "90"))))


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_sources_compile_without_warnings(cuda_builds: dict[str, object], arch: str) -> None:
    result = cuda_builds[arch]
    assert not isinstance(result, Exception), str(result)
    assert Path(str(result)).stat().st_size > 0


def _fast_cubin(nvcc: str, kernel: str, arch: str, out: Path) -> subprocess.CompletedProcess:
    src = K.kernels_dir()
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-Xptxas", "-v,-warn-spills,-warn-lmem-usage",
           *_nvcc_werror_flags(nvcc), "-I", str(src), str(src / f"moe_gemm_{kernel}.cu"),
           "-o", str(out / f"{kernel}-{arch}.cubin")]
    return subprocess.run(cmd, capture_output=True, text=True)


# instances each source holds: v2 20 (fast, general, g_idx), v3 24 (fast, with and without zero
# points). v3's two compiles (30-40 s on two cores) run with its emulated grid (`kernels` marker,
# make test-kernels) so that CI's default run does not grow by them.
FAST_GEMMS = [pytest.param("v2", 20, id="v2"), pytest.param("v3", 24, id="v3", marks=pytest.mark.kernels)]


@pytest.mark.nvcc
@pytest.mark.parametrize(("kernel", "instances"), FAST_GEMMS)
def test_fast_gemm_compiles_without_warnings_or_spills(tmp_path: Path, kernel: str, instances: int) -> None:
    """Every instance of a fast GEMM, sm_80 and sm_90: no warning, no spill, no stack frame."""
    nvcc = K.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): CUDA sources not compiled")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(("80", "90"), pool.map(lambda a: _fast_cubin(nvcc, kernel, a, tmp_path), ("80", "90"))))
    for arch, proc in results.items():
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"sm_{arch}:\n{log[-4000:]}"
        assert "warning" not in log.lower(), f"sm_{arch}:\n{log[-4000:]}"
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        kernels = re.findall(r"Compiling entry function '(\w+)'", log)
        # every instance was compiled
        assert sum(f"moe_gemm_{kernel}_kernel" in k for k in kernels) >= instances, kernels
        assert len(frames) == len(kernels)
        assert all(f == ("0", "0", "0") for f in frames), f"sm_{arch}: {list(zip(kernels, frames))}"


def test_host_sources_compile_without_warnings() -> None:
    from wna16ctl.native.build import HEADER_SCAN_SOURCES

    cxx = K.find_cxx()
    if cxx is None:
        pytest.skip("no g++ on PATH")
    src = K.kernels_dir()
    cmd = [cxx, "-std=c++17", "-fsyntax-only", *_WERROR_HOST, "-Wpedantic", *(str(src / f) for f in (*K.HOST_SOURCES, *HEADER_SCAN_SOURCES))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_fallback_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    monkeypatch.setattr(K, "_libs", {})
    assert not K.native_host_available() and not K.cuda_available()
    packed = pack_codes(_codes((2, 64, 128), 4, 0), 4, dim=-2)
    assert torch.equal(K.marlin_repack_fast(packed, 4), marlin_repack(packed, 4))


# ----------------------------------------------------------------------------------------------
# (b) host library


def _src_table(host: K.NativeLib, num_bits: int, size_k: int, size_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    src_k = torch.empty(size_k * size_n, dtype=torch.int64)
    src_n = torch.empty_like(src_k)
    host.call("wna16_marlin_src_table", num_bits, size_k, size_n, src_k.data_ptr(), src_n.data_ptr())
    return src_k, src_n


@pytest.mark.parametrize("num_bits", BITS)
@pytest.mark.parametrize("size_n,size_k", SHAPES_93)
def test_index_math_matches_python_layout(host: K.NativeLib, num_bits: int, size_n: int, size_k: int) -> None:
    q = _codes((size_k, size_n), num_bits, size_k + size_n + num_bits)
    marlin = marlin_repack(pack_codes(q, num_bits, dim=0), num_bits)
    src_k, src_n = _src_table(host, num_bits, size_k, size_n)
    # every Marlin (k-tile, word, slot) holds the code the C index math names
    got = unpack_codes(marlin, num_bits, dim=-1).reshape(-1)
    assert torch.equal(got, q[src_k, src_n])
    # ... and the inverse map sends each (k, n) back to where it was read from
    kt = torch.empty(size_k * size_n, dtype=torch.int64)
    col, slot = torch.empty_like(kt), torch.empty(size_k * size_n, dtype=torch.int32)
    host.call("wna16_marlin_dst_table", num_bits, size_k, size_n, kt.data_ptr(), col.data_ptr(), slot.data_ptr())
    pf = 32 // num_bits
    flat = (kt * (size_n * 16 // pf) + col) * pf + slot
    assert torch.equal(flat[src_k * size_n + src_n], torch.arange(size_k * size_n))


@pytest.mark.parametrize("num_bits", BITS)
def test_index_math_matches_spec_tables(host: K.NativeLib, num_bits: int) -> None:
    size_k, size_n = 64, 192
    q = np.random.default_rng(num_bits).integers(0, 1 << num_bits, (size_k, size_n))
    expected = ref.unpack(ref.marlin_table_form(q, num_bits), num_bits, axis=1, size=size_n * 16)
    src_k, src_n = _src_table(host, num_bits, size_k, size_n)
    assert np.array_equal(expected.reshape(-1), q[src_k.numpy(), src_n.numpy()])


def test_scale_and_zero_point_tables(host: K.NativeLib) -> None:
    for grouped, chunk in ((1, 64), (0, 32)):
        table = torch.empty(chunk, dtype=torch.int32)
        host.call("wna16_scale_perm_table", grouped, table.data_ptr())
        arange = torch.arange(2 * chunk, dtype=torch.float32).reshape(1, -1)
        # group_size 1 < size_k 2 selects the grouped permutation, -1 the channel one
        permuted = marlin_permute_scales(arange, 2, 2 * chunk, 1 if grouped else -1)
        assert permuted[0, :chunk].to(torch.int32).tolist() == table.tolist()
        assert table.tolist() == (ref.scale_perm() if grouped else ref.scale_perm_single())
    for num_bits in BITS:
        table = torch.empty(64, dtype=torch.int32)
        host.call("wna16_zp_perm_table", num_bits, table.data_ptr())
        assert table.tolist() == ref.ZERO_POINT_INDEX[num_bits]
        codes = _codes((3, 128), num_bits, num_bits)
        marlin = unpack_codes(marlin_zero_points(pack_codes(codes, num_bits), 3, 128, num_bits), num_bits)
        idx = torch.cat([table.long(), table.long() + 64])
        assert torch.equal(marlin, codes[:, idx])


@pytest.mark.parametrize("num_bits", BITS)
@pytest.mark.parametrize("size_n,size_k", SHAPES_93)
def test_native_repack_equals_torch(host: K.NativeLib, num_bits: int, size_n: int, size_k: int) -> None:
    experts = 2
    q = _codes((experts, size_k, size_n), num_bits, size_n * size_k + num_bits)
    packed = pack_codes(q, num_bits, dim=-2)
    assert torch.equal(K.marlin_repack_fast(packed, num_bits), marlin_repack(packed, num_bits))
    g_idx = torch.stack([torch.randperm(size_k, generator=_gen(e)) // 128 for e in range(experts)])
    _, perm = sort_g_idx(g_idx)
    fast = K.marlin_repack_fast(packed, num_bits, perm)
    assert torch.equal(fast, marlin_repack(packed, num_bits, perm))
    assert torch.equal(K.marlin_unrepack_fast(fast, num_bits, size_k, size_n, perm), packed)
    assert torch.equal(K.marlin_unrepack_fast(fast, num_bits, size_k, size_n),
                       marlin_unrepack(fast, num_bits, size_k, size_n))


@pytest.mark.parametrize("num_bits", BITS)
@pytest.mark.parametrize("act_order", [False, True])
def test_native_repack_strided_in_and_out(host: K.NativeLib, num_bits: int, act_order: bool) -> None:
    """The repack command's call: a transposed view of the checkpoint's N-first words in, a
    column block of the wider w13 output out; equal to the torch repack of contiguous copies."""
    size_k, size_n = 256, 192
    q = _codes((size_n, size_k), num_bits, 7 + num_bits)
    n_first = pack_codes(q, num_bits, dim=-1)  # the checkpoint's [N, K/pf]
    kfirst_view = n_first.transpose(0, 1)  # [K/pf, N], not contiguous
    perm = sort_g_idx(torch.randperm(size_k, generator=_gen(3)) // 64)[1] if act_order else None
    want = marlin_repack(kfirst_view.contiguous(), num_bits, perm)
    wide = torch.full((size_k // 16, 2 * want.shape[-1]), -1, dtype=torch.int32)
    K.marlin_repack_fast(kfirst_view, num_bits, perm, out=wide[:, want.shape[-1]:])
    assert torch.equal(wide[:, want.shape[-1]:], want)
    assert bool((wide[:, : want.shape[-1]] == -1).all())  # the other half is untouched


def test_native_scales_and_zero_points_equal_torch(host: K.NativeLib) -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        s = torch.randn(3, 4, 256, generator=_gen(1)).to(dtype)
        for grouped, gs in ((1, 128), (0, -1)):
            out = torch.empty_like(s)
            host.call("wna16_permute_scales_host", s.data_ptr(), out.data_ptr(), 12, 256, s.element_size(), grouped, 0)
            expected = marlin_permute_scales(s, 512, 256, gs)
            assert torch.equal(out, expected)
            back = torch.empty_like(s)
            host.call("wna16_permute_scales_host", out.data_ptr(), back.data_ptr(), 12, 256, s.element_size(), grouped, 1)
            assert torch.equal(back, marlin_unpermute_scales(expected, 512, 256, gs))
    for num_bits in BITS:
        zp = pack_codes(_codes((2, 4, 256), num_bits, 3), num_bits)
        out, back = torch.empty_like(zp), torch.empty_like(zp)
        host.call("wna16_zero_points_host", zp.data_ptr(), out.data_ptr(), 8, 256, num_bits, 0)
        assert torch.equal(out, marlin_zero_points(zp, 4, 256, num_bits))
        host.call("wna16_zero_points_host", out.data_ptr(), back.data_ptr(), 8, 256, num_bits, 1)
        assert torch.equal(back, zp)
        assert torch.equal(marlin_zero_points_inverse(out, 4, 256, num_bits), zp)


def test_native_errors_are_reported(host: K.NativeLib) -> None:
    with pytest.raises(K.KernelError, match="size_n = 100 is not divisible by tile_n_size = 64"):
        host.call("wna16_marlin_repack_host", 0, None, 0, 1, 16, 100, 4, 1)
    bad = torch.zeros(1, 2, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="perm values"):
        K.marlin_repack_fast(bad, 4, torch.full((1, 16), 99))


# ----------------------------------------------------------------------------------------------
# (c) GEMM: a problem built from logical codes, its fp32 reference, and the Marlin inputs


def make_problem(*, num_bits=4, dtype=torch.bfloat16, experts=4, m=5, top_k=2, size_k=256, size_n=192,
                 group_size=64, zp=False, act_order=False, k_full=True, router=True, seed=0,
                 skew=False) -> dict:
    g = _gen(seed)
    q = torch.randint(0, 1 << num_bits, (experts, size_k, size_n), generator=g)
    if act_order and not k_full:
        # a rank's slice of a row-parallel layer: global group ids into the full (2x) scales
        groups = 2 * size_k // group_size
        g_idx = torch.randint(0, groups, (experts, size_k), generator=g)
    elif act_order:
        groups = size_k // group_size
        g_idx = torch.stack([torch.randperm(size_k, generator=g) // group_size for _ in range(experts)])
    else:
        groups = 1 if group_size == -1 else size_k // group_size
        g_idx = None
    scales = (torch.rand(experts, groups, size_n, generator=g) * 0.02 + 1e-3).to(dtype)
    zeros = torch.randint(0, 1 << num_bits, (experts, groups, size_n), generator=g) if zp else None
    grp = g_idx if g_idx is not None else (torch.arange(size_k) // (size_k // groups)).expand(experts, size_k)
    z = zeros if zeros is not None else torch.full((experts, groups, size_n), 1 << (num_bits - 1))
    w = torch.stack([(q[e] - z[e][grp[e]]).to(dtype) * scales[e][grp[e]] for e in range(experts)])
    a = torch.randn(m, size_k, generator=g).to(dtype)
    if skew:  # every token to the same experts: large per-expert groups (64-row tiles)
        top = torch.arange(top_k).expand(m, top_k)
    else:
        top = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)])
    flat = top.reshape(-1)
    sorted_ids = torch.argsort(flat, stable=True).to(torch.int32)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=experts), 0)
    topk_weights = torch.rand(m * top_k, generator=g) if router else None
    expected = torch.stack([a[s // top_k].float() @ w[flat[s]].float() for s in range(m * top_k)])
    if router:
        expected = expected * topk_weights.unsqueeze(1)

    perm = sorted_gidx = None
    packed = pack_codes(q.to(torch.int32), num_bits, dim=-2)
    if g_idx is not None:
        sorted_gidx, perm = sort_g_idx(g_idx)
    b_q = marlin_repack(packed, num_bits, perm)
    m_scales = marlin_permute_scales(scales, groups * max(group_size, 1) if group_size != -1 else size_k,
                                     size_n, group_size)
    m_zeros = None
    if zeros is not None:
        m_zeros = marlin_zero_points(pack_codes(zeros.to(torch.int32), num_bits), groups, size_n, num_bits)
    args = (a, b_q, m_scales, sorted_ids, offsets, top_k, num_bits, m_zeros, sorted_gidx, perm, topk_weights, k_full)
    return {"args": args, "expected": expected, "dtype": dtype}


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


# output rounding dominates: half an ulp of the largest value, plus fp32 summation noise
TOL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}

GEMM_CASES = [
    {},
    {"num_bits": 8},
    {"dtype": torch.float16},
    {"group_size": -1},
    {"group_size": 32, "size_k": 512, "size_n": 128},
    {"group_size": 128, "num_bits": 8, "dtype": torch.float16},
    {"zp": True},
    {"zp": True, "num_bits": 8, "dtype": torch.float16},
    {"act_order": True},
    {"act_order": True, "num_bits": 8, "dtype": torch.float16},
    {"act_order": True, "k_full": False},
    {"act_order": True, "k_full": False, "zp": True, "router": False},
    {"router": False, "top_k": 1, "m": 9},
    {"skew": True, "m": 70, "experts": 2, "size_n": 128},
]


def _case_id(case: dict) -> str:
    return ",".join(f"{k}={getattr(v, 'itemsize', v) if isinstance(v, torch.dtype) else v}" for k, v in case.items()) or "default"


@pytest.mark.parametrize("case", GEMM_CASES, ids=_case_id)
def test_gemm_cpu_op_matches_fp32_reference(case: dict) -> None:
    prob = make_problem(**case)
    got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
    assert got.dtype == prob["dtype"] and got.shape == prob["expected"].shape
    assert _rel_err(got, prob["expected"]) < TOL[prob["dtype"]]


def test_gemm_cpu_op_leaves_unrouted_rows_zero() -> None:
    prob = make_problem(m=6, top_k=2)
    args = list(prob["args"])
    offsets = args[4].clone()
    offsets[2:] = offsets[2]  # experts 2.. get no slots
    args[4] = offsets
    got = torch.ops.wna16ctl.moe_wna16_gemm(*args)
    routed = args[3][: int(offsets[2])].long()
    mask = torch.zeros(got.shape[0], dtype=torch.bool)
    mask[routed] = True
    assert torch.count_nonzero(got[~mask]) == 0
    assert _rel_err(got[mask], prob["expected"][mask]) < TOL[prob["dtype"]]


def test_gemm_rejects_bad_group_layout() -> None:
    prob = make_problem(act_order=True)
    args = list(prob["args"])
    args[2] = args[2][:, :1].contiguous()  # a single scale row with act-order on a full K
    with pytest.raises(ValueError, match="num_groups must be > 1"):
        torch.ops.wna16ctl.moe_wna16_gemm(*args)


# ----------------------------------------------------------------------------------------------
# (d) GPU


def _gpu_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    if not K.cuda_available():
        pytest.skip("CUDA library unavailable (nvcc missing or build failed; see the log)")


@pytest.mark.gpu
@pytest.mark.parametrize("num_bits", BITS)
def test_cuda_repack_equals_cpu(num_bits: int) -> None:
    _gpu_or_skip()
    for size_n, size_k in SHAPES_93:
        packed = pack_codes(_codes((3, size_k, size_n), num_bits, size_k), num_bits, dim=-2)
        _, perm = sort_g_idx(torch.stack([torch.randperm(size_k, generator=_gen(e)) // 128 for e in range(3)]))
        for p in (None, perm):
            got = torch.ops.wna16ctl.marlin_repack(packed.cuda(), num_bits, None if p is None else p.cuda())
            assert torch.equal(got.cpu(), marlin_repack(packed, num_bits, p))
        s = torch.randn(3, size_k // 128, size_n).half()
        got = torch.ops.wna16ctl.marlin_permute_scales(s.cuda(), size_k, size_n, 128)
        assert torch.equal(got.cpu(), marlin_permute_scales(s, size_k, size_n, 128))
        zp = pack_codes(_codes((3, size_k // 128, size_n), num_bits, 5), num_bits)
        got = torch.ops.wna16ctl.marlin_zero_points(zp.cuda(), size_k // 128, size_n, num_bits)
        assert torch.equal(got.cpu(), marlin_zero_points(zp, size_k // 128, size_n, num_bits))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mma", "fma"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=_case_id)
def test_cuda_gemm_matches_cpu(case: dict, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu_or_skip()
    monkeypatch.setenv("WNA16CTL_GEMM_VARIANT", variant)
    prob = make_problem(**case)
    cuda_args = [x.cuda() if isinstance(x, torch.Tensor) else x for x in prob["args"]]
    got = torch.ops.wna16ctl.moe_wna16_gemm(*cuda_args).cpu()
    expected = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
    assert _rel_err(got, expected.float()) < TOL[prob["dtype"]]
