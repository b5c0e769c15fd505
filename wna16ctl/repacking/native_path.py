"""repack's native data path: torch-free, for the layers it covers.

A chunk of experts is either mapped in place (`map`: read-only shared windows of the shards, so
the bytes are read from the page cache itself; the streamed path, wna16ctl.repacking.pipeline._produce_streamed)
or read (`read`, pread) into a reused buffer in the order the torch path reads it (so the source
digest is the same; the positioned-write path).  Its scales are checked finite, and every pending
rank's Marlin tensors are built by the host library (`wna16_marlin_rank_host` in
kernels/host.cpp) straight from the checkpoint's N-first words, into the output files' blocks or
into reused buffers.  The native calls that read a mapping survive a shard truncated meanwhile
(they return WNA16_EFAULT instead of the process dying of SIGBUS), which becomes the one-line
error a truncated shard gets everywhere.

It covers Marlin layers that are symmetric, without act-order or tile padding, whose scales are
already in the model dtype; its bytes equal the torch path's (tests/repacking/test_native_path.py).  Every
other layer goes through `wna16ctl.layout` (`unsupported` says why).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any, Mapping

from wna16ctl.native import build as native
from wna16ctl.sources.headers import CheckpointFiles, TensorInfo
from wna16ctl.sources.moe import ROLE_ORDER
from wna16ctl.sources.raw import RawReader
from wna16ctl.dtypes import ST_SIZES
from wna16ctl.errors import BadInput
from wna16ctl.layout.registry import expert_shapes
from wna16ctl.layout.spec import MARLIN, RankLayout, marlin_scales_grouped, w2_scale_size_k

_SCALE_KIND = {"F16": 0, "BF16": 1, "F32": 2}  # wna16_first_nonfinite's kinds
_MAP_GAP = 1 << 20  # tensors at most this far apart share a mapped window
_OUT_ORDER = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")  # the builder's outputs  # per projection, in TensorReader.read_projection's order


def unsupported(layer: Any, spec: RankLayout, scale_dtype: str, device: str) -> str | None:
    """Why the native path cannot build this layer (None when it can); `scale_dtype` is the
    output's safetensors scale dtype."""
    if device == "cuda":
        return "--device cuda runs the repack on the GPU"
    if spec.layout != MARLIN:
        return f"the {spec.layout} layout"
    if not spec.symmetric or spec.act_order or spec.padded:
        return "zero points, act-order or tile padding"
    if layer.fmt.native_inputs(layer.scheme) is None:
        return "a stored form the host library does not read in place"
    if layer.scale_dtype != scale_dtype or scale_dtype not in _SCALE_KIND:
        return f"scales cast from {layer.scale_dtype} to {scale_dtype}"
    if native.host_lib() is None:
        return "no native host library"
    return None


