"""bench/roofline.py: the superseded roofline's arithmetic on cases computed by hand (the v2 4-bit
16x256 fast tile on an H200 at M = 1; bench shape: E 64, K 2048, N 1536, top-8, int4 group 128,
bf16); bench/kernel_static.py's SASS classifier and streaming path on a listing written for these
tests; the launch choices against ncu; and the fitted model against the measured H200 rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import roofline as R

INST = R.Instance("4-bit 16x256", 4, 1, 4, registers=240, loop_sass=487, loop_mma=32)
H200 = R.GPUS["h200"]


def test_plan_twin_matches_the_recorded_dynamic_shared_memory() -> None:
    # kernel_static.py read 100,560 B (4-bit 16x256) and 120,016 B (8-bit 16x256) from the plan
    assert R.plan_of(INST).smem == 100_560
    assert R.plan_of(R.Instance("8-bit", 8, 1, 4, 245, 531, 32)).smem == 120_016


def test_occupancy_by_hand() -> None:
    # 240 registers x 32 lanes = 7,680 per warp (whole 256-register units), x 4 warps = 30,720:
    # 65,536 // 30,720 = 2 blocks; shared memory: 233,472 // (100,560 + 1,024) = 2 as well
    assert R.blocks_per_sm(INST, R.plan_of(INST), H200) == (2, "registers")
    # the 8-bit tile's 120,016 B leave room for one block
    eight = R.Instance("8-bit", 8, 1, 4, 245, 531, 32)
    assert R.blocks_per_sm(eight, R.plan_of(eight), H200) == (1, "shared memory")


def test_stage_cost_by_hand() -> None:
    c = R.stage_cost(INST, H200, R.Shape(), rows=1)
    # HBM per stage: 4 k-tiles x 4 n-tiles x 128 words x 4 B = 8,192 B of weights, plus one
    # 512 B scale row (256 bf16) every second stage (group 128 = 2 stages of 64 rows)
    assert c.hbm_bytes == 8192 + 256
    # 4.8e12 B/s / 132 SMs / 1.98e9 clk/s = 18.3655 B per SM and clock
    assert c.cycles["hbm"] == pytest.approx(8448 / 18.36547, rel=1e-5)
    # shared memory in 128 B wavefronts: copies (16 x 128 + 8,192) / 128 = 80, ldmatrix 4 warps x 4
    # = 16, weight loads 4 warps x 4 n-tiles x 4 = 64, lane table 4 x 4 x 4 sub-tiles x 4 = 256,
    # refill 4 x 4 x 4 x (4 narrow + 4) = 512 per group -> 256 per stage
    assert c.cycles["shared memory"] == 80 + 16 + 64 + 256 + 256
    # issue: 8 warps per SM = 2 per scheduler, 2 x 0.4 = 0.8 of the issue slots; 487 SASS per stage
    # plus the refill (4 n-tiles x 4 sub-tiles x 17 = 272 per group -> 136 per stage)
    assert c.warps_per_scheduler == 2 and c.issue_rate == pytest.approx(0.8)
    assert c.cycles["issue"] == pytest.approx((487 + 136) / 0.8)
    assert c.limit == "issue"
    assert c.steady_fraction == pytest.approx(459.99 / 778.75, rel=1e-4)


def test_expectation_at_m1_by_hand() -> None:
    e = R.expect(INST, H200, R.Shape(), 1)
    # 1 token reaches 8 experts: 8 tiles x 6 n-tiles x 32 stages = 1,536 units on 264 blocks, the
    # longest range 6 stages, two blocks per SM; some range crosses a tile boundary (2 fills) and
    # some tile is cut (one fix-up)
    steady = 2 * 6 * 778.75 / 1.98e9
    fills, fixup = 2 * 0.8e-6, 0.8e-6
    epilogue = 2 * (4 * 16 * 256 * 4 * 2) / 128 / 1.98e9  # per tile 4 warps' fp32 partials out and back
    launches = 2 * 1.5e-6  # workspace reset and tile prefix before the main kernel
    total = steady + fills + fixup + epilogue + launches
    assert e.modelled_us == pytest.approx(total * 1e6, rel=1e-6)
    nbytes = 8448 * 1536 + 2048 * 2 + 8 * 1536 * 2  # weights + scales, activations, outputs
    assert e.hbm_bytes == pytest.approx(nbytes)
    assert e.fraction == pytest.approx(nbytes / 4.8e12 / total, rel=1e-6)
    assert 0.24 < e.fraction < 0.25
    assert e.limit.startswith("fixed costs: other launches")  # 6.4 of 11.2 us do not stream


def test_launcher_tile_choice() -> None:
    s = R.Shape()
    assert [R.launcher_rows(s, m) for m in (1, 16, 64, 256, 512)] == [16, 16, 16, 32, 64]


def test_v3_design_accounting_by_hand() -> None:
    d = R.V3_DESIGN[0]
    # no lane table, no cross-warp reduction buffer: the 4-stage pipeline (4 x 13,056 B) and the
    # row tables (16 x 4 + 16 x 8 + 16 B); 128 registers -> 4 blocks per SM (the grid's own cap)
    assert R.plan_of(d).smem == 4 * 13_056 + 64 + 128 + 16
    assert R.blocks_per_sm(d, R.plan_of(d), H200) == (4, "registers")
    c = R.stage_cost(d, H200, R.Shape(), rows=1)
    # shared memory: copies 80, ldmatrix 4 warps x 4 k-tiles x 4 = 64, weights 64, scale rows into
    # registers 4 x 4 x 4 x 2 / 4 = 32 per group -> 16 per stage
    assert c.cycles["shared memory"] == 80 + 64 + 64 + 16
    # 16 warps per SM: 4 per scheduler, the issue slots full; 471 SASS + a quarter refill (68 / 2)
    assert c.issue_rate == 1.0 and c.cycles["issue"] == pytest.approx(471 + 34)
    assert c.limit == "copy limit"
    e = R.expect(d, H200, R.Shape(), 1)
    assert e.parts_us["other launches"] == 0 and e.parts_us["epilogue"] == 0


def test_static_figures_from_kernel_static_json(tmp_path: Path) -> None:
    import json

    rows = [dict(kernel="v2", arch="90", name="bf16 4-bit 16x256 fast", num_bits=4, registers=232,
                 loop_instructions=450, loop_mma=32, counted_in="sass"),
            dict(kernel="v2", arch="90", name="fp16 4-bit 16x256 fast", num_bits=4, registers=240,
                 loop_instructions=487, loop_mma=32, counted_in="sass"),
            dict(kernel="v2", arch="80", name="bf16 4-bit 16x256 fast", num_bits=4, registers=1,
                 loop_instructions=1, loop_mma=1, counted_in="sass"),
            dict(kernel="v2", arch="90", name="bf16 4-bit 16x128 general", num_bits=4, registers=196,
                 loop_instructions=2786, loop_mma=16, counted_in="sass")]
    path = tmp_path / "static.json"
    path.write_text(json.dumps({"kernels": rows, "notes": []}))
    got = R.instances_from_static(path)
    assert [(i.name, i.mt, i.nt, i.registers, i.loop_sass) for i in got] == [
        ("4-bit bf16 16x256", 1, 4, 232, 450), ("4-bit fp16 16x256", 1, 4, 240, 487)]
    assert R.pick_instance(got, R.Shape(), 1).loop_sass == 450  # the bench shape is bf16


def test_v3_plan_twin_matches_the_header(tmp_path: Path) -> None:
    """PlanV3's shared memory against kernels/moe_gemm_v3.cuh's smem_bytes(E), compiled."""
    import subprocess

    from wna16ctl.native.ops import find_cxx, kernels_dir

    cxx = find_cxx()
    if cxx is None:
        pytest.skip("no g++ on PATH")
    cases = [(nb, mt, nt, e) for nb in (4, 8) for mt, nt in ((1, 4), (2, 2), (4, 1)) for e in (8, 64, 257)]
    body = "\n".join(f'  std::printf("%lld\\n", wna16v3::smem_bytes<{nb}, {mt}, {nt}>({e}));' for nb, mt, nt, e in cases)
    src = tmp_path / "plan.cpp"
    src.write_text('#include <cstdio>\n#include "moe_gemm_v3.cuh"\nint main() {\n' + body + "\n}\n")
    subprocess.run([cxx, "-std=c++17", "-I", str(kernels_dir()), str(src), "-o", str(tmp_path / "plan")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "plan")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    want = [R.plan_of(R.v3_instance("x", nb, mt, nt, 128, 1, 1, "test"), experts=e).smem for nb, mt, nt, e in cases]
    assert got == want
    # by hand, 4-bit 16x256, 64 experts: the reduction buffer (4 x 16 x 264 fp32 = 67,584 B) is
    # larger than the pipeline (4 x 10,880 B); + slots, row offsets, flag, warp totals, unit
    # positions, 64 scale-copy pointers, and the tile prefix (65 words, 272 B)
    assert want[1] == 67_584 + 64 + 128 + 16 + 32 + 16 + 512 + 272
    # 8-bit 16x256: the pipeline (4 x 19,200 B) sets it: two blocks per SM on an H200
    assert want[10] == 4 * 19_200 + 64 + 128 + 16 + 32 + 16 + 512 + 272


def test_v3_accounting_by_hand() -> None:
    v3 = R.v3_instance("4-bit 16x256", 4, 1, 4, registers=128, loop_sass=300, loop_mma=16, source="test")
    plan = R.plan_of(v3)
    # 128 registers x 32 lanes x 8 warps = 32,768: two blocks by registers (shared memory would allow 3)
    assert R.blocks_per_sm(v3, plan, H200) == (2, "registers")
    c = R.stage_cost(v3, H200, R.Shape(), rows=1)
    assert c.hbm_bytes == 8192 + 256  # as v2: the same weights and scale rows per stage
    # shared memory: copies 80, ldmatrix 8 warps x 4 = 32, weights 64, no lane table; the refill
    # reads every warp's 8 sub-tiles x 2 scales = 4 x 4 x 4 x 2 = 128 narrow loads per group -> 64
    assert c.cycles["shared memory"] == 80 + 32 + 64 + 64
    # 16 warps per SM: 4 per scheduler, the issue slots full; each scheduler holds 2 warps of a
    # block: 2 x (300 + half the v2 refill estimate, 136 per group -> 68 per stage)
    assert c.warps_per_scheduler == 4 and c.issue_rate == 1.0
    assert c.cycles["issue"] == pytest.approx(2 * (300 + 68))
    assert c.limit == "issue"
    e = R.expect(v3, H200, R.Shape(), 1)
    assert e.parts_us["other launches"] == 0 and e.parts_us["epilogue"] > 0


def test_recorded_v3_figures_against_v2() -> None:
    """docs/performance.md's claim and the premise of ops.fast_gemm_order, from the recorded
    static figures: the model puts v3's bench instance ahead of v2's at M = 1, 16, 64 on both GPUs
    (the 16 x 256 tile) and at M = 256 (32 x 128), behind it at M = 512 (64 x 64: auto keeps v2);
    at >= 50 % of an H200's peak at M = 16 but not at M = 1 (two pipeline fills and the stream-K
    fix-up of v2's partition: 2.4 us of fixed costs on 4.0 us of streaming)."""
    shape = R.Shape()
    for gpu in R.GPUS.values():
        for m in (1, 16, 64):
            v2 = R.expect(R.pick_instance(R.RECORDED_SM90, shape, m), gpu, shape, m)
            v3 = R.expect(R.pick_instance(R.RECORDED_SM90_V3, shape, m), gpu, shape, m)
            assert v3.instance == "v3 4-bit bf16 16x256" and v3.fraction > v2.fraction
        for m, ahead in ((256, True), (512, False)):
            v2 = R.expect(R.pick_instance(R.RECORDED_SM90, shape, m), gpu, shape, m)
            v3 = R.expect(R.pick_instance(R.RECORDED_SM90_V3, shape, m), gpu, shape, m)
            assert (v3.fraction > v2.fraction) == ahead, (gpu.name, m)
    h200 = R.GPUS["h200"]
    at = {m: R.expect(R.pick_instance(R.RECORDED_SM90_V3, shape, m), h200, shape, m).fraction for m in (1, 16)}
    assert at[16] >= 0.5 > at[1]


