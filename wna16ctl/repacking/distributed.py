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
  failing process's one-line message.  A process that dies makes the others' next exchange fail
  (or torchrun stops them), which counts as a failure too.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

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

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def _first_sentence(e: BaseException) -> str:
    """gloo's messages start with a source location and go on for lines: keep what it says."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).splitlines() or [""])[0])
    return (text.split(". ")[0] or type(e).__name__).rstrip(".")


def outcome_of(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) of a failure, as the other processes are told it."""
    if isinstance(e, WnaError):
        return e.exit_code, e.message
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted"
    return EXIT_BAD_INPUT, f"internal error: {type(e).__name__}: {e}"


class Group:
    """The processes of one run.  Single-process runs use `SOLO`, which exchanges nothing."""

    def __init__(self, launch: Launch, members: list[Launch] | None = None):
        self.launch = launch
        self.members = members or [launch]  # every process's Launch, by rank

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
            raise PeerFailed(f"process {self.rank}: lost contact with another process of the run ({_first_sentence(e)}); "
                             f"it was killed or crashed, or took longer than ${TIMEOUT_ENV} seconds") from None
        return out

    def together(self, step: str, fn: Callable[[], T]) -> T:
        """Run `fn` here, then learn every process's outcome: raise this process's own error, or
        PeerFailed naming the first process that failed; return `fn`'s value when all succeeded."""
        if self.world_size == 1:
            return fn()
        error: BaseException | None = None
        value: Any = None
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
        try:
            outcomes = self.all_gather(None if error is None else outcome_of(error))
        except PeerFailed:
            if error is not None:  # this process's own error says more than the lost peer
                raise error from None
            raise
        if error is not None:
            raise error
        for process, outcome in enumerate(outcomes):
            if outcome is not None:
                code, message = outcome
                raise PeerFailed(f"process {process} failed while {step}: {message}", code)
        return value

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
        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - the rendezvous failed: one line
        raise UsageError(f"process {launch.rank}: cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')} ({_first_sentence(e)}); "
                         "check torchrun's --master-addr/--master-port or --rdzv-endpoint") from None
    _stop_on_sigterm()
    group = Group(launch)
    group.members = group.all_gather(launch)
    return group


def _stop_on_sigterm() -> None:
    """torchrun stops the other processes with SIGTERM when one fails: make that an interrupt,
    so staging is kept and the journal records every finished file."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

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
