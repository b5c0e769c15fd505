"""One unattended GPU check: build the kernels, check them against the CPU path, benchmark them.

    python -m wna16ctl.native.gpucheck [--out FILE] [--budget SECONDS] [--no-pytest] [--no-sanitizer]
    python -m wna16ctl.native.gpucheck --build-only

Builds the CUDA library first (cached: a second run finds it), outside the time budget; the
budget (default 480 s) then covers the checks, which stop REPORT_RESERVE_S (60 s) before it ends
so that the report is always written. Needs nothing prepared but a python with torch (CUDA
build) and nvcc. Writes one JSON file ($OUT/gpu_check.json when $OUT is set, else
./gpu_check.json) and rewrites it after every step and case (atomically), so a time limit or a
hung kernel leaves what was measured; prints a short summary. Exit status: 0 all checks passed,
1 a check failed (or the run was stopped), 2 the check could not run (no GPU / torch without
CUDA / build failure).

Checks:
* repack, scale and zero-point permutation: CUDA == torch CPU path bit for bit (§9.3 shapes,
  4/8 bit, with and without act-order);
* MoE GEMM, the fast kernels (v3 -- falling back to v2 where it declines --, v2) and the simple
  reference kernel (v1, mma.sync): against an fp32 reference from the logical (unpacked,
  unpermuted) dequantised weights and against each other (v3 equal to v2 bit for bit),
  over a seeded subsample of m ∈ {1,7,16,64,123,512}, n ∈ {128,1024}, k ∈ {256,2048},
  e ∈ {8,64}, top-k ∈ {2,6}, 4/8 bit, group size -1/32/128, zero points, act-order (full and
  partial K); plus a few small cases against the CPU op;
* compute-sanitizer memcheck, racecheck and synccheck on four tiny GEMM cases (v3 and v2 with
  tiles cut between blocks, v2 with g_idx, v1), when compute-sanitizer is installed; a tool that
  refuses the device ("Device not supported") is "not run" with its reason, never a failure;
* the vLLM load format `wna16ctl` (wna16ctl/integrations/vllm_plugin.py): a `repack --layout marlin`
  output of the demo checkpoint served with `--load-format wna16ctl` against vLLM's default load of
  the checkpoint (both on the Marlin backend), greedy tokens and logprobs on the same prompts; "not
  run" with the reason without vLLM ($WNA16CTL_VLLM_PYTHON or this python) or a served release/GPU;
* the test-suite's `gpu` tests when pytest is importable.
Benchmarks (CUDA events around the bare library calls: no host synchronisation inside the timed
region): repack throughput, plain and act-order, as a share of the GPU's peak memory bandwidth;
GEMM time and weight bandwidth of v3, v2 and v1 against torch bf16 matmuls of the dequantised
weights, batch 1-512, each row with the share of the HBM peak that bench/roofline.py's model
expects for v3 and v2; the goals (repack >= 70% of peak, the automatic kernel -- v3, v2 for the
64-row tile -- >= 50% at m <= 16 and within 1.5x of bf16 at m >= 64) are reported as met or not,
apart from the pass/fail of the checks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

TOL = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}  # of max |ref|; output rounding dominates
GOALS = {"repack_pct_of_peak": 70.0, "gemm_pct_of_peak_m_le_16": 50.0, "gemm_vs_bf16_m_ge_64": 1.5}
DEFAULT_BUDGET_S = 480.0
REPORT_RESERVE_S = 60.0  # the checks stop this long before the budget ends: the report is written
# what compute-sanitizer prints when it cannot attach to the GPU (a runtime / driver it does not
# support): the tool did not run, which says nothing about the kernels
SANITIZER_REFUSED = re.compile(r"(?i)device not supported|unsupported (gpu|device)|not supported on this (gpu|device)")


class Report(dict):
    """The JSON report, rewritten on disk (atomically: a temporary file renamed over it) by every
    save(), so whatever stops the run leaves the last complete state behind."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _now() -> float:
    return time.monotonic()


class Budget:
    """Seconds left for the checks: the budget less the reserve kept for writing the report."""

    def __init__(self, seconds: float, reserve: float = 0.0):
        self.start = _now()
        self.seconds = seconds
        self.reserve = reserve

    def left(self) -> float:
        return self.seconds - self.reserve - (_now() - self.start)


