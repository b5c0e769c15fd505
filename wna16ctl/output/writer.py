"""Writing repack output: planned safetensors files, positioned writes, hashes, atomic commit.

Every output file's header is computed from the plan before any tensor exists, so a tensor can
be written piecewise (expert by expert) at its final offset with `pwrite`; the resident set stays
at one chunk of experts whatever the model size.  Output is staged in a hidden sibling directory
and renamed into place only when complete: an interrupted run never leaves something that looks
finished, and `--resume` reuses the staged files whose hashes match the journal and whose source
bytes (digested as they are read) are unchanged.

Several processes may write one staging directory (torchrun, `wna16ctl.repacking.distributed`): the
owner creates, locks and commits it; the others join it (the marker's run id must be the one the
owner announced) and each journals its own files in a journal part, so no process overwrites
another's record.  The owner merges every part when it adopts an interrupted run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import struct
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import blake3

from wna16ctl.sources.headers import DTYPE_BITS
from wna16ctl.output import outdir
from wna16ctl.errors import BadInput, OutputError, UsageError
from wna16ctl.output.filestream import DEPTH, FileStream, StreamAborted, start_writeback
from wna16ctl.output.filestream import allocate as allocate_blocks
from wna16ctl.output.outdir import JOURNAL_NAME, MANIFEST_NAME

_ALIGN = 8  # safetensors pads the header so that data starts 8-byte aligned
PLANNED_METADATA = {"format": "pt"}  # every output file's safetensors __metadata__
# The digest of every output file (and of the source bytes behind it): BLAKE3, ~4x sha256's speed
# on one core here.  Manifests of earlier versions carry sha256, which verify still reads.
FILE_HASH = "blake3"
FILE_HASHES = ("blake3", "sha256")  # the manifest keys verify accepts, preferred first


def new_hasher(algorithm: str = FILE_HASH) -> Any:
    """A streaming hasher (update / hexdigest) of one of FILE_HASHES."""
    if algorithm == "blake3":
        return blake3.blake3()
    return hashlib.new(algorithm)


def recorded_hash(meta: Any) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a manifest file entry, None when it records none we know."""
    if isinstance(meta, dict):
        for algorithm in FILE_HASHES:
            if isinstance(meta.get(algorithm), str):
                return algorithm, meta[algorithm]
    return None


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BITS[self.dtype]
        for d in self.shape:
            n *= d
        return n // 8


@dataclass
class PlannedFile:
    """One output safetensors file: its tensors in data order and their offsets."""

    relpath: str  # relative to the output root, e.g. rank-0/model-00001-of-00002.safetensors
    tensors: list[PlannedTensor]
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # name -> absolute byte offset of its data
    size: int = 0

    def layout(self) -> None:
        entries: dict[str, Any] = {"__metadata__": dict(PLANNED_METADATA)}
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


def sha256_file(path: Path, bufsize: int = 16 << 20, progress: Callable[[int], None] | None = None, *,
                follow_links: bool = False) -> str:
    """sha256 of a regular file (output files are never links; a checkpoint's may be)."""
    return hash_file(path, "sha256", bufsize, progress, follow_links=follow_links)


def hash_file(path: Path, algorithm: str = FILE_HASH, bufsize: int = 16 << 20,
              progress: Callable[[int], None] | None = None, *, follow_links: bool = False) -> str:
    """Digest (one of FILE_HASHES) of a regular file."""
    h = new_hasher(algorithm)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
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


