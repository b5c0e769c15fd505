"""The two-process header scan that `inspect` uses on large checkpoints gives exactly the serial
result, and errors found by the worker process reach the user the same way.

The worker is only forked in processes without torch, so these tests run the real CLI in a
subprocess (pytest itself has torch imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synthetic_headers


def _inspect(ckpt: Path, *, fork: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("WNA16CTL_NO_FORK", None)
    if not fork:
        env["WNA16CTL_NO_FORK"] = "1"
    return subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(ckpt), "--tp", "1,8", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> Path:
    return synthetic_headers.write(tmp_path_factory.mktemp("k") / "ck", layers=9, experts=16, hidden=512,
                                   inter=256, shards=12, vocab=128)


def test_parallel_equals_serial(many_shards):
    a, b = _inspect(many_shards, fork=True), _inspect(many_shards, fork=False)
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert len(json.loads(a.stdout)["layers"]) == 8


def test_worker_error_reaches_the_user(many_shards, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(many_shards, ck)
    victim = sorted(ck.glob("*.safetensors"))[-1]  # in the worker's half
    victim.write_bytes(victim.read_bytes()[:50])
    for fork in (True, False):
        res = _inspect(ck, fork=fork)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert victim.name in res.stderr and "truncated" in res.stderr


def test_stray_file_outside_the_index_is_ignored(many_shards, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(many_shards, ck)
    (ck / "consolidated.safetensors").write_bytes(b"not a safetensors file")
    a, b = _inspect(ck, fork=True), _inspect(many_shards, fork=False)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["layers"] == json.loads(b.stdout)["layers"]


def _rewrite_header(path: Path, mutate) -> None:
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    mutate(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def test_garbled_header_in_the_parents_half_does_not_hang(tmp_path):
    # a worker payload larger than a pipe buffer, and a non-BadInput failure in the parent's half
    ck = synthetic_headers.write(tmp_path / "ck", layers=9, experts=128, hidden=512, inter=256, shards=12, vocab=128)
    victim = sorted(ck.glob("*.safetensors"))[1]

    def garble(h):
        name = next(k for k in h if k != "__metadata__")
        h[name]["data_offsets"] = [0, str(h[name]["data_offsets"][1])]

    _rewrite_header(victim, garble)
    res = _inspect(ck, fork=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert victim.name in res.stderr and "corrupt" in res.stderr


def test_entries_checked_by_the_worker_are_readable(many_shards):
    code = ("from wna16ctl.sources import open_checkpoint;"
            f"ck = open_checkpoint({str(many_shards)!r});"
            "print(ck.files.info('lm_head.weight').shape, ck.files.raw('model.norm.weight')['shape'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["(128,", "512)", "[512]"]
