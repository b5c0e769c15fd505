"""Mutation testing of the fast GEMMs (kernels/moe_gemm_v2.cu, moe_gemm_v3.cu): realistic bugs,
each applied to a copy of kernels/, must be caught by the emulated tests -- wrong output (for v3
also any difference from v2's output, or a counter word left set), an emulator abort, or a
sanitizer report.

Each mutant names the builds whose cases must catch it: the plain build runs its kernel's test
grid (seeded block schedules, several blocks side by side), the ThreadSanitizer build the
sanitizer grid. `python -m tests.emu.mutation` runs every case against every mutant and prints how many
cases catch each; the test-suite (tests/native/test_emu_mutants.py) stops at the first catch.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from tests.emu import harness as H
from wna16ctl.native import ops as K


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str], ...]  # (text, replacement), each text occurring exactly once
    builds: tuple[str, ...] = ("plain",)  # the builds whose cases must catch it
    fast: bool = False  # part of the default test run (the rest: `make test-kernels`)
    file: str = "moe_gemm_v2.cu"

    @property
    def kernel(self) -> str:
        return "v3" if self.file == "moe_gemm_v3.cu" else "v2"


MUTANTS: tuple[Mutant, ...] = (
    Mutant("M1-a-fragment-row", "ldmatrix row addresses: the k-chunk from lane bit 3 instead of bit 4",
           (("ch = 2 * warp + (lane >> 4);", "ch = 2 * warp + ((lane >> 3) & 1);"),)),
    Mutant("M2-group-off-by-one", "the scale group of a k-tile taken from its last row + 1",
           (("const int64_t g = kt * 16 / p.group_rows;", "const int64_t g = (kt * 16 + 16) / p.group_rows;"),)),
    Mutant("M3-scale-column-swap", "the lane table's scales of column c and c + 8 swapped",
           (("u.x = sp[0], u.y = sp[1], u.z = zp[0]", "u.x = sp[1], u.y = sp[0], u.z = zp[0]"),)),
    Mutant("M4-no-zero-point", "zero points never read: the symmetric midpoint subtracted always",
           (("const int z = p.zp ? (int)wna16_zp_code(zrow, NB, col) : (1 << (NB - 1));",
             "const int z = 1 << (NB - 1);"),
            ("    const uint32_t* zrow = reinterpret_cast<const uint32_t*>(st + P::Z_OFF) + row * (BN / PF);\n",
             ""))),
    Mutant("M5-no-acquire-spin", "the stream-K consumer trusts the relaxed counter, no acquire of the ready flags",
           (("            while (wna16_load_acquire(p.ready + slot_of(b)) == 0) {\n            }",
             "            (void)slot_of(b);"),),
           builds=("tsan",), fast=True),
    Mutant("M6-k-stages-floor", "the stage count rounds K down: the last partial stage is dropped",
           (("const int kstages = (int)((p.size_k + kStageK - 1) / kStageK);",
             "const int kstages = (int)(p.size_k / kStageK);"),)),
    Mutant("M7-no-m-bound", "the tile's sorted ids read without the bound of the expert's rows",
           (("      if (i < t.rows) {\n        s = p.sorted_ids[t.m0 + i];", "      {\n        s = p.sorted_ids[t.m0 + i];"),)),
    Mutant("M8-barrier-after-issue", "the streaming loop's stage barrier after the next stage's cp.async issue",
           (("          wna16_syncthreads();\n          if (ks + kStages - 1 < ks1) ld.load(p, t, smem, sh_aoff, ks + kStages - 1);\n",
             "          if (ks + kStages - 1 < ks1) ld.load(p, t, smem, sh_aoff, ks + kStages - 1);\n"
             "          wna16_syncthreads();\n"),),
           builds=("tsan",), fast=True),
    Mutant("M10-no-stage-barrier", "the streaming loop's stage barrier removed",
           (("          wna16_syncthreads();\n          if (ks + kStages - 1 < ks1) ld.load(",
             "          if (ks + kStages - 1 < ks1) ld.load("),),
           builds=("tsan",)),
    Mutant("M9-expert-stride", "the expert's weight offset strides by the packed width N / PF, not the Marlin row",
           (("b = p.b + t.e * (int64_t)ktiles * bcols +", "b = p.b + t.e * (int64_t)ktiles * (p.size_n / PF) +"),)),
    # v3 (kernels/moe_gemm_v3.cu): its own protocol and its register-held scales
    Mutant("V1-no-acquire-spin", "v3's stream-K consumer trusts the relaxed counter, no acquire of the ready flags",
           (("            while (wna16_load_acquire(p.ready + slot_of(b)) == 0) {\n            }",
             "            (void)slot_of(b);"),),
           builds=("tsan",), file="moe_gemm_v3.cu"),
    Mutant("V2-barrier-after-issue", "v3's streaming stage barrier after the next stage's cp.async issue",
           (("        wna16_syncthreads();                 // everyone's have; stage ks - 1 is consumed\n"
             "        if (ks + kStages - 1 < ks1) ld.load(p, mcount, nvalid, smem, sh_aoff, ks + kStages - 1);\n",
             "        if (ks + kStages - 1 < ks1) ld.load(p, mcount, nvalid, smem, sh_aoff, ks + kStages - 1);\n"
             "        wna16_syncthreads();\n"),),
           builds=("tsan",), file="moe_gemm_v3.cu"),
    Mutant("V3-no-counter-reset", "v3 leaves the tile counters set after a call (the next call elects no last block)",
           (("        wna16_atomic_add(p.counters + tile, -(int)(b_hi - b_lo + 1));\n", ""),),
           file="moe_gemm_v3.cu"),
    Mutant("V4-zero-halves-swapped", "v3's zero pairs of columns c and c + 8 swapped at use",
           (("          z[0] = z[1] = wna16_prmt(sz[s][1], 0u, 0x1010u);\n          z[2] = z[3] = wna16_prmt(sz[s][1], 0u, 0x3232u);",
             "          z[0] = z[1] = wna16_prmt(sz[s][1], 0u, 0x3232u);\n          z[2] = z[3] = wna16_prmt(sz[s][1], 0u, 0x1010u);"),),
           file="moe_gemm_v3.cu"),
    Mutant("V5-n-half-words", "v3's second n-warp reads the first n-warp's weight words",
           (("(kw * NT + sub0 / 4) * WPT", "(kw * NT + (sub0 - nw * NSUB) / 4) * WPT"),), file="moe_gemm_v3.cu"),
    Mutant("V6-scale-columns-hoisted", "v3's refill reads the scales of the lane's first n-warp columns",
           (("(uint32_t)(16 * nw * NSUB + (lane >> 2))", "(uint32_t)(16 * (nw & 0) * NSUB + (lane >> 2))"),), file="moe_gemm_v3.cu"),
)


def by_name(name: str) -> Mutant:
    return next(m for m in MUTANTS if m.name == name or m.name.split("-")[0] == name)


def mutated_tree(tmp: Path, mutant: Mutant) -> Path:
    """A copy of kernels/ with the mutant's edits applied."""
    dst = tmp / "kernels"
    shutil.copytree(K.kernels_dir(), dst, ignore=shutil.ignore_patterns("__pycache__"))
    text = (dst / mutant.file).read_text()
    for old, new in mutant.edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{mutant.name}: {old!r} occurs {n} times in {mutant.file}")
        text = text.replace(old, new)
    (dst / mutant.file).write_text(text)
    return dst


