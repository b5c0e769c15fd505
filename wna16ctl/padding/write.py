"""Writing the padded checkpoint: the same shards, tensors and format, with the padded sizes.

Each output shard mirrors an input shard (same name, same tensors in the same data order); its
header is computed from the plan first, so every tensor goes to its final offset.  Padding only
appends (`blocks`), so no value is computed: tensors that do not change, and the original bytes
of those that gain rows at their end, are copied in the kernel (consecutive ones in one range);
the added bytes are written from a block made once per shape; a tensor whose rows grow (the down
projection) is read row by row straight into a buffer of its padded form that already holds the
added bytes, and written in one piece.  Shards are written several at once (one per core, up to
PRODUCERS); memory stays at one buffer per padded shape and producer; no torch, except once per
shape for a format that stores its projections in a form other than the canonical one (GPTQ's,
AWQ's: `stored` finds their byte ranges).
Everything goes through `wna16ctl.output`: staged beside OUT, hashed as it is written, one fsync
per file, committed by one rename with a manifest, never half-written, and `--force` replaces
only an earlier wna16ctl output.

config.json gets the padded fields and a `wna16ctl_padding` record (vLLM and transformers keep
unknown fields as attributes and read nothing from it); the index gets the new total size; the
tokenizer and generation files are copied as they are.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from wna16ctl.errors import BadInput
from wna16ctl.output import filestream
from wna16ctl.output.outdir import MANIFEST_NAME, OUTPUT_FORMAT
from wna16ctl.planning.padding import PadPlan, padded_shape
from wna16ctl.sources import formats
from wna16ctl.sources.formats import WEIGHT, SHAPE
from wna16ctl.version import __version__

LAYOUT = "pad"  # the manifest's `layout`: a padded checkpoint, in the checkpoint's own format
CONFIG_RECORD = "wna16ctl_padding"  # the config.json field that records the padding
# files of the checkpoint directory that are written anew, or are weights in another format
_REWRITTEN = {"config.json", "model.safetensors.index.json", MANIFEST_NAME}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def identity(plan: PadPlan) -> dict[str, Any]:
    from wna16ctl.sources import source_fingerprint

    return {"format": OUTPUT_FORMAT, "layout": LAYOUT, "tool_version": __version__,
            "source_fingerprint": source_fingerprint(plan.checkpoint),
            "settings": {"fields": {k: list(v) for k, v in plan.fields.items()}}}


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def _planned_files(plan: PadPlan) -> list[tuple[Any, Any]]:
    """(input shard, output PlannedFile) per shard, tensors in the input's data order."""
    from wna16ctl.output.writer import PlannedFile, PlannedTensor

    files = plan.checkpoint.files
    out = []
    for sh in files.shards:
        entries = sorted(((name, files.entry(name)) for name in sh.entries), key=lambda kv: kv[1]["data_offsets"][0])
        tensors = []
        for name, e in entries:
            module, suffix = _split(name)
            m = plan.modules.get(module)
            shape = tuple(e["shape"]) if m is None else padded_shape(m, suffix, tuple(e["shape"]))
            tensors.append(PlannedTensor(name, e["dtype"], shape))
        f = PlannedFile(_relpath(plan.checkpoint.root, sh.path), tensors)
        f.layout()
        out.append((sh, f))
    return out


