"""Cases for the linear planner's kernel choice against each release's `choose_mp_linear_kernel`.

For a per-rank linear shape, scheme, GPU and environment, the release's own kernel list and each
kernel's `can_implement` run in the conformance worker (`linear_outcome`); the planner walks its
`kernel_priority` with `kernel_reason` (what `plan_linear` does).  The test is in
test_vllm_conformance.py, which shares each release's worker.
"""

from __future__ import annotations

import random
from typing import Any

from tests.conformance import vllm_release
from wna16ctl.planning import rules
from wna16ctl.planning.engine_env import make_switches
from wna16ctl.planning.linear import (KernelConfig, kernel_priority, kernel_reason, linear_has_g_idx,
                                      linear_scheme_error, weight_type)
from wna16ctl.sources.config import WeightScheme

GPUS = ["sm75", "sm80", "sm86", "sm89", "sm90", "sm90", "sm100", "sm120"]
ENVS: list[dict[str, str]] = [{}, {}, {}, {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"},
                              {"VLLM_DISABLED_KERNELS": "MarlinLinearKernel,MacheteLinearKernel"}]


def sample(rng: random.Random) -> dict[str, Any]:
    k = rng.choice([512, 1024, 2048, 2880, 4096, 7168, 96 * rng.randint(1, 64), 16 * rng.randint(1, 300)])
    n = rng.choice([512, 1024, 2048, 4096, 5120, 64 * rng.randint(1, 128), 8 * rng.randint(1, 600)])
    tp = rng.choice([1, 2, 4, 8])
    row = rng.random() < 0.5  # row-parallel splits K, column-parallel N
    k_p, n_p = (k // tp, n) if row else (k, n // tp)
    bits = rng.choice([4, 4, 8, 8, 2, 3, 5, 6, 7])
    gs = rng.choice([-1, 32, 64, 128, 128])
    # the weights' actorder, handed to the release's own linear scheme (which decides has_g_idx)
    actorder = rng.choice([None, None, None, "weight", "static", "group", "dynamic"]) if gs > 0 else None
    return {"kind": "linear", "k": k, "n": n, "k_p": max(k_p, 1), "n_p": max(n_p, 1), "num_bits": bits,
            "symmetric": rng.random() < 0.7, "group_size": gs, "actorder": actorder,
            "act_type": rng.choice(["bfloat16", "bfloat16", "float16"]), "gpu": rng.choice(GPUS),
            "env": rng.choice(ENVS)}


def _scheme(case: dict[str, Any]) -> WeightScheme:
    gs = case["group_size"]
    return WeightScheme(num_bits=case["num_bits"], group_size=gs, symmetric=case["symmetric"],
                        strategy="group" if gs > 0 else "channel", actorder=case.get("actorder"),
                        format="pack-quantized")


def planner_kernel(version: str, case: dict[str, Any]) -> str | None:
    """The kernel the linear planner picks, or "scheme ValueError" where it says the release cannot
    build the layer's scheme."""
    rel = rules.release(version)
    sw = make_switches(case["env"])
    disabled = sw.names("VLLM_DISABLED_KERNELS", version)
    s = _scheme(case)
    if linear_scheme_error(s, rel) is not None:
        return "scheme ValueError"
    c = KernelConfig(k=case["k"], n=case["n"], k_p=case["k_p"], n_p=case["n_p"], weight_type=weight_type(s),
                     bits=case["num_bits"], act_type=case["act_type"], group_size=case["group_size"],
                     zero_points=not case["symmetric"], has_g_idx=linear_has_g_idx(s))
    for kern in kernel_priority(rel, case["gpu"]):
        if kern not in disabled and kernel_reason(kern, rel, case["gpu"], c) is None:
            return kern
    return None


def linear_disagreement(version: str, case: dict[str, Any]) -> str | None:
    if case.get("actorder") in ("group", "dynamic") and rules.release(version).has("config.refuse_group_actorder"):
        return None  # the release refuses the whole checkpoint at config parse (compared in the MoE cases)
    got = vllm_release.vllm_outcome(version, case)
    assert not got["ops_called"], f"compiled ops called while choosing: {got['ops_called']}"
    mine = planner_kernel(version, case)
    if (got["error"] or "").startswith("scheme ValueError") and mine == "scheme ValueError":
        return None
    if got["kernel"] != mine:
        return f"vLLM {version}: {got['kernel'] or got['error']!r}, planner {mine!r} for {case}"
    return None

