"""`convert`'s data path without torch: each projection's stored tensors read into reused numpy
buffers and put in the canonical form word by word (`sources.formats.word_forms`), written straight
into the output stream's blocks (a transpose lands there in one copy); every other tensor read from
the source into those blocks in pieces.  The stream hashes and writes a block while the next is
filled (`output.filestream`).

The reads run on the converting thread, into buffers that stay in its cache until the transposes
read them (the kernel's readahead keeps the source coming; a reading thread of its own, 4 MiB
ahead, cost more CPU than it overlapped: its buffers crossed between the cores and the caches).

It writes the same bytes as the torch path (`write._produce`, the reference).  A projection whose check fails,
or whose tensors are not in the form the word transforms take, goes through the reference (torch
imported then only), which names the tensor and the reason or converts it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from math import prod
from typing import Any, Callable, Optional

import numpy as np

from wna16ctl.conversion.plan import ConversionPlan, Projection
from wna16ctl.dtypes import NUMPY_WORDS, ST_BITS
from wna16ctl.errors import BadInput
from wna16ctl.native import build
from wna16ctl.native.build import WNA16_EFAULT, KernelError
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, SHAPE, ZERO_POINTS, word_forms
from wna16ctl.sources.formats.compressed_tensors import NAMES

CHUNK = 1 << 20  # the largest piece written or copied at once (the stream's block)
# a transposed copy's tile: 64 rows of the source by 128 of its columns (32 KiB of int32: in L1)
_TILE_ROWS, _TILE_COLS = 128, 64
_ROLES = (CODES, SCALES, ZERO_POINTS, G_IDX)  # the order a projection's stored tensors are read in (as write.py)


def takes(plan: ConversionPlan) -> bool:
    """Whether the target is compressed-tensors (the form the word transforms write) and every
    projection's scheme is one they convert."""
    from wna16ctl.sources import formats

    return plan.target is formats.DEFAULT and all(word_forms.handles(p.scheme) for p in plan.projections.values())


