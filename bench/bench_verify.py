"""`verify` of the default demo checkpoint repacked at --tp 2 (64 GSM8K samples), whole process.

    python bench/bench_verify.py [--runs 3] [--dir /tmp/wna16ctl-bench-verify]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import med, median_runs, run_once, wna16ctl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench-verify"))
    a = ap.parse_args()
    ck, out = a.dir / "ckpt", a.dir / "tp2"
    if not (ck / "config.json").exists():
        run_once(wna16ctl("demo", str(ck), "--force"))
    run_once(wna16ctl("repack", str(ck), "--tp", "2", "-o", str(out), "--force", "-q"))
    runs = median_runs(wna16ctl("verify", str(ck), str(out)), a.runs)
    if any(r.returncode for r in runs):
        raise SystemExit("verify did not pass")
    walls = [r.wall for r in runs]
    print("| benchmark | median wall | min | max | peak RSS |")
    print("|---|---|---|---|---|")
    print(f"| verify, default demo (Qwen3-MoE, 2 layers × 8 experts, int4 g128) at --tp 2, 64 samples | "
          f"{med(walls):.2f} s | {min(walls):.2f} s | {max(walls):.2f} s | {max(r.max_rss_kib for r in runs) / 1024:.0f} MiB |")


if __name__ == "__main__":
    main()
