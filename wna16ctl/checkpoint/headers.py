"""Safetensors headers and the shard index, read without touching tensor data.

A safetensors file is `u64 little-endian header length | JSON header | data`.  Only the first
8 + N bytes of each shard are read, so `inspect` costs the same on a 600 GB checkpoint as on a
demo.  Every path named by the index must stay inside the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from wna16ctl.errors import BadInput

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 512 * 1024 * 1024  # safetensors' own limit is 100 MB; be lenient, not unbounded

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: "I32", "BF16", ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the data in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    size: int  # file size in bytes
    data_start: int  # 8 + header length
    entries: dict[str, dict]  # the raw header entries (without "__metadata__")
    metadata: dict[str, str]


class CheckpointFiles:
    """The tensors of a checkpoint directory, by name, from headers only."""

    def __init__(self, root: Path, shards: list[ShardHeader], index_path: Path | None):
        self.root = root
        self.shards = shards
        self.index_path = index_path
        # One merged name -> entry map (dict.update runs in C: this is on inspect's hot path).
        self._entries: dict[str, dict] = {}
        for sh in shards:
            self._entries.update(sh.entries)
        if len(self._entries) != sum(len(sh.entries) for sh in shards):
            seen: dict[str, ShardHeader] = {}
            for sh in shards:
                for name in sh.entries:
                    if name in seen:
                        raise BadInput(
                            f"{sh.path}: tensor {name} is also in {seen[name].path.name}; "
                            "a checkpoint must store each tensor once"
                        )
                    seen[name] = sh
        self._shard_index: dict[str, ShardHeader] | None = None
        self.reread: Callable[[Path], ShardHeader] = read_shard_header  # the header source's reader

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> Iterator[str]:
        return iter(self._entries)

    def missing(self, name: str) -> BadInput:
        """The error for a tensor the headers lack, naming the shard the index assigns it to."""
        if self.index_path is not None:
            try:
                wm = json.loads(self.index_path.read_bytes()).get("weight_map", {})
            except (OSError, ValueError, AttributeError):
                wm = {}
            if name in wm:
                return BadInput(
                    f"{self.root / str(wm[name])}: does not hold tensor {name}, which the index assigns to it; "
                    "the shard is corrupt or from another checkpoint"
                )
        return BadInput(f"{self.root}: tensor {name} is missing from every shard; the checkpoint is incomplete")

    def _entry(self, name: str) -> dict | None:
        e = self._entries.get(name)
        if e is None and name in self._entries:
            # checked in a worker process, which sent back only the names: read that header here
            sh = self.shard_of(name)
            full = self.reread(sh.path)
            sh.entries.update(full.entries)
            self._entries.update(full.entries)
            e = self._entries[name]
        return e

    def info(self, name: str) -> TensorInfo:
        e = self._entry(name)
        if e is None:
            raise self.missing(name)
        sh = self.shard_of(name)
        start, end = e["data_offsets"]
        return TensorInfo(name, e["dtype"], tuple(e["shape"]), sh.path, sh.data_start + start, sh.data_start + end)

    def raw(self, name: str) -> dict | None:
        """The raw header entry (`dtype`, `shape`, `data_offsets`) or None."""
        return self._entry(name)

    def shard_of(self, name: str) -> ShardHeader:
        if len(self.shards) == 1:
            return self.shards[0]
        if self._shard_index is None:  # built on first use: inspect rarely needs it
            self._shard_index = {n: sh for sh in self.shards for n in sh.entries}
        return self._shard_index[name]

    @property
    def total_bytes(self) -> int:
        return sum(sh.size for sh in self.shards)


def _safe_child(root: Path, rel: str, index_path: Path) -> Path:
    """Resolve an index-named file and refuse anything outside `root` (absolute, `..`, links out)."""
    if not rel or os.path.isabs(rel) or "\\" in rel or any(part == ".." for part in Path(rel).parts):
        raise BadInput(f"{index_path}: weight_map names {rel!r}, which is outside the checkpoint directory")
    p = root / rel
    try:
        # the directory must stay inside; the file itself may be a symlink (a Hugging Face cache
        # snapshot links every file to ../../blobs/<hash>)
        parent = p.parent.resolve()
    except OSError as e:
        raise BadInput(f"{index_path}: cannot resolve {rel!r} ({e})") from None
    if not parent.is_relative_to(root.resolve()):
        raise BadInput(f"{index_path}: weight_map names {rel!r}, which leads outside the checkpoint directory")
    return p


def read_shard_headers(paths: list[Path]) -> list[ShardHeader]:
    # Serial on purpose: sending decoded entries back from a forked process costs as much as
    # decoding them (measured); `inspect` parallelises the per-shard scan instead (scan.py).
    return [read_shard_header(p) for p in paths]


def read_shard_header(path: Path) -> ShardHeader:
    """Read one safetensors header; raise BadInput naming the file when it is not a valid one."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(f"{path}: truncated safetensors file ({size} bytes, no header length); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or 8 + n > size:
                raise BadInput(
                    f"{path}: header length {n} does not fit the file size {size}; the file is truncated or not safetensors"
                )
            blob = f.read(n)
    except FileNotFoundError:
        raise BadInput(f"{path}: shard not found; the index names it but the file is missing") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, expected a safetensors shard") from None
    except PermissionError:
        raise BadInput(f"{path}: permission denied") from None
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: header is not a JSON object; the file is corrupt")
    return shard_header_from_dict(path, size, 8 + n, header)


