"""`repack --layout vllm`: each rank's pre-processing parameter state for stock vLLM.

`vllm serve OUT --load-format sharded_state -tp N` reads `model-rank-{rank}-part-{part}.safetensors`
from OUT and copies every tensor into the parameter of the same name of a freshly built model;
only then does vLLM run its weight processing (the Marlin repack and the rest).  What must be in
those files is therefore what a normal load would have put into the fresh parameters: the key
set, shapes and dtypes of `rules.VLLM_STATE_KEYS` for the release, filled the way vLLM's weight
loaders fill them (`wna16ctl.layout.vllm_state`).

Planning (`plan_vllm_state`) resolves the contract for one checkpoint, TP size and release into
the exact tensors of every rank; `write_vllm_state` builds and writes them through the staged
output of `writer.StagedOutput` (atomic commit, manifest); `verify_vllm_state` checks an output
against the contract and inverts every tensor back to the checkpoint, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from wna16ctl.version import __version__
from wna16ctl.planning import rules
from wna16ctl.planning.vllm_state import check_supported
from wna16ctl.sources import Checkpoint, MoELayer, open_checkpoint
from wna16ctl.sources.moe import _FAMILY_NAMES
from wna16ctl.dtypes import FLOAT_ST_OF_CONFIG, ST_SIZES, torch_dtype
from wna16ctl.errors import BadInput, NotLoadable, UsageError
from wna16ctl.output.manifest import FORMAT_NAME, FORMAT_VERSION, SIDE_FILES
from wna16ctl.sink import human_bytes, plural

LAYOUT = "vllm"
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
    moe_layers: dict[int | None, MoELayer] = field(default_factory=dict)  # by layer_index
    gpu: str = rules.DEFAULT_GPU
    # the backend planned for each MoE layer where the release's expert buffers depend on it
    # (rules state.experts_k_first), with the orientation it implies
    backends: dict[int | None, str] = field(default_factory=dict)
    k_first: dict[int | None, bool] = field(default_factory=dict)
    switches: Any = None  # planning.engine_env.EngineSwitches (None: the engine's defaults)

    def files(self, rank: int) -> list[str]:
        return [PATTERN.format(rank=rank, part=p) for p in range(len(self.parts[rank]))]

    def serve_command(self, out: str | os.PathLike[str]) -> str:
        return serve_command(out, self.tp)

    def experts_json(self) -> dict[str, Any]:
        """How the expert buffers are laid out, and the backend that decided it (where one did)."""
        k_first = sorted({self.k_first.get(layer, False) for layer in self.moe_layers})
        return {"orientation": "k_first" if k_first == [True] else "n_first" if k_first in ([False], []) else "mixed",
                "backend_decides": bool(self.backends),
                "backends": {str(layer): b for layer, b in sorted(self.backends.items())}}

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint.root), "layout": LAYOUT, "tp": self.tp, "vllm": self.vllm,
            "load_format": "sharded_state", "pattern": PATTERN, "gpu": self.gpu, "experts": self.experts_json(),
            "ranks": [{"rank": r, "files": self.files(r), "keys": len(self.keys[r]),
                       "bytes": sum(t.nbytes for t in self.keys[r])} for r in range(self.tp)],
        }


def serve_command(out: str | os.PathLike[str], tp: int) -> str:
    from wna16ctl.planning.next_steps import VLLM_LAYOUT, serve_command as serve

    return serve(out, VLLM_LAYOUT, tp)


# -- planning (torch-free) ------------------------------------------------------------------------

def _size(value: int | None, name: str) -> int:
    """A config.json size the key contract was built from (BadInput should the config lack it)."""
    if value is None:
        raise BadInput(f"config.json: {name} is missing; the vllm layout needs it")
    return value


def _layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _when(ck: Checkpoint, cond: str | None, layer: int | None, moe: MoELayer | None,
          k_first: dict[int | None, bool] | None = None) -> bool:
    if cond is None:
        return True
    if " " in cond:
        return all(_when(ck, c, layer, moe, k_first) for c in cond.split())
    if cond in ("k_first", "n_first"):
        first = bool((k_first or {}).get(layer, False))
        return first if cond == "k_first" else not first
    names = ck.files
    tied = bool(ck.config.raw.get("tie_word_embeddings", False)) or "lm_head.weight" not in names
    if cond == "untied":
        return not tied
    if cond == "tied":
        return tied
    if cond == "asym":
        return moe is not None and moe.scheme is not None and not moe.scheme.symmetric
    if cond == "qkv_bias":
        return f"model.layers.{layer}.self_attn.q_proj.bias" in names
    if cond == "qk_norm":
        return f"model.layers.{layer}.self_attn.q_norm.weight" in names
    if cond in ("mla", "gqa"):
        return ck.dims.mla == (cond == "mla")
    if cond in ("q_lora", "no_q_lora"):
        return bool(ck.config.raw.get("q_lora_rank")) == (cond == "q_lora")
    if cond == "noaux_tc":
        return ck.config.raw.get("topk_method") == "noaux_tc"
    raise AssertionError(f"unknown contract condition {cond}")


def _shared_size(ck: Checkpoint, layer: int | None, block: str, gate: str) -> int | None:
    """The shared expert's intermediate size (Qwen2-MoE `shared_expert`, DeepSeek/GLM `shared_experts`)."""
    for module in ("shared_expert", "shared_experts"):
        name = f"model.layers.{layer}.{block}.{module}.{gate}.weight"
        if name in ck.files:
            return ck.files.info(name).shape[0]
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


