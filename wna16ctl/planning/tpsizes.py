"""Tensor-parallel sizes: the one parser of `--tp` and the one check of a size against a checkpoint.

Every command (and the Python API) goes through these two functions, so `inspect`, `repack` and
`verify` accept the same spellings and refuse the same sizes with the same words.
"""

from __future__ import annotations

from typing import Iterable

from wna16ctl.sources.moe import MoELayer
from wna16ctl.errors import UsageError

MAX_TP = 4096  # far above any deployment; catches typos like 40960 before anything is planned


def parse_tp_list(value: str | int | Iterable[int], *, single: bool = False) -> tuple[int, ...]:
    """`"1,2, 4"` / `4` / `[1, 2]` -> `(1, 2, 4)`: integers >= 1, duplicates dropped in order.

    `single` (repack: one size per output) refuses more than one size.
    """
    if isinstance(value, int):
        items: list[object] = [value]
    elif isinstance(value, str):
        items = [x.strip() for x in value.split(",")]
        if any(not x for x in items):
            raise UsageError(f"--tp {value!r}: empty entry; write sizes separated by commas, e.g. 1,2,4,8")
    else:
        items = list(value)
    sizes: list[int] = []
    for x in items:
        n = int(str(x)) if not isinstance(x, bool) and str(x).isdigit() else None
        if n is None or n < 1:
            raise UsageError(f"--tp {x!s}: not a positive integer; TP sizes are whole numbers >= 1, e.g. 1,2,4,8")
        if n > MAX_TP:
            raise UsageError(f"--tp {n}: more than {MAX_TP} ranks; check the value")
        if n not in sizes:
            sizes.append(n)
    if not sizes:
        raise UsageError("--tp: no TP size given; e.g. --tp 2")
    if single and len(sizes) > 1:
        raise UsageError(f"--tp {','.join(map(str, sizes))}: this command writes one TP size at a time; pass one")
    return tuple(sizes)


def check_tp_sizes(layers: Iterable[MoELayer], tps: Iterable[int], ep: bool) -> None:
    """Refuse sizes that leave ranks with nothing of a layer: more TP ranks than intermediate
    columns (without EP).  Under EP a rank may hold no expert; that still loads."""
    if ep:
        return
    for layer in layers:
        for tp in tps:
            if tp > layer.intermediate_size:
                raise UsageError(
                    f"--tp {tp}: more ranks than the intermediate size {layer.intermediate_size} of {layer.prefix}; "
                    f"each rank needs at least one column (at most --tp {layer.intermediate_size}, or use --ep)"
                )