def shard_header_from_dict(path: Path, size: int, data_start: int, header: dict) -> ShardHeader:
    """Check a decoded safetensors header (`size`: the file's bytes, `data_start`: 8 + header
    length) and make its ShardHeader.  Every header source goes through here: local files
    (`read_shard_header`) and headers fetched by range request from the Hub (`wna16ctl.hub`)."""
    meta = header.pop("__metadata__", None) or {}
    data_len = size - data_start
    max_end = 0
    for name, e in header.items():
        try:
            dtype = e["dtype"]
            start, end = e["data_offsets"]
            shape = e["shape"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: header entry for {name} lacks dtype/shape/data_offsets; the file is corrupt") from None
        # cheap type checks only: this loop runs over every tensor; the dims of a shape are
        # checked where they are used (compared with an expected shape, or multiplied out)
        if type(start) is not int or type(end) is not int or type(shape) is not list \
                or dtype not in DTYPE_SIZES or not (0 <= start <= end):
            raise BadInput(f"{path}: tensor {name} has dtype {dtype!r} / offsets {e['data_offsets']!r} / shape "
                           f"{shape!r}, which is invalid; the file is corrupt")
        if end > max_end:
            max_end = end
    if max_end > data_len:
        raise BadInput(
            f"{path}: tensor data ends at byte {data_start + max_end} but the file has {size}; "
            "the shard is truncated (re-download it)"
        )
    return ShardHeader(path=path, size=size, data_start=data_start, entries=header, metadata=meta)


def check_tensor_extent(info: dict, name: str, path: Path) -> None:
    """Check that a header entry's byte range matches its dtype and shape."""
    numel = 1
    for d in info["shape"]:
        if type(d) is not int or d < 0:
            raise BadInput(f"{path}: tensor {name} has shape {info['shape']!r}, which is invalid; the file is corrupt")
        numel *= d
    start, end = info["data_offsets"]
    if end - start != numel * DTYPE_SIZES[info["dtype"]]:
        raise BadInput(
            f"{path}: tensor {name} spans {end - start} bytes but {info['dtype']}{list(info['shape'])} needs "
            f"{numel * DTYPE_SIZES[info['dtype']]}; the file is corrupt"
        )


_INDEX_VALUE = re.compile(rb'":\s*"([^"\\]*\.safetensors)"')


def _index_files_fast(blob: bytes) -> tuple[list[str], int] | None:
    """The distinct shard files an index names, and how many names it maps, without a JSON parse.

    On a 280k-tensor index this is ~5x cheaper than json.loads.  It is only trusted when the
    count equals the number of tensors the headers hold; any other index takes the exact path.
    """
    try:
        values = _INDEX_VALUE.findall(blob)
        if not values:
            return None
        return [v.decode("utf-8") for v in dict.fromkeys(values)], len(values)
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class ShardList:
    """Where a checkpoint's shards are, before any of them is read."""

    root: Path
    paths: list[Path]
    index_path: Path | None = None
    index_blob: bytes | None = None
    index_count: int | None = None  # names the index maps (fast path); None: check exactly


def locate_shards(root: Path) -> ShardList:
    """The shard files of the checkpoint at `root`: the index's, `model.safetensors`, or a glob."""
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory; point wna16ctl at a checkpoint directory")
    index_path = root / INDEX_NAME
    if index_path.exists():
        try:
            blob = index_path.read_bytes()
        except OSError as e:
            raise BadInput(f"{index_path}: cannot read ({e.strerror})") from None
        fast = _index_files_fast(blob)
        if fast is not None:
            return ShardList(root, [_safe_child(root, rel, index_path) for rel in fast[0]], index_path, blob, fast[1])
        return ShardList(root, list(_index_weight_map(index_path, blob)[1].values()), index_path, blob, None)
    single = root / SINGLE_NAME
    if single.exists():
        return ShardList(root, [single])
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise BadInput(f"{root}: no {INDEX_NAME} and no *.safetensors files; not a safetensors checkpoint")
    return ShardList(root, found)


def assemble(where: ShardList, shards: list[ShardHeader]) -> CheckpointFiles:
    """The checkpoint's tensors from its shard headers, checked against the index."""
    ckpt = CheckpointFiles(where.root, shards, where.index_path)
    if where.index_path is None or where.index_count == len(ckpt):
        return ckpt
    # The exact (slower) path: full JSON parse, every name checked against its file.
    blob = where.index_blob if where.index_blob is not None else where.index_path.read_bytes()
    wm, files = _index_weight_map(where.index_path, blob)
    by_path = {sh.path: sh for sh in shards}
    for name, rel in wm.items():
        sh = by_path.get(files[rel])
        if sh is None or name not in sh.entries:
            raise BadInput(f"{where.index_path}: names tensor {name} in {rel}, but {rel} does not hold it")
    if len(wm) != len(ckpt):
        extra = next(n for n in ckpt.names() if n not in wm)
        raise BadInput(f"{ckpt.shard_of(extra).path}: holds tensor {extra}, which the index does not name")
    return ckpt


def _index_weight_map(index_path: Path, blob: bytes) -> tuple[dict[str, str], dict[str, Path]]:
    try:
        index = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{index_path}: not a readable JSON index ({e})") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise BadInput(f"{index_path}: has no weight_map")
    files: dict[str, Path] = {}
    for rel in dict.fromkeys(wm.values()):
        if not isinstance(rel, str):
            raise BadInput(f"{index_path}: weight_map value {rel!r} is not a file name")
        files[rel] = _safe_child(index_path.parent, rel, index_path)
    return wm, files


def read_checkpoint_files(root: Path) -> CheckpointFiles:
    """Read the index (if any) and every shard header of the checkpoint at `root`."""
    where = locate_shards(root)
    return assemble(where, read_shard_headers(where.paths))
