"""One unattended GPU check: build the kernels, check them against the CPU path, benchmark them.

    python -m wna16ctl.gpucheck [--out FILE] [--budget SECONDS] [--no-pytest]

Runs in well under five minutes on one NVIDIA GPU with nothing prepared but a python with torch
(CUDA build) and nvcc. Writes one JSON file ($OUT/gpu_check.json when $OUT is set, else
./gpu_check.json) and prints a short summary. Exit status: 0 all checks passed, 1 a check
failed, 2 the check could not run (no GPU / torch without CUDA / build failure).

Checks:
* repack, scale and zero-point permutation: CUDA == torch CPU path bit for bit (§9.3 shapes,
  4/8 bit, with and without act-order);
* MoE GEMM, both kernel variants (mma.sync and fp32 FMA): against an fp32 reference from the
  logical (unpacked, unpermuted) weights, over a seeded subsample of m ∈ {1,16,123,666},
  n ∈ {128,1024}, k ∈ {256,2048}, e ∈ {8,64}, top-k ∈ {2,6}, 4/8 bit, group size -1/32/128,
  zero points, act-order (full and partial K); plus a few small cases against the CPU op;
* the test-suite's `gpu` tests when pytest is importable.
Benchmarks: repack throughput as a share of the GPU's peak memory bandwidth; GEMM time and
effective weight bandwidth against torch bf16 matmuls of the dequantised weights, batch 1-64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

TOL = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}  # of max |ref|; output rounding dominates


def _now() -> float:
    return time.monotonic()


class Budget:
    def __init__(self, seconds: float):
        self.start = _now()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (_now() - self.start)


def _time_cuda(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call, CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


# ----------------------------------------------------------------------------------------------
# problems


def build_problem(*, m: int, n: int, k: int, e: int, topk: int, bits: int, gs: int, zp: bool,
                  act: bool, k_full: bool = True, dtype=torch.bfloat16, seed: int = 0,
                  device: str = "cuda", router: bool = True) -> dict:
    """Random logical weights, their fp32 reference output and the Marlin-layout inputs."""
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack, marlin_zero_points, sort_g_idx
    from wna16ctl.layout.packing import pack_codes

    g = torch.Generator(device="cpu").manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)  # the big tensors are drawn on the device
    q = torch.randint(0, 1 << bits, (e, k, n), generator=gd, device=device, dtype=torch.int32)
    if act and not k_full:
        groups = 2 * k // gs  # the rank's K is half of the layer's; g_idx holds global groups
        g_idx = torch.randint(0, groups, (e, k), generator=g).to(device)
    elif act:
        groups = k // gs
        g_idx = torch.stack([torch.randperm(k, generator=g) // gs for _ in range(e)]).to(device)
    else:
        groups = 1 if gs == -1 else k // gs
        g_idx = None
    scales = (torch.rand(e, groups, n, generator=g) * 0.02 + 1e-3).to(device=device, dtype=dtype)
    zeros = torch.randint(0, 1 << bits, (e, groups, n), generator=g, dtype=torch.int32).to(device) if zp else None
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    top = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).to(device)
    flat = top.reshape(-1)
    sorted_ids = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.bincount(flat, minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    tw = torch.rand(m * topk, generator=g).to(device) if router else None

    # reference: dequantise logical codes in the activation dtype, fp32 matmul per expert
    expected = torch.zeros(m * topk, n, dtype=torch.float32, device=device)
    grp_default = torch.arange(k, device=device) // (k // groups) if g_idx is None else None
    offs = offsets.tolist()
    for ex in range(e):
        slots = sorted_ids[offs[ex]:offs[ex + 1]].long()
        if slots.numel() == 0:
            continue
        grp = g_idx[ex] if g_idx is not None else grp_default
        z = zeros[ex][grp] if zeros is not None else (1 << (bits - 1))
        w = (q[ex] - z).to(dtype) * scales[ex][grp]
        expected[slots] = a[slots // topk].float() @ w.float()
    if tw is not None:
        expected *= tw.unsqueeze(1)

    perm = sorted_g = None
    if g_idx is not None:
        sorted_g, perm = sort_g_idx(g_idx)
    b_q = marlin_repack(pack_codes(q, bits, dim=-2), bits, perm)
    size_k_scales = groups * gs if gs != -1 else k
    m_scales = marlin_permute_scales(scales, size_k_scales, n, gs)
    m_zeros = marlin_zero_points(pack_codes(zeros, bits), groups, n, bits) if zeros is not None else None
    args = (a, b_q, m_scales, m_zeros, sorted_g, perm, sorted_ids, offsets, tw, topk, bits, k_full)
    return {"args": args, "expected": expected, "dtype": dtype, "q": q, "scales": scales, "zeros": zeros,
            "g_idx": g_idx}


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    denom = float(expected.abs().max())
    return float((got.float() - expected).abs().max()) / (denom if denom else 1.0)


def gemm_cases(seed: int, count: int) -> list[dict]:
    """A seeded subsample of the §9.4-style grid that still covers every feature."""
    rng = random.Random(seed)
    grid = []
    for m in (1, 16, 123, 666):
        for n in (128, 1024):
            for k in (256, 2048):
                for e in (8, 64):
                    for topk in (2, 6):
                        for bits in (4, 8):
                            for gs in (-1, 32, 128):
                                for zp in (False, True):
                                    for act in ("none", "full", "partial"):
                                        if act != "none" and gs == -1:
                                            continue  # act-order needs groups
                                        grid.append(dict(m=m, n=n, k=k, e=e, topk=topk, bits=bits, gs=gs,
                                                         zp=zp, act=act != "none", k_full=act != "partial"))
    rng.shuffle(grid)
    # make sure each feature value appears at least once, then fill with the shuffled rest
    chosen: list[dict] = []
    keys = ("m", "n", "k", "e", "topk", "bits", "gs", "zp", "act", "k_full")
    for key in keys:
        for value in sorted({repr(c[key]) for c in grid}):
            if not any(repr(c[key]) == value for c in chosen):
                chosen.append(next(c for c in grid if repr(c[key]) == value))
    for c in grid:
        if len(chosen) >= count:
            break
        if c not in chosen:
            chosen.append(c)
    for i, c in enumerate(chosen):
        c["dtype"] = torch.bfloat16 if i % 3 else torch.float16
    return chosen


# ----------------------------------------------------------------------------------------------
# steps


def step_env(report: dict) -> Optional[str]:
    report["env"] = env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    from wna16ctl import kernels as K

    nvcc = K.find_nvcc()
    env["nvcc"] = nvcc
    if nvcc:
        env["nvcc_version"] = K._tool_version(nvcc).splitlines()[-1]
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (CPU-only torch build, no GPU, or driver problem)"
    props = torch.cuda.get_device_properties(0)
    env.update(device=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2 ** 30, 1))
    if not nvcc:
        return "nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    return None


def step_build(report: dict) -> Optional[str]:
    from wna16ctl import kernels as K

    t0 = _now()
    try:
        path = K.build_cuda()
    except K.KernelBuildError as exc:
        report["build"] = {"ok": False, "error": str(exc)[-3000:]}
        return "CUDA library build failed"
    report["build"] = {"ok": True, "cuda_lib": str(path), "seconds": round(_now() - t0, 1),
                       "archs": K.detect_archs()}
    try:
        t1 = _now()
        report["build"]["host_lib"] = str(K.build_host())
        report["build"]["host_seconds"] = round(_now() - t1, 1)
    except K.KernelBuildError as exc:
        report["build"]["host_error"] = str(exc)[-1000:]
    lib = K.cuda_lib()
    if lib is None:
        return "CUDA library built but did not load"
    import ctypes

    info = (ctypes.c_int32 * 8)()
    try:  # the first runtime call: a driver older than the toolkit fails here
        lib.call("wna16_cuda_device_info", torch.cuda.current_device(), ctypes.addressof(info))
    except K.KernelError as exc:
        report["build"]["runtime_error"] = str(exc)
        return f"CUDA library cannot run on this driver/device: {exc}"
    cc_major, cc_minor, sms, mem_khz, bus_bits, l2, rt, drv = list(info)
    peak = 2.0 * mem_khz * 1e3 * bus_bits / 8 / 1e9  # DDR: two transfers per clock
    report["device"] = {"cc": f"{cc_major}.{cc_minor}", "sm_count": sms, "mem_clock_khz": mem_khz,
                        "bus_width_bits": bus_bits, "l2_bytes": l2, "peak_gbps": round(peak, 1),
                        "cuda_runtime": rt, "cuda_driver": drv}
    return None


def step_repack(report: dict, budget: Budget) -> bool:
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack, marlin_zero_points, sort_g_idx
    from wna16ctl.layout.packing import pack_codes

    results = []
    ok = True
    for bits in (4, 8):
        for n, k in ((256, 1024), (448, 640), (832, 1408), (1024, 1024), (1792, 640), (3328, 1408)):
            g = torch.Generator().manual_seed(n + k + bits)
            q = torch.randint(0, 1 << bits, (4, k, n), generator=g, dtype=torch.int32)
            packed = pack_codes(q, bits, dim=-2)
            _, perm = sort_g_idx(torch.stack([torch.randperm(k, generator=g) // 128 for _ in range(4)]))
            for p in (None, perm):
                got = torch.ops.wna16ctl.marlin_repack(packed.cuda(), bits, None if p is None else p.cuda()).cpu()
                same = bool(torch.equal(got, marlin_repack(packed, bits, p)))
                ok &= same
                results.append({"what": "repack", "bits": bits, "n": n, "k": k, "act_order": p is not None,
                                "bit_exact": same})
            s = torch.randn(4, k // 128, n, generator=g).to(torch.bfloat16)
            same = bool(torch.equal(torch.ops.wna16ctl.marlin_permute_scales(s.cuda(), k, n, 128).cpu(),
                                    marlin_permute_scales(s, k, n, 128)))
            s1 = s[:, :1].contiguous()
            same &= bool(torch.equal(torch.ops.wna16ctl.marlin_permute_scales(s1.cuda(), k, n, -1).cpu(),
                                     marlin_permute_scales(s1, k, n, -1)))
            zp = pack_codes(torch.randint(0, 1 << bits, (4, k // 128, n), generator=g, dtype=torch.int32), bits)
            same &= bool(torch.equal(torch.ops.wna16ctl.marlin_zero_points(zp.cuda(), k // 128, n, bits).cpu(),
                                     marlin_zero_points(zp, k // 128, n, bits)))
            ok &= same
            results.append({"what": "scales+zp", "bits": bits, "n": n, "k": k, "bit_exact": same})
    report["repack_checks"] = {"ok": ok, "cases": results}
    return ok


def step_gemm(report: dict, budget: Budget, count: int) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true fp32
    cases = gemm_cases(seed=1234, count=count)
    results = []
    ok = True
    for i, case in enumerate(cases):
        if budget.left() < 60:
            report["gemm_checks_truncated"] = f"stopped after {i} of {len(cases)} cases (time budget)"
            break
        prob = build_problem(**case, seed=i)
        entry = {key: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for key, v in case.items()}
        for variant in ("mma", "fma"):
            os.environ["WNA16CTL_GEMM_VARIANT"] = variant
            try:
                got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
                torch.cuda.synchronize()
                err = _rel_err(got, prob["expected"])
                passed = err < TOL[prob["dtype"]]
                entry[variant] = {"rel_err": float(f"{err:.3g}"), "ok": passed}
            except Exception as exc:  # record and continue: one bad case must not hide the rest
                passed = False
                entry[variant] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            ok &= passed
        results.append(entry)
    os.environ.pop("WNA16CTL_GEMM_VARIANT", None)

    # small cases against the CPU op itself (same semantics, tighter agreement expected)
    cpu_cases = []
    for j, case in enumerate([dict(m=5, n=192, k=256, e=4, topk=2, bits=4, gs=64, zp=True, act=False),
                              dict(m=7, n=128, k=512, e=4, topk=3, bits=8, gs=128, zp=False, act=True),
                              dict(m=3, n=256, k=256, e=3, topk=2, bits=4, gs=32, zp=False, act=True, k_full=False,
                                   dtype=torch.float16)]):
        prob = build_problem(**case, seed=100 + j)
        cpu_args = [x.cpu() if isinstance(x, torch.Tensor) else x for x in prob["args"]]
        want = torch.ops.wna16ctl.moe_wna16_gemm(*cpu_args)
        got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"]).cpu()
        err = _rel_err(got, want.float())
        passed = err < TOL[prob["dtype"]]
        ok &= passed
        cpu_cases.append({"case": j, "rel_err_vs_cpu_op": float(f"{err:.3g}"), "ok": passed})
    report["gemm_checks"] = {"ok": ok, "tolerance_rel_max": {str(k).replace("torch.", ""): v for k, v in TOL.items()},
                             "cases": results, "vs_cpu_op": cpu_cases}
    return ok


def bench_repack(report: dict) -> None:
    e, k, n, bits = 16, 7168, 4096, 4
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, k // 8, n), dtype=torch.int32, device="cuda")
    perm = torch.stack([torch.randperm(k, device="cuda") for _ in range(e)]).to(torch.int32)
    peak = report.get("device", {}).get("peak_gbps") or float("nan")
    out = {}
    for name, p in (("plain", None), ("act_order", perm)):
        ms = _time_cuda(lambda: torch.ops.wna16ctl.marlin_repack(packed, bits, p), reps=10)
        moved = 2 * packed.numel() * 4 + (p.numel() * 4 if p is not None else 0)  # read + write
        gbps = moved / ms / 1e6
        out[name] = {"ms": round(ms, 3), "gbps_read_write": round(gbps, 1),
                     "pct_of_peak": round(100 * gbps / peak, 1)}
    out["shape"] = {"experts": e, "k": k, "n": n, "bits": bits, "packed_mb": round(packed.numel() * 4 / 1e6, 1)}
    report["bench_repack"] = out


def bench_gemm(report: dict, budget: Budget) -> None:
    """Decode-sized MoE GEMM: E 64, K 2048, N 1536 (a w13 projection), top-8, int4 g128, bf16."""
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack
    from wna16ctl.layout.packing import pack_codes

    e, k, n, topk, bits, gs = 64, 2048, 1536, 8, 4, 128
    dtype = torch.bfloat16
    q = torch.randint(0, 16, (e, k, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(e, k // gs, n, device="cuda") * 0.02).to(dtype)
    b_q = marlin_repack(pack_codes(q, bits, dim=-2), bits)
    m_scales = marlin_permute_scales(scales, k, n, gs)
    grp = torch.arange(k, device="cuda") // gs
    w_deq = torch.stack([(q[i] - 8).to(dtype) * scales[i][grp] for i in range(e)])  # [E, K, N] bf16
    del q
    rows = []
    for m in (1, 4, 16, 64):
        if budget.left() < 20:
            break
        g = torch.Generator().manual_seed(m)
        a = torch.randn(m, k, generator=g).to(device="cuda", dtype=dtype)
        top = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).cuda()
        flat = top.reshape(-1)
        sorted_ids = torch.argsort(flat, stable=True).to(torch.int32)
        counts = torch.bincount(flat, minlength=e)
        offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = torch.cumsum(counts, 0)
        active = torch.nonzero(counts).flatten()
        n_active = int(active.numel())
        max_rows = int(counts.max())
        # torch baseline: the active experts' dequantised bf16 weights, one bmm over padded groups
        w_act = w_deq[active].contiguous()
        a_pad = torch.zeros(n_active, max_rows, k, dtype=dtype, device="cuda")
        entry: dict[str, Any] = {"m": m, "active_experts": n_active}
        int_bytes = n_active * (k * n * bits // 8 + (k // gs) * n * 2)
        bf16_bytes = n_active * k * n * 2
        for variant in ("mma", "fma"):
            os.environ["WNA16CTL_GEMM_VARIANT"] = variant
            ms = _time_cuda(lambda: torch.ops.wna16ctl.moe_wna16_gemm(
                a, b_q, m_scales, None, None, None, sorted_ids, offsets, None, topk, bits, True), reps=10)
            entry[variant] = {"ms": round(ms, 4), "weight_gbps": round(int_bytes / ms / 1e6, 1)}
        os.environ.pop("WNA16CTL_GEMM_VARIANT", None)
        ms = _time_cuda(lambda: torch.bmm(a_pad, w_act), reps=10)
        entry["torch_bf16_bmm"] = {"ms": round(ms, 4), "weight_gbps": round(bf16_bytes / ms / 1e6, 1)}
        rows.append(entry)
    report["bench_gemm"] = {"shape": {"experts": e, "k": k, "n": n, "top_k": topk, "bits": bits, "group_size": gs,
                                      "dtype": "bfloat16"}, "rows": rows,
                            "note": "weight_gbps = bytes of the active experts' weights (+scales) / time; "
                                    "torch baseline = one bmm over the active experts' dequantised bf16 weights "
                                    "(tokens padded per expert), i.e. 4x the int4 bytes"}


def step_pytest(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        report["pytest_gpu"] = {"skipped": "pytest not importable"}
        return None
    if not (repo / "tests" / "test_kernels.py").is_file() or budget.left() < 45:
        report["pytest_gpu"] = {"skipped": "tests/ not present or no time left"}
        return None
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "tests/test_kernels.py"]
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=max(30, budget.left() - 15))
    except subprocess.TimeoutExpired:
        report["pytest_gpu"] = {"ok": False, "error": "timed out"}
        return False
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    report["pytest_gpu"] = {"ok": proc.returncode == 0, "returncode": proc.returncode, "tail": tail}
    if proc.returncode not in (0, 1):  # collection/usage problem (e.g. numpy missing), not a failure
        report["pytest_gpu"]["note"] = "pytest could not run the tests; the checks above still stand"
        return None
    return proc.returncode == 0


def summary(report: dict) -> str:
    lines = [f"wna16ctl GPU check: {report['status']}" + (f" ({report['reason']})" if report.get("reason") else "")]
    env = report.get("env", {})
    if env.get("device"):
        lines.append(f"  device {env['device']} (sm {env.get('capability')}), torch {env.get('torch')} "
                     f"cuda {env.get('torch_cuda')}, {env.get('nvcc_version', 'nvcc ?')}")
    if "build" in report:
        b = report["build"]
        lines.append(f"  build: {'ok' if b.get('ok') else 'FAILED'}" + (f" in {b.get('seconds')} s" if b.get("ok") else ""))
    if "repack_checks" in report:
        r = report["repack_checks"]
        lines.append(f"  repack/scales/zp bit-exact vs CPU: {'ok' if r['ok'] else 'FAILED'} ({len(r['cases'])} cases)")
    if "gemm_checks" in report:
        gch = report["gemm_checks"]
        worst = {v: max((c[v].get("rel_err", float("inf")) for c in gch["cases"] if v in c), default=None)
                 for v in ("mma", "fma")}
        lines.append(f"  GEMM vs fp32 reference: {'ok' if gch['ok'] else 'FAILED'} ({len(gch['cases'])} cases, "
                     f"worst rel err mma {worst['mma']}, fma {worst['fma']})")
    if "pytest_gpu" in report:
        p = report["pytest_gpu"]
        state = p.get("skipped") or ("ok" if p.get("ok") else ("not run" if p.get("note") else "FAILED"))
        lines.append(f"  pytest -m gpu: {state}")
    if "bench_repack" in report:
        br = report["bench_repack"]
        lines.append(f"  repack {br['shape']['packed_mb']} MB int4: {br['plain']['gbps_read_write']} GB/s "
                     f"({br['plain']['pct_of_peak']}% of peak {report.get('device', {}).get('peak_gbps')} GB/s), "
                     f"act-order {br['act_order']['gbps_read_write']} GB/s")
    for row in report.get("bench_gemm", {}).get("rows", []):
        lines.append(f"  GEMM m={row['m']:>3}: mma {row['mma']['ms']} ms ({row['mma']['weight_gbps']} GB/s), "
                     f"fma {row['fma']['ms']} ms, torch bf16 {row['torch_bf16_bmm']['ms']} ms "
                     f"({row['torch_bf16_bmm']['weight_gbps']} GB/s)")
    return "\n".join(lines)


def run(out: Path, budget_s: float, gemm_count: int, with_pytest: bool) -> int:
    budget = Budget(budget_s)
    report: dict[str, Any] = {"status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    repo = Path(__file__).resolve().parent.parent

    def finish(status: str, reason: Optional[str] = None, code: int = 0) -> int:
        report["status"] = status
        if reason:
            report["reason"] = reason
        report["seconds"] = round(_now() - budget.start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(summary(report))
        print(f"  report: {out}")
        return code

    try:
        reason = step_env(report)
        if reason:
            return finish("not-run", reason, 2)
        reason = step_build(report)
        if reason:
            return finish("not-run", reason, 2)
        ok = step_repack(report, budget)
        ok &= step_gemm(report, budget, gemm_count)
        if with_pytest:
            ok &= step_pytest(report, budget, repo) is not False
        if budget.left() > 30:
            bench_repack(report)
        if budget.left() > 30:
            bench_gemm(report, budget)
    except Exception as exc:  # keep whatever was measured
        report["exception"] = traceback.format_exc()[-4000:]
        return finish("error", f"{type(exc).__name__}: {exc}"[:300], 1)
    return finish("passed" if ok else "failed", None if ok else "see the failing cases", 0 if ok else 1)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wna16ctl.gpucheck", description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the whole check (default 270)")
    parser.add_argument("--gemm-cases", type=int, default=40, help="GEMM grid cases to run (default 40)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the test-suite's gpu tests")
    args = parser.parse_args(argv)
    return run(args.out, args.budget, args.gemm_cases, not args.no_pytest)


if __name__ == "__main__":
    sys.exit(main())
