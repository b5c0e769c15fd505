"""Which checkpoints the `vllm` layout (vLLM's own `sharded_state` files) can be written for, per
release: the rulebook's checked key contracts (`rules.VLLM_STATE_SUPPORT`) and what the layout does
not split by rank. A planning fact, read by `repack --layout vllm` and by the next steps inspect
offers, so that neither proposes what the other refuses.
"""

from __future__ import annotations

from wna16ctl.errors import NotLoadable, UsageError
from wna16ctl.planning import rules
from wna16ctl.planning.moe import unquantized_lookup_error
from wna16ctl.sources import Checkpoint


def _refuse_unknown(version: str, arch: str) -> None:
    if not rules.vllm_state_known(version, arch):
        known = ", ".join(f"{a} ({rules.span(list(v))})" for a, v in rules.VLLM_STATE_SUPPORT.items())
        raise UsageError(f"--layout vllm: vLLM {version} with architecture {arch} has no known sharded_state contract "
                         f"(known: {known})")


def check_supported(ck: Checkpoint, version: str) -> None:
    arch = ck.config.model_type
    _refuse_unknown(version, arch)
    if ck.linear_layers or ck.unplaced_linear:
        first = ck.linear_layers[0].modules[0] if ck.linear_layers else ck.unplaced_linear[0]
        raise UsageError(f"--layout vllm: {ck.root}: quantized non-expert layer {first} is not supported by the vllm "
                         "layout yet; use --layout marlin or transposed")
    kv_scheme = (ck.config.raw.get("quantization_config") or {}).get("kv_cache_scheme")
    if kv_scheme:
        raise UsageError(f"--layout vllm: {ck.config.path}: a kv_cache_scheme changes the attention scales vLLM "
                         "creates; the vllm layout does not support it yet")
    if ck.mtp_layers:
        raise UsageError(f"--layout vllm: {ck.root}: multi-token-prediction layers are not supported by the vllm layout")
    for lay in ck.layers:
        if lay.scheme is None:
            raise UsageError(f"--layout vllm: {lay.prefix}: unquantized experts are not supported by the vllm layout")
        if len(lay.scheme_sets) > 1:
            raise UsageError(f"--layout vllm: {lay.prefix}: experts of mixed precision; vLLM loads every expert "
                             "with expert 0's scheme, so there is no faithful state to write")
        if lay.scheme.num_bits not in rules.VLLM_STATE_BITS:
            raise UsageError(f"--layout vllm: {lay.prefix}: {lay.scheme.num_bits}-bit experts pack codes across int32 "
                             "words, which the vllm layout does not split by rank; vLLM loads the checkpoint itself")
        if lay.scheme.act_order and rules.release(version).has("config.refuse_group_actorder"):
            raise NotLoadable(f"{lay.prefix}: actorder {lay.scheme.actorder!r}: vLLM {version} refuses the checkpoint")
        unquantized = unquantized_lookup_error(lay, rules.release(version))  # rule method.checkpoint_proj_names
        if unquantized is not None:
            raise NotLoadable(f"{lay.prefix}: {unquantized}")
        if lay.scheme.act_order:
            raise UsageError(f"--layout vllm: {lay.prefix}: actorder {lay.scheme.actorder!r} (g_idx and whole w2 "
                             f"scales per rank) is not supported by the vllm layout; use --layout marlin")
