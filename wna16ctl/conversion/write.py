"""Writing the converted checkpoint through `wna16ctl.output`: each source shard becomes the shard of
the same name, produced front to back (`FileStream`), staged beside OUT and committed by one rename
with a manifest; never half-written.

A projection is read (its stored tensors by role), put in the canonical form by its format (GPTQ
v1's zero - 1 and AWQ's interleaved words undone there, the data checked as it is read), and written
in the target format's stored form by that format (`stored_form`): the pack-quantized tensors are
the canonical form as it is, with `weight_shape`; GPTQ's are its qweight, qzeros (v1: zero - 1),
scales and g_idx.  Every other tensor is copied byte for byte in pieces.  Memory stays at one
projection and one piece.

`--resume`: a staged or committed file of an earlier run with the same source and settings is kept
when its own bytes are still the ones recorded and converting the checkpoint as it is now gives
those bytes again (hashed, not written), as repack's native path checks its files: no digest of the
source is taken while writing, and a source whose data changed (whatever its size and times say)
has the files made from it written again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from wna16ctl.conversion.plan import LAYOUT, ConversionPlan, Projection, identity
from wna16ctl.errors import BadInput
from wna16ctl.output import filestream
from wna16ctl.output.manifest import MANIFEST_NAME
from wna16ctl.sources import formats
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, SHAPE, ZERO_POINTS
from wna16ctl.version import __version__

PIECE = 8 << 20  # the largest piece of a copied tensor held at once
STREAM_DEPTH = 8
PRODUCERS = 4  # files converted at once, at most (one per core)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_ROLES = (CODES, SCALES, ZERO_POINTS, G_IDX)  # the order a projection's stored tensors are read in


def converted_config(plan: ConversionPlan, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with the compressed-tensors quantization_config (where the source kept it)."""
    holder = raw
    for sub in ("text_config", "language_config"):
        if isinstance(raw.get(sub), dict) and "quantization_config" in raw[sub] and "quantization_config" not in raw:
            holder = raw[sub]
    holder["quantization_config"] = plan.config
    return raw


def write_converted(plan: ConversionPlan, out: str | os.PathLike[str], *, force: bool = False, resume: bool = False,
                    progress: Callable[..., Callable[[int], None]] | None = None) -> dict[str, Any]:
    """Write the converted checkpoint to `out` and commit it with a manifest; returns the manifest."""
    from wna16ctl import interrupts
    from wna16ctl.output.writer import FILE_HASH, StagedOutput

    ck = plan.checkpoint
    ident = identity(ck, plan.writer)
    staged = StagedOutput(Path(out).resolve(), force=force, resume=resume, identity=ident, checkpoint=ck.root)
    reused: list[str] = []
    path = _data_path(plan)
    try:
        with interrupts.deferred(), path.reader(ck.files) as reader:
            _adopt_rebuilt(plan, staged, reader, path, progress)
            pending = [f for _, f in plan.files if f.relpath not in staged.done]
            reused = [f.relpath for _, f in plan.files if f.relpath in staged.done]
            staged.check_space(sum(f.size for f in pending))
            advance = progress("converting", sum(f.size for f in pending), unit="bytes") if progress else (lambda n: 0)
            _write_files(staged, pending, reader, path, advance)
        _write_side_files(plan, staged)
        staged.collect_hashes()
        manifest = {
            "format": ident["format"], "layout": LAYOUT, "tool_version": __version__, "identity": ident,
            "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"]},
            "conversion": plan.to_json(), "files_reused": reused,
            "files": {rel: {FILE_HASH: digest, "bytes": (staged.stage / rel).stat().st_size}
                      for rel, digest in sorted(staged.done.items())},
        }
        with interrupts.deferred() as held:
            staged.commit(manifest, MANIFEST_NAME)
            held.forget()
    except BaseException as e:
        with interrupts.deferred():  # an interrupted run keeps its finished files for --resume
            staged.abort(keep_for_resume=isinstance(e, KeyboardInterrupt))
        raise
    return manifest


class _Stopped(Exception):
    """A producer stopped because another one failed (that one's error is raised)."""


@dataclass(frozen=True)
class _DataPath:
    reader: Callable[[Any], Any]  # the reader class, given the checkpoint's files
    reserve: Callable[[Any], int]  # the largest reservation of a file's stream
    produce: Callable[..., None]  # (f, reader, stream, advance, check): file f through stream; check() between pieces
    producers: int  # files produced at once


def _data_path(plan: ConversionPlan) -> _DataPath:
    """The torch-free word path (`conversion.words`) where it takes every projection's scheme, one
    file per core at once (its reads and transposes release the GIL), else the torch path below (the
    reference, one file at a time; both write the same bytes)."""
    from wna16ctl.conversion import words

    if words.takes(plan):
        from wna16ctl.sources.raw import RawReader

        written = words.written_of(plan)
        return _DataPath(RawReader, words.max_reserve, lambda f, reader, stream, advance, check: words.produce(
            plan, f, reader, stream, advance, _converted, written, check), filestream.producers(len(plan.files), PRODUCERS))
    from wna16ctl.sources.tensors import TensorReader

    return _DataPath(TensorReader, lambda f: 0, lambda f, reader, stream, advance, check: _produce(
        plan, f, reader, stream.write, advance, check), 1)


