"""Disagreements with vLLM 0.27.0 whose cause is known and not yet fixed in the planner.

The conformance test for 0.27.0 (the release the planner models) does not assert on a case that
one of these explains; every other disagreement fails.  Each entry names the vLLM code that
decides the case.  Delete an entry when the planner models it: the cases it covered are then
asserted on again.
"""

from __future__ import annotations

from typing import Any, Callable

Outcome = dict[str, Any]
Rule = Callable[[dict[str, Any], Outcome, Outcome], bool]


def _fallback_backend(v: Outcome) -> bool:
    return v["backend"] in ("humming", "emulation")


KNOWN_0_27_0: dict[str, Rule] = {
    # compressed_tensors_moe_wna16.py, CompressedTensorsWNA16MoEMethod.__init__: 8-bit asserts
    # group_size == -1 before the oracle (bare AssertionError); the planner only warns.
    "int8 with grouped scales is refused by the method constructor":
        lambda c, v, p: c["num_bits"] == 8 and c["group_size"] != -1,
    # fused_moe/experts/triton_moe.py, TritonWNA16Experts._supports_quant_scheme: no asymmetric
    # quant key in 0.27.0; the planner lets Triton take int4 asym.
    "Triton has no asymmetric kernel in 0.27.0":
        lambda c, v, p: not c["symmetric"] and "asymmetric" in v.get("rejected_reasons", {}).get("triton", ""),
    # the constructor's non-Marlin branch asserts strategy == "group": a channel-wise layer that
    # Marlin rejects does not load; the planner gives it to Triton.
    "channel-wise layers load only on Marlin":
        lambda c, v, p: c["strategy"] == "channel" and v["backend"] not in ("marlin", "batched_marlin", None),
    # "dynamic" is act-order for the constructor's is_actorder (strict Marlin gate) but not for
    # the Triton rule, the non-Marlin assert or _w2_scale_sharding (all compare with "group").
    "actorder 'dynamic' is only partly treated as act-order":
        lambda c, v, p: c["actorder"] == "dynamic",
    # with Marlin and Triton rejected the oracle goes on to HUMMING / EMULATION, which the
    # planner does not know; the constructor's non-Marlin asserts then decide the outcome.
    "backends after Triton (Humming, Emulation) are not modelled":
        lambda c, v, p: _fallback_backend(v),
    # marlin_utils.check_moe_marlin_supports_config compares group_size (None for channel-wise
    # written with group_size null) with 0: TypeError in the oracle; the planner only warns.
    "channel-wise group_size null crashes the oracle":
        lambda c, v, p: bool(c.get("group_size_null")),
    # create_weights wording is "CompressedTensors WNA16 MoE ...", the planner writes
    # "CompressedTensors WNA16 Marlin MoE ..." (the wording of the older Marlin-only method).
    "create_weights error texts say 'WNA16 MoE', not 'WNA16 Marlin MoE'":
        lambda c, v, p: (v["stage"] == p["stage"] == "create_weights"
                         and v["error"] == (p["error"] or "").replace("WNA16 Marlin MoE", "WNA16 MoE")),
    # compressed-tensors 0.17.0 QuantizationArgs refuses act-order with a non-group strategy;
    # the planner has no config stage.
    "compressed-tensors refuses actorder group/dynamic on channel-wise schemes":
        lambda c, v, p: v["stage"] == "config" and "Must use group or tensor_group" in (v["error"] or ""),
    # the harness does not drive the expert weight loader, where the planner's pack-factor and
    # act-order-zero-point checks would apply: not verifiable here.
    "planner's load-time checks are not driven by the harness":
        lambda c, v, p: p["stage"] == "loader" and v["stage"] is None,
}


def known_cause(version: str, case: dict[str, Any], vllm: Outcome, plan: Outcome) -> str | None:
    """The name of the known planner gap that explains this case's disagreement, if any."""
    if version != "0.27.0":
        return None
    for name, rule in KNOWN_0_27_0.items():
        if rule(case, vllm, plan):
            return name
    return None
