"""Static performance evidence for the MoE GEMM kernels, without a GPU.

    python bench/kernel_static.py [--arch 90 --arch 80] [--json FILE]

For the simple reference kernel (kernels/moe_gemm.cu) and the fast ones (kernels/moe_gemm_v2.cu,
kernels/moe_gemm_v3.cu), per kernel instance and architecture:

* registers, spill stores / loads, stack frame and static shared memory, from `ptxas -v`
  (the v2 / v3 kernels' dynamic shared memory comes from their plans in kernels/moe_gemm_v2.cuh
  and kernels/moe_gemm_v3.cuh -- v3's for 64 experts, its tile prefix grows with E; v1's is
  dynamic too, sizeof its MoeTile::Shared, and not read here);
* instructions per weight code in the loop that turns weight codes into mma operands, counted
  in the SASS (`cuobjdump --dump-sass`):
    - v2: the innermost loop holding the mma instructions (the streaming K loop). Its whole body
      counts once per iteration -- copies, barrier, dequantisation, mma -- and one iteration
      covers 32 * NT codes per thread (one 16-row k-tile of NT 64-column n-tiles);
    - v3: the same loop; its warps split the block's columns in two, so one iteration covers
      16 * NT codes per thread (one k-tile of half the block's columns); and what a scale
      group's first stage adds to it ("group extra": the enclosing loop less the streaming loop
      and one iteration of it -- the scale-pair refill and the group's bookkeeping);
    - v1: the innermost loop holding the 16-bit shared stores of decoded weights (the decode
      loop). One iteration decodes one word, 32 / num_bits codes; its mma loop is extra.
  Without cuobjdump the same loops are counted in the PTX (`nvcc -ptx`) instead.

cuobjdump (and the nvdisasm it runs) are not part of every CUDA install;
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` provides both (this script also looks in
the wheels' nvidia/cu*/bin). Without nvcc nothing can be measured: one line says so and the
script exits 0.
"""

from __future__ import annotations

import argparse
import os
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # roofline: the shapes, launch choices and loop records

from wna16ctl.native.ops import find_cxx, find_nvcc, kernels_dir  # noqa: E402 - after the sys.path set-up above

SOURCES = {"v1": "moe_gemm.cu", "v2": "moe_gemm_v2.cu", "v3": "moe_gemm_v3.cu"}
V3_PLAN_EXPERTS = 64  # the experts v3's dynamic shared memory is reported for (bench shape)
TARGET_SASS_PER_4BIT_CODE = 4.0


@dataclass
class KernelFigures:
    kernel: str        # v1 / v2 / v3
    arch: str
    name: str          # readable instance name
    mangled: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem_static: int = 0
    smem_dynamic: int = 0
    num_bits: int = 0
    loop_instructions: int = 0
    loop_mma: int = 0
    codes_per_iteration: int = 0
    per_code: float = 0.0
    per_code_without_mma: float = 0.0
    # v3: what a scale group's first stage issues on top of a streaming iteration (the scale-pair
    # refill, the group's bookkeeping): the loop around the streaming loop, less the streaming
    # loop, less one iteration of it (that stage's own copies, dequantisation and mma)
    group_sass: int = 0
    counted_in: str = ""  # "sass" / "ptx" / ""
    notes: list[str] = field(default_factory=list)


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    nvcc = find_nvcc()
    if nvcc and (Path(nvcc).parent / name).is_file():
        return str(Path(nvcc).parent / name)
    for d in filter(None, [os.environ.get("WNA16CTL_CUDA_BIN")]):  # a directory holding the tools
        if (Path(d) / name).is_file():
            return str(Path(d) / name)
    site = Path(sysconfig.get_paths()["purelib"])
    # the nvidia-cuda-* wheels, or the copies a triton wheel carries
    for cand in (sorted((site / "nvidia").glob(f"cu*/bin/{name}")) + sorted((site / "nvidia").glob(f"cuda_{name}/bin/{name}"))
                 + sorted(site.glob(f"triton/backends/nvidia/bin/{name}"))):
        return str(cand)
    return None


def find_cuobjdump() -> tuple[str | None, dict[str, str]]:
    """cuobjdump and the environment that lets it find nvdisasm, or None."""
    cuobjdump, nvdisasm = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        return None, {}
    return cuobjdump, {"NVDISASM_PATH": str(Path(nvdisasm).parent),
                       "PATH": f"{Path(nvdisasm).parent}:{os.environ.get('PATH', '')}"}


# ----------------------------------------------------------------------------------------------
# names


