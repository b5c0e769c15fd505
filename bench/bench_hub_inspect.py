"""`inspect --tp 8 --json` on a Kimi-K2-sized header set (61 layers, 384 experts, ~208k tensors in
60 sparse shards, ~550 GiB apparent) served by the local Hub stand-in of the tests: bytes fetched
against the apparent size, and the wall time of a first (cold) run, of a run with the headers
cached, and of an offline run, against `inspect` of the local directory in the same run.

    python bench/bench_hub_inspect.py [--runs 5] [--dir /tmp/wna16ctl-kimi-headers]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import synthetic_headers
from common import med, run_once, wna16ctl

from tests.hubserver import FakeHub

REPO = "moonshotai/Kimi-K2-W4A16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers"))
    a = ap.parse_args()
    if not (a.dir / "config.json").exists():
        synthetic_headers.write(a.dir)
    apparent = sum(p.stat().st_size for p in a.dir.iterdir())
    hub = FakeHub()
    hub.add(REPO, a.dir)
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    base.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1")
    local_cmd = wna16ctl("inspect", str(a.dir), "--tp", "8", "--json")
    hub_cmd = wna16ctl("inspect", REPO, "--tp", "8", "--json")
    rows: dict[str, list[float]] = {"local directory": [], "Hub, cold cache": [], "Hub, headers cached": [],
                                    "Hub, HF_HUB_OFFLINE=1": []}
    fetched: list[int] = []
    run_once(local_cmd, base)  # warm the page cache
    for _ in range(a.runs):
        home = Path(tempfile.mkdtemp(prefix="wna16ctl-hf-"))
        env = dict(base, HF_HOME=str(home))
        rows["local directory"].append(run_once(local_cmd, env).wall)
        hub.reset_counts()
        rows["Hub, cold cache"].append(run_once(hub_cmd, env).wall)
        fetched.append(hub.bytes_served)
        rows["Hub, headers cached"].append(run_once(hub_cmd, env).wall)
        rows["Hub, HF_HUB_OFFLINE=1"].append(run_once(hub_cmd, dict(env, HF_HUB_OFFLINE="1")).wall)
        shutil.rmtree(home)
    hub.close()
    base_wall = med(rows["local directory"])
    print(f"apparent size {apparent / 2**30:.1f} GiB; fetched on a cold run {med(fetched) / 1e6:.1f} MB "
          f"({100 * med(fetched) / apparent:.4f} %)\n")
    print("| inspect --tp 8 --json, Kimi-K2-sized | median wall | min | max | vs local |")
    print("|---|---|---|---|---|")
    for name, walls in rows.items():
        print(f"| {name} | {med(walls):.3f} s | {min(walls):.3f} s | {max(walls):.3f} s | {med(walls) / base_wall:.2f}x |")


if __name__ == "__main__":
    main()