def padded_config(plan: PadPlan, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with the padded fields (where the language model's sizes are) and the record."""
    holder = raw
    for sub in ("text_config", "language_config"):
        if isinstance(raw.get(sub), dict) and "hidden_size" not in raw:
            holder = raw[sub]
    for key, (_, new) in plan.fields.items():
        holder[key] = new
    previous = raw.get(CONFIG_RECORD) if isinstance(raw.get(CONFIG_RECORD), dict) else None
    original = dict(previous.get("original", {})) if previous else {}
    for key, (old, _) in plan.fields.items():
        original.setdefault(key, old)  # padding twice records the sizes before the first
    raw[CONFIG_RECORD] = {"tool_version": __version__, "original": original,
                          "padded": {k: v[1] for k, v in plan.fields.items()},
                          "tp": plan.tp, "vllm": plan.vllm, "gpu": plan.gpu,
                          "note": "zero-padded MLP intermediate sizes; the added rows and columns are exact zeros"}
    return raw


def write_padded(plan: PadPlan, out: str | os.PathLike[str], *, force: bool = False,
                 progress: Callable[..., Callable[[int], None]] | None = None) -> dict[str, Any]:
    """Write the padded checkpoint to `out` and commit it with a manifest; returns the manifest."""
    from wna16ctl import interrupts
    from wna16ctl.output.writer import FILE_HASH, StagedOutput
    from wna16ctl.sources.raw import RawReader

    ck = plan.checkpoint
    out_path = Path(out).resolve()
    ident = identity(plan)
    files = _planned_files(plan)
    check_stored_forms(plan, files, _Shapes())
    staged = StagedOutput(out_path, force=force, resume=False, identity=ident, checkpoint=ck.root)
    total = sum(f.size for _, f in files)
    advance = progress("padding", total, unit="bytes") if progress else (lambda n: None)
    try:
        staged.check_space(total)
        # Ctrl-C is raised between tensors (interrupts.check), never while a block is half filled
        with interrupts.deferred(), RawReader(ck.files) as reader:
            _write_shards(plan, staged, files, reader, advance)
        _write_side_files(plan, staged, files)
        staged.collect_hashes()
        manifest = {
            "format": OUTPUT_FORMAT, "layout": LAYOUT, "tool_version": __version__, "identity": ident,
            "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"]},
            "padding": plan.to_json(),
            "files": {rel: {FILE_HASH: digest, "bytes": (staged.stage / rel).stat().st_size}
                      for rel, digest in sorted(staged.done.items())},
        }
        # OUT moves aside and the staging directory takes its place: both renames or neither
        with interrupts.deferred() as held:
            staged.commit(manifest, MANIFEST_NAME)
            held.forget()
    except BaseException:
        with interrupts.deferred():  # a second Ctrl-C waits until the staging directory is gone
            staged.abort(keep_for_resume=False)
        raise
    return manifest


# The largest piece of a tensor whose rows grow that is read and written at once: such a tensor
# is built in pieces of whole rows, so memory stays bounded however large one tensor is.
ROWS_BYTES = 8 << 20
STREAM_DEPTH = 8  # 1 MiB blocks in flight per output file: a few writes at once keep the disk busy
# Shards written at once, one per core up to this (producers()).  Measured on 2 cores only: there
# the second producer took the write phase from one busy core to two (docs/performance.md, pad);
# more cores help where the disk outruns one core's copying (~2 GB/s here), as NVMe arrays do.
PRODUCERS = 4
PROGRESS_BYTES = 16 << 20  # the progress bar moves in steps of this
_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv


class _Shapes:
    """What is built once per padded shape: the tensor's padding, and for tensors whose rows grow a
    buffer of a piece of the padded tensor with its added bytes in place, into which each piece of
    a tensor of that shape is read (every expert of a layer has the same shapes, so memory stays at
    a few such buffers)."""

    def __init__(self) -> None:
        self.padding: dict[tuple, Any] = {}
        self.pieces: dict[tuple, tuple[memoryview, list[list[memoryview]]]] = {}

    def of(self, m: Any, suffix: str, shape: tuple[int, ...], dtype: str, n_rows: int) -> tuple[tuple, Any]:
        from wna16ctl.padding.blocks import tensor_padding

        s = m.scheme
        key = (m.role, m.width, m.padded, m.hidden, s, m.fmt.quant_method, suffix, shape, dtype, n_rows)
        if key not in self.padding:
            if m.stored_apart and m.stored_kind(suffix) in formats.CANONICAL:  # found through the format, with torch
                from wna16ctl.padding.stored import stored_padding

                self.padding[key] = stored_padding(m, m.stored_kind(suffix), shape, dtype)
            else:
                self.padding[key] = tensor_padding(m, suffix, shape, dtype, n_rows)
        return key, self.padding[key]

    def piece(self, key: tuple, pad: Any, rows: int, last: bool) -> tuple[memoryview, list[list[memoryview]]]:
        """A buffer of `rows` padded rows whose added bytes are in place (the last piece's end with
        `last_tail`) and, in batches of at most 1024 for one preadv, the places of the original rows."""
        k = (key, rows, last)
        if k not in self.pieces:
            row = bytes(pad.row_in) + pad.tail
            data = row * rows if not last else row * (rows - 1) + bytes(pad.row_in) + pad.last_tail
            view = memoryview(bytearray(data))
            places = [view[r * pad.row_out: r * pad.row_out + pad.row_in] for r in range(rows)]
            self.pieces[k] = (view, [places[i: i + _IOV_MAX] for i in range(0, rows, _IOV_MAX)])
        return self.pieces[k]


