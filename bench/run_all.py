"""Run every benchmark and print their markdown tables (the source of docs/performance.md).

    python bench/run_all.py
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    cpus = len(__import__("os").sched_getaffinity(0))
    print(f"machine: {platform.machine()}, {cpus} CPUs, Python {platform.python_version()}\n")
    for script in ("bench_inspect.py", "bench_hub_inspect.py", "bench_repack.py", "bench_verify.py"):
        print(f"## {script}\n", flush=True)
        subprocess.run([sys.executable, str(HERE / script)], check=True)
        print(flush=True)


if __name__ == "__main__":
    main()
