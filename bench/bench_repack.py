"""`repack` against `cp -r` of the same checkpoint, both ending in `sync`, in one run, and peak RSS.

A random-code Qwen3-30B-A3B-shaped checkpoint (H 2048, I 768, 128 experts, int4 g128) with
`--layers` MoE layers (4 = 1.28 GB) is copied with `cp -r SRC DST` and repacked with
`wna16ctl repack SRC --tp 2 -o OUT -q`; each command is followed by `sync` (timed with it) and
starts from a missing destination (removed, and the removal synced, untimed).  A pair is one of
each, in alternating order (cp first, then repack first, ...) so that drift of a shared machine
hits both alike; after one warm-up pair (page cache) the median of `--pairs` pairs of the ratio
cp / repack is printed with its min-max.  Peak RSS (wait4) is measured at a second size to show it
does not grow with the checkpoint.  A per-tensor micro-benchmark compares `build_rank_tensors`
(the torch data path) with a straightforward per-expert reference.

`--simd avx512,avx2,scalar` (any of the levels of `WNA16CTL_SIMD`) compares the native rank
builder's tile loops instead: each round runs `cp -r` and the repack once per level (each with
`sync`), in an order that alternates round by round, and prints per level the median of the
per-round ratios cp / repack and its peak RSS, then the rank builder alone per level (one thread,
in this process, 8 experts of the same shape, 4-bit and 8-bit).  A level forced on a CPU that has
a better one emulates a CPU that has only that level, as far as the tile loop goes.

    python bench/bench_repack.py [--layers 4] [--small-layers 1] [--pairs 3] [--dir /tmp/wna16ctl-bench]
    python bench/bench_repack.py --simd avx512,avx2,scalar [--layers 4] [--pairs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ENV, Command, alternating_rounds, dir_bytes, med, wna16ctl

HERE = Path(__file__).resolve().parent


def _ckpt(root: Path, layers: int, *, gptq: bool = False) -> Path:
    """The synthetic checkpoint of `layers` layers (`gptq`: written as a GPTQ checkpoint), made once."""
    # Written by a child process: this one stays small (no torch), because a child's peak RSS as
    # wait4 reports it starts from its parent's at the fork.
    path = root / (f"q30-gptq-{layers}l" if gptq else f"q30-{layers}l")
    if not (path / "config.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(path), "--layers", str(layers),
                        *(["--gptq"] if gptq else [])], check=True, stdout=subprocess.DEVNULL)
    return path


def cpu_simd() -> str:
    """The vector instruction sets of this CPU that the tile loops use."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    have = [name for name, flag in (("AVX-512 VBMI", "avx512vbmi"), ("AVX2", "avx2"), ("NEON", "asimd")) if flag in flags]
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return f"{model or 'unknown CPU'}: {', '.join(have) or 'no vector extension the tile loops use'}"


def simd_paths(root: Path, layers: int, pairs: int, tp: int, levels: list[str]) -> list[str]:
    """Markdown rows: per WNA16CTL_SIMD level, cp / repack as the median of per-round ratios."""
    ck = _ckpt(root, layers)
    size = dir_bytes(ck)
    copy = root / "copy"
    cmds: list[Command] = [("cp", ["cp", "-r", str(ck), str(copy)], copy, None)]
    for level in levels:
        out = root / f"out-{level}"
        cmds.append((level, wna16ctl("repack", str(ck), "--tp", str(tp), "-o", str(out), "-q"), out,
                     {**ENV, "WNA16CTL_SIMD": level}))
    runs, load = alternating_rounds(cmds, pairs)
    cp = runs["cp"]
    rows = []
    for level in levels:
        ratios = [c.wall / r.wall for c, r in zip(cp, runs[level])]
        rp = med([r.wall for r in runs[level]])
        rows.append(f"| {level} | {layers} layers, {size / 1e9:.2f} GB, --tp {tp} | {med([c.wall for c in cp]):.2f} s | "
                    f"{rp:.2f} s | **{med(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) | "
                    f"{max(r.max_rss_kib for r in runs[level]) / 1024:.0f} MiB | {load:.1f} |")
    return rows


