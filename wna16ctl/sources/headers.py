"""Safetensors headers and the shard index, read without touching tensor data.

A safetensors file is `u64 little-endian header length | JSON header | data`.  Only the first
8 + N bytes of each shard are read, so `inspect` costs the same on a 600 GB checkpoint as on a
demo.  Every path named by the index must stay inside the checkpoint directory.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from wna16ctl.dtypes import ST_BITS, ST_SIZES
from wna16ctl.errors import BadInput
from wna16ctl.sources.header_digest import digest_index

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers (HeaderTooLarge)
MAX_INDEX = 1 << 30  # a 10^6-tensor index is ~100 MB
_U64 = 1 << 64

DTYPE_SIZES = ST_SIZES
DTYPE_BITS = ST_BITS


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
    # the names sorted bytewise and joined by "\n", when the native reader checked the header
    # (header_digest): `assemble` compares them with the index's in one step
    sorted_names: bytes | None = None


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
            except (OSError, ValueError, AttributeError, RecursionError):
                wm = {}
            if not isinstance(wm, dict):
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

    def load_order(self, name: str) -> tuple[list[Any], str]:
        """Where vLLM's safetensors iterator yields `name`: files in natural order (its
        _natural_sort_key), then the file's keys in sorted order (safe_open.keys()); where two
        tensors load into one parameter, the later one is kept."""
        path = str(self.shard_of(name).path)
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path)], name

    def raw(self, name: str) -> dict | None:
        """The raw header entry (`dtype`, `shape`, `data_offsets`) or None."""
        return self._entry(name)

    def entry(self, name: str) -> dict:
        """The raw header entry of a tensor the checkpoint holds (BadInput naming it otherwise)."""
        e = self._entry(name)
        if e is None:
            raise self.missing(name)
        return e

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


def open_regular(path: Path, what: str) -> int:
    """An O_RDONLY descriptor of a regular file (never blocks on a FIFO or device)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, expected {what}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInput(f"{path}: is a symbolic link loop; point it at the real {what}") from None
        raise BadInput(f"{path}: cannot open ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise BadInput(f"{path}: is {kind}, expected {what}; replace it with the file itself")
    return fd


def read_regular_file(path: Path, what: str, *, limit: int) -> bytes:
    """The bytes of a small regular file (BadInput when it is something else or too large)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BadInput(f"{path}: {size} bytes, more than the {limit >> 20} MiB a {what} can have")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)


def read_shard_header(path: Path) -> ShardHeader:
    """Read one safetensors header; raise BadInput naming the file when it is not a valid one.

    The safetensors library's rules, so that what it refuses is refused here (with the file
    named): header at most 100 MB of UTF-8 JSON; `__metadata__` a str -> str map; each entry a
    known dtype, a shape of non-negative integers and two integer offsets; offsets, sorted,
    tiling the data section exactly (no gap, no overlap, nothing after); every entry's byte
    count equal to its dtype and shape.  Duplicate names, which the library silently collapses,
    are refused too.
    """
    size, blob = read_shard_bytes(path)
    return shard_header_from_bytes(path, size, blob)


def read_shard_bytes(path: Path) -> tuple[int, bytes]:
    """A shard's file size and header bytes (the JSON after the 8-byte length), read with the
    checks that need only the length; BadInput naming the file otherwise."""
    try:
        fd = open_regular(path, "safetensors shard")
    except FileNotFoundError:
        raise BadInput(f"{path}: shard not found; the index names it but the file is missing") from None
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(f"{path}: truncated safetensors file ({size} bytes, no header length); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise BadInput(f"{path}: header length {n} exceeds the safetensors limit of {MAX_HEADER} bytes; "
                               "the file is corrupt or not safetensors")
            if n < 2 or 8 + n > size:
                raise BadInput(
                    f"{path}: header length {n} does not fit the file size {size}; the file is truncated or not safetensors"
                )
            blob = f.read(n)
    except PermissionError:
        raise BadInput(f"{path}: permission denied") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from None
    return size, blob


def shard_header_from_bytes(path: Path, size: int, blob: bytes) -> ShardHeader:
    """Check a safetensors header -- `blob`, the JSON after the 8-byte length, of a file of `size`
    bytes -- and make its ShardHeader.  Every header source goes through here: local files
    (`read_shard_header`) and headers fetched by range request from the Hub (`wna16ctl.sources.hub`)."""
    header = _decode_header(path, blob)
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict) or not all(type(v) is str for v in meta.values()):
        raise BadInput(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    data_start = 8 + len(blob)
    # JSON true/false can only be wrong here (a bool is not a dimension); such a header takes
    # the entry-by-entry path, which says what is wrong
    plain = b"true" not in blob and b"false" not in blob
    # no '-' anywhere: no number in the header is negative, and the fast pass need not look
    _check_layout(path, header, data_start, size, fast=plain, signed=b"-" in blob)
    return ShardHeader(path=path, size=size, data_start=data_start, entries=header, metadata=meta)


def _decode_header(path: Path, blob: bytes) -> dict:
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: header is not UTF-8 (byte {e.start}); the file is corrupt") from None
    header = _parse_json(path, text, None)
    if not isinstance(header, dict):
        raise BadInput(f"{path}: header is not a JSON object; the file is corrupt")
    # json.loads keeps the last of repeated keys.  Each entry has one "dtype", "shape" and
    # "data_offsets" key: counts that differ from the number of names mean a repeated key
    # somewhere (or those words inside strings), and only then is the header parsed again
    # with a hook that finds the repeat (the hook costs ~40% of the parse).
    # An earlier copy without those keys (`{"a": {}, "a": {...}}`) leaves them at one per name:
    # one object per entry, plus the header's and the metadata's, is the other count to match.
    n = len(header) - ("__metadata__" in header)
    if (blob.count(b'"data_offsets"') != n or blob.count(b'"dtype"') != n or blob.count(b'"shape"') != n
            or blob.count(b'"__metadata__"') > 1 or blob.count(b"{") != len(header) + 1):
        repeated: list[str] = []

        def hook(pairs: list[tuple[str, Any]]) -> dict:
            d = dict(pairs)
            if len(d) != len(pairs) and not repeated:
                seen: set[str] = set()
                for k, _ in pairs:
                    if k in seen:
                        repeated.append(k)
                        break
                    seen.add(k)
            return d

        _parse_json(path, text, hook)
        if repeated:
            raise BadInput(f"{path}: header names {repeated[0]!r} twice; the file is corrupt")
    return header


def _parse_json(path: Path, text: str, hook: Any) -> Any:
    # NaN / Infinity are refused through parse_constant, which the C scanner calls only for such a
    # token: it costs nothing otherwise (measured: the same time as a plain json.loads)
    try:
        return json.loads(text, object_pairs_hook=hook, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadInput(f"{path}: header JSON is nested too deeply; the file is corrupt") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers beyond int()'s digit limit
        raise BadInput(f"{path}: header is not valid JSON ({str(e).split(';')[0]}); the file is corrupt") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _fast_spans(header: dict, signed: bool = True) -> list[tuple[int, int]] | None:
    """The entries' (start, end) when every entry is plainly well formed (C-level products and
    minima: ~4x faster than checking each dimension in Python on 10^5 entries), else None.
    `signed`: the header may hold negative numbers (else the minima are not taken)."""
    bits_of, prod = DTYPE_BITS, math.prod
    spans: list[tuple[int, int]] = []
    add = spans.append
    try:
        for e in header.values():
            start, end = e["data_offsets"]
            shape = e["shape"]
            n = prod(shape) * bits_of[e["dtype"]]
            # cheapest test first; the type tests reject floats, strings and lists that multiply
            if (n != 8 * (end - start) or type(n) is not int or type(start) is not int or type(end) is not int
                    or type(shape) is not list or n >= _U64 or (signed and (start < 0 or (shape and min(shape) < 0)))):
                return None
            add((start, end))
    except (KeyError, TypeError, ValueError):
        return None
    return spans


def _tiles(spans: list[tuple[int, int]], data_len: int) -> bool:
    spans.sort()
    pos = 0
    for start, end in spans:
        if start != pos:
            return False
        pos = end
    return pos == data_len


def _check_layout(path: Path, header: dict, data_start: int, size: int, fast: bool = False,
                  signed: bool = True) -> None:
    """Every entry well-formed, byte counts matching dtype x shape, offsets tiling the data.

    `fast`: try the vectorised pass first (the header holds no JSON booleans); anything it does
    not accept is checked entry by entry, which names what is wrong."""
    if fast:
        quick = _fast_spans(header, signed)
        if quick is not None and _tiles(quick, size - data_start):
            return
    spans = _exact_spans(path, header)  # says which tensor is wrong
    spans.sort()
    data_len = size - data_start
    pos = 0
    for start, end, name in spans:
        if start != pos:
            what = "overlaps the tensor before it" if start < pos else f"leaves a gap at byte {pos}"
            raise BadInput(f"{path}: tensor {name} {what} (data offsets {start}..{end}); the file is corrupt")
        pos = end
    if pos != data_len:
        if pos > data_len:
            raise BadInput(
                f"{path}: tensor data ends at byte {data_start + pos} but the file has {size}; "
                "the shard is truncated (re-download it)"
            )
        raise BadInput(f"{path}: {data_len - pos} bytes after the last tensor's data; the file is corrupt or "
                       "was appended to")


def _exact_spans(path: Path, header: dict) -> list[tuple[int, int, str]]:
    spans: list[tuple[int, int, str]] = []
    bits_of = DTYPE_BITS
    for name, e in header.items():
        try:
            dtype = e["dtype"]
            offsets = e["data_offsets"]
            shape = e["shape"]
        except (KeyError, TypeError):
            raise BadInput(f"{path}: header entry for {name} lacks dtype/shape/data_offsets; the file is corrupt") from None
        bits = bits_of.get(dtype) if type(dtype) is str else None
        if bits is None or type(offsets) is not list or len(offsets) != 2 or type(shape) is not list:
            raise BadInput(f"{path}: tensor {name} has dtype {dtype!r} / offsets {offsets!r} / shape "
                           f"{shape!r}, which is invalid; the file is corrupt")
        start, end = offsets
        if type(start) is not int or type(end) is not int or not (0 <= start <= end < _U64):
            raise BadInput(f"{path}: tensor {name} has data offsets {offsets!r}, which are invalid; the file is corrupt")
        numel = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise BadInput(f"{path}: tensor {name} has shape {shape!r}, which is invalid; the file is corrupt")
            numel *= d
        if numel * bits >= _U64 or (numel * bits) % 8 or (numel * bits) // 8 != end - start:
            raise BadInput(
                f"{path}: tensor {name} spans {end - start} bytes but {dtype}{shape} needs "
                f"{numel * bits / 8:g}; the file is corrupt"
            )
        spans.append((start, end, name))
    return spans


@dataclass(frozen=True)
class ShardList:
    """Where a checkpoint's shards are, before any of them is read."""

    root: Path
    paths: list[Path]
    index_path: Path | None = None
    # the index's weight_map (tensor name -> file as the index names it) and its files (that name
    # -> the path in `paths`), parsed and checked once
    weight_map: dict[str, str] | None = None
    index_files: dict[str, Path] | None = None
    # from the native index reader instead of `weight_map`: per file as the index names it, the
    # names it assigns to that file, sorted bytewise and joined by "\n"
    index_names: dict[str, bytes] | None = None