def _sizes(ck: Checkpoint, tp: int, moe: MoELayer | None, layer: int | None) -> dict[str, int]:
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
        name = f"model.layers.{layer}.mlp.gate_proj.weight"
        if name in ck.files:
            s["Dn"] = split(ck.files.info(name).shape[0], f"model.layers.{layer}.mlp intermediate size")
    if moe is not None and moe.scheme is not None:
        pf = 32 // moe.scheme.num_bits
        i_n = split(moe.intermediate_size, f"{moe.prefix}: intermediate size")
        g = moe.scheme.group_size
        s |= {"E": moe.num_experts, "In": i_n, "Hp": h // pf, "Inp": i_n // pf, "I2np": 2 * i_n // pf,
              "Hpz": h // pf, "G13": 1 if g == -1 else h // g, "G2": 1 if g == -1 else i_n // g}
        if g != -1 and (h % g or i_n % g):
            raise NotLoadable(f"{moe.prefix}: intermediate size per rank {i_n} or hidden size {h} is not a multiple "
                              f"of group_size {g}; vLLM refuses --tp {tp}")
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


def _expert_orientation(ck: Checkpoint, tp: int, vllm: str, gpu: str, switches: Any
                        ) -> tuple[dict[int | None, str], dict[int | None, bool]]:
    """(backend per MoE layer, K-first per MoE layer) where the release's expert buffers depend on
    the backend (state.experts_k_first); empty where they do not."""
    from wna16ctl.planning.moe import Backend, plan_layer

    rel = rules.release(vllm)
    if not rel.has("state.experts_k_first"):
        return {}, {}
    n_first = {Backend.FLASHINFER_TRTLLM.value} | ({Backend.HUMMING.value} if rel.has("state.humming_n_first") else set())
    backends: dict[int | None, str] = {}
    k_first: dict[int | None, bool] = {}
    for lay in ck.layers:
        lp = plan_layer(lay, tp, False, vllm, gpu, switches) if switches is not None else plan_layer(lay, tp, False, vllm, gpu)
        if not lp.loadable or lp.backend is None:
            reason = (lp.errors or ["no backend loads it"])[0]
            raise NotLoadable(f"{lay.prefix}: vLLM {vllm} on {gpu} does not load this layer at --tp {tp}: {reason}")
        backends[lay.layer_index] = lp.backend.value
        k_first[lay.layer_index] = lp.backend.value not in n_first
    return backends, k_first


def plan_vllm_state(ckpt: str | os.PathLike[str] | Checkpoint, tp: int, vllm: str, *,
                    max_shard_bytes: int = 4 << 30, gpu: str = rules.DEFAULT_GPU,
                    switches: Any = None) -> VllmStatePlan:
    """The exact tensors of every rank.  `gpu` and `switches` (planning.engine_env.EngineSwitches)
    matter only for releases whose expert buffers follow the backend (state.experts_k_first)."""
    ck = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    check_supported(ck, vllm)
    backends, k_first = _expert_orientation(ck, tp, vllm, gpu, switches)
    dtype_name = ck.config.torch_dtype
    if dtype_name not in FLOAT_ST_OF_CONFIG:
        raise BadInput(f"{ck.config.path}: torch_dtype {dtype_name!r} is not bfloat16, float16 or float32")
    model_st = FLOAT_ST_OF_CONFIG[dtype_name]
    moe_by_layer = {lay.layer_index: lay for lay in ck.layers}
    arch = ck.config.model_type
    n_layers = ck.config.num_hidden_layers or 0

    def resolved(row: rules.StateKey, layer: int | None, moe: MoELayer | None, sizes: dict[str, int]) -> StateTensor:
        dtype = model_st if row.dtype == "model" else row.dtype
        return StateTensor(_resolve(row.key, layer, moe), _eval_shape(row.shape, sizes), dtype,
                           _resolve(row.fill, layer, moe), layer)

    keys: list[StateTensor] = []
    base = _sizes(ck, tp, None, None)
    model_rows = [r for r in _rows_for("model") if _in_force(r, vllm, arch) and _when(ck, r.when, None, None)]
    keys += [resolved(r, None, None, base) for r in model_rows if r.key.startswith("model.embed")]
    for layer in range(n_layers):
        moe = moe_by_layer.get(layer)
        sizes = _sizes(ck, tp, moe, layer)
        scopes = ["layer"] + (["moe"] + (["shared"] if "Sn" in sizes else []) if moe is not None else ["dense"])
        for scope in scopes:
            for row in _rows_for(scope):
                if _in_force(row, vllm, arch) and _when(ck, row.when, layer, moe, k_first):
                    keys.append(resolved(row, layer, moe, sizes))
    keys += [resolved(r, None, None, base) for r in model_rows if not r.key.startswith("model.embed")]
    _check_sources(ck, keys)
    per_rank = [list(keys) for _ in range(tp)]  # every rank holds the same keys and shapes
    parts = [_split_parts(k, max_shard_bytes) for k in per_rank]
    return VllmStatePlan(ck, tp, vllm, dtype_name, per_rank, parts, moe_by_layer, gpu, backends, k_first, switches)


def _check_sources(ck: Checkpoint, keys: list[StateTensor]) -> None:
    """Every checkpoint tensor a key is made from exists: one line naming the first that does not."""
    for t in keys:
        verb, _, arg = t.fill.partition(" ")
        if verb in ("copy", "vocab", "column", "row"):
            names = [arg]
        elif verb == "qkv":
            names = [arg.replace(".q_proj.", f".{p}_proj.") for p in "qkv"]
        elif verb in ("merged", "cat"):
            names = arg.split()
        else:
            continue
        for name in names:
            if name not in ck.files:
                raise ck.files.missing(name)


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


# -- building (torch) ------------------------------------------------------------------------------

def _torch_dtype(st: str) -> Any:
    return torch_dtype(st)


def build_tensor(plan: VllmStatePlan, reader: Any, t: StateTensor, rank: int) -> Any:
    """The value of key `t` on `rank`, made from the checkpoint the way vLLM's loaders make it."""
    import torch

    from wna16ctl.layout import vllm_state as vs

    dtype = _torch_dtype(t.dtype)
    tp = plan.tp
    verb, _, arg = t.fill.partition(" ")
    if verb == "const":
        out = torch.full(t.shape, float(arg), dtype=dtype)
    elif verb == "copy":
        out = reader.read(arg)
    elif verb == "vocab":
        out = vs.vocab_shard(reader.read(arg), tp, rank)
    elif verb == "column":
        out = vs.column_shard(reader.read(arg), tp, rank)
    elif verb == "row":
        out = vs.row_shard(reader.read(arg), tp, rank)
    elif verb == "merged":
        out = vs.merged_column_shard([reader.read(n) for n in arg.split()], tp, rank)
    elif verb == "cat":  # a replicated layer fused from several checkpoint ones (fused_qkv_a_proj)
        out = torch.cat([reader.read(n).to(dtype) for n in arg.split()], 0)
    elif verb == "qkv":
        dims = plan.checkpoint.dims
        q, k, v = (reader.read(arg.replace(".q_proj.", f".{p}_proj.")) for p in "qkv")
        out = vs.qkv_shard(q, k, v, _size(dims.num_attention_heads, "num_attention_heads"),
                           _size(dims.num_key_value_heads, "num_key_value_heads"), _size(dims.head_dim, "head_dim"),
                           tp, rank)
    elif verb in ("w13", "w2", "w13t", "w2t", "shape13", "shape2"):
        out = _expert_tensor(plan, reader, plan.moe_layers[t.layer], verb, arg, rank, dtype)
    else:
        raise AssertionError(f"unknown fill {t.fill}")
    # vLLM copies a loaded tensor into its parameter: a dtype conversion where they differ
    out = out.to(dtype).contiguous()
    if tuple(out.shape) != t.shape:
        raise BadInput(f"{plan.checkpoint.root}: {t.key} came out {tuple(out.shape)}, the contract says {t.shape}; "
                       "the checkpoint's tensors do not match its config.json")
    return out


def _expert_tensor(plan: VllmStatePlan, reader: Any, moe: MoELayer, verb: str, suffix: str, rank: int,
                   dtype: Any) -> Any:
    import torch

    from wna16ctl.layout import vllm_state as vs

    tp = plan.tp
    assert moe.scheme is not None, "the key contract holds expert tensors of quantized layers only"
    channel = moe.scheme.group_size == -1
    if verb in ("shape13", "shape2"):
        # vLLM writes the checkpoint's weight_shape of each projection into the expert's row; of
        # gate and up (the same values in a valid checkpoint) up's is loaded last and kept
        role = "up" if verb == "shape13" else "down"
        rows = []
        for e in range(moe.num_experts):
            name = moe.tensor_name(e, role, "weight_shape")
            if name not in reader.files:
                raise reader.files.missing(name)
            rows.append(reader.read(name))
        return vs.weight_shape_rows(rows, dtype)
    per_expert = []
    transposed = verb.endswith("t")  # K-first buffers: the loader transposes each checkpoint tensor
    verb = verb.rstrip("t")
    for e in range(moe.num_experts):
        if verb == "w13":
            gate, up = (_expert_read(reader, moe, e, role, suffix) for role in ("gate", "up"))
            per_expert.append(vs.w13_shard(gate, up, tp, rank))
        else:
            down = _expert_read(reader, moe, e, "down", suffix)
            per_expert.append(vs.w2_shard(down, tp, rank, whole=channel and suffix == "weight_scale"))
    if per_expert[0].dtype != torch.int32:  # scales: converted to the parameter's dtype
        per_expert = [p.to(dtype) for p in per_expert]
    if transposed:
        per_expert = [p.t() for p in per_expert]
    return vs.stack_experts(per_expert)


def _expert_read(reader: Any, moe: MoELayer, e: int, role: str, suffix: str) -> Any:
    import torch

    name = moe.tensor_name(e, role, suffix)
    if name not in reader.files:
        if suffix == "weight_zero_point":
            raise BadInput(f"{reader.files.root}: {name} is missing (an old writer's all-zero zero point); vLLM would "
                           "load garbage codes there: rewrite the checkpoint with a current compressed-tensors")
        raise reader.files.missing(name)
    t = reader.read(name)
    if suffix == "weight_zero_point" and t.dtype != torch.int32:
        raise BadInput(f"{reader.files.root}: {name} is {t.dtype} (an unpacked legacy zero point); vLLM's sharded "
                       "state needs the packed int32 form: rewrite the checkpoint with a current compressed-tensors")
    return t


# -- writing ----------------------------------------------------------------------------------------

def identity(plan: VllmStatePlan) -> dict[str, Any]:
    from wna16ctl.repacking.pipeline import source_fingerprint

    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "source_fingerprint": source_fingerprint(plan.checkpoint),
            "settings": {"tp": plan.tp, "layout": LAYOUT, "vllm": plan.vllm}}