def describe(kernel: str, mangled: str) -> tuple[str, int, int]:
    """(readable name, num_bits, NT) of a kernel instance from its mangled name."""
    if kernel == "v3":
        m = re.search(r"moe_gemm_v3_kernelILi(\d)ELi(\d)ELi(\d)ELi(\d)ELb([01])E", mangled)
        if not m:
            return mangled, 0, 0
        dt, nb, mt, nt, zp = (int(x) for x in m.groups())
        return f"{'bf16' if dt else 'fp16'} {nb}-bit {16 * mt}x{64 * nt} fast{' zp' if zp else ''}", nb, nt
    if kernel == "v2":
        m = re.search(r"moe_gemm_v2_kernelILi(\d)ELi(\d)ELi(\d)ELi(\d)ELi(\d)E", mangled)
        if not m:
            return mangled, 0, 0
        dt, nb, mt, nt, mode = (int(x) for x in m.groups())
        modes = {0: "fast", 1: "general", 2: "g_idx"}
        name = f"{'bf16' if dt else 'fp16'} {nb}-bit {16 * mt}x{64 * nt} {modes.get(mode, mode)}"
        return name, nb, nt
    # the activation type is __half / __nv_bfloat16 or a tag type (F16 / BF16) in the name
    m = re.search(r"moe_wna16_kernelI(.*?)Li(\d)ELi(\d+)ELb([01])E", mangled)
    if not m:
        return mangled, 0, 0
    t, nb, bm, mma = m.groups()
    bf16 = "bfloat" in t or "BF16" in t
    return f"{'bf16' if bf16 else 'fp16'} {nb}-bit {bm}x128 {'mma' if mma == '1' else 'fma'}", int(nb), 2


def is_gemm(kernel: str, mangled: str) -> bool:
    if kernel in ("v2", "v3"):
        return f"moe_gemm_{kernel}_kernel" in mangled
    return "moe_wna16_kernel" in mangled


# ----------------------------------------------------------------------------------------------
# compiling