def test_v3_group_sass_and_epilogue_from_the_kernel() -> None:
    """v3 counted: the refill comes from kernel_static's group figure instead of the estimate, and
    its epilogue moves only the rows that have a slot (M = 1: one row of the 16 per tile)."""
    counted = R.v3_instance("4-bit 16x256", 4, 1, 4, registers=128, loop_sass=300, loop_mma=16, source="test",
                            group_sass=120)
    c = R.stage_cost(counted, H200, R.Shape(), rows=1)
    # group 128 = 2 stages: 2 warps of the block per scheduler x (300 + 120 / 2)
    assert c.cycles["issue"] == pytest.approx(2 * (300 + 60))
    plan = R.plan_of(counted)
    # one row: per warp 4 * NT = 16 stores of the low half, one wavefront each (4 lanes x 8 bytes),
    # 8 warps; read back 4 k-warps x 256 columns x 4 bytes = 32 wavefronts
    assert R.epilogue_wavefronts(counted, plan, 1) == 8 * 16 + 32
    # a full 16-row slice moves what v2's formula says: 2 x 4 x 16 x 256 x 4 bytes / 128
    assert R.epilogue_wavefronts(counted, plan, 16) == R.epilogue_wavefronts(INST, R.plan_of(INST), 16) == 1024
    assert R.epilogue_wavefronts(INST, R.plan_of(INST), 1) == 1024  # v2 moves the whole slice