def producers(n_files: int) -> int:
    """Shards written at once: one per core (at most PRODUCERS), never more than there are shards."""
    return filestream.producers(n_files, PRODUCERS)


def _write_shards(plan: PadPlan, staged: Any, files: list[tuple[Any, Any]], reader: Any,
                  advance: Callable[[int], None]) -> None:
    """Every output shard, several at once.  Copying the bytes into the blocks (the kernel's copy
    out of the page cache, the rows of growing tensors into place) is the work of the thread that
    produces a file: with one producer pad used one core while `cp` of the same bytes waits only for
    the disk.  Each producer takes the next shard; the first error (a Ctrl-C `interrupts.check`
    raised in a producer included) stops the others at their next tensor and is raised here."""
    from wna16ctl import interrupts

    n = producers(len(files))
    if n == 1:
        shapes = _Shapes()
        for sh, f in files:
            _write_shard(plan, staged.stream(f, 0, STREAM_DEPTH, allocate=True), sh, f, reader.fd(sh.path), shapes,
                         advance, lambda: False)
            staged.finish_stream(f)  # its last writes, fsync and digest run in the background
        return
    lock = threading.Lock()  # the staged output's bookkeeping and the next shard: one producer at a time
    stop = threading.Event()
    queue = iter(files)

    def produce() -> None:
        shapes = _Shapes()  # its buffers are filled in place: one set per producer
        try:
            while True:
                with lock:
                    item = None if stop.is_set() else next(queue, None)
                    if item is None:
                        return
                    sh, f = item
                    stream = staged.stream(f, 0, STREAM_DEPTH, allocate=True)
                    src_fd = reader.fd(sh.path)
                _write_shard(plan, stream, sh, f, src_fd, shapes, advance, stop.is_set)
                with lock:
                    staged.finish_stream(f)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="wna16ctl-pad") as pool:
        futures = [pool.submit(produce) for _ in range(n)]
        interrupts.wait_all(futures)  # a Ctrl-C meanwhile is recorded; a producer raises it
    errors = [e for e in (fut.exception() for fut in futures) if e is not None and not isinstance(e, _Stopped)]
    if errors:
        raise errors[0]


class _Stopped(Exception):
    """A producer stopped because another one failed (that one's error is raised)."""


