"""`inspect --tp 8 --json` on a Kimi-K2-sized header set (61 layers, 384 experts, H 7168, I 2048,
int4 g32, ~208k tensors in 60 sparse shards).  Prints a markdown row: median wall, min, max,
peak RSS.

    python bench/bench_inspect.py [--runs 7] [--dir /tmp/wna16ctl-kimi-headers]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_headers  # noqa: E402
from common import med, median_runs, wna16ctl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers"))
    ap.add_argument("--linear-dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers-linear"))
    a = ap.parse_args()
    if not (a.dir / "config.json").exists():
        synthetic_headers.write(a.dir)
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