def compile_cubin(nvcc: str, kernel: str, arch: str, out: Path) -> tuple[Path, str]:
    src = kernels_dir() / SOURCES[kernel]
    cubin = out / f"{kernel}-sm{arch}.cubin"
    cmd = [nvcc, "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-Xptxas", "-v", "-I", str(kernels_dir()),
           str(src), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return cubin, proc.stdout + proc.stderr


def compile_ptx(nvcc: str, kernel: str, arch: str, out: Path) -> str:
    src = kernels_dir() / SOURCES[kernel]
    ptx = out / f"{kernel}-sm{arch}.ptx"
    subprocess.run([nvcc, "-ptx", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-I", str(kernels_dir()), str(src),
                    "-o", str(ptx)], check=True, capture_output=True)
    return ptx.read_text()


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per function: registers, spill stores/loads, stack, static smem."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            current = m.group(1)
            out.setdefault(current, {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            out[current]["smem"] = int(sm.group(1)) if sm else 0
    return out


def dynamic_smem(out: Path) -> dict[tuple[int, int, int, int], int]:
    """The v2 plan's shared-memory bytes per (num_bits, MT, NT, per_row), from the header."""
    cxx = find_cxx()
    if not cxx:
        return {}
    prog = out / "plan.cpp"
    variants = [(nb, mt, nt, pr) for nb in (4, 8) for mt, nt, pr in ((1, 4, 0), (2, 2, 0), (4, 1, 0), (1, 2, 0),
                                                                      (1, 2, 1))]
    lines = [f'  std::printf("{nb} {mt} {nt} {pr} %d\\n", wna16v2::Plan<{nb}, {mt}, {nt}, {"true" if pr else "false"}>::SMEM);'
             for nb, mt, nt, pr in variants]
    prog.write_text('#include <cstdio>\n#include "moe_gemm_v2.cuh"\nint main() {\n' + "\n".join(lines) + "\n}\n")
    exe = out / "plan"
    subprocess.run([cxx, "-std=c++17", "-I", str(kernels_dir()), str(prog), "-o", str(exe)], check=True)
    sizes = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        nb, mt, nt, pr, size = (int(x) for x in line.split())
        sizes[(nb, mt, nt, pr)] = size
    return sizes


def dynamic_smem_v3(out: Path, experts: int = V3_PLAN_EXPERTS) -> dict[tuple[int, int, int], int]:
    """The v3 plan's shared-memory bytes per (num_bits, MT, NT) for `experts` experts."""
    cxx = find_cxx()
    if not cxx:
        return {}
    prog = out / "plan3.cpp"
    variants = [(nb, mt, nt) for nb in (4, 8) for mt, nt in ((1, 4), (2, 2), (4, 1))]
    lines = [f'  std::printf("{nb} {mt} {nt} %lld\\n", wna16v3::smem_bytes<{nb}, {mt}, {nt}>({experts}));'
             for nb, mt, nt in variants]
    prog.write_text('#include <cstdio>\n#include "moe_gemm_v3.cuh"\nint main() {\n' + "\n".join(lines) + "\n}\n")
    exe = out / "plan3"
    subprocess.run([cxx, "-std=c++17", "-I", str(kernels_dir()), str(prog), "-o", str(exe)], check=True)
    sizes = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        nb, mt, nt, size = (int(x) for x in line.split())
        sizes[(nb, mt, nt)] = size
    return sizes


# ----------------------------------------------------------------------------------------------
# loops


_SASS_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")


def sass_functions(text: str) -> dict[str, list[tuple[int, str]]]:
    funcs = {}
    for chunk in re.split(r"\n\s*Function : ", text)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        funcs[name] = [(int(a, 16), b.strip()) for a, b in _SASS_INS.findall(chunk)]
    return funcs


def _opcode(ins: str) -> str:
    parts = ins.split()
    if not parts:
        return ""
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def sass_loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """[start, end] instruction index ranges of loops (a branch back to an earlier address)."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (addr, text) in enumerate(ins):
        if _opcode(text).startswith("BRA"):
            m = re.search(r"(0x[0-9a-f]+)", text.split("BRA", 1)[1])
            if m:
                target = int(m.group(1), 16)
                if target <= addr and target in index:
                    loops.append((index[target], i))
    return loops


def innermost_loop(ops: list[str], loops: list[tuple[int, int]], marker) -> tuple[int, int] | None:
    """The smallest loop whose body holds an instruction that `marker(opcode)` accepts."""
    best = None
    for lo, hi in loops:
        if any(marker(op) for op in ops[lo:hi + 1]) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    return best


def count_sass(kernel: str, ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    """(instructions, mma instructions) of the kernel's main loop body."""
    ops = [_opcode(t) for _, t in ins]
    if kernel in ("v2", "v3"):
        loop = innermost_loop(ops, sass_loops(ins), lambda op: op.startswith("HMMA"))
    else:
        loop = innermost_loop(ops, sass_loops(ins), lambda op: op.startswith("STS.U16"))
    if loop is None:
        return None
    body = ops[loop[0]:loop[1] + 1]
    return len(body), sum(op.startswith("HMMA") for op in body)


def group_sass(ins: list[tuple[int, str]]) -> int:
    """v3: the instructions of the smallest loop that encloses the streaming loop (one scale
    group's run of stages), less the streaming loop's, less one more streaming iteration (the
    group's first stage, peeled before the streaming loop). 0 without such a loop."""
    ops = [_opcode(t) for _, t in ins]
    loops = sass_loops(ins)
    inner = innermost_loop(ops, loops, lambda op: op.startswith("HMMA"))
    if inner is None:
        return 0
    outer = [(lo, hi) for lo, hi in loops if lo <= inner[0] and inner[1] <= hi and (lo, hi) != inner]
    if not outer:
        return 0
    lo, hi = min(outer, key=lambda l: l[1] - l[0])
    n_inner = inner[1] - inner[0] + 1
    return max(0, (hi - lo + 1) - 2 * n_inner)


# ----------------------------------------------------------------------------------------------
# the streaming path of a loop, and its instructions by class

# instruction classes of the per-chunk table, in the order they are printed; the first class
# whose opcode prefixes match names an instruction, the rest is "other" (moves, predicates,
# float arithmetic outside the dequantisation, special registers)
SASS_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("global (LDG/LDGSTS/STG/RED/ATOM)", ("LDGSTS", "LDG", "STG", "RED", "ATOM")),
    ("shared (LDS/LDSM/STS)", ("LDSM", "LDS", "STS")),
    ("mma (HMMA)", ("HMMA",)),
    ("dequant (LOP3/PRMT/SHF/I2F/F2F/HFMA2/HADD2/HMUL2)", ("LOP3", "PRMT", "SHF", "I2F", "F2F", "HFMA2",
                                                           "HADD2", "HMUL2")),
    ("address (IMAD/IADD3/LEA/ISETP/SEL)", ("IMAD", "IADD3", "LEA", "ISETP", "SEL", "IABS", "IMNMX", "SHL")),
    ("barrier (BAR/DEPBAR)", ("BAR", "DEPBAR", "LDGDEPBAR", "MEMBAR", "WARPSYNC")),
    ("branch (BRA/BSSY/BSYNC)", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "JMP", "BRX")),
)
OTHER_CLASS = "other"
CLASS_KEYS = {name: name.split(" ", 1)[0] for name, _ in SASS_CLASSES} | {OTHER_CLASS: OTHER_CLASS}


def sass_class(opcode: str) -> str:
    """The class of one SASS opcode (`LDGSTS.E.BYPASS.128` -> global); the first match wins, so
    LDGDEPBAR is a barrier only because no global prefix matches it ("LDG" does: checked first)."""
    if opcode.startswith(("LDGDEPBAR", "DEPBAR")):
        return "barrier (BAR/DEPBAR)"
    for name, prefixes in SASS_CLASSES:
        if opcode.startswith(prefixes):
            return name
    return OTHER_CLASS


def _branch(text: str) -> tuple[int | None, bool]:
    """(target address, conditional) of a BRA; (None, False) for anything else. `@PT` always
    branches, `@!PT` never; any other guard makes it conditional."""
    parts = text.split()
    if _opcode(text) != "BRA" and not _opcode(text).startswith("BRA."):
        return None, False
    guard = parts[0] if parts[0].startswith("@") else ""
    if guard == "@!PT":
        return None, False
    m = re.findall(r"0x[0-9a-f]+", text)
    return (int(m[-1], 16) if m else None), guard not in ("", "@PT")


def streaming_path(ins: list[tuple[int, str]], loop: tuple[int, int]) -> list[int]:
    """Indices of the instructions one iteration of `loop` executes when it streams: the
    shortest way (in instructions) through the loop's control flow from its head back to its
    back branch that passes every basic block holding an HMMA, and every block holding a weight
    copy (LDGSTS / LDG) laid out before the last HMMA. Branches that leave the streaming -- the end
    of a slice or tile, its reduction and output -- are not taken; a copy or scale load behind a
    per-stage condition is counted as taken (an upper bound). Falls back to the whole body when
    the blocks cannot be chained."""
    lo, hi = loop
    index = {a: i for i, (a, _) in enumerate(ins)}
    ops = [_opcode(t) for _, t in ins]
    leaders = {lo}
    for i in range(lo, hi + 1):
        target, _ = _branch(ins[i][1])
        if target is not None and target in index and lo <= index[target] <= hi:
            leaders.add(index[target])
        if ops[i].startswith(("BRA", "EXIT", "RET", "BRX", "JMP")) and i + 1 <= hi:
            leaders.add(i + 1)
    starts = sorted(leaders)
    blocks = [(s, (starts[k + 1] - 1) if k + 1 < len(starts) else hi) for k, s in enumerate(starts)]
    block_of = {s: k for k, (s, _) in enumerate(blocks)}
    succ: list[list[int]] = []
    for s, e in blocks:
        nxt: list[int] = []
        target, cond = _branch(ins[e][1])
        op = ops[e]
        falls = not op.startswith(("BRA", "EXIT", "RET", "BRX", "JMP")) or cond or ins[e][1].startswith("@!PT") \
            or (op.startswith(("EXIT", "RET")) and ins[e][1].startswith("@"))
        if target is not None and target in index and index[target] in block_of and index[target] != lo:
            nxt.append(block_of[index[target]])
        if falls and e + 1 <= hi:
            nxt.append(block_of[e + 1])
        succ.append(nxt)
    size = [e - s + 1 for s, e in blocks]
    last_mma = max((i for i in range(lo, hi + 1) if ops[i].startswith("HMMA")), default=None)
    if last_mma is None:
        return list(range(lo, hi + 1))
    must = [k for k, (s, e) in enumerate(blocks)
            if any(ops[i].startswith("HMMA") or (ops[i].startswith(("LDGSTS", "LDG")) and i <= last_mma)
                   for i in range(s, e + 1))]
    end = block_of[max(starts)] if blocks[-1][1] == hi else None
    waypoints = [0] + [k for k in must if k != 0] + ([len(blocks) - 1] if end is not None else [])
    path = [0]
    for a, b in zip(waypoints, waypoints[1:]):
        if a == b:
            continue
        way = _shortest(a, b, succ, size)
        if way is None:
            return list(range(lo, hi + 1))
        path += way[1:]
    return [i for k in path for i in range(blocks[k][0], blocks[k][1] + 1)]


def _shortest(a: int, b: int, succ: list[list[int]], size: list[int]) -> list[int] | None:
    """Blocks of the cheapest walk a -> b (Dijkstra on block sizes), or None."""
    import heapq

    best = {a: 0}
    prev: dict[int, int] = {}
    heap = [(0, a)]
    while heap:
        d, k = heapq.heappop(heap)
        if k == b:
            out = [b]
            while out[-1] != a:
                out.append(prev[out[-1]])
            return out[::-1]
        if d > best.get(k, 1 << 60):
            continue
        for n in succ[k]:
            nd = d + size[n]
            if nd < best.get(n, 1 << 60):
                best[n], prev[n] = nd, k
                heapq.heappush(heap, (nd, n))
    return None


def class_counts(ins: list[tuple[int, str]], indices: list[int]) -> dict[str, int]:
    """Instructions of `indices` per class (every class present, zeros included)."""
    out = {name: 0 for name, _ in SASS_CLASSES} | {OTHER_CLASS: 0}
    for i in indices:
        out[sass_class(_opcode(ins[i][1]))] += 1
    return out


def ptx_functions(text: str) -> dict[str, list[str]]:
    funcs = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\s*\((.*?)\n\}\n", text, re.S):
        lines = [ln.strip() for ln in m.group(2).splitlines()]
        funcs[m.group(1)] = lines
    return funcs


def count_ptx(kernel: str, lines: list[str]) -> tuple[int, int] | None:
    labels = {}
    body: list[str] = []  # instructions and labels, in order
    for ln in lines:
        if re.match(r"^\$?[\w$]+:$", ln):
            labels[ln[:-1]] = len(body)
            body.append(ln)
        elif ln.endswith(";") and not ln.startswith((".", "//", "{", "}")):
            body.append(ln)
    loops = []
    for i, ln in enumerate(body):
        m = re.search(r"\bbra(?:\.uni)?\s+([\w$]+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    marker = (lambda s: "mma.sync" in s) if kernel in ("v2", "v3") else (lambda s: s.startswith(("st.shared.u16", "st.shared.b16")))
    best = None
    for lo, hi in loops:
        if any(marker(s) for s in body[lo:hi + 1]) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        return None
    seg = [s for s in body[best[0]:best[1] + 1] if not s.endswith(":")]
    return len(seg), sum("mma.sync" in s for s in seg)


# ----------------------------------------------------------------------------------------------
# vLLM's Marlin MoE kernel beside v3 (--vs-marlin)

VLLM_VERSION = "0.33.0"
MOE_LIBRARY = "vllm/_moe_C_stable_libtorch.abi3.so"
# vLLM ScalarType ids (exponent, mantissa, signed, bias, ... packed into an int64) as they appear in
# the Marlin instances' mangled names
SCALAR_ID = {"bf16": 1125899906909960, "u4b8": 1125899907892224, "u8b128": 1125899923621888}


def marlin_cache(version: str = VLLM_VERSION) -> Path:
    from wna16ctl.native.build import cache_dir

    base = os.environ.get("WNA16CTL_CACHE")
    return (Path(base) if base else cache_dir()) / "marlin-sass" / version


def vllm_moe_library(wheel: Path | None, download: bool, version: str = VLLM_VERSION) -> Path:
    """vLLM's compiled MoE library: taken from `wheel`, else the cached copy, else (download) from
    `pip download vllm==version` into the cache (the wheel is deleted after the library is taken)."""
    import zipfile

    cache = marlin_cache(version)
    lib = cache / Path(MOE_LIBRARY).name
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-", dir=cache) as tmp:
        if wheel is None:
            if not download:
                raise FileNotFoundError(f"no vLLM {version} MoE library in {cache}: give --vllm-wheel PATH or --download")
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                   "--disable-pip-version-check", "-q", "-d", tmp, f"vllm=={version}"],
                                  capture_output=True, text=True)
            found = sorted(Path(tmp).glob("vllm-*.whl"))
            if proc.returncode or not found:
                raise FileNotFoundError(f"pip download vllm=={version} failed: {proc.stderr.strip()[-300:]}")
            wheel = found[0]
        try:
            zf = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise FileNotFoundError(f"{wheel}: not a readable wheel ({exc}); give a vllm=={version} wheel") from exc
        with zf:
            if MOE_LIBRARY not in zf.namelist():
                raise FileNotFoundError(f"{wheel}: no {MOE_LIBRARY} in this wheel")
            part = Path(tmp) / "lib.so"
            part.write_bytes(zf.read(MOE_LIBRARY))
            part.replace(lib)  # complete or absent, never half-written
    return lib


