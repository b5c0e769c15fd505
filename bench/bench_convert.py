"""`convert` of a GPTQ checkpoint against `cp -r` of the same checkpoint, both ending in `sync`, in one run.

The random-code Qwen3-30B-A3B-shaped checkpoint of the repack benchmark (H 2048, I 768, 128
experts, int4 g128; `--layers` MoE layers, 4 = 1.3 GB) written as a GPTQ checkpoint
(`synthetic_checkpoint.py --gptq`: GPTQModel's v1 storage, sym, no act-order, float16 scales) is
copied with `cp -r SRC DST` and converted with `wna16ctl convert SRC -o OUT -q`; each command is
followed by `sync` (timed with it) and starts from a missing destination.  A round is one of each,
in alternating order; after one warm-up round (page cache) the medians of wall, CPU (user + sys)
and peak RSS (wait4) of `--pairs` rounds are printed, and the median of the per-round ratios
cp / convert (speed against speed: 1 = as fast as `cp -r`) with its min-max.  `--baseline SRC_TREE`
adds a third command to every round: the convert of another checkout of wna16ctl (its root put
first on PYTHONPATH), e.g. the previous version, so that both are measured under the same load.

    python bench/bench_convert.py [--layers 4] [--pairs 3] [--dir /tmp/wna16ctl-bench] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_repack import _ckpt, cpu_simd
from common import ENV, Command, alternating_rounds, dir_bytes, med, wna16ctl


def rounds(root: Path, layers: int, pairs: int, baseline: Path | None = None) -> list[str]:
    ck = _ckpt(root, layers, gptq=True)
    copy, out = root / "copy", root / "converted"
    cmds: list[Command] = [("cp", ["cp", "-r", str(ck), str(copy)], copy, None),
                           ("convert", wna16ctl("convert", str(ck), "-o", str(out), "-q"), out, None)]
    if baseline is not None:  # another checkout's convert, its root first on PYTHONPATH
        cmds.append(("baseline", [sys.executable, "-m", "wna16ctl", "convert", str(ck), "-o", str(root / "baseline"), "-q"],
                     root / "baseline", {**ENV, "PYTHONPATH": str(baseline.resolve())}))
    runs, load = alternating_rounds(cmds, pairs)
    fig = lambda name, key: med([getattr(r, key) for r in runs[name]])  # noqa: E731 - a one-line accessor beside its data
    lines = []
    for name, *_ in cmds[1:]:
        ratios = [c.wall / v.wall for c, v in zip(runs["cp"], runs[name])]
        lines.append(f"| {name}: {layers} layers, {dir_bytes(ck) / 1e9:.2f} GB | {fig('cp', 'wall'):.2f} s, "
                     f"{fig('cp', 'cpu'):.2f} s CPU, {fig('cp', 'max_rss_kib') / 1024:.0f} MiB | {fig(name, 'wall'):.2f} s, "
                     f"{fig(name, 'cpu'):.2f} s CPU, {fig(name, 'max_rss_kib') / 1024:.0f} MiB | **{med(ratios):.2f}** "
                     f"({min(ratios):.2f}–{max(ratios):.2f}) | {load:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    ap.add_argument("--baseline", type=Path, default=None, help="another wna16ctl checkout, converted in the same rounds")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_simd()}; {os.cpu_count()} CPUs; command: wna16ctl convert SRC -o OUT -q")
    print("| GPTQ checkpoint | cp -r SRC + sync: wall, CPU, peak RSS | convert + sync: wall, CPU, peak RSS "
          "| cp / convert (median, min–max) | load avg |")
    print("|---|---|---|---|---|")
    print("\n".join(rounds(args.dir, args.layers, args.pairs, args.baseline)), flush=True)


if __name__ == "__main__":
    main()
