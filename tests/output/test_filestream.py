"""wna16ctl.output.filestream: a file produced front to back in reused blocks, hashed as written."""

from __future__ import annotations

import ctypes
import errno
import os
import random
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest

from wna16ctl.output import filestream
from wna16ctl.output.filestream import FileStream, SerialLane


class Failed(Exception):
    pass


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=3) as p:
        yield p


@pytest.fixture
def write_pool():
    with ThreadPoolExecutor(max_workers=4) as p:
        yield p


def _produce(path, data: bytes, pool, *, direct: bool, block: int, pieces: list[int], header: bytes = b"",
             write_pool=None, depth: int = 4) -> FileStream:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, len(header) + len(data))
    s = FileStream(fd, len(header) + len(data), blake3.blake3(), pool, max_reserve=max(pieces), block=block,
                   direct=direct, on_error=lambda e: Failed(f"{path}: {e.strerror}"), write_pool=write_pool,
                   depth=depth)
    s.write(header)
    at = 0
    for n in pieces:
        n = min(n, len(data) - at)
        addr = s.reserve(n)
        ctypes.memmove(addr, data[at:at + n], n)  # what the native builder does: bytes built in place
        s.commit(n)
        at += n
    assert at == len(data)
    s.close()
    os.fsync(fd)
    os.close(fd)
    return s


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("block", [4096, 3 * 4096, 1 << 16])
@pytest.mark.parametrize("writes", ["on the lane", "on their own pool, depth 2", "on their own pool, depth 4"])
def test_stream_writes_and_hashes_exactly_what_was_committed(tmp_path, pool, write_pool, direct, block, writes):
    rng = random.Random(block + direct)
    header = rng.randbytes(137)  # an odd length: nothing after it is page-aligned in the file
    data = rng.randbytes(10 * block + 1234)
    pieces = [rng.choice([1, 7, 4095, 4096, 5000, block, block + 3]) for _ in range(400)]
    s = _produce(tmp_path / "f", data, pool, direct=direct, block=block,
                 pieces=_cap(pieces, len(data), block + 3), header=header,
                 write_pool=None if writes == "on the lane" else write_pool, depth=int(writes[-1]) if writes[-1].isdigit() else 2)
    got = (tmp_path / "f").read_bytes()
    assert got == header + data  # the padding of the last direct write is cut again
    assert s.hasher.hexdigest() == blake3.blake3(header + data).hexdigest()


def _cap(pieces: list[int], total: int, most: int) -> list[int]:
    out, left = [], total
    for p in pieces:
        p = min(p, most, left)
        if p:
            out.append(p)
            left -= p
    while left:
        out.append(min(most, left))
        left -= out[-1]
    return out


def test_stream_refuses_bytes_past_the_planned_end_and_an_early_close(tmp_path, pool):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        s = FileStream(fd, 100, blake3.blake3(), pool, max_reserve=64, on_error=lambda e: Failed(str(e)))
        s.reserve(64)
        s.commit(64)
        with pytest.raises(ValueError, match="pass the planned end 100"):
            s.reserve(37)
        with pytest.raises(ValueError, match="at 64 of 100"):
            s.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("own_pool", [False, True])
def test_a_failed_write_surfaces_in_the_producer_with_the_file_named(tmp_path, pool, write_pool, own_pool):
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # every write fails (EBADF)
    try:
        s = FileStream(fd, 1 << 20, blake3.blake3(), pool, max_reserve=4096, block=8192, direct=False,
                       on_error=lambda e: Failed(f"{path}: {e.strerror}"), write_pool=write_pool if own_pool else None)
        with pytest.raises(Failed, match=str(path)):
            for _ in range(256):
                s.reserve(4096)
                s.commit(4096)
            s.close()
    finally:
        os.close(fd)


def test_a_direct_write_the_filesystem_refuses_falls_back_to_plain_writes(tmp_path, pool, monkeypatch):
    real = os.pwrite
    calls = {"einval": 0}

    def pwrite(fd, data, offset):
        if calls["einval"] == 0:
            calls["einval"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not FileStream(probe, 0, None, pool, max_reserve=1, on_error=Failed).direct:
            pytest.skip(f"{tmp_path}: the filesystem does not take O_DIRECT")
    finally:
        os.close(probe)
    monkeypatch.setattr(filestream.os, "pwrite", pwrite)
    data = random.Random(3).randbytes(5 * 8192 + 11)
    s = _produce(tmp_path / "f", data, pool, direct=True, block=8192, pieces=_cap([3000] * 100, len(data), 3000))
    assert calls["einval"] == 1 and not s.direct
    assert (tmp_path / "f").read_bytes() == data


def test_serial_lane_runs_one_files_tasks_in_order(pool):
    lanes = [SerialLane(pool) for _ in range(3)]
    seen: dict[int, list[int]] = {i: [] for i in range(3)}
    futs = [lanes[i % 3].submit(lambda i=i: seen[i % 3].append(i)) for i in range(300)]
    for f in futs:
        f.result()
    assert all(seen[k] == list(range(k, 300, 3)) for k in seen)


def test_abort_while_a_finished_file_is_still_being_written_leaves_it_unjournaled(tmp_path, monkeypatch):
    import json
    import time

    from wna16ctl.output.writer import PlannedFile, PlannedTensor, StagedOutput

    staged = StagedOutput(tmp_path / "out", force=False, resume=False, identity={"x": 1})
    f = PlannedFile("rank-0/model-00001-of-00001.safetensors", [PlannedTensor("t", "U8", (3 << 20,))])
    f.layout()
    real = os.pwrite

    def slow(fd, data, offset):  # the file's last writes are still running when abort() comes
        time.sleep(0.2)
        return real(fd, data, offset)

    monkeypatch.setattr(filestream.os, "pwrite", slow)
    s = staged.stream(f, 1 << 20)
    for _ in range(3):
        s.reserve(1 << 20)
        s.commit(1 << 20)
    staged.finish_stream(f)
    time.sleep(0.05)  # the blocks are hashed by now: the file's final task waits for its writes
    staged.abort(keep_for_resume=True)  # must not raise: an aborted file is simply not journaled
    journal = json.loads((staged.stage / staged.journal_name).read_text())
    assert f.relpath not in journal["files"]
