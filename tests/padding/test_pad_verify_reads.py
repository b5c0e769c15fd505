"""The padding proof reads each padded file once: the manifest's digests are computed from the
bytes the tensor proof reads, and what it skips is still hashed."""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

import wna16ctl
from wna16ctl.output import writer

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=2)


def _path_of(fd: int) -> str:
    return os.path.realpath(f"/proc/self/fd/{fd}")


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Bytes read per file (real path): positioned reads, and the unbuffered file reads of hashing."""
    counts: Counter[str] = Counter()
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        n = real_preadv(fd, buffers, offset, *rest)
        counts[_path_of(fd)] += n
        return n

    def pread(fd: int, size: int, offset: int) -> bytes:
        data = real_pread(fd, size, offset)
        counts[_path_of(fd)] += len(data)
        return data

    class Counting(io.FileIO):
        def readinto(self, b: Any) -> int:  # type: ignore[override]  # counts what the base class reads
            n = super().readinto(b) or 0
            counts[_path_of(self.fileno())] += n
            return n

    def open_counting(file: Any, mode: str = "r", buffering: int = -1, *rest: Any, **kw: Any) -> Any:
        if buffering == 0 and not rest and not kw:
            return Counting(file, mode)
        return open(file, mode, buffering, *rest, **kw)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(writer, "open", open_counting, raising=False)
    return counts


def _tensor_files(out: Path) -> list[Path]:
    return sorted(out.glob("*.safetensors"))


def test_the_padding_proof_reads_each_padded_file_once(make_ckpt, tmp_path, bytes_read):
    src = make_ckpt(**SMALL, symmetric=False)
    out = tmp_path / "p"
    wna16ctl.pad(src, out, tp=2, vllm="0.32.0")
    bytes_read.clear()
    proof = wna16ctl.verify(src, out, numerics=False)
    assert proof.passed and proof.tensors_padded, proof.problems
    files = _tensor_files(out)
    assert len(files) == 2
    for f in files:  # hashed and proved from one read of its bytes
        assert bytes_read[os.path.realpath(f)] == f.stat().st_size, (f.name, bytes_read)


def test_a_byte_the_partial_proof_skips_still_fails_the_files_digest_read_once(make_ckpt, tmp_path, bytes_read):
    src = make_ckpt(**SMALL, symmetric=False)
    out = tmp_path / "p"
    wna16ctl.pad(src, out, tp=2, vllm="0.32.0")
    name = "model.layers.0.mlp.experts.3.gate_proj.weight_scale"  # expert 3: left out by --experts 0-1
    f = next(f for f in _tensor_files(out) if name in load_file(f))
    t = load_file(f)
    t[name][0, 0] *= 2
    save_file(t, f, metadata={"format": "pt"})
    bytes_read.clear()
    proof = wna16ctl.verify(src, out, numerics=False, experts="0-1")
    assert proof.problems == [f"{f}: missing or changed since it was written (its digest differs)"]
    assert not proof.passed
    for g in _tensor_files(out):
        assert bytes_read[os.path.realpath(g)] == g.stat().st_size, (g.name, bytes_read)