def write_vllm_state(plan: VllmStatePlan, out: str | os.PathLike[str], *, force: bool = False,
                     progress: Callable[..., Callable[[int], None]] | None = None) -> dict[str, Any]:
    """Build and write every rank's files, the side files and the manifest; commit atomically."""
    from safetensors.torch import save

    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.output.writer import MANIFEST_NAME, StagedOutput

    out_path = Path(out).resolve()
    ident = identity(plan)
    staged = StagedOutput(out_path, force=force, resume=False, identity=ident, checkpoint=plan.checkpoint.root)
    total = sum(t.nbytes for keys in plan.keys for t in keys)
    advance = progress("writing the vLLM state", total, unit="bytes") if progress else (lambda n: None)
    try:
        with TensorReader(plan.checkpoint.files) as reader:
            for r in range(plan.tp):
                for name, part in zip(plan.files(r), plan.parts[r]):
                    tensors = {t.key: build_tensor(plan, reader, t, r) for t in part}
                    staged.write_small(name, save(tensors, metadata={"format": "pt"}))
                    advance(sum(t.nbytes for t in part))
        for name in SIDE_FILES:
            src = plan.checkpoint.root / name
            if src.is_file():
                staged.copy_file(src, name)
        staged.collect_hashes()
        manifest = build_manifest(plan, staged.done, staged.stage, ident, out_path)
        staged.commit(manifest, MANIFEST_NAME)
    except BaseException:
        staged.abort(keep_for_resume=False)
        raise
    return manifest


