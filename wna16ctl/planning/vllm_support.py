"""Which checkpoints the `vllm` layout can be written for, per release: the rulebook's checked key
contracts (`rules.VLLM_STATE_SUPPORT`) and what the layout refuses, each refusal with the reason
read in vLLM's own code.  Asked by the layout's plan (`planning.vllm_state`) and by the serve path
(`planning.serving`), so that inspect never proposes what repack refuses.  Torch-free.
"""

from __future__ import annotations

from typing import Any

from wna16ctl.errors import NotLoadable, UsageError
from wna16ctl.planning import rules
from wna16ctl.planning.moe import plan_layer, unquantized_lookup_error
from wna16ctl.sources import Checkpoint, MoELayer, formats


# Why the layout refuses what it refuses: each reason read in vLLM's own code, named beside it.
# MoE experts of several schemes: CompressedTensorsMoEMethod.get_moe_method
# (compressed_tensors_moe/compressed_tensors_moe.py) looks the layer's scheme up under the names of
# expert 0 ("{layer_name}.0.{proj}") and creates every expert's parameters with it.
MIXED_REASON = ("experts of mixed precision: vLLM creates every expert's parameters with expert 0's scheme "
                "(CompressedTensorsMoEMethod.get_moe_method), so there is no faithful state to write")
# Act-order on the releases that load it: CompressedTensorsWNA16MoEMethod._w2_scale_sharding
# (compressed_tensors_moe_wna16.py) keeps the whole w2 scales on every rank (load_full_w2) and the
# method adds g_idx parameters; the layout's key contract holds neither (0.32.0 on refuses
# group/dynamic act-order in CompressedTensorsConfig itself).
ACT_ORDER_REASON = ("vLLM keeps whole w2 scales on every rank and adds g_idx parameters "
                    "(CompressedTensorsWNA16MoEMethod._w2_scale_sharding), which the vllm layout does not write; "
                    "use --layout marlin")
# kv_cache_scheme: BaseKVCacheMethod.create_weights (quantization/kv_cache.py) adds q_scale, k_scale,
# v_scale and prob_scale parameters to every attention layer, which the layout's key contract holds
# no row for.
KV_CACHE_REASON = ("a kv_cache_scheme makes vLLM add q_scale, k_scale, v_scale and prob_scale parameters to "
                   "every attention layer (BaseKVCacheMethod.create_weights), which the vllm layout does not write")
# MTP layers: the main model skips their weights (DeepseekV2ForCausalLM.load_weights, "skip spec
# decode layers"), and the MTP draft is a second model loaded with the same load format
# (get_draft_load_config in model_loader/utils.py); ShardedStateLoader.load_weights indexes the model's
# state with every key of the files (state_dict[key]) and fails on any missing key, so one
# directory cannot hold both models' states.
MTP_REASON = ("multi-token-prediction layers: vLLM's main model skips them and its MTP draft model is loaded "
              "from the same sharded_state files, which must hold exactly one model's keys "
              "(ShardedStateLoader.load_weights); the vllm layout writes the main model only")
# Act-order on quantized linear layers (releases before config.refuse_group_actorder):
# CompressedTensorsWNA16.create_weights (schemes/compressed_tensors_wNa16.py) keeps the whole scales
# on every rank (marlin_repeat_scales_on_all_ranks is true for act-order) and registers a
# weight_g_idx parameter; the layout's key contract holds neither.
LINEAR_ACT_ORDER_REASON = ("vLLM keeps the whole scales on every rank and adds a weight_g_idx parameter "
                           "(CompressedTensorsWNA16.create_weights, marlin_repeat_scales_on_all_ranks), which the "
                           "vllm layout does not write; use --layout marlin")
# --ep (--enable-expert-parallel, no data parallelism): FusedMoEParallelConfig.make makes the MoE
# layers' EP rank the TP rank and their TP size 1, so each expert is whole on one rank, and
# ExpertMapManager (fused_moe/expert_map_manager.py, determine_expert_map) gives each rank its
# local experts at model build: vLLM's default linear placement (ParallelConfig
# .expert_placement_strategy), E // n each, the first E % n ranks one more, local expert i of rank
# r being global expert start_r + i.  The map is a non-persistent buffer (no key), and
# ShardedStateLoader reads the files of the TP rank, so the files hold that rank's local experts in
# the map's order (planning.moe.local_expert_ranges); the serve line asks for no other placement.


def _refuse_unknown(version: str, arch: str) -> None:
    if not rules.vllm_state_known(version, arch):
        known = ", ".join(f"{a} ({rules.span(list(v))})" for a, v in rules.VLLM_STATE_SUPPORT.items())
        raise UsageError(f"--layout vllm: vLLM {version} with architecture {arch} has no known sharded_state contract "
                         f"(known: {known})")


def _refuse_format_release(ck: Checkpoint, version: str) -> None:
    """A GPTQ, AWQ or auto-round checkpoint: the releases whose GPTQ/AWQ method rows were checked."""
    if version not in rules.VLLM_STATE_FORMAT_RELEASES:
        quant = ck.config.quant
        assert quant is not None
        raise UsageError(f"--layout vllm: {ck.config.path}: quant_method {quant.quant_method}: vLLM {version}'s GPTQ "
                         "and AWQ methods have no checked sharded_state contract (checked: "
                         f"{rules.span(list(rules.VLLM_STATE_FORMAT_RELEASES))}); use --layout marlin")