class InOrderDigest:
    """A file's digest (one of FILE_HASHES) from bytes a caller reads anyway, fed in file order:
    a check that reads the file's tensors hashes the same bytes instead of reading the file a
    second time.  What the caller does not feed (the header, a tensor it skips) is read here; a
    piece fed behind one already hashed (out of file order) leaves the digest to a whole read of
    the file, so that the digest is always the file's."""

    def __init__(self, path: Path, algorithm: str = FILE_HASH, bufsize: int = 16 << 20,
                 progress: Callable[[int], None] | None = None):
        self.path, self.algorithm, self.bufsize, self.progress = path, algorithm, bufsize, progress
        self._h: Any = new_hasher(algorithm)
        self.pos = 0  # bytes hashed so far, from the start of the file
        self.bytes_read = 0  # bytes this object read itself (what the caller did not feed)
        self._whole = False  # a piece came out of order: hash the whole file at the end

    def feed(self, start: int, data: memoryview | bytes) -> None:
        """The file's bytes at `start`, as the caller read them."""
        if self._whole or start < self.pos:
            self._whole = True
            return
        self.hash_through(start)
        self._h.update(data)
        self.pos = start + len(data)

    def hash_through(self, end: int | None) -> None:
        """Hash the file's bytes from `pos` to `end` (None: to its end), read here."""
        if self._whole or (end is not None and self.pos >= end):
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        with open(fd, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(self.path))
            f.seek(self.pos)
            buf = memoryview(bytearray(self.bufsize))
            while end is None or self.pos < end:
                n = f.readinto(buf if end is None else buf[:min(self.bufsize, end - self.pos)])
                if not n:
                    if end is not None:  # shorter than the bytes fed: the file changed under the reader
                        raise OSError(errno.EIO, "the file ended early", str(self.path))
                    break
                self._h.update(buf[:n])
                self.pos += n
                self.bytes_read += n
                if self.progress is not None:
                    self.progress(n)

    def hexdigest(self) -> str:
        """The file's digest: what was fed, and the rest of the file read here."""
        if self._whole:
            return hash_file(self.path, self.algorithm, self.bufsize)
        self.hash_through(None)
        return self._h.hexdigest()


def _os_error(e: OSError, path: Path | str) -> OutputError:
    what = e.strerror or str(e)
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        # mkdir(parents=True, exist_ok=True) says "File exists" when a parent is a file or a device
        what = "a part of this path exists and is not a directory"
    hint = {
        errno.EEXIST: "choose an -o inside a directory",
        errno.ENOTDIR: "choose an -o inside a directory",
        28: "free space on the output filesystem or choose another -o",
        13: "choose an output directory you can write to",
        30: "choose a writable output location",
    }.get(e.errno or 0)
    return OutputError(f"{path}: cannot write ({what}); nothing was left behind", hint=hint)


# copy_file_range cannot copy between these (other filesystems, special files, old kernels)
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


