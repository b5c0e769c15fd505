"""`inspect --tp 8 --json` on a Kimi-K2-sized header set (61 layers, 384 experts, H 7168, I 2048,
int4 g32, ~208k tensors in 60 sparse shards).  Prints a markdown row: median wall, min, max,
peak RSS.

    python bench/bench_inspect.py [--runs 7] [--dir /tmp/wna16ctl-kimi-headers]

`--vs-bare N` instead times `inspect --tp 8 --json` against a bare Python read of the same
headers (bench/bare_header_read.py: json.loads of the index and of every shard header, nothing
checked) in N alternating pairs, and prints the median of the per-pair ratios of wall and of CPU
time (user + system of the process and its worker), and both peak RSS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_headers  # noqa: E402
from common import med, median_runs, run_once, wna16ctl  # noqa: E402


def vs_bare(d: Path, pairs: int) -> None:
    inspect = wna16ctl("inspect", str(d), "--tp", "8", "--json")
    bare = [sys.executable, str(Path(__file__).resolve().parent / "bare_header_read.py"), str(d)]
    load = os.getloadavg()[0]
    runs: dict[str, list] = {"inspect": [], "bare": []}
    for i in range(pairs + 1):  # the first pair is a warm-up (page cache, bytecode)
        order = (("inspect", inspect), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("inspect", inspect))
        for name, cmd in order:
            r = run_once(cmd)
            if i:
                runs[name].append(r)
        load = max(load, os.getloadavg()[0])
    ins, ref = runs["inspect"], runs["bare"]
    wall = [a.wall / b.wall for a, b in zip(ins, ref)]
    cpu = [a.cpu / b.cpu for a, b in zip(ins, ref)]
    print(f"inspect --tp 8 --json against a bare header read, {pairs} alternating pairs, load average up to {load:.1f}")
    print()
    print("| | inspect | bare read | inspect / bare, median of pairs (min–max) |")
    print("|---|---|---|---|")
    print(f"| wall | {med([r.wall for r in ins]):.2f} s | {med([r.wall for r in ref]):.2f} s | "
          f"**{med(wall):.2f}** ({min(wall):.2f}–{max(wall):.2f}) |")
    print(f"| CPU (user + system) | {med([r.cpu for r in ins]):.2f} s | {med([r.cpu for r in ref]):.2f} s | "
          f"**{med(cpu):.2f}** ({min(cpu):.2f}–{max(cpu):.2f}) |")
    print(f"| peak RSS | {max(r.max_rss_kib for r in ins) / 1024:.0f} MiB | {max(r.max_rss_kib for r in ref) / 1024:.0f} MiB | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers"))
    ap.add_argument("--linear-dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers-linear"))
    ap.add_argument("--vs-bare", type=int, metavar="PAIRS", help="alternating pairs against a bare header read")
    a = ap.parse_args()
    if not (a.dir / "config.json").exists():
        synthetic_headers.write(a.dir)
    if a.vs_bare:
        vs_bare(a.dir, a.vs_bare)
        return
    if not (a.linear_dir / "config.json").exists():
        synthetic_headers.write(a.linear_dir, quantize_linear=True)
    print("| benchmark | median wall | min | max | peak RSS |")
    print("|---|---|---|---|---|")
    for label, d in (("experts quantized", a.dir), ("experts + attention/dense/shared quantized (366 linear layers)",
                                                     a.linear_dir)):
        runs = median_runs(wna16ctl("inspect", str(d), "--tp", "8", "--json"), a.runs)
        walls = [r.wall for r in runs]
        print(f"| inspect --tp 8 --json, Kimi-K2-sized headers (208k tensors, 60 shards), {label} | {med(walls):.3f} s | "
              f"{min(walls):.3f} s | {max(walls):.3f} s | {max(r.max_rss_kib for r in runs) / 1024:.0f} MiB |")


if __name__ == "__main__":
    main()
