"""`inspect --tp 8 --json` on a Kimi-K2-sized header set (61 layers, 384 experts, H 7168, I 2048,
int4 g32, ~208k tensors in 60 sparse shards).  Prints a markdown row: median wall, min, max,
peak RSS.

    python bench/bench_inspect.py [--runs 7] [--dir /tmp/wna16ctl-kimi-headers]

`--vs-bare N` instead times `inspect --tp 8 --json` against a bare Python read of the same
headers (bench/bare_header_read.py: json.loads of the index and of every shard header, nothing
checked) in N alternating pairs, and prints the median of the per-pair ratios of wall and of CPU
time (user + system of the process and its worker), and both peak RSS.

`--python-reader` adds inspect with its native header reader switched off (WNA16CTL_NO_NATIVE=1).
`--baseline-python PY` (with `--baseline-src DIR`, put first on its PYTHONPATH) adds a third
command to each round: the same inspect run by another interpreter / source tree, e.g. the
previous release's checkout and its virtual environment.  The order of the commands rotates from
round to round.  `--breakdown N` prints where inspect's CPU time goes, step by step in one
process (min of N repeats of each step, cyclic GC off as in inspect), for the native header reader
(kernels/header_scan.cpp, what inspect runs when it can build it) and for the Python reader (its
definition and fallback), next to the bare read's two json.loads steps.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_headers
from common import med, median_runs, run_once, wna16ctl


def vs_bare(d: Path, rounds: int, baseline: list[str] | None = None, baseline_src: Path | None = None,
            python_reader: bool = False) -> None:
    """`rounds` rounds of inspect, the bare read (and the baseline), in rotating order after a
    warm-up round; medians of the runs and of the per-round ratios to the bare read."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(here.parent)}
    cmds: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "inspect": ([sys.executable, "-m", "wna16ctl", "inspect", str(d), "--tp", "8", "--json"], env),
        "bare": ([sys.executable, str(here / "bare_header_read.py"), str(d)], None),
    }
    if python_reader:  # the same code with its native header reader switched off
        cmds["python reader"] = (cmds["inspect"][0], {**env, "WNA16CTL_NO_NATIVE": "1"})
    if baseline:
        base_env = dict(os.environ)
        if baseline_src is not None:
            base_env["PYTHONPATH"] = str(baseline_src)
        cmds["baseline"] = ([*baseline, "-m", "wna16ctl", "inspect", str(d), "--tp", "8", "--json"], base_env)
    names = list(cmds)
    load = os.getloadavg()[0]
    runs: dict[str, list] = {n: [] for n in names}
    for i in range(rounds + 1):  # the first round is a warm-up (page cache, bytecode)
        for name in names[i % len(names):] + names[:i % len(names)]:
            # in the checkpoint directory: `python -m` would import a wna16ctl found in the working
            # directory before the one PYTHONPATH names
            r = run_once(*cmds[name], cwd=d)
            if i:
                runs[name].append(r)
        load = max(load, os.getloadavg()[0])
    print(f"inspect --tp 8 --json against a bare header read, {rounds} rounds in rotating order, "
          f"load average up to {load:.1f}")
    print()
    cols = [n for n in names if n != "bare"]
    head = " | ".join(cols)
    ratios = " | ".join(f"{n} / bare" for n in cols) + (" | inspect / baseline" if baseline else "")
    print(f"| | {head} | bare read | {ratios} (median of rounds, min–max) |")
    print("|---|" + "---|" * (len(cols) + 1 + len(cols) + bool(baseline)))

    def ratio(a: list, b: list, key: str) -> str:
        rs = [getattr(x, key) / getattr(y, key) for x, y in zip(a, b)]
        return f"**{med(rs):.2f}** ({min(rs):.2f}–{max(rs):.2f})"

    for key, label in (("wall", "wall"), ("cpu", "CPU (user + system, the worker process included)"),
                       ("user", "user CPU alone")):
        cells = [f"{med([getattr(r, key) for r in runs[n]]):.2f} s" for n in cols + ["bare"]]
        rcells = [ratio(runs[n], runs["bare"], key) for n in cols]
        if baseline:
            rcells.append(ratio(runs["inspect"], runs["baseline"], key))
        print(f"| {label} | " + " | ".join(cells + rcells) + " |")
    rss = [f"{max(r.max_rss_kib for r in runs[n]) / 1024:.0f} MiB" for n in cols + ["bare"]]
    print("| peak RSS | " + " | ".join(rss) + " |" + " |" * (len(cols) + bool(baseline)))


