"""Faults a buggy repack could write, planted in a correct output with the manifest re-hashed, so
that only the numerics (layer check, e2e) and the bit-exact round trip can see them.

Used by tests/verification/test_e2e.py, and runnable as a study that prints the table of what each
check reports for each fault and for correct repacks of every demo architecture:

    .venv/bin/python -m tests.verification.faults [--prompts 2] [--tokens 8] [--dir /tmp/wna16ctl-faults]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path

import torch

from tests.verification.test_checks import patch, read, rehash
from wna16ctl.layout.packing import pack_codes, unpack_codes
from wna16ctl.layout.rank import build_expert_tensors
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack
from wna16ctl.sources import open_checkpoint
from wna16ctl.sources.tensors import TensorReader

SMALL = dict(num_layers=1, num_experts=4, hidden_size=128, intermediate_size=128, group_size=32,
             vocab_size=320, tokenizer=True)


def _source_expert(ck: Path, expert: int, layer: int = 0) -> dict:
    c = open_checkpoint(ck)
    with TensorReader(c.files) as reader:
        return reader.read_expert(c.layers[layer], expert)


def _rewrite_expert(ck: Path, out: Path, settings: RepackSettings, rank: int, expert: int, ex: dict,
                    names: tuple[str, ...]) -> int:
    """Rank `rank`'s tensors `names` of `expert` rebuilt from the (altered) source expert `ex`;
    returns how many words changed."""
    job = plan_repack(ck, settings).jobs[0]
    spec = job.specs[rank]
    local = expert - job.expert_ranges[rank].start
    bad = build_expert_tensors(ex, spec, expert_id=expert, scale_dtype=torch.bfloat16)
    changed = 0
    for name in names:
        full = f"{job.layer.prefix}.{name}"
        t = read(out, rank, full)
        changed += int((t[local] != bad[name]).sum())
        t[local] = bad[name]
        patch(out, rank, full, t)
    rehash(out)
    return changed


def zero_point_off_by_one(ck: Path, out: Path, settings: RepackSettings, expert: int = 0) -> str:
    """One gate zero point (row 0, group 0) of one expert one code higher (asymmetric checkpoints)."""
    ex = _source_expert(ck, expert)
    zp = unpack_codes(ex["gate"]["weight_zero_point"], 4, dim=0)
    zp[0, 0] = (zp[0, 0] + 1) % 16
    ex["gate"]["weight_zero_point"] = pack_codes(zp, 4, dim=0)
    changed = _rewrite_expert(ck, out, settings, 0, expert, ex, ("w13_weight_zero_point",))
    assert changed == 1, changed
    return f"expert {expert}, gate row 0 group 0 zero point +1"


def flipped_code(ck: Path, out: Path, settings: RepackSettings, expert: int) -> str:
    """The lowest bit of one gate code (row 0, column 0) of `expert`: one quantisation step."""
    ex = _source_expert(ck, expert)
    codes = unpack_codes(ex["gate"]["weight_packed"], 4, dim=1)
    codes[0, 0] ^= 1
    ex["gate"]["weight_packed"] = pack_codes(codes, 4, dim=1)
    changed = _rewrite_expert(ck, out, settings, 0, expert, ex, ("w13_weight_packed",))
    assert changed == 1, changed
    return f"expert {expert}, gate code [0, 0] low bit flipped"


def swapped_scale_columns(ck: Path, out: Path, settings: RepackSettings) -> str:
    """Two adjacent columns of rank 0's Marlin-order w13 scales swapped, in every expert."""
    name = f"{plan_repack(ck, settings).jobs[0].layer.prefix}.w13_weight_scale"
    s = read(out, 0, name)
    swapped = s.clone()
    swapped[..., [0, 1]] = s[..., [1, 0]]
    assert not swapped.equal(s)
    patch(out, 0, name, swapped)
    rehash(out)
    return "rank 0 w13 scales, Marlin columns 0 and 1"


def gate_up_swapped(ck: Path, out: Path, settings: RepackSettings, expert: int = 0) -> str:
    """Rank 0's w13 of one expert built with the gate and up projections exchanged."""
    ex = _source_expert(ck, expert)
    ex["gate"], ex["up"] = ex["up"], ex["gate"]
    names = tuple(n for n in ("w13_weight_packed", "w13_weight_scale", "w13_weight_zero_point")
                  if "zero" not in n or "weight_zero_point" in ex["gate"])
    assert _rewrite_expert(ck, out, settings, 0, expert, ex, names) > 0
    return f"expert {expert}, rank 0: w13 gate and up halves exchanged"