def _switches_json(switches: Any) -> dict[str, Any]:
    """The engine switches a plan followed, recorded only when given (verify plans with them again)."""
    if switches is None:
        return {}
    out: dict[str, Any] = {}
    if switches.env:
        out["env"] = dict(switches.env)
    if switches.moe_backend != "auto":
        out["moe_backend"] = switches.moe_backend
    return out


def build_manifest(plan: VllmStatePlan, hashes: dict[str, str], root: Path, ident: dict[str, Any],
                   out: Path) -> dict[str, Any]:
    from wna16ctl.output.writer import FILE_HASH

    ck = plan.checkpoint
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": __version__, "identity": ident,
        "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"],
                   "architecture": (ck.config.architectures or ("",))[0]},
        "engine": {"name": "vllm", "version": plan.vllm, "load_format": "sharded_state", "pattern": PATTERN,
                   "gpu": plan.gpu, **_switches_json(plan.switches)},
        "experts": plan.experts_json(),
        "tp": plan.tp, "ep": False, "layout": LAYOUT, "model_dtype": plan.model_dtype,
        "ranks": [{"rank": r, "files": plan.files(r), "keys": len(plan.keys[r]),
                   "bytes": sum(t.nbytes for t in plan.keys[r])} for r in range(plan.tp)],
        "serve": serve_command(out, plan.tp),
        "files": {rel: {FILE_HASH: digest, "bytes": (root / rel).stat().st_size} for rel, digest in sorted(hashes.items())},
    }


