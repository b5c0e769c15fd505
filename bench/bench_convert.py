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
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_repack import _ENV, _dir_bytes, _sync, cpu_simd
from common import Run, med, run_once, wna16ctl

HERE = Path(__file__).resolve().parent


def gptq_ckpt(root: Path, layers: int) -> Path:
    """The GPTQ synthetic, written once by a child process (this one stays small: no torch)."""
    path = root / f"q30-gptq-{layers}l"
    if not (path / "config.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, str(HERE / "synthetic_checkpoint.py"), str(path), "--layers", str(layers),
                        "--gptq"], check=True, stdout=subprocess.DEVNULL)
    return path


def timed(cmd: list[str], dst: Path, env: dict[str, str] = _ENV) -> Run:
    """`cmd` then `sync`, from a missing destination: wall of both, CPU and peak RSS of `cmd` (run
    in DIR, never in a checkout: `python -m` would import the package of the working directory)."""
    shutil.rmtree(dst, ignore_errors=True)
    _sync()  # the removal's (and the previous run's) writeback is timed for neither
    r = run_once(cmd, env, cwd=dst.parent)
    return Run(r.wall + _sync(), r.max_rss_kib, r.returncode, r.cpu, r.user)


def rounds(root: Path, layers: int, pairs: int, baseline: Path | None = None) -> list[str]:
    ck = gptq_ckpt(root, layers)
    copy = root / "copy"
    cmds = [("cp", ["cp", "-r", str(ck), str(copy)], copy, _ENV),
            ("convert", wna16ctl("convert", str(ck), "-o", str(root / "converted"), "-q"), root / "converted", _ENV)]
    if baseline is not None:
        cmds.append(("baseline", [sys.executable, "-m", "wna16ctl", "convert", str(ck), "-o", str(root / "baseline"), "-q"],
                     root / "baseline", _ENV | {"PYTHONPATH": str(baseline.resolve())}))
    runs: dict[str, list[Run]] = {name: [] for name, *_ in cmds}
    load = os.getloadavg()[0]
    for i in range(pairs + 1):  # the first round is a warm-up
        for name, cmd, dst, env in (cmds if i % 2 == 0 else cmds[::-1]):
            r = timed(cmd, dst, env)
            if r.returncode != 0:
                raise SystemExit(f"{name}: exit {r.returncode}")
            if i:
                runs[name].append(r)
        load = max(load, os.getloadavg()[0])
    for _, _, dst, _ in cmds:
        shutil.rmtree(dst, ignore_errors=True)
    fig = lambda name, key: med([getattr(r, key) for r in runs[name]])  # noqa: E731 - a one-line accessor beside its data
    lines = []
    for name, *_ in cmds[1:]:
        ratios = [c.wall / v.wall for c, v in zip(runs["cp"], runs[name])]
        lines.append(f"| {name}: {layers} layers, {_dir_bytes(ck) / 1e9:.2f} GB | {fig('cp', 'wall'):.2f} s, "
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