class Buffers:
    """Anonymous memory shared by every layer of a run and reused chunk after chunk (fresh memory
    costs a page fault per 4 KiB): two input slots and two output slots per rank."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, tuple[mmap.mmap, memoryview, int]] = {}

    def get(self, key: tuple, nbytes: int) -> tuple[memoryview, int]:
        """(view, address) of buffer `key`, at least nbytes long."""
        buf = self._bufs.get(key)
        if buf is None or len(buf[1]) < nbytes:
            m = mmap.mmap(-1, max(nbytes, 1))
            buf = (m, memoryview(m), ctypes.addressof(ctypes.c_char.from_buffer(m)))
            self._bufs[key] = buf
        return buf[1], buf[2]


class LayerBuilder:
    """Buffers and calls for one layer: `read` a chunk into slot 0 or 1, `check`, `build` a rank."""

    def __init__(self, files: CheckpointFiles, layer: Any, specs: list[RankLayout], buffers: Buffers,
                 scale_dtype: str, max_experts: int, simd_level: int = 1):
        self.files, self.layer, self.specs, self.buffers = files, layer, specs, buffers
        self.simd_level = simd_level  # a WNA16_SIMD_* level (wna16ctl.native.simd.resolve); 1 = the best the CPU has
        self.scale_dtype, self.max_experts = scale_dtype, max_experts
        inputs = layer.fmt.native_inputs(layer.scheme)  # what the host library reads in place (`unsupported`)
        suffixes = (inputs.codes, inputs.scales)
        self._scale_suffix = f".{inputs.scales}"
        names0 = [layer.tensor_name(0, role, s) for role in ROLE_ORDER for s in suffixes]
        self.expert_bytes = sum(files.info(n).nbytes for n in names0)
        self.shapes = expert_shapes(specs[0], scale_dtype)  # name -> (per-expert shape, dtype)
        self.per_expert = {name: _nbytes(shape, dt) for name, (shape, dt) in self.shapes.items()}
        self._src = {slot: (ctypes.c_void_p * (6 * max_experts))() for slot in range(2)}
        self._scales: dict[int, list[tuple[TensorInfo, int]]] = {}
        # per expert, its 6 tensors in read order with their place in src (looked up once per layer)
        self._reads = [[(files.info(layer.tensor_name(e, role, suffix)), 3 * k + j)
                        for j, role in enumerate(ROLE_ORDER) for k, suffix in enumerate(suffixes)]
                       for e in range(layer.num_experts)]
        n = 6 * max_experts
        self._io = {slot: ((ctypes.c_int32 * n)(), (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)(), (ctypes.c_void_p * n)())
                    for slot in range(2)}
        self._maps: dict[int, list[tuple[int, int, Any]]] = {}  # slot -> (address, length, shard) mapped

    def read(self, reader: RawReader, chunk: range, slot: int) -> memoryview:
        """Read the chunk's expert tensors into `slot` (one native call); returns the bytes read,
        in read order."""
        view, base = self.buffers.get(("in", slot), self.expert_bytes * self.max_experts)
        n = 6 * len(chunk)
        fds, offsets, sizes, dsts = self._io[slot]
        src, pos = self._src[slot], 0
        infos: list[tuple[TensorInfo, int]] = []  # (tensor, its offset in `view`)
        for i, e in enumerate(chunk):
            for info, place in self._reads[e]:
                if pos + info.nbytes > len(view):
                    raise BadInput(f"{info.file}: tensor {info.name} is larger than expert 0's; the checkpoint is corrupt")
                t = len(infos)
                fds[t], offsets[t], sizes[t], dsts[t] = reader.fd(info.file), info.start, info.nbytes, base + pos
                src[6 * i + place] = base + pos  # packed gate, up, down, then their scales
                infos.append((info, pos))
                pos += info.nbytes
        err = ctypes.c_int32(0)
        failed = native.loaded_host_lib().wna16_pread_many(fds, offsets, sizes, dsts, n, ctypes.byref(err))
        if failed >= 0:  # read again the plain way, which names the tensor and the cause if it fails again
            for info, at in infos:
                reader.read_into(info, view[at:at + info.nbytes])
        self._scales[slot] = [(info, base + at) for info, at in infos if info.name.endswith(self._scale_suffix)]
        return view[:pos]

    def map(self, reader: RawReader, chunk: range, slot: int) -> None:
        """Point `slot` at the chunk's expert tensors in the page cache itself (a read-only shared
        mapping of the span they occupy in each shard), not at a copy; `unmap` when built.  The
        native calls that read them survive a shard truncated meanwhile (WNA16_EFAULT)."""
        self.unmap(slot)
        # one window per run of nearby tensors (a shard's tensors of one expert need not be adjacent:
        # mapping from the first to the last would hold most of the shard)
        tensors = sorted((info.file, info.start, info.end) for e in chunk for info, _ in self._reads[e])
        windows: list[list[Any]] = []
        for path, start, end in tensors:
            if windows and windows[-1][0] == path and start - windows[-1][2] <= _MAP_GAP:
                windows[-1][2] = max(windows[-1][2], end)
            else:
                windows.append([path, start, end])
        lib = native.loaded_host_lib()
        where: list[tuple[Any, int, int, int]] = []  # (shard, first byte, last byte, address of the first)
        for path, lo, hi in windows:
            fd = reader.fd(path)
            if os.fstat(fd).st_size < hi:
                raise _truncated(path)
            start = lo - lo % mmap.PAGESIZE
            err = ctypes.c_int32(0)
            addr = lib.wna16_map_file(fd, start, hi - start, ctypes.byref(err))
            if not addr:
                raise BadInput(f"{path}: cannot be mapped ({os.strerror(err.value)}); check the file and run again")
            self._maps.setdefault(slot, []).append((addr, hi - start, path))
            where.append((path, lo, hi, addr + (lo - start)))

        def address(info: TensorInfo) -> int:
            for path, lo, hi, addr in where:
                if path == info.file and lo <= info.start and info.end <= hi:
                    return addr + (info.start - lo)
            raise AssertionError(f"{info.name} is in no mapped window")

        src = self._src[slot]
        scales: list[tuple[TensorInfo, int]] = []
        for i, e in enumerate(chunk):
            for info, place in self._reads[e]:
                src[6 * i + place] = at = address(info)
                if info.name.endswith(self._scale_suffix):
                    scales.append((info, at))
        self._scales[slot] = scales

    def unmap(self, slot: int) -> None:
        for addr, length, _ in self._maps.pop(slot, []):
            native.loaded_host_lib().wna16_unmap_file(addr, length)

    def mapped_files(self, slot: int) -> list[Any]:
        return [path for _, _, path in self._maps.get(slot, [])]

    def check_scales(self, slot: int) -> None:
        """Scales must be finite (the same rule and message as `sources.tensors.check_scales`)."""
        if not check_scales_at(self._scales[slot], self.scale_dtype):
            raise _truncated(self.mapped_files(slot)[0])

    def build(self, rank: int, n_experts: int, slot: int) -> dict[str, memoryview]:
        """Rank `rank`'s tensors for the chunk in `slot`: name -> bytes of its n_experts slices
        (in reused memory, valid until the slot's next build)."""
        view, base = self.buffers.get(("out", rank, slot), sum(self.per_expert.values()) * self.max_experts)
        regions: dict[str, memoryview] = {}
        addrs: dict[str, int] = {}
        pos = 0
        for name in _OUT_ORDER:
            n = self.per_expert[name] * n_experts
            regions[name] = view[pos:pos + n]
            addrs[name] = base + pos
            pos += n
        self.build_into(rank, n_experts, slot, addrs)
        return regions

    def build_into(self, rank: int, n_experts: int, slot: int, addrs: Mapping[str, int | None]) -> None:
        """Build rank `rank`'s tensors for the chunk in `slot` at the given addresses (name ->
        address of room for n_experts slices; None: not wanted, built into scratch memory)."""
        spec = self.specs[rank]
        out = []
        for name in _OUT_ORDER:
            addr = addrs.get(name)
            if addr is None:
                addr = self.buffers.get(("scratch", name), self.per_expert[name] * self.max_experts)[1]
            out.append(addr)
        mapped = slot in self._maps  # one thread: the fault guard is per thread
        try:
            native.loaded_host_lib().call(
                "wna16_marlin_rank_host", self._src[slot], n_experts, spec.hidden_size, spec.intermediate_size,
                spec.tp, spec.rank, spec.num_bits, spec.group_size, int(spec.load_full_w2),
                ST_SIZES[self.scale_dtype], int(marlin_scales_grouped(spec.hidden_size, spec.group_size)),
                int(marlin_scales_grouped(w2_scale_size_k(spec), spec.group_size)), *out, self.simd_level,
                1 if mapped else 0,
            )
        except native.KernelError as e:
            if e.code == native.WNA16_EFAULT and mapped:
                raise _truncated(self.mapped_files(slot)[0]) from None
            raise


def check_scales_at(scales: list[tuple[TensorInfo, int]], dtype: str) -> bool:
    """The scales at these addresses (each `dtype`) must be finite, in the host library: the rule
    and message of `sources.tensors.check_scales`.  False where a mapped shard shrank meanwhile."""
    ptrs, counts = (ctypes.c_void_p * len(scales))(), (ctypes.c_int64 * len(scales))()
    for t, (info, addr) in enumerate(scales):
        ptrs[t], counts[t] = addr, info.nbytes // ST_SIZES[info.dtype]
    at = ctypes.c_int64(-1)
    bad = native.loaded_host_lib().wna16_first_nonfinite_many(ptrs, counts, len(scales), _SCALE_KIND[dtype],
                                                              ctypes.byref(at))
    if bad == -2:
        return False
    if bad >= 0:
        info, addr = scales[bad]
        i, width = at.value, ST_SIZES[info.dtype]
        cols = info.shape[-1] if len(info.shape) > 1 else counts[bad]
        where = [i // cols, i % cols] if len(info.shape) > 1 else [i]
        value = _scale_value(ctypes.string_at(addr + i * width, width), info.dtype)
        raise BadInput(f"tensor {info.name}: scale {value} at {where} is not finite; "
                       "the checkpoint is corrupt (re-quantize or re-download it)")
    return True


SCALE_READ_BYTES = 64 << 20  # scales read and checked at once by check_scale_tensors


def check_scale_tensors(files: CheckpointFiles, infos: list[TensorInfo]) -> None:
    """Every scale tensor of `infos` finite, read in pieces of at most SCALE_READ_BYTES: checked by
    the host library as the native path checks a chunk's (`check_scales_at`), or without it by
    `sources.tensors.check_scales`, as the torch path does.  For what copies scales without reading
    them as numbers (pad), before it writes."""
    if native.host_lib() is None or any(i.dtype not in _SCALE_KIND for i in infos):
        from wna16ctl.sources.tensors import TensorReader, check_scales

        with TensorReader(files) as reader:
            for info in infos:
                check_scales(reader.read(info.name), info.name)
        return
    with RawReader(files) as reader:
        for dtype in sorted({i.dtype for i in infos}):
            batch: list[TensorInfo] = []
            size = 0
            for info in (i for i in infos if i.dtype == dtype):
                if batch and size + info.nbytes > SCALE_READ_BYTES:
                    _check_scale_batch(reader, batch, dtype)
                    batch, size = [], 0
                batch.append(info)
                size += info.nbytes
            if batch:
                _check_scale_batch(reader, batch, dtype)


def _check_scale_batch(reader: RawReader, batch: list[TensorInfo], dtype: str) -> None:
    buf = bytearray(sum(i.nbytes for i in batch))
    if not buf:
        return
    held = (ctypes.c_char * len(buf)).from_buffer(buf)  # the bytearray stays put while this holds it
    base = ctypes.addressof(held)
    view, places, pos = memoryview(buf), [], 0
    for info in batch:
        reader.read_into(info, view[pos: pos + info.nbytes])
        places.append((info, base + pos))
        pos += info.nbytes
    check_scales_at(places, dtype)


def _truncated(path: Any) -> BadInput:
    return BadInput(f"{path}: ends before the tensor data the plan expects (the shard was truncated or replaced "
                    "after planning); restore the file and run again; nothing was left behind")


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = ST_SIZES[dtype]
    for d in shape:
        n *= d
    return n


def _scale_value(raw: bytes, dtype: str) -> float:
    if dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack("<e" if dtype == "F16" else "<f", raw)[0]
