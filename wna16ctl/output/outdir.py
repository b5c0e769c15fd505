"""What repack may create, replace and delete around an output directory OUT.

One rule: wna16ctl deletes or renames only paths it created, in this run or an earlier one, and
can prove it created:

* the staging directory `.OUT.wna16ctl-partial` holds a marker naming the OUT it belongs to;
* a finished OUT (or the previous OUT kept as `.OUT.wna16ctl-old` during a commit) holds a
  wna16ctl manifest (or manifest parts, `wna16ctl.part-R_R.json`, when it holds some of the
  ranks), and `--force` replaces it only when every entry is one the manifest(s) list;
* an empty directory may be used or replaced.

Anything else in one of those places is refused with one line naming the first foreign entry.
Nothing is ever written through a symbolic link: files are created with O_EXCL|O_NOFOLLOW after
unlinking whatever name was there (inside the staging directory only), and every directory on
the way is checked with lstat.  None of these names may be the checkpoint or one of its parents.
One run per OUT: the staging directory itself is flock()ed by the process that owns it, so a
killed run leaves no lock file behind and the lock dies with the process.  Other processes of
the same multi-process run write into it too; the marker's run id proves they joined this run
(`wna16ctl.repacking.distributed`), and each keeps its own journal part.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

from wna16ctl.errors import UsageError

from wna16ctl.output.manifest import FORMAT_NAME as OUTPUT_FORMAT, MANIFEST_NAME  # re-exported

STAGE_MARKER = ".wna16ctl-stage.json"
STAGE_FORMAT = "wna16ctl-stage"
JOURNAL_NAME = ".wna16ctl-journal.json"  # written by the process that owns the staging directory
PART_MANIFEST_PREFIX = "wna16ctl.part-"
_PART_MANIFEST_RE = re.compile(r"^wna16ctl\.part-(0|[1-9][0-9]*)(_(0|[1-9][0-9]*))*\.json$")
_JOURNAL_PART_RE = re.compile(r"^\.wna16ctl-journal-p[1-9][0-9]*\.json$")
_MAX_SMALL_JSON = 64 << 20  # a marker or manifest larger than this is not one of ours


def part_manifest_name(ranks: list[int] | tuple[int, ...]) -> str:
    """The manifest part of an output holding only `ranks` (`--ranks`, `--node-local`)."""
    return f"{PART_MANIFEST_PREFIX}{'_'.join(str(r) for r in sorted(ranks))}.json"


def is_part_manifest_name(name: str) -> bool:
    return bool(_PART_MANIFEST_RE.match(name))


def journal_part_name(process: int) -> str:
    """The journal of process `process` (> 0) of a multi-process run; process 0 keeps JOURNAL_NAME."""
    return JOURNAL_NAME if process == 0 else f".wna16ctl-journal-p{process}.json"


def is_journal_name(name: str) -> bool:
    return name == JOURNAL_NAME or bool(_JOURNAL_PART_RE.match(name))


def part_manifest_names(path: Path) -> list[str]:
    """The manifest parts directly inside `path` (regular files only), sorted."""
    try:
        names = [e.name for e in os.scandir(path) if is_part_manifest_name(e.name) and e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    return sorted(names)


def stage_path(out: Path) -> Path:
    return out.parent / f".{out.name}.wna16ctl-partial"


def old_path(out: Path) -> Path:
    return out.parent / f".{out.name}.wna16ctl-old"


def check_clear_of_checkpoint(out: Path, ckpt: Path) -> None:
    """Refuse an OUT whose own, staging or previous-output name is (or holds) the checkpoint."""
    ck = ckpt.resolve()
    if out == ck or ck in out.parents:
        raise UsageError(f"{out}: the output must not be inside the checkpoint directory")
    for p, what in ((out, "the output"), (stage_path(out), "the staging directory"),
                    (old_path(out), "the previous-output directory")):
        if p == ck or p in ck.parents:
            if p == out:
                raise UsageError(f"{out}: contains the checkpoint {ck}; choose an output directory outside it")
            raise UsageError(f"{p}: {what} of {out} would be the checkpoint {ck} (or hold it); "
                             "choose another output name")


def check_not_inside_an_output(out: Path) -> None:
    """Refuse an OUT inside another repack output (or its staging directory): replacing or resuming
    that output would delete or adopt this one's files."""
    for parent in Path(os.path.abspath(out)).parents:
        if parent.name.endswith(".wna16ctl-partial") and (parent / STAGE_MARKER).is_file():
            raise UsageError(f"{out}: is inside the staging directory {parent} of another run; choose a "
                             "directory outside it")
        if our_manifest(parent) is not None:
            raise UsageError(f"{out}: is inside the repack output {parent}; replacing or resuming that output "
                             "would remove this one; choose a directory outside it")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def is_real_dir(path: Path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def read_json_file(path: Path) -> Any:
    """A small JSON file of ours (never through a link, never a FIFO); None when it is not one."""
    from wna16ctl.sources.jsonfile import JSONError, loads

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_SMALL_JSON:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return loads(data)
    except JSONError:
        return None


def is_our_stage(path: Path, out: Path) -> bool:
    if not is_real_dir(path):
        return False
    marker = read_json_file(path / STAGE_MARKER)
    return isinstance(marker, dict) and marker.get("format") == STAGE_FORMAT and marker.get("out") == str(out)


def _is_manifest(m: Any) -> bool:
    return isinstance(m, dict) and m.get("format") == OUTPUT_FORMAT and isinstance(m.get("files"), dict)


def our_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a wna16ctl output directory at `path`, or None if it is not one.

    Without `wna16ctl.json`, the manifest parts (each valid, one identity) stand for it: a copy
    of the first with the union of their files.  Which ranks they cover is `wna16ctl.repacking.parts`'."""
    if not is_real_dir(path):
        return None
    m = read_json_file(path / MANIFEST_NAME)
    if _is_manifest(m):
        return m
    if os.path.lexists(path / MANIFEST_NAME):
        return None
    parts = [read_json_file(path / name) for name in part_manifest_names(path)]
    if not parts or not all(_is_manifest(p) for p in parts):
        return None
    if any(p.get("identity") != parts[0].get("identity") for p in parts):
        return None
    merged = dict(parts[0])
    merged["files"] = {k: v for p in parts for k, v in p["files"].items()}
    return merged


def _entries(root: Path) -> list[tuple[str, bool]]:
    """(relative path, is a real directory) of everything under `root`, links not followed."""
    out: list[tuple[str, bool]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for d in dirnames:
            p = Path(dirpath) / d
            out.append(((rel_dir / d).as_posix(), is_real_dir(p)))
        for f in filenames:
            out.append(((rel_dir / f).as_posix(), False))
    return sorted(out)


def _unlisted_entry(entries: list[tuple[str, bool]], listed: set[str]) -> str | None:
    """The first of `entries` (`_entries`) that is neither a file `listed` nor a directory holding one."""
    parents = {p.as_posix() for rel in listed for p in Path(rel).parents if p.as_posix() != "."}
    for rel, is_dir in entries:
        if (is_dir and rel in parents) or (not is_dir and rel in listed):
            continue
        return rel
    return None


def foreign_entry(path: Path, out: Path) -> str | None:
    """The first entry of directory `path` that no wna16ctl run wrote, or None if all are ours.

    Ours: an empty directory; a marked staging directory of `out`; an output directory whose
    entries are all listed by its manifest (and the directories holding them).
    """
    entries = _entries(path)
    if not entries or is_our_stage(path, out):
        return None
    manifest = our_manifest(path)
    if manifest is None:
        return entries[0][0]
    # the marker too: a commit killed between its rename and the marker's removal leaves it
    listed = {str(k) for k in manifest["files"]} | {MANIFEST_NAME, STAGE_MARKER, *part_manifest_names(path)}
    return _unlisted_entry(entries, listed)


# The demo checkpoint (`wna16ctl demo OUT`) follows the same rule: its marker, written before any
# other file, lists every file the demo writes there, so `demo --force` replaces a directory only
# when each of its entries is one of them (an interrupted demo included).
DEMO_MARKER = ".wna16ctl-demo.json"
DEMO_FORMAT = "wna16ctl-demo"


def demo_marker(files: list[str]) -> bytes:
    """The marker of a demo checkpoint holding `files` (deterministic: same files, same bytes)."""
    return json.dumps({"format": DEMO_FORMAT, "files": sorted(files)}, sort_keys=True).encode()


def foreign_demo_entry(path: Path) -> str | None:
    """The first entry of directory `path` that no demo wrote, or None: an empty directory, or a
    demo checkpoint whose marker lists every entry."""
    entries = _entries(path)
    if not entries:
        return None
    marker = read_json_file(path / DEMO_MARKER)
    if not (isinstance(marker, dict) and marker.get("format") == DEMO_FORMAT and isinstance(marker.get("files"), list)
            and all(isinstance(f, str) for f in marker["files"])):
        return entries[0][0]
    return _unlisted_entry(entries, {*marker["files"], DEMO_MARKER})


def commit_stage(stage: Path, out: Path, clear_old: Callable[[Path], None]) -> None:
    """Make the finished staging directory `stage` OUT: one rename, after an existing OUT (proven
    ours by the caller) moved aside to `.OUT.wna16ctl-old`, which `clear_old` first proves ours and
    removes when an earlier run left it.  The previous OUT is deleted afterwards; if the second
    rename fails, it is put back, so OUT is the old or the new output, never neither."""
    old = None
    if os.path.lexists(out):
        old = old_path(out)
        clear_old(old)
        os.rename(out, old)
    try:
        os.rename(stage, out)
    except OSError:
        if old is not None:
            with contextlib.suppress(OSError):
                os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_ours(path: Path, out: Path, what: str) -> None:
    """Delete `path` (a staging or previous-output directory) after proving it is ours."""
    st = _lstat(path)
    if st is None:
        return
    foreign = foreign_entry(path, out) if stat.S_ISDIR(st.st_mode) else path.name
    if foreign is not None:
        raise UsageError(f"{path}: {what} exists but was not written by wna16ctl (first foreign entry: "
                         f"{foreign}); move it away and run again")
    shutil.rmtree(path)


def clear_dir(path: Path, keep: tuple[str, ...] = ()) -> None:
    """Empty a directory of ours (its entries are removed, links themselves, never their targets)."""
    for entry in os.scandir(path):
        if entry.name in keep:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def ensure_dirs(root: Path, rel_dir: str) -> Path:
    """Create `root/rel_dir` component by component; refuse a link or non-directory on the way."""
    p = root
    for part in Path(rel_dir).parts:
        p = p / part
        st = _lstat(p)
        if st is None:
            os.mkdir(p)
        elif not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{p}: is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'} "
                             "inside the staging directory; wna16ctl does not write through it (remove it)")
    return p


def create_file(path: Path, *, mode: int = os.O_RDWR) -> int:
    """A new file at `path` (whatever name was there is unlinked first: staging only)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise OSError(errno.EISDIR, "is a directory", str(path)) from None
    return os.open(path, mode | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def write_file(path: Path, data: bytes) -> None:
    fd = create_file(path, mode=os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)


def stage_marker(out: Path, run: str | None = None) -> bytes:
    """The marker of a staging directory; `run` identifies the run that other processes join."""
    return json.dumps({"format": STAGE_FORMAT, "out": str(out), "pid": os.getpid(), "run": run}).encode()


def stage_run(path: Path) -> str | None:
    marker = read_json_file(path / STAGE_MARKER)
    return marker.get("run") if isinstance(marker, dict) else None


def lock_dir(path: Path) -> int:
    """flock() a real directory; returns the descriptor, or -1 when another process holds it."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return -1
    return fd


def in_use(path: Path) -> bool:
    """Whether another run holds the lock of the real directory `path` (`lock_dir`): a staging
    directory being written now, not one an interrupted run left."""
    try:
        if not is_real_dir(path):
            return False
        fd = lock_dir(path)
    except OSError:  # a parent that is a file, no permission: not a run's staging directory
        return False
    if fd < 0:
        return True
    os.close(fd)
    return False


def busy(out: Path, command: str = "repack") -> UsageError:
    """The refusal of a second run into an OUT another run is writing (with or without --resume)."""
    return UsageError(f"{out}: another wna16ctl {command} is writing it; wait for it to finish")