# -- verifying --------------------------------------------------------------------------------------

@dataclass
class VllmStateReport:
    out: Path
    tp: int
    vllm: str
    problems: list[str]
    keys_checked: int = 0
    tensors_round_tripped: int = 0
    serve: str = ""
    round_trip_ran: bool = False  # the files met the contract, so the tensors were compared

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def passed(self) -> bool:
        """The output is proved (the name every verify result answers to)."""
        return self.ok

    @property
    def next_steps(self) -> list[Any]:
        """The serve command, once the output is proved."""
        return [_next_step(self.out, self.tp)] if self.passed else []

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.out), "layout": LAYOUT, "tp": self.tp, "vllm": self.vllm, "ok": self.ok,
                "passed": self.passed, "keys_checked": self.keys_checked,
                "tensors_round_tripped": self.tensors_round_tripped, "problems": self.problems, "serve": self.serve,
                "next_steps": [s.to_json() for s in self.next_steps]}


def read_manifest(out: Path) -> dict[str, Any]:
    from wna16ctl.output.writer import MANIFEST_NAME

    path = out / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: cannot read the manifest ({e}); point verify at a repack output") from None


def verify_vllm_state(ckpt: str | os.PathLike[str] | Checkpoint, out: str | os.PathLike[str]) -> VllmStateReport:
    """Files against the contract (every key, no extra, exact shape and dtype), hashes against the
    manifest, and every tensor inverted back to the checkpoint bit for bit."""
    out_path = Path(out)
    manifest = read_manifest(out_path)
    engine = manifest["engine"]
    tp, vllm = int(manifest["tp"]), str(engine["version"])
    switches = None
    if engine.get("env") or engine.get("moe_backend"):
        from wna16ctl.planning.engine_env import make_switches

        switches = make_switches(engine.get("env"), engine.get("moe_backend"))
    plan = plan_vllm_state(ckpt, tp, vllm, gpu=str(engine.get("gpu", rules.DEFAULT_GPU)), switches=switches)
    report = VllmStateReport(out_path, tp, vllm, [], serve=serve_command(out_path, tp))
    headers = _check_files(plan, out_path, manifest, report)
    if report.problems:
        return report
    report.round_trip_ran = True
    _round_trip(plan, out_path, headers, report)
    return report


