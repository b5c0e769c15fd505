"""The order of gpu_check's timed calls, on a fake clock: the L2 flush and the busy stream before
the start event, nothing but the call between the events, the median of at least 15."""

from __future__ import annotations

import pytest

from wna16ctl.native import gputiming


class FakeClock:
    def __init__(self, durations: list[float]):
        self.log: list[str] = []
        self.durations = iter(durations)

    def event(self):
        clock = self

        class Event:
            def record(self) -> None:
                clock.log.append("record")
                self.at = len(clock.log)

            def elapsed_time(self, other) -> float:
                assert clock.log[self.at:other.at - 1] == ["call"]  # only the call was timed
                return next(clock.durations)
        return Event()

    def flush(self) -> None:
        self.log.append("flush")

    def busy(self) -> None:
        self.log.append("busy")

    def synchronize(self) -> None:
        self.log.append("sync")


def test_each_timed_call_is_flushed_and_queued_behind_busy_work() -> None:
    clock = FakeClock([float(x) for x in [9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 100]])
    result = gputiming.time_calls(lambda: clock.log.append("call"), clock, warmup=1)
    assert clock.log[:4] == ["flush", "call", "sync", "flush"]
    timed = clock.log[3:]
    assert timed == ["flush", "busy", "record", "call", "record", "sync"] * 15
    assert result == {"ms": 8.0, "min_ms": 1.0, "max_ms": 100.0, "reps": 15}


def test_fewer_than_15_reps_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 15"):
        gputiming.time_calls(lambda: None, FakeClock([]), reps=9)


def test_shares_of_peak_and_of_the_copy_ceiling() -> None:
    got = gputiming.shares(4.8e9, 2.0, peak_gbps=4800.0, copy_gbps=4000.0)
    assert got == {"gbps": 2400.0, "pct_of_peak": 50.0, "pct_of_copy": 60.0}
    assert gputiming.shares(1e6, 1.0, None, None)["pct_of_copy"] is None
