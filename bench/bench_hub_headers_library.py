"""Hub header reading: wna16ctl's own range reads (`sources/hub.py`) against huggingface_hub's
`get_safetensors_metadata`, on the Kimi-K2-sized header set (60 sparse shards) served by the
local Hub stand-in of the tests.  Both fetch every shard's header; the figures are the wall
time of a cold fetch (median of --runs, each in a fresh HF_HOME), the requests and body bytes
each makes, and what a second run costs (ours reads its header cache, the library refetches).

    python bench/bench_hub_headers_library.py [--runs 3] [--dir /tmp/wna16ctl-kimi-headers]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import synthetic_headers

from tests.hubserver import FakeHub

REPO = "moonshotai/Kimi-K2-W4A16"
OURS = ("from wna16ctl.sources.hub import HubRef, open_hub_checkpoint\n"
        "ck = open_hub_checkpoint(HubRef('%s'))\nprint(len(ck.files.shards))\n" % REPO)
LIBRARY = ("import huggingface_hub\n"
           "m = huggingface_hub.get_safetensors_metadata('%s')\nprint(len(m.files_metadata))\n" % REPO)


def timed(hub: FakeHub, code: str, hf_home: Path) -> tuple[float, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    hub.reset_counts()
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert res.returncode == 0 and res.stdout.strip() == "60", res.stderr[-2000:]
    return wall, len(hub.requests), hub.bytes_served


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-kimi-headers"))
    a = ap.parse_args()
    if not (a.dir / "config.json").exists():
        synthetic_headers.write(a.dir)
    hub = FakeHub()
    hub.add(REPO, a.dir)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, code in (("wna16ctl", OURS), ("get_safetensors_metadata", LIBRARY)):
            cold, warm = [], []
            for i in range(a.runs):
                home = Path(tmp) / f"{name}-{i}"
                cold.append(timed(hub, code, home))
                warm.append(timed(hub, code, home))
            out[name] = {"cold_s": statistics.median(c[0] for c in cold), "cold_requests": cold[0][1],
                         "cold_body_bytes": cold[0][2], "second_run_s": statistics.median(w[0] for w in warm),
                         "second_run_requests": warm[0][1], "second_run_body_bytes": warm[0][2]}
    hub.close()
    out["ratio_cold_library_over_ours"] = out["get_safetensors_metadata"]["cold_s"] / out["wna16ctl"]["cold_s"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