def _write_files(staged: Any, files: list[Any], reader: Any, path: _DataPath, advance: Callable[[int], Any]) -> None:
    """Every pending output file through a stream of its own, `path.producers` at once: each
    producer takes the next file, and its stream hashes and writes while it fills the next block.
    The first error (a Ctrl-C `interrupts.check` raised in a producer included) stops the others
    at their next piece and is raised here; every finished file is journaled for `--resume`."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from wna16ctl import interrupts

    lock = threading.Lock()  # the staged output's bookkeeping and the next file: one producer at a time
    stop = threading.Event()
    queue = iter(files)

    def check() -> None:
        interrupts.check()
        if stop.is_set():
            raise _Stopped

    def producer() -> None:
        try:
            while True:
                with lock:
                    f = None if stop.is_set() else next(queue, None)
                    if f is None:
                        return
                    stream = staged.stream(f, path.reserve(f), STREAM_DEPTH, allocate=True)
                path.produce(f, reader, stream, advance, check)
                with lock:
                    staged.finish_stream(f)  # its last writes, fsync and digest run in the background
                    staged.checkpoint_journal()  # the files finished by now
        except BaseException:
            stop.set()
            raise

    if path.producers == 1:
        return producer()
    with ThreadPoolExecutor(max_workers=path.producers, thread_name_prefix="wna16ctl-convert") as pool:
        futures = [pool.submit(producer) for _ in range(path.producers)]
        interrupts.wait_all(futures)  # a Ctrl-C meanwhile is recorded; a producer raises it
    errors = [e for e in (fut.exception() for fut in futures) if e is not None and not isinstance(e, _Stopped)]
    if errors:
        raise errors[0]
    return None


def _adopt_rebuilt(plan: ConversionPlan, staged: Any, reader: Any, path: _DataPath,
                   progress: Callable[..., Callable[[int], None]] | None) -> None:
    """Adopt each file an earlier run finished whose staged bytes are as recorded and which the
    checkpoint, converted again now into a stream that only hashes, still gives (the rule of
    repack's native path: `StagedOutput.staged_file_matches` without a source digest, `adopt`)."""
    from concurrent.futures import ThreadPoolExecutor

    from wna16ctl import interrupts
    from wna16ctl.output.filestream import FileStream, depth_for
    from wna16ctl.output.writer import new_hasher

    candidates = [f for _, f in plan.files if f.relpath in staged.reusable and staged.staged_file_matches(f, False)]
    if not candidates:
        return
    advance = progress("checking the staged files", sum(f.size for f in candidates), unit="bytes") if progress \
        else (lambda n: 0)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wna16ctl-rehash") as pool:
        for f in candidates:
            reserve = path.reserve(f)
            stream = FileStream(-1, f.size, new_hasher(), pool, max_reserve=reserve, on_error=lambda e: e,
                                direct=False, depth=depth_for(reserve))  # fd -1: hashed, never written
            stream.write(f.header)
            path.produce(f, reader, stream, advance, interrupts.check)
            stream.close()
            if stream.hasher.hexdigest() == staged.reusable[f.relpath][0]:
                staged.adopt(f)


def _produce(plan: ConversionPlan, f: Any, reader: Any, write: Callable[[Any], None],
             advance: Callable[[int], Any], check: Callable[[], None]) -> None:
    """Write file `f` front to back through `write`; `check()` between tensors (raises to stop)."""
    from wna16ctl.output.writer import ReusedBuffer

    files = plan.checkpoint.files
    fmt = formats.of(plan.checkpoint.config.quant)
    first = {p.written()[0][0]: p for p in plan.projections.values()}  # where each projection's tensors start
    buf = ReusedBuffer(PIECE)  # the stream has its header already
    buffers: dict[str, Any] = {}  # the stored tensors of one projection, read into the same storage each time
    done: set[str] = set()
    for t in f.tensors:
        check()
        if t.name in done:
            continue
        if t.name in first:
            pieces = _converted(first[t.name], fmt, reader, buffers)
            for name, data in pieces:
                done.add(name)
                write(data)
            advance(sum(len(d) for _, d in pieces))
            continue
        info = files.info(t.name)
        for start in range(info.start, info.end, PIECE):
            n = min(PIECE, info.end - start)
            view = buf.view()[:n]
            reader.read_into(type(info)(info.name, info.dtype, (), info.file, start, start + n), view)
            write(view)
        advance(info.nbytes)


def converted_tensors(p: Projection, fmt: Any, reader: Any, buffers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The target format's tensors of one projection, by name: its stored tensors read in `_ROLES`
    order, put in the canonical form by its format `fmt` (which checks them as it converts) and
    stored by the target's (`p.writer`'s) format.  `buffers` (role -> uint8 tensor, kept by the
    caller): the stored tensors are read into these, grown as needed, instead of into new storage;
    the result may share them, so it must be used before the next call with the same buffers."""
    import torch

    from wna16ctl.sources.tensors import check_scales

    target = p.writer.fmt
    names = {r: p.stored[r] for r in _ROLES if r in p.stored}
    stored = {r: reader.read(n) if buffers is None else _read_reusing(reader, n, buffers, r) for r, n in names.items()}
    check_scales(stored[SCALES], names[SCALES])
    canon = fmt.canonical(stored, p.scheme, names)
    try:
        form = target.stored_form(canon, p.target_scheme)
    except BadInput as e:  # what the target cannot hold of these values, named by the source's tensor
        raise BadInput(f"tensor {names.get(ZERO_POINTS, names[CODES])}: {e}") from None
    out = {target.names.tensor(p.module, r): form[r] for r in _ROLES if r in form}
    if target.names.shape is not None:
        out[target.names.tensor(p.module, SHAPE)] = torch.tensor([p.n, p.k], dtype=torch.int64)
    return out


def _read_reusing(reader: Any, name: str, buffers: dict[str, Any], role: str) -> Any:
    """Tensor `name` read into `buffers[role]` (fresh storage for every tensor costs its page
    faults: more than the reading, at a projection of a few hundred KiB)."""
    import torch

    from wna16ctl.sources.tensors import as_tensor, writable_view

    info = reader.files.info(name)
    if role not in buffers or buffers[role].numel() < info.nbytes:
        buffers[role] = torch.empty(info.nbytes, dtype=torch.uint8)
    raw = buffers[role][:info.nbytes]
    reader.read_into(info, writable_view(raw))
    return as_tensor(raw, info.dtype, info.shape)


def _converted(p: Projection, fmt: Any, reader: Any, buffers: dict[str, Any]) -> list[tuple[str, memoryview]]:
    """(name, bytes) of the projection's pack-quantized tensors in the planned order, each checked
    against its planned dtype and shape; written before the next projection reuses `buffers`."""
    from wna16ctl.dtypes import torch_dtype
    from wna16ctl.sources.tensors import writable_view

    tensors = converted_tensors(p, fmt, reader, buffers)
    out = []
    for name, dtype, shape in p.written():
        t = tensors.get(name)
        if t is None or t.dtype != torch_dtype(dtype) or list(t.shape) != list(shape):
            got = "missing" if t is None else f"{t.dtype} {list(t.shape)}"
            raise BadInput(f"tensor {p.stored[CODES]}: converts to {name} {got}, not {dtype} {shape} as its "
                           "header promises; the checkpoint's tensors do not match its config")
        out.append((name, writable_view(t.contiguous())))  # the view holds the tensor: written without a copy
    return out


def _write_side_files(plan: ConversionPlan, staged: Any) -> None:
    """config.json with the new quantization_config, the index with the new names, the target
    format's own config files (GPTQModel's quantize_config.json), the rest copied (the source
    format's config files beside config.json are left out: the new config says it all)."""
    from wna16ctl.sources.headers import read_regular_file
    from wna16ctl.sources.jsonfile import loads

    ck = plan.checkpoint
    raw = loads(read_regular_file(ck.root / "config.json", "config.json", limit=64 << 20))
    staged.write_small("config.json", (json.dumps(converted_config(plan, raw), indent=2) + "\n").encode())
    skip = {"config.json", MANIFEST_NAME} | set(formats.FORMAT_FILES)
    if ck.files.index_path is not None:
        index = loads(read_regular_file(ck.files.index_path, "index", limit=256 << 20))
        index["weight_map"] = {t.name: f.relpath for _, f in plan.files for t in f.tensors}
        if isinstance(index.get("metadata"), dict):
            index["metadata"]["total_size"] = sum(t.nbytes for _, f in plan.files for t in f.tensors)
        staged.write_small(ck.files.index_path.name, (json.dumps(index, indent=2) + "\n").encode())
        skip.add(ck.files.index_path.name)
    for name, body in plan.writer.side_files(plan.config).items():  # the target's own config files
        staged.write_small(name, (json.dumps(body, indent=2) + "\n").encode())
        skip.add(name)
    shards = {f.relpath for _, f in plan.files}
    for entry in sorted(os.scandir(ck.root), key=lambda e: e.name):
        if entry.name in skip or entry.name in shards or entry.name.startswith("."):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or not entry.is_file(follow_symlinks=True):
            continue  # weights in another format, directories: not part of the converted checkpoint
        staged.copy_file(Path(entry.path), entry.name)