def marlin_entry(num_bits: int, group_size: int, threads: int, block_size: int, tile_n: int, tile_k: int) -> str:
    """The part of a Marlin MoE instance's mangled name that identifies it (bf16 activations and
    output, symmetric int4 (u4b8) or int8 (u8b128) weights, 4 stages, no float zero points)."""
    b = SCALAR_ID["u4b8" if num_bits == 4 else "u8b128"]
    bf = SCALAR_ID["bf16"]
    groups = "n1" if group_size < 0 else str(group_size // 16)
    m_blocks, m8 = max(1, block_size // 16), int(block_size == 8)
    return (f"MarlinILl{bf}ELl{b}ELl{bf}ELl{bf}ELi{threads}ELi{m_blocks}ELi{tile_n // 16}ELi{tile_k // 16}"
            f"ELb{m8}ELi4ELi{groups}ELb0E")


def marlin_ptx_files(lib: Path, cuobjdump: str, env: dict[str, str]) -> list[Path]:
    """The library's PTX files, extracted once into the cache. The wheel holds Marlin MoE cubins
    for sm_80 / sm_89 / sm_120 and PTX for sm_80 only: on an H200 the driver compiles that PTX."""
    out = lib.parent / "ptx"
    done = out / ".complete"
    if not done.is_file():
        out.mkdir(exist_ok=True)
        subprocess.run([cuobjdump, "--extract-ptx", "all", str(lib)], cwd=out, capture_output=True, check=True,
                       env={**os.environ, **env})
        done.write_text("")
    return sorted(out.glob("*.ptx"))


def marlin_sm90_cubin(lib: Path, fragment: str, cuobjdump: str, env: dict[str, str]) -> tuple[Path, str]:
    """The instance whose name holds `fragment`, cut from the library's PTX (the file's header and
    that one entry) and compiled for sm_90 with ptxas -v, as the driver's compiler would: (cubin,
    ptxas log), cached."""
    cubin = lib.parent / "sm90" / f"{fragment}.cubin"
    log = cubin.with_suffix(".log")
    if cubin.is_file() and log.is_file():
        return cubin, log.read_text()
    cubin.parent.mkdir(exist_ok=True)
    for ptx in marlin_ptx_files(lib, cuobjdump, env):
        text = ptx.read_text()
        if fragment not in text:
            continue
        starts = [m.start() for m in re.finditer(r"^\.visible \.entry ", text, re.M)] + [len(text)]
        for s, e in zip(starts, starts[1:]):
            if fragment in text[s:text.index("(", s)]:
                src = cubin.with_suffix(".ptx")
                src.write_text(text[:starts[0]] + text[s:e])
                ptxas = str(Path(find_nvcc()).parent / "ptxas")
                proc = subprocess.run([ptxas, "-arch=sm_90", "-O3", "-v", str(src), "-o", str(cubin) + ".part"],
                                      capture_output=True, text=True)
                if proc.returncode:
                    raise RuntimeError(f"ptxas failed on {fragment}: {proc.stderr[-2000:]}")
                Path(str(cubin) + ".part").replace(cubin)
                log.write_text(proc.stdout + proc.stderr)
                src.unlink()
                return cubin, log.read_text()
    raise FileNotFoundError(f"no Marlin instance {fragment} in {lib}")


def loop_counts(name: str, ins: list[tuple[int, str]], registers: int, chunks_per_iteration: int,
                extra: int = 0):
    """roofline.LoopCounts of a kernel's streaming loop (the innermost loop holding HMMA)."""
    import roofline as R

    ops = [_opcode(t) for _, t in ins]
    loop = innermost_loop(ops, sass_loops(ins), lambda op: op.startswith("HMMA"))
    if loop is None:
        raise RuntimeError(f"{name}: no loop with an HMMA in its SASS")
    counts = class_counts(ins, streaming_path(ins, loop))
    return R.LoopCounts(name, registers, {CLASS_KEYS[k]: v for k, v in counts.items()}, chunks_per_iteration, extra)


def measure_vs_marlin(wheel: Path | None, download: bool) -> tuple[dict, list[str]]:
    """Fresh LoopCounts of every v3 and Marlin instance the model's launch choices can pick, keyed
    as roofline.RECORDED_LOOPS."""
    import roofline as R

    nvcc = find_nvcc()
    cuobjdump, env = find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        return {}, ["nvcc, cuobjdump or nvdisasm not found: nothing counted"]
    lib = vllm_moe_library(wheel, download)
    loops: dict[tuple, object] = {}
    for key in R.RECORDED_LOOPS:
        if key[0] != "marlin":
            continue
        _, bits, size, threads, tn, tk = key
        group = -1 if bits == 8 else 128
        cubin, log = marlin_sm90_cubin(lib, marlin_entry(bits, group, threads, size, tn, tk), cuobjdump, env)
        sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True,
                              env={**os.environ, **env}).stdout
        usage = next(iter(parse_ptxas(log).values()))
        chunks = MARLIN_STAGES_PER_LOOP * tk * tn * bits // 8 // 16 // (threads // 32)
        name = (f"Marlin bf16 {'u4b8 g128' if bits == 4 else 'u8b128 channel'} m{size} {tn}x{tk}, "
                f"{threads} threads")
        loops[key] = loop_counts(name, next(iter(sass_functions(sass).values())), usage["registers"], chunks)
    with tempfile.TemporaryDirectory(prefix="wna16-static-") as tmp:
        cubin, log = compile_cubin(nvcc, "v3", "90", Path(tmp))
        usage = parse_ptxas(log)
        sass = sass_functions(subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True,
                                             check=True, env={**os.environ, **env}).stdout)
    for mangled, ins in sass.items():
        m = re.search(r"moe_gemm_v3_kernelILi1ELi(\d)ELi(\d)ELi(\d)ELb0E", mangled)  # bf16, no zero points
        if not m or mangled not in usage:
            continue
        bits, mt, nt = (int(x) for x in m.groups())
        name = f"v3 bf16 {bits}-bit {16 * mt}x{64 * nt}"
        # one iteration: one 16-row k-tile of half the block's columns per warp
        loops[("v3", bits, 16 * mt)] = loop_counts(name, ins, usage[mangled]["registers"], 16 * 32 * nt * bits // 16 // 8,
                                                   group_sass(ins))
    return loops, [f"Marlin: vLLM {VLLM_VERSION} {MOE_LIBRARY} ({lib}), sm_80 PTX compiled for sm_90 by "
                   f"{Path(find_nvcc()).parent / 'ptxas'}; v3: kernels/moe_gemm_v3.cu, nvcc for sm_90"]


