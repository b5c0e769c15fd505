"""Writing repack output: planned safetensors files, positioned writes, hashes, atomic commit.

Every output file's header is computed from the plan before any tensor exists, so a tensor can
be written piecewise (expert by expert) at its final offset with `pwrite`; the resident set stays
at one chunk of experts whatever the model size.  Output is staged in a hidden sibling directory
and renamed into place only when complete: an interrupted run never leaves something that looks
finished, and `--resume` reuses the staged files whose hashes match the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from wna16ctl.checkpoint.headers import DTYPE_SIZES
from wna16ctl.checkpoint.tensors import SAFETENSORS_DTYPES, writable_view
from wna16ctl.errors import BadInput, OutputError, UsageError

MANIFEST_NAME = "wna16ctl.json"
JOURNAL_NAME = ".wna16ctl-journal.json"
_ALIGN = 8  # safetensors pads the header so that data starts 8-byte aligned


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class PlannedFile:
    """One output safetensors file: its tensors in data order and their offsets."""

    relpath: str  # relative to the output root, e.g. rank-0/model-00001-of-00002.safetensors
    tensors: list[PlannedTensor]
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # name -> absolute byte offset of its data
    size: int = 0

    def layout(self) -> None:
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        pos = 0
        rel: dict[str, int] = {}
        for t in self.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            rel[t.name] = pos
            pos += t.nbytes
        blob = json.dumps(entries, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % _ALIGN)
        self.header = struct.pack("<Q", len(blob)) + blob
        base = len(self.header)
        self.offsets = {k: base + v for k, v in rel.items()}
        self.size = base + pos


def split_into_files(groups: Iterable[list[PlannedTensor]], prefix: str, max_bytes: int) -> list[PlannedFile]:
    """Fill files in order with whole groups (a group never straddles files) up to `max_bytes`."""
    chunks: list[list[PlannedTensor]] = [[]]
    size = 0
    for g in groups:
        gbytes = sum(t.nbytes for t in g)
        if chunks[-1] and size + gbytes > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].extend(g)
        size += gbytes
    n = len(chunks)
    files = [PlannedFile(f"{prefix}model-{i + 1:05d}-of-{n:05d}.safetensors", c) for i, c in enumerate(chunks)]
    for f in files:
        f.layout()
    return files


def staging_path(out: Path) -> Path:
    """The hidden sibling of OUT where a run builds its output (kept after an interrupt for --resume)."""
    return out.parent / f".{out.name}.wna16ctl-partial"


def sha256_file(path: Path, bufsize: int = 16 << 20, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def _os_error(e: OSError, path: Path | str) -> OutputError:
    what = e.strerror or str(e)
    hint = {
        28: "free space on the output filesystem or choose another -o",
        13: "choose an output directory you can write to",
        30: "choose a writable output location",
    }.get(e.errno or 0)
    return OutputError(f"{path}: cannot write ({what}); nothing was left behind", hint=hint)


class StagedOutput:
    """The output directory under construction (a hidden sibling of OUT) and its file handles."""

    def __init__(self, out: Path, *, force: bool, resume: bool, identity: dict[str, Any]):
        self.out = out
        self.identity = identity  # fingerprint + settings: what --resume must match
        self.stage = staging_path(out)
        self.done: dict[str, str] = {}  # relpath -> sha256 of finished files
        self._fds: dict[str, int] = {}
        self._hashing: dict[str, Future[str]] = {}
        # one hashing thread: tasks run in submission order, so a file's ranges hash in order
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wna16ctl-hash")
        self._hashers: dict[str, tuple[Any, list[int]]] = {}  # relpath -> (sha256, [bytes hashed])
        try:
            self._prepare(force, resume)
        except BaseException:
            self._unlock()
            raise

    # setup -------------------------------------------------------------------------------------
    def _lock(self) -> None:
        """One writer per OUT: a second repack into the same OUT would share the staging dir."""
        import fcntl

        self._lock_path = self.out.parent / f".{self.out.name}.wna16ctl-lock"
        try:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _os_error(e, self._lock_path) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise UsageError(f"{self.out}: another wna16ctl repack is writing it; wait for it to finish") from None

    def _unlock(self) -> None:
        if getattr(self, "_lock_fd", -1) >= 0:
            self._lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _prepare(self, force: bool, resume: bool) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UsageError(f"{out}: exists and is not a directory; choose another -o")
        nonempty = out.is_dir() and any(out.iterdir())
        if nonempty and not (force or resume):
            raise UsageError(f"{out}: exists and is not empty; pass --force to replace it or --resume to reuse it")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(e, out.parent) from None
        self._lock()
        reusable: dict[str, str] = {}
        if resume:
            reusable = self._adopt_previous(nonempty)
        if self.stage.exists() and not reusable:
            shutil.rmtree(self.stage)
        try:
            self.stage.mkdir(exist_ok=True)
            if not os.access(self.stage, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise _os_error(e, self.stage) from None
        self.reusable = reusable

    def _adopt_previous(self, out_nonempty: bool) -> dict[str, str]:
        """Files a previous run finished for the same source and settings (journal or manifest)."""
        if self.stage.is_dir():
            journal = _read_json(self.stage / JOURNAL_NAME)
            if journal and journal.get("identity") == self.identity:
                return dict(journal.get("files", {}))
        if out_nonempty:
            manifest = _read_json(self.out / MANIFEST_NAME)
            if not manifest or manifest.get("identity") != self.identity:
                raise UsageError(
                    f"{self.out}: holds output for another source or other settings (its manifest does not match); "
                    "use --force to replace it"
                )
            # Hard-link the finished files into staging (the old OUT stays intact until the commit).
            if self.stage.exists():
                shutil.rmtree(self.stage)
            files = {k: v["sha256"] for k, v in manifest.get("files", {}).items()}
            for rel in files:
                src, dst = self.out / rel, self.stage / rel
                if not src.is_file():
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copyfile(src, dst)
            return files
        return {}

    def is_reusable(self, f: PlannedFile) -> bool:
        """True when a staged file from an earlier run has exactly the expected bytes."""
        want = self.reusable.get(f.relpath)
        path = self.stage / f.relpath
        if want is None or not path.is_file() or path.stat().st_size != f.size:
            return False
        if sha256_file(path) != want:
            return False
        self.done[f.relpath] = want
        return True

    # writing -------------------------------------------------------------------------------------
    def open(self, f: PlannedFile) -> None:
        path = self.stage / f.relpath
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Unlink first: a staged file may be a hard link to the previous output (--resume),
            # which must stay intact until the commit.
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self._fds[f.relpath] = fd
            os.pwrite(fd, f.header, 0)
            # Reserve the whole file now: a full disk fails here, before hours of work.
            os.posix_fallocate(fd, 0, f.size) if hasattr(os, "posix_fallocate") else os.ftruncate(fd, f.size)
        except OSError as e:
            raise _os_error(e, path) from None

    def pwrite(self, f: PlannedFile, offset: int, data: torch.Tensor | bytes | memoryview) -> None:
        fd = self._fds[f.relpath]
        if isinstance(data, torch.Tensor):
            t = data.contiguous()  # held until the writes below are done: the view does not own it
            view = writable_view(t)
        else:
            view = memoryview(data)
        done = 0
        total = view.nbytes
        try:
            while done < total:
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _os_error(e, self.stage / f.relpath) from None

    def copy_range(self, f: PlannedFile, offset: int, src_fd: int, src_offset: int, nbytes: int,
                   source: Path | None = None) -> None:
        """Copy bytes from a source file without passing them through Python (copy_file_range)."""
        fd = self._fds[f.relpath]
        done = 0
        try:
            while done < nbytes:
                if hasattr(os, "copy_file_range"):
                    n = os.copy_file_range(src_fd, fd, nbytes - done, src_offset + done, offset + done)
                else:  # pragma: no cover - non-Linux
                    chunk = os.pread(src_fd, min(nbytes - done, 16 << 20), src_offset + done)
                    n = os.pwrite(fd, chunk, offset + done)
                if n == 0:
                    # The input is at fault (truncated after planning): name it, not the staging file.
                    raise BadInput(
                        f"{source or 'the source'}: ends before the tensor data the plan expects (the shard was "
                        "truncated or replaced after planning); restore the file and run again; nothing was left behind"
                    )
                done += n
        except OSError as e:
            raise _os_error(e, self.stage / f.relpath) from None

    def written_upto(self, f: PlannedFile, offset: int) -> None:
        """Bytes [0, offset) of `f` are final: hash them in the background while work goes on.

        Files are filled front to back in units (non-expert groups, then layers in order), so
        the hash of a file is nearly done when its last unit is written, instead of starting then.
        """
        hasher, pos = self._hashers.setdefault(f.relpath, (hashlib.sha256(), [0]))
        fd = self._fds[f.relpath]
        self._pool.submit(_hash_range, fd, hasher, pos, offset)

    def finish(self, f: PlannedFile) -> None:
        """Complete a file: hash what is left, fsync and close it, all in the background."""
        fd = self._fds.pop(f.relpath)
        hasher, pos = self._hashers.setdefault(f.relpath, (hashlib.sha256(), [0]))
        path = self.stage / f.relpath

        def complete() -> str:
            try:
                _hash_range(fd, hasher, pos, f.size)
                os.fsync(fd)
            except OSError as e:
                raise _os_error(e, path) from None
            finally:
                os.close(fd)
            return hasher.hexdigest()

        self._hashing[f.relpath] = self._pool.submit(complete)

    def write_small(self, relpath: str, data: bytes) -> None:
        path = self.stage / relpath
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        except OSError as e:
            raise _os_error(e, path) from None
        self.done[relpath] = hashlib.sha256(data).hexdigest()

    def copy_file(self, src: Path, relpath: str) -> None:
        dst = self.stage / relpath
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        except OSError as e:
            raise _os_error(e, dst) from None
        self.done[relpath] = sha256_file(dst)

    def collect_hashes(self) -> None:
        for rel, fut in self._hashing.items():
            self.done[rel] = fut.result()
        self._hashing.clear()
        self.checkpoint_journal()

    def checkpoint_journal(self) -> None:
        """Record finished files so that --resume after an interruption can skip them."""
        for rel, fut in list(self._hashing.items()):
            if fut.cancelled():  # abort() cancelled a queued hash: the file is simply not journaled
                del self._hashing[rel]
            elif fut.done():
                self.done[rel] = fut.result()
                del self._hashing[rel]
        data = json.dumps({"identity": self.identity, "files": self.done}, indent=1).encode()
        tmp = self.stage / (JOURNAL_NAME + ".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.stage / JOURNAL_NAME)
        except OSError as e:
            raise _os_error(e, tmp) from None

    # the end -------------------------------------------------------------------------------------
    def commit(self, manifest: dict[str, Any]) -> None:
        """Write the manifest, then make the staged directory OUT in one rename."""
        self.collect_hashes()
        (self.stage / JOURNAL_NAME).unlink(missing_ok=True)
        manifest_bytes = json.dumps(manifest, indent=2).encode() + b"\n"
        try:
            (self.stage / MANIFEST_NAME).write_bytes(manifest_bytes)
            old = None
            if self.out.exists():
                old = self.out.parent / f".{self.out.name}.wna16ctl-old"
                if old.exists():
                    shutil.rmtree(old)
                os.rename(self.out, old)
            os.rename(self.stage, self.out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            raise _os_error(e, self.out) from None
        finally:
            self._pool.shutdown(wait=True)
            self._unlock()

    def abort(self, keep_for_resume: bool) -> None:
        """Close everything; remove the staging directory unless it should serve --resume."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for fut in self._hashing.values():
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if keep_for_resume:
            try:
                self.checkpoint_journal()
            except OutputError:
                pass
        else:
            shutil.rmtree(self.stage, ignore_errors=True)
        self._unlock()


def _hash_range(fd: int, hasher: Any, pos: list[int], end: int, bufsize: int = 4 << 20) -> None:
    """Feed bytes [pos[0], end) of `fd` to `hasher` (page-cache reads of what was just written).

    One reused buffer: a fresh 4 MiB bytes object per read would cost a page fault per 4 KiB.
    """
    buf = bytearray(min(bufsize, max(end - pos[0], 1)))
    view = memoryview(buf)
    while pos[0] < end:
        n = os.preadv(fd, [view[: min(len(buf), end - pos[0])]], pos[0])
        if n == 0:
            raise OSError(5, "file shorter than planned")
        hasher.update(view[:n])
        pos[0] += n


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def st_dtype(dtype: torch.dtype) -> str:
    return SAFETENSORS_DTYPES[dtype]
