"""Timing whole commands the way a user runs them: wall time and peak RSS of the child process."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class Run:
    wall: float
    max_rss_kib: int
    returncode: int
    cpu: float = 0.0  # user + system seconds of the process and the children it waited for
    user: float = 0.0  # the user part alone (system time swings with the host's load)


def run_once(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Run:
    """Run `cmd` in a fresh process (via fork+wait4 so its own peak RSS is measured).  `cwd`: where
    it runs (`python -m` puts the working directory first on sys.path, before PYTHONPATH)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return Run(wall, usage.ru_maxrss, proc.returncode, usage.ru_utime + usage.ru_stime, usage.ru_utime)


def median_runs(cmd: list[str], runs: int, warmup: int = 1, env: dict[str, str] | None = None) -> list[Run]:
    for _ in range(warmup):
        run_once(cmd, env)
    return [run_once(cmd, env) for _ in range(runs)]


def med(values: list[float]) -> float:
    return statistics.median(values)


def wna16ctl(*args: str) -> list[str]:
    return [str(BIN / "wna16ctl"), *args]


def peak_children_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
