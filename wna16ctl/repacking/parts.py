"""Outputs holding some of the ranks (`repack --ranks`, `--node-local`), and joining them into one.

Such a part is an ordinary repack output whose manifest is named `wna16ctl.part-R_R….json`
(its ranks, `outdir.part_manifest_name`) instead of `wna16ctl.json`.  Its content is the manifest
a whole run writes, except that `files` lists only what the part holds (its ranks' files and the
side files) and a last key `part: {ranks}` names its ranks.  So parts are joined by copying their
contents into one directory (rank directories never overlap; the side files are equal) and, if
a plain `wna16ctl.json` is wanted, `wna16ctl assemble DIR`: it checks that the parts agree and
cover every rank and that every listed file is there with its size, then writes the manifest of
the whole run (byte for byte the one a single run writes, given the same checkpoint path) and
removes the parts.  `verify` reads parts directly as well: one part, or several copied together.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wna16ctl.output import outdir
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.output.outdir import MANIFEST_NAME, OUTPUT_FORMAT

# May differ between parts made on different machines: the whole manifest takes the part with the
# lowest rank's (the checkpoint path is not part of the identity; the fingerprint is)
_MAY_DIFFER = ("source.path",)


def part_ranks(manifest: dict[str, Any]) -> list[int] | None:
    """The ranks a (merged) manifest part covers; None for a whole run's manifest."""
    part = manifest.get("part")
    return None if part is None else list(part["ranks"])


def read_part(path: Path) -> dict[str, Any]:
    """One manifest part, with its `part.ranks` checked against its name."""
    from wna16ctl.sources.jsonfile import JSONError, loads

    st = outdir._lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: not a regular file; a manifest part is one (copy the file itself)")
    try:
        m = loads(path.read_bytes())
    except OSError as e:
        raise BadInput(f"{path}: unreadable ({e.strerror})") from None
    except JSONError as e:
        raise BadInput(f"{path}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != OUTPUT_FORMAT or not isinstance(m.get("files"), dict):
        raise BadInput(f"{path}: not a wna16ctl repack manifest part")
    part = m.get("part")
    ranks = part.get("ranks") if isinstance(part, dict) else None
    if (not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                            for r in ranks)
            or outdir.part_manifest_name(ranks) != path.name or len(set(ranks)) != len(ranks)):
        raise BadInput(f"{path}: field 'part' must be {{\"ranks\": [...]}} naming the ranks in the file name; "
                       "the manifest part is corrupt")
    return m


def _without(m: dict[str, Any]) -> dict[str, Any]:
    """What every part of one run has in common: all but `files`, `part` and `source.path`."""
    out = {k: v for k, v in m.items() if k not in ("files", "part")}
    if isinstance(out.get("source"), dict):
        out["source"] = {k: v for k, v in out["source"].items() if k != "path"}
    return out


def merge_parts(root: Path, names: list[str]) -> dict[str, Any]:
    """The manifest parts `names` in `root` as one manifest part covering all their ranks.
    Parts of another run (other identity, plan or settings), or disagreeing about a file, are refused."""
    parts = sorted(((name, read_part(root / name)) for name in names), key=lambda p: min(p[1]["part"]["ranks"]))
    first_name, first = parts[0]
    common = _without(first)
    files: dict[str, Any] = {}
    owner: dict[str, str] = {}
    ranks: set[int] = set()
    for name, m in parts:
        mine = _without(m)
        if mine != common:
            key = next(k for k in sorted(set(mine) | set(common)) if mine.get(k) != common.get(k))
            raise BadInput(f"{root / name}: its {key!r} differs from {first_name}'s: the parts are from different "
                           "runs (checkpoint or settings); repack the missing ranks with the same settings")
        tp = m.get("tp")
        if not all(isinstance(tp, int) and r < tp for r in m["part"]["ranks"]):
            raise BadInput(f"{root / name}: names ranks {m['part']['ranks']} outside tp {tp}; the manifest part is corrupt")
        for rel, meta in m["files"].items():
            if rel in files and files[rel] != meta:
                raise BadInput(f"{root / rel}: {name} and {owner[rel]} record different contents for it; the parts are "
                               "from different runs")
            files[rel], owner[rel] = meta, name
        ranks.update(m["part"]["ranks"])
    merged = dict(first)
    merged["files"] = dict(sorted(files.items()))
    merged["part"] = {"ranks": sorted(ranks)}
    return merged