def test_kernel_static_group_sass_on_a_synthetic_listing() -> None:
    import kernel_static as KS

    # a group loop at 0..9 around a streaming loop at 4..7 (4 instructions, one HMMA)
    text = ["NOP", "NOP", "NOP", "NOP", "HMMA.16816.F32 R0, R1, R2, R0", "NOP", "NOP", "BRA 0x40", "NOP",
            "BRA 0x0"]
    ins = [(16 * i, t) for i, t in enumerate(text)]
    assert KS.count_sass("v3", ins) == (4, 1)
    assert KS.group_sass(ins) == 10 - 2 * 4


# ----------------------------------------------------------------------------------------------
# kernel_static's SASS classifier and streaming path, on a listing written for these tests
# (tests/data/sass/streaming_loop.sass: a loop at 0x40..0x1a0 whose body fetches behind a
# condition, dequantises, runs one HMMA, then either goes on streaming (0xf0 -> 0x180) or falls
# into a slice end -- a store, an atomic, a dependent load, a fence -- before the back branch)

SASS_FIXTURE = Path(__file__).resolve().parent / "data" / "sass" / "streaming_loop.sass"


def _fixture():
    import kernel_static as KS

    funcs = KS.sass_functions(SASS_FIXTURE.read_text())
    return KS, funcs["synthetic_stream_kernel"]