def cases(build: str, kernel: str = "v2") -> list[tuple[str, str, dict, dict]]:
    """(id, tile variant, problem, emulated device) of the cases that run in `build`."""
    if kernel == "v3":
        from tests.native.test_emu_gemm_v3 import GRID, SAN_GRID, _id, seeded_devices
    else:
        from tests.native.test_emu_gemm_v2 import GRID, SAN_GRID, _id, seeded_devices

    grid = GRID if build == "plain" else SAN_GRID
    out = []
    for item in grid:
        variant, sms, case = item
        dev = seeded_devices(sms, item)[-1]  # a seeded schedule, blocks side by side
        out.append((_id(item), variant, case, dev))
    return out


def verdict(exe: Path, variant: str, case: dict, dev: dict, kernel: str = "v2") -> Optional[str]:
    """Why the case catches the kernel in `exe` (None: it passes)."""
    from tests.native.test_emu import check_gemm, grid_problem
    from tests.native.test_emu_gemm_v2 import run_gemm_v2
    from tests.native.test_emu_gemm_v3 import run_gemm_v3

    prob = grid_problem(**case)
    try:
        if kernel == "v3":  # two calls on one workspace, v2's output as the reference too
            r, got = run_gemm_v3(exe, prob, variant, dev, sms=dev["sms"])
            if r.returncode == 0 and r.rc == 99:
                return "counter words left set: " + r.stderr.strip()[-100:]
            _, want = run_gemm_v2(exe, prob, variant, dev)
            if r.returncode == 0 and r.rc == 0 and not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                return "differs from v2's output"
        else:
            r, got = run_gemm_v2(exe, prob, variant, dev)
    except subprocess.TimeoutExpired:
        return "timeout"
    if r.returncode == 66:
        return "sanitizer: " + next((ln.strip() for ln in r.stderr.splitlines() if "Sanitizer" in ln), "report")
    if r.returncode != 0:
        return "abort: " + (r.stderr.strip().splitlines() or ["?"])[-1][:120]
    try:
        check_gemm(prob, r, got)
    except AssertionError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"wrong output: {first[:100] or (where.line or '?').strip()[:100]}"
    return None


def verdicts(mutant: Mutant, build: str, tmp: Path, stop_at_first: bool) -> Iterator[tuple[str, Optional[str]]]:
    exe = H.build(build, mutated_tree(tmp, mutant))
    for cid, variant, case, dev in cases(build, mutant.kernel):
        why = verdict(exe, variant, case, dev, mutant.kernel)
        yield cid, why
        if why and stop_at_first:
            return


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mutants", nargs="*", help="names (M1 .. M9); default: all")
    ap.add_argument("--builds", default="plain,tsan", help="comma-separated builds to run (plain, tsan)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every catching case")
    args = ap.parse_args(argv)
    chosen = [by_name(n) for n in args.mutants] if args.mutants else list(MUTANTS)
    survivors = []
    for m in chosen:
        line = [f"{m.name:28s}"]
        caught_where_required = False
        for build in args.builds.split(","):
            with tempfile.TemporaryDirectory(prefix="wna16-mutant-") as tmp:
                results = list(verdicts(m, build, Path(tmp), stop_at_first=False))
            caught = [(c, w) for c, w in results if w]
            line.append(f"{build}: {len(caught)}/{len(results)}")
            if build in m.builds and caught:
                caught_where_required = True
            if args.verbose:
                for c, w in caught:
                    print(f"    {m.name} {build} {c}: {w}")
        if not caught_where_required:
            survivors.append(m.name)
        print("  ".join(line), "" if caught_where_required else "  SURVIVED", flush=True)
    if survivors:
        print("survived:", ", ".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
