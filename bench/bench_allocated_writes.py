"""O_DIRECT writes into a file sized by `ftruncate` against one whose blocks were allocated first
(`wna16ctl.output.filestream.allocate`), as `pad` writes its shards: `--mb` MB of 1 MiB writes,
`--inflight` at once, then fsync, timed from the file's creation.  Rounds alternate the order;
the median time of each is printed with all rounds.

    python bench/bench_allocated_writes.py [--mb 870] [--inflight 4] [--rounds 4] [--dir /tmp/wna16ctl-bench]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wna16ctl.output.filestream import allocate  # noqa: E402 - after the sys.path line that finds the package

BLOCK = 1 << 20


def timed_write(path: Path, total: int, inflight: int, allocated: bool) -> float:
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(BLOCK))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    try:
        os.ftruncate(fd, total)
        if allocated:
            allocate(fd, total)
        with ThreadPoolExecutor(inflight) as pool:
            list(pool.map(lambda offset: os.pwrite(fd, buf, offset), range(0, total, BLOCK)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=870)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "allocated-writes.bin"
    total = args.mb * BLOCK
    kinds = [("ftruncate only", False), ("allocated", True)]
    times: dict[str, list[float]] = {name: [] for name, _ in kinds}
    for i in range(args.rounds):
        for name, allocated in (kinds if i % 2 == 0 else kinds[::-1]):
            path.unlink(missing_ok=True)
            subprocess.run(["sync"], check=True)
            times[name].append(timed_write(path, total, args.inflight, allocated))
    path.unlink(missing_ok=True)
    print(f"{args.mb} MiB of 1 MiB O_DIRECT writes, {args.inflight} in flight; load {os.getloadavg()[0]:.1f}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:15s} median {m:.2f} s ({total / m / 1e9:.2f} GB/s); rounds {', '.join(f'{x:.2f}' for x in t)}")


if __name__ == "__main__":
    main()
