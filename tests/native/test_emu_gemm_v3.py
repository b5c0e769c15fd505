"""The v3 MoE GEMM (kernels/moe_gemm_v3.cu, launcher included) executed on the CPU emulation.

v3 runs v2's fast mode (no act-order, scale groups of whole 64-row stages) with eight warps split
over K and N, scale pairs in registers, an evict-first weight stream and one launch (the tile
prefix built per block, stream-K counters that return to zero). Its arithmetic is v2's, so every
case here is checked three ways: against the torch op and an fp32 reference (as v2's grid is),
and bit for bit against v2's output on the same emulated device. A case runs its blocks in index
order and side by side in two seeded schedules (the default suite's cases: one seeded schedule),
and calls the kernel twice on one workspace: the counter words must be zero after every call (no
reset between calls).

The grid is the fast part of v2's (tests/native/test_emu_gemm_v2.py): every tile (16 x 256,
32 x 128, 64 x 64), fp16 / bf16, 4 / 8 bits, zero points, sentinel padding, empty first and last
experts, N past a tile edge, stream-K tiles cut between blocks, long K with several stages per
group. Three run in the default suite, in one seeded schedule each (blocks side by side); the
other eight, in all three schedules, and the sanitizer cases are marked `kernels` (make
test-kernels).
What v3 does not run (act-order, groups of 16 / 32 rows) is refused with WNA16_ENOTSUP and
leaves the output untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.emu import harness as H
from tests.native.test_emu import asan, check_gemm, drivers, grid_problem, plain, tsan  # noqa: F401 - pytest fixtures, found by name
from tests.native.test_emu import MARKER, _driver, _grid_id, run_gemm_op
from tests.native.test_emu_gemm_v2 import GRID as V2_GRID, VARIANTS, _mode, run_gemm_v2
from wna16ctl.native import ops as K

BLOCKS_PER_SM = 2  # kernels/moe_gemm_v3.cuh kBlocksPerSm


def counter_words(prob: dict, variant: str, sms: int) -> int:
    """The workspace's leading counter and flag words (moe_gemm_v3.cu make_config): they must be
    zero after every call."""
    ids = prob["args"][3]
    experts, size_n = prob["args"][1].shape[0], prob["args"][2].shape[2]
    if variant == "auto":
        per_expert = -(-ids.numel() // experts)
        rows = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    else:
        rows = int(variant.removeprefix("tile"))
    bn = 64 * {16: 4, 32: 2, 64: 1}[rows]
    max_tiles = (-(-ids.numel() // rows) + experts) * -(-size_n // bn)
    return -(-(max_tiles + 2 * sms * BLOCKS_PER_SM) // 4) * 4


def run_gemm_v3(exe: Path, prob: dict, variant: str, dev: Optional[dict] = None, calls: int = 2,
                sms: int = 132) -> tuple[H.Result, torch.Tensor]:
    return run_gemm_op(exe, "gemm_v3", prob, VARIANTS[variant], dev,
                       ints={"calls": calls, "flag_words": counter_words(prob, variant, sms)})


FAST = [item for item in V2_GRID if _mode(item[2]) == "fast"]
# more fast cases than v2's grid holds: 4-bit 64 x 64 with zero points, 8-bit bf16 16 x 256, an
# expert with more rows than one 64-row tile, many SMs (every tile cut into single stages)
EXTRA = [
    ("tile64", 2, dict(size_k=192, size_n=128, group_size=64, zp=True, skew=True, m=70, experts=2, top_k=2,
                       pad=16)),
    ("tile16", 2, dict(size_k=256, size_n=320, group_size=128, num_bits=8, m=3, experts=3, empty_ends=True)),
    ("auto", 16, dict(size_k=256, size_n=128, group_size=-1, dtype=torch.float16, zp=True, m=2)),
]
GRID = FAST + EXTRA
# the default suite's handful: one per tile, both widths and dtypes, zero points, a cut tile
DEFAULT = {0, 2, 5}


def _id(item) -> str:
    variant, sms, case = item
    return f"sms={sms}," + _grid_id((variant, case))


def seeded_devices(sms: int, item) -> list[dict]:
    base = sum(map(ord, _id(item))) % 1000 * 10
    teams = max(2, min(4, 2 * sms))
    return [{"sms": sms}] + [{"sms": sms, "blocks": teams, "seed": base + k} for k in (1, 2)]


def test_v3_grid_covers_the_fast_axes() -> None:
    cases = [c for _, _, c in GRID]
    assert all(_mode(c) == "fast" for c in cases)
    assert {v for v, _, _ in GRID} >= {"tile16", "tile32", "tile64"}
    assert {c.get("dtype", torch.bfloat16) for c in cases} == {torch.float16, torch.bfloat16}
    assert {c.get("num_bits", 4) for c in cases} == {4, 8}
    for key in ("zp", "pad", "empty_ends", "skew"):
        assert any(c.get(key) for c in cases), key
    assert max(c.get("size_n", 192) for c in cases) > 256
    default = [GRID[i] for i in DEFAULT]
    assert {v for v, _, _ in default} == {"tile16", "tile32", "tile64"}
    assert {c.get("num_bits", 4) for _, _, c in default} == {4, 8}


def check_v3(exe: Path, item, devices) -> None:
    variant, sms, case = item
    prob = grid_problem(**case)
    for dev in devices:
        r3, got3 = run_gemm_v3(exe, prob, variant, dev=dev, sms=sms)
        check_gemm(prob, r3, got3)
        r2, got2 = run_gemm_v2(exe, prob, variant, dev=dev)
        check_gemm(prob, r2, got2)
        assert torch.equal(got3.view(torch.int16), got2.view(torch.int16)), f"v3 differs from v2 on {dev}"


@pytest.mark.parametrize(
    "item", [pytest.param(item, id=_id(item), marks=() if i in DEFAULT else (pytest.mark.kernels,))
             for i, item in enumerate(GRID)])
def test_emulated_gemm_v3_grid(plain: Path, item, request) -> None:
    devices = seeded_devices(item[1], item)
    if request.node.get_closest_marker("kernels") is None:
        devices = devices[-1:]  # the default suite: one seeded schedule, blocks side by side
    check_v3(plain, item, devices)


SAN_GRID = [
    ("tile32", 1, dict(size_k=192, size_n=320, group_size=64, m=2, experts=2, dtype=torch.float16, num_bits=8,
                       zp=True, pad=32)),
    ("tile64", 2, dict(size_k=128, size_n=128, group_size=-1, skew=True, m=20, experts=2, top_k=2)),
    # the streaming loop issuing copies (12 stages per group, 8 per block), its tiles cut between
    # three blocks
    ("tile16", 3, dict(size_k=1536, size_n=64, group_size=768, zp=True, m=2, experts=2)),
]


@pytest.mark.kernels
@pytest.mark.parametrize("flavour", ["tsan", "asan"])
@pytest.mark.parametrize("item", SAN_GRID, ids=_id)
def test_emulated_gemm_v3_under_sanitizers(drivers, flavour: str, item) -> None:
    exe = _driver(drivers, flavour)
    devices = seeded_devices(item[1], item)
    check_v3(exe, item, devices[1:] if flavour == "tsan" else devices[-1:])


@pytest.mark.parametrize("case", [
    dict(size_k=80, size_n=64, group_size=16, pad=16),                              # groups of 16 rows
    dict(size_k=128, size_n=64, group_size=32, act_order=True, num_bits=8),         # act-order, full K
    dict(size_k=128, size_n=64, group_size=64, act_order=True, k_full=False),       # g_idx
], ids=["groups16", "act_order", "g_idx"])
def test_emulated_gemm_v3_declines_what_it_does_not_run(plain: Path, case: dict) -> None:
    prob = grid_problem(**case)
    r, got = run_gemm_op(plain, "gemm_v3", prob, 0, {"sms": 2})
    assert r.returncode == 0 and r.rc == K.WNA16_ENOTSUP and "v3 GEMM" in r.message
    assert bool((got.view(torch.int16) == MARKER).all())


def test_emulated_gemm_v3_refuses_old_devices(plain: Path) -> None:
    prob = grid_problem(size_k=64, size_n=64, m=2, experts=2)
    r, _ = run_gemm_v3(plain, prob, "auto", dev={"cc": 75})
    assert r.returncode == 0 and r.rc == K.WNA16_ENOTSUP and "needs sm80+" in r.message


def test_emulated_gemm_v3_catches_a_counter_left_set(plain: Path) -> None:
    """The reset check itself: a workspace word left non-zero after a call is reported (the
    driver's check, fed a deliberately dirty word through a one-word smaller count of the
    workspace: the partials' first word, which no call resets, is not zero after a cut tile)."""
    prob = grid_problem(size_k=256, size_n=64, group_size=64, m=2, experts=2)
    r, _ = run_gemm_op(plain, "gemm_v3", prob, 0, {"sms": 4},
                       ints={"calls": 1, "flag_words": counter_words(prob, "auto", 4) + 64 * 256})
    assert r.returncode == 0 and r.rc == 99 and "not reset" in r.stderr


def test_v3_is_the_automatic_choice_and_v2_stays_selectable(monkeypatch) -> None:
    monkeypatch.setenv("WNA16CTL_GEMM_KERNEL", "v3")
    assert K.gemm_kernel() == "v3"
    monkeypatch.delenv("WNA16CTL_GEMM_KERNEL")
    assert K.gemm_kernel() == "auto"
    # auto: v3 first, v2 for what v3 declines (ops.GEMM_KERNELS says why), v2 alone for the 64-row
    # tile (the model has v2 ahead there); v2 on request skips v3
    assert K.fast_gemm_order("auto", 8, 64, 0) == ("v3", "v2")          # decode: 16 x 256
    assert K.fast_gemm_order("auto", 64 * 24, 64, 0) == ("v3", "v2")    # 24 rows per expert: 32 x 128
    assert K.fast_gemm_order("auto", 64 * 40, 64, 0) == ("v2",)         # 40 rows per expert: 64 x 64
    assert K.fast_gemm_order("auto", 8, 64, 64) == ("v2",)              # tile64 forced
    assert K.fast_gemm_order("v3", 64 * 40, 64, 0) == ("v3", "v2") and K.fast_gemm_order("v2", 8, 64, 0) == ("v2",)
