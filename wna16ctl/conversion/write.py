"""Writing the converted checkpoint through `wna16ctl.output`: each source shard becomes the shard of
the same name, produced front to back (`FileStream`), staged beside OUT and committed by one rename
with a manifest; never half-written.

A projection is read (its stored tensors by role), put in the canonical form by its format (GPTQ
v1's zero - 1 and AWQ's interleaved words undone there, the data checked as it is read), and written
as the pack-quantized tensors, which are that canonical form as it is, with `weight_shape`; every
other tensor is copied byte for byte in pieces.  Memory stays at one projection and one piece.

`--resume`: every output file records the digest of the source bytes it was made from (read in
the order they are used); a staged or committed file of an earlier run with the same source and
settings is kept when its own bytes and that digest still match.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from wna16ctl.conversion.plan import LAYOUT, ConversionPlan, Projection, identity
from wna16ctl.errors import BadInput
from wna16ctl.output.manifest import MANIFEST_NAME
from wna16ctl.sources import formats
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, SHAPE, ZERO_POINTS
from wna16ctl.version import __version__

PIECE = 8 << 20  # the largest piece of a copied tensor held at once
STREAM_DEPTH = 8
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
    from wna16ctl.sources.tensors import TensorReader

    ck = plan.checkpoint
    ident = identity(ck)
    staged = StagedOutput(Path(out).resolve(), force=force, resume=resume, identity=ident, checkpoint=ck.root)
    reused: list[str] = []
    try:
        with interrupts.deferred(), TensorReader(ck.files) as reader:
            pending = [(sh, f) for sh, f in plan.files if not _reusable(plan, staged, reader, f)]
            reused = [f.relpath for _, f in plan.files if f.relpath in staged.done]
            staged.check_space(sum(f.size for _, f in pending))
            advance = progress("converting", sum(f.size for _, f in pending), unit="bytes") if progress else (lambda n: 0)
            for _, f in pending:
                stream = staged.stream(f, 0, STREAM_DEPTH, allocate=True)
                staged.sources[f.relpath] = _produce(plan, f, reader, stream.write, advance)
                staged.finish_stream(f)
                staged.checkpoint_journal()
        _write_side_files(plan, staged)
        staged.collect_hashes()
        manifest = {
            "format": ident["format"], "layout": LAYOUT, "tool_version": __version__, "identity": ident,
            "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"]},
            "conversion": plan.to_json(), "files_reused": reused,
            "files": {rel: {FILE_HASH: digest, "bytes": (staged.stage / rel).stat().st_size,
                            **({f"source_{FILE_HASH}": staged.sources[rel]} if rel in staged.sources else {})}
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


def _reusable(plan: ConversionPlan, staged: Any, reader: Any, f: Any) -> bool:
    """A file an earlier run finished, whose bytes are as recorded and whose source bytes are unchanged."""
    if f.relpath not in staged.reusable or not staged.staged_file_matches(f):
        return False
    return bool(staged.reuse(f, _produce(plan, f, reader, None, lambda n: 0)))


def _produce(plan: ConversionPlan, f: Any, reader: Any, write: Callable[[Any], None] | None,
             advance: Callable[[int], Any]) -> str:
    """Write file `f` front to back through `write` (None: only read and digest its source bytes);
    returns the digest of the source bytes, in the order they were read."""
    from wna16ctl import interrupts
    from wna16ctl.output.writer import ReusedBuffer, new_hasher

    files = plan.checkpoint.files
    fmt = formats.of(plan.checkpoint.config.quant)
    first = {p.written()[0][0]: p for p in plan.projections.values()}  # where each projection's tensors start
    hasher = new_hasher()
    hasher.update(f.relpath.encode() + b"\0")
    reader.hasher = hasher
    buf = ReusedBuffer(PIECE)  # the stream has its header already
    buffers: dict[str, Any] = {}  # the stored tensors of one projection, read into the same storage each time
    try:
        done: set[str] = set()
        for t in f.tensors:
            interrupts.check()
            if t.name in done:
                continue
            if t.name in first:
                pieces = _converted(first[t.name], fmt, reader, buffers)
                for name, data in pieces:
                    done.add(name)
                    if write is not None:
                        write(data)
                advance(sum(len(d) for _, d in pieces))
                continue
            info = files.info(t.name)
            for start in range(info.start, info.end, PIECE):
                n = min(PIECE, info.end - start)
                view = buf.view()[:n]
                reader.read_into(type(info)(info.name, info.dtype, (), info.file, start, start + n), view)
                if write is not None:
                    write(view)
            advance(info.nbytes)
    finally:
        reader.hasher = None
    return str(hasher.hexdigest())


def converted_tensors(p: Projection, fmt: Any, reader: Any, buffers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pack-quantized tensors of one projection, by name: its stored tensors read in `_ROLES`
    order and put in the canonical form by its format `fmt` (which checks them as it converts).
    `buffers` (role -> uint8 tensor, kept by the caller): the stored tensors are read into these,
    grown as needed, instead of into new storage; the result may share them, so it must be used
    before the next call with the same buffers."""
    import torch

    from wna16ctl.sources.formats.compressed_tensors import NAMES
    from wna16ctl.sources.tensors import check_scales

    names = {r: p.stored[r] for r in _ROLES if r in p.stored}
    stored = {r: reader.read(n) if buffers is None else _read_reusing(reader, n, buffers, r) for r, n in names.items()}
    check_scales(stored[SCALES], names[SCALES])
    canon = fmt.canonical(stored, p.scheme, names)
    out = {NAMES.tensor(p.module, r): canon[r] for r in _ROLES if r in canon}
    out[NAMES.tensor(p.module, SHAPE)] = torch.tensor([p.n, p.k], dtype=torch.int64)
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
    """config.json with the new quantization_config, the index with the new names, the rest copied
    (the format's own config files beside config.json are left out: the new config says it all)."""
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
    shards = {f.relpath for _, f in plan.files}
    for entry in sorted(os.scandir(ck.root), key=lambda e: e.name):
        if entry.name in skip or entry.name in shards or entry.name.startswith("."):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or not entry.is_file(follow_symlinks=True):
            continue  # weights in another format, directories: not part of the converted checkpoint
        staged.copy_file(Path(entry.path), entry.name)