def copy_between(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> int:
    """Copy `nbytes` from one descriptor to another at given offsets; returns the bytes copied
    (fewer only when the source ends early).  In-kernel copy where possible, else read/write."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < nbytes:
        n = -1
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
            except OSError as e:
                if e.errno not in _NO_COPY_RANGE:
                    raise
                use_kernel = False  # e.g. EXDEV: the checkpoint and OUT are on different filesystems
        if n < 0:
            chunk = os.pread(src_fd, min(nbytes - done, 16 << 20), src_offset + done)
            n = len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(dst_fd, view, dst_offset + done + n - len(view)):]
        if n == 0:
            break
        done += n
    return done


class StagedOutput:
    """The output directory under construction (a hidden sibling of OUT) and its file handles.

    Everything it deletes or renames is proven ours first (`wna16ctl.output.outdir`); the staging
    directory is locked (flock) for the run, so one writer per OUT.
    """

    def __init__(self, out: Path, *, force: bool, resume: bool, identity: dict[str, Any],
                 checkpoint: Path | None = None, process: int = 0, join: str | None = None,
                 reusable: dict[str, tuple[str, str | None]] | None = None):
        """`join`: the run id of a staging directory another process of this run owns (then
        `reusable` is what that owner adopted); `process` names this process's journal part."""
        self.out = out
        self.identity = identity  # fingerprint + settings: what --resume must match
        self.stage = outdir.stage_path(out)
        self.done: dict[str, str] = {}  # relpath -> FILE_HASH digest of finished files
        self.sources: dict[str, str] = {}  # relpath -> digest of the source bytes it was made from
        self.reusable: dict[str, tuple[str, str | None]] = {}  # relpath -> (digest, source digest)
        self._fds: dict[str, int] = {}
        self._hashing: dict[str, Future[str]] = {}
        self._lock_fd = -1
        self._created_stage = False
        self.keep_stage = False  # set when a failure must not discard finished work
        # one hashing thread: tasks run in submission order, so a file's ranges hash in order
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wna16ctl-hash")
        # fsync apart from hashing: waiting for one file's writeback does not hold up the next hash
        self._sync_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="wna16ctl-sync")
        self._hashers: dict[str, tuple[Any, list[int]]] = {}  # relpath -> (hasher, [bytes hashed])
        self._hash_buf = ReusedBuffer()  # used by the hash thread only
        self._streams: dict[str, tuple[FileStream, int]] = {}  # relpath -> (stream, fd): files written in order
        self._stream_pool: ThreadPoolExecutor | None = None  # their hashing ...
        self._write_pool: ThreadPoolExecutor | None = None  # ... and their writes
        self._closing: dict[str, tuple[FileStream, int]] = {}  # relpath -> (stream, fd): streams finished, their last writes queued
        self.owner = join is None  # the owner locks, clears, adopts and commits; joiners only write
        self.run = join or uuid.uuid4().hex
        self.journal_name = outdir.journal_part_name(process)
        self._rewritten: set[str] = set()  # files this process (re)creates: their old entry is void
        if checkpoint is not None:
            outdir.check_clear_of_checkpoint(out, checkpoint)
        outdir.check_not_inside_an_output(out)
        if not self.owner:
            self._join(reusable or {})
            return
        try:
            self._prepare(force, resume)
        except BaseException:
            self._release_after_failed_prepare()
            raise

    # setup -------------------------------------------------------------------------------------
    def _release_after_failed_prepare(self) -> None:
        if self._created_stage:  # made by this run a moment ago: ours to remove
            shutil.rmtree(self.stage, ignore_errors=True)
        self._unlock()
        self._pool.shutdown(wait=False)
        self._sync_pool.shutdown(wait=False)

    def release(self) -> None:
        """Give up a prepared staging directory before anything was written (another process of
        the run failed to start): removed if this run created it, else left as it was."""
        self._release_after_failed_prepare()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _prepare(self, force: bool, resume: bool) -> None:
        out, stage = self.out, self.stage
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise UsageError(f"{out}: exists and is not a directory; choose another -o")
        if out.is_dir() and os.stat(out).st_dev != os.stat(out.parent).st_dev:
            # staging beside OUT would be on another filesystem: the final rename cannot work
            raise UsageError(f"{out}: is a mount point; choose a directory inside it as -o")
        nonempty = out.is_dir() and any(out.iterdir())
        if nonempty and not (force or resume):
            raise UsageError(f"{out}: exists and is not empty; pass --force to replace it or --resume to reuse it")
        if nonempty:  # --force or --resume: OUT is replaced at the commit, so all of it must be ours
            foreign = outdir.foreign_entry(out, out)
            if foreign is not None:
                raise UsageError(
                    f"{out}: {'--force' if force else '--resume'} replaces only wna16ctl output, but {foreign} was "
                    "not written by wna16ctl; move it away or choose another -o"
                )
        old = outdir.old_path(out)
        if os.path.lexists(old) and (not outdir.is_real_dir(old) or outdir.foreign_entry(old, out) is not None):
            raise UsageError(f"{old}: exists but was not written by wna16ctl; move it away and run again")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(e, out.parent) from None
        # the staging directory: ours (marked for this OUT), empty, or not there
        if os.path.lexists(stage):
            if not outdir.is_real_dir(stage) or (any(os.scandir(stage)) and not outdir.is_our_stage(stage, out)):
                raise UsageError(
                    f"{stage}: exists but is not wna16ctl's staging directory for {out}; move it away and run again"
                )
        else:
            try:
                stage.mkdir()
                self._created_stage = True
            except OSError as e:
                raise _os_error(e, stage) from None
        try:
            if not os.access(stage, os.W_OK):
                raise PermissionError(13, "Permission denied")
            self._lock_fd = outdir.lock_dir(stage)
        except OSError as e:
            raise _os_error(e, stage) from None
        if self._lock_fd < 0:
            raise outdir.busy(out)
        if resume:
            self.reusable = self._adopt_previous(nonempty)
        if not self.reusable:
            outdir.clear_dir(stage)
        try:
            outdir.write_file(stage / outdir.STAGE_MARKER, outdir.stage_marker(out, self.run))
        except OSError as e:
            raise _os_error(e, stage) from None
        if self.reusable:  # journal parts were merged (and pruned): record them in one place now
            self.checkpoint_journal()

    def _join(self, reusable: dict[str, tuple[str, str | None]]) -> None:
        """Write into the staging directory the owner prepared for this run (never lock, clear,
        adopt or remove it: that is the owner's)."""
        if not outdir.is_our_stage(self.stage, self.out) or outdir.stage_run(self.stage) != self.run:
            raise UsageError(f"{self.stage}: is not the staging directory process 0 of this run prepared (a "
                             "different directory at this path on this machine?); with OUT local to each node "
                             "pass --node-local")
        self.reusable = dict(reusable)

    def _adopt_previous(self, out_nonempty: bool) -> dict[str, tuple[str, str | None]]:
        """Files a previous run finished for the same source and settings (journal or manifest)."""
        found: dict[str, tuple[str, str | None]] = {}
        if outdir.is_our_stage(self.stage, self.out):
            # the owner's journal and every other process's part (a multi-process run)
            names = sorted(e.name for e in os.scandir(self.stage) if outdir.is_journal_name(e.name))
            for name in names:
                journal = outdir.read_json_file(self.stage / name)
                if isinstance(journal, dict) and journal.get("identity") == self.identity:
                    files, sources = journal.get("files"), journal.get("sources") or {}
                    if isinstance(files, dict) and isinstance(sources, dict):
                        found.update({str(k): (str(v), sources.get(k)) for k, v in files.items() if _plain_rel(k)})
            if found:
                self._prune_stage(set(found))  # the parts go too: the owner's journal gets them all
                return found
        if out_nonempty:
            manifest = outdir.our_manifest(self.out)
            if not manifest or manifest.get("identity") != self.identity:
                raise UsageError(
                    f"{self.out}: holds output for another source or other settings (its manifest does not match); "
                    "use --force to replace it"
                )
            # Hard-link the finished files into staging (the old OUT stays intact until the commit);
            # only regular files: a link in OUT is never followed, and never adopted.
            outdir.clear_dir(self.stage)
            found = {}
            for rel, meta in manifest["files"].items():
                # only digests of this version's kind: an earlier version's sha256 entries (and
                # their source_sha256 keys) could never match this run's source digests
                if not isinstance(meta, dict) or not isinstance(meta.get(FILE_HASH), str) or not _plain_rel(rel):
                    continue
                src, dst = self.out / rel, self.stage / rel
                st = outdir._lstat(src)
                if st is None or not stat.S_ISREG(st.st_mode):
                    continue
                outdir.ensure_dirs(self.stage, str(Path(rel).parent))
                try:
                    os.link(src, dst, follow_symlinks=False)
                except OSError:
                    continue
                found[rel] = (meta[FILE_HASH], meta.get(f"source_{FILE_HASH}"))
            return found
        return {}

    def _prune_stage(self, keep: set[str]) -> None:
        """Remove from our staging directory everything but the journaled regular files: a link
        (removed as a link, its target untouched) or stray file must not reach OUT."""
        keep = keep | {outdir.STAGE_MARKER, JOURNAL_NAME}
        dirs = {p.as_posix() for rel in keep for p in Path(rel).parents if p.as_posix() != "."}
        for dirpath, dirnames, filenames in os.walk(self.stage, topdown=True):
            base = Path(dirpath).relative_to(self.stage)
            for d in list(dirnames):
                rel = (base / d).as_posix()
                if rel not in dirs or not outdir.is_real_dir(Path(dirpath) / d):
                    p = Path(dirpath) / d
                    shutil.rmtree(p) if outdir.is_real_dir(p) else os.unlink(p)
                    dirnames.remove(d)
            for name in filenames:
                rel = (base / name).as_posix()
                st = os.lstat(Path(dirpath) / name)
                if rel not in keep or not stat.S_ISREG(st.st_mode):
                    os.unlink(Path(dirpath) / name)

    def staged_file_matches(self, f: PlannedFile, need_source: bool = True) -> bool:
        """True when a staged file from an earlier run has exactly the bytes it was recorded with
        (whether its source is unchanged is the caller's question: see `reuse`, `adopt`);
        `need_source`: only files recorded with the digest of their source bytes qualify."""
        entry = self.reusable.get(f.relpath)
        path = self.stage / f.relpath
        if entry is None or (need_source and entry[1] is None):
            return False
        st = outdir._lstat(path)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            return False
        try:
            return hash_file(path) == entry[0]
        except OSError:
            return False

    def reuse(self, f: PlannedFile, source_digest: str) -> bool:
        """Adopt a matching staged file when it was made from the source bytes as they are now."""
        sha, recorded = self.reusable[f.relpath]
        if recorded != source_digest:
            return False
        self.done[f.relpath] = sha
        self.sources[f.relpath] = source_digest
        return True

    def adopt(self, f: PlannedFile) -> bool:
        """Adopt a matching staged file the caller has proven current by rebuilding it."""
        self.done[f.relpath] = self.reusable[f.relpath][0]
        return True

    def check_space(self, nbytes: int) -> None:
        """Fail before hours of work when the output filesystem cannot hold what is left to write
        (files are created as they are first written, so no descriptor is held per pending file)."""
        try:
            st = os.statvfs(self.stage)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise OutputError(
                f"{self.stage}: cannot write ({nbytes} bytes needed, {free} free); nothing was left behind",
                hint="free space on the output filesystem or choose another -o",
            )

    # writing -------------------------------------------------------------------------------------
    def open(self, f: PlannedFile) -> None:
        """Create `f` in staging with its header (idempotent: files are opened when first written)."""
        if f.relpath in self._fds:
            return
        self._rewritten.add(f.relpath)
        path = self.stage / f.relpath
        try:
            outdir.ensure_dirs(self.stage, str(Path(f.relpath).parent))
            # a new inode: a staged file may be a hard link to the previous output (--resume),
            # which must stay intact until the commit
            fd = outdir.create_file(path)
            self._fds[f.relpath] = fd
            os.pwrite(fd, f.header, 0)
            os.ftruncate(fd, f.size)
        except OSError as e:
            raise _os_error(e, path) from None

    def pwrite(self, f: PlannedFile, offset: int, data: Any) -> None:
        """Write a CPU tensor, bytes or a memoryview at `offset` of `f`."""
        fd = self._fds[f.relpath]
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
        else:  # a torch tensor (torch is only imported by the torch data path)
            from wna16ctl.sources.tensors import writable_view

            t = data.contiguous()  # held until the writes below are done: the view does not own it
            view = writable_view(t)
        done = 0
        total = view.nbytes
        try:
            while done < total:
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _os_error(e, self.stage / f.relpath) from None

    def stream(self, f: PlannedFile, max_reserve: int, depth: int = DEPTH, *, allocate: bool = False) -> FileStream:
        """Create `f` in staging to be written front to back (`wna16ctl.output.filestream`), starting
        with its header; `max_reserve` is the largest piece the caller will reserve at once,
        `depth` the blocks that may be in flight; `allocate`: its blocks allocated up front
        (`filestream.allocate`)."""
        self._rewritten.add(f.relpath)
        path = self.stage / f.relpath
        try:
            outdir.ensure_dirs(self.stage, str(Path(f.relpath).parent))
            fd = outdir.create_file(path, mode=os.O_WRONLY)  # a new inode, as in open()
        except OSError as e:
            raise _os_error(e, path) from None
        try:
            os.ftruncate(fd, f.size)
            if allocate:
                allocate_blocks(fd, f.size)
        except OSError as e:
            os.close(fd)
            raise _os_error(e, path) from None
        if self._stream_pool is None:
            # hashing (CPU: two threads) apart from writing (waiting for the disk: several in flight)
            self._stream_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="wna16ctl-hash-stream")
            self._write_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wna16ctl-write-stream")
        s = FileStream(fd, f.size, new_hasher(), self._stream_pool, write_pool=self._write_pool,
                       max_reserve=max_reserve,
                       on_error=lambda e: _os_error(e, path), direct=os.environ.get("WNA16CTL_DIRECT_IO", "1") != "0",
                       depth=depth)
        self._streams[f.relpath] = (s, fd)
        s.write(f.header)
        return s

    def finish_stream(self, f: PlannedFile) -> None:
        """Complete a streamed file without waiting: its last block, then fsync and close, run on
        the I/O pool; the digest is journaled like `finish`'s once that is done (no source digest:
        `--resume` checks a streamed file by rebuilding it)."""
        s, fd = self._streams.pop(f.relpath)
        path = self.stage / f.relpath
        done: Future[str] = Future()
        self._closing[f.relpath] = (s, fd)

        def complete(error: BaseException | None) -> None:
            if self._closing.pop(f.relpath, None) is None:  # closed by abort() meanwhile
                return
            if isinstance(error, StreamAborted):  # abort(): the file is simply not journaled
                os.close(fd)
                done.cancel()
                return
            try:
                if error is None:
                    os.fsync(fd)
            except OSError as e:
                error = _os_error(e, path)
            finally:
                os.close(fd)
            if done.set_running_or_notify_cancel():  # not cancelled by abort()
                if error is None:
                    done.set_result(s.hasher.hexdigest())
                else:
                    done.set_exception(error)

        self._hashing[f.relpath] = done
        s.finish(complete)

    def start_writeback(self, f: PlannedFile, offset: int, nbytes: int) -> None:
        """Start writing [offset, offset + nbytes) of `f` to disk now (sync_file_range, Linux), so
        that the fsync at the end finds little left to wait for; a no-op where unavailable."""
        start_writeback(self._fds[f.relpath], offset, nbytes)

    def copy_range(self, f: PlannedFile, offset: int, src_fd: int, src_offset: int, nbytes: int,
                   source: Path | None = None) -> None:
        """Copy bytes from a source file (in the kernel where possible, across filesystems too)."""
        self.open(f)
        try:
            done = copy_between(src_fd, src_offset, self._fds[f.relpath], offset, nbytes)
        except OSError as e:
            raise _os_error(e, self.stage / f.relpath) from None
        if done < nbytes:
            # The input is at fault (truncated after planning): name it, not the staging file.
            raise BadInput(
                f"{source or 'the source'}: ends before the tensor data the plan expects (the shard was "
                "truncated or replaced after planning); restore the file and run again; nothing was left behind"
            )

    def written_upto(self, f: PlannedFile, offset: int) -> None:
        """Bytes [0, offset) of `f` are final: hash them in the background while work goes on.

        Files are filled front to back in units (non-expert groups, then layers in order), so
        the hash of a file is nearly done when its last unit is written, instead of starting then.
        """
        hasher, pos = self._hashers.setdefault(f.relpath, (new_hasher(), [0]))
        fd = self._fds[f.relpath]
        self._pool.submit(_hash_range, fd, hasher, pos, offset, self._hash_buf)

    def hash_written(self, f: PlannedFile, offset: int, data: memoryview) -> bool:
        """Feed `data`, just written at `offset` of `f`, to the file's hash without reading it back,
        when it is next in file order; False (nothing done) when the hash thread is behind.

        Safe beside the hash thread: its position reaches `offset` only once it has hashed every
        byte before, and no range it is given goes past data that is not final yet."""
        hasher, pos = self._hashers.setdefault(f.relpath, (new_hasher(), [0]))
        if pos[0] != offset:
            return False
        hasher.update(data)
        pos[0] = offset + data.nbytes
        return True

    def finish(self, f: PlannedFile, source_digest: str) -> None:
        """Complete a file: hash what is left, then fsync and close it, all in the background
        (the hash thread hands the fsync to a sync thread and goes on with the next file)."""
        fd = self._fds.pop(f.relpath)
        hasher, pos = self._hashers.setdefault(f.relpath, (new_hasher(), [0]))
        path = self.stage / f.relpath
        self.sources[f.relpath] = source_digest
        done: Future[str] = Future()

        def sync(digest: str) -> None:
            try:
                os.fsync(fd)
            except OSError as e:
                done.set_exception(_os_error(e, path))
            else:
                done.set_result(digest)
            finally:
                os.close(fd)

        def complete() -> None:
            try:
                _hash_range(fd, hasher, pos, f.size, self._hash_buf)
            except OSError as e:
                os.close(fd)
                done.set_exception(_os_error(e, path))
                return
            try:
                self._sync_pool.submit(sync, hasher.hexdigest())
            except RuntimeError as e:  # shut down by abort()
                os.close(fd)
                done.set_exception(e)

        def queued_cancel(fut: Future[None]) -> None:
            if fut.cancelled():  # abort() cancelled the queued hash: nothing will finish this file
                os.close(fd)
                done.cancel()

        self._pool.submit(complete).add_done_callback(queued_cancel)
        self._hashing[f.relpath] = done

    def write_small(self, relpath: str, data: bytes) -> None:
        path = self.stage / relpath
        try:
            outdir.ensure_dirs(self.stage, str(Path(relpath).parent))
            outdir.write_file(path, data)
        except OSError as e:
            raise _os_error(e, path) from None
        h = new_hasher()
        h.update(data)
        self.done[relpath] = h.hexdigest()

    def copy_file(self, src: Path, relpath: str) -> None:
        """Copy a side file (tokenizer, config) of the checkpoint: regular files only."""
        dst = self.stage / relpath
        try:
            sfd = os.open(src, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise BadInput(f"{src}: cannot read ({e.strerror})") from None
        try:
            st = os.fstat(sfd)
            if not stat.S_ISREG(st.st_mode):
                raise BadInput(f"{src}: is not a regular file; replace it with the file itself")
            try:
                outdir.ensure_dirs(self.stage, str(Path(relpath).parent))
                dfd = outdir.create_file(dst, mode=os.O_WRONLY)
                try:
                    copy_between(sfd, 0, dfd, 0, st.st_size)
                finally:
                    os.close(dfd)
            except OSError as e:
                raise _os_error(e, dst) from None
        finally:
            os.close(sfd)
        self.done[relpath] = hash_file(dst)

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
        # Entries adopted from an earlier run stay until this process rewrites the file: in a
        # multi-process run they may be another process's, not yet in its own journal part.
        files = {rel: v[0] for rel, v in self.reusable.items() if rel not in self._rewritten}
        sources = {rel: v[1] for rel, v in self.reusable.items() if rel not in self._rewritten and v[1] is not None}
        files.update(self.done)
        sources.update(self.sources)
        data = json.dumps({"identity": self.identity, "files": files, "sources": sources}, indent=1).encode()
        tmp = self.stage / (self.journal_name + ".tmp")
        try:
            outdir.write_file(tmp, data)
            os.replace(tmp, self.stage / self.journal_name)
        except OSError as e:
            raise _os_error(e, tmp) from None

    # the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        """A joining process's end: its files hashed, synced and journaled (the owner commits)."""
        try:
            self.collect_hashes()
        finally:
            self._pool.shutdown(wait=True)
            self._shutdown_stream_pools()

    def _shutdown_stream_pools(self, cancel: bool = False) -> None:
        for pool in (self._stream_pool, self._write_pool):  # hashing first: its final tasks wait for writes
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=cancel)

    def commit(self, manifest: dict[str, Any], manifest_name: str = MANIFEST_NAME) -> None:
        """Write the manifest (or a manifest part), then make the staged directory OUT in one rename.

        On failure the staging directory stays locked, so that `abort` can still remove it (or keep
        it for --resume): the caller's error then says what is on disk."""
        assert self.owner, "only the owner of the staging directory commits it"
        self.collect_hashes()
        manifest_bytes = json.dumps(manifest, indent=2).encode() + b"\n"
        try:
            if os.path.lexists(self.out):
                foreign = outdir.foreign_entry(self.out, self.out) if outdir.is_real_dir(self.out) else self.out.name
                if foreign is not None:  # appeared while we worked: keep the finished output for --resume
                    self.keep_stage = True
                    raise UsageError(f"{self.out}: {foreign} was added while repack ran and is not wna16ctl's; "
                                     f"move it away and rerun with --resume (the finished output is kept)")
            # the manifest first, the journal parts after: a disk that fills here leaves the journal whole
            outdir.write_file(self.stage / manifest_name, manifest_bytes)
            for entry in os.scandir(self.stage):  # every process's journal part
                if outdir.is_journal_name(entry.name):
                    os.unlink(entry.path)
            outdir.commit_stage(self.stage, self.out, lambda old: outdir.remove_ours(
                old, self.out, "the previous-output directory"))
            # the marker goes last: until the rename the staging directory must stay provably ours
            (self.out / outdir.STAGE_MARKER).unlink(missing_ok=True)
        except OSError as e:
            raise _os_error(e, self.out) from None
        finally:
            self._pool.shutdown(wait=True)
            self._sync_pool.shutdown(wait=True)
            self._shutdown_stream_pools()
        self._unlock()

    def abort(self, keep_for_resume: bool) -> None:
        """Close everything; remove the staging directory unless it should serve --resume."""
        for s, _ in [*self._streams.values(), *self._closing.values()]:
            s.abort()
        self._shutdown_stream_pools(cancel=True)  # no write may be running when its descriptor closes
        for _, fd in [*self._streams.values(), *self._closing.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._streams.clear()
        self._closing.clear()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for fut in self._hashing.values():
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sync_pool.shutdown(wait=True)
        if keep_for_resume or self.keep_stage or not self.owner:
            try:
                self.checkpoint_journal()
            except OutputError:
                pass
        elif self._lock_fd >= 0:  # ours and locked: remove it
            shutil.rmtree(self.stage, ignore_errors=True)
        self._unlock()


def _plain_rel(rel: Any) -> bool:
    """A manifest path that stays inside OUT."""
    return (isinstance(rel, str) and bool(rel) and not os.path.isabs(rel) and "\\" not in rel
            and all(p not in ("", ".", "..") for p in rel.split("/")))


class ReusedBuffer:
    """One read buffer, allocated on first use and reused: a fresh buffer per read would cost a
    page fault per 4 KiB (the hash thread's read-back of what was just written, repack's copy of
    the non-expert tensors)."""

    def __init__(self, size: int = 4 << 20):
        self.size = size
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(bytearray(self.size))
        return self._view


def _hash_range(fd: int, hasher: Any, pos: list[int], end: int, buf: ReusedBuffer | None = None) -> None:
    """Feed bytes [pos[0], end) of `fd` to `hasher` (page-cache reads of what was just written)."""
    view = (buf or ReusedBuffer(min(4 << 20, max(end - pos[0], 1)))).view()
    while pos[0] < end:
        n = os.preadv(fd, [view[: min(len(view), end - pos[0])]], pos[0])
        if n == 0:
            raise OSError(5, "file shorter than planned")
        hasher.update(view[:n])
        pos[0] += n


