"""Static issue model of the CUDA Marlin repack kernel (kernels/repack.cu), without a GPU.

    python bench/repack_static.py [--cubin FILE] [--json FILE]

A model counted from the SASS, not a measurement. For each instance of the repack kernels it
counts, in the innermost loops that move global memory (a loop is the code between a backward
branch and its target, as bench/kernel_static.py reads it):

* instructions per loop pass and the global bytes the pass stores (each STG by its width:
  .128 = 16 bytes, .64 = 8, .U16 / .S16 = 2, .U8 / .S8 = 1, otherwise 4). A repack reads as many
  bytes as it writes, so a pass's traffic is twice what it stores; loads are not counted
  because the act-order gather loads a source word once per code it takes (from cache after
  the first);
* thread instructions per byte of traffic = the loops' instructions over their traffic, summed
  over the loops of one path (the staged kernel runs a staging loop and an emitting loop once
  per word each, the tile kernels one loop per tile lane). In the staged kernel a loop that
  reads shared memory and global memory is the act-order row gather (its source rows come from
  the staged perm) and is left out: its figure is of the path without act-order; the tile
  kernel has one instance per path (GATHER = act-order);
* the set-up: the instructions before the first counted loop, once per thread for a
  grid-stride kernel; "one pass per thread" adds it to a single pass (the worst case, a grid with
  one pass per thread; both division branches are counted, so it is an upper bound);
* the bandwidth that issue rate allows: an H200 has 132 SMs, 4 warp schedulers per SM, each
  issuing one warp instruction (32 thread instructions) per clock at about 1.98 GHz, so
  3.34e13 thread instructions per second when every issue slot is used; the cap is that over
  the instructions per byte, against the 4.8 TB/s HBM peak. The model ignores latency, the
  memory system and dual issue: it says how far the instruction count alone lets the kernel go.

The source is compiled for sm_90 (`nvcc -cubin -arch=sm_90 -O3 -std=c++17 -I kernels
kernels/repack.cu`) unless --cubin names one (an older build, to compare). Without nvcc or
cuobjdump one line says so and the script exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_static import _opcode, find_cuobjdump, sass_functions, sass_loops  # noqa: E402 - after the sys.path set-up above
from roofline import GPUS, Gpu  # noqa: E402 - after the sys.path set-up above


WARP = 32
H200 = GPUS["h200"]  # 132 SMs, 4 schedulers per SM, 1.98 GHz, 4.8 TB/s HBM (bench/roofline.py's)


def thread_instructions_per_s(gpu: Gpu = H200) -> float:
    """Thread instructions per second with every issue slot used: each scheduler issues one warp
    instruction per clock."""
    return gpu.sms * gpu.schedulers * WARP * gpu.clock_hz


@dataclass
class LoopTraffic:
    start: int          # instruction index of the loop's first and last instruction
    end: int
    instructions: int
    global_bytes: int   # traffic per pass: twice the bytes stored (read + written)
    gather: bool        # reads shared and global memory: the act-order row gather


@dataclass
class RepackModel:
    kernel: str
    loops: list[LoopTraffic] = field(default_factory=list)
    setup_instructions: int = 0
    per_byte: float = 0.0               # counted loops only
    per_byte_one_pass: float = 0.0      # set-up + one pass of each counted loop
    cap_bytes_per_s: float = 0.0
    cap_pct_of_peak: float = 0.0
    cap_one_pass_bytes_per_s: float = 0.0


def global_bytes(opcode: str) -> int:
    """Bytes one thread moves with a global load or store; 0 for anything else."""
    base = opcode.split(".")[0]
    if base not in ("LDG", "STG"):
        return 0
    mods = opcode.split(".")[1:]
    for mod, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if mod in mods:
            return size
    return 4


def memory_loops(ins: list[tuple[int, str]]) -> list[LoopTraffic]:
    """The innermost loops that move global memory (no other such loop inside them)."""
    ops = [_opcode(t) for _, t in ins]
    found = []
    for lo, hi in sass_loops(ins):
        body = ops[lo:hi + 1]
        if any(global_bytes(op) for op in body):
            stored = sum(global_bytes(op) for op in body if op.startswith("STG"))
            gather = any(op.startswith("LDS") for op in body) and any(op.startswith("LDG") for op in body)
            found.append(LoopTraffic(lo, hi, len(body), 2 * stored, gather))
    return [a for a in found
            if not any(b is not a and a.start <= b.start and b.end <= a.end for b in found)]


def model(kernel: str, ins: list[tuple[int, str]], gpu: Gpu = H200) -> RepackModel:
    m = RepackModel(kernel, memory_loops(ins))
    counted = [lp for lp in m.loops if not lp.gather]
    if not counted:
        return m
    instructions = sum(lp.instructions for lp in counted)
    moved = sum(lp.global_bytes for lp in counted)
    m.setup_instructions = min(lp.start for lp in counted)
    m.per_byte = instructions / moved
    m.per_byte_one_pass = (instructions + m.setup_instructions) / moved
    m.cap_bytes_per_s = bandwidth_cap(m.per_byte, gpu)
    m.cap_pct_of_peak = 100.0 * m.cap_bytes_per_s / gpu.hbm_bytes_per_s
    m.cap_one_pass_bytes_per_s = bandwidth_cap(m.per_byte_one_pass, gpu)
    return m


def bandwidth_cap(instructions_per_byte: float, gpu: Gpu = H200) -> float:
    """Bytes per second of traffic when issue is the only limit."""
    return thread_instructions_per_s(gpu) / instructions_per_byte


def is_repack_kernel(mangled: str) -> bool:
    return "marlin_repack" in mangled


def readable(mangled: str) -> str:
    m = re.search(r"(marlin_repack\w*?kernel)ILi(\d)E(Lb([01])E)?", mangled)
    if not m:
        return mangled
    return f"{m.group(1)}<{m.group(2)}{', gather' if m.group(4) == '1' else ''}>"


def compile_cubin(out: Path) -> Path:
    from wna16ctl.native.ops import find_nvcc, kernels_dir
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    cubin = out / "repack-sm90.cubin"
    cmd = [nvcc, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-I", str(kernels_dir()),
           str(kernels_dir() / "repack.cu"), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return cubin


def measure(cubin: Path | None) -> list[RepackModel]:
    cuobjdump, env = find_cuobjdump()
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump / nvdisasm not found")
    with tempfile.TemporaryDirectory(prefix="repack-static-") as tmp:
        path = cubin or compile_cubin(Path(tmp))
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env,
                              check=True).stdout
    return [model(readable(name), ins) for name, ins in sass_functions(sass).items() if is_repack_kernel(name)]


def render(models: list[RepackModel], gpu: Gpu = H200) -> str:
    lines = [f"static issue model, {gpu.name}: {gpu.sms} SMs x {gpu.schedulers} schedulers x "
             f"{WARP} lanes x {gpu.clock_hz / 1e9:.2f} GHz = {thread_instructions_per_s(gpu):.3g} "
             f"thread instructions/s; HBM peak {gpu.hbm_bytes_per_s / 1e12:.1f} TB/s",
             "kernel | loops (instructions / traffic bytes per pass; g = act-order gather, not counted) | "
             "per byte | cap | % of peak | set-up | one pass per thread: per byte, cap"]
    for m in sorted(models, key=lambda x: x.kernel):
        loops = ", ".join(f"{lp.instructions}/{lp.global_bytes}{' g' if lp.gather else ''}" for lp in m.loops)
        if not m.per_byte:
            lines.append(f"{m.kernel} | {loops} | - | - | - | - | -")
            continue
        lines.append(f"{m.kernel} | {loops} | {m.per_byte:.2f} | {m.cap_bytes_per_s / 1e12:.1f} TB/s | "
                     f"{m.cap_pct_of_peak:.0f} % | {m.setup_instructions} | {m.per_byte_one_pass:.2f}, "
                     f"{m.cap_one_pass_bytes_per_s / 1e12:.1f} TB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cubin", type=Path, help="count this cubin instead of compiling kernels/repack.cu")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    try:
        models = measure(args.cubin)
    except FileNotFoundError as exc:
        print(f"repack_static: skipped: {exc}")
        return 0
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"repack_static: {exc}", file=sys.stderr)
        return 2
    print(render(models))
    if args.json:
        args.json.write_text(json.dumps({"gpu": asdict(H200), "thread_instructions_per_s": thread_instructions_per_s(), "kernels": [asdict(m) for m in models]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
