"""Disagreements with vLLM whose cause is known.

The conformance test does not assert on a case that one of these explains; every other
disagreement fails.  Each entry names the vLLM code that
decides the case.  Delete an entry when the planner models it: the cases it covered are then
asserted on again.
"""

from __future__ import annotations

from typing import Any, Callable

Outcome = dict[str, Any]
Rule = Callable[[dict[str, Any], Outcome, Outcome], bool]


KNOWN: dict[str, Rule] = {
    # wna16ctl refuses a per-rank intermediate size that is not a whole number of packed words;
    # the release's own expert weight loader, driven on CPU tensors (load_check), then raises or
    # fills the rank's parameter with other columns' codes: the refusal is the loader's verdict
    "the release's weight loader raises or loads other codes (checked)":
        lambda c, v, p: (p["stage"] == "load" and v["stage"] is None
                         and str(v.get("load_check", "")).startswith(("raises", "wrong codes"))),
    # act-order with zero points under TP: the packed weight loads (load_check ok), but g_idx names
    # groups of the whole row while only the rank's slice of the zero points is loaded; the harness
    # checks the packed weight only, so this one is explained, not verified
    "act-order + zero points under TP: zero-point slicing not driven by the harness":
        lambda c, v, p: (p["stage"] == "load" and v["stage"] is None and v.get("load_check") == "ok"
                         and "asymmetric zero points under tensor parallelism" in (p["error"] or "")),
    # GPTQ/AWQ layers on the MoeWNA16 fallback that vLLM builds and loads, but that compute with the
    # wrong scale groups: it skips GPTQ's g_idx (act-order) and ignores GPTQModel's dynamic rules;
    # the planner refuses them as correctness hazards (read in moe_wna16.py: get_weight_loader,
    # MoeWNA16Config.from_config), which no step the harness drives raises
    "MoeWNA16 fallback loads and computes wrong (act-order or dynamic rule dropped)":
        lambda c, v, p: (p["stage"] == "load" and v["stage"] is None and v.get("method_class") == "MoeWNA16Method"
                         and "MoeWNA16 fallback" in (p["error"] or "")),
    # a GPTQ dynamic rule's group size that does not divide the per-rank sizes: the Marlin gate
    # checked the base group size and create_weights floors the scale rows (auto_gptq.py), so the
    # layer builds and would compute with the wrong groups; the planner refuses it
    "GPTQ dynamic group size floored by create_weights":
        lambda c, v, p: (p["stage"] == "load" and v["stage"] is None and "floors the scale rows" in (p["error"] or "")),
}


def known_cause(version: str, case: dict[str, Any], vllm: Outcome, plan: Outcome) -> str | None:
    """The name of the known planner gap that explains this case's disagreement, if any."""
    for name, rule in KNOWN.items():
        if rule(case, vllm, plan):
            return name
    return None


# Disagreements of a whole model built by the release (model_build.py): (release, case, vLLM's
# outcome, the planner's, the differing lines) -> explained.
ModelRule = Callable[[str, dict[str, Any], Outcome, Outcome, list[str]], bool]
KNOWN_MODEL: dict[str, ModelRule] = {}


def known_model_cause(version: str, case: dict[str, Any], vllm: Outcome, plan: Outcome, diffs: list[str]) -> str | None:
    """The name of the known difference that explains all of a model case's disagreements, if any."""
    for name, rule in KNOWN_MODEL.items():
        if rule(version, case, vllm, plan, diffs):
            return name
    return None
