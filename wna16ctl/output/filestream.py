"""One output file written front to back through reused, page-aligned blocks.

The producer (repack's native data path) asks for room at the end of the file (`reserve`), builds
its bytes there in place, and `commit`s them.  Each full block is handed to a shared pool of I/O
threads, which hash it (the file is produced in order, so its digest needs no read-back), while a
second pool writes it at its offset.  Where the filesystem takes O_DIRECT the block goes from this memory straight to
the disk: no copy into the page cache, no dirty pages for a later writeback, and almost no CPU;
elsewhere (tmpfs, some network filesystems) it is a plain write followed by `sync_file_range`, so
the disk starts at once.  A few blocks per file: one is filled while the others are written.

A file's blocks are hashed one after another (in file order) but written in any order and in
parallel with other files' blocks, which keeps several writes in flight on a disk that is slow at
one at a time.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

_PAGE = 4096  # O_DIRECT wants offsets, sizes and addresses aligned to the logical block size (<= 4 KiB)
# One write of 1 MiB (or one reservation, when larger), up to three of them in flight per file:
# small enough that a block is still in the cache when it is hashed and written, deep enough that
# a disk slow at one write at a time is kept busy (bench/bench_repack.py measured 1, 4 and 8 MiB
# blocks here: 1 MiB was fastest).  Four in flight per file measured the same time with 12 MiB
# more peak memory: the write pool runs four writes at once for all files together.
BLOCK_BYTES = 1 << 20
DEPTH = 3


def producers(n_files: int, most: int) -> int:
    """Files written at once, each by a producer of its own: one per core this process may run on
    (its affinity: a container or `taskset` may grant fewer than the machine has), at most `most`,
    never more than there are files."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(most, cores, n_files))


def depth_for(max_reserve: int) -> int:
    """Blocks in flight for a stream whose largest reservation is `max_reserve`.  One of small
    pieces (a layer's scales: a few KiB a chunk) fills a block over many chunks, so its writes are
    rare and two blocks keep it going; its other blocks would only hold memory for the whole run."""
    return 2 if max_reserve * 4 <= BLOCK_BYTES else DEPTH


_O_DIRECT = getattr(os, "O_DIRECT", 0)


class StreamAborted(Exception):
    """What `finish`'s callback gets when the stream was aborted before its last write."""


