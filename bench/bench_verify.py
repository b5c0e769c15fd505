"""`verify` timed as a whole process: the default demo checkpoint repacked at --tp 2 (64 GSM8K
samples), or a synthetic Qwen3-MoE-shaped checkpoint (`--synthetic L,E,H,I`: layers, experts,
hidden, intermediate; random codes, bench/synthetic_checkpoint.py) repacked at --tp 1.

    python bench/bench_verify.py [--runs 3] [--dir /tmp/wna16ctl-bench-verify]
    python bench/bench_verify.py --synthetic 4,32,1024,384 --samples 5 --layers 0 \
        --before-tree /tmp/older-source --runs 1

`--at-scale CASE` measures the exactness proof (`verify --no-numerics`) at the sizes users have,
against `cp -r` of the same output in the same run (A B A B …), with wall, CPU and peak RSS:
  qwen30b-repack  Qwen3-30B-A3B-shaped synthetic (48 layers × 128 experts, H 2048, I 768, ~16 GB),
                  verify of its `repack --tp 2`;
  qwen30b-pad     the same checkpoint, verify ORIGINAL PADDED of its `pad --tp 4`;
  kimi-layer      one Kimi-K2-width layer (384 experts, H 7168, I 2048, int4 g32, ~8.5 GB),
                  verify of its `repack --tp 8`.
`--scale-numerics N` also times one verify with numerics on N samples (the memory bound is the
same: the tokens per layer are capped by verify's budget).  kimi-pad is the Kimi-width layer's
`pad --tp 8 --to 2304`, verified as ORIGINAL PADDED.
`--cold` drops the page cache before each command (root only), so that both read the bytes
from the disk: without it `cp -r` right after a verify copies from memory what the verify left in
the page cache, and the ratio measures the cache, not the disk.
`--scale-layers N` makes the Qwen3 cases N layers (the peak RSS must not move with N). The
checkpoints and outputs are written under --dir; `--clean` removes them afterwards.

    python bench/bench_verify.py --at-scale kimi-layer --runs 1 --dir /data/bench --clean

`--layers SPEC` adds a row for `verify --layers SPEC` (a partial verify of those MoE layers).
`--before-tree DIR` adds a row for the full verify run with DIR first on PYTHONPATH (the source
tree of an earlier commit, e.g. `git archive <commit> | tar -x -C DIR`): a baseline measured in
the same run, on the same machine and load.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, drop_page_cache, med, median_runs, run_once, wna16ctl


def _row(what: str, runs: list) -> str:
    walls = [r.wall for r in runs]
    users = [r.user for r in runs]
    return (f"| {what} | {med(walls):.1f} s | {min(walls):.1f} s | {max(walls):.1f} s | {med(users):.1f} s | "
            f"{max(r.max_rss_kib for r in runs) / 1024:.0f} MiB |")


SCALE_CASES = {  # name -> (synthetic_checkpoint.py arguments, the command that makes OUT, its flags)
    "qwen30b-repack": (["--layers", "48", "--experts", "128", "--hidden", "2048", "--intermediate", "768"],
                       "repack", ["--tp", "2"]),
    "qwen30b-pad": (["--layers", "48", "--experts", "128", "--hidden", "2048", "--intermediate", "768"],
                    "pad", ["--tp", "4"]),
    "kimi-layer": (["--layers", "1", "--experts", "384", "--hidden", "7168", "--intermediate", "2048",
                    "--group-size", "32", "--experts-per-shard", "32"], "repack", ["--tp", "8"]),
    "kimi-pad": (["--layers", "1", "--experts", "384", "--hidden", "7168", "--intermediate", "2048",
                  "--group-size", "32", "--experts-per-shard", "32"], "pad", ["--tp", "8", "--to", "2304"]),
}


def _scale_row(what: str, runs: list, base: list | None = None) -> str:
    walls = [r.wall for r in runs]
    ratio = f"{med([b.wall / r.wall for r, b in zip(runs, base)]):.2f}" if base else "1"
    return (f"| {what} | {med(walls):.1f} s | {med([r.cpu for r in runs]):.1f} s | "
            f"{max(r.max_rss_kib for r in runs) / 1024:.0f} MiB | {ratio} |")


def at_scale(case: str, root: Path, runs: int, layers: int | None, clean: bool, here: dict[str, str],
             numerics: int = 0, cold: bool = False) -> None:
    """One at-scale case (module doc): verify --no-numerics against cp -r of the output, pair by pair;
    `cold`: each from a dropped page cache (the bytes read from the disk by both)."""
    import shutil

    gen, command, flags = SCALE_CASES[case]
    if layers is not None:
        gen = [*gen[:gen.index("--layers") + 1], str(layers), *gen[gen.index("--layers") + 2:]]
    ck = root / ("syn-" + "-".join(gen[1::2]))
    out, copy = root / f"{case}-out", root / f"{case}-copy"
    try:
        if not (ck / "config.json").exists():
            run_once([sys.executable, str(ROOT / "bench" / "synthetic_checkpoint.py"), str(ck), *gen], here)
        if not out.exists():
            run_once(wna16ctl(command, str(ck), *flags, "-o", str(out), "--force", "-q"), here)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        verify = wna16ctl("verify", str(ck), str(out), "--no-numerics")
        mine, cps, full = [], [], []
        load = os.getloadavg()[0]
        if numerics:  # the default verify (numerics on `numerics` samples), once
            full.append(run_once(wna16ctl("verify", str(ck), str(out), "--num-samples", str(numerics)), here))
            if full[-1].returncode:
                raise SystemExit("verify with numerics did not pass")
        if cold and not drop_page_cache():
            raise SystemExit("--cold: the page cache cannot be dropped here (root only)")
        for _ in range(runs):
            shutil.rmtree(copy, ignore_errors=True)
            if cold:
                drop_page_cache()
            cps.append(run_once(["cp", "-r", str(out), str(copy)]))
            shutil.rmtree(copy, ignore_errors=True)
            if cold:
                drop_page_cache()
            mine.append(run_once(verify, here))
            if mine[-1].returncode:
                raise SystemExit("verify did not pass")
        shape = " ".join(gen)
        print(f"{case}: synthetic {shape}; OUT = {command} {' '.join(flags)}, {size / 2**30:.2f} GiB; "
              f"{'each command from a dropped page cache; ' if cold else ''}"
              f"{os.cpu_count()} CPUs; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
        print("| command | median wall | median CPU (user+sys) | peak RSS | speed vs cp -r (cp wall / wall) |")
        print("|---|---|---|---|---|")
        print(_scale_row(f"cp -r OUT (the same {size / 2**30:.2f} GiB)", cps))
        print(_scale_row(f"verify CKPT OUT --no-numerics ({case})", mine, cps))
        if full:
            print(_scale_row(f"verify CKPT OUT --num-samples {numerics} (numerics; {case})", full))
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        if clean:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(ck, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench-verify"))
    ap.add_argument("--synthetic", default=None, metavar="L,E,H,I")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--layers", default=None, metavar="SPEC")
    ap.add_argument("--before-tree", type=Path, default=None)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each row's timed ones")
    ap.add_argument("--at-scale", choices=sorted(SCALE_CASES), default=None)
    ap.add_argument("--scale-layers", type=int, default=None, help="--at-scale qwen30b-*: this many layers")
    ap.add_argument("--clean", action="store_true", help="--at-scale: remove the checkpoint and output afterwards")
    ap.add_argument("--cold", action="store_true",
                    help="--at-scale: drop the page cache before each command (root), so both read from the disk")
    ap.add_argument("--scale-numerics", type=int, default=0, metavar="N",
                    help="--at-scale: also time one verify with numerics on N samples (wall, CPU, peak RSS)")
    a = ap.parse_args()
    here = {**os.environ, "PYTHONPATH": str(ROOT)}
    if a.at_scale:
        a.dir.mkdir(parents=True, exist_ok=True)
        at_scale(a.at_scale, a.dir, a.runs, a.scale_layers, a.clean, here, a.scale_numerics, a.cold)
        return
    if a.synthetic:
        layers, experts, hidden, inter = (int(x) for x in a.synthetic.split(","))
        ck, out, tp = a.dir / f"syn-{a.synthetic.replace(',', '-')}", a.dir / "syn-tp1", "1"
        if not (ck / "config.json").exists():
            run_once([sys.executable, str(ROOT / "bench" / "synthetic_checkpoint.py"), str(ck), "--layers", str(layers),
                      "--experts", str(experts), "--hidden", str(hidden), "--intermediate", str(inter)], here)
        what = f"Qwen3-MoE-shaped synthetic, {layers} layers × {experts} experts, hidden {hidden}, intermediate {inter}"
    else:
        ck, out, tp = a.dir / "ckpt", a.dir / "tp2", "2"
        if not (ck / "config.json").exists():
            run_once(wna16ctl("demo", str(ck), "--force"), here)
        what = "default demo (Qwen3-MoE, 2 layers × 8 experts, int4 g128)"
    run_once(wna16ctl("repack", str(ck), "--tp", tp, "-o", str(out), "--force", "-q"), here)
    verify = wna16ctl("verify", str(ck), str(out), "--num-samples", str(a.samples))
    rows = []
    if a.before_tree is not None:
        before = median_runs(verify, a.runs, a.warmup, env={**os.environ, "PYTHONPATH": str(a.before_tree)})
        rows.append(_row(f"verify, {what}, at --tp {tp}, {a.samples} samples: {a.before_tree}", before))
    runs = median_runs(verify, a.runs, a.warmup, env=here)
    if any(r.returncode for r in runs):
        raise SystemExit("verify did not pass")
    rows.append(_row(f"verify, {what}, at --tp {tp}, {a.samples} samples", runs))
    if a.layers is not None:
        part = median_runs(verify + ["--layers", a.layers], a.runs, a.warmup, env=here)
        rows.append(_row(f"verify --layers {a.layers} (partial), same output", part))
    print("| benchmark | median wall | min | max | median user CPU | peak RSS |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
