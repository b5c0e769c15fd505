"""Classify every disagreement between the planner and vLLM releases over many random cases.

    python -m tests.conformance.sweep --releases all -n 2000 [--seed 0] [--json out.json]

Prints, per release, each class of disagreement (which fields differ and how, with numbers in
error texts blanked), how many cases fell in it, and its smallest case with both outcomes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from typing import Any

from tests.conformance import cases as case_space
from tests.conformance import vllm_release
from tests.conformance.known_differences import known_cause
from tests.conformance.test_vllm_conformance import (disagreements, head_disagreement, outcome_of_plan, run_planner,
                                                     vllm_outcome_for)


def _blank_numbers(text: str | None) -> str | None:
    return None if text is None else re.sub(r"\d+", "N", text)


def class_key(vllm: dict[str, Any], plan: dict[str, Any], diffs: list[str]) -> str:
    """One class per kind of difference: the differing fields with their values, numbers blanked."""
    parts = []
    for d in diffs:
        field = d.split(":", 1)[0]
        if field == "stage":
            parts.append(f"stage vllm={vllm['stage']}[{vllm.get('error_type')}: {_blank_numbers(vllm['error'])}] "
                         f"planner={plan['stage']}[{_blank_numbers(plan['error'])}]")
        elif field in ("w2_scale_sharding", "padded_intermediate", "create_weights error"):
            parts.append(field)
        else:
            parts.append(_blank_numbers(d))
    return " | ".join(parts)


def _size(case: dict[str, Any]) -> tuple:
    return (case["hidden_size"] * case["intermediate_size"], case["num_experts"], case["tp"])


def sweep(version: str, n: int, seed: int, gpus: list[str] | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    classes: dict[str, dict[str, Any]] = {}
    atoms: dict[str, dict[str, Any]] = {}
    explained: dict[str, int] = {}
    unexplained = 0
    agree = 0
    ops_called = 0
    t0 = time.perf_counter()
    vllm_release.worker(version)  # start-up is not part of the per-case timing
    t1 = time.perf_counter()
    for _ in range(n):
        case = case_space.sample(rng, gpus)
        plan = outcome_of_plan(run_planner(case, version))
        vllm = vllm_outcome_for(version, case, plan)
        if vllm.get("ops_called"):
            ops_called += 1
        diffs = disagreements(vllm, plan)
        if case.get("lm_head"):
            diffs += head_disagreement(version, case, vllm)
        if not diffs:
            agree += 1
            continue
        known = known_cause(version, case, vllm, plan)
        if known is not None:
            explained[known] = explained.get(known, 0) + 1
        else:
            unexplained += 1
        for d in diffs:  # each differing field on its own, so root causes stand out
            atom = class_key(vllm, plan, [d])
            a = atoms.setdefault(atom, {"count": 0, "case": case, "vllm": vllm, "planner": plan})
            a["count"] += 1
            if _size(case) < _size(a["case"]):
                a.update(case=case, vllm=vllm, planner=plan)
        key = class_key(vllm, plan, diffs)
        entry = classes.setdefault(key, {"count": 0, "case": case, "vllm": vllm, "planner": plan, "diffs": diffs})
        entry["count"] += 1
        if _size(case) < _size(entry["case"]):
            entry.update(case=case, vllm=vllm, planner=plan, diffs=diffs)
    t2 = time.perf_counter()
    for e in [*classes.values(), *atoms.values()]:
        e["vllm"].pop("traceback", None)
    return {"version": version, "cases": n, "agree": agree, "startup_s": round(t1 - t0, 2),
            "per_1000_s": round((t2 - t1) / n * 1000, 2), "classes": classes, "atoms": atoms,
            "explained": explained, "unexplained": unexplained, "ops_called": ops_called}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--releases", default=",".join(vllm_release.DEFAULT_CI_RELEASES))
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--gpus", help="comma list of GPUs to draw from (sm75 ... sm120); default every --gpu the CLI accepts")
    args = ap.parse_args(argv)
    versions = list(vllm_release.RELEASES) if args.releases == "all" else args.releases.split(",")
    results = []
    for v in versions:
        try:
            vllm_release.release_sources(v)
        except vllm_release.ReleaseUnavailable:
            print(vllm_release.fetch_hint(v), file=sys.stderr)
            continue
        res = sweep(v, args.n, args.seed, args.gpus.split(",") if args.gpus else None)
        vllm_release.close_worker(v)
        results.append(res)
        print(f"== vLLM {v}: {res['agree']}/{res['cases']} agree; start-up {res['startup_s']} s, "
              f"{res['per_1000_s']} s per 1000 cases; known causes {res['explained']}, "
              f"unexplained {res['unexplained']}; compiled ops called while deciding: {res['ops_called']}", flush=True)
        for key, e in sorted(res["atoms"].items(), key=lambda kv: -kv[1]["count"]):
            print(f"  [{e['count']}] {key}")
            print(f"      case: {json.dumps(e['case'])}")
        if args.json:  # rewritten after each release, so a long sweep can be read while it runs
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
