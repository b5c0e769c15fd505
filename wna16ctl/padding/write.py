"""Writing the padded checkpoint: the same shards, tensors and format, with the padded sizes.

Each output shard mirrors an input shard (same name, same tensors in the same data order); its
header is computed from the plan first, so every tensor goes to its final offset.  Tensors that
do not change are copied in the kernel (consecutive ones in one range); padded ones are read,
padded and written one at a time, so memory stays at one projection's tensors.  Everything goes
through `wna16ctl.output`: staged beside OUT, committed by one rename with a manifest, never
half-written, and `--force` replaces only an earlier wna16ctl output.

config.json gets the padded fields and a `wna16ctl_padding` record (vLLM and transformers keep
unknown fields as attributes and read nothing from it); the index gets the new total size; the
tokenizer and generation files are copied as they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from wna16ctl.errors import BadInput
from wna16ctl.output.outdir import MANIFEST_NAME, OUTPUT_FORMAT
from wna16ctl.planning.padding import PadPlan, padded_shape
from wna16ctl.version import __version__

LAYOUT = "pad"  # the manifest's `layout`: a padded checkpoint, in the checkpoint's own format
CONFIG_RECORD = "wna16ctl_padding"  # the config.json field that records the padding
# files of the checkpoint directory that are written anew, or are weights in another format
_REWRITTEN = {"config.json", "model.safetensors.index.json", MANIFEST_NAME}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def identity(plan: PadPlan) -> dict[str, Any]:
    from wna16ctl.repacking.pipeline import source_fingerprint

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
    from wna16ctl.output.writer import FILE_HASH, StagedOutput
    import torch

    from wna16ctl.padding.tensors import append_dim, pad_tensor
    from wna16ctl.sources.tensors import TensorReader, torch_dtype, writable_view

    ck = plan.checkpoint
    out_path = Path(out).resolve()
    ident = identity(plan)
    files = _planned_files(plan)
    staged = StagedOutput(out_path, force=force, resume=False, identity=ident, checkpoint=ck.root)
    total = sum(f.size for _, f in files)
    advance = progress("padding", total, unit="bytes") if progress else (lambda n: None)
    # per tensor shape: its padded form, whose added block is written as it is (every expert of a
    # layer has the same shapes, so memory stays at one projection's tensors), and a read buffer
    blocks: dict[tuple, Any] = {}
    rows_of: dict[tuple, list[list[memoryview]]] = {}  # per padded buffer: where each original row goes
    try:
        staged.check_space(total)
        with TensorReader(ck.files) as reader:
            for sh, f in files:
                staged.open(f)  # creates the file with its header
                src_fd = reader.fd(sh.path)
                run: list[int] = []  # a pending kernel copy: [dst, src, nbytes]

                def flush() -> None:
                    if run:
                        staged.copy_range(f, run[0], src_fd, run[1], run[2], source=sh.path)
                        advance(run[2])
                        run.clear()

                for t in f.tensors:
                    e = ck.files.entry(t.name)
                    src = sh.data_start + e["data_offsets"][0]
                    nbytes = e["data_offsets"][1] - e["data_offsets"][0]
                    dst = f.offsets[t.name]
                    module, suffix = _split(t.name)
                    m = plan.modules.get(module)
                    if m is None:
                        if run and run[0] + run[2] == dst and run[1] + run[2] == src:
                            run[2] += nbytes
                        else:
                            flush()
                            run.extend((dst, src, nbytes))
                        continue
                    flush()
                    info = ck.files.info(t.name)
                    n_rows = _rows(ck, module)
                    dim = append_dim(m, suffix, info.shape, torch_dtype(info.dtype), n_rows)
                    if dim is None:  # rewritten whole (small: zero points, weight_shape)
                        data = pad_tensor(m, suffix, reader.read(t.name), n_rows)
                        if tuple(data.shape) != t.shape:
                            raise AssertionError(f"{t.name}: padded to {tuple(data.shape)}, planned {t.shape}")
                        staged.pwrite(f, dst, data)
                    else:
                        key = (m.role, suffix, info.shape, info.dtype, m.width, m.padded, n_rows)
                        if key not in blocks:  # the padded form of a zero tensor: its added block is the one
                            blocks[key] = pad_tensor(m, suffix, torch.zeros(info.shape, dtype=torch_dtype(info.dtype)),
                                                     n_rows).contiguous()
                        padded = blocks[key]
                        if dim == 0:  # the original bytes, then the added ones
                            staged.copy_range(f, dst, src_fd, info.start, info.nbytes, source=sh.path)
                            staged.pwrite(f, dst + info.nbytes, writable_view(padded).cast("B")[info.nbytes:])
                        else:  # each row grows: its original bytes are read straight into the row's start
                            if key not in rows_of:
                                rows_of[key] = _row_views(writable_view(padded), info, padded.shape[1] * padded.element_size())
                            _read_rows_into(src_fd, info, rows_of[key], sh.path)
                            staged.pwrite(f, dst, padded)
                    advance(t.nbytes)
                flush()
                staged.finish(f, "")
        _write_side_files(plan, staged)
        staged.collect_hashes()
        manifest = {
            "format": OUTPUT_FORMAT, "layout": LAYOUT, "tool_version": __version__, "identity": ident,
            "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"]},
            "padding": plan.to_json(),
            "files": {rel: {FILE_HASH: digest, "bytes": (staged.stage / rel).stat().st_size}
                      for rel, digest in sorted(staged.done.items())},
        }
        staged.commit(manifest, MANIFEST_NAME)
    except BaseException:
        staged.abort(keep_for_resume=False)
        raise
    return manifest


_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv


def _row_views(out: memoryview, info: Any, out_row: int) -> list[list[memoryview]]:
    """Where each row of the 2-d tensor `info` goes in `out` (row r at r·out_row), in batches of
    at most 1024 (Linux's limit on the buffers of one preadv)."""
    rows = info.shape[0]
    row = info.nbytes // rows
    return [[out[r * out_row: r * out_row + row] for r in range(first, min(rows, first + _IOV_MAX))]
            for first in range(0, rows, _IOV_MAX)]


def _read_rows_into(fd: int, info: Any, batches: list[list[memoryview]], path: Path) -> None:
    """Read the tensor `info` (rows stored back to back) into the rows' places: one scattered read
    per batch, no copy in this process."""
    offset = info.start
    for views in batches:
        want = sum(v.nbytes for v in views)
        got = os.preadv(fd, views, offset)
        if got != want:  # a regular file returns all of it unless it ends first
            raise BadInput(f"{path}: ends before tensor {info.name} does (the shard was truncated or replaced "
                           "after planning); restore the file and run again; nothing was left behind")
        offset += want


def _relpath(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _rows(ck: Any, module: str) -> int:
    for suffix in ("weight_packed", "weight"):
        if f"{module}.{suffix}" in ck.files:
            return int(ck.files.info(f"{module}.{suffix}").shape[0])
    raise BadInput(f"{ck.root}: {module} has no weight_packed or weight tensor")


def _write_side_files(plan: PadPlan, staged: Any) -> None:
    ck = plan.checkpoint
    from wna16ctl.sources.headers import read_regular_file
    from wna16ctl.sources.jsonfile import loads

    raw = loads(read_regular_file(ck.root / "config.json", "config.json", limit=64 << 20))
    staged.write_small("config.json", (json.dumps(padded_config(plan, raw), indent=2) + "\n").encode())
    if ck.files.index_path is not None:
        index = loads(read_regular_file(ck.files.index_path, "index", limit=256 << 20))
        if isinstance(index.get("metadata"), dict):  # the bytes of every tensor's data
            index["metadata"]["total_size"] = sum(t.nbytes for _, f in _planned_files(plan) for t in f.tensors)
        staged.write_small(ck.files.index_path.name, (json.dumps(index, indent=2) + "\n").encode())
    shard_names = {_relpath(ck.root, sh.path) for sh in ck.files.shards}
    for entry in sorted(os.scandir(ck.root), key=lambda e: e.name):
        if entry.name in _REWRITTEN or entry.name in shard_names or entry.name.startswith("."):
            continue
        if entry.name.endswith(_WEIGHT_SUFFIXES) or not entry.is_file(follow_symlinks=True):
            continue  # weights in another format, directories: not part of the padded checkpoint
        staged.copy_file(Path(entry.path), entry.name)
