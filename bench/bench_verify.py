"""`verify` timed as a whole process: the default demo checkpoint repacked at --tp 2 (64 GSM8K
samples), or a synthetic Qwen3-MoE-shaped checkpoint (`--synthetic L,E,H,I`: layers, experts,
hidden, intermediate; random codes, bench/synthetic_checkpoint.py) repacked at --tp 1.

    python bench/bench_verify.py [--runs 3] [--dir /tmp/wna16ctl-bench-verify]
    python bench/bench_verify.py --synthetic 4,32,1024,384 --samples 5 --layers 0 \
        --before-tree /tmp/older-source --runs 1

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

from common import ROOT, med, median_runs, run_once, wna16ctl


def _row(what: str, runs: list) -> str:
    walls = [r.wall for r in runs]
    users = [r.user for r in runs]
    return (f"| {what} | {med(walls):.1f} s | {min(walls):.1f} s | {max(walls):.1f} s | {med(users):.1f} s | "
            f"{max(r.max_rss_kib for r in runs) / 1024:.0f} MiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench-verify"))
    ap.add_argument("--synthetic", default=None, metavar="L,E,H,I")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--layers", default=None, metavar="SPEC")
    ap.add_argument("--before-tree", type=Path, default=None)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each row's timed ones")
    a = ap.parse_args()
    here = {**os.environ, "PYTHONPATH": str(ROOT)}
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