def max_reserve(f: Any) -> int:
    """The largest piece `produce` reserves in the stream of planned file `f`: a chunk, or one row
    of a converted tensor where a row is larger."""
    rows = [prod(t.shape[1:]) * ST_BITS[t.dtype] // 8 for t in f.tensors if len(t.shape) > 1]
    return max([CHUNK, *rows])


Written = dict[str, list[tuple[str, str, list[int]]]]  # module -> its planned (name, dtype, shape), in order


def written_of(plan: ConversionPlan) -> Written:
    """Each projection's planned tensors, computed once for all files."""
    return {m: p.written() for m, p in plan.projections.items()}


def produce(plan: ConversionPlan, f: Any, reader: Any, stream: Any, advance: Callable[[int], Any],
            reference: Callable[..., list[tuple[str, Any]]], written: Written, check: Callable[[], None]) -> None:
    """Write planned file `f` through `stream` after its header; `check()` between pieces (it
    raises to stop: a Ctrl-C, another producer's error).  `reference(p, fmt, reader, buffers)`: the
    torch path's (name, bytes) of a projection, for those the word transforms decline; `written`:
    `written_of(plan)`."""
    from wna16ctl.sources import formats

    fmt = formats.of(plan.checkpoint.config.quant)
    transpose = transposer()
    mapping = None if transpose is _numpy_transpose else _Mapping(reader)
    by_reference = lambda p, raw: reference(p, fmt, _Replay(reader, raw, mapping), {})  # noqa: E731 - the torch path on the bytes read
    buffers: dict[str, np.ndarray] = {}
    for unit in _units(plan, f, written):
        check()
        p, roles = unit
        if p is None:  # a piece copied: read straight into the stream's block
            (_, info), = roles
            reader.read_into(info, memoryview(_room(stream, info.nbytes)).cast("B"))
            stream.commit(info.nbytes)
            advance(info.nbytes)
            continue
        mapped = mapping if mapping is not None and word_forms.codes_moved_only(p.scheme) else None
        try:
            _convert(p, written[p.module], _read(unit, reader, buffers, mapped), stream, by_reference, transpose)
        except KernelError as e:
            if e.code != WNA16_EFAULT:
                raise
            raise _truncated(dict(roles)[CODES]) from None
        finally:
            if mapped is not None:
                mapped.release()
        advance(sum(prod(shape) * ST_BITS[dtype] // 8 for _, dtype, shape in written[p.module]))


Unit = tuple[Optional[Projection], list[tuple[str, Any]]]  # (the projection, or None for a piece copied; (role, TensorInfo) read)


def _units(plan: ConversionPlan, f: Any, written: Written) -> list[Unit]:
    """What is read for file `f`, in order: each projection's stored tensors where its converted
    tensors start (in `_ROLES` order, as write.py reads them), every other tensor in pieces."""
    files = plan.checkpoint.files
    first = {w[0][0]: p for p, w in ((p, written[p.module]) for p in plan.projections.values())}
    out: list[Unit] = []
    done: set[str] = set()
    for t in f.tensors:
        if t.name in done:
            continue
        p = first.get(t.name)
        if p is not None:
            out.append((p, [(r, files.info(p.stored[r])) for r in _ROLES if r in p.stored]))
            done.update(name for name, _, _ in written[p.module])
            continue
        info = files.info(t.name)
        for start in range(info.start, info.end, CHUNK):
            piece = type(info)(info.name, info.dtype, info.shape, info.file, start, min(start + CHUNK, info.end))
            out.append((None, [("", piece)]))
    return out


def _read(unit: Unit, reader: Any, slot: dict[str, np.ndarray],
          mapping: Optional["_Mapping"]) -> dict[str, tuple[Any, np.ndarray]]:
    """The unit's tensors, role -> (TensorInfo, its bytes in `slot[role]`, grown as needed): fresh
    storage for every tensor would cost its page faults.  With a `mapping`, the codes are not read
    but mapped: only the native transpose reads them, straight from the page cache (no copy)."""
    out = {}
    for role, info in unit[1]:
        if mapping is not None and role == CODES:
            out[role] = (info, mapping.map(info))
            continue
        if role not in slot or slot[role].size < info.nbytes:
            slot[role] = np.empty(info.nbytes, dtype=np.uint8)
        raw = slot[role][:info.nbytes]
        reader.read_into(info, raw.data)
        out[role] = (info, raw)
    return out


def _room(stream: Any, nbytes: int) -> Any:
    """The next `nbytes` of the stream's block, to be filled in place and then committed."""
    return _at(stream.reserve(nbytes), nbytes)


def _at(address: int, nbytes: int) -> Any:
    """The `nbytes` of memory at `address`, as a buffer."""
    return (ctypes.c_char * nbytes).from_address(address)


def _convert(p: Projection, written: list[tuple[str, str, list[int]]], raw: dict[str, tuple[Any, np.ndarray]],
             stream: Any, by_reference: Callable, transpose: Transpose) -> None:
    """The projection's pack-quantized tensors (`written`: name, dtype, shape) written in the planned
    order; through the reference where the word transforms decline or a result is not the planned
    dtype and shape."""
    stored = {}
    for role, (info, data) in raw.items():
        word = np.dtype(NUMPY_WORDS[info.dtype]) if info.dtype in NUMPY_WORDS else None
        if word is None or info.nbytes != prod(info.shape) * word.itemsize:
            return _reference(p, raw, stream, by_reference)
        stored[role] = (info.dtype, data.view(word).reshape(info.shape))
    canon = word_forms.canonical_words(stored, p.scheme, p.k)
    if canon is None:
        return _reference(p, raw, stream, by_reference)
    canon[SHAPE] = ("I64", np.array([p.n, p.k], dtype="<i8"))
    roles = {NAMES.tensor(p.module, r): r for r in (*_ROLES, SHAPE)}
    planned = []
    for name, dtype, shape in written:
        got = canon.get(roles.get(name, ""))
        if got is None or got[0] != dtype or list(got[1].shape) != list(shape):
            return _reference(p, raw, stream, by_reference)
        planned.append(got[1])
    for array in planned:
        _put(stream, array, transpose)
    return None


Transpose = Callable[[int, np.ndarray], None]  # (address, transposed 2-D view): its C-order bytes written there


def transposer() -> Transpose:
    """How `_put` writes a transposed view: the native host library's tiles where it is built
    (`native.build.host_lib`; the level of `native.simd.resolve`: AVX2 words 2-3x numpy's tiled
    copies here), else numpy's copies in tiles (`WNA16CTL_NO_NATIVE=1`, no compiler).  The same bytes."""
    from wna16ctl.native import simd

    lib = build.host_lib()
    if lib is None:
        return _numpy_transpose
    level, _ = simd.resolve()
    native = lib.wna16_transpose_host

    def transpose(address: int, view: np.ndarray) -> None:
        cols, rows = view.shape  # view = block.T, block [rows, cols] with its rows `ld` elements apart
        if view.strides[0] != view.itemsize or view.itemsize not in (2, 4):
            return _numpy_transpose(address, view)
        rc = native(view.ctypes.data, view.strides[1] // view.itemsize, rows, cols, address, view.itemsize, level)
        if rc:
            raise KernelError(f"wna16_transpose_host: {lib.wna16_last_error().decode(errors='replace')}", rc)
        return None

    return transpose


def _put(stream: Any, array: np.ndarray, transpose: Transpose) -> None:
    """`array` (a view, possibly transposed) copied into the stream's blocks in C order, rows at a time."""
    rows = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
    row_bytes = rows.shape[1] * rows.itemsize
    if row_bytes == 0:
        return
    step = max(1, CHUNK // row_bytes)
    for r0 in range(0, rows.shape[0], step):
        part = rows[r0:r0 + step]
        if part.flags.c_contiguous:
            np.copyto(np.ndarray(part.shape, dtype=part.dtype, buffer=_room(stream, part.nbytes)), part)
        else:
            transpose(stream.reserve(part.nbytes), part)
        stream.commit(part.nbytes)


def _numpy_transpose(address: int, view: np.ndarray) -> None:
    """The transposed 2-D `view` written at `address` by numpy, in tiles whose source rows stay in
    the cache (numpy's own strided copy of a whole projection took twice as long in isolation)."""
    dst = np.ndarray(view.shape, dtype=view.dtype, buffer=_at(address, view.nbytes))
    rows, cols = dst.shape
    for c0 in range(0, cols, _TILE_COLS):
        for r0 in range(0, rows, _TILE_ROWS):
            np.copyto(dst[r0:r0 + _TILE_ROWS, c0:c0 + _TILE_COLS], view[r0:r0 + _TILE_ROWS, c0:c0 + _TILE_COLS])


class _Mapping:
    """Tensors mapped from the checkpoint's shards (`wna16_map_file`, populated) until `release`:
    the native transposes read them in place, guarded against a shard that shrinks meanwhile
    (WNA16_EFAULT instead of SIGBUS).  One projection's codes at a time: the mapped pages count
    in the process's resident memory while mapped."""

    def __init__(self, reader: Any):
        from wna16ctl.native import build

        self._reader = reader
        self._lib = build.loaded_host_lib()
        self._maps: list[tuple[int, int]] = []
        self.names: set[str] = set()

    def map(self, info: Any) -> np.ndarray:
        fd = self._reader.fd(info.file)
        if os.fstat(fd).st_size < info.end:
            raise _truncated(info)
        start = info.start - info.start % mmap.PAGESIZE
        err = ctypes.c_int32(0)
        addr = self._lib.wna16_map_file(fd, start, info.end - start, ctypes.byref(err))
        if not addr:
            raise BadInput(f"{info.file}: cannot be mapped ({os.strerror(err.value)}); check the file and run again")
        self._maps.append((addr, info.end - start))
        self.names.add(info.name)
        return np.ndarray(info.nbytes, dtype=np.uint8, buffer=_at(addr + info.start - start, info.nbytes))

    def release(self) -> None:
        for addr, length in self._maps:
            self._lib.wna16_unmap_file(addr, length)
        self._maps.clear()
        self.names.clear()


def _truncated(info: Any) -> BadInput:
    return BadInput(f"{info.file}: ends before tensor {info.name} does (the shard was truncated or replaced after "
                    "planning); restore the file and run again")


class _Replay:
    """A reader that serves the bytes already read (the reference converts them without reading
    twice); mapped ones it reads again (only the guarded native code reads a mapping)."""

    def __init__(self, reader: Any, raw: dict[str, tuple[Any, np.ndarray]], mapping: Optional[_Mapping]):
        self.files = reader.files
        self._reader = reader
        mapped = mapping.names if mapping is not None else set()
        self._bytes = {info.name: data for info, data in raw.values() if info.name not in mapped}

    def read_into(self, info: Any, view: memoryview) -> None:
        if info.name not in self._bytes:
            return self._reader.read_into(info, view)
        view.cast("B")[:info.nbytes] = self._bytes[info.name].data.cast("B")
        return None


def _reference(p: Projection, raw: dict[str, tuple[Any, np.ndarray]], stream: Any, by_reference: Callable) -> None:
    """The projection converted by the torch path from the bytes read (its BadInput names the tensor)."""
    for _, data in by_reference(p, raw):
        stream.write(data)