def _inside(rel: Any) -> bool:
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel
            and all(p not in ("", ".", "..") for p in rel.split("/")))


def whole_manifest(merged: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the whole run from merged parts covering every rank (same key order)."""
    return {k: v for k, v in merged.items() if k != "part"}


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """A manifest as repack writes it (StagedOutput.commit)."""
    return json.dumps(manifest, indent=2).encode() + b"\n"


@dataclass
class AssembleResult:
    out: Path
    parts: list[str]  # the manifest parts joined (and removed)
    ranks: list[int]
    files: int
    manifest: dict[str, Any]

    @property
    def next_steps(self) -> list[str]:
        """The verify line that checks the joined output against its checkpoint (the source path
        its manifest records), shell-quoted."""
        import shlex

        source = (self.manifest.get("source") or {}).get("path")
        return [shlex.join(["wna16ctl", "verify", str(source), str(self.out)])] if source else []

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.out), "parts": self.parts, "ranks": self.ranks, "files": self.files,
                "manifest_name": MANIFEST_NAME, "manifest": self.manifest, "next_steps": self.next_steps}


def assemble(out: str | os.PathLike[str]) -> AssembleResult:
    """Join the manifest parts copied into `out` into its `wna16ctl.json` (see the module doc).

    Checks presence and size of every listed file, not its content (`verify` hashes them)."""
    root = Path(out)
    if not outdir.is_real_dir(root):
        raise UsageError(f"{root}: not a directory; pass the directory the parts were copied into")
    names = outdir.part_manifest_names(root)
    existing = outdir.read_json_file(root / MANIFEST_NAME) if os.path.lexists(root / MANIFEST_NAME) else None
    if not names:
        if existing is not None:
            raise UsageError(f"{root}: already one output ({MANIFEST_NAME}, no manifest parts); nothing to assemble")
        raise UsageError(f"{root}: holds no manifest part (wna16ctl.part-*.json); copy the parts' contents into it")
    merged = merge_parts(root, names)
    tp = merged.get("tp")
    missing = [r for r in range(tp if isinstance(tp, int) else 0) if r not in merged["part"]["ranks"]]
    if missing:
        raise UsageError(f"{root}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {tp} "
                         f"missing (the parts hold {', '.join(map(str, merged['part']['ranks']))}); copy the part that "
                         "holds them into it and run again")
    whole = whole_manifest(merged)
    data = manifest_bytes(whole)
    if existing is not None and existing != whole:
        raise UsageError(f"{root / MANIFEST_NAME}: exists and is not the manifest these parts make; move it away")
    for rel, meta in whole["files"].items():
        path = root / rel
        if not _inside(rel):
            raise BadInput(f"{root}: a manifest part names {rel!r}, a path outside the directory; the part is corrupt")
        st = outdir._lstat(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: listed by the parts but {'missing' if st is None else 'not a regular file'}; "
                             "copy the parts' contents again")
        if st.st_size != meta.get("bytes"):
            raise UsageError(f"{path}: {st.st_size} bytes, the parts say {meta.get('bytes')} (an incomplete copy?); "
                             "copy it again")
    tmp = root / (MANIFEST_NAME + ".tmp")
    listed = set(whole["files"]) | {MANIFEST_NAME, tmp.name, outdir.STAGE_MARKER, *names}
    parents = {p.as_posix() for rel in listed for p in Path(rel).parents if p.as_posix() != "."}
    for rel, is_dir in outdir._entries(root):
        if not ((is_dir and rel in parents) or (not is_dir and rel in listed)):
            raise UsageError(f"{root}: {rel} is not listed by any manifest part; move it away and run again")
    try:
        fd = outdir.create_file(tmp, mode=os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / MANIFEST_NAME)
        for name in names:  # after the rename: an interrupted assemble is simply run again
            os.unlink(root / name)
        (root / outdir.STAGE_MARKER).unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"{root}: cannot write {MANIFEST_NAME} ({e.strerror}); nothing was changed") from None
    return AssembleResult(root, names, merged["part"]["ranks"], len(whole["files"]), whole)
