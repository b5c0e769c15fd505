"""The native rank builder's NEON tile loops, on this (x86-64) machine: tests/native/simd_rank_test.cpp
is cross-compiled with Debian's aarch64 g++ and run under qemu-user, where it compares the NEON
loops with the scalar ones; and its per-case digests must equal those of the same program built
for this CPU (whose scalar loop tests/repacking/test_native_path.py compares with the torch layout code).
Skipped, with one line, where the cross compiler or qemu-aarch64 is absent
(`apt-get install g++-aarch64-linux-gnu qemu-user`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from wna16ctl.native import build as native

NATIVE = Path(__file__).resolve().parent
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


def _build(cxx: str, out: Path, *extra: str) -> Path:
    src = native.kernels_dir()
    cmd = [cxx, "-O2", "-std=c++17", "-pthread", *extra, "-I", str(src), str(NATIVE / "simd_rank_test.cpp"),
           *(str(src / f) for f in native.HOST_SOURCES), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _digests(stdout: str) -> dict[tuple[str, str], str]:
    return {(case, level): digest for case, level, digest in (line.split() for line in stdout.splitlines()
                                                              if len(line.split()) == 3)}


def test_neon_tiles_under_qemu_equal_the_scalar_ones_and_this_cpus(tmp_path):
    missing = [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found: NEON tile loops not run "
                    "(apt-get install g++-aarch64-linux-gnu qemu-user)")
    cxx = native.find_cxx()
    if cxx is None:
        pytest.skip("no g++ on PATH")
    # warnings are errors, as for the host build (tests/native/test_kernels.py): the NEON code is compiled nowhere else
    arm = _build(CROSS_CXX, tmp_path / "simd_rank_test.aarch64", "-static", "-Wall", "-Wextra", "-Werror")
    here = _build(cxx, tmp_path / "simd_rank_test")
    arm_run = subprocess.run([QEMU, str(arm)], capture_output=True, text=True, timeout=600)
    assert arm_run.returncode == 0, arm_run.stdout[-4000:] + arm_run.stderr[-2000:]
    here_run = subprocess.run([str(here)], capture_output=True, text=True, timeout=600)
    assert here_run.returncode == 0, here_run.stdout[-4000:]
    arm_d, here_d = _digests(arm_run.stdout), _digests(here_run.stdout)
    cases = {case for case, _ in here_d}
    assert cases and {case for case, level in arm_d if level == "neon"} == cases  # NEON ran every case
    assert not any(level in ("avx2", "avx512") for _, level in arm_d)
    for case in cases:  # every level of both builds: one digest per case
        assert {d for (c, _), d in {**arm_d, **here_d}.items() if c == case} == {here_d[(case, "scalar")]}, case