def _write_shard(plan: PadPlan, stream: Any, sh: Any, f: Any, src_fd: int, shapes: _Shapes,
                 advance: Callable[[int], None], stopped: Callable[[], bool]) -> None:
    """Write output shard `f` from input shard `sh` front to back through a `FileStream` (hashed
    from memory as it goes, written in 1 MiB blocks, O_DIRECT where the filesystem takes it):
    original bytes are read straight into the stream's blocks, consecutive ones in one range;
    added bytes are copied from the shape's prepared block; the rows of a tensor whose rows grow
    are read straight into their places in its prepared padded buffer, which is then streamed."""
    from wna16ctl import interrupts

    ck = plan.checkpoint
    run = [0, 0]  # source bytes to stream next: offset, nbytes
    moved = 0  # bytes not yet reported to the progress bar

    def flush() -> None:
        if run[1]:
            _read_into_stream(stream, src_fd, run[0], run[1], sh.path)
            run[1] = 0

    def copy(src: int, nbytes: int) -> None:
        if run[1] and run[0] + run[1] == src:
            run[1] += nbytes
            return
        flush()
        run[:] = [src, nbytes]

    rows_of: dict[str, int] = {}
    for t in f.tensors:
        interrupts.check()
        if stopped():
            raise _Stopped
        e = ck.files.entry(t.name)
        src = sh.data_start + e["data_offsets"][0]
        nbytes = e["data_offsets"][1] - e["data_offsets"][0]
        if run[1] == 0 and stream.position != f.offsets[t.name]:
            raise AssertionError(f"{f.relpath}: {t.name} is not next in the file")
        module, suffix = _split(t.name)
        m = plan.modules.get(module)
        pad = None
        if m is not None:
            if module not in rows_of:
                rows_of[module] = _rows(ck, m)
            key, pad = shapes.of(m, suffix, tuple(e["shape"]), e["dtype"], rows_of[module])
        if m is None or (pad is not None and pad.unchanged):
            copy(src, nbytes)
        elif pad is None:  # rewritten from its values (weight_shape; partial int32 words)
            flush()
            stream.write(_rewritten(m, suffix, t, ck.files.info(t.name), src_fd, rows_of[module], sh.path))
        elif pad.rows == 1:  # the original bytes, then the added ones
            copy(src, nbytes)
            flush()
            stream.write(pad.tail)
        else:  # each row grows: its original bytes are read straight into the row's place
            flush()
            per = max(1, min(pad.rows, ROWS_BYTES // max(pad.row_out, 1)))
            for first in range(0, pad.rows, per):
                rows = min(per, pad.rows - first)
                view, batches = shapes.piece(key, pad, rows, first + rows == pad.rows)
                _read_rows_into(src_fd, src + first * pad.row_in, batches, sh.path, t.name)
                stream.write(view)
        moved += t.nbytes
        if moved >= PROGRESS_BYTES:
            advance(moved)
            moved = 0
    flush()
    advance(moved)


def _read_into_stream(stream: Any, fd: int, offset: int, nbytes: int, path: Path) -> None:
    """Source bytes [offset, offset + nbytes) read straight into the stream's next blocks."""
    end = offset + nbytes
    while offset < end:
        n = min(stream.block, end - offset)
        view = memoryview((ctypes.c_char * n).from_address(stream.reserve(n))).cast("B")
        try:
            got = os.preadv(fd, [view], offset)
        except OSError as e:
            raise _unreadable(path, e) from None
        finally:
            view.release()
        if got != n:  # a regular file returns all of it unless it ends first
            raise BadInput(f"{path}: ends before the tensor data the plan expects (the shard was truncated or "
                           "replaced after planning); restore the file and run again; nothing was left behind")
        stream.commit(n)
        offset += n


def _rewritten(m: Any, suffix: str, t: Any, info: Any, src_fd: int, n_rows: int, path: Path) -> bytes:
    """The padded bytes of a tensor rewritten from its values."""
    from wna16ctl.dtypes import ARRAY_TYPECODES
    from wna16ctl.padding.blocks import padded_weight_shape

    data = _read(src_fd, info.start, info.nbytes, path, t.name)
    if m.stored_kind(suffix) == SHAPE and info.dtype in ARRAY_TYPECODES:
        out = padded_weight_shape(m, data, info.dtype)
    else:  # rare forms (a partial last int32 word): the tensor math itself
        import torch

        from wna16ctl.padding.tensors import pad_tensor
        from wna16ctl.sources.tensors import as_tensor, writable_view

        padded = pad_tensor(m, suffix, as_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8), info.dtype,
                                                 info.shape), n_rows).contiguous()
        if tuple(padded.shape) != t.shape:
            raise AssertionError(f"{t.name}: padded to {tuple(padded.shape)}, planned {t.shape}")
        out = bytes(writable_view(padded))
    if len(out) != t.nbytes:
        raise AssertionError(f"{t.name}: padded to {len(out)} bytes, planned {t.nbytes}")
    return out


def _truncated(path: Path, name: str) -> BadInput:
    return BadInput(f"{path}: ends before tensor {name} does (the shard was truncated or replaced after "
                    "planning); restore the file and run again; nothing was left behind")