def expert_use(ck: Path, out: Path, e2e_options, samples: Path) -> torch.Tensor:
    """How often the reference run routes to each expert of layer 0 (on a pristine output)."""
    import wna16ctl.verification.e2e as e2e_mod
    from wna16ctl.verification.checks import verify_output

    counts = torch.zeros(256, dtype=torch.long)
    real = e2e_mod._ReferenceExperts.__call__

    def counting(self, a, ids, w):
        counts.add_(torch.bincount(ids.reshape(-1).cpu(), minlength=256))
        return real(self, a, ids, w)

    e2e_mod._ReferenceExperts.__call__ = counting
    try:
        report = verify_output(ck, out, samples=samples, num_samples=4, e2e=e2e_options)
    finally:
        e2e_mod._ReferenceExperts.__call__ = real
    return counts, report


def _row(name: str, what: str, report, seconds: float) -> str:
    ok = {c.name: c.status for c in report.checks}
    num = report.numerics[0] if report.numerics else None
    e = report.e2e
    ratio = e.max_error_over_bound if e is not None else None
    toks = f"{e.tokens_agreeing}/{e.tokens_generated}" if e is not None and e.prompts else "—"
    return (f"| {name} | {what} | {ok.get('round_trip')} | {ok.get('numerics')} "
            f"({num.max_error_over_bound:.3g}, {num.violations} out) | {e.status if e else '—'} "
            f"({'—' if ratio is None else f'{ratio:.3g}'}, {e.block_violations if e else 0} out) | {toks} | "
            f"{seconds:.0f} s |")


def main() -> None:
    from tests.conftest import ACT_ORDER_RELEASE, MIXTRAL_NAMES_RELEASE, QUESTIONS
    from wna16ctl.demo import DemoSpec, write_demo_checkpoint
    from wna16ctl.repacking.pipeline import run_repack
    from wna16ctl.verification.checks import verify_output
    from wna16ctl.verification.e2e import E2EOptions

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-faults"))
    ap.add_argument("--only", default="", help="comma-separated row names")
    a = ap.parse_args()
    torch.set_num_threads(1)
    opts = E2EOptions(prompts=a.prompts, max_new_tokens=a.tokens)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE)
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str, **spec) -> tuple[Path, Path]:
        if name not in made:
            ck, out = a.dir / f"ck-{name}", a.dir / f"out-{name}"
            if not (ck / "config.json").exists():
                shutil.rmtree(ck, ignore_errors=True)
                write_demo_checkpoint(ck, DemoSpec(**{**SMALL, **spec}))
            if not (out / "manifest.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                chosen = settings if spec.get("arch") != "mixtral" else dataclasses.replace(settings, vllm=MIXTRAL_NAMES_RELEASE)
                run_repack(plan_repack(ck, chosen), out)
            made[name] = (ck, out)
        return made[name]

    def faulty(name: str, pristine: Path) -> Path:
        dst = a.dir / f"fault-{name}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(pristine, dst)
        return dst

    only = set(filter(None, a.only.split(",")))
    print("| case | what | round trip | numerics (max err/bound, elements out) | e2e (max err/bound, elements out) | tokens agree | time |")
    print("|---|---|---|---|---|---|---|")
    archs = {"qwen3_moe": {}, "mixtral": dict(arch="mixtral"), "mixtral-asym": dict(arch="mixtral", symmetric=False),
             "qwen2_moe": dict(arch="qwen2_moe"), "deepseek_v3": dict(arch="deepseek_v3", num_layers=2),
             "qwen3_moe-16e": dict(num_experts=16)}  # 16 experts: some are rarely routed
    counts = None
    for name, spec in archs.items():
        if only and name not in only and not (name == "qwen3_moe-16e" and "flipped-code" in only):
            continue
        ck, out = get(name, **spec)
        t0 = time.monotonic()
        if name == "qwen3_moe-16e":
            counts, report = expert_use(ck, out, opts, QUESTIONS)
        else:
            report = verify_output(ck, out, samples=QUESTIONS, num_samples=4, e2e=opts)
        print(_row(f"correct {name}", "repack --tp 2", report, time.monotonic() - t0), flush=True)
    faults = [
        ("zero-point", "mixtral-asym", lambda ck, out: zero_point_off_by_one(
            ck, out, dataclasses.replace(settings, vllm=MIXTRAL_NAMES_RELEASE))),
        ("flipped-code", "qwen3_moe-16e", None),
        ("scale-columns", "qwen3_moe", lambda ck, out: swapped_scale_columns(ck, out, settings)),
        ("gate-up", "qwen3_moe", lambda ck, out: gate_up_swapped(ck, out, settings)),
    ]
    for name, base, plant in faults:
        if only and name not in only:
            continue
        ck, pristine = get(base, **archs[base])
        out = faulty(name, pristine)
        if plant is None:
            used = counts[:16]
            rare = int(torch.where(used > 0, used, torch.iinfo(torch.long).max).argmin())
            what = flipped_code(ck, out, settings, rare) + f" (routed {int(used[rare])} slots of {int(used.sum())})"
        else:
            what = plant(ck, out)
        t0 = time.monotonic()
        report = verify_output(ck, out, samples=QUESTIONS, num_samples=4, e2e=opts)
        print(_row(name, what, report, time.monotonic() - t0), flush=True)


if __name__ == "__main__":
    main()
