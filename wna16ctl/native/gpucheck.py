"""One unattended GPU check: build the kernels, check them against the CPU path, benchmark them.

    python -m wna16ctl.native.gpucheck [--out FILE] [--budget SECONDS | --deadline EPOCH_SECONDS]
                                       [--vllm-moe-lib PATH] [--no-pytest] [--no-sanitizer] [--no-vllm-plugin]
    python -m wna16ctl.native.gpucheck --build-only

Builds the CUDA library first (cached: a second run finds it), outside the time budget; the
budget (default 480 s, or what is left until --deadline: scripts/gpu_check.sh passes the end of
its 480 s less its hard stop's margin) then covers the checks, which stop REPORT_RESERVE_S before
it ends so that the report is always written. Needs nothing prepared but a python with torch (CUDA
build) and nvcc. Writes one JSON file ($OUT/gpu_check.json when $OUT is set, else
./gpu_check.json) and rewrites it after every step and case (atomically), and each step's own
file (gpu_check.steps/NN-STEP.json) whole as soon as that step ends, so a time limit, a hung
kernel or a machine taken back leaves what was measured; prints a short summary with every step
passed, failed, cut or not run (and why: without a GPU every step is "not run: no GPU"). Exit
status: 0 all checks passed, 1 a check failed or a step of the first five groups was cut or found
no time left (or the run was stopped), 2 the check could not run (no GPU / torch without CUDA /
build failure).

The steps, in run order (STEP_GROUPS: the most valuable figures first), each with a time budget
(STEP_TIME_S: the time it needs left to start -- else "not run: no time left" --, and at most
takes -- past it, it is stopped and "cut", never passed):
1. correctness and the product flow:
   * repack, scale and zero-point permutation: CUDA == torch CPU path bit for bit (4/8 bit, with
     and without act-order);
   * MoE GEMM, the fast kernels (v3 -- falling back to v2 where it declines --, v2) and the
     simple reference kernel (v1, mma.sync): against an fp32 reference from the logical
     (unpacked, unpermuted) dequantised weights and against each other (v3 equal to v2 bit for
     bit), over a seeded subsample of m ∈ {1,7,16,64,123,512}, n, k, e, top-k, 4/8 bit, group
     size -1/32/128, zero points, act-order (full and partial K); plus a few small cases against
     the CPU op;
   * the product: demo -> repack --device cuda (equal to --device cpu) -> verify --e2e;
2. the repack kernel against 70 % of HBM: the device copy ceiling, then the repack kernel's
   bandwidth (benchmarks: wna16ctl/native/gputiming.py, GPU time with the L2 flushed and the
   launch hidden, median of 15);
3. the M = 1 step sweep (STEP_SWEEP_ROWS): v3, v2, vLLM's Marlin and a torch bf16 bmm at M = 1 on
   DeepSeek-V3 w13 at TP 8 and the two sweep shapes that hold the streaming and vary the
   reduction's steps;
4. GEMM v3 and v2 against Marlin: vLLM's compiled Marlin MoE GEMM on our layout against the same
   fp32 reference (wna16ctl/native/vllm_marlin.py; an installed vLLM's library or
   --vllm-moe-lib), then the other rows of the three model shapes at M 1-1024, each with its
   share of the peak and of the copy ceiling, / Marlin, / bf16 and measured / bench/roofline.py's
   model; the goals (repack >= 70% of peak, the automatic kernel >= 50% at m <= 16 and within
   1.5x of bf16 at m >= 64) are reported as met or not, apart from the pass/fail of the checks;
5. compute-sanitizer memcheck, racecheck and synccheck on four tiny GEMM cases, when installed; a
   tool that refuses the device is "not run" with its reason, never a failure;
then, with the time left: `repack --tp 2 --device cpu` and `--device cuda` of one synthetic
checkpoint (wall time), the test-suite's `gpu` tests (GPU_TEST_FILES) when pytest is importable,
the vLLM load format `wna16ctl` (wna16ctl/integrations/plugin_check.py) against vLLM's default
load and engine start-up ("not run" with the reason without vLLM).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
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
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch

if TYPE_CHECKING:
    from wna16ctl.native.build import NativeLib

TOL = {torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}  # of max |ref|; output rounding dominates
GOALS = {"repack_pct_of_peak": 70.0, "gemm_pct_of_peak_m_le_16": 50.0, "gemm_vs_bf16_m_ge_64": 1.5}
DEFAULT_BUDGET_S = 480.0
REPORT_RESERVE_S = 10.0  # the checks stop this long before the budget ends: the report is written
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
        write_json(self.path, self)


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, whole or not at all: a temporary file renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


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

    def share(self, cap: Optional[float]) -> Budget:
        """One step's budget: at most `cap` seconds (None: no cap) of what is left."""
        left = max(0.0, self.left())
        return Budget(left if cap is None else min(cap, left))


class BudgetSpent(BaseException):
    """A step reached the end of its budget, or the checks the end of theirs (the report reserve
    is what remains). Not an Exception: the steps' `except Exception` around one case or kernel
    must not take it for that case's fault."""


# ----------------------------------------------------------------------------------------------
# problems


def build_problem(*, m: int, n: int, k: int, e: int, topk: int, bits: int, gs: int, zp: bool,
                  act: bool, k_full: bool = True, dtype=torch.bfloat16, seed: int = 0,
                  device: str = "cuda", router: bool = True) -> dict:
    """Random logical weights, their fp32 reference output and the Marlin-layout inputs."""
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack, marlin_zero_points, sort_g_idx
    from wna16ctl.layout.packing import dequantize, pack_codes

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
        grp = g_idx[ex] if g_idx is not None else cast(torch.Tensor, grp_default)  # set whenever g_idx is None
        w = dequantize(q[ex], scales[ex], grp, bits, dtype, zeros[ex] if zeros is not None else None)
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
    # the op's argument order: the required ones, then the optional ones
    args = (a, b_q, m_scales, sorted_ids, offsets, topk, bits, m_zeros, sorted_g, perm, tw, k_full)
    return {"args": args, "expected": expected, "dtype": dtype, "q": q, "scales": scales, "zeros": zeros,
            "g_idx": g_idx, "topk_ids": top}


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    denom = float(expected.abs().max())
    return float((got.float() - expected).abs().max()) / (denom if denom else 1.0)


def gemm_cases(seed: int, count: int) -> list[dict[str, Any]]:
    """A seeded subsample of the §9.4-style grid that still covers every feature."""
    rng = random.Random(seed)
    grid: list[dict[str, Any]] = []
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
    chosen: list[dict[str, Any]] = []
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
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    report["env"] = env
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
        if budget.left() < 3:  # a case takes well under a second on a GPU
            report["gemm_checks_truncated"] = f"stopped after {i} of {len(cases)} cases (time budget)"
            break
        prob = build_problem(**case, seed=i)
        entry: dict[str, Any] = {key: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                                 for key, v in case.items()}
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
    small_cases: list[dict[str, Any]] = [
        dict(m=5, n=192, k=256, e=4, topk=2, bits=4, gs=64, zp=True, act=False),
        dict(m=7, n=128, k=512, e=4, topk=3, bits=8, gs=128, zp=False, act=True),
        dict(m=3, n=256, k=256, e=3, topk=2, bits=4, gs=32, zp=False, act=True, k_full=False, dtype=torch.float16)]
    for j, case in enumerate(small_cases):
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