def test_sass_classes() -> None:
    import kernel_static as KS

    want = {"LDGSTS.E.BYPASS.128": "global", "LDG.E.128": "global", "STG.E": "global", "REDG.E.ADD.S32": "global",
            "ATOMG.E.CAS.STRONG.GPU": "global", "LDSM.16.M88.4": "shared", "LDS.128": "shared", "STS.U16": "shared",
            "HMMA.16816.F32.BF16": "mma", "LOP3.LUT": "dequant", "PRMT": "dequant", "SHF.R.U32.HI": "dequant",
            "I2F.BF16": "dequant", "HFMA2.BF16_V2": "dequant", "HMUL2": "dequant", "HADD2.F32": "dequant",
            "IMAD.WIDE.U32": "address", "IADD3": "address", "LEA.HI.X": "address", "ISETP.GE.AND": "address",
            "SEL": "address", "BAR.SYNC.DEFER_BLOCKING": "barrier", "LDGDEPBAR": "barrier", "DEPBAR.LE": "barrier",
            "BRA": "branch", "BSSY": "branch", "BSYNC": "branch", "MOV": "other", "S2R": "other", "FADD": "other"}
    got = {op: KS.CLASS_KEYS[KS.sass_class(op)] for op in want}
    assert got == want


def test_streaming_path_skips_the_slice_end() -> None:
    KS, ins = _fixture()
    ops = [KS._opcode(t) for _, t in ins]
    loop = KS.innermost_loop(ops, KS.sass_loops(ins), lambda op: op.startswith("HMMA"))
    assert (ins[loop[0]][0], ins[loop[1]][0]) == (0x40, 0x1A0)
    path = KS.streaming_path(ins, loop)
    addrs = [ins[i][0] for i in path]
    # head, the conditional fetch (counted as taken), wait, barrier, dequantisation, mma, the
    # branch past the slice end, the loop's counter and back branch; not 0x110..0x170
    assert addrs == [0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0, 0x100,
                     0x180, 0x190, 0x1A0]
    counts = {KS.CLASS_KEYS[k]: v for k, v in KS.class_counts(ins, path).items()}
    assert counts == {"global": 1, "shared": 1, "mma": 1, "dequant": 3, "address": 4, "barrier": 3,
                      "branch": 3, "other": 0}
    assert sum(counts.values()) == len(path) == 16


