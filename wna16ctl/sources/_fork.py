"""Split pure-Python work over two processes (fork + pipe) when that is safe and worth it.

`inspect` on the largest checkpoints spends its time in JSON decoding and header checks, all of it
GIL-bound.  A forked child does the second half of a list while the parent does the first; the
child's results come back marshalled (or pickled).  Only used in processes without threads (not
after torch is imported), and only on platforms with fork; otherwise the work runs serially.
"""

from __future__ import annotations

import marshal
import os
import signal
import sys
import threading
from typing import Any, Callable, Sequence, TypeVar

from wna16ctl.errors import BadInput

T = TypeVar("T")
R = TypeVar("R")


def _can_fork() -> bool:
    return (
        hasattr(os, "fork")
        and "torch" not in sys.modules  # its thread pools must not be forked mid-use
        and threading.active_count() == 1
        and os.environ.get("WNA16CTL_NO_FORK") != "1"
    )


def split_map(fn: Callable[[T], R], items: Sequence[T], *, min_items: int = 8, use_marshal: bool = False,
              extra: Callable[[], Any] | None = None, child_share: float = 0.5,
              extra_in_parent: bool = False) -> tuple[list[R], Any]:
    """`([fn(x) for x in items], extra())`, the second half and `extra` computed in a forked child
    when possible (`extra_in_parent`: `extra` runs in this process, after its own half, while the
    child is still at work).

    Worth it when results are small compared with the work (a shard's summary from its decoded
    header), not for bulky results (the decoded header itself: sending it costs as much).
    A `BadInput` is re-raised in the parent with its message (the parent's own first).
    """
    if len(items) < min_items or not _can_fork():
        side = extra() if extra is not None else None
        return [fn(x) for x in items], side
    half = len(items) - int(len(items) * child_share)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: compute the second half, send it, leave without cleanup handlers
        os.close(rfd)
        try:
            try:
                side = extra() if extra is not None and not extra_in_parent else None
                # ("ok", [results, side]), or ("bad" / "err", message)
                payload: tuple[str, Any] = ("ok", [[fn(x) for x in items[half:]], side])
            except BadInput as e:
                payload = ("bad", e.message)
            except BaseException as e:  # reported by the parent
                payload = ("err", f"{type(e).__name__}: {e}")
            if use_marshal and payload[0] == "ok":
                data = b"M" + marshal.dumps(payload)
            else:
                import pickle  # only what marshal cannot carry

                data = b"P" + pickle.dumps(payload, protocol=5)
            with os.fdopen(wfd, "wb") as w:
                w.write(data)
        finally:
            os._exit(0)
    os.close(wfd)
    first_error: BadInput | None = None
    try:
        own_side = None
        try:
            first = [fn(x) for x in items[:half]]
            if extra is not None and extra_in_parent:
                own_side = extra()
        except BadInput as e:
            first, first_error = [], e
        with os.fdopen(rfd, "rb") as r:
            data = r.read()
    except BaseException:
        # anything else (a bug, Ctrl-C): the child may be blocked writing into the pipe
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    os.waitpid(pid, 0)
    if first_error is not None:
        raise first_error
    if not data:
        raise RuntimeError("worker process died")
    if data[:1] == b"M":
        status, value = marshal.loads(data[1:])
    else:
        import pickle

        status, value = pickle.loads(data[1:])
    if status == "bad":
        raise BadInput(value)
    if status == "err":
        raise RuntimeError(value)
    return first + list(value[0]), own_side if extra_in_parent else value[1]
