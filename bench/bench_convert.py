"""`convert` of a GPTQ checkpoint against `cp -r` of the same checkpoint, both ending in `sync`, in one run.

The random-code Qwen3-30B-A3B-shaped checkpoint of the repack benchmark (H 2048, I 768, 128
experts, int4 g128; `--layers` MoE layers, 4 = 1.3 GB) written as a GPTQ checkpoint
(`synthetic_checkpoint.py --gptq`: GPTQModel's v1 storage, sym, no act-order, float16 scales) is
copied with `cp -r SRC DST` and converted with `wna16ctl convert SRC -o OUT -q`; each command is
followed by `sync` (timed with it) and starts from a missing destination.  A round is one of each,
in alternating order; after one warm-up round (page cache) the medians of wall, CPU (user + sys)
and peak RSS (wait4) of `--pairs` rounds are printed, and the median of the per-round ratios
cp / convert (speed against speed: 1 = as fast as `cp -r`) with its min-max.

    python bench/bench_convert.py [--layers 4] [--pairs 3] [--dir /tmp/wna16ctl-bench]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_repack import _ckpt, cpu_simd
from common import Command, alternating_rounds, dir_bytes, med, wna16ctl


def rounds(root: Path, layers: int, pairs: int) -> str:
    ck = _ckpt(root, layers, gptq=True)
    copy, out = root / "copy", root / "converted"
    cmds: list[Command] = [("cp", ["cp", "-r", str(ck), str(copy)], copy, None),
                           ("convert", wna16ctl("convert", str(ck), "-o", str(out), "-q"), out, None)]
    runs, load = alternating_rounds(cmds, pairs)
    ratios = [c.wall / v.wall for c, v in zip(runs["cp"], runs["convert"])]
    fig = lambda name, key: med([getattr(r, key) for r in runs[name]])  # noqa: E731 - a one-line accessor beside its data
    return (f"| {layers} layers, {dir_bytes(ck) / 1e9:.2f} GB | {fig('cp', 'wall'):.2f} s, {fig('cp', 'cpu'):.2f} s CPU, "
            f"{fig('cp', 'max_rss_kib') / 1024:.0f} MiB | {fig('convert', 'wall'):.2f} s, {fig('convert', 'cpu'):.2f} s CPU, "
            f"{fig('convert', 'max_rss_kib') / 1024:.0f} MiB | **{med(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) "
            f"| {load:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_simd()}; {os.cpu_count()} CPUs; command: wna16ctl convert SRC -o OUT -q")
    print("| GPTQ checkpoint | cp -r SRC + sync: wall, CPU, peak RSS | convert + sync: wall, CPU, peak RSS "
          "| cp / convert (median, min–max) | load avg |")
    print("|---|---|---|---|---|")
    print(rounds(args.dir, args.layers, args.pairs), flush=True)


if __name__ == "__main__":
    main()
