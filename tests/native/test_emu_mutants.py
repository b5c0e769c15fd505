"""Mutation testing: each realistic bug of tests/emu/mutation.py, applied to a copy of the
kernels, is caught by the emulated GEMM tests in the builds it names. The two that need the
emulation's device-like memory model (a consumer without its acquire, a cp.async issued before
the barrier that protects its buffer) run by default; the rest are marked `mutants` and run by
`make test-kernels` (each recompiles the GEMM source)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.emu import mutation as MU
from tests.native.test_emu import _driver, drivers  # noqa: F401 - pytest fixtures, found by name


@pytest.mark.parametrize(
    "mutant", [pytest.param(m, id=m.name, marks=() if m.fast else (pytest.mark.mutants,)) for m in MU.MUTANTS])
def test_mutant_is_caught(tmp_path: Path, drivers, mutant: MU.Mutant) -> None:
    for build in mutant.builds:
        _driver(drivers, build)  # skips when that sanitizer runtime is missing
        seen = list(MU.verdicts(mutant, build, tmp_path / build, stop_at_first=True))
        assert seen and seen[-1][1], f"{mutant.name} ({mutant.what}) passed every {build} case"
