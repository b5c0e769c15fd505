"""Ctrl-C at a moment of the program's choosing.

Python raises KeyboardInterrupt in the main thread at whatever bytecode it is running.  While
worker threads run native calls on memory the main thread owns (mapped shard windows, output
buffers), or while a thread pool is starting a thread, an exception at an arbitrary point can free
that memory under a running call or leave a pool half set up.  Inside `deferred()` a Ctrl-C is
only recorded; it is raised at the next `check()` (a point where everything started has been
waited for) or when the block ends.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

_pending = False  # a Ctrl-C arrived inside a deferred block and was not raised yet
_depth = 0  # deferred blocks open (they nest)


def _record(signum: int, frame: Any) -> None:
    global _pending
    _pending = True


class Deferral:
    """What `deferred()` yields: `forget()` drops a Ctrl-C that arrived inside the block (the work
    it would have stopped is done)."""

    def forget(self) -> None:
        global _pending
        _pending = False


@contextmanager
def deferred() -> Iterator[Deferral]:
    """Within the block a Ctrl-C is recorded instead of raised; `check()` raises it, and so does
    the end of the block (unless another exception is on its way out, or `forget()` was called).

    Only the main thread receives signals: elsewhere, or when the program handles SIGINT itself,
    this changes nothing."""
    global _depth, _pending
    own = (threading.current_thread() is threading.main_thread() and _depth == 0
           and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if own:
        _pending = False
        signal.signal(signal.SIGINT, _record)
    _depth += 1
    ok = False
    try:
        yield Deferral()
        ok = True
    finally:
        _depth -= 1
        if own:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _pending:
                _pending = False
                if ok:
                    raise KeyboardInterrupt


def check() -> None:
    """Raise the Ctrl-C a deferred block recorded, if any (call where nothing is half done)."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait until every future has finished, even when a Ctrl-C arrives meanwhile (raised once
    they all have): what they run may use memory the caller frees next."""
    interrupted = False
    for fut in futures:
        while True:
            try:
                fut.exception()
                break
            except KeyboardInterrupt:
                interrupted = True
            except BaseException:  # cancelled: it will not run
                break
    if interrupted:
        raise KeyboardInterrupt
