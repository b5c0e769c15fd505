"""Per-rank GPU memory of a checkpoint's weights as vLLM holds them, from the plans already made.

`weights_per_rank` adds up, for one rank of one TP (or EP) size in one release, every tensor the
release's model creates for the checkpoint: the routed experts as the WNA16 MoE method creates
them (`create_weights`: N-first packed words, the scales with w2's kept whole where the planner
says `load_full_w2`, zero points, the `weight_shape` rows, and the g_idx tensors of the releases
that create them), every other layer as its layer class shards it (`planning.linear.per_rank_shape`:
column, row, QKV with KV heads replicated when TP exceeds them, the vocabulary padded to 64 and
split), the norms and other small tensors replicated, and the tensors the attention layers create
themselves (KV-cache scales).  These sizes are the built model's parameters and buffers, which the
conformance harness checks byte for byte against each release's own model built on the meta
device.  What processing changes after loading is kept apart in `processing`, from the release's
processing code (`expert_processing`: on Marlin, the experts' tile padding, the g_idx tensors
0.27-0.29 free, the per-layer workspace of 0.27-0.30; checked against the release's own
`process_weights_after_loading` run on the built experts).  Processing this module does not model
(Humming's and the emulation's conversions, the quantized linear layers' kernels) is named in
`processing_not_modelled`, and its modules count as built.

The multimodal encoders of vision-language models and multi-token-prediction layers are not
counted (`not_counted` names them): vLLM builds the former from `vision_config`, not from tensors
this module plans, and loads the latter only as a draft model.  Torch-free; no files read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wna16ctl.dtypes import FLOAT_ST_OF_CONFIG, ST_SIZES
from wna16ctl.planning import rules
from wna16ctl.planning.linear import LinearPlan, per_rank_shape
from wna16ctl.layout.spec import marlin_moe_padded_intermediate
from wna16ctl.planning.moe import LayerPlan
from wna16ctl.sources import Checkpoint, MoELayer
from wna16ctl.sources.architectures import ROUTER_IN_BLOCK_FP32, architecture
from wna16ctl.sources.model import ROW, LinearLayer, is_mtp, unquantized_linear_layers

DEFAULT_SMS = 132  # an H100 SXM's streaming multiprocessors, where the GPU is not named
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (VocabParallelEmbedding, ParallelLMHead)
_MULTIMODAL = ("visual.", "vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.", "audio_tower.")
# per-rank tensors of the gated delta-net (Qwen3-Next, Qwen3.5) split along their first dimension
_SPLIT_FIRST = ("conv1d.weight", "A_log", "dt_bias")
# parameters vLLM creates in float32 whatever the model dtype
_FP32 = ("A_log", "e_score_correction_bias")
# a GQA attention layer's own tensors: compressed-tensors' KV-cache method's q/k/v scales (fp32)
# and zero points (model dtype), one element each, and the layer's four fp32 scalar buffers
# (_k_scale, _v_scale, _q_scale, _prob_scale); an MLA layer has the four buffers only
_GQA_SCALES_FP32, _GQA_ZERO_POINTS, _ATTN_BUFFERS_FP32 = 3, 3, 4


@dataclass
class WeightsMemory:
    """One rank's weight memory, by vLLM module (bytes)."""

    tp: int
    ep: bool
    vllm: str
    rank: int
    built: dict[str, int] = field(default_factory=dict)  # module -> bytes as built (before processing)
    processing: dict[str, int] = field(default_factory=dict)  # module -> bytes processing adds (or frees: < 0)
    not_counted: list[str] = field(default_factory=list)  # checkpoint modules left out, and why
    # modules whose processing is not modelled (their as-built bytes stand in the loaded figure), and why
    processing_not_modelled: list[str] = field(default_factory=list)

    @property
    def built_bytes(self) -> int:
        return sum(self.built.values())

    @property
    def loaded_bytes(self) -> int:
        """After weight processing: the figure a start holds on the GPU for the weights."""
        return self.built_bytes + sum(self.processing.values())

    def processing_by_cause(self) -> dict[str, int]:
        """Processing's bytes summed by cause (tile_padding, g_idx_freed, workspace)."""
        out: dict[str, int] = {}
        for module, nbytes in self.processing.items():
            cause = module.rpartition(".")[2]
            out[cause] = out.get(cause, 0) + nbytes
        return out

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "ep": self.ep, "vllm": self.vllm, "rank": self.rank,
                "built_bytes": self.built_bytes, "processing_bytes": sum(self.processing.values()),
                "loaded_bytes": self.loaded_bytes, "not_counted": list(self.not_counted),
                "processing_not_modelled": list(self.processing_not_modelled)}


