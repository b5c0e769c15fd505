"""Positioned reads of tensor bytes into a caller's buffer, without torch (one open descriptor
per shard).  `sources.tensors.TensorReader` builds torch tensors on it; repack's native data
path reads whole chunks of experts into reused buffers with it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wna16ctl.sources.headers import CheckpointFiles, TensorInfo
from wna16ctl.errors import BadInput


class RawReader:
    def __init__(self, files: CheckpointFiles):
        self.files = files
        self._fds: dict[Path, int] = {}
        # when set, every byte read is fed to it in read order (repack's resume key, see repacking/pipeline.py)
        self.hasher: Any = None

    def __enter__(self) -> "RawReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def fd(self, path: Path) -> int:
        """The open descriptor of a shard (opened on first use)."""
        return self._fd(path)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise BadInput(f"{path}: cannot open ({e.strerror})") from None
            kept = self._fds.setdefault(path, fd)  # two threads may open it at once: one descriptor kept
            if kept != fd:
                os.close(fd)
                fd = kept
        return fd

    def read_into(self, info: TensorInfo, view: memoryview) -> None:
        """Fill `view` (info.nbytes long) with the tensor's bytes."""
        fd = self._fd(info.file)
        done = 0
        while done < info.nbytes:
            try:
                n = os.preadv(fd, [view[done:info.nbytes]], info.start + done)
            except OSError as e:
                raise BadInput(f"{info.file}: reading tensor {info.name} failed ({e.strerror})") from None
            if n == 0:
                raise BadInput(
                    f"{info.file}: ends before tensor {info.name} does (the shard was truncated or replaced "
                    "after planning); restore the file and run again"
                )
            done += n
        if self.hasher is not None:
            self.hasher.update(view[:info.nbytes])