class BudgetSpent(Exception):
    """The checks reached the end of their budget (the report reserve is what remains)."""


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
    for m in (1, 7, 16, 64, 123, 512):
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
    from wna16ctl.native import ops as K

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
    from wna16ctl.native import ops as K

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


# WNA16CTL_GEMM_KERNEL, WNA16CTL_GEMM_VARIANT; "v3" falls back to v2 where it declines (v3_runs)
KERNELS = {"v3": ("v3", "auto"), "v2": ("v2", "auto"), "v1": ("v1", "mma")}


def v3_runs(case: dict) -> bool:
    """Whether the v3 kernel takes this case itself (its fast mode: no act-order, K and the scale
    groups whole 64-row stages; moe_gemm_v3.cu check_mode) rather than handing it to v2."""
    k, gs = case["k"], case["gs"]
    return not case["act"] and k % 64 == 0 and (gs == -1 or gs % 64 == 0)


def _use_kernel(name: str) -> None:
    os.environ["WNA16CTL_GEMM_KERNEL"], os.environ["WNA16CTL_GEMM_VARIANT"] = KERNELS[name]


def _default_kernel() -> None:
    os.environ.pop("WNA16CTL_GEMM_KERNEL", None)
    os.environ.pop("WNA16CTL_GEMM_VARIANT", None)