def _rank_of(name: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"model-rank-(\d+)-part-(\d+)\.safetensors", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_files(plan: VllmStatePlan, out: Path, manifest: dict[str, Any], report: VllmStateReport
                 ) -> dict[int, dict[str, tuple[Path, dict[str, Any]]]]:
    """Per rank: key -> (file, header entry).  Every contract violation becomes one line."""
    from wna16ctl.sources.headers import read_shard_header
    from wna16ctl.output.writer import FILE_HASH, hash_file

    for rel, meta in sorted((manifest.get("files") or {}).items()):
        path = out / rel
        if not path.is_file():
            report.problems.append(f"{path}: listed in the manifest but missing")
        elif hash_file(path) != meta.get(FILE_HASH):
            report.problems.append(f"{path}: content differs from the manifest's {FILE_HASH}")
    found: dict[int, dict[str, tuple[Path, dict[str, Any]]]] = {r: {} for r in range(plan.tp)}
    for entry in sorted(os.listdir(out)):
        rp = _rank_of(entry)
        if rp is None:
            continue
        rank, _ = rp
        if rank >= plan.tp:
            report.problems.append(f"{out / entry}: rank {rank} is outside --tp {plan.tp}; vLLM would load it into no rank")
            continue
        header = read_shard_header(out / entry)
        for key, info in header.entries.items():
            if key in found[rank]:
                report.problems.append(f"{out / entry}: key {key} also in {found[rank][key][0].name}")
            found[rank][key] = (out / entry, info)
    for r in range(plan.tp):
        want = {t.key: t for t in plan.keys[r]}
        got = found[r]
        for key, t in want.items():
            if key not in got:
                report.problems.append(f"rank {r}: key {key} is missing (vLLM {plan.vllm} raises on a missing key)")
                continue
            path, info = got[key]
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if dtype != t.dtype:
                report.problems.append(f"{path}: {key} is {dtype}, vLLM {plan.vllm} creates it as {t.dtype}")
            if shape != t.shape:
                report.problems.append(f"{path}: {key} has shape {list(shape)}, vLLM {plan.vllm} creates "
                                       f"{list(t.shape)}{_vocab_hint(key, shape, t.shape)}")
            report.keys_checked += 1
        for key in sorted(set(got) - set(want)):
            report.problems.append(f"{got[key][0]}: extra key {key} (vLLM {plan.vllm} has no such parameter: KeyError)")
    return found


def _vocab_hint(key: str, shape: tuple[int, ...], want: tuple[int, ...]) -> str:
    if key.endswith(("embed_tokens.weight", "lm_head.weight")) and shape[1:] == want[1:] and shape[0] < want[0]:
        return " (the vocabulary is not padded to a multiple of 64)"
    return ""


def _round_trip(plan: VllmStatePlan, out: Path, found: dict[int, dict[str, tuple[Path, Any]]],
                report: VllmStateReport) -> None:
    """Invert every key of every rank to the checkpoint tensors it came from and compare bit for bit."""
    import torch
    from safetensors import safe_open

    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.layout import vllm_state as vs

    handles: dict[Path, Any] = {}

    def load(rank: int, key: str) -> torch.Tensor:
        path = found[rank][key][0]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(key)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16
                                                                         else a, b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)

    dims = plan.checkpoint.dims
    with TensorReader(plan.checkpoint.files) as reader:
        def src(name: str, dtype: torch.dtype) -> torch.Tensor:
            return reader.read(name).to(dtype)

        for t in plan.keys[0]:
            parts = [load(r, t.key) for r in range(plan.tp)]
            dtype = parts[0].dtype
            verb, _, arg = t.fill.partition(" ")
            bad: str | None = None
            if verb == "const":
                if any(not torch.equal(p, torch.full(t.shape, float(arg), dtype=dtype)) for p in parts):
                    bad = f"does not hold the fresh parameter's value {arg}"
            elif verb == "copy":
                if any(not same(p, src(arg, dtype)) for p in parts):
                    bad = f"differs from {arg} on some rank"
            elif verb == "vocab":
                rows, pad = vs.vocab_unshard(parts, _size(dims.vocab_size, "vocab_size"))
                if not same(rows, src(arg, dtype)):
                    bad = f"rows differ from {arg}"
                elif bool(pad.any()):
                    bad = "padding rows are not zero"
            elif verb in ("column", "row"):
                whole = vs.column_unshard(parts) if verb == "column" else vs.row_unshard(parts)
                if not same(whole, src(arg, dtype)):
                    bad = f"ranks joined differ from {arg}"
            elif verb == "merged":
                names = arg.split()
                sources = [src(n, dtype) for n in names]
                for name, s, got in zip(names, sources, vs.merged_column_unshard(parts, [s.shape[0] for s in sources])):
                    if not same(got, s):
                        bad = f"the {name} rows differ"
            elif verb == "cat":
                names = arg.split()
                sources = [src(n, dtype) for n in names]
                for r, p in enumerate(parts):  # replicated: every rank holds the whole concatenation
                    for name, s_, got in zip(names, sources, p.split([x.shape[0] for x in sources], 0)):
                        if bad is None and not same(got, s_):
                            bad = f"rank {r}: the {name} rows differ"
            elif verb == "qkv":
                kv_heads, head_dim = _size(dims.num_key_value_heads, "num_key_value_heads"), _size(dims.head_dim, "head_dim")
                q, k, v, replicas = vs.qkv_unshard(parts, _size(dims.num_attention_heads, "num_attention_heads"), kv_heads,
                                                   head_dim)
                for got, proj in zip((q, k, v), "qkv"):
                    name = arg.replace(".q_proj.", f".{proj}_proj.")
                    if not same(got, src(name, dtype)):
                        bad = f"the {name} rows differ"
                per_kv = vs.kv_heads_per_rank(kv_heads, plan.tp) * head_dim
                for r, first in replicas:
                    if not torch.equal(parts[r][-2 * per_kv:], parts[first][-2 * per_kv:]):
                        bad = f"rank {r}'s replicated key/value heads differ from rank {first}'s"
            else:
                bad = _expert_round_trip(plan, reader, plan.moe_layers[t.layer], verb, arg, parts, same)
            if bad:
                report.problems.append(f"{found[0][t.key][0].parent}: {t.key}: {bad}")
            else:
                report.tensors_round_tripped += plan.tp