def _round_up(n: int, to: int = _PAGE) -> int:
    return -(-n // to) * to


class SerialLane:
    """Tasks of one file, run in submission order on a shared pool (no thread per file)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._lock = threading.Lock()
        self._queue: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            self._queue.append((fn, fut))
            if not self._running:
                self._running = True
                self._pool.submit(self._drain)
        return fut

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                fn, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the block
                fut.set_exception(e)


class FileStream:
    """Bytes [0, size) of one file, produced in order.  `hasher` receives every byte in order;
    `on_error(exc)` turns an OSError of a write into the error to raise (naming the file).  With
    fd -1 nothing is written: the bytes are only hashed (repack's check of a staged file)."""

    def __init__(self, fd: int, size: int, hasher: Any, pool: ThreadPoolExecutor, *, max_reserve: int,
                 write_pool: ThreadPoolExecutor | None = None,
                 on_error: Callable[[OSError], BaseException], block: int = BLOCK_BYTES, direct: bool = True,
                 depth: int = DEPTH):
        self.fd, self.size, self.hasher = fd, size, hasher
        self._on_error = on_error
        self._block = max(_PAGE, block // _PAGE * _PAGE)
        # a reservation never needs a new block mid-way; +1 page for the zero padding of the last write
        self._capacity = self._block + _round_up(max(max_reserve, 1)) + _PAGE
        self._lane = SerialLane(pool)
        self._write_pool = write_pool  # None: each write runs on the lane after its block's hash
        self._bufs: list[tuple[mmap.mmap, int]] = []
        self._inflight: list[tuple[Future[Any], Future[Any]] | None] = [None] * max(2, depth)
        self._cur = 0
        self._fill = 0  # bytes in the current buffer
        self._flushed = 0  # file offset of the current buffer's first byte
        self.position = 0  # bytes committed so far
        self.direct = bool(direct and _O_DIRECT and fd >= 0) and self._set_direct(True)
        self._failed: BaseException | None = None
        self.aborted = False

    @property
    def block(self) -> int:
        """Bytes per write (a reservation of at most this never waits for more than one write)."""
        return self._block

    # the producer's side ---------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        """Address of room for the next `nbytes` of the file (valid until `commit`)."""
        if self.position + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at {self.position} pass the planned end {self.size}")
        buf = self._buffer(self._cur)
        if self._fill + nbytes > self._capacity - _PAGE:
            self._hand_off(self._fill // _PAGE * _PAGE)
            buf = self._buffer(self._cur)
            if self._fill + nbytes > self._capacity - _PAGE:
                raise ValueError(f"a reservation of {nbytes} bytes is larger than this stream's {self._capacity}")
        return buf[1] + self._fill

    def commit(self, nbytes: int) -> None:
        self._fill += nbytes
        self.position += nbytes
        if self._fill >= self._block:
            self._hand_off(self._fill // _PAGE * _PAGE)

    def write(self, data: bytes | memoryview) -> None:
        """Append bytes (the header, a copied tensor): reserve, copy, commit."""
        view = memoryview(data).cast("B")
        for at in range(0, len(view), self._block):
            piece = view[at:at + self._block]
            self.reserve(len(piece))
            m = self._bufs[self._cur][0]
            m[self._fill:self._fill + len(piece)] = piece
            self.commit(len(piece))

    def close(self) -> None:
        """Write what is left and wait for every write (the caller fsyncs and takes the digest)."""
        done: Future[BaseException | None] = Future()
        self.finish(done.set_result)
        error = done.result()
        if error is not None:
            raise error

    def finish(self, then: Callable[[BaseException | None], None]) -> None:
        """Queue what is left and return at once: `then(error)` runs on the hashing pool after the
        file's last write (error: why a write failed or the stream was aborted; None when all
        is written).  The producer goes on with the next file meanwhile."""
        if self.position != self.size:
            raise ValueError(f"finished at {self.position} of {self.size} bytes")
        padded = False
        if self._fill:
            padded = self._hand_off(self._fill, last=True)
        writes = [w for _, w in filter(None, self._inflight)]
        self._inflight = [None] * len(self._inflight)

        def final() -> None:  # after the file's last hash (the lane runs its tasks in order)
            for w in writes:  # the writes run on the other pool, which never waits for this one
                try:
                    w.result()
                except BaseException:  # recorded in self._failed
                    pass
            error = self._failed or (StreamAborted() if self.aborted else None)
            if error is None and padded:
                try:
                    os.ftruncate(self.fd, self.size)  # drop the zero padding of the last write
                except OSError as e:
                    error = self._on_error(e)
            self._release()
            then(error)

        self._lane.submit(final)

    def abort(self) -> None:
        """Stop: queued blocks are skipped (the caller waits for the pools before closing the fd)."""
        self.aborted = True

    # blocks ----------------------------------------------------------------------------------
    def _buffer(self, i: int) -> tuple[mmap.mmap, int]:
        while len(self._bufs) <= i:
            m = mmap.mmap(-1, self._capacity)  # page-aligned, as O_DIRECT needs
            self._bufs.append((m, ctypes.addressof(ctypes.c_char.from_buffer(m))))
        return self._bufs[i]

    def _hand_off(self, nbytes: int, last: bool = False) -> bool:
        """Queue bytes [0, nbytes) of the current buffer (hashed in order on the lane, written on
        the write pool, both at once); carry the rest into the next buffer.  True when the write
        was padded to a page (the last one, with O_DIRECT)."""
        if nbytes <= 0:
            return False
        m, addr = self._buffer(self._cur)
        real = nbytes
        if last and self.direct and nbytes % _PAGE:  # the last write is padded to a page, then cut
            nbytes = _round_up(nbytes)
            ctypes.memset(addr + real, 0, nbytes - real)
        offset = self._flushed
        hashed = self._lane.submit(lambda: self._hash_block(m, real))
        if self._write_pool is not None:
            written = self._write_pool.submit(self._write_block, m, nbytes, offset)
        else:
            written = self._lane.submit(lambda: self._write_block(m, nbytes, offset))
        self._inflight[self._cur] = (hashed, written)
        self._flushed += real
        if last:  # nothing follows: no buffer to wait for, nothing to carry
            self._fill = 0
            return nbytes != real
        nxt = (self._cur + 1) % len(self._inflight)
        waiting = self._inflight[nxt]
        if waiting is not None:  # the next buffer must be hashed and written before it is refilled
            self._inflight[nxt] = None
            for fut in waiting:
                fut.result()
        carry = self._fill - real
        if carry:
            ctypes.memmove(self._buffer(nxt)[1], addr + real, carry)
        self._cur, self._fill = nxt, carry
        return False

    def _hash_block(self, m: mmap.mmap, nbytes: int) -> None:
        if self.aborted or self._failed is not None:
            return
        with memoryview(m) as view:
            self.hasher.update(view[:nbytes])  # releases the GIL

    def _write_block(self, m: mmap.mmap, nbytes: int, offset: int) -> None:
        if self.aborted or self._failed is not None or self.fd < 0:  # fd -1: a stream only hashed
            return
        try:
            with memoryview(m) as view:
                self._pwrite(view[:nbytes], offset)
            if not self.direct:
                start_writeback(self.fd, offset, nbytes)
        except OSError as e:
            self._failed = self._on_error(e)
            raise self._failed from None

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                # the filesystem took the flag but not this write (an alignment it wants larger):
                # plain writes from here on
                self._set_direct(False)
                self.direct = False

    def _set_direct(self, on: bool) -> bool:
        try:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        except OSError:
            return False
        return True

    def _release(self) -> None:
        for m, _ in self._bufs:
            try:
                m.close()
            except BufferError:  # a view is still alive in a failed write: the GC frees it
                pass
        self._bufs.clear()


_SYNC_FILE_RANGE_WRITE = 2
_libc_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing [offset, offset + nbytes) to disk now (Linux); a no-op where unavailable."""
    global _libc_sync_file_range
    if _libc_sync_file_range is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _libc_sync_file_range = fn
        except (AttributeError, OSError):
            _libc_sync_file_range = False  # looked up once: not available here
    if _libc_sync_file_range:
        _libc_sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: errors surface at fsync


_libc_fallocate: Any = None
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.ENODEV}


def allocate(fd: int, nbytes: int) -> None:
    """Allocate the blocks of bytes [0, nbytes) of a new file now (Linux `fallocate`, mode 0: the
    space is reserved, reads give zeros until written).  An O_DIRECT write into allocated blocks
    skips the allocation the filesystem would otherwise do per write: on this ext4 VM 870 MB of
    1 MiB writes, 4 in flight, took 0.47 s instead of 0.87 s (a file sized by ftruncate alone).
    A no-op where the filesystem or libc cannot (never glibc's posix_fallocate, which falls back to
    writing every block); no space raises ENOSPC, before anything is written."""
    global _libc_fallocate
    if _libc_fallocate is None:
        fn: Any  # the libc function, or False where there is none
        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate64
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
        except (AttributeError, OSError):
            fn = False
        _libc_fallocate = fn
    if not _libc_fallocate or nbytes <= 0:
        return
    while _libc_fallocate(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in _NO_FALLOCATE:
            return
        raise OSError(err, os.strerror(err))

