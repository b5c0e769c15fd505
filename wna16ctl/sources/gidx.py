"""Act-order: gate and up must carry the same g_idx.

vLLM keeps one g_idx for the fused w13 parameter, so a checkpoint whose gate_proj and up_proj
g_idx differ would dequantize one of them with the other's groups.  `inspect` reports this as an
error and `repack` refuses it, both through `gate_up_g_idx_mismatch`.  The g_idx vectors are
small (K int32 per projection); they are read with plain `pread` so `inspect` stays torch-free.
"""

from __future__ import annotations

import os
import sys
from array import array

from wna16ctl.sources.formats import G_IDX
from wna16ctl.sources.headers import CheckpointFiles, TensorInfo
from wna16ctl.sources.moe import MoELayer
from wna16ctl.dtypes import ARRAY_TYPECODES
from wna16ctl.errors import BadInput

_TYPECODE = ARRAY_TYPECODES


def _read(fds: dict[str, int], info: TensorInfo) -> bytes:
    key = str(info.file)
    if key not in fds:
        try:
            fds[key] = os.open(info.file, os.O_RDONLY)
        except OSError as e:
            raise BadInput(f"{info.file}: cannot open ({e.strerror})") from None
    data = os.pread(fds[key], info.nbytes, info.start)
    if len(data) != info.nbytes:
        raise BadInput(f"{info.file}: truncated inside tensor {info.name}; re-download the shard")
    return data


def _values(info: TensorInfo, data: bytes) -> array:
    values = array(_TYPECODE[info.dtype])
    values.frombytes(data)
    if sys.byteorder != "little":  # safetensors is little-endian
        values.byteswap()
    return values


def gate_up_g_idx_mismatch(files: CheckpointFiles, layer: MoELayer) -> str | None:
    """The first expert of `layer` whose gate and up g_idx differ, described with the fix; None
    when every pair agrees, the layer has no act-order, or old writers left g_idx out (then both
    are k // group_size)."""
    if layer.scheme is None or not layer.scheme.act_order:
        return None
    fds: dict[str, int] = {}
    try:
        for e in range(layer.num_experts):
            names = [layer.stored_name(e, role, G_IDX) for role in ("gate", "up")]
            if not all(n in files for n in names):
                continue
            infos = [files.info(n) for n in names]
            if any(i.dtype not in _TYPECODE for i in infos):
                continue  # the header scan already refused other dtypes
            gate, up = (_read(fds, i) for i in infos)
            if infos[0].dtype == infos[1].dtype and gate == up:
                continue
            a, b = _values(infos[0], gate), _values(infos[1], up)
            if list(a) == list(b):
                continue
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{names[0]} and {names[1]} differ (first at column {k}); vLLM keeps one g_idx for "
                    "w13 and would mis-scale gate_proj. Re-quantize with a shared act-order for gate and up")
    finally:
        for fd in fds.values():
            os.close(fd)
    return None
