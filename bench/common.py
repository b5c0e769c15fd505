"""Timing whole commands the way a user runs them: wall time and peak RSS of the child process."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# As installed: Python may cache bytecode (the warm-up pair writes it), else every run recompiles
# the modules it imports (~40 ms here when PYTHONDONTWRITEBYTECODE is set in the environment).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


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


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sync() -> float:
    t = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t


def drop_page_cache() -> bool:
    """Write back and drop the page cache, so that the next command reads its bytes from the disk
    (root only: False, and nothing dropped, elsewhere)."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def timed(cmd: list[str], dst: Path, env: dict[str, str] | None = None) -> Run:
    """`cmd` then `sync`, from a missing destination: wall of both, CPU and peak RSS of `cmd` (run
    beside DST, never in a checkout: `python -m` would import the package of the working directory)."""
    shutil.rmtree(dst, ignore_errors=True)
    sync()  # the removal's (and the previous run's) writeback is timed for neither
    r = run_once(cmd, env or ENV, cwd=dst.parent)
    return Run(r.wall + sync(), r.max_rss_kib, r.returncode, r.cpu, r.user)


# a command of a round: (its name, the command, its destination, its environment or None for ENV)
Command = tuple[str, list[str], Path, "dict[str, str] | None"]


def alternating_rounds(cmds: list[Command], pairs: int,
                       after: Callable[[str, Path], None] = lambda name, dst: None) -> tuple[dict[str, list[Run]], float]:
    """Each command once a round (`timed`), in an order that alternates round by round so that drift
    of a shared machine hits all alike; the first round is a warm-up (page cache), then `pairs`
    timed rounds.  `after(name, dst)` looks at each output before the next command; the outputs
    are removed at the end.  (the timed runs by name, the highest load average seen)."""
    runs: dict[str, list[Run]] = {name: [] for name, *_ in cmds}
    load = os.getloadavg()[0]
    for i in range(pairs + 1):
        for name, cmd, dst, env in (cmds if i % 2 == 0 else cmds[::-1]):
            r = timed(cmd, dst, env)
            if r.returncode != 0:
                raise SystemExit(f"{name}: exit {r.returncode}")
            after(name, dst)
            if i:
                runs[name].append(r)
        load = max(load, os.getloadavg()[0])
    for _, _, dst, _ in cmds:
        shutil.rmtree(dst, ignore_errors=True)
    return runs, load
