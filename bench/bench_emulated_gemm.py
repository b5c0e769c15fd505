"""The MoE GEMM of one demo-sized MoE block through the kernel source on the CPU emulation
(wna16ctl/native/emulated.py), against the torch twin of the kernel in the same run.

    python bench/bench_emulated_gemm.py [--tokens 16,128,512] [--runs 3]

Shape: hidden 128, intermediate 64 per rank (the test demos at TP 2), 4 experts, top-2, 4-bit,
group 32, bf16; w13 ([T·2, 128] × [128, 128]) then w2 ([T·2, 64] × [64, 128]), as verify runs them.
Prints per token count: median seconds per launch of each, their ratio, the process's peak RSS
and the CPU's SIMD level.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.native.test_kernels import make_problem
from wna16ctl.native import emulated


def simd_level() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0] if Path("/proc/cpuinfo").exists() else ""
    return next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sse4_2", "SSE4.2")) if flag in flags),
                "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="16,128,512")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if emulated.emulated_gemm_lib() is None:
        raise SystemExit(f"emulated kernels unavailable: {emulated.emulated_unavailable_reason()}")
    print(f"CPU SIMD: {simd_level()}, {len(__import__('os').sched_getaffinity(0))} cores visible")
    print("| tokens | GEMM | emulated s/launch | torch twin s/launch | ratio |")
    print("|---|---|---|---|---|")
    for t in map(int, a.tokens.split(",")):
        for name, k, n in (("w13", 128, 128), ("w2", 64, 128)):
            prob = make_problem(size_k=k, size_n=n, group_size=32, experts=4, m=t, top_k=2)
            args = prob["args"]
            x, b_q, scales, ids, offs, top_k, bits, zp, g_idx, perm, tw, k_full = args
            times = {"emu": [], "torch": []}
            for _ in range(a.runs):
                t0 = time.perf_counter()
                emulated.emulated_moe_gemm(x, b_q, scales, ids, offs, top_k=top_k, num_bits=bits, zero_points=zp,
                                           topk_weights=tw)
                times["emu"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                torch.ops.wna16ctl.moe_wna16_gemm(*args)
                times["torch"].append(time.perf_counter() - t0)
            e, w = statistics.median(times["emu"]), statistics.median(times["torch"])
            print(f"| {t} | {name} | {e:.3f} | {w:.4f} | {e / w:.0f}× |", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