def _clock(report: dict):
    from wna16ctl.native import gputiming

    return gputiming.CudaClock(report.get("device", {}).get("l2_bytes") or (64 << 20))


def bench_copy(report: Report) -> None:
    """The device-to-device copy bandwidth: the ceiling the kernels' bandwidths are also stated
    against (beside the datasheet peak)."""
    from wna16ctl.native import gputiming

    report["copy_ceiling"] = gputiming.copy_ceiling(_clock(report))


def bench_repack(report: Report) -> None:
    """The bare launcher in the timed region (the torch op validates perm on the host first)."""
    from wna16ctl.native import gputiming

    lib = _loaded_cuda_lib()
    clock = _clock(report)
    e, k, n, bits = 16, 7168, 4096, 4
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, k // 8, n), dtype=torch.int32, device="cuda")
    perm = torch.stack([torch.randperm(k, device="cuda") for _ in range(e)]).to(torch.int32)
    out_t = torch.empty(e, k // 16, n * 16 // 8, dtype=torch.int32, device="cuda")
    peak = report.get("device", {}).get("peak_gbps")
    copy = report.get("copy_ceiling", {}).get("gbps")
    out: dict[str, Any] = {"timed": TIMED}
    for name, p in (("plain", None), ("act_order", perm)):
        def call(p=p) -> None:
            lib.call("wna16_cuda_marlin_repack", packed.data_ptr(), None if p is None else p.data_ptr(),
                     out_t.data_ptr(), e, k, n, bits, _stream())
        t = gputiming.time_calls(call, clock)
        moved = 2 * packed.numel() * 4 + (p.numel() * 4 if p is not None else 0)  # read + write
        s = gputiming.shares(moved, t["ms"], peak, copy)
        out[name] = {"ms": round(t["ms"], 4), "gbps_read_write": s["gbps"], "pct_of_peak": s["pct_of_peak"],
                     "pct_of_copy": s["pct_of_copy"]}
    out["shape"] = {"experts": e, "k": k, "n": n, "bits": bits, "packed_mb": round(packed.numel() * 4 / 1e6, 1)}
    report["bench_repack"] = out


def _loaded_cuda_lib() -> NativeLib:
    """The CUDA kernel library, which the steps after step_build run only once it has loaded."""
    from wna16ctl.native import ops as K

    lib = K.cuda_lib()
    if lib is None:
        raise RuntimeError("the CUDA kernel library is not loaded (step_build did not pass)")
    return lib


def _gemm_call(kernel: str, args: tuple) -> tuple[Callable[[], None], torch.Tensor]:
    """A closure launching one GEMM kernel through the bare library call (output and workspace
    allocated once, inputs validated once by the caller), for timing without host syncs."""
    from wna16ctl.native import ops as K

    lib = _loaded_cuda_lib()
    a, b_q, scales, ids, offs, top_k, bits, zp, g_idx, perm, tw, k_full = args
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


TIMED = ("GPU time: CUDA events around the bare call, the L2 flushed before each call (outside the events), "
         "a sleep kernel queued before the start event (launch latency hidden), median of 15 "
         "(wna16ctl/native/gputiming.py)")
# the benchmark's MoE shapes: (name, experts, size_k, size_n, bits, group size, M values); top-8, bf16
BENCH_M = (1, 4, 16, 64, 256, 1024)
BENCH_SHAPES = (
    ("Qwen3-30B-A3B w13", 128, 2048, 1536, 4, 128, BENCH_M),
    ("Qwen3-30B-A3B w2", 128, 768, 2048, 4, 128, BENCH_M),
    ("DeepSeek-V3 w13 at TP 8", 256, 7168, 512, 4, 128, BENCH_M),
    ("Qwen3-30B-A3B w13 int8 channel-wise", 128, 2048, 1536, 8, -1, (16,)),
    # with DeepSeek-V3 w13 at TP 8 (K x N = 7168 x 512), a sweep at M = 1 that keeps each block's
    # streaming the same while the blocks sharing an output tile change (v3: 17 / 9 / 5 parts;
    # Marlin: 12 / 7 / 4 slices): the per-step cost of each kernel's cross-block reduction, measured
    # (bench/roofline.py STEP_SWEEP)
    ("reduction-step sweep E 256, K 3584, N 1024", 256, 3584, 1024, 4, 128, (1,)),
    ("reduction-step sweep E 256, K 1792, N 2048", 256, 1792, 2048, 4, 128, (1,)),
)
BENCH_TOP_K = 8
# the M = 1 step sweep's rows (shape, m) of BENCH_SHAPES: a step of its own, ahead of the other
# GEMM rows (it settles the fitted model's two M = 1 rows)
STEP_SWEEP_ROWS = frozenset({("DeepSeek-V3 w13 at TP 8", 1), ("reduction-step sweep E 256, K 3584, N 1024", 1),
                             ("reduction-step sweep E 256, K 1792, N 2048", 1)})


# where the benchmark and the Marlin check put their tensors (tests/native/test_gpucheck.py runs
# their plumbing on the CPU with stand-ins for the kernels)
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _routing(m: int, e: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [m, topk] (distinct experts per token), our sorted slots and expert offsets."""
    g = torch.Generator().manual_seed(seed)
    top = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).to(DEVICE)
    flat = top.reshape(-1)
    sorted_ids = torch.argsort(flat, stable=True).to(torch.int32)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=DEVICE)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=e), 0)
    return top, sorted_ids, offsets


def bench_gemm(report: Report, budget: Budget, marlin_op: Any = None, *, key: str = "bench_gemm",
               only: Optional[frozenset] = None, skip: frozenset = frozenset()) -> None:
    """v3, v2, vLLM's Marlin (when its library loaded) and a torch bf16 bmm over the active experts'
    dequantised weights, on the model shapes of BENCH_SHAPES at M = 1 ... 1024, top-8: the rows
    (shape, m) in `only` (default all) and not in `skip`, into report[key]."""
    from wna16ctl.layout.marlin import marlin_permute_scales, marlin_repack
    from wna16ctl.layout.packing import dequantize, pack_codes
    from wna16ctl.native import gputiming, vllm_marlin
    from wna16ctl.native import ops as K

    dtype = torch.bfloat16
    clock = _clock(report)
    peak = report.get("device", {}).get("peak_gbps")
    copy = report.get("copy_ceiling", {}).get("gbps")
    rows: list[dict] = []
    report[key] = {"rows": rows, "timed": TIMED, "top_k": BENCH_TOP_K, "dtype": "bfloat16",
                   "marlin": "vLLM moe_wna16_marlin_gemm" if marlin_op is not None else None,
                   "note": "gbps = bytes of the active experts' quantised weights + scales / time; "
                           "the torch baseline is one bmm over the active experts' dequantised bf16 "
                           "weights (tokens padded per expert), i.e. 4x (int4) the bytes"}
    for shape_name, e, k, n, bits, gs, all_ms in BENCH_SHAPES:
        ms = [m for m in all_ms if (only is None or (shape_name, m) in only) and (shape_name, m) not in skip]
        if not ms:
            continue
        if budget.left() < 8:  # a shape's weights are drawn and repacked on the GPU first
            report[key]["truncated"] = f"stopped before {shape_name} (time budget)"
            break
        groups = 1 if gs == -1 else k // gs
        q = torch.randint(0, 1 << bits, (e, k, n), dtype=torch.int32, device=DEVICE)
        scales = (torch.rand(e, groups, n, device=DEVICE) * 0.02 + 1e-3).to(dtype)
        b_q = marlin_repack(pack_codes(q, bits, dim=-2), bits)
        m_scales = marlin_permute_scales(scales, k, n, gs)
        grp = torch.arange(k, device=DEVICE) // (k // groups)
        w_deq = torch.stack([dequantize(q[i], scales[i], grp, bits, dtype) for i in range(e)])
        del q
        workspace = vllm_marlin.new_workspace(torch.device(DEVICE)) if marlin_op is not None else None
        for m in ms:
            if budget.left() < 3:
                report[key]["truncated"] = f"stopped at {shape_name} m = {m} (time budget)"
                break
            top, sorted_ids, offsets = _routing(m, e, BENCH_TOP_K, seed=m + e)
            counts = torch.bincount(top.reshape(-1), minlength=e)
            active = torch.nonzero(counts).flatten()
            n_active, max_rows = int(active.numel()), int(counts.max())
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=DEVICE, dtype=dtype)
            entry: dict[str, Any] = {"shape": shape_name, "experts": e, "k": k, "n": n, "bits": bits,
                                     "group_size": gs, "m": m, "active_experts": n_active}
            q_bytes = n_active * (k * n * bits // 8 + groups * n * 2)
            args = (a, b_q, m_scales, sorted_ids, offsets, BENCH_TOP_K, bits, None, None, None, None, True)
            outs = {}
            calls = {kernel: _gemm_call(kernel, args) for kernel in ("v3", "v2")}
            if marlin_op is not None and workspace is not None:
                margs = vllm_marlin.call_args(a=a, b_q=b_q, scales=m_scales, zero_points=None, topk_ids=top,
                                              topk_weights=None, bits=bits, workspace=workspace,
                                              out=torch.empty(m * BENCH_TOP_K, n, dtype=dtype, device=DEVICE))
                why = vllm_marlin.schema_mismatch(marlin_op.default._schema, margs)
                if why:
                    entry["marlin"] = {"not_run": why}
                else:
                    values = [v for _, v in margs]
                    calls["marlin"] = (functools.partial(marlin_op, *values), values[1])
            for kernel, (call, c) in calls.items():
                try:
                    t = gputiming.time_calls(call, clock)
                except Exception as exc:  # one kernel refusing a shape must not hide the others
                    entry[kernel] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
                outs[kernel] = c
                s = gputiming.shares(q_bytes, t["ms"], peak, copy)
                entry[kernel] = {"ms": round(t["ms"], 4), "weight_gbps": s["gbps"], "pct_of_peak": s["pct_of_peak"],
                                 "pct_of_copy": s["pct_of_copy"]}
            w_act = w_deq[active].contiguous()
            a_pad = torch.zeros(n_active, max_rows, k, dtype=dtype, device=DEVICE)
            t = gputiming.time_calls(lambda: torch.bmm(a_pad, w_act), clock)
            bf = gputiming.shares(n_active * k * n * 2, t["ms"], peak, copy)
            entry["torch_bf16_bmm"] = {"ms": round(t["ms"], 4), "weight_gbps": bf["gbps"],
                                       "pct_of_copy": bf["pct_of_copy"]}
            for kernel in ("v3", "v2", "marlin"):
                if "ms" in entry.get(kernel, {}):
                    entry[f"{kernel}_over_bf16"] = round(entry[kernel]["ms"] / t["ms"], 2)
                    if kernel != "marlin" and "ms" in entry.get("marlin", {}):
                        entry[f"{kernel}_over_marlin"] = round(entry[kernel]["ms"] / entry["marlin"]["ms"], 2)
            if "v3" in outs and "v2" in outs:
                entry["v3_equals_v2"] = bool(torch.equal(outs["v3"], outs["v2"]))
            if "v3" in outs and "marlin" in outs:
                entry["marlin_vs_v3_rel_err"] = float(f"{_rel_err(outs['marlin'], outs['v3'].float()):.3g}")
            entry["auto_kernel"] = K.fast_gemm_order("auto", sorted_ids.numel(), e, 0)[0]  # what auto runs here
            entry["measured_over_fitted_model"] = fitted_model_ratios(entry, report.get("env", {}).get("device", ""))
            if bits == 4:
                model_shape = {"experts": e, "size_k": k, "size_n": n, "top_k": BENCH_TOP_K, "group_size": gs}
                entry["model"] = model_expectation(report, m, "v2", model_shape)
                entry["model_v3"] = model_expectation(report, m, "v3", model_shape)
                for kernel, model in (("v2", entry["model"]), ("v3", entry["model_v3"])):
                    if "expected_pct_of_peak" in model and entry.get(kernel, {}).get("pct_of_peak"):
                        entry[f"{kernel}_over_model"] = round(entry[kernel]["pct_of_peak"] /
                                                              model["expected_pct_of_peak"], 2)
            rows.append(entry)
            report.save()
        del w_deq, b_q


def _roofline() -> Any:
    """The checkout's bench/roofline.py as a module, or None where this is not a checkout."""
    # the checkout's bench/, however deep this module sits in the package
    bench = next((d / "bench" for d in Path(__file__).resolve().parents if (d / "bench" / "roofline.py").is_file()),
                 None)
    if bench is None:
        return None
    sys.path.insert(0, str(bench))
    try:
        # found on the path just set: not a module of the package
        R = importlib.import_module("roofline")
    finally:
        sys.path.remove(str(bench))
    return R


def fitted_model_ratios(entry: dict, device_name: str) -> dict:
    """measured / the fitted model (bench/roofline.py, fitted on H200 rows) for v3 and vLLM's Marlin
    on this benchmark row: 1.0 is as modelled, > 1 slower. The fit holds for an H200 alone."""
    R = _roofline()
    if R is None:
        return {"not_run": "bench/roofline.py not in this checkout"}
    if "h200" not in device_name.lower().replace(" ", ""):
        return {"not_run": f"the fitted model is fitted on an H200, not {device_name or 'this device'}"}
    shape = R.MoeShape(entry["shape"], entry["experts"], entry["k"], entry["n"], top_k=BENCH_TOP_K,
                       num_bits=entry["bits"], group_size=entry["group_size"])
    out: dict[str, Any] = {}
    for kernel in ("v3", "marlin"):
        if "ms" in entry.get(kernel, {}):
            try:
                out[kernel] = round(R.measured_over_model(kernel, shape, entry["m"], entry[kernel]["ms"] * 1e3), 2)
            except Exception as exc:  # a shape the model does not cover
                out[kernel] = {"not_run": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def model_expectation(report: dict, m: int, kernel: str = "v2", shape: Optional[dict] = None) -> dict:
    """bench/roofline.py's expected share of the HBM peak for `kernel` (v2 or v3) at this M on this
    device (the checkout's bench/; the recorded sm_90 static figures), on `shape` (Shape's fields;
    default its bench shape). Superseded by the fitted model (fitted_model_ratios) where that applies."""
    R = _roofline()
    if R is None:
        return {"not_run": "bench/roofline.py not in this checkout"}
    dev, name = report.get("device", {}), report.get("env", {}).get("device", "")
    gpu = next((g for key, g in R.GPUS.items() if key in name.lower().replace(" ", "")), None)
    if gpu is None or dev.get("sm_count") not in (None, gpu.sms):
        if not dev.get("peak_gbps") or not dev.get("sm_count"):
            return {"not_run": f"no model for {name or 'this device'}"}
        gpu = R.Gpu(name or "this GPU", dev["peak_gbps"] * 1e9, dev["sm_count"], 1.98e9)
    model_shape = R.Shape(**shape) if shape else R.Shape()
    recorded = R.RECORDED_SM90_V3 if kernel == "v3" else R.RECORDED_SM90
    try:
        e = R.expect(R.pick_instance(list(recorded), model_shape, m), gpu, model_shape, m)
    except Exception as exc:  # a shape the model does not cover
        return {"not_run": f"the model does not cover this row ({type(exc).__name__}: {exc})"[:200]}
    return {"gpu": gpu.name, "instance": e.instance, "expected_pct_of_peak": round(100 * e.fraction, 1),
            "modelled_us": round(e.modelled_us, 1), "limit": e.limit}


# vLLM's Marlin MoE kernel on our layout against the fp32 reference: (bits, zero points, group size)
MARLIN_CHECK_CASES = [(bits, zp, gs) for bits in (4, 8) for zp in (False, True) for gs in (32, 128, -1)]
MARLIN_CHECK_SHAPE: dict[str, Any] = dict(n=512, k=1024, e=8, topk=2)


def step_vllm_marlin_check(report: Report, budget: Budget, op: Any, why: str) -> Optional[bool]:
    """The layout proof: vLLM's compiled Marlin MoE GEMM, given the weights, scales and zero points
    that wna16ctl.layout.marlin writes, matches the fp32 reference from the logical codes."""
    from wna16ctl.native import vllm_marlin

    if op is None:
        report["vllm_marlin_check"] = {"not_run": why}
        return None
    results: list[dict] = []
    report["vllm_marlin_check"] = {"library": why, "cases": results}
    workspace = vllm_marlin.new_workspace(torch.device(DEVICE))
    ok, ran = True, 0
    for i, (bits, zp, gs) in enumerate(MARLIN_CHECK_CASES):
        for m in (1, 33):
            entry: dict[str, Any] = {"bits": bits, "zero_points": zp, "group_size": gs, "m": m}
            results.append(entry)
            if vllm_marlin.weight_type_id(bits, zp) is None:
                entry["not_run"] = f"vLLM's Marlin MoE has no {bits}-bit type with zero points"
                continue
            if budget.left() < 2:
                entry["not_run"] = "no time left"
                continue
            prob = build_problem(m=m, bits=bits, gs=gs, zp=zp, act=False, seed=500 + i, device=DEVICE,
                                 **MARLIN_CHECK_SHAPE)
            a, b_q, m_scales, *_ = prob["args"]
            m_zeros, tw = prob["args"][7], prob["args"][10]
            args = vllm_marlin.call_args(a=a, b_q=b_q, scales=m_scales, zero_points=m_zeros, topk_ids=prob["topk_ids"],
                                         topk_weights=tw.reshape(m, -1), bits=bits, workspace=workspace)
            mismatch = vllm_marlin.schema_mismatch(op.default._schema, args)
            if mismatch:  # the library takes other arguments: a check that cannot run, not a layout fault
                entry["not_run"] = mismatch
                continue
            try:
                got = op(*(value for _, value in args))
                _sync()
            except Exception as exc:
                entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                ok, ran = False, ran + 1
                continue
            err = _rel_err(got, prob["expected"])
            entry.update(rel_err=float(f"{err:.3g}"), ok=err < TOL[prob["dtype"]])
            ok &= entry["ok"]
            ran += 1
        report.save()
    report["vllm_marlin_check"]["ok"] = ok
    if not ran:
        report["vllm_marlin_check"]["not_run"] = "no case ran"
        return None
    return ok


# ----------------------------------------------------------------------------------------------
# the product on this GPU: demo -> repack --device cuda (and cpu, timed on the same checkpoint) ->
# verify --e2e

PRODUCT_TP = 2
# the synthetic checkpoint both repacks time: two Qwen3-30B-A3B-shaped layers (128 experts, hidden
# 2048, intermediate 768; about 0.6 GiB)
TIMING_CHECKPOINT = {"layers": 2}


def _missing_dependency(run: dict) -> Optional[str]:
    """The reason a CLI run could not start for a module this python lacks (the CLI's own
    dependencies are not gpu_check's), or None."""
    line = next((ln for ln in run.get("tail", []) if "ModuleNotFoundError" in ln), None)
    return f"the CLI cannot start here: {line.strip()}" if line and not run.get("ok") else None


def _cli(args: list[str], timeout: float, cwd: Path) -> dict:
    t0 = _now()
    try:
        proc = subprocess.run([sys.executable, "-m", "wna16ctl", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=max(5.0, timeout))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "command": "wna16ctl " + " ".join(args)}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "seconds": round(_now() - t0, 2),
            "command": "wna16ctl " + " ".join(args), "tail": tail}


def _manifest_files(run: dict) -> Optional[dict]:
    """The output files' digests from the manifest a `repack` run printed ("manifest: PATH")."""
    path = next((ln.split(":", 1)[1].strip() for ln in run.get("tail", []) if ln.startswith("manifest: ")), None)
    try:
        files = json.loads(Path(path).read_text())["files"] if path else None
    except (OSError, ValueError, KeyError):
        return None
    if not isinstance(files, dict):
        return None
    return {rel: {k: v for k, v in f.items() if k != "bytes"} for rel, f in files.items()}


def step_product(report: Report, budget: Budget, repo: Path, device: str = "cuda") -> Optional[bool]:
    """The CLI as a user runs it on a GPU machine, each step passed / failed / not run (`device`:
    what the GPU steps pass to --device; the CPU tests of this step pass cpu)."""
    import importlib.util
    import tempfile

    steps: dict[str, dict] = {}
    report["product"] = steps
    work = Path(tempfile.mkdtemp(prefix="wna16ctl-gpu-check-"))
    ckpt, cuda_out, cpu_out = work / "demo", work / f"tp{PRODUCT_TP}-cuda", work / f"tp{PRODUCT_TP}-cpu"
    ok = True
    try:
        steps["demo"] = _cli(["demo", str(ckpt), "--force"], min(90.0, budget.left() - 3), repo)
        missing = _missing_dependency(steps["demo"])
        if missing:
            steps["demo"] = {"not_run": missing}
            return None
        if not steps["demo"]["ok"]:
            return False
        for name, dev, out in (("repack_cuda", device, cuda_out), ("repack_cpu", "cpu", cpu_out)):
            steps[name] = _cli(["repack", str(ckpt), "--tp", str(PRODUCT_TP), "-o", str(out), "--device", dev,
                                "--force", "-q"], min(90.0, budget.left() - 3), repo)
            ok &= steps[name]["ok"]
            report.save()
        if steps["repack_cuda"]["ok"] and steps["repack_cpu"]["ok"]:
            on_gpu, on_cpu = _manifest_files(steps["repack_cuda"]), _manifest_files(steps["repack_cpu"])
            steps["cuda_equals_cpu"] = {"ok": bool(on_cpu) and on_gpu == on_cpu,
                                        "what": "every output file's digest, --device cuda against --device cpu"}
            ok &= steps["cuda_equals_cpu"]["ok"]
        if not steps["repack_cuda"]["ok"]:
            steps["verify_e2e"] = {"not_run": "repack --device cuda failed"}
        elif importlib.util.find_spec("transformers") is None:
            steps["verify"] = _cli(["verify", str(ckpt), str(cuda_out), "--device", device],
                                   min(90.0, budget.left() - 3), repo)
            ok &= steps["verify"]["ok"]
            steps["verify_e2e"] = {"not_run": "transformers is not importable (wna16ctl[e2e])"}
        elif budget.left() < 30:
            steps["verify_e2e"] = {"not_run": "no time left"}
        else:
            steps["verify_e2e"] = _cli(["verify", str(ckpt), str(cuda_out), "--device", device, "--e2e"],
                                       min(150.0, budget.left() - 3), repo)
            ok &= steps["verify_e2e"]["ok"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ok


def step_repack_timing(report: Report, budget: Budget, repo: Path, device: str = "cuda") -> Optional[bool]:
    """`repack --tp 2` of one synthetic Qwen3-30B-A3B-shaped checkpoint with --device cpu and
    --device cuda, alternated, wall time of the whole command each (what `--device auto` choosing
    the CPU rests on)."""
    import tempfile

    bench = repo / "bench" / "synthetic_checkpoint.py"
    if not bench.is_file():
        report["repack_timing"] = {"not_run": "bench/synthetic_checkpoint.py not in this checkout"}
        return None
    # the system's temporary directory, not the report's: a run stopped here must not leave a
    # checkpoint among the files that come back with the report
    work = Path(tempfile.mkdtemp(prefix="wna16ctl-gpu-check-"))
    try:
        return _time_repack_devices(report, budget, work, repo, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _time_repack_devices(report: Report, budget: Budget, work: Path, repo: Path, device: str) -> Optional[bool]:
    sys.path.insert(0, str(repo / "bench"))
    try:
        # found on the path just set: not a module of the package
        synthetic_checkpoint = importlib.import_module("synthetic_checkpoint")
    except ImportError as exc:  # safetensors missing from this python
        report["repack_timing"] = {"not_run": f"bench/synthetic_checkpoint.py cannot run here: {exc}"}
        return None
    finally:
        sys.path.remove(str(repo / "bench"))
    ckpt = work / "synthetic"
    t0 = _now()
    synthetic_checkpoint.write(ckpt, **TIMING_CHECKPOINT)
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    timing: dict[str, Any] = {"checkpoint": f"synthetic {TIMING_CHECKPOINT}",
                              "bytes": size, "written_in_s": round(_now() - t0, 1), "cpu": [], device: []}
    report["repack_timing"] = timing
    ok = True
    for _ in range(2):
        for dev in ("cpu", device):
            if budget.left() < 15:
                timing["truncated"] = "no time left"
                break
            run = _cli(["repack", str(ckpt), "--tp", str(PRODUCT_TP), "-o", str(work / f"timed-{dev}"), "--device",
                        dev, "--force", "-q"], min(120.0, budget.left() - 3), repo)
            missing = _missing_dependency(run)
            if missing:
                report["repack_timing"] = {"not_run": missing}
                return None
            ok &= run["ok"]
            timing[dev].append(run["seconds"] if run["ok"] else run)
            report.save()
    cpu = [t for t in timing["cpu"] if isinstance(t, float)]
    cuda = [t for t in timing.get(device, []) if isinstance(t, float)]
    if cpu and cuda:
        timing["cuda_over_cpu"] = round(min(cuda) / min(cpu), 2)  # best of each
    timing["ok"] = ok
    return ok


def gemm_rows(report: dict) -> list[dict]:
    """The GEMM benchmark's rows: the M = 1 step sweep's, then the others'."""
    return [row for key in ("bench_step_sweep", "bench_gemm") for row in report.get(key, {}).get("rows", [])]


def goals(report: Report) -> dict:
    """The performance goals, met or not (None: not measured). The GEMM goals are judged, per row,
    on the kernel the automatic choice runs there (`auto_kernel`: v3, or v2 for the 64-row tile;
    v2 in a report without v3)."""
    br, rows = report.get("bench_repack", {}), gemm_rows(report)
    def auto(r: dict) -> str:  # the kernel the automatic choice runs on this row
        kernel = r.get("auto_kernel", "v2")
        return kernel if kernel in r else "v2"
    low = [v for r in rows if r["m"] <= 16 and (v := r.get(auto(r), {}).get("pct_of_peak")) is not None]
    high = [v for r in rows if r["m"] >= 64 and (v := r.get(f"{auto(r)}_over_bf16")) is not None]

    def kernels(pick) -> Optional[str]:  # the kernels a goal's rows were judged on
        return "/".join(sorted({auto(r) for r in rows if pick(r["m"])}, reverse=True)) or None
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
SANITIZER_CASES: list[tuple[str, dict[str, Any]]] = [  # (kernel, build_problem arguments)
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
        if budget.left() < 25:  # a python with torch and the four cases under the tool
            results[tool] = {"skipped": "no time left"}
            continue
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "66", "--kernel-name", "kns=wna16",
               sys.executable, "-m", "wna16ctl.native.gpucheck", "--sanitizer-cases"]
        t0 = _now()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(15.0, min(90.0, budget.left() - 3)))
            if proc.returncode and re.search(r"(?i)unrecognized|unknown option|invalid.*kernel-name", proc.stderr):
                # a tool without kernel filters: check every kernel (slower, same verdict)
                cmd = [c for c in cmd if c not in ("--kernel-name", "kns=wna16")]
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=max(15.0, min(90.0, budget.left() - 3)))
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


def _run_writing_json(cmd: list[str], out: Path, repo: Path,
                      budget: Budget) -> tuple[subprocess.CompletedProcess, dict] | str:
    """Run a tool that writes its result to `out` as JSON, within the budget: its process and the
    JSON, or the name of what stopped it (a timeout, no file, no JSON)."""
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=max(30.0, budget.left() - 10))
        return proc, json.loads(out.read_text())
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        return type(exc).__name__


def step_vllm_plugin(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    """The vLLM load format's check (wna16ctl/integrations/plugin_check.py), run as its own process
    (it starts vLLM twice); its JSON goes into the report as `vllm_plugin`."""
    if budget.left() < 60:
        report["vllm_plugin"] = {"not_run": "no time left"}
        return None
    out = Path(str(report.path) + ".vllm_plugin.json") if isinstance(report, Report) else repo / "vllm_plugin.json"
    cmd = [sys.executable, "-m", "wna16ctl.integrations.plugin_check", "--out", str(out),
           "--budget", str(int(budget.left() - 20))]
    ran = _run_writing_json(cmd, out, repo, budget)
    if isinstance(ran, str):
        report["vllm_plugin"] = {"ok": False, "error": f"the check did not finish ({ran})"}
        return False
    proc, result = ran
    report["vllm_plugin"] = result
    if result.get("not_run"):
        return None
    if proc.returncode not in (0, 1):
        result.setdefault("error", f"exit {proc.returncode}")
    return bool(result.get("ok"))


# bench/bench_engine_load.py --device cuda: one start of each load format (the checkpoint is small
# so that two vLLM starts fit the budget); exit 2 and {"status": "not-run"} without a CUDA vLLM
ENGINE_LOAD_ARGS = ("--device", "cuda", "--rounds", "1", "--layers", "1")


def step_engine_load(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    """Engine start-up with a normal load against `sharded_state` of `repack --layout vllm`, as its
    own process; its JSON goes into the report as `engine_load`. A run that could not start vLLM is
    "not run" with the bench's reason, never a pass."""
    out = Path(str(report.path) + ".engine_load.json") if isinstance(report, Report) else repo / "engine_load.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(repo / "bench" / "bench_engine_load.py"), *ENGINE_LOAD_ARGS, "--json", str(out),
           "--timeout", str(max(30, int(budget.left() - 30)))]
    ran = _run_writing_json(cmd, out, repo, budget)
    if isinstance(ran, str):
        report["engine_load"] = {"ok": False, "error": f"the benchmark did not finish ({ran})"}
        return False
    proc, result = ran
    if proc.returncode == 2 or result.get("status") == "not-run":
        report["engine_load"] = {"not_run": result.get("reason") or "the benchmark gave no reason"}
        return None
    report["engine_load"] = result
    if proc.returncode != 0:
        result.setdefault("error", result.get("reason") or f"exit {proc.returncode}")
        return False
    if not result.get("same_first_token", False):  # both formats must serve the same model
        result["error"] = "the first greedy token differs between the load formats"
        return False
    return True


# the test files whose `gpu` tests the pytest step runs (tests/native/test_gpucheck.py checks
# that every tests/ path this module names exists)
GPU_TEST_FILES = ("tests/native/test_kernels.py", "tests/native/test_gemm_v2.py")


def step_pytest(report: dict, budget: Budget, repo: Path) -> Optional[bool]:
    try:
        import pytest  # noqa: F401 - only whether pytest can be imported
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
    if "cases" in report.get("repack_checks", {}):
        r = report["repack_checks"]
        lines.append(f"  repack/scales/zp bit-exact vs CPU: {'ok' if r['ok'] else 'FAILED'} ({len(r['cases'])} cases)")
    if "cases" in report.get("gemm_checks", {}):
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
    lines += _engine_lines(report)
    if "pytest_gpu" in report:
        p = report["pytest_gpu"]
        state = (p.get("skipped") or (f"not run ({p['not_run']})" if p.get("not_run") else None)
                 or ("ok" if p.get("ok") else ("not run" if p.get("note") else "FAILED")))
        lines.append(f"  pytest -m gpu: {state}")
    if "vllm_marlin_check" in report:
        v = report["vllm_marlin_check"]
        cases = [c for c in v.get("cases", []) if "ok" in c]
        if not cases:
            state = f"not run ({v.get('not_run', 'no case ran')})"
        else:
            worst_err = max((c.get("rel_err", float("inf")) for c in cases), default=None)
            state = (f"{'ok' if all(c['ok'] for c in cases) else 'FAILED'} ({len(cases)} cases, worst rel err "
                     f"{worst_err}; {sum('not_run' in c for c in v['cases'])} not run)")
        lines.append(f"  vLLM Marlin MoE on our layout vs fp32 reference: {state}")
    product = report.get("product", {})
    if isinstance(product.get("not_run"), str):
        product = {"all steps": {"not_run": product["not_run"]}}
    for name, p in product.items():
        if not isinstance(p, dict):  # the step's own error (and its traceback, left to the JSON)
            if name == "error":
                lines.append(f"  product: FAILED ({p})")
            continue
        if p.get("not_run"):
            state = f"not run ({p['not_run']})"
        else:
            state = ("ok" if p.get("ok") else "FAILED") + (f" in {p['seconds']} s" if "seconds" in p else "")
            if not p.get("ok") and (p.get("error") or p.get("tail")):
                state += f" ({p.get('error') or p['tail'][-1][:200]})"
        lines.append(f"  product {name}: {state}")
    rt = report.get("repack_timing", {})
    if rt:
        state = f"not run ({rt['not_run']})" if rt.get("not_run") else (
            f"{rt.get('checkpoint')}, {rt.get('bytes', 0) / 2 ** 30:.2f} GiB, --tp 2: --device cpu {rt.get('cpu')} s, "
            f"--device cuda {rt.get('cuda')} s; cuda / cpu (best of each) {rt.get('cuda_over_cpu')}")
        lines.append(f"  repack wall time: {state}")
    copy = report.get("copy_ceiling", {}).get("gbps")
    if copy:
        lines.append(f"  device-to-device copy: {copy} GB/s (peak {report.get('device', {}).get('peak_gbps')} GB/s)")
    if "plain" in report.get("bench_repack", {}):
        br = report["bench_repack"]
        lines.append(f"  repack {br['shape']['packed_mb']} MB int4: {br['plain']['gbps_read_write']} GB/s "
                     f"({br['plain']['pct_of_peak']}% of peak, {br['plain'].get('pct_of_copy')}% of copy), "
                     f"act-order {br['act_order']['gbps_read_write']} GB/s")
    lines += [_gemm_row_line(row) for row in gemm_rows(report)]
    for name, g in report.get("goals", {}).items():
        state = "not measured" if g.get("met") is None else ("met" if g["met"] else "NOT met")
        lines.append(f"  goal {name} {g['goal']}" + (f" ({g['kernel']})" if g.get("kernel") else "") + f": {state}")
    reasons = {(st["state"], st.get("reason")) for st in report.get("steps", {}).values()}
    if len(reasons) == 1 and len(report["steps"]) > 1:  # one state for all (e.g. no GPU): one line
        state, why = reasons.pop()
        lines.append(f"  steps: all {len(report['steps'])} {state}" + (f" ({why})" if why else ""))
    elif report.get("steps"):
        lines.append("  steps: " + "; ".join(
            f"{name} {st['state']}" + (f" ({st['reason']})" if st.get("reason") else "")
            for name, st in report["steps"].items()))
    return "\n".join(lines)


def _gemm_row_line(row: dict) -> str:
    """One benchmark row: each kernel's time, share of the peak and of the copy, the models, the ratios."""
    parts = []
    models: tuple[tuple[str, dict[str, Any]], ...] = (
        ("v3", row.get("model_v3", {})), ("v2", row.get("model", {})), ("marlin", {}))
    for kernel, model in models:
        k = row.get(kernel, {})
        if "ms" not in k:
            if k:
                parts.append(f"{kernel} {k.get('not_run') or k.get('error')}")
            continue
        expected = (f", model {model['expected_pct_of_peak']}% ({model['limit']}), measured / model "
                    f"{row.get(f'{kernel}_over_model')}" if "expected_pct_of_peak" in model else "")
        fitted = row.get("measured_over_fitted_model", {}).get(kernel)
        if isinstance(fitted, float):
            expected += f", measured / fitted model {fitted}"
        parts.append(f"{kernel} {k['ms'] * 1e3:.1f} us ({k['pct_of_peak']}% of peak, {k.get('pct_of_copy')}% of "
                     f"copy{expected}, / bf16 = {row.get(f'{kernel}_over_bf16')})")
    ratios = ", ".join(f"{kr} / marlin = {row[f'{kr}_over_marlin']}" for kr in ("v3", "v2")
                       if f"{kr}_over_marlin" in row)
    same = "" if "v3_equals_v2" not in row else f"; v3 == v2 {'yes' if row['v3_equals_v2'] else 'NO'}"
    return (f"  GEMM {row.get('shape', '')} m={row['m']:>4}: " + "; ".join(parts)
            + (f"; {ratios}" if ratios else "")
            + f"; torch bf16 {row['torch_bf16_bmm']['ms'] * 1e3:.1f} us{same}")


def _engine_lines(report: dict) -> list[str]:
    """The steps that start vLLM: its load format and the engine start-up comparison."""
    lines: list[str] = []
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
    if "engine_load" in report:
        e = report["engine_load"]
        if e.get("not_run"):
            state = f"not run ({e['not_run']})"
        elif e.get("status") == "measured":
            state = (f"{'ok' if not e.get('error') else 'FAILED (' + e['error'] + ')'} (vLLM {e.get('vllm')}, TP "
                     f"{e.get('tp')}: ready {e['summary']['default']['ready_s']:.1f} s default, "
                     f"{e['summary']['sharded_state']['ready_s']:.1f} s sharded_state, "
                     f"default / sharded_state {e['ready_ratio']:.2f}x)")
        else:
            state = f"FAILED ({e.get('error')})"
        lines.append(f"  engine start-up, default vs sharded_state: {state}")
    return lines


# The steps in run order, grouped by what the run is for, the most valuable figures first: a run
# cut short (the 8 minutes of gpu_check.sh, a lent machine taken back) keeps those.
STEP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the build", ("build",)),
    ("correctness and the product flow", ("repack_checks", "gemm_checks", "product")),
    ("the repack kernel against 70 % of HBM", ("bench_copy", "bench_repack")),
    ("the M = 1 step sweep", ("bench_step_sweep",)),
    ("GEMM v3 and v2 against Marlin", ("vllm_marlin_check", "bench_gemm")),
    ("the sanitizer", ("sanitizer",)),
    ("with the time left", ("repack_timing", "pytest_gpu", "vllm_plugin", "engine_load")),
)
STEPS = tuple(name for _, names in STEP_GROUPS for name in names)
# what a run must have done to the end to pass: a step of these cut or without the time to start
# leaves the run "incomplete" (the last group runs only with the time left)
CORE_STEPS = tuple(name for _, names in STEP_GROUPS[1:-1] for name in names)
# (seconds a step needs left to start, seconds it may take at most; None: what is left). The caps
# of the first five groups add up to 395 s: with the build cached they fit the checks' share of
# gpu_check.sh's 480 s; after a slow build the last of them find no time left and say so.
STEP_TIME_S: dict[str, tuple[float, Optional[float]]] = {
    "repack_checks": (5, 20), "gemm_checks": (15, 45), "product": (45, 90),
    "bench_copy": (5, 10), "bench_repack": (5, 15),
    "bench_step_sweep": (10, 30),
    "vllm_marlin_check": (5, 20), "bench_gemm": (20, 75),
    "sanitizer": (30, 90),
    "repack_timing": (60, 90), "pytest_gpu": (45, 120), "vllm_plugin": (60, None), "engine_load": (120, None),
}
# a step still running this long past its cap is stopped (its own checks of the time end it before)
STEP_GRACE_S = 5.0


def record_step(report: dict, name: str, result: Optional[bool], reason: Optional[str] = None) -> None:
    """The step's state in report["steps"]: passed, failed or not run with the reason (given, or
    what the step wrote into its own entry)."""
    entry: dict[str, Any] = {"state": "passed" if result is True else "failed" if result is False else "not run"}
    if result is None:
        own = report.get(name)
        if not isinstance(own, dict):
            own = {}
        entry["reason"] = reason or own.get("not_run") or own.get("skipped") or "no reason recorded"
    report.setdefault("steps", {})[name] = entry


def record_cut(report: dict, name: str, why: str) -> None:
    """A step stopped before its end: failed if what it measured already failed, else cut (never
    passed); what it measured stays in its entry."""
    own = report.get(name)
    failed = isinstance(own, dict) and own.get("ok") is False
    report.setdefault("steps", {})[name] = {"state": "failed" if failed else "cut",
                                            "reason": f"{why}: what it measured before is kept"}


def steps_dir(out: Path) -> Path:
    """Where each step's own JSON goes as the step ends (gpu_check.json: gpu_check.steps/)."""
    return out.with_name(out.stem + ".steps")


def step_file(out: Path, name: str) -> Path:
    """The step's JSON file, numbered in run order."""
    return steps_dir(out) / f"{STEPS.index(name) + 1:02d}-{name}.json"


def save_step(report: dict, name: str) -> None:
    """The step's state and figures in a file of their own, written whole as soon as the step ends:
    a run cut in a later step (or killed) leaves every earlier step's file complete."""
    if not isinstance(report, Report):
        return
    group = next(g for g, names in STEP_GROUPS if name in names)
    entry = {"step": name, "order": STEPS.index(name) + 1, "group": group, **report["steps"][name],
             "device": report.get("env", {}).get("device"), "result": report.get(name)}
    if name.startswith("bench_") and "goals" in report:
        entry["goals"] = report["goals"]
    write_json(step_file(report.path, name), entry)


def clear_step_files(out: Path) -> None:
    """An earlier run's step files (never mistaken for this run's)."""
    for path in steps_dir(out).glob("[0-9][0-9]-*.json*"):
        path.unlink(missing_ok=True)


def close_unrecorded(report: dict, reason: str) -> None:
    """Every step without a state yet: not run, for `reason`; each gets its file."""
    for name in STEPS:
        if name not in report.get("steps", {}):
            record_step(report, name, None, reason)
            save_step(report, name)


def _load_marlin(path: Optional[str]) -> tuple[Any, str]:
    from wna16ctl.native import vllm_marlin

    return vllm_marlin.load(path)


StepFn = Optional[Callable[[Budget], Optional[bool]]]


def plan_steps(report: Report, repo: Path, gemm_count: int, marlin: tuple[Any, str], with_pytest: bool,
               with_sanitizer: bool, with_vllm_plugin: bool) -> list[tuple[str, StepFn]]:
    """Each step after the build, in STEPS order, as a function of its own budget (None: not asked for)."""
    marlin_op, marlin_why = marlin
    fns: dict[str, StepFn] = {
        "repack_checks": lambda b: step_repack(report, b),
        "gemm_checks": lambda b: step_gemm(report, b, gemm_count),
        "product": lambda b: step_product(report, b, repo),
        "bench_copy": lambda b: bench_copy(report),
        "bench_repack": lambda b: bench_repack(report),
        "bench_step_sweep": lambda b: bench_gemm(report, b, marlin_op, key="bench_step_sweep", only=STEP_SWEEP_ROWS),
        "vllm_marlin_check": lambda b: step_vllm_marlin_check(report, b, marlin_op, marlin_why),
        "bench_gemm": lambda b: bench_gemm(report, b, marlin_op, skip=STEP_SWEEP_ROWS),
        "sanitizer": (lambda b: step_sanitizer(report, b)) if with_sanitizer else None,
        "repack_timing": lambda b: step_repack_timing(report, b, repo),
        "pytest_gpu": (lambda b: step_pytest(report, b, repo)) if with_pytest else None,
        "vllm_plugin": (lambda b: step_vllm_plugin(report, b, repo)) if with_vllm_plugin else None,
        "engine_load": (lambda b: step_engine_load(report, b, repo)) if with_vllm_plugin else None,
    }
    return [(name, fns[name]) for name in STEPS[1:]]


def run_step(report: Report, budget: Budget, name: str, fn: Callable[[Budget], Optional[bool]]) -> Optional[bool]:
    """One step within its share of the budget (STEP_TIME_S[name]'s cap): a timer raises
    BudgetSpent STEP_GRACE_S past it, or at the end of the checks' budget if that comes first."""
    share = budget.share(STEP_TIME_S.get(name, (20.0, None))[1])
    report.setdefault("step_budgets", {})[name] = round(share.seconds, 1)
    signal.setitimer(signal.ITIMER_REAL, max(0.5, min(share.left() + STEP_GRACE_S, budget.left())))
    try:
        return fn(share)
    except Exception as exc:  # one step's fault must not cost the steps after it
        report.setdefault(name, {})
        if isinstance(report[name], dict):
            report[name]["error"] = f"{type(exc).__name__}: {exc}"[:500]
            report[name]["traceback"] = traceback.format_exc()[-3000:]
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_plan(report: Report, budget: Budget, plan: list[tuple[str, StepFn]],
             begin: Callable[[str], None]) -> tuple[bool, bool]:
    """The steps in order, each recorded (and its file written) as it ends: (none failed, a step
    of CORE_STEPS was cut or found no time left)."""
    ok, short = True, False
    for name, fn in plan:
        least = STEP_TIME_S.get(name, (20.0, None))[0]
        if fn is None or budget.left() < least:
            reason = "not asked for (--no-...)" if fn is None else "no time left"
            if fn is not None:
                report.setdefault(name, {"not_run": reason})
                short |= name in CORE_STEPS
            record_step(report, name, None, reason)
            save_step(report, name)
            continue
        begin(name)
        t0 = _now()
        try:
            result = run_step(report, budget, name, fn)
        except BudgetSpent:
            if budget.left() < 1.0:  # the checks' time is over, not only this step's
                record_cut(report, name, "the checks' budget ran out during it")
                save_step(report, name)
                close_unrecorded(report, "no time left")
                raise
            record_cut(report, name, f"ran past its {report['step_budgets'][name]:g} s budget and was stopped")
            short |= report["steps"][name]["state"] == "cut" and name in CORE_STEPS
            ok &= report["steps"][name]["state"] != "failed"
        else:
            if name.startswith("bench_") and result is not False:
                result = True  # a benchmark that returned measured; its figures are judged in goals
            record_step(report, name, result)
            ok &= result is not False
        report["steps"][name].update(seconds=round(_now() - t0, 1), budget_s=report["step_budgets"][name])
        if name in ("bench_repack", "bench_step_sweep", "bench_gemm"):
            report["goals"] = goals(report)
        save_step(report, name)
        report.save()
    return ok, short


def run(out: Path, budget_s: float, gemm_count: int, with_pytest: bool, with_sanitizer: bool = True,
        build_only: bool = False, with_vllm_plugin: bool = True, vllm_moe_lib: Optional[str] = None,
        deadline: Optional[float] = None) -> int:
    """The whole check. The checks' budget is `budget_s` from the end of the build, or, with
    `deadline` (seconds since the epoch: gpu_check.sh passes its start + 480 s less its hard
    stop's margin), what is left until then."""
    budget = Budget(budget_s, REPORT_RESERVE_S)
    report = Report(out)
    clear_step_files(out)
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
        during = report.get("step", "?")
        if during in STEPS and during not in report.get("steps", {}):
            record_cut(report, during, f"stopped by signal {signum}")
            save_step(report, during)
        close_unrecorded(report, f"the run was stopped by signal {signum}")
        finish("stopped", f"terminated by signal {signum} during {during}: partial report", 1)
        os._exit(1)

    def spent(signum, frame) -> None:  # a step's or the checks' share of the budget is over
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
            if not report.get("env", {}).get("cuda_available"):
                reason = f"no GPU: {reason}"
            close_unrecorded(report, reason)
            return finish("not-run", reason, 2)
        step("build")
        reason = step_build(report)
        if reason:
            record_step(report, "build", False)
            save_step(report, "build")
            close_unrecorded(report, f"the build: {reason}")
            return finish("not-run", reason, 2)
        record_step(report, "build", True)
        save_step(report, "build")
        if build_only:
            return finish("built")
        # the budget covers the checks: it starts now, after the (cached) build, and a timer
        # stops them REPORT_RESERVE_S before its end
        if deadline is not None:
            budget_s = deadline - time.time()
        budget = Budget(budget_s, REPORT_RESERVE_S)
        report["budget"] = {"seconds": round(budget_s, 1), "report_reserve": REPORT_RESERVE_S,
                            "build_seconds_outside": report["build"].get("seconds")}
        if deadline is not None:
            report["budget"]["deadline"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(deadline))
        signal.signal(signal.SIGALRM, spent)
        plan = plan_steps(report, repo, gemm_count, _load_marlin(vllm_moe_lib), with_pytest, with_sanitizer,
                          with_vllm_plugin)
        ok, short = run_plan(report, budget, plan, step)
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
    if not ok:
        return finish("failed", "see the failing cases", 1)
    if short:
        return finish("incomplete", "a step of the first five groups was cut or found no time left", 1)
    return finish("passed")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wna16ctl.native.gpucheck", description=__doc__.splitlines()[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the checks after the build (default {DEFAULT_BUDGET_S:g}; they stop "
                             f"{REPORT_RESERVE_S:g} s before it ends to write the report)")
    parser.add_argument("--deadline", type=float, default=None, metavar="EPOCH_SECONDS",
                        help="the checks' budget is what is left until this time (seconds since the epoch; "
                             "gpu_check.sh passes its start + its whole run less the hard stop's margin)")
    parser.add_argument("--build-only", action="store_true", help="build (or find cached) the CUDA library and stop")
    parser.add_argument("--gemm-cases", type=int, default=24, help="GEMM grid cases to run (default 24)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the test-suite's gpu tests")
    parser.add_argument("--no-sanitizer", action="store_true", help="skip the compute-sanitizer runs")
    parser.add_argument("--no-vllm-plugin", action="store_true",
                        help="skip --load-format wna16ctl against vLLM's default load (needs vLLM)")
    parser.add_argument("--vllm-moe-lib", metavar="PATH", default=None,
                        help="vLLM's compiled MoE library (vllm/_moe_C_stable_libtorch.abi3.so from a vLLM wheel, "
                             "or its directory) for the Marlin check and benchmark; default: an installed vLLM's")
    parser.add_argument("--sanitizer-cases", action="store_true", help=argparse.SUPPRESS)  # run inside the tool
    args = parser.parse_args(argv)
    if args.sanitizer_cases:
        return sanitizer_cases()
    return run(args.out, args.budget, args.gemm_cases, not args.no_pytest, not args.no_sanitizer, args.build_only,
               not args.no_vllm_plugin, args.vllm_moe_lib, args.deadline)


if __name__ == "__main__":
    sys.exit(main())