def locate_shards(root: Path) -> ShardList:
    """The shard files of the checkpoint at `root`: the index's, `model.safetensors`, or a glob."""
    if not root.is_dir():
        raise BadInput(f"{root}: not a directory; point wna16ctl at a checkpoint directory")
    index_path = root / INDEX_NAME
    if os.path.lexists(index_path):
        try:
            blob = read_regular_file(index_path, "shard index", limit=MAX_INDEX)
        except FileNotFoundError:
            raise BadInput(f"{index_path}: is a dangling symbolic link; restore the index") from None
        # Parsed exactly (natively, else json.loads), never pattern-matched: what the JSON says
        # is what counts.
        names = digest_index(blob)
        if names is not None:
            files = {rel: _safe_child(root, rel, index_path) for rel in names}
            return ShardList(root, list(files.values()), index_path, None, files, names)
        wm, files = _index_weight_map(index_path, blob)
        return ShardList(root, list(files.values()), index_path, wm, files)
    single = root / SINGLE_NAME
    if os.path.lexists(single):
        return ShardList(root, [single])
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise BadInput(f"{root}: no {INDEX_NAME} and no *.safetensors files; not a safetensors checkpoint")
    return ShardList(root, found)


def assemble(where: ShardList, shards: list[ShardHeader]) -> CheckpointFiles:
    """The checkpoint's tensors from its shard headers, checked name by name against the index."""
    ckpt = CheckpointFiles(where.root, shards, where.index_path)
    if where.index_path is None:
        return ckpt
    wm, files = where.weight_map, where.index_files
    index_names = where.index_names
    if (index_names is not None and files is not None and len(shards) == len(files)
            and all(sh.sorted_names is not None for sh in shards)):
        # both sides read natively: each shard holds exactly the names the index assigns to it
        rel_of = {p: rel for rel, p in files.items()}
        if all(index_names.get(rel_of.get(sh.path, "")) == sh.sorted_names for sh in shards):
            return ckpt
    if wm is None or files is None:
        wm, files = _index_weight_map(where.index_path,
                                      read_regular_file(where.index_path, "shard index", limit=MAX_INDEX))
    rel_of = {p: rel for rel, p in files.items()}
    # Each shard's names all assigned to it by the index, and no other names in the index (the
    # names are distinct across shards): one C-level lookup per name, no dict built.
    get = wm.get
    if len(wm) == len(ckpt) and all(list(map(get, sh.entries)).count(rel_of.get(sh.path)) == len(sh.entries)
                                    for sh in shards):
        return ckpt
    by_path = {sh.path: sh for sh in shards}
    file_of = {rel: by_path.get(p) for rel, p in files.items()}
    for name, rel in wm.items():
        sh = file_of[rel]
        if sh is None or name not in sh.entries:
            raise BadInput(f"{where.index_path}: names tensor {name} in {rel}, but {rel} does not hold it")
    if len(wm) != len(ckpt):
        extra = next(n for n in ckpt.names() if n not in wm)
        raise BadInput(f"{ckpt.shard_of(extra).path}: holds tensor {extra}, which the index does not name")
    return ckpt


def _index_weight_map(index_path: Path, blob: bytes) -> tuple[dict[str, str], dict[str, Path]]:
    from wna16ctl.sources.jsonfile import JSONError, loads

    try:
        index = loads(blob)
    except JSONError as e:
        raise BadInput(f"{index_path}: not a readable JSON index ({e})") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise BadInput(f"{index_path}: has no weight_map")
    files: dict[str, Path] = {}
    for rel in dict.fromkeys(wm.values()):
        if not isinstance(rel, str):
            raise BadInput(f"{index_path}: weight_map value {_short_repr(rel)} is not a file name")
        files[rel] = _safe_child(index_path.parent, rel, index_path)
    return wm, files


def _short_repr(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def read_checkpoint_files(root: Path) -> CheckpointFiles:
    """Read the index (if any) and every shard header of the checkpoint at `root`."""
    where = locate_shards(root)
    return assemble(where, read_shard_headers(where.paths))