def step_gemm(report: Report, budget: Budget, count: int) -> bool:
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
        outs = {}
        for kernel in KERNELS:
            _use_kernel(kernel)
            try:
                got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
                torch.cuda.synchronize()
                outs[kernel] = got
                err = _rel_err(got, prob["expected"])
                passed = err < TOL[prob["dtype"]]
                entry[kernel] = {"rel_err": float(f"{err:.3g}"), "ok": passed}
            except Exception as exc:  # record and continue: one bad case must not hide the rest
                passed = False
                entry[kernel] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            ok &= passed
        if "v2" in outs and "v1" in outs:  # the kernels against each other
            err = _rel_err(outs["v2"], outs["v1"].float())
            entry["v2_vs_v1"] = {"rel_err": float(f"{err:.3g}"), "ok": err < TOL[prob["dtype"]]}
            ok &= entry["v2_vs_v1"]["ok"]
        if "v3" in outs and "v2" in outs:  # v3 adds in v2's order: equal bit for bit
            entry["v3_vs_v2"] = {"v3_ran": v3_runs(case), "bit_equal": bool(torch.equal(outs["v3"], outs["v2"]))}
            entry["v3_vs_v2"]["ok"] = entry["v3_vs_v2"]["bit_equal"]
            ok &= entry["v3_vs_v2"]["ok"]
        results.append(entry)
        report["gemm_checks"] = {"ok": ok, "partial": True, "cases": results}
        report.save()
    _default_kernel()

    # small cases against the CPU op itself (same semantics, tighter agreement expected)
    cpu_cases = []
    for j, case in enumerate([dict(m=5, n=192, k=256, e=4, topk=2, bits=4, gs=64, zp=True, act=False),
                              dict(m=7, n=128, k=512, e=4, topk=3, bits=8, gs=128, zp=False, act=True),
                              dict(m=3, n=256, k=256, e=3, topk=2, bits=4, gs=32, zp=False, act=True, k_full=False,
                                   dtype=torch.float16)]):
        prob = build_problem(**case, seed=100 + j)
        cpu_args = [x.cpu() if isinstance(x, torch.Tensor) else x for x in prob["args"]]
        want = torch.ops.wna16ctl.moe_wna16_gemm(*cpu_args)
        for kernel in KERNELS:
            _use_kernel(kernel)
            got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"]).cpu()
            err = _rel_err(got, want.float())
            passed = err < TOL[prob["dtype"]]
            ok &= passed
            cpu_cases.append({"case": j, "kernel": kernel, "rel_err_vs_cpu_op": float(f"{err:.3g}"), "ok": passed})
        _default_kernel()
    report["gemm_checks"] = {"ok": ok, "tolerance_rel_max": {str(k).replace("torch.", ""): v for k, v in TOL.items()},
                             "cases": results, "vs_cpu_op": cpu_cases}
    return ok


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def bench_repack(report: Report) -> None:
    """The bare launcher in the timed region (the torch op validates perm on the host first)."""
    from wna16ctl.native import ops as K

    lib = K.cuda_lib()
    e, k, n, bits = 16, 7168, 4096, 4
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, k // 8, n), dtype=torch.int32, device="cuda")
    perm = torch.stack([torch.randperm(k, device="cuda") for _ in range(e)]).to(torch.int32)
    out_t = torch.empty(e, k // 16, n * 16 // 8, dtype=torch.int32, device="cuda")
    peak = report.get("device", {}).get("peak_gbps") or float("nan")
    out: dict[str, Any] = {"timed": "CUDA events around wna16_cuda_marlin_repack alone (no host syncs)"}
    for name, p in (("plain", None), ("act_order", perm)):
        def call(p=p) -> None:
            lib.call("wna16_cuda_marlin_repack", packed.data_ptr(), None if p is None else p.data_ptr(),
                     out_t.data_ptr(), e, k, n, bits, _stream())
        ms = _time_cuda(call, reps=10)
        moved = 2 * packed.numel() * 4 + (p.numel() * 4 if p is not None else 0)  # read + write
        gbps = moved / ms / 1e6
        out[name] = {"ms": round(ms, 3), "gbps_read_write": round(gbps, 1),
                     "pct_of_peak": round(100 * gbps / peak, 1)}
    out["shape"] = {"experts": e, "k": k, "n": n, "bits": bits, "packed_mb": round(packed.numel() * 4 / 1e6, 1)}
    report["bench_repack"] = out


def _gemm_call(kernel: str, args: tuple) -> tuple[Callable[[], None], torch.Tensor]:
    """A closure launching one GEMM kernel through the bare library call (output and workspace
    allocated once, inputs validated once by the caller), for timing without host syncs."""
    from wna16ctl.native import ops as K

    lib = K.cuda_lib()
    a, b_q, scales, zp, g_idx, perm, ids, offs, tw, top_k, bits, k_full = args
    e, k, n, groups = b_q.shape[0], b_q.shape[1] * 16, scales.shape[2], scales.shape[1]
    slots = a.shape[0] * top_k
    c = torch.zeros(slots, n, dtype=a.dtype, device=a.device)
    if kernel in ("v2", "v3"):
        words = ctypes.c_int64(0)
        lib.call(f"wna16_cuda_moe_gemm_{kernel}_workspace", ids.numel(), e, n, k, groups, bits,
                 int(perm is not None), 0, ctypes.byref(words))
        # v3: zeroed once, every call leaves its counters zero again (no reset in the timed region)
        ws = torch.zeros(max(words.value, 1), dtype=torch.int32, device=a.device)
        name, variant = f"wna16_cuda_moe_gemm_{kernel}", 0
    else:
        ws, name, variant = torch.empty(e + 1, dtype=torch.int32, device=a.device), "wna16_cuda_moe_gemm", 2

    def ptr(t):
        return None if t is None else t.data_ptr()

    def call() -> None:
        lib.call(name, ptr(a), ptr(b_q), ptr(scales), ptr(zp), ptr(g_idx), ptr(perm), ptr(ids), ptr(offs), ptr(tw),
                 ptr(c), ptr(ws), slots, ids.numel(), e, n, k, groups, top_k, bits, K.DTYPE_CODES[a.dtype],
                 int(k_full), variant, _stream())
    return call, c


def bench_gemm(report: Report, budget: Budget) -> None:
    """Decode- to prefill-sized MoE GEMM: E 64, K 2048, N 1536 (a w13 projection), top-8, int4 g128,
    bf16; v3, v2 and v1 against one torch bf16 bmm over the active experts' dequantised weights,
    each fast kernel also against the model's expectation."""
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack
    from wna16ctl.layout.packing import pack_codes
    from wna16ctl.native import ops as K

    e, k, n, topk, bits, gs = 64, 2048, 1536, 8, 4, 128
    dtype = torch.bfloat16
    peak = report.get("device", {}).get("peak_gbps") or float("nan")
    q = torch.randint(0, 16, (e, k, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(e, k // gs, n, device="cuda") * 0.02).to(dtype)
    b_q = marlin_repack(pack_codes(q, bits, dim=-2), bits)
    m_scales = marlin_permute_scales(scales, k, n, gs)
    grp = torch.arange(k, device="cuda") // gs
    w_deq = torch.stack([(q[i] - 8).to(dtype) * scales[i][grp] for i in range(e)])  # [E, K, N] bf16
    del q
    rows: list[dict] = []
    report["bench_gemm"] = {"shape": {"experts": e, "k": k, "n": n, "top_k": topk, "bits": bits, "group_size": gs,
                                      "dtype": "bfloat16"}, "rows": rows,
                            "timed": "CUDA events around the bare library call (no host syncs)",
                            "note": "weight_gbps = bytes of the active experts' int4 weights + scales / time; "
                                    "torch baseline = one bmm over the active experts' dequantised bf16 weights "
                                    "(tokens padded per expert), i.e. 4x the int4 bytes"}
    for m in (1, 4, 16, 64, 128, 256, 512):
        if budget.left() < 20:
            report["bench_gemm"]["truncated"] = f"stopped before m = {m} (time budget)"
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
        w_act = w_deq[active].contiguous()
        a_pad = torch.zeros(n_active, max_rows, k, dtype=dtype, device="cuda")
        entry: dict[str, Any] = {"m": m, "active_experts": n_active}
        int_bytes = n_active * (k * n * bits // 8 + (k // gs) * n * 2)
        bf16_bytes = n_active * k * n * 2
        args = (a, b_q, m_scales, None, None, None, sorted_ids, offsets, None, topk, bits, True)
        outs = {}
        for kernel in ("v3", "v2", "v1"):
            call, c = _gemm_call(kernel, args)
            ms = _time_cuda(call, reps=10)
            outs[kernel] = c
            gbps = int_bytes / ms / 1e6
            entry[kernel] = {"ms": round(ms, 4), "weight_gbps": round(gbps, 1), "pct_of_peak": round(100 * gbps / peak, 1)}
        entry["v2_vs_v1_rel_err"] = float(f"{_rel_err(outs['v2'], outs['v1'].float()):.3g}")
        entry["v3_equals_v2"] = bool(torch.equal(outs["v3"], outs["v2"]))
        entry["auto_kernel"] = K.fast_gemm_order("auto", sorted_ids.numel(), e, 0)[0]  # what auto runs here
        ms = _time_cuda(lambda: torch.bmm(a_pad, w_act), reps=10)
        entry["torch_bf16_bmm"] = {"ms": round(ms, 4), "weight_gbps": round(bf16_bytes / ms / 1e6, 1)}
        for kernel in ("v3", "v2", "v1"):
            entry[f"{kernel}_over_bf16"] = round(entry[kernel]["ms"] / ms, 2)
        entry["model"] = model_expectation(report, m)
        entry["model_v3"] = model_expectation(report, m, "v3")
        for kernel, model in (("v2", entry["model"]), ("v3", entry["model_v3"])):
            if "expected_pct_of_peak" in model:
                entry[f"{kernel}_over_model"] = round(entry[kernel]["pct_of_peak"] / model["expected_pct_of_peak"], 2)
        rows.append(entry)
        report.save()


def model_expectation(report: dict, m: int, kernel: str = "v2") -> dict:
    """bench/roofline.py's expected share of the HBM peak for `kernel` (v2 or v3) at this M on this
    device (the checkout's bench/; the recorded sm_90 static figures)."""
    # the checkout's bench/, however deep this module sits in the package
    bench = next((d / "bench" for d in Path(__file__).resolve().parents if (d / "bench" / "roofline.py").is_file()),
                 None)
    if bench is None:
        return {"not_run": "bench/roofline.py not in this checkout"}
    sys.path.insert(0, str(bench))
    try:
        import roofline as R
    finally:
        sys.path.remove(str(bench))
    dev, name = report.get("device", {}), report.get("env", {}).get("device", "")
    gpu = next((g for key, g in R.GPUS.items() if key in name.lower().replace(" ", "")), None)
    if gpu is None or dev.get("sm_count") not in (None, gpu.sms):
        if not dev.get("peak_gbps") or not dev.get("sm_count"):
            return {"not_run": f"no model for {name or 'this device'}"}
        gpu = R.Gpu(name or "this GPU", dev["peak_gbps"] * 1e9, dev["sm_count"], 1.98e9)
    shape = R.Shape()
    recorded = R.RECORDED_SM90_V3 if kernel == "v3" else R.RECORDED_SM90
    e = R.expect(R.pick_instance(list(recorded), shape, m), gpu, shape, m)
    return {"gpu": gpu.name, "instance": e.instance, "expected_pct_of_peak": round(100 * e.fraction, 1),
            "modelled_us": round(e.modelled_us, 1), "limit": e.limit}


def goals(report: Report) -> dict:
    """The performance goals, met or not (None: not measured). The GEMM goals are judged, per row,
    on the kernel the automatic choice runs there (`auto_kernel`: v3, or v2 for the 64-row tile;
    v2 in a report without v3)."""
    br, rows = report.get("bench_repack", {}), report.get("bench_gemm", {}).get("rows", [])
    auto = {r["m"]: r.get("auto_kernel", "v2") if r.get("auto_kernel", "v2") in r else "v2" for r in rows}
    low = [r[auto[r["m"]]]["pct_of_peak"] for r in rows if r["m"] <= 16]
    high = [r[f"{auto[r['m']]}_over_bf16"] for r in rows if r["m"] >= 64]
    def kernels(pick) -> Optional[str]:  # the kernels a goal's rows were judged on
        return "/".join(sorted({k for m, k in auto.items() if pick(m)}, reverse=True)) or None
    out = {
        "repack_pct_of_peak": {"goal": f">= {GOALS['repack_pct_of_peak']}", "plain": br.get("plain", {}).get("pct_of_peak"),
                               "act_order": br.get("act_order", {}).get("pct_of_peak")},
        "gemm_pct_of_peak_m_le_16": {"goal": f">= {GOALS['gemm_pct_of_peak_m_le_16']}",
                                     "kernel": kernels(lambda m: m <= 16), "worst": min(low) if low else None},
        "gemm_vs_bf16_m_ge_64": {"goal": f"<= {GOALS['gemm_vs_bf16_m_ge_64']}x",
                                 "kernel": kernels(lambda m: m >= 64), "worst": max(high) if high else None},
    }
    rp = [v for v in (out["repack_pct_of_peak"]["plain"], out["repack_pct_of_peak"]["act_order"]) if v is not None]
    out["repack_pct_of_peak"]["met"] = min(rp) >= GOALS["repack_pct_of_peak"] if rp else None
    w = out["gemm_pct_of_peak_m_le_16"]["worst"]
    out["gemm_pct_of_peak_m_le_16"]["met"] = None if w is None else w >= GOALS["gemm_pct_of_peak_m_le_16"]
    w = out["gemm_vs_bf16_m_ge_64"]["worst"]
    out["gemm_vs_bf16_m_ge_64"]["met"] = None if w is None else w <= GOALS["gemm_vs_bf16_m_ge_64"]
    return out


# ----------------------------------------------------------------------------------------------
# compute-sanitizer on three tiny cases (each tool in a process of its own)

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
SANITIZER_CASES = [  # (kernel, build_problem arguments)
    ("v3", dict(m=3, n=256, k=320, e=4, topk=2, bits=4, gs=64, zp=True, act=False)),
    ("v2", dict(m=3, n=256, k=320, e=4, topk=2, bits=4, gs=64, zp=True, act=False)),
    ("v2", dict(m=2, n=128, k=192, e=3, topk=2, bits=8, gs=32, zp=False, act=True, k_full=False)),
    ("v1", dict(m=3, n=128, k=128, e=3, topk=2, bits=4, gs=32, zp=True, act=True)),
]


def find_compute_sanitizer() -> Optional[str]:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    from wna16ctl.native import ops as K

    nvcc = K.find_nvcc()
    for d in ([Path(nvcc).parent] if nvcc else []) + [Path("/usr/local/cuda/bin")]:
        if (d / "compute-sanitizer").is_file():
            return str(d / "compute-sanitizer")
    return None


def sanitizer_cases() -> int:
    """The four tiny cases, each checked against the fp32 reference (run inside compute-sanitizer).
    Few blocks (v3 and v2: one tile cut between blocks) so that the tools see the inter-block
    paths."""
    if not torch.cuda.is_available():
        print("sanitizer cases: not run: no GPU (torch sees no CUDA device)")
        return 2
    from wna16ctl.native import ops as K  # registers torch.ops.wna16ctl.*

    if K.cuda_lib() is None:
        print("sanitizer cases: not run: the CUDA kernel library is not available (nvcc, the build)")
        return 2
    bad = 0
    for kernel, case in SANITIZER_CASES:
        prob = build_problem(**case, seed=7)
        _use_kernel(kernel)
        got = torch.ops.wna16ctl.moe_wna16_gemm(*prob["args"])
        torch.cuda.synchronize()
        err = _rel_err(got, prob["expected"])
        print(f"case {kernel} {case}: rel err {err:.3g}")
        bad += not err < TOL[prob["dtype"]]
    _default_kernel()
    return 1 if bad else 0


def step_sanitizer(report: Report, budget: Budget) -> Optional[bool]:
    tool_path = find_compute_sanitizer()
    if tool_path is None:
        report["sanitizer"] = {"skipped": "compute-sanitizer not found (PATH, next to nvcc, /usr/local/cuda/bin)"}
        return None
    results: dict[str, Any] = {"tool": tool_path, "cases": [c for c, _ in SANITIZER_CASES]}
    report["sanitizer"] = results
    ok = True
    ran_any = False
    for tool in SANITIZER_TOOLS:
        if budget.left() < 50:
            results[tool] = {"skipped": "no time left"}
            continue
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "66", "--kernel-name", "kns=wna16",
               sys.executable, "-m", "wna16ctl.native.gpucheck", "--sanitizer-cases"]
        t0 = _now()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(20.0, min(90.0, budget.left() - 40)))
            if proc.returncode and re.search(r"(?i)unrecognized|unknown option|invalid.*kernel-name", proc.stderr):
                # a tool without kernel filters: check every kernel (slower, same verdict)
                cmd = [c for c in cmd if c not in ("--kernel-name", "kns=wna16")]
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=max(20.0, min(90.0, budget.left() - 40)))
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
            refused = SANITIZER_REFUSED.search(proc.stdout + proc.stderr)
            if proc.returncode and refused:
                line = next((ln for ln in tail if SANITIZER_REFUSED.search(ln)), refused.group(0)).strip("= ")
                results[tool] = {"not_run": f"compute-sanitizer refused the device: {line}",
                                 "returncode": proc.returncode, "seconds": round(_now() - t0, 1), "tail": tail}
                report.save()
                continue
            harness = next((ln for ln in tail if "sanitizer cases: not run:" in ln), None)
            if proc.returncode == 2 and harness:  # the cases could not start: says nothing about the kernels
                results[tool] = {"not_run": harness.split("not run:", 1)[1].strip(), "returncode": 2, "tail": tail}
                report.save()
                continue
            passed = proc.returncode == 0
            results[tool] = {"ok": passed, "returncode": proc.returncode, "seconds": round(_now() - t0, 1), "tail": tail}
        except subprocess.TimeoutExpired:
            passed = False
            results[tool] = {"ok": False, "error": "timed out", "seconds": round(_now() - t0, 1)}
        ran_any = True
        ok &= passed
        report.save()
    if not ran_any:
        reasons = {results[t].get("not_run") or results[t].get("skipped") for t in SANITIZER_TOOLS if t in results}
        results["not_run"] = "; ".join(sorted(r for r in reasons if r))
        return None
    return ok


def step_vllm_plugin(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    """The vLLM load format's check (wna16ctl/integrations/plugin_check.py), run as its own process
    (it starts vLLM twice); its JSON goes into the report as `vllm_plugin`."""
    if budget.left() < 60:
        report["vllm_plugin"] = {"not_run": "no time left"}
        return None
    out = Path(str(report.path) + ".vllm_plugin.json") if isinstance(report, Report) else repo / "vllm_plugin.json"
    cmd = [sys.executable, "-m", "wna16ctl.integrations.plugin_check", "--out", str(out),
           "--budget", str(int(budget.left() - 20))]
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=max(30.0, budget.left() - 10))
        result = json.loads(out.read_text())
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        report["vllm_plugin"] = {"ok": False, "error": f"the check did not finish ({type(exc).__name__})"}
        return False
    report["vllm_plugin"] = result
    if result.get("not_run"):
        return None
    if proc.returncode not in (0, 1):
        result.setdefault("error", f"exit {proc.returncode}")
    return bool(result.get("ok"))


# the test files whose `gpu` tests the pytest step runs (tests/native/test_gpucheck.py checks
# that every tests/ path this module names exists)
GPU_TEST_FILES = ("tests/native/test_kernels.py", "tests/native/test_gemm_v2.py")


def step_pytest(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        report["pytest_gpu"] = {"skipped": "pytest not importable"}
        return None
    missing = [p for p in GPU_TEST_FILES if not (repo / p).is_file()]
    if missing or budget.left() < 45:
        report["pytest_gpu"] = {"skipped": f"{', '.join(missing)} not in this checkout" if missing else "no time left"}
        return None
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           *GPU_TEST_FILES]
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
                 for v in ("v3", "v2", "v1")}
        v3_cases = [c["v3_vs_v2"] for c in gch["cases"] if "v3_vs_v2" in c]
        lines.append(f"  GEMM vs fp32 reference: {'ok' if gch['ok'] else 'FAILED'} ({len(gch['cases'])} cases, "
                     f"worst rel err v3 {worst['v3']}, v2 {worst['v2']}, v1 {worst['v1']}; v3 == v2 bit for bit "
                     f"in {sum(c['bit_equal'] for c in v3_cases)} of {len(v3_cases)}, "
                     f"{sum(c['v3_ran'] for c in v3_cases)} run by v3 itself)")
    if "sanitizer" in report:
        san = report["sanitizer"]

        def tool_state(t: str) -> str:
            d = san[t]
            if d.get("not_run"):
                return "not run"
            return d.get("skipped") or ("ok" if d.get("ok") else "FAILED")
        state = san.get("skipped") or (f"not run ({san['not_run']})" if san.get("not_run") else ", ".join(
            f"{t} {tool_state(t)}" for t in SANITIZER_TOOLS if t in san))
        lines.append(f"  compute-sanitizer: {state}")
    if "vllm_plugin" in report:
        v = report["vllm_plugin"]
        if v.get("not_run"):
            state = f"not run ({v['not_run']})"
        elif "same_tokens" in v:
            state = (f"{'ok' if v['ok'] else 'FAILED'} (vLLM {v.get('vllm')}, greedy tokens "
                     f"{'equal' if v['same_tokens'] else 'DIFFER'}, max logprob diff {v['max_logprob_diff']:.3g} "
                     f"over {v['logprobs_compared']})")
        else:
            state = f"FAILED ({v.get('error')})"
        lines.append(f"  --load-format wna16ctl vs default load: {state}")
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
        parts = []
        for kernel, model in (("v3", row.get("model_v3", {})), ("v2", row.get("model", {}))):
            if kernel not in row:
                continue
            expected = (f", model {model['expected_pct_of_peak']}% ({model['limit']})"
                        if "expected_pct_of_peak" in model else "")
            parts.append(f"{kernel} {row[kernel]['ms']} ms ({row[kernel]['weight_gbps']} GB/s, "
                         f"{row[kernel]['pct_of_peak']}% of peak{expected}, / bf16 = {row.get(f'{kernel}_over_bf16')})")
        same = "" if "v3_equals_v2" not in row else f", v3 == v2 {'yes' if row['v3_equals_v2'] else 'NO'}"
        lines.append(f"  GEMM m={row['m']:>3}: " + "; ".join(parts) + f"; v1 {row['v1']['ms']} ms "
                     f"(/ bf16 = {row.get('v1_over_bf16')}); torch bf16 {row['torch_bf16_bmm']['ms']} ms{same}")
    for name, g in report.get("goals", {}).items():
        state = "not measured" if g.get("met") is None else ("met" if g["met"] else "NOT met")
        lines.append(f"  goal {name} {g['goal']}" + (f" ({g['kernel']})" if g.get("kernel") else "") + f": {state}")
    return "\n".join(lines)


def run(out: Path, budget_s: float, gemm_count: int, with_pytest: bool, with_sanitizer: bool = True,
        build_only: bool = False, with_vllm_plugin: bool = True) -> int:
    budget = Budget(budget_s, REPORT_RESERVE_S)
    report = Report(out)
    report.update(status="running", started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), steps_done=[])
    repo = Path(__file__).resolve().parents[2]

    def finish(status: str, reason: Optional[str] = None, code: int = 0) -> int:
        report["status"] = status
        if reason:
            report["reason"] = reason
        report["seconds"] = round(_now() - budget.start, 1)
        report.save()
        print(summary(report))
        print(f"  report: {out}")
        return code

    def stopped(signum, frame) -> None:  # the time limit of gpu_check.sh: keep what was measured
        finish("stopped", f"terminated by signal {signum} during {report.get('step', '?')}: partial report", 1)
        os._exit(1)

    def spent(signum, frame) -> None:  # the checks' share of the budget is over
        raise BudgetSpent()

    def step(name: str) -> None:
        if report.get("step"):
            report["steps_done"].append(report["step"])
        report["step"] = name
        report.save()

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        step("env")
        reason = step_env(report)
        if reason:
            return finish("not-run", reason, 2)
        step("build")
        reason = step_build(report)
        if reason:
            return finish("not-run", reason, 2)
        if build_only:
            return finish("built")
        # the budget covers the checks: it starts now, after the (cached) build, and a timer
        # stops them REPORT_RESERVE_S before its end
        budget = Budget(budget_s, REPORT_RESERVE_S)
        report["budget"] = {"seconds": budget_s, "report_reserve": REPORT_RESERVE_S,
                            "build_seconds_outside": report["build"].get("seconds")}
        signal.signal(signal.SIGALRM, spent)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, budget.left()))
        step("repack_checks")
        ok = step_repack(report, budget)
        step("gemm_checks")
        ok &= step_gemm(report, budget, gemm_count)
        for name, fn in (("bench_repack", lambda: bench_repack(report)),
                         ("bench_gemm", lambda: bench_gemm(report, budget))):
            if budget.left() > 30:
                step(name)
                fn()
            else:
                report[name] = {"skipped": "no time left"}
        report["goals"] = goals(report)
        if with_vllm_plugin:
            step("vllm_plugin")
            ok &= step_vllm_plugin(report, budget, repo) is not False
        if with_sanitizer:
            step("sanitizer")
            ok &= step_sanitizer(report, budget) is not False
        if with_pytest:
            step("pytest_gpu")
            ok &= step_pytest(report, budget, repo) is not False
        step("done")
    except BudgetSpent:
        return finish("stopped", f"the checks' budget ({budget_s:g} s less {REPORT_RESERVE_S:g} s for the report) "
                      f"ran out during {report.get('step', '?')}: the steps after it did not run", 1)
    except Exception as exc:  # keep whatever was measured
        report["exception"] = traceback.format_exc()[-4000:]
        return finish("error", f"{type(exc).__name__}: {exc}"[:300], 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, previous)
    return finish("passed" if ok else "failed", None if ok else "see the failing cases", 0 if ok else 1)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wna16ctl.native.gpucheck", description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the checks after the build (default {DEFAULT_BUDGET_S:g}; they stop "
                             f"{REPORT_RESERVE_S:g} s before it ends to write the report)")
    parser.add_argument("--build-only", action="store_true", help="build (or find cached) the CUDA library and stop")
    parser.add_argument("--gemm-cases", type=int, default=24, help="GEMM grid cases to run (default 24)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the test-suite's gpu tests")
    parser.add_argument("--no-sanitizer", action="store_true", help="skip the compute-sanitizer runs")
    parser.add_argument("--no-vllm-plugin", action="store_true",
                        help="skip --load-format wna16ctl against vLLM's default load (needs vLLM)")
    parser.add_argument("--sanitizer-cases", action="store_true", help=argparse.SUPPRESS)  # run inside the tool
    args = parser.parse_args(argv)
    if args.sanitizer_cases:
        return sanitizer_cases()
    return run(args.out, args.budget, args.gemm_cases, not args.no_pytest, not args.no_sanitizer, args.build_only,
               not args.no_vllm_plugin)


if __name__ == "__main__":
    sys.exit(main())
