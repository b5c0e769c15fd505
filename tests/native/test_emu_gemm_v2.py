"""The fast MoE GEMM (kernels/moe_gemm_v2.cu, launcher included) executed on the CPU emulation.

The real source runs on the emulated device (tests/emu, docs/kernel-emulation.md): its cp.async
pipeline, ldmatrix, register dequantisation, mma, stream-K fix-up and the parallel tile prefix.
Every case is checked against the torch op and an fp32 reference, rows no slot reaches must stay
untouched, and the workspace is exactly the size the kernel's own query asks for (the sanitizer
builds see an access past it).

The grid: K % 64 in {0, 16, 32, 48}; N in {64, 128, 256, 320}; fp16 and bf16; 4 and 8 bits;
zero points; act-order with a full K and with is_k_full false; sentinel-padded sorted ids; empty
first and last experts; every tile variant (16 x 256, 32 x 128, 64 x 64 fast tiles, the general
and g_idx 16 x 128 instances); stream-K tiles cut between blocks (few emulated SMs); and a few
cases under ThreadSanitizer and AddressSanitizer + UBSan, the fast kernel's streaming loop among
them. Every case also runs with its blocks side by side in two seeded schedules. Broken copies of
the kernel are tests/native/test_emu_mutants.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.emu import harness as H
from tests.native.test_emu import asan, check_gemm, drivers, grid_problem, plain, tsan  # noqa: F401 - pytest fixtures, found by name
from tests.native.test_emu import _driver, _grid_id, run_gemm_op
from wna16ctl.native import ops as K

VARIANTS = {"auto": 0, "tile16": 16, "tile32": 32, "tile64": 64}


def run_gemm_v2(exe: Path, prob: dict, variant: str, dev: Optional[dict] = None) -> tuple[H.Result, torch.Tensor]:
    return run_gemm_op(exe, "gemm_v2", prob, VARIANTS[variant], dev)  # the driver sizes the workspace


# (tile variant, emulated SMs, problem): few SMs make stream-K cut tiles between blocks
GRID = [
    ("tile16", 4, dict(size_k=128, size_n=64, group_size=64)),
    ("tile16", 1, dict(size_k=80, size_n=128, group_size=16, dtype=torch.float16, pad=16)),
    ("tile32", 2, dict(size_k=96, size_n=256, group_size=32, num_bits=8, zp=True, empty_ends=True)),
    ("tile64", 1, dict(size_k=112, size_n=320, group_size=16, dtype=torch.float16, num_bits=8, pad=8,
                       empty_ends=True)),
    ("auto", 2, dict(size_k=80, size_n=64, group_size=16, act_order=True, k_full=False, zp=True, pad=16)),
    ("auto", 3, dict(size_k=96, size_n=128, group_size=32, act_order=True, dtype=torch.float16, num_bits=8)),
    ("tile16", 1, dict(size_k=112, size_n=256, group_size=-1, dtype=torch.float16, zp=True, router=False)),
    ("auto", 1, dict(size_k=128, size_n=128, group_size=32, act_order=True, k_full=False, dtype=torch.float16,
                     num_bits=8, zp=True, empty_ends=True, pad=16)),
    ("tile64", 2, dict(size_k=256, size_n=128, group_size=64, skew=True, m=60, experts=2, top_k=2)),
    ("tile32", 1, dict(size_k=192, size_n=64, group_size=64, dtype=torch.float16, num_bits=8, zp=True, pad=32,
                       empty_ends=True)),
    ("tile16", 2, dict(size_k=320, size_n=320, group_size=64, zp=True, m=3)),
    ("tile32", 1, dict(size_k=448, size_n=256, group_size=-1, num_bits=8, skew=True, m=20, experts=2, top_k=2)),
    ("tile64", 3, dict(size_k=128, size_n=192, group_size=128, dtype=torch.float16, zp=True, skew=True, m=40,
                       experts=2, top_k=2, empty_ends=True)),
    ("auto", 2, dict(size_k=208, size_n=64, group_size=-1, num_bits=4, pad=16)),
    # long K, many groups, fast mode: the streaming loop runs several stages per group
    ("tile16", 3, dict(size_k=1024, size_n=128, group_size=128, zp=True, m=2, experts=2)),
    ("tile32", 2, dict(size_k=768, size_n=128, group_size=256, dtype=torch.float16, num_bits=8, m=12, experts=3,
                       top_k=2, skew=True)),
]


def seeded_devices(sms: int, item) -> list[dict]:
    """The emulated devices a case runs on: blocks in index order on one team, then two seeded
    schedules with blocks side by side (stream-K partials, flags and counters race across
    blocks; the seeds differ per case)."""
    base = sum(map(ord, _id(item))) % 1000 * 10
    teams = max(2, min(4, 2 * sms))
    return [{"sms": sms}] + [{"sms": sms, "blocks": teams, "seed": base + k} for k in (1, 2)]


def _id(item) -> str:
    variant, sms, case = item
    return f"sms={sms}," + _grid_id((variant, case))


def _mode(case: dict) -> str:
    size_k = case.get("size_k", 256)
    gs = case.get("group_size", 64)
    rows = size_k if gs == -1 else gs
    if case.get("act_order"):
        return "g_idx" if case.get("k_full") is False else "general"
    return "fast" if rows % 64 == 0 else "general"


def test_v2_grid_covers_every_axis() -> None:
    cases = [c for _, _, c in GRID]
    assert {c.get("size_k", 256) % 64 for c in cases} == {0, 16, 32, 48}
    ns = {c.get("size_n", 192) for c in cases}
    assert {64, 128, 256} <= ns and max(ns) > 256
    assert {(v, _mode(c)) for v, _, c in GRID if _mode(c) == "fast"} >= {("tile16", "fast"), ("tile32", "fast"),
                                                                         ("tile64", "fast")}
    assert {_mode(c) for c in cases} == {"fast", "general", "g_idx"}
    for key in ("zp", "pad", "empty_ends", "act_order", "skew"):
        assert any(c.get(key) for c in cases), key
    assert {c.get("dtype", torch.bfloat16) for c in cases} == {torch.float16, torch.bfloat16}
    assert {c.get("num_bits", 4) for c in cases} == {4, 8}


@pytest.mark.parametrize("item", GRID, ids=_id)
def test_emulated_gemm_v2_grid(plain: Path, item) -> None:
    variant, sms, case = item
    prob = grid_problem(**case)
    for dev in seeded_devices(sms, item):
        check_gemm(prob, *run_gemm_v2(plain, prob, variant, dev=dev))


SAN_GRID = [
    ("tile16", 1, dict(size_k=80, size_n=64, group_size=16, m=3, experts=3, act_order=True, k_full=False, zp=True,
                       pad=16, empty_ends=True)),
    ("tile32", 1, dict(size_k=192, size_n=320, group_size=64, m=2, experts=2, dtype=torch.float16, num_bits=8,
                       zp=True, pad=32)),
    ("tile64", 1, dict(size_k=112, size_n=128, group_size=-1, skew=True, m=20, experts=2, top_k=2)),
    # the fast kernel's streaming loop issuing copies (12 stages per group, 8 per block), its
    # tiles cut between three blocks
    ("tile16", 3, dict(size_k=1536, size_n=64, group_size=768, zp=True, m=2, experts=2)),
]


@pytest.mark.parametrize("flavour", ["tsan", "asan"])
@pytest.mark.parametrize("item", SAN_GRID, ids=_id)
def test_emulated_gemm_v2_under_sanitizers(drivers, flavour: str, item) -> None:
    exe = _driver(drivers, flavour)
    variant, sms, case = item
    prob = grid_problem(**case)
    # blocks side by side in seeded orders: the stream-K partials and counters are shared
    # (ThreadSanitizer in both schedules, AddressSanitizer, whose findings do not depend on the
    # interleaving, in one)
    for dev in seeded_devices(sms, item)[1:] if flavour == "tsan" else seeded_devices(sms, item)[-1:]:
        check_gemm(prob, *run_gemm_v2(exe, prob, variant, dev=dev))


def test_emulated_gemm_v2_refuses_what_it_does_not_run(plain: Path) -> None:
    prob = grid_problem(size_k=64, size_n=64, m=2, experts=2)
    r, _ = run_gemm_v2(plain, prob, "auto", dev={"cc": 75})
    assert r.returncode == 0 and r.rc == K.WNA16_ENOTSUP and "needs sm80+" in r.message