def test_streaming_path_falls_back_to_the_whole_body_without_mma() -> None:
    KS, ins = _fixture()
    no_mma = [(a, t.replace("HMMA.16816.F32.BF16", "FFMA")) for a, t in ins]
    assert KS.streaming_path(no_mma, (4, 26)) == list(range(4, 27))


def test_marlin_instance_name() -> None:
    import kernel_static as KS

    # bf16 activations / output / scales, u4b8 weights, 128 threads, one m-block of 8 rows,
    # thread_n 128 (8 blocks of 16), thread_k 64 (4), 4 stages, groups of 128 rows (8 blocks)
    assert KS.marlin_entry(4, 128, 128, 8, 128, 64) == (
        "MarlinILl1125899906909960ELl1125899907892224ELl1125899906909960ELl1125899906909960E"
        "Li128ELi1ELi8ELi4ELb1ELi4ELi8ELb0E")
    assert KS.marlin_entry(8, -1, 256, 64, 256, 64).endswith("Li256ELi4ELi16ELi4ELb0ELi4ELin1ELb0E")
    assert "Ll1125899923621888E" in KS.marlin_entry(8, -1, 256, 64, 256, 64)


# ----------------------------------------------------------------------------------------------
# the launch choices against what ncu saw on the H200


def test_marlin_launch_matches_ncu_at_m1() -> None:
    shape = R.H200_SHAPES["qwen3-w13"]
    assert R.marlin_block_size(shape, 1) == 8 and R.marlin_block_size(shape, 1024) == 64
    launch = R.marlin_launch(shape, 1)
    ncu = R.NCU_H200["marlin"]
    # 128 registers x 128 threads x 4 B = 64 KiB: 255 KiB // 64 KiB = 3 blocks (the 256-thread
    # configuration: 1), shared memory 232,448 / 3 - 1,024 = 76,458 B
    assert (launch.blocks_per_sm, launch.grid, launch.loop.registers) == (ncu["blocks_per_sm"], ncu["blocks"],
                                                                          ncu["registers"])
    assert R.H200_SMEM_OPTIN // launch.blocks_per_sm - 1024 == 76_458
    assert round(76_458 / 1000, 1) == ncu["smem_kb"]
    # the main-branch clause would lower it to 2 (N / 128 * M * 8 * 4 = 384 < 396)
    assert R.marlin_launch(shape, 1, small_call_clause=True).blocks_per_sm == 2
    v3 = R.v3_launch(shape, 1)
    assert (v3.blocks_per_sm, v3.grid, v3.loop.registers) == (2, R.NCU_H200["v3"]["blocks"], 124)


