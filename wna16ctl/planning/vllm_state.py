"""The `vllm` layout's plan: the exact tensors of every rank that a checkpoint, TP size (and expert
parallelism) and release resolve to, once `planning.vllm_support` takes the checkpoint.

`vllm serve OUT --load-format sharded_state -tp N` reads `model-rank-{rank}-part-{part}.safetensors`
from OUT and copies every tensor into the parameter of the same name of a freshly built model;
only then does vLLM run its weight processing (the Marlin repack and the rest).  What must be in
those files is therefore what a normal load would have put into the fresh parameters: the key
set, shapes and dtypes of `rules.VLLM_STATE_KEYS` for the release, each with its fill (how
`wna16ctl.layout.vllm_state` makes it from the checkpoint).  Torch-free.

Read by `repack --layout vllm` (repacking.vllm_state writes the plan), by `verify` of such an
output (verification.vllm_state) and by the next steps inspect offers, so that none of them
proposes what another refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from wna16ctl.dtypes import FLOAT_ST_OF_CONFIG, ST_SIZES
from wna16ctl.errors import BadInput, NotLoadable, UsageError
from wna16ctl.layout.spec import CODES, G_IDX, SCALES, VLLM, ZERO_POINTS
from wna16ctl.planning import rules
from wna16ctl.planning.methods import LINEAR_PARAMS
from wna16ctl.planning.methods.base import AWQ_LINEAR, AWQ_MARLIN_LINEAR, GPTQ_LINEAR
from wna16ctl.planning.moe import local_expert_ranges
from wna16ctl.planning.next_steps import NextStep
from wna16ctl.planning.vllm_support import check_supported, moe_methods
from wna16ctl.sources import Checkpoint, MoELayer, formats, open_checkpoint
from wna16ctl.sources.formats.face import SHAPE
from wna16ctl.sources.moe import _FAMILY_NAMES


PATTERN = "model-rank-{rank}-part-{part}.safetensors"  # vLLM's default sharded_state file pattern


@dataclass(frozen=True)
class StateTensor:
    """One key of one rank's state: its contract row resolved for a layer."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: BF16 / F16 / F32 / I32
    fill: str  # the row's fill with names resolved
    layer: int | None  # decoder layer index (None: model-level)

    @property
    def nbytes(self) -> int:
        n = ST_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class VllmStatePlan:
    checkpoint: Checkpoint
    tp: int
    vllm: str
    model_dtype: str  # config.json torch_dtype
    keys: list[list[StateTensor]]  # per rank, in file order
    parts: list[list[list[StateTensor]]]  # per rank, per file
    moe_layers: dict[int, MoELayer] = field(default_factory=dict)
    gpu: str = rules.DEFAULT_GPU
    # the backend planned for each MoE layer where the release's expert buffers depend on it
    # (rules state.experts_k_first), with the orientation it implies
    backends: dict[int, str] = field(default_factory=dict)
    k_first: dict[int, bool] = field(default_factory=dict)
    switches: Any = None  # planning.engine_env.EngineSwitches (None: the engine's defaults)
    out: str | None = None  # where it is to be written (named in the serve command; None: OUT)
    memory: dict[str, Any] | None = None  # a dry run's per-rank memory of the deployment (planning.deployment)
    ep: bool = False  # expert parallelism: each rank holds its local experts whole

    def files(self, rank: int) -> list[str]:
        return [PATTERN.format(rank=rank, part=p) for p in range(len(self.parts[rank]))]

    def experts_of(self, moe: MoELayer, rank: int) -> range:
        """The global experts `rank` holds, in the order of its expert buffers (all without EP)."""
        return experts_of(moe, self.tp, self.ep, rank)

    def serve_step(self, out: str | os.PathLike[str]) -> NextStep:
        """How the output at `out` is served: the one answer of `planning.serving.serve_path`."""
        from wna16ctl.planning.serving import serve_path

        step = serve_path(self.checkpoint, self.tp, ep=self.ep, version=self.vllm, gpu=self.gpu,
                          switches=self.switches, written=VLLM, out=os.fspath(out))
        assert step is not None  # a written vllm layout is always served by stock vLLM
        return step

    def serve_command(self, out: str | os.PathLike[str]) -> str:
        return self.serve_step(out).serve

    def experts_json(self) -> dict[str, Any]:
        """How the expert buffers are laid out, and the backend that decided it (where one did)."""
        k_first = sorted({self.k_first.get(layer, False) for layer in self.moe_layers})
        return {"orientation": "k_first" if k_first == [True] else "n_first" if k_first in ([False], []) else "mixed",
                "backend_decides": bool(self.backends),
                "backends": {str(layer): b for layer, b in sorted(self.backends.items())}}

    def to_json(self, out: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """The plan (`repack --layout vllm --dry-run --json`); `serve` names `out`, or OUT."""
        return {
            "checkpoint": str(self.checkpoint.root), "layout": VLLM, "tp": self.tp, "ep": self.ep, "vllm": self.vllm,
            "load_format": "sharded_state", "pattern": PATTERN, "gpu": self.gpu, "experts": self.experts_json(),
            "ranks": [{"rank": r, "files": self.files(r), "keys": len(self.keys[r]),
                       "bytes": sum(t.nbytes for t in self.keys[r])} for r in range(self.tp)],
            "serve": self.serve_command(out or self.out or "OUT"),
        }

    def result_json(self, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """What `repack --layout vllm --json` prints once `out` is written with `manifest`."""
        return {"output": str(out), "layout": VLLM, "tp": self.tp, "ep": self.ep, "vllm": self.vllm,
                "ranks": manifest["ranks"], "serve": manifest["serve"], "next_steps": [self.serve_step(out).to_json()]}


def experts_of(moe: MoELayer, tp: int, ep: bool, rank: int) -> range:
    """The global experts `rank` holds under `--ep` (vLLM's linear placement), in the order of its
    expert buffers; every expert without EP."""
    return local_expert_ranges(moe.num_experts, tp)[rank] if ep else range(moe.num_experts)


# -- planning (torch-free) ------------------------------------------------------------------------

def _when(ck: Checkpoint, cond: str | None, layer: int | None, moe: MoELayer | None,
          k_first: dict[int, bool] | None = None) -> bool:
    if cond is None:
        return True
    if " " in cond:
        return all(_when(ck, c, layer, moe, k_first) for c in cond.split())
    if cond in ("k_first", "n_first"):
        first = layer is not None and bool((k_first or {}).get(layer, False))
        return first if cond == "k_first" else not first
    names = ck.files
    tied = bool(ck.config.raw.get("tie_word_embeddings", False)) or "lm_head.weight" not in names
    if cond == "untied":
        return not tied
    if cond == "tied":
        return tied
    if cond == "asym":
        return moe is not None and moe.scheme is not None and not moe.scheme.symmetric
    if cond in ("act_order", "no_act_order"):
        ordered = moe is not None and moe.scheme is not None and moe.scheme.act_order
        return ordered == (cond == "act_order")
    if cond == "qkv_bias":
        return f"model.layers.{layer}.self_attn.q_proj.bias" in names
    if cond == "qk_norm":
        return f"model.layers.{layer}.self_attn.q_norm.weight" in names
    if cond in ("mla", "gqa"):
        return ck.dims.mla == (cond == "mla")
    if cond in ("q_lora", "no_q_lora"):
        return bool(ck.config.raw.get("q_lora_rank")) == (cond == "q_lora")
    if cond == "ct_config":
        return ck.config.quant is not None and formats.of(ck.config.quant) is formats.DEFAULT
    if cond == "noaux_tc":
        return ck.config.raw.get("topk_method") == "noaux_tc"
    raise AssertionError(f"unknown contract condition {cond}")


def _shared_size(ck: Checkpoint, layer: int, block: str, gate: str) -> int | None:
    """The shared expert's intermediate size (Qwen2-MoE `shared_expert`, DeepSeek/GLM `shared_experts`)."""
    for module in ("shared_expert", "shared_experts"):
        rows = _output_rows(ck, f"model.layers.{layer}.{block}.{module}.{gate}")
        if rows is not None:
            return rows
    return None


def _output_rows(ck: Checkpoint, module: str) -> int | None:
    """A linear module's output size: the rows of its weight, 16-bit or packed (packed along K)."""
    if f"{module}.weight" in ck.files:
        return ck.files.info(f"{module}.weight").shape[0]
    quant = ck.config.quant
    if quant is not None:
        fmt = formats.of(quant)
        name = fmt.names.tensor(module, CODES)
        if name in ck.files:  # the format says which side of its stored codes is N
            return fmt.codes_nk(list(ck.files.info(name).shape), quant.scheme_for(module))[0]
    return None


def _mla_sizes(ck: Checkpoint, split: Callable[[int, str], int]) -> dict[str, int]:
    """Multi-head latent attention: the per-rank rows of q_b_proj / q_proj, kv_b_proj and the
    columns of o_proj, and the replicated latent sizes (DeepSeek-V2/V3, Kimi-K2)."""
    raw = ck.config.raw
    heads = ck.dims.num_attention_heads or 1
    nope, rope, v = (int(raw.get(k) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    heads_n = split(heads, "num_attention_heads")
    q_lora = raw.get("q_lora_rank")
    return {"KVL": int(raw["kv_lora_rank"]), "R": rope, "QL": int(q_lora or 0),
            "QHn": heads_n * (nope + rope), "KVBn": heads_n * (nope + v), "On": heads_n * v}


def _sizes(ck: Checkpoint, tp: int, moe: MoELayer | None, layer: int | None, ep: bool = False,
           rank: int = 0) -> dict[str, int]:
    """The row symbols of one layer on `rank` (VLLM_STATE_SYMBOLS); under `ep` the routed experts
    are whole (their TP size is 1) and the rank holds only its local ones."""
    from wna16ctl.layout.vllm_state import kv_heads_per_rank, padded_vocab

    dims = ck.dims
    cfg = ck.config
    h = cfg.hidden_size
    heads, kv, hd = dims.num_attention_heads or 1, dims.num_key_value_heads or 1, dims.head_dim or 1
    vocab = dims.vocab_size or 0

    def split(size: int, what: str) -> int:
        if size % tp:
            raise NotLoadable(f"{ck.root}: {what} {size} is not a multiple of --tp {tp}; vLLM refuses this TP size")
        return size // tp

    try:
        kv_rank = 1 if dims.mla else kv_heads_per_rank(kv, tp)
    except ValueError as e:
        raise NotLoadable(f"{ck.root}: {e}") from None
    s: dict[str, int] = {"H": h, "n": tp, "hd": hd, "Qn": split(heads, "num_attention_heads") * hd,
                         "KVn": kv_rank * hd, "Vn": split(padded_vocab(vocab), "padded vocabulary")}
    if dims.mla:
        s |= _mla_sizes(ck, split)
    if layer is not None and moe is None:  # a dense MLP layer (DeepSeek / GLM first_k_dense_replace)
        rows = _output_rows(ck, f"model.layers.{layer}.mlp.gate_proj")
        if rows is not None:
            s["Dn"] = split(rows, f"model.layers.{layer}.mlp intermediate size")
    if moe is not None and moe.scheme is not None and layer is not None:
        pf = 32 // moe.scheme.num_bits
        i_n = moe.intermediate_size if ep else split(moe.intermediate_size, f"{moe.prefix}: intermediate size")
        g = moe.scheme.group_size
        s |= {"E": moe.num_experts, "Er": len(experts_of(moe, tp, ep, rank)), "In": i_n, "Hp": h // pf, "Inp": i_n // pf, "I2np": 2 * i_n // pf,
              "Hpz": h // pf, "G13": 1 if g == -1 else h // g, "G2": 1 if g == -1 else i_n // g,
              "G2f": 1 if g == -1 else moe.intermediate_size // g}
        if g != -1 and (h % g or i_n % g):
            raise NotLoadable(f"{moe.prefix}: intermediate size per rank {i_n} or hidden size {h} is not a multiple "
                              f"of group_size {g}; vLLM refuses --tp {tp}{' --ep' if ep else ''}")
        shared = _shared_size(ck, layer, moe.block.rsplit(".", 1)[-1], _FAMILY_NAMES[moe.family]["gate"])
        if shared is not None:
            s["Sn"] = split(shared, "shared_expert intermediate size")
    return s


def _resolve(text: str, layer: int | None, moe: MoELayer | None) -> str:
    names = _FAMILY_NAMES[moe.family] if moe is not None else _FAMILY_NAMES["gate_up_down"]
    block = moe.block.rsplit(".", 1)[-1] if moe is not None else "mlp"
    return text.format(L=layer, B=block, G=names["gate"], U=names["up"], D=names["down"])


def _eval_shape(shape: tuple[str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    # the expressions are the rulebook's own (a few symbols and + and *)
    return tuple(int(eval(expr, {"__builtins__": {}}, sizes)) for expr in shape)


def _rows_for(scope: str) -> list[rules.StateKey]:
    return [row for row in rules.VLLM_STATE_KEYS if row.scope == scope]


def _in_force(row: rules.StateKey, version: str, arch: str) -> bool:
    if row.archs is not None and arch not in row.archs:
        return False
    if row.rule is None:
        return True
    neg = row.rule.startswith("!")
    has = rules.release(version).has(row.rule.lstrip("!"))
    return has != neg


def _expert_orientation(ck: Checkpoint, tp: int, vllm: str, gpu: str, switches: Any, ep: bool = False
                        ) -> tuple[dict[int, str], dict[int, bool]]:
    """(backend per MoE layer, K-first per MoE layer) where the release's expert buffers depend on
    the backend (state.experts_k_first); empty where they do not."""
    from wna16ctl.planning.moe import Backend, plan_layer

    rel = rules.release(vllm)
    if not rel.has("state.experts_k_first"):
        return {}, {}
    n_first = {Backend.FLASHINFER_TRTLLM.value} | ({Backend.HUMMING.value} if rel.has("state.humming_n_first") else set())
    backends: dict[int, str] = {}
    k_first: dict[int, bool] = {}
    for lay in ck.layers:
        lp = plan_layer(lay, tp, ep, vllm, gpu, switches) if switches is not None else plan_layer(lay, tp, ep, vllm, gpu)
        if not lp.loadable or lp.backend is None:
            reason = (lp.errors or ["no backend loads it"])[0]
            raise NotLoadable(f"{lay.prefix}: vLLM {vllm} on {gpu} does not load this layer at --tp {tp}"
                              f"{' --ep' if ep else ''}: {reason}")
        if lay.layer_index is not None:  # keyed by decoder layer, as the keys are
            backends[lay.layer_index] = lp.backend.value
            k_first[lay.layer_index] = lp.backend.value not in n_first
    return backends, k_first


def plan_vllm_state(ckpt: str | os.PathLike[str] | Checkpoint, tp: int, vllm: str, *,
                    max_shard_bytes: int = 4 << 30, gpu: str = rules.DEFAULT_GPU,
                    switches: Any = None, ep: bool = False) -> VllmStatePlan:
    """The exact tensors of every rank (`ep`: under --enable-expert-parallel).  `gpu` and `switches`
    (planning.engine_env.EngineSwitches) matter only for releases whose expert buffers follow the
    backend (state.experts_k_first)."""
    ck = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    check_supported(ck, vllm)
    methods = moe_methods(ck, tp, vllm, gpu, switches, ep)
    # only compressed-tensors' expert buffers follow the backend; the GPTQ/AWQ methods' are K-first always
    ct = all(m == rules.CT_MOE_METHOD for m in methods.values())
    backends, k_first = _expert_orientation(ck, tp, vllm, gpu, switches, ep) if ct else ({}, {})
    dtype_name = ck.config.torch_dtype
    if dtype_name not in FLOAT_ST_OF_CONFIG:
        raise BadInput(f"{ck.config.path}: torch_dtype {dtype_name!r} is not bfloat16, float16 or float32")
    moe_by_layer = {lay.layer_index: lay for lay in ck.layers if lay.layer_index is not None}
    # the ranks' keys differ only in the number of local experts under EP: one plan per count
    by_count: dict[tuple[int, ...], list[StateTensor]] = {}
    per_rank = []
    for rank in range(tp):
        count = tuple(len(experts_of(moe, tp, ep, rank)) for moe in moe_by_layer.values())
        if count not in by_count:
            keys = _quantized_linear(ck, _rank_keys(ck, tp, vllm, moe_by_layer, k_first, ep, rank, methods), tp, vllm,
                                     gpu, switches)
            _check_sources(ck, keys)
            by_count[count] = keys
        per_rank.append(list(by_count[count]))
    parts = [_split_parts(k, max_shard_bytes) for k in per_rank]
    return VllmStatePlan(ck, tp, vllm, dtype_name, per_rank, parts, moe_by_layer, gpu, backends, k_first, switches,
                         ep=ep)


def _rank_keys(ck: Checkpoint, tp: int, vllm: str, moe_by_layer: dict[int, MoELayer], k_first: dict[int, bool],
               ep: bool, rank: int, methods: dict[int, str]) -> list[StateTensor]:
    """The contract's rows resolved for one rank, in the order vLLM's model registers them (the
    quantized linear layers still as their 16-bit rows); `methods`: the MoE method of each MoE layer."""
    model_st = FLOAT_ST_OF_CONFIG[ck.config.torch_dtype]
    arch = ck.config.model_type

    def resolved(row: rules.StateKey, layer: int | None, moe: MoELayer | None, sizes: dict[str, int]) -> StateTensor:
        dtype = model_st if row.dtype == "model" else row.dtype
        return StateTensor(_resolve(row.key, layer, moe), _eval_shape(row.shape, sizes), dtype,
                           _resolve(row.fill, layer, moe), layer)

    keys: list[StateTensor] = []
    base = _sizes(ck, tp, None, None)
    model_rows = [r for r in _rows_for("model") if _in_force(r, vllm, arch) and _when(ck, r.when, None, None)]
    keys += [resolved(r, None, None, base) for r in model_rows if r.key.startswith("model.embed")]
    for layer in range(ck.config.num_hidden_layers or 0):
        moe = moe_by_layer.get(layer)
        sizes = _sizes(ck, tp, moe, layer, ep, rank)
        scopes = ["layer"] + (["moe"] + (["shared"] if "Sn" in sizes else []) if moe is not None else ["dense"])
        for scope in scopes:
            for row in _rows_for(scope):
                if row.method is not None and row.method != methods.get(layer):
                    continue  # another MoE method's parameters
                if _in_force(row, vllm, arch) and _when(ck, row.when, layer, moe, k_first):
                    keys.append(resolved(row, layer, moe, sizes))
    keys += [resolved(r, None, None, base) for r in model_rows if not r.key.startswith("model.embed")]
    return keys


def _source_names(fill: str) -> list[str]:
    """The checkpoint tensors a fill reads (none for the expert and constant fills)."""
    verb, _, arg = fill.partition(" ")
    verb = verb.removesuffix("_k")  # a GPTQ/AWQ tensor's cut reads the same tensors
    if verb in ("copy", "vocab", "column", "row"):
        return [arg]
    if verb == "qkv":
        return [arg.replace(".q_proj.", f".{p}_proj.") for p in "qkv"]
    if verb in ("merged", "cat"):
        return arg.split()
    return []


def _check_sources(ck: Checkpoint, keys: list[StateTensor]) -> None:
    """Every checkpoint tensor a key is made from exists: one line naming the first that does not."""
    for t in keys:
        for name in _source_names(t.fill):
            if name not in ck.files:
                raise ck.files.missing(name)


# -- quantized linear layers ---------------------------------------------------------------------
# CompressedTensorsWNA16.create_weights registers, on every quantized linear layer (every release of
# VLLM_STATE_SUPPORT, whichever kernel choose_mp_linear_kernel picks: the kernel only reads them
# in process_weights_after_loading), in this order:
#   weight_packed     int32 [N/rank, K/rank / pack]        (PackedvLLMParameter, packed along K)
#   weight_scale      dtype [N/rank, K/rank / group]       (GroupQuantScaleParameter), or [N, K / group]
#                     whole on every rank for channel-wise scales of a row-parallel layer
#                     (marlin_repeat_scales_on_all_ranks: ChannelQuantScaleParameter has no input dim)
#   weight_shape      int64 [2]                            (BasevLLMParameter: every shard's load copies
#                     the checkpoint's whole weight_shape, so the one loaded last is kept)
#   weight_zero_point int32 [N/rank / pack, groups]        (asymmetric only; packed along N, cut like the
#                     scales)
# The 16-bit row of the contract gives the per-rank [N, K] and how the layer cuts it (its fill verb).
_LINEAR_VERBS = ("qkv", "row", "column", "merged", "cat", "copy")


def _load_order(ck: Checkpoint, name: str) -> tuple[list[Any], str]:
    """Where vLLM's safetensors iterator yields `name` (the later of two is kept)."""
    return ck.files.load_order(name)


def _quantized_linear(ck: Checkpoint, keys: list[StateTensor], tp: int, vllm: str, gpu: str, switches: Any
                      ) -> list[StateTensor]:
    """`keys` with every 16-bit linear row whose checkpoint modules are quantized replaced by the
    parameters vLLM creates for it; a quantized layer no row reads is refused."""
    by_module = {m: lin for lin in ck.linear_layers for m in lin.modules}
    written: set[str] = set()
    out: list[StateTensor] = []
    for t in keys:
        verb = t.fill.partition(" ")[0]
        modules = [n[: -len(".weight")] for n in _source_names(t.fill) if n.endswith(".weight")]
        if verb not in _LINEAR_VERBS or not t.key.endswith(".weight") or not any(m in by_module for m in modules):
            out.append(t)
            continue
        lins = {by_module[m].name for m in modules if m in by_module}
        if len(lins) > 1 or not all(m in by_module for m in modules):
            raise UsageError(f"--layout vllm: {t.key}: vLLM fuses {', '.join(modules)} into one layer, and the "
                             "checkpoint quantizes only some of them; vLLM requires one scheme for all")
        lin = by_module[modules[0]]
        method = _linear_loads(lin, tp, vllm, gpu, switches, ck.config.torch_dtype)
        written.add(lin.name)
        if method in FORMAT_LINEAR_PARAMS:
            out += _format_linear_params(ck, t, lin, modules, tp, vllm, method)
        else:
            out += _linear_params(ck, t, lin, modules, tp)
    for lin in ck.linear_layers:
        if lin.name not in written:
            _linear_loads(lin, tp, vllm, gpu, switches, ck.config.torch_dtype)
            raise UsageError(f"--layout vllm: {lin.name}: a quantized {lin.kind} is not written by the vllm layout; "
                             "use --layout marlin or transposed")
    return out


def _linear_loads(lin: Any, tp: int, vllm: str, gpu: str, switches: Any, dtype: str) -> str | None:
    """The linear method class vLLM builds for the layer (None: compressed-tensors'); NotLoadable
    where the release does not load the layer at this TP size (planning.linear)."""
    from wna16ctl.planning.linear import plan_linear

    extra = {"switches": switches} if switches is not None else {}
    lp = plan_linear(lin, tp, vllm, gpu, dtype if dtype in FLOAT_ST_OF_CONFIG else "bfloat16", **extra)
    if not lp.loadable:
        reason = (lp.errors or ["no kernel loads it"])[0].splitlines()[0]
        raise NotLoadable(f"{lin.name}: vLLM {vllm} on {gpu} does not load this layer at --tp {tp}: {reason}")
    return lp.method


def _linear_params(ck: Checkpoint, t: StateTensor, lin: Any, modules: list[str], tp: int) -> list[StateTensor]:
    """The quantized parameters of the layer a 16-bit row `t` stands for (see the table above)."""
    s = lin.scheme
    verb, _, arg = t.fill.partition(" ")
    pack = 32 // s.num_bits
    n, k = t.shape
    whole = verb == "row" and s.group_size == -1  # channel scales of a row-parallel layer: every rank whole
    groups = 1 if s.group_size == -1 else k // s.group_size
    # zero points are packed along N: each part a rank holds must start on a word
    parts = {"qkv": [ck.dims.head_dim or 1], "merged": [(_output_rows(ck, m) or 0) // tp for m in modules],
             "cat": [_output_rows(ck, m) or 0 for m in modules]}.get(verb, [n])
    odd = [f"per-rank input size {k}"] if k % pack else []
    if not s.symmetric:
        odd += [f"output rows {u} (zero points)" for u in parts if u % pack]
    if odd:
        raise UsageError(f"--layout vllm: {lin.name}: {odd[0]} is not a whole number of {s.num_bits}-bit codes per "
                         "int32 word; the vllm layout does not split such words by rank")

    stored = formats.of(ck.config.quant).names  # the checkpoint's tensors, by role

    def fill(role: str, how: str = verb) -> str:
        return f"{how} " + " ".join(stored.tensor(name[: -len(".weight")], role) for name in arg.split())

    base = t.key[: -len("weight")]  # the layer's parameters: vLLM's names (planning.methods)
    shape_src = max((stored.tensor(m, SHAPE) for m in modules), key=lambda name: _load_order(ck, name)
                    if name in ck.files else ([], name))
    params = [StateTensor(base + LINEAR_PARAMS[CODES], (n, k // pack), "I32", fill(CODES), t.layer),
              StateTensor(base + LINEAR_PARAMS[SCALES], (n, groups), t.dtype,
                          fill(SCALES, "copy" if whole else verb), t.layer),
              StateTensor(base + LINEAR_PARAMS[SHAPE], (2,), "I64", f"copy {shape_src}", t.layer)]
    if not s.symmetric:
        params.append(StateTensor(base + LINEAR_PARAMS[ZERO_POINTS], (n // pack, groups), "I32",
                                  fill(ZERO_POINTS, "copy" if whole else verb), t.layer))
    return params


# The GPTQ and AWQ linear methods (quantization/auto_gptq.py AutoGPTQLinearMethod, auto_awq.py
# AutoAWQMarlinLinearMethod and AutoAWQLinearMethod; auto-round's INC linear scheme builds the same
# methods) register the checkpoint's tensors as stored, K first:
#   qweight int32 GPTQ [K/rank / pack, N/rank] (packed along K); AWQ [K/rank, N/rank / pack] (along N)
#   scales  dtype [K/rank / group, N/rank]; whole on every rank for a row-parallel layer whose scales
#           are channel-wise or (GPTQ before state.gptq_act_order ends) act-ordered
#           (marlin_repeat_scales_on_all_ranks: ChannelQuantScaleParameter has no input dim)
#   qzeros  int32 [K/rank / group, N/rank / pack] (packed along N, cut like the scales); GPTQ
#           registers it symmetric or not
#   g_idx   int32 [K/rank] (GPTQ, state.gptq_act_order): a row-parallel layer's is cut by rank; a
#           fused column-parallel layer loads each part's whole g_idx into it, so the part loaded
#           last is kept
# The 16-bit row's fill verb cuts the N-first view of each tensor (its `_k` form transposes around it).
FORMAT_LINEAR_PARAMS = {GPTQ_LINEAR: {CODES: "qweight", SCALES: "scales", ZERO_POINTS: "qzeros", G_IDX: "g_idx"},
                        AWQ_MARLIN_LINEAR: {CODES: "qweight", SCALES: "scales", ZERO_POINTS: "qzeros"},
                        AWQ_LINEAR: {CODES: "qweight", SCALES: "scales", ZERO_POINTS: "qzeros"}}


def _format_linear_params(ck: Checkpoint, t: StateTensor, lin: Any, modules: list[str], tp: int, vllm: str,
                          method: str) -> list[StateTensor]:
    """The parameters a GPTQ or AWQ linear method registers for the layer a 16-bit row `t` stands for."""
    s = lin.scheme
    params = FORMAT_LINEAR_PARAMS[method]
    verb, _, arg = t.fill.partition(" ")
    pack = 32 // s.num_bits
    n, k = t.shape
    gptq = G_IDX in params
    act_order = gptq and s.act_order and rules.release(vllm).has("state.gptq_act_order")
    whole = gptq and verb == "row" and (s.group_size == -1 or act_order)
    full_k = k * tp if verb == "row" else k
    # the group size normalised as the methods do (channel-wise: the whole input size)
    groups = (full_k if whole else k) // (full_k if s.group_size == -1 else s.group_size)
    if not groups:
        raise UsageError(f"--layout vllm: {lin.name}: channel-wise AWQ scales of a row-parallel layer: vLLM "
                         f"creates {k} // {full_k} = 0 groups per rank (AutoAWQMarlinLinearMethod.create_weights), "
                         "which no state can fill")
    parts = {"qkv": [ck.dims.head_dim or 1], "merged": [(_output_rows(ck, m) or 0) // tp for m in modules],
             "cat": [_output_rows(ck, m) or 0 for m in modules]}.get(verb, [n])
    odd = [f"per-rank input size {k}"] if gptq and k % pack else []
    odd += [f"output rows {u}" for u in parts if u % pack]  # qzeros (and AWQ's codes) are packed along N
    if odd:
        raise UsageError(f"--layout vllm: {lin.name}: {odd[0]} is not a whole number of {s.num_bits}-bit codes per "
                         "int32 word; the vllm layout does not split such words by rank")
    stored = formats.of(ck.config.quant).names
    names = [n_[: -len(".weight")] for n_ in arg.split()]

    def fill(role: str, how: str = verb) -> str:
        cut = how if how == "copy" else f"{how}_k"
        return f"{cut} " + " ".join(stored.tensor(m, role) for m in names)

    base = t.key[: -len("weight")]
    codes = (k // pack, n) if gptq else (k, n // pack)
    out = [StateTensor(base + params[CODES], codes, "I32", fill(CODES), t.layer),
           StateTensor(base + params[SCALES], (groups, n), t.dtype, fill(SCALES, "copy" if whole else verb), t.layer),
           StateTensor(base + params[ZERO_POINTS], (groups, n // pack), "I32",
                       fill(ZERO_POINTS, "copy" if whole else verb), t.layer)]
    if gptq and rules.release(vllm).has("state.gptq_act_order"):
        out.append(StateTensor(base + params[G_IDX], (k,), "I32", _g_idx_fill(ck, verb, modules, stored), t.layer))
    return out


def _g_idx_fill(ck: Checkpoint, verb: str, modules: list[str], stored: Any) -> str:
    """How a GPTQ linear layer's g_idx parameter is filled: a row-parallel layer's K entries of this
    rank (`column` cuts a 1-D tensor's first dimension); a column-parallel layer's the whole g_idx
    of the part loaded last; zeros where the checkpoint stores none (nothing is loaded into it)."""
    present = [stored.tensor(m, G_IDX) for m in modules if stored.tensor(m, G_IDX) in ck.files]
    if not present:
        return "const 0"
    if verb == "row":
        return f"column {present[0]}"
    return f"copy {max(present, key=lambda name: _load_order(ck, name))}"


def _split_parts(keys: list[StateTensor], max_bytes: int) -> list[list[StateTensor]]:
    """Files of at most `max_bytes` (a tensor larger than that gets a file of its own), keys in order."""
    parts: list[list[StateTensor]] = [[]]
    size = 0
    for t in keys:
        if parts[-1] and size + t.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return parts
