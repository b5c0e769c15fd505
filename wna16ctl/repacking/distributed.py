"""One repack across processes: the launch torchrun describes, the process group, who writes what.

torchrun starts one process per slot and describes it in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK = the node, MASTER_ADDR/MASTER_PORT = the rendezvous).
A gloo process group is created only when such a launch has more than one process; otherwise
everything runs in this process as before (`SOLO`).  gloo needs no GPU: the group only carries a
few small Python objects (statuses, file hashes), never tensors.

The decisions made here:

* which TP ranks a process writes: rank r is written by process r mod world size (optionally
  out of a `--ranks` subset), so ranks spread evenly whatever the node layout;
* which GPU a process uses with `--device cuda`: its LOCAL_RANK;
* every step of a run is taken together (`Group.together`): each process runs it, then all
  exchange their outcome, so a failure anywhere stops every process at the same step with the
  failing process's one-line message; `Group.exchange` is such a step whose value every process
  receives from every other.  A process that dies makes the others' next exchange fail
  (or torchrun stops them with SIGTERM), which counts as a failure too;
* one error line per node: an error every process of a node knows (exchanged, or a lost
  process) is printed by the node's first process still running; the others exit with the same
  code and say nothing (the exception's `quiet`).  A lost process is named when it can be known:
  a process on this host that is gone without having marked itself stopped in torchrun's store.
  What every process meets alike before the group exists (a failed rendezvous), or a Ctrl-C that
  reaches them all, is likewise said by each node's first process (`joined`, one command's group).
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from wna16ctl.errors import EXIT_BAD_INPUT, UsageError, WnaError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 24 * 3600  # a process with little to write waits for the slowest at the end
TIMEOUT_ENV = "WNA16CTL_DIST_TIMEOUT"
# Test-only: the process whose RANK this names kills itself (SIGKILL) right after its first output
# file is hashed and journaled, to exercise the abort/--resume path.  Unset in normal use.
TEST_KILL_ENV = "WNA16CTL_TEST_KILL_AFTER_FIRST_FILE"


@dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun launch (or a single process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0  # GROUP_RANK

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _hostname() -> str:
    import socket  # only a run of several processes asks (a single process imports nothing for it)

    return socket.gethostname()


def _int_env(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise UsageError(f"WORLD_SIZE={env.get('WORLD_SIZE')} is set but {name} is not: launch with torchrun "
                             "(it sets RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT) or unset WORLD_SIZE")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; launch with torchrun or unset it") from None
    if value < 0:
        raise UsageError(f"{name}={raw!r} is negative; launch with torchrun or unset it")
    return value


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
    """The launch torchrun describes in `env` (os.environ); a single process when WORLD_SIZE is
    unset or 1."""
    env = os.environ if env is None else env
    world = _int_env(env, "WORLD_SIZE", 1)
    if world <= 1:
        return Launch()
    rank = _int_env(env, "RANK")
    local_rank = _int_env(env, "LOCAL_RANK")
    local_world = _int_env(env, "LOCAL_WORLD_SIZE", world)
    node = _int_env(env, "GROUP_RANK", rank // max(local_world, 1))
    if not env.get("MASTER_ADDR"):
        raise UsageError(f"WORLD_SIZE={world} is set but MASTER_ADDR is not: launch with torchrun or unset WORLD_SIZE")
    _int_env(env, "MASTER_PORT")
    if rank >= world or local_rank >= local_world or local_world > world:
        raise UsageError(f"RANK={rank}, LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world} do not fit "
                         f"WORLD_SIZE={world}; launch with torchrun")
    return Launch(rank, world, local_rank, local_world, node)


def ranks_of_process(tp: int, process: int, world_size: int, subset: Sequence[int] | None = None) -> list[int]:
    """The TP ranks process `process` of `world_size` writes: r mod world size = process."""
    pool = range(tp) if subset is None else sorted(set(subset))
    return [r for r in pool if r % world_size == process]


def parse_ranks(value: str, tp: int) -> list[int]:
    """`--ranks 0,3` → [0, 3]: distinct ranks of 0..tp-1, in order."""
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= tp:
            raise UsageError(f"--ranks {value!r}: {part!r} is not a rank of --tp {tp} (0 to {tp - 1}); "
                             "pass comma-separated ranks, e.g. --ranks 0,3")
        if int(part) not in out:
            out.append(int(part))
    return sorted(out)


# ---- the GPU of a process ----------------------------------------------------------------------------


def cuda_index(launch: Launch, device_count: int) -> int:
    """The GPU a process uses: its LOCAL_RANK, which must be one of the visible GPUs."""
    if launch.local_rank >= device_count:
        raise UsageError(
            f"--device cuda: this process has LOCAL_RANK {launch.local_rank} but {device_count} GPU"
            f"{'s are' if device_count != 1 else ' is'} visible; start at most {device_count} processes per node "
            "(torchrun --nproc-per-node) or use --device cpu")
    return launch.local_rank


def select_device(device: str, launch: Launch, *, cuda_usable: Callable[[], bool] | None = None,
                  device_count: Callable[[], int] | None = None,
                  set_device: Callable[[int], None] | None = None) -> str:
    """Make this process's GPU the current CUDA device when the repack runs on one; returns
    "cpu" or "cuda:N".  `--device auto` falls back to the CPU when this LOCAL_RANK has no GPU.
    The callables default to wna16ctl.native.ops / torch.cuda (parameters so that tests need no GPU)."""
    if device == "cpu":
        return "cpu"
    if cuda_usable is None:
        from wna16ctl.native import ops as kernels

        cuda_usable = kernels.cuda_available
    if not cuda_usable():
        if device == "cuda":
            raise UsageError("--device cuda: no usable CUDA GPU and kernel library here; use --device cpu")
        return "cpu"
    if device_count is None or set_device is None:
        import torch

        device_count = device_count or torch.cuda.device_count
        set_device = set_device or torch.cuda.set_device
    count = device_count()
    if device == "auto" and launch.local_rank >= count:
        return "cpu"
    index = cuda_index(launch, count)
    set_device(index)
    return f"cuda:{index}"


# ---- the process group ---------------------------------------------------------------------------------


class PeerFailed(WnaError):
    """Another process of the run failed (or vanished): this one stops too, committing nothing."""

    quiet: bool  # set where it is raised: another process of the node prints the line

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


class StoppedByLauncher(KeyboardInterrupt):
    """torchrun stopped this process (SIGTERM), which it does to the others when one process ends
    early.  An interrupt, so that staging is kept with every finished file journaled; the CLI
    prints `message` (not "interrupted") and exits with `exit_code`."""

    quiet: bool  # set where it is raised: another process of the node prints the line

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


_STOPPING = False  # this process knows how it ends: a later SIGTERM must not cut its one line short


def _first_sentence(e: BaseException) -> str:
    """gloo's messages start with a source location and go on for lines: keep what it says."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).splitlines() or [""])[0])
    return (text.split(". ")[0] or type(e).__name__).rstrip(".")