def test_marlin_smem_by_hand() -> None:
    # thread_k 64, thread_n 128, one m-block, int4 g128: B pipeline 4 x (64 x 128 / 8) x 4 = 16,384;
    # A 4 x 16 x 64 x 2 = 8,192; scales 1 group x 128 x 2 x 4 = 1,024; metadata 16 x 16 = 256
    assert R.marlin_smem(R.H200_SHAPES["qwen3-w13"], 1, 64, 128) == 16_384 + 8_192 + 1_024 + 256


def test_tiles_per_expert() -> None:
    assert R.tiles_per_expert(1, 8, 128, 16) == pytest.approx(8 / 128)
    # M = 1024, 64-row tiles: 64 rows per expert on average, ~half the experts need a second tile
    assert 1.4 < R.tiles_per_expert(1024, 8, 128, 64) < 1.6


# ----------------------------------------------------------------------------------------------
# the fitted model against the measured rows


def _outside(ratio: float) -> bool:
    return abs(ratio - 1) > R.FIT_TOLERANCE


def test_fitted_model_predicts_the_measured_rows() -> None:
    """Every recorded row of both kernels within +-25 %, except the rows R.UNPREDICTED names --
    and those do miss (the list is what the model says, not a shelter)."""
    rows = R.check_rows(with_leave_one_out=False)
    assert len(rows) == 2 * len(R.MEASURED_H200) == 16
    assert len(R.FittedParams.NAMES) == 5 < len(rows)
    missed = {(r.kernel, r.shape, r.m) for r in rows if _outside(r.ratio)}
    assert missed == set(R.UNPREDICTED)
    for r in rows:
        assert r.model_us == pytest.approx(R.model_us(r.kernel, r.shape, r.m))
        assert r.measured_us in {row.marlin_us if r.kernel == "marlin" else row.v3_us
                                 for row in R.MEASURED_H200 if (row.shape, row.m) == (r.shape, r.m)}


def test_leave_one_out_on_the_streaming_rows() -> None:
    """Refitted without it, each row with M >= 16 is still predicted within +-25 % -- except
    Marlin's M = 1024 row, the only one whose SM holds 8 warps, which alone sets the per-warp issue
    rate."""
    rows = R.check_rows()
    streaming = [r for r in rows if r.m >= 16]
    assert {(r.kernel, r.shape, r.m) for r in streaming if _outside(r.loo_ratio)} == {("marlin", "qwen3-w13", 1024)}


def test_m1_step_costs_recover_a_planted_line() -> None:
    """Rows built as the slowest block's streaming plus 3 µs plus 0.5 µs per reduction step give
    back that line, for both kernels."""
    recorded = {c.kernel: c for c in R.m1_step_costs()}
    streaming = {}
    for kernel, c in recorded.items():
        for (shape, steps, rest), row in zip(c.points, [r for r in R.MEASURED_H200 if r.m == 1]):
            measured = row.marlin_us if kernel == "marlin" else row.v3_us
            streaming[kernel, shape] = (measured - rest, steps)
    planted = []
    for row in R.MEASURED_H200:
        if row.m != 1:
            continue
        (ms, msteps), (vs, vsteps) = streaming["marlin", row.shape], streaming["v3", row.shape]
        planted.append(R.MeasuredRow(row.shape, 1, ms + 3.0 + 0.5 * msteps, vs + 3.0 + 0.5 * vsteps))
    for c in R.m1_step_costs(rows=tuple(planted)):
        assert c.intercept_us == pytest.approx(3.0)
        assert c.slope_us == pytest.approx(0.5)
        assert c.per_operation_us == pytest.approx(0.5 / R.SYNC_OPS_PER_STEP[c.kernel])


def test_m1_rows_imply_different_latencies_for_one_sync_operation() -> None:
    """Why no single latency predicts both kernels' M = 1 rows: per dependent cross-block memory
    operation, v3's rows imply more than four times what Marlin's do. Steps by hand for
    DeepSeek-V3 w13: Marlin's 10-unit stripes over 112 k-tiles cut a tile into 12 slices (11
    links); v3's 1792 units over 264 blocks give blocks 0-16 a part of tile 0 (17 parts)."""
    costs = {c.kernel: c for c in R.m1_step_costs()}
    steps = {k: {s: x for s, x, _ in c.points} for k, c in costs.items()}
    assert steps["marlin"]["deepseek-w13-tp8"] == 11
    assert steps["v3"]["deepseek-w13-tp8"] == 17
    assert costs["v3"].per_operation_us > 4 * costs["marlin"].per_operation_us