def _expert_round_trip(plan: VllmStatePlan, reader: Any, moe: MoELayer, verb: str, suffix: str, parts: list[Any],
                       same: Callable[[Any, Any], bool]) -> str | None:
    from wna16ctl.layout import vllm_state as vs

    dtype = parts[0].dtype
    if verb in ("w13t", "w2t"):  # K-first: back to the N-first form first
        parts = [p.transpose(1, 2) for p in parts]
        verb = verb[:-1]
    for e in range(moe.num_experts):
        if verb in ("shape13", "shape2"):
            roles = ("gate", "up") if verb == "shape13" else ("down",)
            for role in roles:
                want = vs.weight_shape_rows([reader.read(moe.tensor_name(e, role, "weight_shape"))], dtype)[0]
                if any(not same(p[e], want) for p in parts):
                    return f"expert {e}: differs from {moe.tensor_name(e, role, 'weight_shape')}"
            continue
        if verb == "w13":
            gate, up = vs.w13_unshard([p[e] for p in parts])
            for role, got in (("gate", gate), ("up", up)):
                want = _expert_read(reader, moe, e, role, suffix)
                if not same(got, want.to(got.dtype)):
                    return f"expert {e}: differs from {moe.tensor_name(e, role, suffix)}"
        else:
            assert moe.scheme is not None, "the key contract holds expert tensors of quantized layers only"
            whole = moe.scheme.group_size == -1 and suffix == "weight_scale"
            got, differing = vs.w2_unshard([p[e] for p in parts], whole=whole)
            if differing:
                return f"expert {e}: ranks {differing} hold another copy than rank 0"
            want = _expert_read(reader, moe, e, "down", suffix)
            if not same(got, want.to(got.dtype)):
                return f"expert {e}: differs from {moe.tensor_name(e, 'down', suffix)}"
    return None


# -- the command -----------------------------------------------------------------------------------

