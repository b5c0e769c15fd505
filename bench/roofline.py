"""A roofline model of the fast MoE GEMMs (kernels/moe_gemm_v2.cu, moe_gemm_v3.cu) on H100 / H200.

    python bench/roofline.py [--static FILE.json] [--gpu h200 --gpu h100] [--json FILE]

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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