def test_step_sweep_holds_the_streaming_and_varies_the_steps() -> None:
    """gpu_check's sweep at M = 1: every shape gives the slowest block the same units (Marlin 10,
    v3 7) while the blocks per output tile fall (Marlin 12 / 7 / 4 slices, v3 17 / 9 / 5 parts), so
    the measured times' differences are the reduction's steps alone."""
    from wna16ctl.native import gpucheck

    bench = {(e, k, n) for _, e, k, n, _, _, ms in gpucheck.BENCH_SHAPES if 1 in ms}
    parts = {"marlin": [], "v3": []}
    for key in R.STEP_SWEEP:
        shape = R.H200_SHAPES[key]
        assert (shape.experts, shape.size_k, shape.size_n) in bench
        assert shape.size_k * shape.size_n == 7168 * 512
        for kernel, units in (("marlin", 10), ("v3", 7)):
            c = R.call_counts(kernel, shape, 1)
            assert max(u for u, _ in c.blocks) == units
            parts[kernel].append(c.max_parts)
    assert parts == {"marlin": [12, 7, 4], "v3": [17, 9, 5]}


def test_measured_over_model() -> None:
    p = R.fitted_params()
    want = 100.0 / R.model_us("v3", "qwen3-w13", 16, p)
    assert R.measured_over_model("v3", "qwen3-w13", 16, 100.0) == pytest.approx(want)
    assert R.measured_over_model("marlin", R.QWEN3_W13, 64, 77.0) == pytest.approx(
        77.0 / R.model_us("marlin", R.QWEN3_W13, 64))


def test_model_uses_the_counts() -> None:
    """Halving v3's loop instructions shortens an issue-bound call, not a latency-bound one."""
    p = R.fitted_params()
    shape = R.H200_SHAPES["qwen3-w13"]
    lean = dict(R.RECORDED_LOOPS)
    old = lean[("v3", 4, 16)]
    lean[("v3", 4, 16)] = R.LoopCounts(old.name, old.registers, {k: v // 2 for k, v in old.classes.items()},
                                       old.chunks_per_iteration, old.group_extra // 2)
    full = R.model_time_s(R.call_counts("v3", shape, 64), p)
    half = R.model_time_s(R.call_counts("v3", shape, 64, loops=lean), p)
    assert half < 0.6 * full


@pytest.mark.kernels
def test_recorded_v3_loops_equal_a_fresh_count(tmp_path: Path) -> None:
    """RECORDED_LOOPS' v3 entries against kernels/moe_gemm_v3.cu compiled for sm_90 now (nvcc,
    cuobjdump and nvdisasm; `make test-kernels`)."""
    import os
    import subprocess

    import kernel_static as KS

    nvcc = KS.find_nvcc()
    cuobjdump, env = KS.find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc, cuobjdump and nvdisasm")
    cubin, log = KS.compile_cubin(nvcc, "v3", "90", tmp_path)
    usage = KS.parse_ptxas(log)
    sass = KS.sass_functions(subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True,
                                            check=True, env={**os.environ, **env}).stdout)
    seen = 0
    for mangled, ins in sass.items():
        import re

        m = re.search(r"moe_gemm_v3_kernelILi1ELi(\d)ELi(\d)ELi(\d)ELb0E", mangled)
        if not m:
            continue
        bits, mt, nt = (int(x) for x in m.groups())
        fresh = KS.loop_counts("fresh", ins, usage[mangled]["registers"], 16 * 32 * nt * bits // 16 // 8,
                               KS.group_sass(ins))
        rec = R.RECORDED_LOOPS[("v3", bits, 16 * mt)]
        assert (fresh.registers, fresh.classes, fresh.chunks_per_iteration, fresh.group_extra) == (
            rec.registers, rec.classes, rec.chunks_per_iteration, rec.group_extra), rec.name
        seen += 1
    assert seen == 6
