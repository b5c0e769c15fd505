"""bench/repack_static.py: the repack kernel's static issue model on a SASS listing written for
these tests, with figures worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import repack_static as RS

# Two set-up instructions; a task loop (0x20..0x110) holding an act-order gather loop
# (0x30..0x60: a shared load of the perm, a byte load) and a staging loop (0x70..0xa0: one
# 4-byte load, one shared store); then an emitting loop (0xc0..0x100: a shared load, a 16-byte
# store, an 8-byte store); a trap loop with no memory traffic at the end.
LISTING = """\
\tcode for sm_90
\t\tFunction : _ZN12_GLOBAL__N_120marlin_repack_kernelILi4EEEvPKjPKiPjlll
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, R0 ;
        /*0020*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0030*/                   LDS R4, [R2] ;
        /*0040*/                   LDG.E.U8.CONSTANT R5, desc[UR4][R6.64] ;
        /*0050*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0060*/               @P0 BRA 0x30 ;
        /*0070*/                   LDG.E.CONSTANT R5, desc[UR4][R6.64] ;
        /*0080*/                   STS [R3], R5 ;
        /*0090*/                   IADD3 R3, R3, 0x4, RZ ;
        /*00a0*/               @P0 BRA 0x70 ;
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00c0*/                   LDS.128 R8, [R3] ;
        /*00d0*/                   PRMT R12, R8, 0x5140, R9 ;
        /*00e0*/                   STG.E.128 desc[UR4][R14.64], R8 ;
        /*00f0*/                   STG.E.64 desc[UR4][R16.64], R12 ;
        /*0100*/               @P0 BRA 0xc0 ;
        /*0110*/               @P1 BRA 0x20 ;
        /*0120*/                   EXIT ;
        /*0130*/                   BRA 0x130 ;
"""


def _ins():
    import kernel_static as KS

    return KS.sass_functions(LISTING)["_ZN12_GLOBAL__N_120marlin_repack_kernelILi4EEEvPKjPKiPjlll"]


def test_global_bytes_by_width() -> None:
    assert [RS.global_bytes(op) for op in ("LDG.E.128.CONSTANT", "STG.E.128", "STG.E.64", "LDG.E.CONSTANT",
                                           "STG.E.U16", "LDG.E.S8", "LDS.128", "STS", "PRMT")] == \
        [16, 16, 8, 4, 2, 1, 0, 0, 0]


def test_innermost_memory_loops_and_the_gather() -> None:
    loops = RS.memory_loops(_ins())
    # the task loop (0x20..0x110) encloses the others and the trap loop moves nothing; traffic
    # is twice the bytes stored
    assert [(lp.start, lp.end, lp.instructions, lp.global_bytes, lp.gather) for lp in loops] == [
        (3, 6, 4, 0, True), (7, 10, 4, 0, False), (12, 16, 5, 48, False)]


def test_model_by_hand() -> None:
    m = RS.model("k", _ins())
    # counted: staging 4 instructions (stores nothing global) and emitting 5, which stores 24
    # bytes: 48 bytes of traffic (as many read as written) -> 9 / 48
    assert m.per_byte == pytest.approx(9 / 48)
    # set-up: the 7 instructions before the staging loop (the gather loop's among them)
    assert m.setup_instructions == 7
    assert m.per_byte_one_pass == pytest.approx(16 / 48)
    # 132 x 4 x 32 x 1.98e9 = 3.345408e13 thread instructions per second
    assert RS.thread_instructions_per_s(RS.H200) == pytest.approx(3.345408e13)
    assert m.cap_bytes_per_s == pytest.approx(3.345408e13 * 48 / 9)
    assert m.cap_pct_of_peak == pytest.approx(100 * 3.345408e13 * 48 / 9 / 4.8e12)


def test_the_old_figures_reproduce() -> None:
    # docs/performance.md's hand count of the staged kernel: 36 + 45 instructions per 8 bytes
    assert RS.bandwidth_cap(81 / 8) / 1e12 == pytest.approx(3.30, abs=0.01)
    # and with the per-task set-up: 298 instructions per 16 bytes, near 1.8 TB/s
    assert RS.bandwidth_cap(298 / 16) / 1e12 == pytest.approx(1.80, abs=0.01)


def test_readable_names() -> None:
    assert RS.readable("_ZN41_GLOBAL__N__3743b980_9_repack_cu_cbe54fd726marlin_repack_tiles_kernelILi8EEEvPKjPjll") \
        == "marlin_repack_tiles_kernel<8>"
    assert RS.readable("_ZN41_GLOBAL__N__3743b980_9_repack_cu_cbe54fd726marlin_repack_tiles_kernelILi4ELb1EEEvPKjPKiPjlll") \
        == "marlin_repack_tiles_kernel<4, gather>"
    assert RS.is_repack_kernel("_Z18zero_points_kernelILi4EEvPKjPjll") is False
