"""The model around the routed experts: attention and MLP sizes, MTP layers, and the quantized
linear layers vLLM builds from the checkpoint's non-expert tensors.

vLLM does not build one layer per checkpoint module: it fuses `q_proj/k_proj/v_proj` into one
`qkv_proj`, `gate_proj/up_proj` into `gate_up_proj`, MLA's `q_a_proj/kv_a_proj_with_mqa` into
`fused_qkv_a_proj`, Qwen3.5's `in_proj_qkv/in_proj_z` into `in_proj_qkvz` and `in_proj_b/in_proj_a`
into `in_proj_ba`, and each fused layer has one tensor-parallel role (column, row, replicated,
vocabulary).  `find_linear_layers` groups the checkpoint's quantized non-expert modules the way
the engine does, with each shard's output size read from the headers; planning them is
`plan_linear` (planning/linear.py).  Headers and config only: no tensor data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Callable

from wna16ctl.sources import formats
from wna16ctl.sources.architectures import architecture
from wna16ctl.sources.config import ModelConfig, WeightScheme
from wna16ctl.sources.headers import CheckpointFiles

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# tensor-parallel roles of vLLM's linear layer classes
COLUMN = "column"  # ColumnParallelLinear / MergedColumnParallelLinear: N split over ranks
QKV = "qkv"  # QKVParallelLinear: heads split, KV heads replicated when fewer than ranks
ROW = "row"  # RowParallelLinear: K split over ranks
REPLICATED = "replicated"  # ReplicatedLinear (or disable_tp): every rank holds it whole
VOCAB = "vocab"  # ParallelLMHead: the vocabulary (padded to 64) split over ranks
TP_ROLES = (COLUMN, QKV, ROW, REPLICATED, VOCAB)


@dataclass(frozen=True)
class ModelDims:
    """config.json sizes that decide tensor-parallel sharding outside the experts."""

    model_type: str
    text_model_type: str | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    num_experts: int | None
    mla: bool  # DeepSeek-V2/V3 multi-head latent attention (kv_lora_rank is set)
    q_lora_rank: int | None
    linear_num_key_heads: int | None  # Qwen3-Next / Qwen3.5 gated delta-net attention
    linear_num_value_heads: int | None
    linear_key_head_dim: int | None
    linear_value_head_dim: int | None

    @property
    def linear_key_dim(self) -> int | None:
        if self.linear_num_key_heads and self.linear_key_head_dim:
            return self.linear_num_key_heads * self.linear_key_head_dim
        return None

    @property
    def linear_value_dim(self) -> int | None:
        if self.linear_num_value_heads and self.linear_value_head_dim:
            return self.linear_num_value_heads * self.linear_value_head_dim
        return None


def _int(raw: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = raw.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def model_dims(config: ModelConfig) -> ModelDims:
    raw = config.raw
    heads = _int(raw, "num_attention_heads", "n_head", "num_heads")
    kv = _int(raw, "num_key_value_heads", "multi_query_group_num")
    head_dim = _int(raw, "head_dim")
    if head_dim is None and heads:
        head_dim = config.hidden_size // heads
    return ModelDims(
        model_type=config.model_type,
        text_model_type=raw.get("text_model_type") if isinstance(raw.get("text_model_type"), str) else None,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv if kv is not None else heads,
        head_dim=head_dim,
        vocab_size=_int(raw, "vocab_size", "padded_vocab_size"),
        num_experts=config.num_experts,
        mla=_int(raw, "kv_lora_rank") is not None,
        q_lora_rank=_int(raw, "q_lora_rank"),
        linear_num_key_heads=_int(raw, "linear_num_key_heads"),
        linear_num_value_heads=_int(raw, "linear_num_value_heads"),
        linear_key_head_dim=_int(raw, "linear_key_head_dim"),
        linear_value_head_dim=_int(raw, "linear_value_head_dim"),
    )


def moe_routing(config: ModelConfig) -> str | None:
    """vLLM's routing method for the model's routed experts (its `get_routing_method_type`, with
    what the model class passes: scoring function, renormalization, expert groups, correction
    bias); None for a model type whose routing is not known here."""
    raw = config.raw
    mt = raw.get("text_model_type") if isinstance(raw.get("text_model_type"), str) else config.model_type
    arch = architecture(mt)
    if arch is None or arch.routing is None:
        return None
    if arch.routing == "naive":
        return "RenormalizeNaive"  # softmax, always renormalized
    renormalize = bool(raw.get("norm_topk_prob", arch.norm_topk_prob_default))
    if arch.routing == "grouped":
        scoring = raw.get("scoring_func", "softmax")
        bias = raw.get("topk_method") == "noaux_tc"
        groups = raw.get("n_group", 1)
    elif arch.routing == "sigmoid_bias":
        scoring, bias, groups = "sigmoid", True, raw.get("n_group")
    else:
        scoring, bias, groups = "softmax", False, None
    if bias:
        if scoring != "sigmoid" or not renormalize:
            return "Unspecified"
        if (groups or 0) > 0:
            return "DeepSeekV3"
        return "MiniMax2" if raw.get("routed_scaling_factor") in (None, 1.0) else "Unspecified"
    if scoring == "sigmoid":
        return "SigmoidRenorm" if renormalize else "Sigmoid"
    if scoring == "softmax":
        return "RenormalizeNaive" if renormalize else "Default"
    return "Unspecified"


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def is_mtp(name: str, num_hidden_layers: int | None) -> bool:
    """Whether a module belongs to a multi-token-prediction (MTP) layer, which vLLM's decoder never
    builds: Qwen3.5/Qwen3-Next keep them under `mtp.`, DeepSeek-V3 and GLM-4.5 number them after the
    decoder layers (`model.layers.<num_hidden_layers + i>`).  vLLM loads them only as the draft
    model of MTP speculative decoding."""
    if name.startswith("mtp.") or ".mtp." in name:
        return True
    if num_hidden_layers is None:
        return False
    i = layer_index(name)
    return i is not None and i >= num_hidden_layers


@dataclass(frozen=True)
class LinearShard:
    module: str  # the checkpoint module, e.g. model.layers.0.self_attn.k_proj
    output_sizes: tuple[int, ...]  # the engine's output shards it fills (in_proj_qkv fills three)
    scheme: WeightScheme | None
    stored_packed: bool = True  # False: a shard the checkpoint stores unquantized (a plain weight)


@dataclass
class LinearLayer:
    """One linear layer as vLLM builds it, from one or more checkpoint modules."""

    name: str  # vLLM's layer name, e.g. model.layers.0.self_attn.qkv_proj
    kind: str  # e.g. "self_attn.qkv_proj" (the name without its layer path)
    layer_index: int | None
    tp_role: str  # one of TP_ROLES
    input_size: int  # K
    shards: list[LinearShard] = field(default_factory=list)
    head_dim: int | None = None  # QKV: head size (q and k); v head size is v rows / KV heads
    num_heads: int | None = None  # QKV: query heads as the layer counts them (gate heads included)
    num_kv_heads: int | None = None
    refused: str | None = None  # the engine builds this module unquantized: loading its packed tensors fails
    # the checkpoint's quant_method and quantization_config as written (the format's own method
    # steps read them), and the checkpoint modules whose names lie inside this layer's or its
    # shards' names, each with whether it stores integer tensors: what the engine's substring
    # matching of module lists filled from the safetensors metadata can see
    quant_method: str | None = field(default=None, compare=False)
    quant_raw: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    inner_modules: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return tuple(n for s in self.shards for n in s.output_sizes)

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def modules(self) -> list[str]:
        return [s.module for s in self.shards]

    @property
    def scheme(self) -> WeightScheme | None:
        return self.shards[0].scheme if self.shards else None

    @property
    def mixed_schemes(self) -> bool:
        return len({s.scheme for s in self.shards}) > 1


# multimodal towers: their own layer classes and sharding, not planned here (reported as unplaced)
_VISION = (".visual.", ".vision_tower.", ".vision_model.", ".mm_projector.", ".multi_modal_projector.", ".audio_tower.")

# checkpoint leaf -> (vLLM fused leaf, role, position in the fused layer)
_ATTN_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_GDN = {"in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1), "in_proj_b": ("in_proj_ba", 0),
        "in_proj_a": ("in_proj_ba", 1), "in_proj_qkvz": ("in_proj_qkvz", 0), "in_proj_ba": ("in_proj_ba", 0),
        "out_proj": ("out_proj", 0)}
_FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                 "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "in_proj_ba": ("in_proj_b", "in_proj_a"),
                 "in_proj_qkvz": ("in_proj_qkv", "in_proj_z")}
_UNQUANTIZED = {"gate": "the MoE router", "shared_expert_gate": "the shared-expert gate"}
_UNQUANTIZED_HEAD = ("the output projection (a ParallelLMHead is quantized only when a target names it: 'lm_head', "
                     "a regex matching it, or part of the class name; the class target 'Linear' is not)")


def _router_takes_quant(model_type: str | None) -> bool:
    arch = architecture(model_type)
    return arch is not None and arch.router_takes_quant


def _packed_nk(files: CheckpointFiles, module: str, scheme: WeightScheme | None,
               fmt: formats.InputFormat) -> tuple[int, int] | None:
    e = files.raw(f"{module}.{fmt.names.codes}")
    if e is None or len(e["shape"]) != 2:
        return None
    return fmt.codes_nk(list(e["shape"]), scheme)


def find_linear_layers(files: CheckpointFiles, config: ModelConfig) -> tuple[list[LinearLayer], list[str]]:
    """The quantized non-expert linear layers of the decoder as vLLM fuses them, and the names of
    quantized modules wna16ctl cannot place (MTP layers excluded: see `is_mtp`)."""
    quant = config.quant
    if quant is None:
        return [], []
    dims = model_dims(config)
    fmt = formats.of(quant)
    codes = fmt.names.codes
    modules = [n[: -len(codes) - 1] for n in files.names()
               if ".experts." not in n and n.endswith(f".{codes}")]
    modules = [m for m in modules if not is_mtp(m, dims.num_hidden_layers)]
    schemes = dict(zip(modules, quant.schemes_for(modules)))
    layers, unknown = _place_linear(files, config, modules, schemes, lambda m: _packed_nk(files, m, schemes[m], fmt))
    # an expert's module path (".experts.") is never part of a non-expert layer's name: left out
    stores_int = module_integer_flags((n, str((files.raw(n) or {}).get("dtype", ""))) for n in files.names()
                                      if ".experts." not in n) if fmt.engine_reads_module_dtypes and layers else {}
    for lay in layers:
        lay.quant_method, lay.quant_raw = quant.quant_method, quant.raw
        lay.inner_modules = inner_modules(stores_int, [lay.name, *lay.modules])
    return layers, unknown


_FLOAT_DTYPES = ("F16", "BF16", "F32")


def module_integer_flags(tensors: Iterable[tuple[str, str]]) -> dict[str, bool]:
    """Each module of the checkpoint (a tensor name without its last part) and whether it stores a
    tensor of a non-float dtype (vLLM's GPTQ/AWQ maybe_update_config reads the same metadata)."""
    out: dict[str, bool] = {}
    for name, dtype in tensors:
        module = name.rpartition(".")[0]
        out[module] = out.get(module, False) or dtype not in _FLOAT_DTYPES
    return out


def inner_modules(flags: dict[str, bool], names: list[str]) -> dict[str, bool]:
    """The modules of `flags` whose name is a substring of one of `names`, starting at a name's
    start or after a dot (module paths start at a component)."""
    out: dict[str, bool] = {}
    for name in names:
        starts = [0] + [i + 1 for i, ch in enumerate(name) if ch == "."]
        for a in starts:
            for b in range(a + 1, len(name) + 1):
                if name[a:b] in flags:
                    out[name[a:b]] = flags[name[a:b]]
    return out


def unquantized_linear_layers(files: CheckpointFiles, config: ModelConfig) -> tuple[list[LinearLayer], list[str]]:
    """The decoder's linear layers stored unquantized (a 2-D `weight`, no `weight_packed`), placed
    and fused by the same rules as `find_linear_layers`, and the 2-D weights that are no linear
    layer it knows (embeddings, the multimodal towers)."""
    dims = model_dims(config)
    modules = [n[: -len(".weight")] for n in files.names()
               if ".experts." not in n and n.endswith(".weight") and len((files.raw(n) or {}).get("shape", ())) == 2]
    codes = None if config.quant is None else formats.of(config.quant).names.codes
    modules = [m for m in modules if not is_mtp(m, dims.num_hidden_layers)
               and (codes is None or f"{m}.{codes}" not in files)]

    def nk(m: str) -> tuple[int, int] | None:
        rows, cols = (files.raw(f"{m}.weight") or {})["shape"]
        return int(rows), int(cols)

    return _place_linear(files, config, modules, {m: None for m in modules}, nk)


def _place_linear(files: CheckpointFiles, config: ModelConfig, modules: list[str],
                  schemes: dict[str, WeightScheme | None], nk_of: Callable[[str], tuple[int, int] | None]
                  ) -> tuple[list[LinearLayer], list[str]]:
    quant = config.quant
    dims = model_dims(config)
    layers: dict[str, LinearLayer] = {}
    slots: dict[str, dict[int, LinearShard]] = {}
    unknown: list[str] = []

    def add(name: str, kind: str, role: str, k: int, pos: int, shard: LinearShard, **extra: Any) -> None:
        lay = layers.get(name)
        if lay is None:
            lay = layers[name] = LinearLayer(name=name, kind=kind, layer_index=layer_index(name), tp_role=role,
                                             input_size=k, **extra)
            slots[name] = {}
        slots[name][pos] = shard

    for m in modules:
        s = schemes[m]
        nk = nk_of(m)
        if nk is None or any(v in f".{m}" for v in _VISION) or m.rpartition(".")[2] == "embed_tokens":
            unknown.append(m)
            continue
        n, k = nk
        parent, _, leaf = m.rpartition(".")
        block = parent.rpartition(".")[2]
        kind_of = (lambda fused: f"{block}.{fused}") if block else (lambda fused: fused)
        if m == "lm_head" or leaf == "lm_head":
            head = quant.vllm_head_scheme(m) if quant is not None and s is not None else s
            add(m, "lm_head", VOCAB, k, 0, LinearShard(m, (n,), s),
                refused=None if head is not None else _UNQUANTIZED_HEAD)
        elif leaf in _UNQUANTIZED:
            # the router (GateLinear, a ReplicatedLinear) receives the quant config only in the
            # model files the architecture table says; the others build it unquantized
            quantizable = leaf == "gate" and _router_takes_quant(dims.model_type)
            add(m, kind_of(leaf), REPLICATED, k, 0, LinearShard(m, (n,), s),
                refused=None if quantizable else _UNQUANTIZED[leaf])
        elif leaf in _ATTN_QKV and not dims.mla:
            hd = dims.head_dim or 0
            add(f"{parent}.qkv_proj", kind_of("qkv_proj"), QKV, k, _ATTN_QKV[leaf], LinearShard(m, (n,), s), head_dim=hd)
        elif dims.mla and leaf in ("q_a_proj", "kv_a_proj_with_mqa"):
            if dims.q_lora_rank is not None:  # fused into one replicated layer (disable_tp)
                add(f"{parent}.fused_qkv_a_proj", kind_of("fused_qkv_a_proj"), REPLICATED, k,
                    0 if leaf == "q_a_proj" else 1, LinearShard(m, (n,), s))
            else:
                add(m, kind_of(leaf), REPLICATED, k, 0, LinearShard(m, (n,), s))
        elif dims.mla and leaf in ("q_b_proj", "kv_b_proj", "q_proj"):
            add(m, kind_of(leaf), COLUMN, k, 0, LinearShard(m, (n,), s))
        elif leaf == "o_proj":
            add(m, kind_of(leaf), ROW, k, 0, LinearShard(m, (n,), s))
        elif leaf in _MLP:
            fused, pos = _MLP[leaf]
            role = ROW if fused == "down_proj" else COLUMN
            add(f"{parent}.{fused}", kind_of(fused), role, k, pos, LinearShard(m, (n,), s))
        elif leaf in _GDN:
            fused, pos = _GDN[leaf]
            role = ROW if fused == "out_proj" else COLUMN
            sizes: tuple[int, ...] = (n,)
            if leaf == "in_proj_qkv" and dims.linear_key_dim and dims.linear_value_dim \
                    and n == 2 * dims.linear_key_dim + dims.linear_value_dim:
                sizes = (dims.linear_key_dim, dims.linear_key_dim, dims.linear_value_dim)
            add(f"{parent}.{fused}", kind_of(fused), role, k, pos, LinearShard(m, sizes, s))
        else:
            unknown.append(m)
    out: list[LinearLayer] = []
    for name, lay in layers.items():
        # a fused layer whose other shards are stored unquantized: vLLM refuses the mixture
        parent, _, fused = name.rpartition(".")
        for pos, leaf in enumerate(_FUSED_SHARDS.get(fused, ())):
            if pos not in slots[name] and f"{parent}.{leaf}.weight" in files:
                slots[name][pos] = LinearShard(f"{parent}.{leaf}", (0,), None, stored_packed=False)
        lay.shards = [slots[name][p] for p in sorted(slots[name])]
        if lay.tp_role == QKV and lay.head_dim:
            q_rows = lay.shards[0].output_sizes[0] if lay.shards[0].module.endswith("q_proj") else 0
            kv_rows = next((sh.output_sizes[0] for sh in lay.shards if sh.module.endswith("k_proj")), 0)
            lay.num_heads = q_rows // lay.head_dim if q_rows else dims.num_attention_heads
            lay.num_kv_heads = kv_rows // lay.head_dim if kv_rows else dims.num_key_value_heads
        out.append(lay)
    out.sort(key=lambda x: (x.layer_index if x.layer_index is not None else 1 << 30, x.name))
    return out, sorted(unknown)