def repack_vllm_command(sink: Any, source: str, settings: Any, out: str | None, *, launch: Any, dry_run: bool,
                        force: bool, resume: bool, ranks: str | None, node_local: bool) -> int:
    """`repack --layout vllm`: the options the other layouts take that this one does not are refused
    with one line each; the result ends with the serve command."""
    if settings.ep:
        raise UsageError("--layout vllm does not support --ep: expert parallelism changes the key set vLLM "
                         "creates; write a TP output (vllm serve ... --tensor-parallel-size N)")
    if launch.world_size > 1 or ranks is not None or node_local:
        raise UsageError("--layout vllm is written by one process for all ranks: drop torchrun, --ranks and "
                         "--node-local (pipeline parallelism is not supported either)")
    if resume:
        raise UsageError("--layout vllm has no --resume: rerun with --force")
    from wna16ctl.planning.engine_env import EngineSwitches, parse_env

    switches = EngineSwitches(parse_env(dict(settings.env)), settings.moe_backend)
    plan = plan_vllm_state(source, settings.tp, settings.vllm, max_shard_bytes=settings.max_shard_bytes,
                           gpu=settings.gpu, switches=switches)

    def render_plan(console: Any) -> None:
        for r in plan.to_json()["ranks"]:
            console.print(f"rank {r['rank']}: {r['keys']} keys, {human_bytes(r['bytes'])} in {plural(len(r['files']), 'file')}")
        _print_backends(console, plan)
        console.print(f"then serve with: {serve_command(out or 'OUT', plan.tp)}", soft_wrap=True, markup=False)

    if dry_run:
        sink.result({**plan.to_json(), "loadable": True, "serve": serve_command(out or "OUT", plan.tp)}, render_plan)
        return 0
    if out is None:
        raise UsageError("-o/--output is required (or pass --dry-run)")
    with sink.tasks() as progress:
        manifest = write_vllm_state(plan, out, force=force, progress=progress)

    def render_result(console: Any) -> None:
        files = [f for r in manifest["ranks"] for f in r["files"]]
        console.print(f"wrote {plural(len(files), 'file')} for {plural(plan.tp, 'rank')} of vLLM {plan.vllm} into "
                      f"{Path(out).resolve()}", soft_wrap=True)
        _print_backends(console, plan)
        _print_next_step(console, manifest["serve"])

    sink.result({"output": str(Path(out).resolve()), "layout": LAYOUT, "tp": plan.tp, "vllm": plan.vllm,
                 "ranks": manifest["ranks"], "serve": manifest["serve"],
                 "next_steps": [_next_step(Path(out).resolve(), plan.tp).to_json()]}, render_result)
    return 0


def _next_step(out: Path, tp: int) -> Any:
    from wna16ctl.planning.next_steps import VLLM_LAYOUT, NextStep

    return NextStep(tp, False, VLLM_LAYOUT, None, serve_command(out, tp),
                    "stock vLLM reads each rank's files with its sharded_state loader")


def _print_next_step(console: Any, serve: str) -> None:
    console.print("next: serve it with stock vLLM", soft_wrap=True)
    console.print(f"  {serve}", soft_wrap=True, markup=False, highlight=False)


def _print_backends(console: Any, plan: VllmStatePlan) -> None:
    """Where the release's expert buffers follow the backend, which one was planned: the files load
    only into an engine that picks the same one."""
    if not plan.backends:
        return
    chosen = sorted(set(plan.backends.values()))
    orient = plan.experts_json()["orientation"]
    console.print(f"expert buffers {orient.replace('_', '-')}: vLLM {plan.vllm} shapes them by the MoE backend, "
                  f"planned {', '.join(chosen)} on {plan.gpu}; serve where vLLM picks the same backend "
                  f"(or pass --moe-backend {chosen[0]})", soft_wrap=True)


def is_vllm_output(out: str | os.PathLike[str]) -> bool:
    """Whether OUT's manifest says it holds the vllm layout (any other or none: False)."""
    from wna16ctl.output.writer import MANIFEST_NAME

    try:
        return json.loads((Path(out) / MANIFEST_NAME).read_text()).get("layout") == LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


def render_vllm_report(console: Any, report: VllmStateReport) -> None:
    for line in report.problems:
        console.print(f"FAIL {line}")
    if report.ok:
        console.print(f"PASS {report.keys_checked} keys on {plural(report.tp, 'rank')} match vLLM {report.vllm}'s sharded_state "
                      f"contract; {report.tensors_round_tripped} tensors round-trip to the checkpoint bit for bit")
    if report.passed:
        _print_next_step(console, report.serve)
