"""One verify across processes, as repack runs (`repacking.distributed`): who checks which rank, the
exchanges, and the one report.

Under torchrun each process verifies the TP ranks it is given, rank r by process r mod the number
of processes (out of `--ranks` when given), with the same rule repack writes them by
(`distributed.ranks_of_process`).  A file of no rank (config, side files) is hashed by the process
of the lowest rank checked.  Every process plans, reads the manifest and routes the samples
itself (cheap, and the same everywhere); the expensive part, reading and undoing the ranks' files,
is split.  A layer's numerics add the ranks' partial sums like the all-reduce, so the processes
exchange each layer's partial sums and rounding intervals (`exchange_layer`) and every process
judges the layer on all of them: the rows are those one process computes.  The round trip's
re-assembly of an expert from every rank, which needs all ranks' tensors in one process, is not
repeated across processes: each rank's slice is compared bit for bit with the checkpoint's by the
process that reads it, and `shard_expert` / `unshard_expert` are inverses.

`checks.merge_reports` makes the one report from the processes' reports.

Every exchange (`distributed.Group.exchange`) carries either the value or the process's failure, so
a fault in one process stops every process at the same exchange with the failing process named.
"""

from __future__ import annotations

from typing import Any

from wna16ctl.errors import UsageError
from wna16ctl.repacking.distributed import SOLO, Group, ranks_of_process


def ranks_to_check(present: list[int], asked: list[int] | None, group: Group = SOLO,
                   what: str = "the output") -> list[int]:
    """The ranks this process checks: those of `asked` (all present when None) that fall to it."""
    if asked is not None:
        absent = [r for r in asked if r not in present]
        if absent:
            raise UsageError(f"--ranks {','.join(map(str, asked))}: rank{'s' if len(absent) != 1 else ''} "
                             f"{', '.join(map(str, absent))} not in {what} (it holds rank"
                             f"{'s' if len(present) != 1 else ''} {', '.join(map(str, present))}); "
                             "pass ranks it holds")
    pool = present if asked is None else asked
    return ranks_of_process(max(pool, default=0) + 1, group.rank, group.world_size, subset=pool)


def hashes_file(rel: str, mine: list[int], checked: list[int]) -> bool:
    """Whether this process hashes manifest file `rel`: a rank's file by the process checking that
    rank, any other file by the process checking the lowest rank checked."""
    head = rel.split("/", 1)[0]
    if head.startswith("rank-") and head[5:].isdigit():
        return int(head[5:]) in mine
    return bool(mine) and min(mine) == min(checked, default=0)


# ---- a layer's numerics across processes -------------------------------------------------------------


def exchange_layer(group: Group, layer: str, sums: Any) -> None:
    """A layer's sums (`checks._LayerSums`) over every process's ranks, in place, as the all-reduce
    adds them: the candidate, the reference, the emulated kernel's rows and the rounding interval's
    running sums (and its count of ranks) added up, the experts exercised united, every process's
    reasons for an incomplete candidate, the kernel's largest bound used, its launches added up."""
    if group.world_size == 1:
        return
    iv = sums.interval
    sent = {"candidate": sums.candidate, "reference": sums.reference, "kernel": sums.kernel,
            "interval": [iv.total.lo, iv.total.hi, iv.total.centre, iv.total.mag], "ranks": iv.ranks,
            "exercised": sorted(sums.exercised), "no_candidate": sums.no_candidate,
            "bound_used": sums.bound_used, "launches": sums.launches}
    got = group.exchange(f"comparing {layer}", lambda: sent)
    added = lambda key: _added([g[key] for g in got])  # noqa: E731 - one quantity over the processes
    sums.candidate, sums.reference, sums.kernel = added("candidate"), added("reference"), added("kernel")
    iv.total.lo, iv.total.hi, iv.total.centre, iv.total.mag = (
        _added([g["interval"][i] for g in got]) for i in range(4))
    iv.ranks = sum(g["ranks"] for g in got)
    sums.exercised = {e for g in got for e in g["exercised"]}
    sums.no_candidate = [reason for g in got for reason in g["no_candidate"]]
    used = [g["bound_used"] for g in got if g["bound_used"] is not None]
    sums.bound_used = max(used) if used else None
    sums.launches = {}
    for g in got:
        for name, count in g["launches"].items():
            sums.launches[name] = sums.launches.get(name, 0) + count


def _added(parts: list[Any]) -> Any:
    """The processes' tensors of one quantity added up, in process order (a new tensor)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