def check_supported(ck: Checkpoint, version: str) -> None:
    arch = ck.config.model_type
    quant = ck.config.quant
    # compressed-tensors' method rows, or the GPTQ/AWQ methods' (which method a layer gets, and
    # whether the release loads it, is the planner's: plan_vllm_state asks it per layer)
    own_format = quant is not None and formats.of(quant) is not formats.DEFAULT
    _refuse_unknown(version, arch)
    if own_format:
        _refuse_format_release(ck, version)
    if ck.unplaced_linear:
        raise UsageError(f"--layout vllm: {ck.root}: quantized module {ck.unplaced_linear[0]} is not a layer vLLM "
                         f"builds for {arch}; the vllm layout has no parameter to write it into")
    for lin in ck.linear_layers:
        _check_linear_scheme(lin, version, own_format)
    kv_scheme = (ck.config.raw.get("quantization_config") or {}).get("kv_cache_scheme")
    if kv_scheme:
        raise UsageError(f"--layout vllm: {ck.config.path}: {KV_CACHE_REASON}")
    if ck.mtp_layers:
        raise UsageError(f"--layout vllm: {ck.root}: {MTP_REASON}")
    for lay in ck.layers:
        _check_experts(lay, version, own_format)


def _check_linear_scheme(lin: Any, version: str, own_format: bool) -> None:
    """A quantized non-expert layer (`sources.model.LinearLayer`) the layout can cut by rank; whether
    the release loads it at all is `plan_linear`'s (called with the TP size in `plan_vllm_state`).
    The act-order rules below are compressed-tensors'; GPTQ's are the planner's and the rows'."""
    s = lin.scheme
    if s is None or lin.mixed_schemes or lin.refused:
        return  # plan_linear says what vLLM does with it
    if s.num_bits not in rules.VLLM_STATE_BITS:
        raise UsageError(f"--layout vllm: {lin.name}: {s.num_bits}-bit weights pack codes across int32 words, "
                         "which the vllm layout does not split by rank; vLLM loads the checkpoint itself")
    if own_format:
        return
    if s.act_order and rules.release(version).has("config.refuse_group_actorder"):
        raise NotLoadable(f"{lin.name}: actorder {s.actorder!r}: vLLM {version} refuses the checkpoint")
    if s.act_order:
        raise UsageError(f"--layout vllm: {lin.name}: actorder {s.actorder!r}: {LINEAR_ACT_ORDER_REASON}")


def _check_experts(lay: MoELayer, version: str, own_format: bool = False) -> None:
    if lay.scheme is None:
        raise UsageError(f"--layout vllm: {lay.prefix}: unquantized experts are not supported by the vllm layout")
    if len(lay.scheme_sets) > 1:
        raise UsageError(f"--layout vllm: {lay.prefix}: {MIXED_REASON}")
    if lay.scheme.num_bits not in rules.VLLM_STATE_BITS:
        raise UsageError(f"--layout vllm: {lay.prefix}: {lay.scheme.num_bits}-bit experts pack codes across int32 "
                         "words, which the vllm layout does not split by rank; vLLM loads the checkpoint itself")
    if own_format:
        return  # the GPTQ/AWQ rules of act-order and of unquantized experts are the planner's
    if lay.scheme.act_order and rules.release(version).has("config.refuse_group_actorder"):
        raise NotLoadable(f"{lay.prefix}: actorder {lay.scheme.actorder!r}: vLLM {version} refuses the checkpoint")
    unquantized = unquantized_lookup_error(lay, rules.release(version))  # rule method.checkpoint_proj_names
    if unquantized is not None:
        raise NotLoadable(f"{lay.prefix}: {unquantized}")
    if lay.scheme.act_order:
        raise UsageError(f"--layout vllm: {lay.prefix}: actorder {lay.scheme.actorder!r}: {ACT_ORDER_REASON}")


def moe_methods(ck: Checkpoint, tp: int, vllm: str, gpu: str, switches: Any, ep: bool) -> dict[int, str]:
    """The vLLM MoE method class of each MoE layer (decoder layer index): compressed-tensors' for
    its checkpoints, else the one the format's config builds (planning.moe.plan_layer), whose
    parameters the rows of that method describe.  NotLoadable where the release does not load the
    layer; a method whose state the layout has no rows for (MoeWNA16) is refused in one line."""
    if ck.config.quant is None or formats.of(ck.config.quant) is formats.DEFAULT:
        return {lay.layer_index: rules.CT_MOE_METHOD for lay in ck.layers if lay.layer_index is not None}
    written = {row.method for row in rules.VLLM_STATE_KEYS if row.method is not None}
    out: dict[int, str] = {}
    for lay in ck.layers:
        lp = plan_layer(lay, tp, ep, vllm, gpu, switches) if switches is not None else plan_layer(lay, tp, ep, vllm, gpu)
        if not lp.loadable:
            reason = (lp.errors or ["no backend loads it"])[0]
            raise NotLoadable(f"{lay.prefix}: vLLM {vllm} on {gpu} does not load this layer at --tp {tp}"
                              f"{' --ep' if ep else ''}: {reason}")
        method = (lp.method or {}).get("class")
        if method not in written:
            why = (lp.method or {}).get("fallback_reason")
            raise UsageError(f"--layout vllm: {lay.prefix}: vLLM {vllm} builds {method} for this layer"
                             f"{f' ({why})' if why else ''}; the vllm layout writes the parameters of the GPTQ and "
                             "AWQ Marlin MoE methods only: serve the checkpoint itself")
        if lay.layer_index is not None:
            out[lay.layer_index] = method
    return out