def model_st_dtype(ck: Checkpoint) -> str:
    """The safetensors name of the model dtype (config torch_dtype; bfloat16 when absent)."""
    raw = ck.config.raw
    name = ck.config.torch_dtype or (raw.get("text_config") or {}).get("torch_dtype") or "bfloat16"
    return FLOAT_ST_OF_CONFIG.get(name, "BF16")


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def expert_bytes(lay: MoELayer, plan: LayerPlan, rank: int, model_bytes: int) -> int:
    """The routed experts of one rank as the WNA16 MoE method creates them (vLLM's
    `get_weight_shape` and `create_weights`, sizes in every release; 0.27-0.30 create some of them
    K-first, the same sizes transposed)."""
    s = lay.scheme
    if s is None:
        return 0
    hidden = lay.hidden_size
    e = plan.local_experts[rank]
    i_p = plan.intermediate_size_per_partition
    bits, gs = s.num_bits, s.group_size
    g13 = hidden // gs if gs > 0 else 1
    w2_k = plan.w2.w2_scales_size if plan.w2 is not None and plan.w2.load_full_w2 else i_p
    g2 = w2_k // gs if gs > 0 else 1
    per = 4 * (2 * i_p * (hidden * bits // 32) + hidden * (i_p * bits // 32))  # packed int32 words
    per += model_bytes * (2 * i_p * g13 + hidden * g2)  # scales
    if not s.symmetric:
        per += 4 * ((2 * i_p * bits // 32) * g13 + (hidden * bits // 32) * g2)
    per += 2 * 2 * model_bytes  # w13_weight_shape, w2_weight_shape: two rows of the model dtype
    if rules.release(plan.vllm).has("state.expert_g_idx"):
        per += 2 * 4 * (hidden + i_p)  # w13/w2 g_idx and sort indices, int32
    return per * e


# backends whose processing keeps the experts' sizes: Triton transposes K-first buffers to N-first
# (a copy of the same bytes) or views them as uint8 (fused_moe/oracle/int_wna16.py, TRITON branch)
_SAME_SIZE_BACKENDS = ("triton",)
_MARLIN_BACKENDS = ("marlin", "batched_marlin")
_MARLIN_WORKSPACE_BLOCKS_PER_SM = 4  # marlin_make_workspace_new(device, 4): int32 locks per SM


def expert_processing(lay: MoELayer, plan: LayerPlan, rank: int, model_bytes: int, sms: int) -> dict[str, int]:
    """What the release's processing of one rank's routed experts adds (or frees: < 0), by cause,
    where the backend is Marlin (fused_moe/oracle/int_wna16.py: _process_weights_marlin).  The
    repack keeps every tensor's element count (gptq_marlin_moe_repack, marlin_moe_permute_scales);
    the sizes change in three places:
    - tile padding: the intermediate size per partition padded to lcm(64, group size) (w13's two
      shards and w2's packed rows, their scales and zero points: _pad_w13_shard_cols, _pad_rows);
    - g_idx: the four int32 act-order tensors create_weights makes in 0.27-0.29 are replaced by
      empty ones unless actorder is the string "group";
    - workspace: 0.27-0.30 keep one per layer (SM count x 4 int32)."""
    s = lay.scheme
    if s is None or plan.backend is None or plan.backend.value not in _MARLIN_BACKENDS:
        return {}
    rel, hidden, i_p, e = rules.release(plan.vllm), lay.hidden_size, plan.intermediate_size_per_partition, \
        plan.local_experts[rank]
    bits, gs = s.num_bits, s.group_size
    out: dict[str, int] = {}
    padded = marlin_moe_padded_intermediate(i_p, gs) if rel.has("process.marlin_moe_tile_padding") else i_p
    if padded != i_p:
        g13 = hidden // gs if gs > 0 else 1
        words_n = padded * bits // 32 - i_p * bits // 32  # packed words along the intermediate size
        per = 4 * 2 * (padded - i_p) * (hidden * bits // 32) + 4 * hidden * words_n  # w13, w2 packed
        per += model_bytes * 2 * (padded - i_p) * g13  # w13 scales
        groups_n = padded // gs - i_p // gs if gs > 0 else 0
        per += model_bytes * hidden * groups_n  # w2 scales (grouped only: one row when channel-wise)
        if not s.symmetric:
            per += 4 * g13 * 2 * words_n + 4 * (hidden * bits // 32) * groups_n  # zero points
        out["tile_padding"] = per * e
    if rel.has("state.expert_g_idx") and s.actorder != "group":
        out["g_idx_freed"] = -2 * 4 * (hidden + i_p) * e
    if rel.has("process.marlin_moe_layer_workspace"):
        out["workspace"] = 4 * sms * _MARLIN_WORKSPACE_BLOCKS_PER_SM
    return out


def _quantized_linear_bytes(layer: LinearLayer, plan: LinearPlan, model_bytes: int) -> int:
    """`CompressedTensorsWNA16.create_weights` of a linear layer on one rank."""
    s = layer.scheme
    if s is None or plan.k is None or plan.n is None:
        return 0
    k_p, n_p, k = plan.k, plan.n, layer.input_size
    row_parallel = k_p != k
    g_idx = s.act_order and rules.release(plan.vllm).has("linear.g_idx_kernels")
    repeat = g_idx or (s.group_size == -1 and row_parallel)
    gs = s.group_size if s.group_size != -1 else k
    groups = (k if repeat else k_p) // gs
    out = 4 * n_p * -(-k_p * s.num_bits // 32) + model_bytes * n_p * groups + 16  # + weight_shape int64[2]
    if not s.symmetric:
        out += 4 * -(-n_p * s.num_bits // 32) * groups
    if g_idx:
        out += 4 * k_p
    return out


def _dense_linear_bytes(ck: Checkpoint, layer: LinearLayer, tp: int, model_bytes: int, dtype_bytes: int) -> int:
    plan = LinearPlan(tp=tp, vllm=rules.NEWEST, gpu=rules.DEFAULT_GPU)
    shape = per_rank_shape(layer, tp, plan)
    if shape is None:
        return 0
    _, _, k_p, n_p = shape
    return dtype_bytes * k_p * n_p + _bias_bytes(ck, layer, n_p, model_bytes)


def _dense_dtype_bytes(ck: Checkpoint, layer: LinearLayer, model_bytes: int) -> int:
    arch = architecture(ck.config.model_type)
    if layer.kind.endswith(".gate") and arch is not None and arch.router == ROUTER_IN_BLOCK_FP32:
        return 4
    return model_bytes


def _tied(ck: Checkpoint) -> bool:
    raw = ck.config.raw
    text: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else {}
    return bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _other_tensor_bytes(name: str, shape: list[int], tp: int, model_bytes: int) -> int:
    """A tensor of no linear layer: the vocabulary embedding, the delta-net's per-head tensors
    (split), or a norm, bias or other small tensor every rank holds whole."""
    numel = 1
    for d in shape:
        numel *= d
    leaf = name.rpartition(".")[2]
    elem = 4 if leaf in _FP32 else model_bytes
    if name.endswith("embed_tokens.weight") and len(shape) == 2:
        return elem * padded_vocab(shape[0]) // tp * shape[1]
    if name.endswith(_SPLIT_FIRST):
        return elem * numel // tp
    return elem * numel


def weights_per_rank(ck: Checkpoint, tp: int, ep: bool, vllm: str, moe_plans: dict[str, LayerPlan],
                     linear_plans: dict[str, LinearPlan], rank: int = 0, sms: int = DEFAULT_SMS) -> WeightsMemory:
    """Every tensor rank `rank` of a `tp`-rank start (`ep`: experts spread over the ranks) holds for
    the checkpoint's weights in release `vllm`, from the MoE plans (prefix -> plan at this TP size)
    and the linear plans (layer name -> plan at this TP size); `processing` what the release's
    weight processing then adds or frees on a GPU of `sms` streaming multiprocessors."""
    mem = WeightsMemory(tp=tp, ep=ep, vllm=vllm, rank=rank)
    model_bytes = ST_SIZES[model_st_dtype(ck)]
    counted: set[str] = set()
    for lay in ck.layers:
        counted.add(f"{lay.prefix}.")
        plan = moe_plans.get(lay.prefix)
        if lay.quantized and plan is not None and plan.local_experts:
            mem.built[lay.prefix] = expert_bytes(lay, plan, rank, model_bytes)
            _add_expert_processing(mem, lay, plan, rank, model_bytes, sms)
            if ep:  # the expert map: global expert -> local slot (or -1), int32, on every rank
                mem.built[lay.prefix + ".expert_map"] = 4 * lay.num_experts
        elif not lay.quantized:
            mem.not_counted.append(f"{lay.prefix} (unquantized routed experts)")
    for q in ck.linear_layers:
        counted.update(q.modules)
        lp = linear_plans.get(q.name)
        if lp is not None:
            mem.built[q.name] = _quantized_linear_bytes(q, lp, model_bytes) + _bias_bytes(ck, q, lp.n, model_bytes)
            if "quantized linear layers (Marlin tile padding, workspace)" not in mem.processing_not_modelled:
                mem.processing_not_modelled.append("quantized linear layers (Marlin tile padding, workspace)")
    dense, _ = unquantized_linear_layers(ck.files, ck.config)
    tied = _tied(ck)
    for d in dense:
        counted.update(d.modules)
        if d.kind == "lm_head" and tied:
            continue  # vLLM ties the output projection to the embedding: one tensor
        mem.built[d.name] = _dense_linear_bytes(ck, d, tp, model_bytes, _dense_dtype_bytes(ck, d, model_bytes))
    _add_other_tensors(ck, mem, counted, tp, model_bytes)
    _add_attention_tensors(ck, mem, model_bytes)
    return mem


def _add_expert_processing(mem: WeightsMemory, lay: MoELayer, plan: LayerPlan, rank: int, model_bytes: int,
                           sms: int) -> None:
    backend = plan.backend.value if plan.backend is not None else None
    if backend in _MARLIN_BACKENDS:
        for cause, nbytes in expert_processing(lay, plan, rank, model_bytes, sms).items():
            mem.processing[f"{lay.prefix}.{cause}"] = nbytes
    elif backend not in _SAME_SIZE_BACKENDS:
        note = f"routed experts on {backend} (its conversion at load)"
        if note not in mem.processing_not_modelled:
            mem.processing_not_modelled.append(note)


def _has_bias(ck: Checkpoint, layer: LinearLayer) -> bool:
    """The files hold a bias, or the model class builds one (q/k/v biases of the families the
    architecture table says)."""
    arch = architecture(ck.config.model_type)
    if layer.kind.endswith("qkv_proj") and arch is not None and arch.qkv_bias:
        return True
    return any(f"{m}.bias" in ck.files for m in layer.modules)


def _bias_bytes(ck: Checkpoint, layer: LinearLayer, n_p: int | None, model_bytes: int) -> int:
    if not _has_bias(ck, layer):
        return 0
    return model_bytes * (layer.output_size if layer.tp_role == ROW else (n_p or 0))


def _add_other_tensors(ck: Checkpoint, mem: WeightsMemory, counted: set[str], tp: int, model_bytes: int) -> None:
    layers = ck.config.num_hidden_layers
    modules = {m for m in counted if not m.endswith(".")}
    expert_stems = tuple(m for m in counted if m.endswith("."))
    skipped: set[str] = set()
    # most names are experts' (~200k on Kimi-K2): they are left out first, by their stem, before
    # any per-name work
    names = [n for n in ck.files.names() if not (expert_stems and n.startswith(expert_stems))]
    for name in names:
        module = name.rpartition(".")[0]
        if module in modules:
            continue
        stem = name.removeprefix("model.").removeprefix("language_model.").removeprefix("model.")
        if stem.startswith(_MULTIMODAL) or ".visual." in name or is_mtp(name, layers):
            skipped.add("multimodal encoder" if not is_mtp(name, layers) else "multi-token-prediction layers")
            continue
        shape = (ck.files.raw(name) or {}).get("shape", [])
        mem.built[module] = mem.built.get(module, 0) + _other_tensor_bytes(name, list(shape), tp, model_bytes)
    if not _tied(ck) and not any(k.endswith("lm_head") for k in mem.built):
        embed = next((k for k in mem.built if k.endswith("embed_tokens")), None)
        if embed is not None:  # an untied head the files do not hold is built anyway, the embedding's size
            mem.built[embed.replace("model.embed_tokens", "lm_head")] = mem.built[embed]
    mem.not_counted += sorted(skipped)


def _add_attention_tensors(ck: Checkpoint, mem: WeightsMemory, model_bytes: int) -> None:
    """The tensors attention layers create themselves: a GQA layer's KV-cache scales and zero
    points (compressed-tensors' KV-cache method, on every layer of a compressed-tensors model)
    and scalar buffers; an MLA layer's scalar buffers."""
    gqa = 4 * _ATTN_BUFFERS_FP32 + (4 * _GQA_SCALES_FP32 + model_bytes * _GQA_ZERO_POINTS
                                    if ck.config.quant is not None else 0)
    arch = architecture(ck.config.model_type)
    head_dim = ck.dims.head_dim or 0
    for module in list(mem.built):
        parent, _, leaf = module.rpartition(".")
        if leaf == "qkv_proj":
            mem.built[parent + ".attn"] = gqa
            if arch is not None and arch.qk_norm and f"{parent}.q_norm.weight" not in ck.files:
                # the model class builds the per-head q/k norms whether or not the files hold them
                mem.built[parent + ".qk_norm"] = 2 * head_dim * model_bytes
        elif leaf in ("kv_a_proj_with_mqa", "fused_qkv_a_proj"):
            mem.built[parent + ".mla_attn"] = 4 * _ATTN_BUFFERS_FP32
        elif leaf == "in_proj_qkvz":
            _add_delta_net_tensors(ck, mem, parent, model_bytes)


def _add_delta_net_tensors(ck: Checkpoint, mem: WeightsMemory, parent: str, model_bytes: int) -> None:
    """The gated delta-net's own small tensors (Qwen3-Next, Qwen3.5) that its class builds whether
    or not the files hold them: dt_bias and A_log (fp32) per value head of the rank, the gated
    norm over one value head, the causal convolution over the rank's q/k/v channels."""
    dims, tp = ck.dims, mem.tp
    heads_v, hd_v = dims.linear_num_value_heads or 0, dims.linear_value_head_dim or 0
    conv_dim = 2 * (dims.linear_key_dim or 0) + (dims.linear_value_dim or 0)
    kernel = int(ck.config.raw.get("linear_conv_kernel_dim")
                 or (ck.config.raw.get("text_config") or {}).get("linear_conv_kernel_dim") or 4)
    wanted = {"dt_bias": model_bytes * heads_v // tp, "A_log": 4 * heads_v // tp, "norm.weight": model_bytes * hd_v,
              "conv1d.weight": model_bytes * conv_dim // tp * kernel}
    for leaf, nbytes in wanted.items():
        if f"{parent}.{leaf}" not in ck.files:
            mem.built[f"{parent}.{leaf}"] = nbytes