def outcome_of(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) of a failure, as the other processes are told it."""
    if isinstance(e, WnaError):
        return e.exit_code, e.message
    if isinstance(e, StoppedByLauncher):
        return e.exit_code, e.message
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    return EXIT_BAD_INPUT, f"internal error: {type(e).__name__}: {e}"


class Group:
    """The processes of one run.  Single-process runs use `SOLO`, which exchanges nothing."""

    def __init__(self, launch: Launch, members: list[Launch] | None = None):
        self.launch = launch
        self.members = members or [launch]  # every process's Launch, by rank
        self.hosts: list[tuple[str, int]] = []  # every process's (host name, pid), by rank
        self.store: Any = None  # torchrun's key-value store, where stopping processes mark themselves

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, by rank (pickled over gloo)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:  # gloo: a peer's connection closed, or the timeout
            raise self.lost_contact(_first_sentence(e)) from None
        return out

    # ---- one error line per node -------------------------------------------------------------------

    def _stopping(self) -> None:
        """Mark this process as one that stops knowingly (not a lost one), for the others to read."""
        global _STOPPING
        _STOPPING = True
        if self.store is not None:
            try:
                self.store.set(f"wna16ctl/stopped/{self.rank}", "1")
            except Exception:  # the store may be gone with its host: names stay unknown
                self.store = None

    def _lost(self) -> list[int]:
        """The processes known to be lost: on this host, gone (or a zombie) without having marked
        themselves stopped.  Processes on other hosts cannot be looked at: never listed."""
        here = _hostname()
        lost = []
        for rank, (host, pid) in enumerate(self.hosts):
            if rank == self.rank or host != here or not _process_gone(pid):
                continue
            try:
                marked = self.store is not None and self.store.check([f"wna16ctl/stopped/{rank}"])
            except Exception:
                marked = False
            if not marked:
                lost.append(rank)
        return lost

    def _lost_soon(self, wait_s: float = 2.0) -> list[int]:
        """`_lost`, looked at again for up to `wait_s` while it finds nothing: a killed process's
        connections close while it is still exiting, a moment before it shows as ended."""
        deadline = time.monotonic() + wait_s
        while True:
            lost = self._lost()
            here = _hostname()
            if lost or time.monotonic() >= deadline or not any(
                    host == here for rank, (host, _) in enumerate(self.hosts) if rank != self.rank):
                return lost
            time.sleep(0.05)

    def _speaks_after_loss(self, lost: list[int]) -> bool:
        """Whether this process prints the node's one line: it is the node's first process not lost."""
        running = [m for m in self.node_members(self.launch.node) if m.rank not in lost]
        return min(running, key=lambda m: (m.local_rank, m.rank)).rank == self.rank

    def _other_of_two(self) -> list[int]:
        """Of two processes on different hosts, the other one: the only one that can be lost."""
        other = 1 - self.rank
        if self.world_size == 2 and len(self.hosts) == 2 and self.hosts[other][0] != _hostname():
            return [other]
        return []

    def lost_contact(self, detail: str) -> PeerFailed:
        """The error of a process whose exchange with the others failed: names the lost process
        when it can be known (a process of this host that ended; the other one of two)."""
        self._stopping()
        gone = self._lost_soon()
        lost = gone or self._other_of_two()
        if len(gone) == 1:
            error = PeerFailed(f"process {self.rank} lost contact with process {gone[0]}: it was killed or crashed "
                               "(torchrun's report says how)")
        else:
            whom = f"process {lost[0]}" if len(lost) == 1 else "another process of the run"
            error = PeerFailed(f"process {self.rank} lost contact with {whom} ({detail}): it was killed or crashed, "
                               f"or took longer than ${TIMEOUT_ENV} seconds")
        error.quiet = not self._speaks_after_loss(lost)
        return error

    def stopped_by_launcher(self) -> StoppedByLauncher:
        """The interrupt of a process torchrun stopped (SIGTERM) before it noticed a loss itself."""
        self._stopping()
        lost = self._lost_soon()
        if len(lost) == 1:
            message = (f"process {self.rank} lost contact with process {lost[0]}: it was killed or crashed, and "
                       "torchrun stopped the others (its report says how)")
        else:
            message = (f"process {self.rank} was stopped by torchrun (SIGTERM): another process of the run ended "
                       "early, or the job was cancelled (torchrun's report says which)")
        stop = StoppedByLauncher(message)
        stop.quiet = not self._speaks_after_loss(lost)
        return stop

    def shared(self, error: BaseException) -> BaseException:
        """`error`, which every process of this node knows (exchanged): the node's first process
        prints it, the others stay quiet.  Alone, it is simply this process's error."""
        global _STOPPING
        if self.world_size == 1:
            return error
        _STOPPING = True
        error.quiet = self.rank != self.node_owner(self.launch.node)  # type: ignore[attr-defined]  # a mark any exception can carry; the CLI reads it with getattr
        return error

    def together(self, step: str, fn: Callable[[], T]) -> T:
        """Run `fn` here, then learn every process's outcome: raise this process's own error, or
        PeerFailed naming the first process that failed; return `fn`'s value when all succeeded
        (the value stays in this process)."""
        return self._run_gathered(step, fn, share=False)[0]

    def exchange(self, step: str, fn: Callable[[], T]) -> list[T]:
        """`together`, and every process's value is handed to every process: the values, by process."""
        return self._run_gathered(step, fn, share=True)[1]

    def _run_gathered(self, step: str, fn: Callable[[], T], *, share: bool) -> tuple[T, list[Any]]:
        """Run `fn` here and gather every process's outcome: (this process's value, every process's
        value by process, or None each unless `share`).  A failure anywhere stops every process
        here: this process's own error, or PeerFailed naming the first process that failed.  Each
        process sends ("error", its outcome) or (the kind of step, its value): a process at a step
        of the other kind is out of step with this one."""
        if self.world_size == 1:
            alone = fn()
            return alone, [alone if share else None]
        kind = "exchange" if share else "together"
        error: BaseException | None = None
        value: Any = None
        try:
            value = fn()
        except BaseException as e:  # re-raised below, after the others know
            error = e
        try:
            got = self.all_gather(("error", outcome_of(error)) if error is not None
                                  else (kind, value if share else None))
        except PeerFailed:
            if error is not None:  # this process's own error says more than the lost peer
                raise error from None
            raise
        if error is not None:
            raise self.shared(error)
        said: str
        payload: Any
        for process, message in enumerate(got):
            said, payload = message if isinstance(message, tuple) and len(message) == 2 else ("", None)
            if said == "error":
                code, text = payload
                raise self.shared(PeerFailed(f"process {process} failed while {step}: {text}", code))
            if said != kind:
                raise self.shared(PeerFailed(f"process {process} is not {step}: the processes are out of step; "
                                             "launch every process with the same command", EXIT_BAD_INPUT))
        return value, [payload for _, payload in got]

    def node_members(self, node: int) -> list[Launch]:
        return [m for m in self.members if m.node == node]

    def node_owner(self, node: int) -> int:
        """The process that owns (and commits) a node's output with --node-local: local rank 0."""
        return min(self.node_members(node), key=lambda m: (m.local_rank, m.rank)).rank

    def close(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


SOLO = Group(Launch())


def init_group(launch: Launch | None = None) -> Group:
    """The group of this launch: SOLO for one process, else a gloo group over torchrun's
    rendezvous (MASTER_ADDR:MASTER_PORT) with every member's Launch exchanged."""
    launch = launch or launch_from_env()
    if not launch.distributed:
        return SOLO
    import torch.distributed as dist

    raw = os.environ.get(TIMEOUT_ENV)
    try:
        timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    try:
        import datetime

        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # the rendezvous failed: one line
        raise UsageError(f"process {launch.rank}: cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')} ({_first_sentence(e)}); "
                         "check torchrun's --master-addr/--master-port or --rdzv-endpoint") from None
    global _STOPPING
    _STOPPING = False  # a new run: a SIGTERM stops it again
    group = Group(launch)
    try:
        group.store = dist.distributed_c10d._get_default_store()
    except Exception:  # a private accessor: without it lost processes go unnamed
        group.store = None
    _stop_on_sigterm(group)
    everyone = group.all_gather((launch, _hostname(), os.getpid()))
    group.members = [m for m, _, _ in everyone]
    group.hosts = [(host, pid) for _, host, pid in everyone]
    return group


def launch_or_single(env: Mapping[str, str] | None = None) -> Launch:
    """The launch `env` (os.environ) describes, for choosing what this process prints before it
    joins the others; a single process where the description is broken (`joined` refuses it)."""
    try:
        return launch_from_env(env)
    except UsageError:
        return Launch()


@contextmanager
def joined() -> Iterator[Group]:
    """The group of this process's launch (`init_group`) for the length of one command, closed at
    its end.  A broken launch is refused by every process (none knows which is a node's first).
    What every process of a launch meets alike, an error before the group exists (a failed
    rendezvous) or a Ctrl-C that reaches them all, is said once per node: every process but the
    node's first is marked `quiet`."""
    launch, group = Launch(), SOLO
    try:
        launch = launch_from_env()
        group = init_group(launch)
        yield group
    except BaseException as e:  # marked, then re-raised
        alike = group is SOLO or (isinstance(e, KeyboardInterrupt) and not hasattr(e, "message"))
        if launch.distributed and alike and not hasattr(e, "quiet"):
            e.quiet = launch.local_rank != 0  # type: ignore[attr-defined]  # a mark any exception can carry; the CLI reads it with getattr
        raise
    finally:
        group.close()


def _process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie counts: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def _stop_on_sigterm(group: Group) -> None:
    """torchrun stops the other processes with SIGTERM when one fails: make that an interrupt,
    so staging is kept and the journal records every finished file, which says what was lost.
    Once this process knows how it ends, a SIGTERM changes nothing (its one line is printed whole)."""
    def handler(signum: int, frame: Any) -> None:
        if not _STOPPING:
            raise group.stopped_by_launcher()

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (an embedding application): leave its handlers alone
        pass


def kill_after_first_file_for_tests(launch: Launch, flush: Callable[[], None]) -> None:
    """Test-only hook (TEST_KILL_ENV): kill this process after its first finished file, once
    `flush` has hashed and journaled it.  Does nothing unless the variable names this RANK."""
    if os.environ.get(TEST_KILL_ENV) != str(launch.rank):
        return
    flush()
    os.kill(os.getpid(), signal.SIGKILL)