def breakdown(d: Path, repeats: int) -> None:
    """CPU seconds of each step of inspect in one process, min of `repeats`."""
    import gc
    import json
    import struct
    import time

    os.environ["WNA16CTL_NO_FORK"] = "1"
    from wna16ctl.planning.inspection import inspect_checkpoint
    from wna16ctl.sources import header_digest, headers, scan
    from wna16ctl.sources.config import read_model_config
    from wna16ctl.sources.model import find_linear_layers
    from wna16ctl.sources.moe import find_moe_layers

    gc.disable()
    best: dict[str, float] = {}

    def step(label: str, fn):
        t = time.process_time()
        out = fn()
        best[label] = min(best.get(label, float("inf")), time.process_time() - t)
        return out

    def python_reader(fn):  # a step with the native reader switched off
        def run():
            os.environ["WNA16CTL_NO_NATIVE"] = "1"
            try:
                return fn()
            finally:
                del os.environ["WNA16CTL_NO_NATIVE"]
        return run

    native = header_digest.native_header_scan_available()
    for _ in range(repeats):
        cfg = read_model_config(d)
        inter = cfg.moe_intermediate_size
        index_bytes = (d / headers.INDEX_NAME).read_bytes()
        step("bare: json.loads of the index", lambda: json.loads(index_bytes))
        where_py = step("Python reader: the index read, parsed, its paths checked (locate_shards)",
                        python_reader(lambda: headers.locate_shards(d)))
        blobs = []
        for p in where_py.paths:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                blobs.append((p, os.fstat(f.fileno()).st_size, f.read(n)))
        step("bare: json.loads of every shard header", lambda: [json.loads(b) for _, _, b in blobs])
        step("Python reader: UTF-8, json.loads, repeated keys (_decode_header)",
             lambda: [headers._decode_header(p, b) for p, _, b in blobs])
        shs = step("Python reader: the above + the safetensors layout rules (shard_header_from_bytes)",
                   lambda: [headers.shard_header_from_bytes(p, s, b) for p, s, b in blobs])
        scans = step("Python reader: experts checked against the config (scan_shard)",
                     lambda: [scan.scan_shard(str(sh.path), cfg, inter, keep_entries=True, header=sh) for sh in shs])
        files = step("Python reader: the index against the shards (assemble)", lambda: headers.assemble(where_py, shs))
        if native:
            where = step("native reader: the index (digest_index) and its paths (locate_shards)",
                         lambda: headers.locate_shards(d))
            digests = step("native reader: every shard header checked and summarised (digest_header)",
                           lambda: [header_digest.digest_header(s, b) for _, s, b in blobs])
            nscans = step("native reader: experts checked against the config (scan_digest)",
                          lambda: [scan.scan_digest(str(p), s, 8 + len(b), g, cfg, inter)
                                   for (p, s, b), g in zip(blobs, digests)])
            step("native reader: the index against the shards (assemble)",
                 lambda: headers.assemble(where, [scan.shard_header(x) for x in nscans]))
            del digests, nscans
        step("MoE layers (find_moe_layers)", lambda: find_moe_layers(files, cfg, scans, inter))
        step("linear layers (find_linear_layers)", lambda: find_linear_layers(files, cfg))
        insp = step("inspect_checkpoint, all of it, serial", lambda: inspect_checkpoint(str(d), (8,), False))
        step("JSON output", lambda: json.dumps(insp.to_json()))
    print(f"inspect's steps in one process, CPU seconds, min of {repeats} (load average {os.getloadavg()[0]:.1f})")
    print()
    print("| step | CPU |")
    print("|---|---|")
    for label, v in best.items():
        print(f"| {label} | {v:.3f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers"))
    ap.add_argument("--linear-dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers-linear"))
    ap.add_argument("--vs-bare", type=int, metavar="ROUNDS", help="rounds against a bare header read")
    ap.add_argument("--baseline-python", help="with --vs-bare: also time inspect run by this interpreter")
    ap.add_argument("--baseline-src", type=Path, help="source tree put on the baseline's PYTHONPATH")
    ap.add_argument("--python-reader", action="store_true",
                    help="with --vs-bare: also time inspect with its native header reader off (WNA16CTL_NO_NATIVE=1)")
    ap.add_argument("--breakdown", type=int, metavar="REPEATS", help="CPU time per step, in one process")
    a = ap.parse_args()
    if not (a.dir / "config.json").exists():
        synthetic_headers.write(a.dir)
    if a.breakdown:
        breakdown(a.dir, a.breakdown)
    if a.vs_bare:
        vs_bare(a.dir, a.vs_bare, [a.baseline_python] if a.baseline_python else None, a.baseline_src, a.python_reader)
    if a.breakdown or a.vs_bare:
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
