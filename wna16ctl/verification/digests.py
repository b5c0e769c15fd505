"""The manifest's digests of the rank files, taken as the round trip goes rather than before it.

A rank file stores each tensor for all of its experts before the next tensor, so the round trip,
which reads one expert across every tensor of a layer, cannot feed a file-order hasher.  Hashing
every file first, then round-tripping, reads the output from disk twice once it is larger than
the page cache.  Instead, just before a layer's round trip, each rank file is hashed through the
layer's last byte, and on a worker thread the next layer's bytes are hashed while this layer is
checked: the round trip's positioned reads then find the layer in the page cache, and the output
is read from disk once.  What no layer covers (the header, the non-expert tensors) is hashed at
the end.  The page cache only makes it faster: the digest is the whole file's either way.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from wna16ctl.output.writer import InOrderDigest


@dataclass
class _Pending:
    rel: str
    algorithm: str
    recorded: str
    digest: InOrderDigest
    at: int  # its finding's place in the report, where the manifest check would have put it


def _key(path: Path) -> str:
    return os.path.realpath(path)


class LayerByLayerDigests:
    """Files whose manifest digest is taken in file order while the round trip reads them
    (module doc).  `defer` in the manifest check, `through_layer` before each layer's round trip,
    `finish` once the round trip is over (or did not run): each file's digest against the
    manifest, a finding of the manifest check where they differ."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._ahead: ThreadPoolExecutor | None = None
        self._next: Future[None] | None = None

    def defer(self, rel: str, path: Path, algorithm: str, recorded: str, at: int,
              progress: Callable[[int], None] | None = None) -> None:
        self._pending[_key(path)] = _Pending(rel, algorithm, recorded, InOrderDigest(path, algorithm, progress=progress), at)

    def _ends(self, rank_files: Iterable[Any], names: Iterable[str]) -> list[tuple[InOrderDigest, int]]:
        """(digest, the byte it must be hashed through) of each deferred file holding `names`."""
        ends: dict[str, int] = {}
        for rf in rank_files:
            have = set(rf.files.names())
            for name in names:
                if name in have:
                    info = rf.files.info(name)
                    key = _key(info.file)
                    if key in self._pending:
                        ends[key] = max(ends.get(key, 0), info.end)
        return [(self._pending[k].digest, end) for k, end in sorted(ends.items())]

    def _hash(self, ends: list[tuple[InOrderDigest, int]]) -> None:
        for digest, end in ends:
            digest.hash_through(end)

    def through_layer(self, rank_files: Iterable[Any], names: list[str],
                      next_names: list[str] | None = None) -> None:
        """Hash the files through this layer's tensors `names` (waiting for the worker where it
        already started them), then start the next layer's `next_names` on the worker."""
        rank_files = list(rank_files)
        if self._next is not None:
            self._next.result()
            self._next = None
        self._hash(self._ends(rank_files, names))
        if next_names and self._pending:
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(1, thread_name_prefix="wna16ctl-digest")
            self._next = self._ahead.submit(self._hash, self._ends(rank_files, next_names))

    def close(self) -> None:
        """Wait for the worker's hashing and stop it (a check stopped by an error: nothing else)."""
        try:
            if self._next is not None:
                self._next.result()
        finally:
            self._next = None
            if self._ahead is not None:
                self._ahead.shutdown()
                self._ahead = None

    def finish(self, findings: list[Any], finding: Callable[[str], Any]) -> None:
        """Each file's digest, the rest of it read here; `finding(message)` for each that differs
        from the manifest, put where the manifest check would have put it."""
        self.close()
        inserted = 0
        for p in sorted(self._pending.values(), key=lambda p: p.at):
            if p.digest.hexdigest() != p.recorded:
                findings.insert(p.at + inserted, finding(f"{p.rel}: {p.algorithm} differs from the manifest "
                                                         "(modified after repack)"))
                inserted += 1
        self._pending.clear()
