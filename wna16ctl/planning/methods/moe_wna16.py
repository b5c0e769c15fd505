"""vLLM's `MoeWNA16` method (`moe_wna16.py`): where the GPTQ or AWQ config's Marlin gate refuses a
routed-experts layer, the config rebuilds itself as `MoeWNA16Config.from_config(full_config)` and
the layer gets `MoeWNA16Method`, which converts the experts to the Triton WNA16 layout at load.

It is built from the raw quantization_config: GPTQModel's `dynamic` rules are not applied (the
layer gets the base bits and group size), and releases that still accept GPTQ act-order skip the
g_idx tensors while loading, so the experts compute with the wrong scale groups.
"""

from __future__ import annotations

from typing import Any, Mapping

from wna16ctl.planning import rules
from wna16ctl.planning.methods import awq, gptq
from wna16ctl.planning.methods.base import MOE_WNA16_LAYOUT, MoEMethod, OracleArgs, get_from_keys

_AWQ_MIN_CAPABILITY = 75


def method(raw: Mapping[str, Any], rel: rules.Release, prefix: str, cc: int, reason: str) -> MoEMethod:
    """The fallback method for a layer the Marlin gate refused (`reason`), with its constructor's errors."""
    out = MoEMethod("MoeWNA16Method", "moe_wna16", fallback_reason=reason)
    try:
        linear = get_from_keys(raw, ["quant_method"])
        bits, group = get_from_keys(raw, ["bits"]), get_from_keys(raw, ["group_size"])
        if linear == gptq.QUANT_METHOD:
            has_zp, skip = not get_from_keys(raw, ["sym"]), ()
        else:
            has_zp, skip = bool(get_from_keys(raw, ["zero_point"])), tuple(raw.get("modules_to_not_convert") or ())
    except KeyError as exc:
        out.error = ("method", "missing key", str(exc.args[0]))
        return out
    if linear != gptq.QUANT_METHOD and cc < _AWQ_MIN_CAPABILITY:
        out.error = ("method", "capability", (
            "The quantization method moe_wna16 + awq is not supported for the current GPU. "
            f"Minimum capability: {_AWQ_MIN_CAPABILITY}. Current capability: {cc}."))
        return out
    if awq.skipped(skip, prefix):
        out.vllm_class, out.label = "UnquantizedFusedMoEMethod", "unquantized"
        out.error = ("load", "unquantized method", f"modules_to_not_convert names {prefix}: vLLM builds "
                     "UnquantizedFusedMoEMethod and the checkpoint's packed expert tensors have no parameter to load into")
        return out
    if bits not in (4, 8):
        out.error = ("method", "bits", "MoeWNA16Method only supports int4 and int8 now.")
    elif bits == 8 and group != -1 and rel.has("moe_wna16.int8_channel_assert"):
        out.error = ("method", "int8 grouped", "AssertionError (assert group_size == -1: MoeWNA16Method takes only "
                     "channel-wise int8 experts in this release; the assert has no message)")
    else:
        out.oracle = OracleArgs(bits, bits == 4 and group == 32, has_zp, False, MOE_WNA16_LAYOUT, group, False, False)
    return out


def create_weights(group_size: int, experts: int, hidden: int, i_p: int) -> tuple[int | None, str | None]:
    """(the group size create_weights settles on, None), or (None, its error): it halves the group
    size until it divides both the rank's intermediate size and hidden_size, and asserts that it
    stays at least 32 (an assert without a message)."""
    g = group_size
    while i_p % g or hidden % g:
        g //= 2
        if g < 32:
            return None, (f"AssertionError (assert group_size >= 32: MoeWNA16Method halves group size {group_size} "
                          f"until it divides the intermediate size per partition {i_p} and hidden_size {hidden}; "
                          "the assert has no message)")
    if g < 0:  # channel-wise (-1): the scales are sized hidden_size // -1 (torch.zeros' own message)
        return None, "zeros: Dimension size must be non-negative."
    return g, None


def dropped_act_order(raw: Mapping[str, Any], rel: rules.Release) -> str | None:
    """The correctness hazard of a GPTQ act-order layer on MoeWNA16 (None: not this case)."""
    if rel.has("gptq.desc_act_refused") or not raw.get("desc_act") or raw.get("group_size") == -1:
        return None
    return ("GPTQ act-order (desc_act) on the MoeWNA16 fallback: its weight loader skips the g_idx tensors, so the "
            "experts load without error and dequantize with the wrong scale groups (outputs are wrong)")


def dropped_dynamic(raw: Mapping[str, Any], own_bits: int, own_group: int) -> str | None:
    """The hazard of a layer whose dynamic rule changes its bits or group size: MoeWNA16 reads the
    base config only."""
    if own_bits != raw.get("bits") or own_group != raw.get("group_size"):
        return (f"the layer's dynamic rule gives it {own_bits} bits, group {own_group}, but the MoeWNA16 fallback is "
                f"built from the base config ({raw.get('bits')} bits, group {raw.get('group_size')}): its tensors load "
                "with the wrong shapes or compute with the wrong scale groups")
    return None