def rank_builder_levels(levels: list[str], rounds: int = 15) -> list[str]:
    """Markdown rows: the native rank builder alone per level (one thread, in this process),
    8 experts of H 2048 x I 768, rank 0 of --tp 2, bf16 scales g128; the levels alternate."""
    import ctypes
    import statistics

    from wna16ctl.native import build as native, simd

    lib = native.host_lib()
    H, I, E, tp = 2048, 768, 8, 2
    rows = []
    for nb in (4, 8):
        pf = 32 // nb
        keep = []

        def buf(nbytes: int, fill: bool = False):
            b = (ctypes.c_char * nbytes).from_buffer_copy(os.urandom(nbytes)) if fill else (ctypes.c_char * nbytes)()
            keep.append(b)
            return ctypes.addressof(b)

        src = (ctypes.c_void_p * (6 * E))()
        for e in range(E):
            for j, (n, k) in enumerate(((I, H), (I, H), (H, I))):
                src[6 * e + j] = buf(n * k // pf * 4, fill=True)
                src[6 * e + 3 + j] = buf(n * (k // 128) * 2, fill=True)
        ip = I // tp
        w13, w2 = E * H * 2 * ip // pf * 4, E * ip * H // pf * 4
        out = [buf(w13), buf(w2), buf(E * H // 128 * 2 * ip * 2), buf(E * I // 128 * H * 2)]
        times: dict[str, list[float]] = {level: [] for level in levels}
        for _ in range(rounds):
            for level in levels:
                t = time.perf_counter()
                lib.call("wna16_marlin_rank_host", src, E, H, I, tp, 0, nb, 128, 0, 2, 1, 1, *out,
                         simd.LEVELS[level], 1)
                times[level].append(time.perf_counter() - t)
        base = statistics.median(times[levels[-1]])
        for level in levels:
            m = statistics.median(times[level])
            rows.append(f"| {nb}-bit | {level} | {m * 1e3:.2f} ms | {(w13 + w2) / m / 2**20:.0f} MiB/s | "
                        f"{base / m:.2f}× |")
    return rows


def whole_command(root: Path, layers: int, pairs: int, tp: int) -> tuple[str, int]:
    """One markdown row for `layers` layers, and the repack's peak RSS in KiB."""
    ck = _ckpt(root, layers)
    out, copy = root / "out", root / "copy"
    size = dir_bytes(ck)
    # the warm-up pair also builds the native library
    runs, load = alternating_rounds([("cp", ["cp", "-r", str(ck), str(copy)], copy, None),
                                     ("repack", wna16ctl("repack", str(ck), "--tp", str(tp), "-o", str(out), "-q"), out,
                                      None)], pairs)
    cp_runs, rp_runs = runs["cp"], runs["repack"]
    ratios = [c.wall / r.wall for r, c in zip(rp_runs, cp_runs)]
    rp, cp = med([r.wall for r in rp_runs]), med([c.wall for c in cp_runs])
    rss = max(r.max_rss_kib for r in rp_runs)
    return (f"| {layers} layers, {size / 1e9:.2f} GB, --tp {tp} | {cp:.2f} s | {rp:.2f} s | **{med(ratios):.2f}** "
            f"({min(ratios):.2f}–{max(ratios):.2f}) | {size / rp / 2**20:.0f} MiB/s | {rss / 1024:.0f} MiB | {load:.1f} |",
            rss)


def per_tensor(repeats: int = 3) -> list[str]:
    import torch

    from wna16ctl.layout.rank import RankLayout, build_rank_tensors

    H, I, E = 2048, 768, 8
    g = torch.Generator().manual_seed(0)

    def proj(n: int, k: int) -> dict[str, torch.Tensor]:
        return {"weight_packed": torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32),
                "weight_scale": torch.rand(n, k // 128, generator=g).to(torch.bfloat16)}

    experts = [{"gate": proj(I, H), "up": proj(I, H), "down": proj(H, I)} for _ in range(E)]
    spec = RankLayout(layout="marlin", num_bits=4, group_size=128, symmetric=True, act_order=False, hidden_size=H,
                      intermediate_size=I, tp=1, rank=0, load_full_w2=False, padded_intermediate=I)
    nbytes = E * 3 * H * I // 2

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    ours = best(lambda: build_rank_tensors(experts, spec))
    # straightforward per-expert reference: unpack every code, gather through the 1024-entry
    # permutation table, pack again (what the engine's Python test helpers do)
    perm = _weight_perm_4bit()

    def marlin_naive(kfirst: torch.Tensor) -> torch.Tensor:
        K, N = kfirst.shape[0] * 8, kfirst.shape[1]
        q = torch.stack([(kfirst >> (4 * i)) & 15 for i in range(8)], dim=1).reshape(K, N)
        q = q.reshape(K // 16, 16, N // 16, 16).permute(0, 2, 1, 3).reshape(K // 16, N * 16)
        q = q.reshape(-1, 1024)[:, perm].reshape(K // 16, N * 16 // 8, 8)
        out = torch.zeros(q.shape[:2], dtype=torch.int32)
        for i in range(8):
            out |= (q[..., i] << (4 * i)).to(torch.int32)
        return out

    def naive() -> None:
        for ex in experts:
            w13 = torch.cat([ex["gate"]["weight_packed"], ex["up"]["weight_packed"]]).T.contiguous()
            marlin_naive(w13)
            marlin_naive(ex["down"]["weight_packed"].T.contiguous())

    ref = best(naive)
    return [f"| build_rank_tensors, {E} experts of H 2048 × I 768 int4 (Marlin) | {nbytes / ours / 2**20:.0f} MiB/s | "
            f"{nbytes / ref / 2**20:.0f} MiB/s | {ref / ours:.1f}× |"]


def _weight_perm_4bit():  # -> torch.Tensor
    """Appendix A of the spec: 4-bit Marlin permutation of one 16x64 tile (1024 entries)."""
    import torch

    perm = []
    for t in range(32):
        r, col = 2 * (t % 4), t // 4
        base = [16 * row + col + 8 * blk for blk in (0, 1) for row in (r, r + 1, r + 8, r + 9)]
        for w in range(4):
            perm.extend(b + 256 * w for b in base)
    perm_t = torch.tensor(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
    return perm_t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--small-layers", type=int, default=1, help="second size for the RSS comparison")
    ap.add_argument("--pairs", type=int, default=3, help="timed cp / repack pairs per size (after one warm-up)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    ap.add_argument("--no-per-tensor", action="store_true", help="skip the per-tensor micro-benchmark")
    ap.add_argument("--simd", help="compare these WNA16CTL_SIMD levels (comma-separated, e.g. avx512,avx2,scalar)")
    ap.add_argument("--rank-builder-only", action="store_true", help="with --simd: only the rank builder alone")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.simd:
        levels = [x.strip() for x in a.simd.split(",") if x.strip()]
        print(f"{os.cpu_count()} CPUs; {cpu_simd()}; load average {os.getloadavg()[0]:.1f}")
        if not a.rank_builder_only:
            print(f"cp -r SRC DST && sync  vs  WNA16CTL_SIMD=LEVEL wna16ctl repack SRC --tp {a.tp} -o OUT -q && sync; "
                  f"median of {a.pairs} alternating rounds")
            print()
            print("| WNA16CTL_SIMD | checkpoint | cp -r + sync | repack + sync | cp / repack (min–max) | repack peak RSS "
                  "| load average |")
            print("|---|---|---|---|---|---|---|")
            for row in simd_paths(a.dir, a.layers, a.pairs, a.tp, levels):
                print(row, flush=True)
        print()
        print(f"| rank builder alone | WNA16CTL_SIMD | median | output | speed-up over {levels[-1]} |")
        print("|---|---|---|---|---|")
        for row in rank_builder_levels(levels):
            print(row)
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
        return
    print(f"{os.cpu_count()} CPUs; cp -r SRC DST && sync  vs  wna16ctl repack SRC --tp {a.tp} -o OUT -q && sync; "
          f"median of {a.pairs} alternating pairs")
    print()
    print("| checkpoint | cp -r + sync | repack + sync | cp / repack (min–max) | repack throughput | repack peak RSS | load average |")
    print("|---|---|---|---|---|---|---|")
    rss = {}
    for layers in (a.small_layers, a.layers):
        row, rss[layers] = whole_command(a.dir, layers, a.pairs, a.tp)
        print(row, flush=True)
    small, large = rss[a.small_layers], rss[a.layers]
    print(f"\npeak RSS {small / 1024:.0f} MiB at {a.small_layers} layers, {large / 1024:.0f} MiB at {a.layers}: "
          f"{'flat' if large <= small * 1.1 + 32 * 1024 else 'GROWS with the checkpoint'}; "
          f"{'within' if large <= 2 * 2**20 else 'ABOVE'} 2 GiB")
    if a.no_per_tensor:
        return
    print()
    print("| per tensor | wna16ctl | per-expert reference | speed-up |")
    print("|---|---|---|---|")
    for row in per_tensor():
        print(row)


if __name__ == "__main__":
    main()
