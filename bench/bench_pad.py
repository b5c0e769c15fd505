"""`pad` against `cp -r` of the same checkpoint, both ending in `sync`, in one run, and peak RSS.

The random-code Qwen3-30B-A3B-shaped checkpoint of bench_repack.py (H 2048, I 768, 128 experts,
int4 g128; `--layers` MoE layers, 2 = 0.64 GB) is copied with `cp -r SRC DST` and padded with
`wna16ctl pad SRC --tp 4 --vllm 0.31.0 -o OUT -q` (I 768 -> 1024: every expert projection is
rewritten a third larger, everything else copied in the kernel); each command is followed by
`sync` (timed with it) and starts from a missing destination.  pad writes a third more bytes than
it reads, so a second baseline copies the same bytes pad writes: `cp -r` of a padded output made
before the timed runs.  A round is one of each of the three, in alternating order; after one
warm-up round (page cache) the median of `--pairs` rounds of the ratios cp / pad (the input
copied: time against time) and cp-out / pad (the output's bytes copied: speed against speed at
the same bytes) is printed with its min-max.  Peak RSS (wait4) of pad is given at a second size
to show it does not grow with the checkpoint.

    python bench/bench_pad.py [--layers 2] [--small-layers 1] [--pairs 3] [--dir /tmp/wna16ctl-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_repack import _ckpt, cpu_simd
from common import Command, alternating_rounds, dir_bytes, med, timed, wna16ctl

PAD_ARGS = ("--tp", "4", "--vllm", "0.31.0", "-q")


def pairs_at(root: Path, layers: int, pairs: int) -> tuple[str, int]:
    ck = _ckpt(root, layers)
    copy, copy_out, out, ref = root / "copy", root / "copy-out", root / "padded", root / f"padded-ref-{layers}l"
    if not (ref / "wna16ctl.json").exists():  # the bytes pad writes, for the second baseline
        shutil.rmtree(ref, ignore_errors=True)
        if timed(wna16ctl("pad", str(ck), *PAD_ARGS, "-o", str(ref)), ref).returncode != 0:
            raise SystemExit("pad: failed")
    cmds: list[Command] = [("cp", ["cp", "-r", str(ck), str(copy)], copy, None),
                           ("cp-out", ["cp", "-r", str(ref), str(copy_out)], copy_out, None),
                           ("pad", wna16ctl("pad", str(ck), *PAD_ARGS, "-o", str(out)), out, None)]
    written: list[int] = []

    def measure(name: str, dst: Path) -> None:
        if name == "pad":
            written.append(dir_bytes(dst))

    runs, load = alternating_rounds(cmds, pairs, after=measure)
    ratios = [c.wall / p.wall for c, p in zip(runs["cp"], runs["pad"])]
    same = [c.wall / p.wall for c, p in zip(runs["cp-out"], runs["pad"])]
    size = dir_bytes(ck)
    rss = max(r.max_rss_kib for r in runs["pad"])
    wall = lambda name: med([r.wall for r in runs[name]])  # noqa: E731 - a one-line accessor beside its data
    row = (f"| {layers} layers, {size / 1e9:.2f} GB -> {written[-1] / 1e9:.2f} GB | {wall('cp'):.2f} s | {wall('cp-out'):.2f} s | "
           f"{wall('pad'):.2f} s | **{med(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) | "
           f"**{med(same):.2f}** ({min(same):.2f}–{max(same):.2f}) | {rss / 1024:.0f} MiB | {load:.1f} |")
    return row, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--small-layers", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_simd()}; {os.cpu_count()} CPUs; command: wna16ctl pad SRC {' '.join(PAD_ARGS)} -o OUT")
    print("| checkpoint (in -> out) | cp -r SRC + sync | cp -r of pad's output + sync | pad + sync | cp / pad (median, "
          "min–max) | cp-out / pad, same bytes (median, min–max) | pad peak RSS | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in (args.layers, args.small_layers):
        row, _ = pairs_at(args.dir, layers, args.pairs if layers == args.layers else 1)
        print(row, flush=True)


if __name__ == "__main__":
    main()