def _unreadable(path: Path, e: OSError) -> BadInput:
    return BadInput(f"{path}: cannot be read ({e.strerror or e}); check the file and run again; nothing was left behind")


def _read(fd: int, offset: int, nbytes: int, path: Path, name: str) -> bytes:
    try:
        data = os.pread(fd, nbytes, offset)
    except OSError as e:
        raise _unreadable(path, e) from None
    if len(data) != nbytes:  # a regular file returns all of it unless it ends first
        raise _truncated(path, name)
    return data


def _read_rows_into(fd: int, offset: int, batches: list[list[memoryview]], path: Path, name: str) -> None:
    """Read a tensor (rows stored back to back from `offset`) into its rows' places: one scattered
    read per batch."""
    for views in batches:
        want = len(views) * views[0].nbytes
        try:
            got = os.preadv(fd, views, offset)
        except OSError as e:
            raise _unreadable(path, e) from None
        if got != want:
            raise _truncated(path, name)
        offset += want


def _relpath(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _rows(ck: Any, m: Any) -> int:
    """The projection's N before padding, from its codes (or its unquantized weight)."""
    fmt = formats.of(ck.config.quant)
    stored = fmt.names
    if m.scheme is not None and f"{m.module}.{stored.codes}" in ck.files:
        return int(fmt.codes_nk(list(ck.files.info(f"{m.module}.{stored.codes}").shape), m.scheme)[0])
    for suffix in (stored.codes, WEIGHT):
        if f"{m.module}.{suffix}" in ck.files:
            return int(ck.files.info(f"{m.module}.{suffix}").shape[0])
    raise BadInput(f"{ck.root}: {m.module} has no {stored.codes} or {WEIGHT} tensor")


def check_stored_forms(plan: PadPlan, files: list[tuple[Any, Any]], shapes: _Shapes) -> None:
    """A projection stored in a form other than the canonical one is padded as byte ranges only
    (`padding.stored`): one that has none is refused before anything is written."""
    ck = plan.checkpoint
    for _, f in files:
        for t in f.tensors:
            module, suffix = _split(t.name)
            m = plan.modules.get(module)
            if m is None or not m.stored_apart or m.stored_kind(suffix) not in formats.CANONICAL:
                continue
            e = ck.files.entry(t.name)
            _, pad = shapes.of(m, suffix, tuple(e["shape"]), e["dtype"], _rows(ck, m))
            s = m.scheme
            if pad is None and s is not None:
                raise BadInput(f"{ck.root}: tensor {t.name} ({s.num_bits}-bit, group {s.group_size}) cannot be padded "
                               f"from {m.width} to {m.padded} by appending whole int32 words in its stored form; "
                               "pass --to a width whose codes fill whole int32 words; nothing was written")


def _write_side_files(plan: PadPlan, staged: Any, files: list[tuple[Any, Any]]) -> None:
    ck = plan.checkpoint
    from wna16ctl.sources.headers import read_regular_file
    from wna16ctl.sources.jsonfile import loads

    raw = loads(read_regular_file(ck.root / "config.json", "config.json", limit=64 << 20))
    staged.write_small("config.json", (json.dumps(padded_config(plan, raw), indent=2) + "\n").encode())
    if ck.files.index_path is not None:
        index = loads(read_regular_file(ck.files.index_path, "index", limit=256 << 20))
        if isinstance(index.get("metadata"), dict):  # the bytes of every tensor's data
            index["metadata"]["total_size"] = sum(t.nbytes for _, f in files for t in f.tensors)
        staged.write_small(ck.files.index_path.name, (json.dumps(index, indent=2) + "\n").encode())
    shard_names = {_relpath(ck.root, sh.path) for sh in ck.files.shards}
    for entry in sorted(os.scandir(ck.root), key=lambda e: e.name):
        if entry.name in _REWRITTEN or entry.name in shard_names or entry.name.startswith("."):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or not entry.is_file(follow_symlinks=True):
            continue  # weights in another format, directories: not part of the padded checkpoint
        staged.copy_file(Path(entry.path), entry.name)
