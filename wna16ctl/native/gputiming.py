"""GPU time of one kernel call, not host time: what gpu_check's benchmarks measure with.

Each timed call
* reads its inputs from HBM: the L2 is flushed (a memset of a buffer several times its size)
  before every call, outside the timed region and on the same stream;
* starts when the GPU reaches it, not when the host launched it: a sleep kernel queued before the
  start event keeps the stream busy while the host queues the event, the call and the end event,
  so the launch latency and the host's argument handling fall outside the events;
* is one of at least MIN_REPS, of which the median is reported.

The sequence is written against a small `Clock` (events, flush, busy, synchronize) so that its
order is tested on the CPU (tests/native/test_gputiming.py); `CudaClock` is the real one.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional, Protocol

MIN_REPS = 15
FLUSH_MIN_BYTES = 256 << 20
BUSY_US = 200.0  # long enough for the host to queue an event, a call and an event behind it


class Clock(Protocol):
    def event(self) -> Any: ...  # with record() and elapsed_time(other) -> ms
    def flush(self) -> None: ...
    def busy(self) -> None: ...
    def synchronize(self) -> None: ...


def time_calls(call: Callable[[], Any], clock: Clock, *, reps: int = MIN_REPS, warmup: int = 2) -> dict:
    """Median, min and max milliseconds of `call` over `reps` timed calls (after `warmup`)."""
    if reps < MIN_REPS:
        raise ValueError(f"reps = {reps}: at least {MIN_REPS} calls make a median")
    for _ in range(warmup):
        clock.flush()
        call()
    clock.synchronize()
    times = []
    for _ in range(reps):
        clock.flush()
        clock.busy()
        start, end = clock.event(), clock.event()
        start.record()
        call()
        end.record()
        clock.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps}


def shares(nbytes: float, ms: float, peak_gbps: Optional[float], copy_gbps: Optional[float]) -> dict:
    """Bandwidth of moving `nbytes` in `ms`, as GB/s and as a share of the datasheet peak and of
    the device-to-device copy measured in the same run."""
    gbps = nbytes / ms / 1e6
    return {"gbps": round(gbps, 1),
            "pct_of_peak": round(100 * gbps / peak_gbps, 1) if peak_gbps else None,
            "pct_of_copy": round(100 * gbps / copy_gbps, 1) if copy_gbps else None}


class CudaClock:
    """The clock of the current CUDA stream; `l2_bytes` sizes the flush buffer."""

    def __init__(self, l2_bytes: int, busy_us: float = BUSY_US):
        import torch

        self.torch = torch
        self.buffer = torch.empty(max(FLUSH_MIN_BYTES, 8 * l2_bytes), dtype=torch.uint8, device="cuda")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        clock_khz = getattr(props, "clock_rate", 0) or 1_980_000  # cycles per ms
        self.busy_cycles = int(busy_us * clock_khz / 1e3)

    def event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True)

    def flush(self) -> None:
        self.buffer.zero_()

    def busy(self) -> None:
        self.torch.cuda._sleep(self.busy_cycles)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()


def copy_ceiling(clock: Clock, nbytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth (read + write bytes per second) of an `nbytes` buffer: the
    most a memory-bound kernel can reach on this device, measured the same way as the kernels."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), clock)
    return {"bytes": nbytes, "ms": round(t["ms"], 4), "gbps": round(2 * nbytes / t["ms"] / 1e6, 1)}