MARLIN_STAGES_PER_LOOP = 4  # Marlin's main loop runs its 4 pipeline stages per iteration


def vs_marlin_rows(loops: dict) -> list[dict]:
    """Per measured shape and M: each kernel's instance, registers, shared memory, blocks per SM and
    instructions per 16-byte weight chunk by class."""
    import roofline as R

    rows = []
    for row in R.MEASURED_H200:
        shape = R.H200_SHAPES[row.shape]
        for launch in (R.marlin_launch(shape, row.m, loops=loops), R.v3_launch(shape, row.m, loops=loops)):
            loop = launch.loop
            if launch.kernel == "marlin":
                smem = R.H200_SMEM_OPTIN // launch.blocks_per_sm - 1024 if launch.blocks_per_sm > 1 \
                    else R.H200_SMEM_OPTIN
                needs = R.marlin_smem(shape, max(1, launch.tile_m // 16), launch.unit_k, launch.tile_n)
                extra = 0.0
            else:
                inst = R.v3_instance("x", shape.num_bits, launch.tile_m // 16, launch.tile_n // 64, loop.registers,
                                     loop.instructions, loop.classes["mma"], "fresh")
                smem = needs = R.plan_of(inst, experts=shape.experts).smem
                group_rows = shape.size_k if shape.group_size < 0 else shape.group_size
                # the group extra, per chunk: once per group per warp; a warp runs one iteration
                # per 64-row stage (its k-tile of it), so a group is group_rows / 64 iterations
                extra = loop.group_extra / (group_rows / launch.unit_k * loop.chunks_per_iteration)
            per_chunk = {k: v / loop.chunks_per_iteration for k, v in loop.classes.items()}
            rows.append({"shape": row.shape, "m": row.m, "kernel": launch.kernel, "instance": loop.name,
                         "choice": launch.why, "registers": loop.registers, "smem_bytes": smem,
                         "smem_needed": needs, "blocks_per_sm": launch.blocks_per_sm, "grid": launch.grid,
                         "per_chunk": per_chunk, "group_extra_per_chunk": extra,
                         "total_per_chunk": sum(per_chunk.values()) + extra})
    return rows


def render_vs_marlin(rows: list[dict]) -> str:
    keys = ["global", "shared", "mma", "dequant", "address", "barrier", "branch", "other"]
    out = ["| shape | M | kernel: instance | regs | smem (B) | blocks/SM | " + " | ".join(keys)
           + " | group extra | **total** |",
           "|---|---:|---|---:|---:|---:|" + "---:|" * (len(keys) + 2)]
    for r in rows:
        pc = r["per_chunk"]
        out.append(f"| {r['shape']} | {r['m']} | {r['kernel']}: {r['instance']} | {r['registers']} | "
                   f"{r['smem_bytes']:,} | {r['blocks_per_sm']} | " + " | ".join(f"{pc[k]:.2f}" for k in keys)
                   + f" | {r['group_extra_per_chunk']:.2f} | **{r['total_per_chunk']:.2f}** |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------


def measure(archs: list[str], kernels: list[str] | None = None) -> tuple[list[KernelFigures], list[str]]:
    notes: list[str] = []
    nvcc = find_nvcc()
    if nvcc is None:
        return [], ["nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): nothing measured"]
    cuobjdump, tool_env = find_cuobjdump()
    if cuobjdump is None:
        notes.append("cuobjdump or nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): "
                     "loops counted in PTX, not SASS")
    figures: list[KernelFigures] = []
    with tempfile.TemporaryDirectory(prefix="wna16-static-") as tmp:
        out = Path(tmp)
        jobs = [(k, a) for a in archs for k in (kernels or list(SOURCES))]
        with ThreadPoolExecutor(max_workers=2) as pool:
            built = dict(zip(jobs, pool.map(lambda job: compile_cubin(nvcc, job[0], job[1], out), jobs)))
        smem, smem3 = dynamic_smem(out), dynamic_smem_v3(out)
        for (kernel, arch), (cubin, log) in built.items():
            usage = parse_ptxas(log)
            if cuobjdump:
                sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True,
                                      check=True, env={**os.environ, **tool_env}).stdout
                bodies, counter, where = sass_functions(sass), count_sass, "sass"
            else:
                bodies, counter, where = ptx_functions(compile_ptx(nvcc, kernel, arch, out)), count_ptx, "ptx"
            for mangled, u in sorted(usage.items()):
                if not is_gemm(kernel, mangled):
                    continue
                name, nb, nt = describe(kernel, mangled)
                f = KernelFigures(kernel, arch, name, mangled, u["registers"], u["spill_stores"], u["spill_loads"],
                                  u["stack"], u["smem"], num_bits=nb)
                if kernel == "v2":
                    m = re.search(r"moe_gemm_v2_kernelILi\d+ELi\d+ELi(\d+)ELi(\d+)ELi(\d+)E", mangled)
                    mt, nt_, mode = (int(x) for x in m.groups()) if m else (0, 0, 0)
                    f.smem_dynamic = smem.get((nb, mt, nt_, int(mode == 2)), 0)
                if kernel == "v3":
                    m = re.search(r"moe_gemm_v3_kernelILi\d+ELi\d+ELi(\d+)ELi(\d+)E", mangled)
                    f.smem_dynamic = smem3.get((nb, int(m.group(1)), int(m.group(2))), 0) if m else 0
                counted = counter(kernel, bodies[mangled]) if mangled in bodies else None
                if counted:
                    f.loop_instructions, f.loop_mma = counted
                    f.codes_per_iteration = {"v2": 32 * nt, "v3": 16 * nt}.get(kernel, 32 // max(nb, 1))
                    f.per_code = f.loop_instructions / f.codes_per_iteration
                    f.per_code_without_mma = (f.loop_instructions - f.loop_mma) / f.codes_per_iteration
                    f.counted_in = where
                    if kernel == "v3" and where == "sass":
                        f.group_sass = group_sass(bodies[mangled])
                figures.append(f)
    return figures, notes


def render(figures: list[KernelFigures], notes: list[str]) -> str:
    rows = ["| kernel | arch | instance | regs | spill st/ld (B) | stack (B) | smem static + dynamic (B) "
            "| loop instr. | mma | codes / iter. | per code | per code w/o mma | group extra |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in figures:
        rows.append(f"| {f.kernel} | sm_{f.arch} | {f.name} | {f.registers} | {f.spill_stores} / {f.spill_loads} "
                    f"| {f.stack} | {f.smem_static} + {f.smem_dynamic} | {f.loop_instructions} | {f.loop_mma} "
                    f"| {f.codes_per_iteration} | {f.per_code:.2f} | {f.per_code_without_mma:.2f} "
                    f"| {f.group_sass or '-'} |")
    text = "\n".join(rows)
    if figures:
        where = {f.counted_in for f in figures if f.counted_in}
        spills = sum(f.spill_stores + f.spill_loads for f in figures if f.kernel == "v2")
        spills3 = sum(f.spill_stores + f.spill_loads for f in figures if f.kernel == "v3")
        fast4 = [f.per_code for f in figures if f.kernel == "v2" and f.num_bits == 4 and "16x256 fast" in f.name]
        text += (f"\n\ncounted in: {', '.join(sorted(where)) or 'nothing'}; spill bytes (all instances): "
                 f"v2 {spills}, v3 {spills3}")
        if fast4:
            verdict = "meets" if max(fast4) <= TARGET_SASS_PER_4BIT_CODE else "misses"
            text += (f"; v2 4-bit 16x256 loop: {max(fast4):.2f} instructions per code ({verdict} the "
                     f"<= {TARGET_SASS_PER_4BIT_CODE:g} target)")
    for n in notes:
        text += f"\nnote: {n}"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm arch number (repeatable; default 90 and 80)")
    ap.add_argument("--kernel", action="append", choices=sorted(SOURCES), help="repeatable; default all")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--vs-marlin", action="store_true",
                    help="v3 against vLLM's Marlin MoE for the measured H200 shapes: instructions per 16-byte "
                         "weight chunk by class, registers, shared memory, blocks per SM")
    ap.add_argument("--vllm-wheel", type=Path, help=f"a vllm=={VLLM_VERSION} wheel (default: the cached library)")
    ap.add_argument("--download", action="store_true",
                    help=f"pip download vllm=={VLLM_VERSION} into the cache when no library is cached")
    args = ap.parse_args(argv)
    if args.vs_marlin:
        try:
            loops, notes = measure_vs_marlin(args.vllm_wheel, args.download)
        except (OSError, zipfile.BadZipFile, RuntimeError) as exc:  # a missing or broken wheel, a failed compile
            print(f"kernel_static: {exc}", file=sys.stderr)
            return 2
        if not loops:
            print(f"kernel_static: skipped: {'; '.join(notes)}")
            return 0
        rows = vs_marlin_rows(loops)
        print(render_vs_marlin(rows))
        for n in notes:
            print(f"note: {n}")
        if args.json:
            args.json.write_text(json.dumps({"loops": [{"key": list(k), **asdict(v)} for k, v in loops.items()],
                                             "rows": rows, "notes": notes}, indent=2) + "\n")
        return 0
    figures, notes = measure(args.arch or ["90", "80"], args.kernel)
    if not figures:
        print(f"kernel_static: skipped: {'; '.join(notes)}")
        return 0
    print(render(figures, notes))
    if args.json:
        args.json.write_text(json.dumps({"kernels": [asdict(f) for f in figures], "notes": notes}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
