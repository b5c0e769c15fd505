"""Checkpoints written by the real quantizers (AutoRound, GPTQModel), with an independent reference
dequantization of each, built once and cached.

`quantized` (session fixture) gives a `Quantized`: the folder of each variant of
`write_checkpoints.ALL_VARIANTS`, the float model they were quantized from, and the reference weights
of each (`reference.py`, written beside the checkpoint, never inside it).

They live under ${WNA16CTL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/wna16ctl}/quantized/<key>, the key a
digest of the two scripts that write them and of the quantizer venv's pins (scripts/quantizer_venv.sh),
so a change of either rebuilds them and nothing else does.  A finished set carries a marker written
last; builds take turns through a lock (pytest-xdist workers).  A cold build (the venv, then five
quantizations on the CPU) takes minutes; a warm one reads the marker.  Where the venv has to be
built and the package registry cannot be reached, the tests are skipped with the script's one line;
every other failure fails them.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.quantizers.write_checkpoints import ALL_VARIANTS

HERE = Path(__file__).resolve().parent
WRITER = HERE / "write_checkpoints.py"
REFERENCE = HERE / "reference.py"
VENV_SCRIPT = REPO_ROOT / "scripts" / "quantizer_venv.sh"
UNREACHABLE = 3  # quantizer_venv.sh: the venv has to be built and the registry cannot be reached


@dataclass(frozen=True)
class Quantized:
    root: Path

    @property
    def float_model(self) -> Path:
        return self.root / "float"

    def checkpoint(self, variant: str) -> Path:
        return self.root / variant

    def reference(self, variant: str) -> Path:
        """float32 [N, K] `<module>.weight` of every quantized module, dequantized by the tool's code."""
        return self.root / f"{variant}.reference.safetensors"


def _cache_root() -> Path:
    if "WNA16CTL_CACHE" in os.environ:
        return Path(os.environ["WNA16CTL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wna16ctl"


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"GPTQMODEL_CPU_WORKERS": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, check=False, **kwargs)


def _key() -> str:
    pins = _run(["bash", str(VENV_SCRIPT), "--digest"])
    assert pins.returncode == 0, pins.stderr
    digest = hashlib.sha256(pins.stdout.encode())
    for script in (WRITER, REFERENCE):
        digest.update(script.read_bytes())
    return digest.hexdigest()[:16]


def _venv_python() -> str:
    built = _run(["bash", str(VENV_SCRIPT)], timeout=1800)
    if built.returncode == UNREACHABLE:
        pytest.skip(built.stderr.strip().splitlines()[-1])
    if built.returncode:
        pytest.fail(f"quantizer venv: the build failed (exit {built.returncode}): {built.stderr[-2000:]}")
    return built.stdout.strip()


def _build(root: Path) -> None:
    python = _venv_python()
    stage = root.with_name(root.name + ".partial")
    stage.mkdir(parents=True, exist_ok=True)  # a stopped build resumes: each finished variant is kept
    # cwd: GPTQModel writes a logs/ folder into the working directory
    wrote = _run([python, str(WRITER), str(stage)], timeout=3600, cwd=stage)
    assert wrote.returncode == 0, f"write_checkpoints.py failed: {wrote.stderr[-3000:]}"
    for variant in ALL_VARIANTS:
        out = stage / f"{variant}.reference.safetensors"
        if not out.exists():
            ref = _run([python, str(REFERENCE), str(stage / variant), str(out)], timeout=1800, cwd=stage)
            assert ref.returncode == 0, f"reference.py {variant} failed: {ref.stderr[-3000:]}"
    stage.rename(root)


@pytest.fixture(scope="session")
def quantized() -> Quantized:
    root = _cache_root() / "quantized" / _key()
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.with_name(root.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not root.is_dir():  # built by the holder of the lock before us
                _build(root)
    return Quantized(root)


@pytest.fixture(scope="session")
def quantizer_python() -> str:
    """The quantizer venv's python (reference.py runs in it), built once; skipped with the script's
    one line where it has to be built and the package registry cannot be reached."""
    return _venv_python()


def run_reference(python: str, ckpt: Path, out: Path) -> None:
    """reference.py of `ckpt` into `out` (float32 `<module>.weight` by the tool's own dequantization)."""
    ref = _run([python, str(REFERENCE), str(ckpt), str(out)], timeout=1800, cwd=out.parent)
    assert ref.returncode == 0, f"reference.py {ckpt} failed: {ref.stderr[-3000:]}"


def copy_checkpoint(quantized: Quantized, variant: str, dest: Path) -> Path:
    """A writable copy of a cached checkpoint (the cache is shared: never change it in place)."""
    return Path(shutil.copytree(quantized.checkpoint(variant), dest / variant))
