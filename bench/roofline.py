"""Models of the fast MoE GEMMs (kernels/moe_gemm_v2.cu, moe_gemm_v3.cu) on H100 / H200.

    python bench/roofline.py --fitted
    python bench/roofline.py [--static FILE.json] [--gpu h200 --gpu h100] [--json FILE]

`--fitted` is the model that judges a kernel: fitted to the measured H200 rows of v3 and of vLLM's
Marlin MoE kernel (MEASURED_H200), from the SASS counts of both kernels' streaming loops
(RECORDED_LOOPS, bench/kernel_static.py --vs-marlin), their launch choices and unit partitions;
it prints measured, model and leave-one-out per row. `measured_over_model()` rates a fresh
measurement. See "The model fitted to measured H200 figures" below.

Without `--fitted`: the earlier roofline of assumed machine fields, superseded (1.6-4x optimistic
against the H200 measurements); kept for its hand-checked arithmetic and its callers.

For each kernel instance it takes what the hardware has to do per pipeline stage of one block:

* HBM bytes: the stage's weight words, activation rows, and (once per scale group) its scale and
  zero-point rows;
* shared-memory cycles: cp.async writes, ldmatrix and 16-byte weight loads, the per-lane
  scale / zero table each warp re-reads every stage, and its refill once per group -- counted in
  wavefronts of 128 bytes (a narrow load costs one, as on the hardware);
* issue cycles: the SASS of the streaming loop (from `bench/kernel_static.py`: ptxas -v and
  cuobjdump; recorded sm_90 figures when no file is given), the group refill on top, divided by
  the issue rate that the warps per scheduler allow (registers and shared memory give the
  blocks per SM);
* tensor-core cycles of the stage's mma;
* Little's law: the bytes the pipelines keep in flight against the memory latency;

and the costs of a call that do not stream: the other launches (workspace reset, tile prefix),
the pipeline fill of every tile a block starts, the stream-K fix-up of cut tiles and the
epilogue's reduction through shared memory. The slowest resource per stage sets the streaming
rate; the expected share of the HBM peak at M = 1, 16, 64 is the ideal transfer time over the
modelled one, with the limiting resource named.

The bench shape is docs/performance.md's: E 64, K 2048, N 1536, top-8, int4 group 128, bf16. The
assumptions that no static figure gives (the single-warp issue rate of this loop, the memory
latency, the launch gap, the share of the HBM peak a plain copy reaches, mma.sync's rate) are
the GPU's fields below, named in the output; scripts/gpu_check.sh measures the real figures.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_HEADER = ROOT / "kernels" / "moe_gemm_v2.cuh"
PLAN_HEADER_V3 = ROOT / "kernels" / "moe_gemm_v3.cuh"


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    sms: int
    clock_hz: float
    smem_bytes_per_sm: int = 228 * 1024  # 227 KiB per block + 1 KiB the runtime reserves per block
    smem_reserved_per_block: int = 1024
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    schedulers: int = 4
    smem_bytes_per_clk: int = 128  # 32 banks x 4 bytes per SM and clock
    # assumptions (not from the static figures)
    copy_efficiency: float = 0.88  # the share of the HBM peak a plain device copy reaches
    latency_s: float = 0.8e-6  # loaded HBM latency, first byte of a stage
    launch_gap_s: float = 1.5e-6  # each launch before the main kernel (reset, prefix), back to back
    single_warp_ipc: float = 0.4  # issue slots per clock one warp of this loop fills on its own
    mma_per_clk: float = 0.6  # m16n8k16 mma.sync per SM and clock (~60 % of the dense peak)


GPUS = {
    "h200": Gpu("H200 SXM", 4.8e12, 132, 1.98e9),
    "h100": Gpu("H100 SXM", 3.35e12, 132, 1.98e9),
}


@dataclass(frozen=True)
class Shape:
    experts: int = 64
    size_k: int = 2048
    size_n: int = 1536
    top_k: int = 8
    group_size: int = 128
    act_bytes: int = 2  # bf16
    zero_points: bool = False


@dataclass(frozen=True)
class Instance:
    name: str
    num_bits: int
    mt: int
    nt: int
    registers: int
    loop_sass: int  # SASS of one streaming-loop iteration (one stage of one warp)
    loop_mma: int
    source: str = "recorded sm_90, nvcc 13.0 (docs/performance.md)"
    # how the instance is organised (v2's defaults; a design may change them)
    lane_table: bool = True  # scale / zero pairs re-read from a shared-memory table every stage
    warps_over_n: bool = False  # each warp takes an n-slice and all k-tiles of a stage (no reduction)
    launches: int = 3  # workspace reset, tile prefix, main kernel
    grid_blocks_per_sm: int = 2
    warps_n: int = 1  # v3: the k-warps' columns split over this many warps (8 warps per block)
    kernel: str = "v2"  # whose shared-memory plan (v2, v3)
    reduces_empty_rows: bool = True  # v2: the epilogue's reduction moves every row of a slice
    group_sass: int | None = None  # SASS a scale group's first stage adds, counted (v3); None: estimated

    @property
    def warps(self) -> int:
        return 4 * self.warps_n


# bench/kernel_static.py's sm_90 figures of the fast instances, as recorded in docs/performance.md
RECORDED_SM90 = (
    Instance("4-bit 16x256", 4, 1, 4, 240, 487, 32),
    Instance("4-bit 32x128", 4, 2, 2, 240, 365, 32),
    Instance("4-bit 64x64", 4, 4, 1, 239, 317, 32),
    Instance("8-bit fp16 16x256", 8, 1, 4, 245, 531, 32),
    Instance("8-bit bf16 16x256", 8, 1, 4, 244, 785, 32),
)

# A design, not a kernel: the Marlin-style tiling with warps split over N (32 accumulators per
# thread in the 16x256 tile, ~128 registers assumed: four blocks per SM), scales and zeros in
# registers once per group (no lane table), no cross-warp reduction, one launch. Its loop is
# assumed to hold v2's SASS less the 16 lane-table loads per stage; nothing here is measured.
V3_DESIGN = (
    Instance("v3 design 4-bit 16x256", 4, 1, 4, 128, 487 - 16, 32, source="design assumption",
             lane_table=False, warps_over_n=True, launches=1, grid_blocks_per_sm=4),
    Instance("v3 design 8-bit bf16 16x256", 8, 1, 4, 128, 785 - 16, 32, source="design assumption",
             lane_table=False, warps_over_n=True, launches=1, grid_blocks_per_sm=4),
)




def plan_constants(header: Path = PLAN_HEADER) -> dict[str, int]:
    """The tile constants of kernels/moe_gemm_v2.cuh (kThreads, kStages, kStageK, ...)."""
    text = header.read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (k\w+) = (\d+);", text)}


@dataclass(frozen=True)
class Plan:
    """Python twin of the shared-memory Plan<NB, MT, NT> in kernels/moe_gemm_v2.cuh."""
    num_bits: int
    mt: int
    nt: int
    stages: int
    stage_k: int
    red_pad: int

    @property
    def pf(self) -> int:
        return 32 // self.num_bits

    @property
    def wpt(self) -> int:
        return 1024 // self.pf

    @property
    def bm(self) -> int:
        return 16 * self.mt

    @property
    def bn(self) -> int:
        return 64 * self.nt

    @property
    def a_bytes(self) -> int:
        return self.bm * self.stage_k * 2

    @property
    def b_bytes(self) -> int:
        return 4 * self.nt * self.wpt * 4

    @property
    def stage_bytes(self) -> int:
        s, z, g = 4 * self.bn * 2, 4 * (self.bn // self.pf) * 4, self.stage_k * 4
        return self.a_bytes + self.b_bytes + s + z + g

    @property
    def lane_table_bytes(self) -> int:
        return 4 * self.nt * 4 * 32 * 16

    lane_table: bool = True
    reduction: bool = True

    @property
    def smem(self) -> int:
        pipe = self.stages * self.stage_bytes
        red = 4 * self.bm * (self.bn + self.red_pad) * 4 if self.reduction else 0
        lane = self.lane_table_bytes if self.lane_table else 0
        return max(pipe, red) + lane + self.bm * 4 + self.bm * 8 + 16


@dataclass(frozen=True)
class PlanV3(Plan):
    """Python twin of kernels/moe_gemm_v3.cuh's Plan<NB, MT, NT> and smem_bytes(E): one scale and
    one zero-point row per stage, no g_idx or lane table, the tile prefix of E experts."""
    experts: int = 64

    @property
    def stage_bytes(self) -> int:
        raw = self.a_bytes + self.b_bytes + self.bn * 2 + (self.bn // self.pf) * 4
        return (raw + 15) // 16 * 16

    @property
    def smem(self) -> int:
        pipe = self.stages * self.stage_bytes
        red = 4 * self.bm * (self.bn + self.red_pad) * 4
        # + the flag, the prefix's warp totals, the unit positions, the scale copies' pointers
        fixed = max(pipe, red) + self.bm * 4 + self.bm * 8 + 16 + 4 * 8 + 16 + 8 * 64
        return fixed + (4 * (self.experts + 1) + 15) // 16 * 16


def plan_of(inst: Instance, consts: dict[str, int] | None = None, experts: int = 64) -> Plan:
    c = consts or plan_constants()
    if inst.kernel == "v3":
        c3 = plan_constants(PLAN_HEADER_V3)
        return PlanV3(inst.num_bits, inst.mt, inst.nt, c3["kStages"], c3["kStageK"], c3["kRedPad"],
                      lane_table=False, reduction=True, experts=experts)
    return Plan(inst.num_bits, inst.mt, inst.nt, c["kStages"], c["kStageK"], c["kRedPad"],
                lane_table=inst.lane_table, reduction=not inst.warps_over_n)


def blocks_per_sm(inst: Instance, plan: Plan, gpu: Gpu) -> tuple[int, str]:
    """Resident blocks per SM and what limits them (registers, shared memory, or the grid's own
    blocks per SM)."""
    launch_cap = inst.grid_blocks_per_sm
    warps = inst.warps
    regs_per_warp = math.ceil(inst.registers * 32 / 256) * 256  # allocated in 256-register units
    by_regs = gpu.regs_per_sm // (regs_per_warp * warps)
    by_smem = gpu.smem_bytes_per_sm // (plan.smem + gpu.smem_reserved_per_block)
    by_warps = gpu.max_warps_per_sm // warps
    n = min(by_regs, by_smem, by_warps, launch_cap)
    why = "registers" if n == by_regs else "shared memory" if n == by_smem else "warps" if n == by_warps else "grid"
    return n, why


@dataclass
class StageCost:
    """Cycles of one SM per pipeline stage of one block, per resource, and the HBM bytes."""
    hbm_bytes: float
    cycles: dict[str, float] = field(default_factory=dict)
    blocks: int = 0
    blocks_limited_by: str = ""
    warps_per_scheduler: float = 0.0
    issue_rate: float = 0.0

    @property
    def limit(self) -> str:
        return max(self.cycles, key=self.cycles.get)

    @property
    def steady_fraction(self) -> float:
        """Share of the HBM peak the SM sustains while streaming."""
        return self.cycles["hbm"] / self.cycles[self.limit]


def refill_sass(plan: Plan) -> int:
    """SASS of one lane-table refill per warp (once per scale group): per n-tile, sub-tile and
    column half one scale load, one zero-point load and ~6 instructions of address and packing
    arithmetic (an estimate: this path is outside the counted loop), and one 16-byte store per
    sub-tile."""
    return plan.nt * 4 * (2 * 8 + 1)


def stage_cost(inst: Instance, gpu: Gpu, shape: Shape, rows: int, consts: dict[str, int] | None = None) -> StageCost:
    """The per-stage cost of `inst` when its tiles hold `rows` sorted rows (1 .. 16 * mt)."""
    plan = plan_of(inst, consts, shape.experts)
    mcount = max(1, min(inst.mt, math.ceil(rows / 16)))
    stages_per_group = max(1, shape.group_size // plan.stage_k)
    # HBM: the stage's weights and (once per group) its scale / zero-point rows; the activation
    # rows are re-read by every n-tile of a tile and served by L2 after the first (the call's
    # activations and outputs are counted once, in expect())
    scale_row = plan.bn * 2 + ((plan.bn // plan.pf) * 4 if shape.zero_points else 0)
    hbm = plan.b_bytes + scale_row / stages_per_group

    # shared memory, in 128-byte wavefronts per block-stage (16-byte accesses move 512 B per warp
    # instruction in 4 wavefronts; a narrow access is one wavefront)
    w = gpu.smem_bytes_per_clk
    words_per_lane = plan.wpt * 4 // 32 // 16  # 16-byte weight loads per lane and n-tile
    # per warp and 16-row slice one x4 ldmatrix (4 wavefronts) per k-tile it computes: v2's warp
    # one k-tile, a warp split over N all four; v3's n-warps each load their k-tile's fragments
    a_loads = 4 * mcount * 4 * (4 if inst.warps_over_n else inst.warps_n)
    smem = {
        "cp.async writes": (mcount * 16 * 128 + plan.b_bytes) / w,
        "ldmatrix A": a_loads,
        "weight loads": 4 * plan.nt * words_per_lane * 4,
    }
    if inst.lane_table:
        smem["lane table reads"] = 4 * plan.nt * 4 * 4  # per warp, n-tile, sub-tile one 16-byte load
        per_group = 4 * plan.nt * 4 * (2 * 2 + 4)  # refill: 4 narrow loads + one 16-byte store, per warp
    elif inst.warps_over_n:  # the group's scale / zero row read into registers: one narrow load per pair and warp
        per_group = 4 * plan.nt * 4 * 2 // 4
    else:  # v3: every warp reads the scale (and zero point) of its lane's two columns per sub-tile
        per_group = 4 * plan.nt * 4 * 2 * (2 if shape.zero_points else 1)
    smem["scale refill"] = per_group / stages_per_group
    smem_cycles = sum(smem.values())

    blocks, why = blocks_per_sm(inst, plan, gpu)
    warps_per_scheduler = blocks * inst.warps / gpu.schedulers
    issue_rate = min(1.0, warps_per_scheduler * gpu.single_warp_ipc)
    # a block's warps spread over the schedulers: a block-stage costs every scheduler the loop's
    # SASS once per warp of the block it holds (v2: one, v3: two)
    per_scheduler = inst.warps / gpu.schedulers
    if inst.group_sass is not None:  # counted in the kernel's SASS (bench/kernel_static.py)
        refill = inst.group_sass
    elif inst.lane_table:
        refill = refill_sass(plan)
    elif inst.warps_over_n:
        refill = refill_sass(plan) // 4  # a quarter: own n-slice only
    else:
        refill = refill_sass(plan) // inst.warps_n  # v3: its n-half, into registers
    issue = per_scheduler * (inst.loop_sass + refill / stages_per_group) / issue_rate
    mma = 4 * plan.nt * 8 * mcount / gpu.mma_per_clk
    hbm_per_clk = gpu.hbm_bytes_per_s / gpu.sms / gpu.clock_hz
    latency_clk = gpu.latency_s * gpu.clock_hz
    in_flight = blocks * (plan.stages - 1) * hbm  # bytes per SM the pipelines keep requested
    cost = StageCost(hbm, blocks=blocks, blocks_limited_by=why, warps_per_scheduler=warps_per_scheduler,
                     issue_rate=issue_rate)
    cost.cycles = {
        "hbm": hbm / hbm_per_clk,
        "copy limit": hbm / (hbm_per_clk * gpu.copy_efficiency),
        "latency (Little)": hbm * latency_clk / in_flight,
        "shared memory": smem_cycles,
        "issue": issue,
        "tensor cores": mma,
    }
    return cost


def epilogue_wavefronts(inst: Instance, plan: Plan, rows: int) -> float:
    """Shared-memory wavefronts of one tile's epilogue: the four k-warps' partial sums stored and
    read back for the sum. v2 moves every row of the 16-row slices that hold rows (bytes / 128).
    v3 stores only the rows that have a slot: per warp, 16-row slice and half (rows g and g + 8 of
    the mma fragment) one 8-byte store per lane and column pair -- 4 * NT instructions of which
    each covers 4 rows per wavefront (32 bytes a row) -- and reads back 4 * BN * 4 bytes per row."""
    slices = max(1, min(plan.mt, math.ceil(rows / 16)))
    if inst.reduces_empty_rows:
        return 4 * 16 * slices * plan.bn * 4 * 2 / 128
    stores = 0
    for i in range(slices):
        held = max(0, min(16, rows - 16 * i))
        for half in (min(8, held), max(0, held - 8)):
            if half:
                stores += inst.warps * (plan.bn // 16 // inst.warps_n) * 2 * math.ceil(half / 4)
    reads = min(rows, 16 * slices) * plan.bn * 4 * 4 / 128
    return stores + reads


def experts_reached(shape: Shape, m: int) -> float:
    """Experts that M tokens choosing top_k of E reach on average."""
    return shape.experts * (1 - (1 - shape.top_k / shape.experts) ** m)


def launcher_rows(shape: Shape, m: int) -> int:
    """Tile rows the launcher picks (sorted rows per expert, rounded as moe_align pads)."""
    per_expert = math.ceil(m * shape.top_k / shape.experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


@dataclass
class Expectation:
    gpu: str
    instance: str
    m: int
    experts: float
    hbm_bytes: float
    ideal_us: float
    modelled_us: float
    fraction: float
    limit: str
    steady_fraction: float
    steady_limit: str
    parts_us: dict[str, float]
    blocks_per_sm: int
    warps_per_scheduler: float


def expect(inst: Instance, gpu: Gpu, shape: Shape, m: int, consts: dict[str, int] | None = None) -> Expectation:
    """The modelled call at M tokens: streaming time on the busiest SM plus what does not stream."""
    c = consts or plan_constants()
    plan = plan_of(inst, c, shape.experts)
    e = experts_reached(shape, m)
    slots_per_expert = m * shape.top_k / e
    rows = max(1, min(plan.bm, math.ceil(slots_per_expert)))
    cost = stage_cost(inst, gpu, shape, rows, c)
    kstages = math.ceil(shape.size_k / plan.stage_k)
    ntiles_n = math.ceil(shape.size_n / plan.bn)
    mtiles = e * max(1, math.ceil(slots_per_expert / plan.bm))
    units = round(mtiles) * ntiles_n * kstages
    blocks = min(gpu.sms * inst.grid_blocks_per_sm, units)  # the grid: equal stream-K ranges
    starts = [b * units // blocks for b in range(blocks + 1)]  # unit_start() of the kernel
    longest = max(starts[b + 1] - starts[b] for b in range(blocks))
    # tiles a block starts: each is a pipeline fill (a memory latency before its first stage)
    tiles = max((starts[b + 1] - 1) // kstages - starts[b] // kstages + 1 for b in range(blocks))
    cut = any(starts[b] % kstages for b in range(1, blocks))  # a tile shared by two blocks
    activations = m * shape.size_k * shape.act_bytes
    outputs = m * shape.top_k * shape.size_n * shape.act_bytes
    bytes_total = cost.hbm_bytes * units + activations + outputs
    clk = gpu.clock_hz
    # the busiest SM streams its blocks' stages at the slowest resource's rate
    per_sm = math.ceil(blocks / gpu.sms)  # blocks an SM runs (resident or in a later wave)
    steady_s = per_sm * longest * cost.cycles[cost.limit] / clk
    fill_s = tiles * gpu.latency_s
    fixup_s = gpu.latency_s if cut else 0.0  # publish, flag, acquire, read the partials (L2)
    # the k-warps' partials out and back through shared memory, one wavefront per clock
    epilogue_s = tiles * epilogue_wavefronts(inst, plan, rows) / clk if plan.reduction else 0.0
    launch_s = (inst.launches - 1) * gpu.launch_gap_s
    parts = {"streaming": steady_s, "pipeline fills": fill_s, "stream-K fix-up": fixup_s,
             "epilogue": epilogue_s, "other launches": launch_s}
    total = sum(parts.values())
    ideal = bytes_total / gpu.hbm_bytes_per_s
    fixed = total - steady_s
    limit = cost.limit if steady_s >= fixed else "fixed costs: " + ", ".join(
        k for k in sorted(parts, key=parts.get, reverse=True) if k != "streaming" and parts[k] > 0)
    return Expectation(gpu.name, inst.name, m, e, bytes_total, ideal * 1e6, total * 1e6, ideal / total, limit,
                       cost.steady_fraction, cost.limit, {k: v * 1e6 for k, v in parts.items()}, cost.blocks,
                       cost.warps_per_scheduler)


def instances_from_static(path: Path, kernel: str = "v2") -> list[Instance]:
    """The sm_90 fast instances of `kernel` (v2 or v3) in a `bench/kernel_static.py --json` file."""
    data = json.loads(path.read_text())
    out = []
    for k in data["kernels"]:
        if k["kernel"] != kernel or k["arch"] != "90" or "fast" not in k["name"] or not k["loop_instructions"]:
            continue
        if k["name"].endswith(" zp"):  # v3's zero-point instances: the bench shape has none
            continue
        m = re.search(r"(\d+)x(\d+)", k["name"])
        if not m:
            continue
        bm, bn = int(m.group(1)), int(m.group(2))
        dt = " bf16" if "bf16" in k["name"] else " fp16" if "fp16" in k["name"] else ""
        where = f"{path} ({k.get('counted_in') or '?'})"
        if kernel == "v3":
            out.append(v3_instance(f"{k['num_bits']}-bit{dt} {bm}x{bn}", k["num_bits"], bm // 16, bn // 64,
                                   k["registers"], k["loop_instructions"], k["loop_mma"], where,
                                   group_sass=k.get("group_sass") or None))
        else:
            out.append(Instance(f"{k['num_bits']}-bit{dt} {bm}x{bn}", k["num_bits"], bm // 16, bn // 64,
                                k["registers"], k["loop_instructions"], k["loop_mma"], source=where))
    return out


def v3_instance(name: str, num_bits: int, mt: int, nt: int, registers: int, loop_sass: int, loop_mma: int,
                source: str, group_sass: int | None = None) -> Instance:
    """A v3 kernel instance (kernels/moe_gemm_v3.cu): eight warps (four over K, two over N), scale
    pairs in registers (no lane table), the k-warps' reduction kept for the rows that have a slot,
    one launch, two blocks per SM; group_sass: what a scale group's first stage issues on top of a
    streaming iteration, counted by bench/kernel_static.py (None: refill_sass's estimate)."""
    return Instance("v3 " + name, num_bits, mt, nt, registers, loop_sass, loop_mma, source=source,
                    lane_table=False, warps_over_n=False, launches=1, grid_blocks_per_sm=2, warps_n=2,
                    kernel="v3", reduces_empty_rows=False, group_sass=group_sass)


# bench/kernel_static.py's sm_90 figures of the v3 fast instances without zero points (the bench
# shape has none), as recorded in docs/performance.md ("GEMM kernel"): registers, the streaming
# loop's SASS, its mma, and the SASS a scale group's first stage adds ("group extra")
_V3_SOURCE = "recorded sm_90, nvcc 13.0 (docs/performance.md)"
RECORDED_SM90_V3: tuple[Instance, ...] = (
    v3_instance("4-bit fp16 16x256", 4, 1, 4, 126, 271, 16, _V3_SOURCE, group_sass=119),
    v3_instance("4-bit fp16 32x128", 4, 2, 2, 116, 209, 16, _V3_SOURCE, group_sass=85),
    v3_instance("4-bit fp16 64x64", 4, 4, 1, 116, 208, 16, _V3_SOURCE, group_sass=71),
    v3_instance("8-bit fp16 16x256", 8, 1, 4, 126, 262, 16, _V3_SOURCE, group_sass=121),
    v3_instance("8-bit fp16 32x128", 8, 2, 2, 117, 206, 16, _V3_SOURCE, group_sass=85),
    v3_instance("8-bit fp16 64x64", 8, 4, 1, 118, 199, 16, _V3_SOURCE, group_sass=69),
    v3_instance("4-bit bf16 16x256", 4, 1, 4, 124, 273, 16, _V3_SOURCE, group_sass=119),
    v3_instance("4-bit bf16 32x128", 4, 2, 2, 117, 210, 16, _V3_SOURCE, group_sass=85),
    v3_instance("4-bit bf16 64x64", 4, 4, 1, 118, 209, 16, _V3_SOURCE, group_sass=71),
    v3_instance("8-bit bf16 16x256", 8, 1, 4, 128, 394, 16, _V3_SOURCE, group_sass=121),
    v3_instance("8-bit bf16 32x128", 8, 2, 2, 121, 272, 16, _V3_SOURCE, group_sass=85),
    v3_instance("8-bit bf16 64x64", 8, 4, 1, 122, 233, 16, _V3_SOURCE, group_sass=69),
)


def pick_instance(instances, shape: Shape, m: int, num_bits: int = 4) -> Instance:
    rows = launcher_rows(shape, m)
    want = {16: (1, 4), 32: (2, 2), 64: (4, 1)}[rows]
    return next(i for i in instances if i.num_bits == num_bits and (i.mt, i.nt) == want and "fp16" not in i.name)


def render(rows: list[Expectation], gpus: list[Gpu], costs: list[tuple[str, str, StageCost]]) -> str:
    out = ["| GPU | M | instance | experts | HBM bytes | ideal | modelled | share of HBM peak | limit | "
           "streaming share, limit |",
           "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        out.append(f"| {r.gpu} | {r.m} | {r.instance} | {r.experts:.1f} | {r.hbm_bytes / 1e6:.1f} MB | "
                   f"{r.ideal_us:.1f} µs | {r.modelled_us:.1f} µs | **{100 * r.fraction:.0f} %** | {r.limit} | "
                   f"{100 * r.steady_fraction:.0f} %, {r.steady_limit} |")
    out += ["", "Per stage of one block (cycles of one SM; M = 16 rows; the largest sets the rate):", "",
            "| GPU | instance | blocks/SM (limit) | warps/scheduler | HBM | copy limit | Little | shared mem | "
            "issue | tensor | streaming share |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, name, c in costs:
        cy = c.cycles
        out.append(f"| {g} | {name} | {c.blocks} ({c.blocks_limited_by}) | {c.warps_per_scheduler:g} | "
                   f"{cy['hbm']:.0f} | {cy['copy limit']:.0f} | {cy['latency (Little)']:.0f} | "
                   f"{cy['shared memory']:.0f} | {cy['issue']:.0f} | {cy['tensor cores']:.0f} | "
                   f"{100 * c.steady_fraction:.0f} % ({c.limit}) |")
    for g in gpus:
        out.append(f"\nassumed for {g.name}: plain copy {100 * g.copy_efficiency:.0f} % of "
                   f"{g.hbm_bytes_per_s / 1e12:.2f} TB/s, latency {g.latency_s * 1e6:.1f} µs, launch gap "
                   f"{g.launch_gap_s * 1e6:.1f} µs, one warp issues {g.single_warp_ipc:g}/clk, "
                   f"mma.sync {g.mma_per_clk:g}/clk/SM, {g.clock_hz / 1e9:.2f} GHz")
    return "\n".join(out)


def model(instances: list[Instance], gpus: list[Gpu], shape: Shape = Shape(), ms=(1, 16, 64)):
    consts = plan_constants()
    rows = [expect(pick_instance(instances, shape, m), g, shape, m, consts=consts) for g in gpus for m in ms]
    costs = [(g.name, i.name, stage_cost(i, g, shape, 16 * i.mt, consts)) for g in gpus for i in instances]
    return rows, costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--static", type=Path, help="bench/kernel_static.py --json output (default: recorded sm_90)")
    ap.add_argument("--gpu", action="append", choices=sorted(GPUS), help="repeatable; default h200 and h100")
    ap.add_argument("--json", type=Path, help="also write the expectations as JSON here")
    ap.add_argument("--fitted", action="store_true",
                    help="the model fitted to the measured H200 rows: per row measured, model, leave-one-out")
    args = ap.parse_args(argv)
    if args.fitted:
        print(f"measured: {MEASURED_PROVENANCE}\nloop counts: {LOOP_SOURCE}\n")
        print(render_fitted(check_rows(), fitted_params()))
        print(render_step_costs(m1_step_costs()))
        return 0
    instances = instances_from_static(args.static) if args.static else list(RECORDED_SM90)
    v3 = instances_from_static(args.static, "v3") if args.static else list(RECORDED_SM90_V3)
    if not instances and not v3:
        print(f"roofline: no sm_90 fast v2 or v3 instances in {args.static}", file=sys.stderr)
        return 2
    instances = instances or list(RECORDED_SM90)  # a file of v3 figures only: v2's recorded ones
    gpus = [GPUS[g] for g in (args.gpu or ["h200", "h100"])]
    rows, costs = model(instances, gpus)
    print(f"static figures: {instances[0].source}")
    print(render(rows, gpus, costs))
    if v3:
        rows3, costs3 = model(v3, gpus)
        print(f"\nv3 kernel (kernels/moe_gemm_v3.cu), static figures: {v3[0].source}")
        print(render(rows3, gpus, costs3))
    print("\nv3 design (assumed figures, not a kernel: warps over N, scales in registers, one launch, "
          "4 blocks per SM), share of HBM peak at M = 1 / 16 / 64:")
    shape = Shape()
    for g in gpus:
        for d in V3_DESIGN:
            got = [expect(d, g, shape, m) for m in (1, 16, 64)]
            print(f"  {g.name}, {d.name}: " + " / ".join(f"{100 * r.fraction:.0f} % ({r.limit})" for r in got))
    print("\nsensitivity to the single-warp issue rate (share of HBM peak at M = 1 / 16 / 64):")
    for g in gpus:
        for ipc in (0.3, 0.4, 0.5):
            alt, _ = model(instances, [replace(g, single_warp_ipc=ipc)])
            print(f"  {g.name}, one warp issues {ipc:g}/clk: " + " / ".join(f"{100 * r.fraction:.0f} %" for r in alt))
    if args.json:
        args.json.write_text(json.dumps({"expectations": [asdict(r) for r in rows],
                                         "v3_expectations": [asdict(r) for r in rows3] if v3 else [],
                                         "gpus": [asdict(g) for g in gpus]}, indent=2) + "\n")
    return 0



# ==============================================================================================
# The model fitted to measured H200 figures (supersedes the assumed fields above for judging a
# kernel: those were never measured and proved 1.6-4x optimistic).
#
# A call's time on the busiest block is
#
#     fixed + round_trips * latency + units * (resident blocks) * max(issue, memory) per unit
#
# * units: the (tile, K-stage) pieces of the call, split over the grid as the kernel splits them
#   (v3: stream-K, block b starts at b * units // grid; Marlin: ceil-sized stripes, rounded up to
#   whole scale groups), computed from the routed rows, the tile and the grid -- not fitted;
# * issue per unit: the warp-instructions of the streaming loop per 16-byte weight chunk, counted
#   in the SASS by bench/kernel_static.py, times the chunks of a unit, at the SM's issue rate:
#   warps per SM x `warp_ipc`, capped at `issue_cap` (ncu: both kernels issue 55-56 % of slots
#   at M = 64, however many warps they hold);
# * memory per unit: the call's unique weight and scale bytes over the grid's units, at
#   `hbm_share` of the HBM peak;
# * round trips: the dependent global-memory round trips on the block's path that the counts of
#   its code give (tile lookups, pipeline fills, the stream-K publish and the consumer's
#   acquire / reset per part for v3; the serial slice reduction of Marlin), each `round_trip_s`;
# * fixed: launch and block start, `fixed_s`.
#
# Five machine parameters, fitted (least squares of log(model / measured)) on the recorded rows of
# both kernels together; `leave_one_out()` refits without each row in turn and predicts it.

SASS_CLOCK_HZ = 1.98e9  # H200 SM clock under load (boost), as the older model assumed
H200_SMS = 132
H200_HBM = 4.8e12


@dataclass(frozen=True)
class MoeShape:
    """One MoE projection: E experts of a K x N weight, top-k routing, bf16 activations; group_size
    -1 is channel-wise."""
    name: str
    experts: int
    size_k: int
    size_n: int
    top_k: int = 8
    num_bits: int = 4
    group_size: int = 128

    @property
    def expert_bytes(self) -> int:
        """One expert's weight codes and bf16 scales, as both layouts store them."""
        groups = 1 if self.group_size < 0 else self.size_k // self.group_size
        return self.size_k * self.size_n * self.num_bits // 8 + groups * self.size_n * 2


QWEN3_W13 = MoeShape("Qwen3-30B-A3B w13 (E128 K2048 N1536, int4 g128)", 128, 2048, 1536)
QWEN3_W2 = MoeShape("Qwen3-30B-A3B w2 (E128 K768 N2048, int4 g128)", 128, 768, 2048)
DEEPSEEK_W13_TP8 = MoeShape("DeepSeek-V3 w13 at TP 8 (E256 K7168 N512, int4 g128)", 256, 7168, 512)
QWEN3_W13_INT8 = MoeShape("Qwen3-30B-A3B w13 (E128 K2048 N1536, int8 channel-wise)", 128, 2048, 1536,
                          num_bits=8, group_size=-1)
# gpu_check's reduction-step sweep (with DeepSeek-V3 w13 at TP 8): K x N held at 7168 x 512, so a
# block streams the same units at M = 1 while the blocks that share an output tile change
STEP_SWEEP_K3584 = MoeShape("reduction-step sweep (E256 K3584 N1024, int4 g128)", 256, 3584, 1024)
STEP_SWEEP_K1792 = MoeShape("reduction-step sweep (E256 K1792 N2048, int4 g128)", 256, 1792, 2048)
H200_SHAPES = {"qwen3-w13": QWEN3_W13, "qwen3-w2": QWEN3_W2, "deepseek-w13-tp8": DEEPSEEK_W13_TP8,
               "qwen3-w13-int8": QWEN3_W13_INT8, "sweep-k3584-n1024": STEP_SWEEP_K3584,
               "sweep-k1792-n2048": STEP_SWEEP_K1792}
STEP_SWEEP = ("deepseek-w13-tp8", "sweep-k3584-n1024", "sweep-k1792-n2048")


@dataclass(frozen=True)
class MeasuredRow:
    shape: str  # a key of H200_SHAPES
    m: int
    marlin_us: float
    v3_us: float


MEASURED_PROVENANCE = (
    "one NVIDIA H200 SXM (132 SMs, 60 MB L2), driver 580, torch 2.11.0+cu130, nvcc 13.0; vLLM 0.33.0's "
    "moe_wna16_marlin_gemm from vllm/_moe_C_stable_libtorch.abi3.so and wna16ctl's v3 (main at dbb4008) on "
    "the same inputs (wna16ctl.layout.marlin weights, scales), top-8 routing, bf16; L2 flushed before each "
    "call (a 512 MB memset outside the timed region); median of 15 calls")

# The first GPU measurements of the MoE GEMMs (provenance above): the only rows the model is
# fitted on and judged by.
MEASURED_H200: tuple[MeasuredRow, ...] = (
    MeasuredRow("qwen3-w13", 1, 13.5, 29.3),
    MeasuredRow("qwen3-w13", 16, 54.8, 84.5),
    MeasuredRow("qwen3-w13", 64, 77.0, 126.4),
    MeasuredRow("qwen3-w13", 1024, 277.7, 520.7),
    MeasuredRow("qwen3-w2", 1, 12.2, 25.7),
    MeasuredRow("deepseek-w13-tp8", 1, 17.0, 46.5),
    MeasuredRow("deepseek-w13-tp8", 64, 137.8, 215.9),
    MeasuredRow("qwen3-w13-int8", 16, 80.0, 101.2),
)

# ncu on the same machine, Qwen3 w13 at M = 1 (and the issue rate at M = 64): what the launch
# choices below must reproduce, and what the issue cap stands for.
NCU_H200 = {
    "v3": {"m": 1, "us": 27.0, "blocks": 264, "blocks_per_sm": 2, "registers": 124, "smem_kb": 68.9,
           "dram_share": 0.10, "issue_busy": 0.25, "no_eligible": 0.587},
    "marlin": {"m": 1, "us": 11.5, "blocks": 396, "blocks_per_sm": 3, "registers": 128, "smem_kb": 76.5,
               "dram_share": 0.237},
    "issue_busy_m64": (0.55, 0.56),
}


@dataclass(frozen=True)
class LoopCounts:
    """The streaming loop of one kernel instance on sm_90, from bench/kernel_static.py: registers,
    warp-instructions of one iteration's streaming path by class, the 16-byte weight chunks one
    warp's iteration consumes, and (v3) what a scale group's first stage adds per warp."""
    name: str
    registers: int
    classes: dict[str, int]
    chunks_per_iteration: int
    group_extra: int = 0

    @property
    def instructions(self) -> int:
        return sum(self.classes.values())

    @property
    def per_chunk(self) -> float:
        return self.instructions / self.chunks_per_iteration


def _classes(glb, shared, mma, deq, addr, bar, br, other) -> dict[str, int]:
    return {"global": glb, "shared": shared, "mma": mma, "dequant": deq, "address": addr, "barrier": bar,
            "branch": br, "other": other}


# `python bench/kernel_static.py --vs-marlin --json F` (nvcc 13.0 ptxas for sm_90; Marlin from
# vLLM 0.33.0's sm_80 PTX, which is what the driver compiles on an H200: the wheel holds no sm_90
# Marlin cubin). Keys: (kernel, num_bits, tile rows, threads or warps, tile_n, tile_k).
LOOP_SOURCE = "recorded: bench/kernel_static.py --vs-marlin, sm_90, ptxas 13.0"
RECORDED_LOOPS: dict[tuple, LoopCounts] = {
    ("v3", 4, 16): LoopCounts("v3 bf16 4-bit 16x256", 124, _classes(4, 15, 16, 136, 71, 6, 15, 10), 64, 119),
    ("v3", 4, 32): LoopCounts("v3 bf16 4-bit 32x128", 117, _classes(3, 15, 16, 77, 63, 13, 14, 9), 32, 85),
    ("v3", 4, 64): LoopCounts("v3 bf16 4-bit 64x64", 118, _classes(4, 21, 16, 48, 75, 15, 19, 11), 16, 71),
    ("v3", 8, 16): LoopCounts("v3 bf16 8-bit 16x256", 128, _classes(6, 17, 16, 176, 84, 6, 15, 74), 128, 121),
    ("v3", 8, 32): LoopCounts("v3 bf16 8-bit 32x128", 121, _classes(4, 16, 16, 97, 71, 13, 14, 41), 64, 85),
    ("v3", 8, 64): LoopCounts("v3 bf16 8-bit 64x64", 122, _classes(4, 21, 16, 58, 75, 15, 16, 28), 32, 69),
    ("marlin", 4, 8, 128, 128, 64): LoopCounts("Marlin bf16 u4b8 g128 m8 128x64, 128 threads", 128,
                                               _classes(14, 40, 32, 520, 95, 16, 23, 20), 256),
    ("marlin", 4, 8, 256, 128, 128): LoopCounts("Marlin bf16 u4b8 g128 m8 128x128, 256 threads", 128,
                                                _classes(16, 48, 32, 516, 106, 16, 29, 21), 256),
    ("marlin", 4, 64, 256, 256, 64): LoopCounts("Marlin bf16 u4b8 g128 m64 256x64, 256 threads", 255,
                                                _classes(18, 80, 256, 539, 128, 16, 23, 44), 256),
    ("marlin", 4, 64, 128, 128, 64): LoopCounts("Marlin bf16 u4b8 g128 m64 128x64, 128 threads", 255,
                                                _classes(26, 112, 256, 547, 182, 16, 23, 58), 256),
    ("marlin", 8, 8, 128, 128, 64): LoopCounts("Marlin bf16 u8b128 channel m8 128x64, 128 threads", 94,
                                               _classes(20, 40, 32, 409, 111, 16, 17, 275), 512),
    ("marlin", 8, 8, 256, 128, 128): LoopCounts("Marlin bf16 u8b128 channel m8 128x128, 256 threads", 102,
                                                _classes(20, 40, 32, 409, 106, 16, 17, 278), 512),
}


@dataclass(frozen=True)
class Launch:
    """How a kernel runs one call: the tile (rows x columns x K rows per unit), the warps of a
    block, resident blocks per SM, the grid, its unit partition, and the loop it streams with."""
    kernel: str
    tile_m: int
    tile_n: int
    unit_k: int
    warps: int
    blocks_per_sm: int
    grid: int
    loop: LoopCounts
    why: str = ""


def v3_launch(shape: MoeShape, m: int, sms: int = H200_SMS, loops=None) -> Launch:
    """kernels/moe_gemm_v3.cu's make_config: tile rows from the sorted rows per expert (16 / 32 / 64,
    with 256 / 128 / 64 columns), 8 warps, 2 blocks per SM, stream-K over 2 x SMs blocks."""
    loops = loops or RECORDED_LOOPS
    per_expert = math.ceil(m * shape.top_k / shape.experts)
    rows = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return Launch("v3", rows, {16: 256, 32: 128, 64: 64}[rows], 64, 8, 2, 2 * sms,
                  loops[("v3", shape.num_bits, rows)], f"{rows}-row tile: {per_expert} sorted rows per expert")


def marlin_block_size(shape: MoeShape, m: int) -> int:
    """vLLM's fused_marlin_moe: the smallest of 8, 16, 32, 48, 64 with M * top_k / E / size < 0.9
    (64 when none is)."""
    for size in (8, 16, 32, 48, 64):
        if m * shape.top_k / shape.experts / size < 0.9:
            return size
    return 64


# vLLM's marlin_moe_wna16 thread configurations (thread_k, thread_n, threads), in priority order,
# for one 16-row m-block and for more
MARLIN_SMALL_CONFIGS = ((128, 128, 256), (64, 128, 128))
MARLIN_LARGE_CONFIGS = ((64, 256, 256), (64, 128, 128))
MARLIN_STAGES = 4
H200_SMEM_OPTIN = 232_448  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def marlin_smem(shape: MoeShape, thread_m_blocks: int, thread_k: int, thread_n: int) -> int:
    """The shared memory a Marlin MoE configuration needs (vLLM's get_kernel_cache_size, no act-order
    and no zero points): pipeline of A and B, the reduction buffer, scales, block metadata."""
    tb_m = 16 * thread_m_blocks
    pack = 32 // shape.num_bits
    b = MARLIN_STAGES * (thread_k * thread_n // pack) * 4
    red = tb_m * (thread_n + 8) * 2
    tmp = max(b, red, min(b, red) + thread_n * 2)
    groups = 1 if shape.group_size < 0 else math.ceil(thread_k / shape.group_size)
    scales = groups * thread_n * 2 * MARLIN_STAGES
    return tmp + MARLIN_STAGES * tb_m * thread_k * 2 + scales + tb_m * 16


def marlin_launch(shape: MoeShape, m: int, sms: int = H200_SMS, loops=None,
                  smem_optin: int = H200_SMEM_OPTIN, small_call_clause: bool = False) -> Launch:
    """vLLM's determine_exec_config for this call: per configuration the blocks per SM that the
    registers (255 K register bytes per SM), the shared memory and the clamp (<= 4 for one
    m-block, <= 2 for more) allow; the configuration with the most blocks wins (the first on a
    tie). grid = SMs x blocks.

    small_call_clause: also lower the blocks when N / thread_n * M * top_k * 4 is below SMs x
    blocks, as vLLM's main-branch source does. Off by default: on the measured H200 run ncu saw
    Marlin at 3 blocks per SM (396 blocks, 76.5 KB = 232,448 / 3 - 1,024 B of shared memory) for
    Qwen3 w13 at M = 1, where that clause gives 2 -- the 0.33.0 build did not lower it."""
    loops = loops or RECORDED_LOOPS
    size = marlin_block_size(shape, m)
    mblocks = max(1, size // 16)
    best = None
    for tk, tn, threads in (MARLIN_LARGE_CONFIGS if mblocks > 1 else MARLIN_SMALL_CONFIGS):
        if shape.size_k % tk or shape.size_n % tn:
            continue
        cache = marlin_smem(shape, mblocks, tk, tn)
        if cache > smem_optin - 512:
            continue
        loop = loops.get(("marlin", shape.num_bits, size if size in (8, 64) else 64, threads, tn, tk))
        if loop is None:
            continue
        allow = min(255 * 1024 // (max(loop.registers, 1) * threads * 4), smem_optin // (cache + 1536))
        allow = max(min(allow, 4 if mblocks == 1 else 2), 1)
        work = shape.size_n // tn * m * shape.top_k * 4
        if small_call_clause and work < sms * allow:
            allow = max(work // sms, 1)
        if best is None or allow > best[0]:
            best = (allow, tk, tn, threads, loop)
    if best is None:
        raise ValueError(f"no recorded Marlin instance for {shape.name} at M = {m}")
    allow, tk, tn, threads, loop = best
    return Launch("marlin", size, tn, tk, threads // 32, allow, sms * allow, loop,
                  f"block size {size}; {threads} threads, thread_k {tk}, thread_n {tn}, {allow} blocks per SM")


def tiles_per_expert(m: int, top_k: int, experts: int, rows: int) -> float:
    """Expected tiles of `rows` rows per expert: E[ceil(c / rows)] for c ~ Binomial(M, top_k / E)
    (the routed rows an expert receives under uniform routing)."""
    p = top_k / experts
    if m * p >= experts * 64:  # far beyond the recorded rows: the mean is enough
        return m * p / rows
    total, pk = 0.0, (1 - p) ** m
    for c in range(m + 1):
        if c:
            pk *= (m - c + 1) / c * p / (1 - p)
        total += pk * math.ceil(c / rows)
        if c > m * p and pk < 1e-15:
            break
    return total


def _stripes(kernel: str, units: int, grid: int, kstages: int, group_units: int) -> list[tuple[int, int]]:
    """[start, end) units of each block that has work: v3 b * units // blocks; Marlin ceil-sized
    stripes, rounded up to whole scale groups of units, trailing blocks idle."""
    if kernel == "v3":
        blocks = min(grid, units)
        return [(b * units // blocks, (b + 1) * units // blocks) for b in range(blocks)]
    iters = math.ceil(units / grid)
    if group_units > 1:
        iters = group_units * math.ceil(iters / group_units)
    return [(b * iters, min(units, (b + 1) * iters)) for b in range(grid) if b * iters < units]


@dataclass(frozen=True)
class CallCounts:
    """What a call does, from its launch and the routing (no machine parameter): the warp-instructions
    and HBM bytes of one unit, the SM's warps, and per block its units and dependent round trips
    (only the blocks that can be the slowest for some parameters are kept)."""
    launch: Launch
    units: int
    unit_instructions: float
    unit_bytes: float
    resident: int
    warps_per_sm: int
    blocks: tuple[tuple[int, int], ...]  # (units, round trips)
    hbm_bytes: float
    max_parts: int = 1  # the most blocks that share one output tile (1: no tile is cut)


def call_counts(kernel: str, shape: MoeShape, m: int, sms: int = H200_SMS, loops=None) -> CallCounts:
    launch = v3_launch(shape, m, sms, loops) if kernel == "v3" else marlin_launch(shape, m, sms, loops)
    kstages = shape.size_k // launch.unit_k
    ntiles = math.ceil(shape.size_n / launch.tile_n)
    mtiles = max(1, round(shape.experts * tiles_per_expert(m, shape.top_k, shape.experts, launch.tile_m)))
    units = mtiles * ntiles * kstages
    group_units = 1 if shape.group_size < 0 else max(1, shape.group_size // launch.unit_k)
    stripes = _stripes(kernel, units, launch.grid, kstages, group_units)
    # which blocks share each tile, in order
    parts: dict[int, int] = {}
    for s, e in stripes:
        for t in range(s // kstages, (e - 1) // kstages + 1):
            parts[t] = parts.get(t, 0) + 1
    blocks = set()
    for s, e in stripes:
        touched = range(s // kstages, (e - 1) // kstages + 1)
        cut = [parts[t] for t in touched if parts[t] > 1]
        if kernel == "v3":
            # the tile prefix's read of the offsets; per tile its expert offsets then sorted ids
            # (the prologue's weight fill overlaps them); per cut tile the publish (release, then the
            # counting atomic); the consumer, in turn for every other part: acquires its flag,
            # resets it (a release), reads the part back (a dependent load per part); and its own
            # part once
            trips = 1 + 2 * len(touched) + 2 * len(cut) + (3 * (max(cut) - 1) + 1 if cut else 0)
        else:
            # per slice the moe block's sorted ids, then the pipeline fill; the serial slice
            # reduction: each earlier slice of the tile acquires the lock, reads the running sum,
            # and releases (fence + add) before the next may start
            trips = 2 * len(touched) + (3 * (max(cut) - 1) if cut else 0)
        blocks.add((e - s, trips))
    # keep the Pareto front: a block with fewer units and fewer round trips than another is never
    # the slowest
    front = tuple(sorted(b for b in blocks if not any(o != b and o[0] >= b[0] and o[1] >= b[1] for o in blocks)))
    loop = launch.loop
    chunks_per_unit = launch.unit_k * launch.tile_n * shape.num_bits // 8 // 16
    group_rows = shape.size_k if shape.group_size < 0 else shape.group_size
    # the block's warps split a unit's chunks between them; a scale group's first stage adds the
    # group extra to every warp
    instr = chunks_per_unit * loop.per_chunk + launch.warps * loop.group_extra * launch.unit_k / group_rows
    experts = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** m)
    hbm = experts * shape.expert_bytes
    active = len(stripes)
    resident = min(launch.blocks_per_sm, math.ceil(active / sms))
    return CallCounts(launch, units, instr, hbm / units, resident, resident * launch.warps, front, hbm,
                      max(parts.values(), default=1))


@dataclass(frozen=True)
class FittedParams:
    fixed_s: float
    round_trip_s: float
    issue_cap: float  # warp-instructions per SM and clock, at most
    warp_ipc: float  # warp-instructions per clock one resident warp adds
    hbm_share: float  # of the HBM peak, for the weight stream

    NAMES = ("fixed_s", "round_trip_s", "issue_cap", "warp_ipc", "hbm_share")


def model_time_s(counts: CallCounts, p: FittedParams, sms: int = H200_SMS, hbm: float = H200_HBM,
                 clock: float = SASS_CLOCK_HZ) -> float:
    """The modelled call: the slowest block's units at its SM's rate plus its round trips."""
    rate = min(p.issue_cap, counts.warps_per_sm * p.warp_ipc)
    issue = counts.unit_instructions / rate / clock
    memory = counts.unit_bytes / (p.hbm_share * hbm / sms)
    per_unit = counts.resident * max(issue, memory)
    return p.fixed_s + max(u * per_unit + trips * p.round_trip_s for u, trips in counts.blocks)


def _nelder_mead(f, x0: list[float], step: float = 0.3, iters: int = 4000) -> list[float]:
    n = len(x0)
    pts = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        r = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(r)
        if fr < vals[0]:
            e = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(e)
            pts[-1], vals[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = r, fr
        else:
            k = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fk = f(k)
            if fk < vals[-1]:
                pts[-1], vals[-1] = k, fk
            else:
                for i in range(1, n + 1):
                    pts[i] = [pts[0][j] + 0.5 * (pts[i][j] - pts[0][j]) for j in range(n)]
                    vals[i] = f(pts[i])
    return pts[min(range(n + 1), key=vals.__getitem__)]


# starting point of the fit: round figures of the right order (a launch, a loaded memory latency,
# half the issue slots, a fifth of a slot per warp, 80 % of the HBM peak)
FIT_START = FittedParams(2e-6, 1e-6, 2.0, 0.2, 0.8)


def measured_points(rows=MEASURED_H200) -> list[tuple[str, str, int, float]]:
    """(kernel, shape key, M, measured µs) of every recorded row, Marlin's and v3's."""
    return [(k, r.shape, r.m, us) for r in rows for k, us in (("marlin", r.marlin_us), ("v3", r.v3_us))]


def fit(points=None) -> FittedParams:
    """The five parameters that minimise the squared log error over `points` (default: every
    recorded row of both kernels)."""
    points = points if points is not None else measured_points()
    counted = [(call_counts(k, H200_SHAPES[s], m), us * 1e-6) for k, s, m, us in points]

    def loss(x):
        p = FittedParams(*(math.exp(v) for v in x))
        return sum(math.log(model_time_s(c, p) / t) ** 2 for c, t in counted)

    best = _nelder_mead(loss, [math.log(getattr(FIT_START, n)) for n in FittedParams.NAMES])
    best = _nelder_mead(loss, best, step=0.05)  # restart: Nelder-Mead stalls on the first simplex
    return FittedParams(*(math.exp(v) for v in best))


_FITTED: list[FittedParams] = []


def fitted_params() -> FittedParams:
    """The fit on every recorded row (computed once per process)."""
    if not _FITTED:
        _FITTED.append(fit())
    return _FITTED[0]


def model_us(kernel: str, shape: MoeShape | str, m: int, params: FittedParams | None = None) -> float:
    """The fitted model's time of one call, µs (kernel "v3" or "marlin")."""
    shape = H200_SHAPES[shape] if isinstance(shape, str) else shape
    return model_time_s(call_counts(kernel, shape, m), params or fitted_params()) * 1e6


def measured_over_model(kernel: str, shape: MoeShape | str, m: int, measured_us: float,
                        params: FittedParams | None = None) -> float:
    """measured / model for a fresh measurement of `kernel` on `shape` at M tokens (1.0: as
    modelled; > 1: slower than the model expects)."""
    return measured_us / model_us(kernel, shape, m, params)


@dataclass
class RowCheck:
    kernel: str
    shape: str
    m: int
    measured_us: float
    model_us: float
    loo_us: float  # the row predicted by a fit without it

    @property
    def ratio(self) -> float:
        return self.measured_us / self.model_us

    @property
    def loo_ratio(self) -> float:
        return self.measured_us / self.loo_us


def check_rows(with_leave_one_out: bool = True) -> list[RowCheck]:
    """Every recorded row: measured, the full fit's model, and (optionally) the leave-one-out
    prediction."""
    points = measured_points()
    full = fitted_params()
    out = []
    for i, (k, s, m, us) in enumerate(points):
        loo = fit(points[:i] + points[i + 1:]) if with_leave_one_out else full
        out.append(RowCheck(k, s, m, us, model_us(k, s, m, full), model_us(k, s, m, loo)))
    return out


# The rows the fitted model does not predict within +-25 %, and why (checked both ways by
# tests/test_roofline.py: these miss, every other row lands).
UNPREDICTED = {
    ("marlin", "deepseek-w13-tp8", 1):
        "M = 1 with K 7168: Marlin's stripes cut each output tile into 12 slices whose serial "
        "reduction the model charges 3 round trips a link at the one fitted latency; Marlin's M = 1 "
        "rows imply 0.23 us a link (m1_step_costs), a sixth of its 1.29",
    ("v3", "qwen3-w2", 1):
        "M = 1: v3's M = 1 rows imply 1.38 us for each part its consumer gathers (m1_step_costs), 0.46 us "
        "per counted dependent operation against Marlin's 0.08; the one fitted latency sits between "
        "and leaves v3's M = 1 rows short",
}
FIT_TOLERANCE = 0.25


# ----------------------------------------------------------------------------------------------
# What the M = 1 rows say about one step of each kernel's cross-block reduction.
#
# At M = 1 the call is a few units of streaming plus the reduction of the cut tiles. Take each
# kernel's M = 1 rows, subtract the streaming of the slowest block (its units at the fitted rate)
# and fit what is left as intercept + slope x steps, a step being one link of Marlin's serial slice
# chain (slices - 1 on the longest chain) or one part that v3's consumer gathers (the parts of its
# tile). Dividing the slope by the dependent cross-block memory operations that one step holds in
# the code gives the latency each kernel's rows imply for one such operation -- a property of the
# machine, the same for both kernels if the counts are complete.
#
# Dependent operations per step, from the sources and the sm_90 SASS (kernel_static.py's
# compilation; Marlin's from vLLM 0.33.0's PTX):
# * Marlin, one link of the lock chain (use_atomic_add off, fp32 reduce: what vLLM 0.33.0's fused
#   Marlin MoE and vllm_marlin.call_args pass): the waiting block's poll (LDG.E.STRONG.GPU + CCTL.IVALL) sees the release, its active
#   threads read the running fp32 sum from C_tmp, write it back, and the release fences (MEMBAR.ALL.GPU,
#   ERRBAR, CGAERRBAR) before the counting RED: 3.
# * v3, one part at the tile's consumer: thread 0 acquires the part's ready flag (LDG.E.STRONG.GPU +
#   CCTL.IVALL), resets it with a release store (MEMBAR.ALL.GPU, ERRBAR, CGAERRBAR, STG.E.STRONG.GPU:
#   each waits for the previous store), and the tile's lanes read the part back (eight LDG.E; the
#   loop over parts is unrolled by 4, but each part's FADDs follow its loads before the next part's
#   slot is computed: one round trip per part): 3. The 64-bit divisions that find a part's slot
#   (one in each of the three loops) take their 32-bit path at these sizes (~20 instructions with
#   I2F, MUFU.RCP and F2I, no call).
SYNC_OPS_PER_STEP = {"marlin": 3.0, "v3": 3.0}


@dataclass(frozen=True)
class StepCost:
    kernel: str
    intercept_us: float
    slope_us: float  # per step
    points: tuple[tuple[str, int, float], ...]  # (shape, steps, measured less streaming µs)

    @property
    def per_operation_us(self) -> float:
        """The latency the rows imply for one dependent cross-block memory operation."""
        return self.slope_us / SYNC_OPS_PER_STEP[self.kernel]


def m1_step_costs(params: FittedParams | None = None, rows=MEASURED_H200) -> list[StepCost]:
    """Per kernel, the least-squares line through its M = 1 rows of (reduction steps, measured
    time less the slowest block's streaming at the fitted rate)."""
    p = params or fitted_params()
    out = []
    for kernel in ("marlin", "v3"):
        pts = []
        for r in rows:
            if r.m != 1:
                continue
            c = call_counts(kernel, H200_SHAPES[r.shape], r.m)
            rate = min(p.issue_cap, c.warps_per_sm * p.warp_ipc)
            per_unit = c.resident * max(c.unit_instructions / rate / SASS_CLOCK_HZ,
                                        c.unit_bytes / (p.hbm_share * H200_HBM / H200_SMS))
            units = max(u for u, _ in c.blocks)
            steps = c.max_parts - 1 if kernel == "marlin" else c.max_parts
            measured = r.marlin_us if kernel == "marlin" else r.v3_us
            pts.append((r.shape, steps, measured - units * per_unit * 1e6))
        n = len(pts)
        sx, sy = sum(x for _, x, _ in pts), sum(y for _, _, y in pts)
        sxx, sxy = sum(x * x for _, x, _ in pts), sum(x * y for _, x, y in pts)
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        out.append(StepCost(kernel, (sy - slope * sx) / n, slope, tuple(pts)))
    return out


def render_step_costs(costs: list[StepCost]) -> str:
    out = ["\nM = 1: measured less the slowest block's streaming, against the reduction's steps "
           "(Marlin: links of the slice chain; v3: parts at the consumer):",
           "| kernel | (shape, steps, µs) | intercept µs | µs per step | dependent operations per step | "
           "implied µs per operation |", "|---|---|---:|---:|---:|---:|"]
    for c in costs:
        pts = "; ".join(f"{s} {x}, {y:.1f}" for s, x, y in c.points)
        out.append(f"| {c.kernel} | {pts} | {c.intercept_us:.1f} | {c.slope_us:.2f} | "
                   f"{SYNC_OPS_PER_STEP[c.kernel]:g} | {c.per_operation_us:.3f} |")
    return "\n".join(out)


def render_fitted(rows: list[RowCheck], params: FittedParams) -> str:
    out = ["| kernel | shape | M | measured µs | model µs | measured / model | left-one-out model µs | "
           "measured / left-one-out |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        flag = "" if abs(r.ratio - 1) <= FIT_TOLERANCE else " (outside ±25 %)"
        out.append(f"| {r.kernel} | {r.shape} | {r.m} | {r.measured_us:.1f} | {r.model_us:.1f} | "
                   f"{r.ratio:.2f}{flag} | {r.loo_us:.1f} | {r.loo_ratio:.2f} |")
    out.append(f"\nfitted on {len(rows)} rows, {len(FittedParams.NAMES)} parameters: fixed "
               f"{params.fixed_s * 1e6:.2f} µs, round trip {params.round_trip_s * 1e6:.2f} µs, issue cap "
               f"{params.issue_cap:.2f} warp-instructions / SM / clock, {params.warp_ipc:.3f} per resident warp, "
               f"weight stream at {100 * params.hbm_share:.0f} % of {H200_HBM / 1e12:.1f} TB/s")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
