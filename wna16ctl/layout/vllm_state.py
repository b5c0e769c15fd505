"""The tensor math of vLLM's pre-processing parameter state, and its inverse.

`vllm serve --load-format sharded_state` copies each rank's file into the parameters vLLM has just
created, before `process_weights_after_loading` runs.  What those parameters hold after a normal
load is the checkpoint cut per rank the way vLLM's weight loaders cut it:

* column parallel (N split): rows `[r*N/n, (r+1)*N/n)`; merged column layers (`gate_up_proj`)
  concatenate each part's slice in order;
* QKV: this rank's query heads, then its key heads and value heads, where a rank holds
  `max(1, kv/n)` key/value heads and ranks share (replicate) a head when there are fewer heads
  than ranks;
* row parallel (K split): columns `[r*K/n, (r+1)*K/n)`;
* vocabulary (embedding, lm_head): rows zero-padded to a multiple of 64, then split in rows;
* routed experts, in the checkpoint's N-first packed form: `w13` = gate rows then up rows of this
  rank, `w2` = this rank's K columns (packed words, scale groups, packed zero-point columns);
  channel-wise w2 scales are whole on every rank.

Every function here is a pure function of tensors; `unshard_*` are the inverses `verify` uses to
prove a written state is the checkpoint, bit for bit.  `build_tensor` (forward) and `invert_key`
(inverse) apply them to one key of a planned state (`wna16ctl.planning.vllm_state`), reading the
checkpoint through the reader their caller opened.  No file is opened here, no vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from wna16ctl.dtypes import torch_dtype
from wna16ctl.errors import BadInput
from wna16ctl.layout.spec import G_IDX, SCALES, ZERO_POINTS

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what} {size} is not a multiple of the TP size {tp}")
    return size // tp


# -- dense tensors ------------------------------------------------------------------------------

def vocab_shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows of a [V, H] embedding or lm_head, zero-padded to a multiple of 64, rank's part."""
    vocab = weight.shape[0]
    padded = padded_vocab(vocab)
    per = _split(padded, tp, "padded vocabulary")
    out = weight.new_zeros((per,) + tuple(weight.shape[1:]))
    lo, hi = rank * per, min((rank + 1) * per, vocab)
    if hi > lo:
        out[: hi - lo] = weight[lo:hi]
    return out


def vocab_unshard(parts: list[torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the [V, ...] rows, the padding rows) of the ranks' vocabulary shards."""
    whole = torch.cat(parts, 0)
    return whole[:vocab_size], whole[vocab_size:]


def column_shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = _split(weight.shape[0], tp, "output size")
    return weight[rank * per:(rank + 1) * per].contiguous()


def column_unshard(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 0)


def row_shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = _split(weight.shape[1], tp, "input size")
    return weight[:, rank * per:(rank + 1) * per].contiguous()


def row_unshard(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 1)


def merged_column_shard(weights: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """`gate_up_proj`: each part's rows of this rank, concatenated in order."""
    return torch.cat([column_shard(w, tp, rank) for w in weights], 0)


def merged_column_unshard(parts: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """The full parts (sizes = their full row counts) from the ranks' merged shards."""
    tp = len(parts)
    pieces = [p.split([s // tp for s in sizes], 0) for p in parts]
    return [torch.cat([pieces[r][i] for r in range(tp)], 0) for i in range(len(sizes))]


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    if kv_heads >= tp:
        _split(kv_heads, tp, "key/value heads")
        return kv_heads // tp
    if tp % kv_heads:
        raise ValueError(f"TP size {tp} is not a multiple of the {kv_heads} key/value heads")
    return 1


def head_rows(q: torch.Tensor, heads: int) -> int:
    """Rows per head of a q_proj tensor: the head size for weights, scales and biases, the head size
    over the pack factor for zero points (packed along N)."""
    return q.shape[0] // heads


def qkv_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
              tp: int, rank: int) -> torch.Tensor:
    """`qkv_proj` rows (or bias entries) of this rank: its query heads, key heads, value heads."""
    per_q = _split(heads, tp, "attention heads") * head_dim
    per_kv = kv_heads_per_rank(kv_heads, tp)
    kv_rank = rank // (tp // kv_heads) if kv_heads < tp else rank  # ranks that share a head
    lo = kv_rank * per_kv * head_dim
    hi = lo + per_kv * head_dim
    return torch.cat([q[rank * per_q:(rank + 1) * per_q], k[lo:hi], v[lo:hi]], 0).contiguous()


def qkv_unshard(parts: list[torch.Tensor], heads: int, kv_heads: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(q, k, v, replicas) from the ranks' qkv shards; `replicas` pairs (rank, first rank) whose
    key/value rows must be equal because the ranks share the heads."""
    tp = len(parts)
    per_q = heads // tp * head_dim
    per_kv = kv_heads_per_rank(kv_heads, tp) * head_dim
    split = [p.split([per_q, per_kv, per_kv], 0) for p in parts]
    share = tp // kv_heads if kv_heads < tp else 1
    owners = list(range(0, tp, share))
    q = torch.cat([s[0] for s in split], 0)
    k = torch.cat([split[r][1] for r in owners], 0)
    v = torch.cat([split[r][2] for r in owners], 0)
    replicas = [(r, r - r % share) for r in range(tp) if r % share]
    return q, k, v, replicas


# -- routed experts (N-first packed, as the checkpoint stores them) ------------------------------

def w13_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """One expert's gate and up tensor in N-first form ([N, ...] rows: weight words, scales, or
    packed zero-point rows) → this rank's w13 rows: gate's slice, then up's slice."""
    return torch.cat([column_shard(gate, tp, rank), column_shard(up, tp, rank)], 0)


def w13_unshard(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [p.chunk(2, 0) for p in parts]
    return torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)


def w2_shard(down: torch.Tensor, tp: int, rank: int, *, whole: bool = False) -> torch.Tensor:
    """down's K columns of this rank (weight words, scale groups, zero-point columns); `whole`
    for a tensor every rank holds in full (channel-wise scales)."""
    return down.contiguous() if whole else row_shard(down, tp, rank)


def w2_unshard(parts: list[torch.Tensor], *, whole: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(down, ranks whose copy differs from rank 0's) — the list is empty for a sharded tensor."""
    if whole:
        return parts[0], [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
    return row_unshard(parts), []


def weight_shape_rows(shapes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[E, 2] `w13_weight_shape` / `w2_weight_shape`: each expert's checkpoint `weight_shape`
    (the full, unsharded [N, K]) converted to the parameter's dtype the way a tensor copy does."""
    out = torch.empty((len(shapes), 2), dtype=dtype)
    for e, s in enumerate(shapes):
        out[e] = s
    return out


def stack_experts(per_expert: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(per_expert, 0).contiguous()


# -- one key of the state (forward) and back (inverse) ------------------------------------------------
# `plan` is a `wna16ctl.planning.vllm_state.VllmStatePlan`, `key` one of its `StateTensor`s, `reader`
# a `wna16ctl.sources.tensors.TensorReader` over the checkpoint: the caller reads, this code cuts.

class KFirstReader:
    """A reader whose tensors are the checkpoint's transposed: the N-first view of a GPTQ or AWQ
    tensor stored K first, which the N-first cuts here take (their `_k` forms)."""

    def __init__(self, reader: Any):
        self.reader = reader
        self.files = reader.files

    def read(self, name: str) -> torch.Tensor:
        return self.reader.read(name).t()


_LINEAR_CUTS = ("qkv", "row", "column", "merged")


def _k_first(t: Any) -> Any | None:
    """The N-first form of a key whose fill is a linear cut's `_k` form (None for any other)."""
    from dataclasses import replace

    verb, _, arg = t.fill.partition(" ")
    if not verb.endswith("_k") or verb[:-2] not in _LINEAR_CUTS:
        return None
    return replace(t, fill=f"{verb[:-2]} {arg}", shape=tuple(reversed(t.shape)))


def build_tensor(plan: Any, reader: Any, t: Any, rank: int) -> torch.Tensor:
    """The value of key `t` on `rank`, made from the checkpoint the way vLLM's loaders make it."""
    n_first = _k_first(t)
    if n_first is not None:  # a K-first stored tensor: the N-first cut of its transpose, transposed back
        return build_tensor(plan, KFirstReader(reader), n_first, rank).t().contiguous()
    dtype = torch_dtype(t.dtype)
    tp = plan.tp
    verb, _, arg = t.fill.partition(" ")
    if verb == "const":
        out = torch.full(t.shape, float(arg), dtype=dtype)
    elif verb == "copy":
        out = reader.read(arg)
    elif verb == "vocab":
        out = vocab_shard(reader.read(arg), tp, rank)
    elif verb == "column":
        out = column_shard(reader.read(arg), tp, rank)
    elif verb == "row":
        out = row_shard(reader.read(arg), tp, rank)
    elif verb == "merged":
        out = merged_column_shard([reader.read(n) for n in arg.split()], tp, rank)
    elif verb == "cat":  # a replicated layer fused from several checkpoint ones (fused_qkv_a_proj)
        out = torch.cat([reader.read(n).to(dtype) for n in arg.split()], 0)
    elif verb == "qkv":
        dims = plan.checkpoint.dims
        q, k, v = (reader.read(arg.replace(".q_proj.", f".{p}_proj.")) for p in "qkv")
        out = qkv_shard(q, k, v, dims.num_attention_heads, dims.num_key_value_heads,
                        head_rows(q, dims.num_attention_heads), tp, rank)
    elif verb in _EXPERT_FILLS:
        out = _expert_tensor(plan, reader, plan.moe_layers[t.layer], verb, arg, rank, dtype)
    else:
        raise AssertionError(f"unknown fill {t.fill}")
    # vLLM copies a loaded tensor into its parameter: a dtype conversion where they differ
    out = out.to(dtype).contiguous()
    if tuple(out.shape) != t.shape:
        raise BadInput(f"{plan.checkpoint.root}: {t.key} came out {tuple(out.shape)}, the contract says {t.shape}; "
                       "the checkpoint's tensors do not match its config.json")
    return out


# the expert fills (rules.VLLM_STATE_KEYS): N-first as stored (w13, w2), each expert transposed
# (w13t, w2t), the GPTQ/AWQ tensors K-first as stored (w13_k, w2_k, w2full_k), weight shapes, g_idx
_EXPERT_FILLS = ("w13", "w2", "w13t", "w2t", "w13_k", "w2_k", "w2full_k", "shape13", "shape2", "gidx13", "gidx2")


def _stored_k_first(verb: str, reader: Any) -> tuple[str, Any, bool]:
    """(the N-first fill, the reader it reads through, whether down's tensor is whole on every rank)
    of a GPTQ/AWQ fill: their K-first tensors, read transposed, are the N-first ones of the
    compressed-tensors fills, transposed back into the K-first buffer (w13t/w2t)."""
    if verb.endswith("_k"):
        return {"w13_k": "w13t", "w2_k": "w2t", "w2full_k": "w2t"}[verb], KFirstReader(reader), verb == "w2full_k"
    return verb, reader, False


def _expert_tensor(plan: Any, reader: Any, moe: Any, verb: str, kind: str, rank: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The rank's expert buffer: its experts (`plan.experts_of`: every one, or its local ones under
    EP) stacked in order, each cut for the experts' TP rank (whole under EP)."""
    experts = plan.experts_of(moe, rank)
    tp, rank = (1, 0) if plan.ep else (plan.tp, rank)
    if verb in ("gidx13", "gidx2"):
        return stack_experts([_g_idx_of(reader, moe, e, verb, tp, rank) for e in experts])
    k_stored = verb.endswith("_k")
    verb, reader, full = _stored_k_first(verb, reader)
    suffix = moe.fmt.names.suffix(kind) if kind else kind
    if verb in ("shape13", "shape2"):
        # vLLM writes the checkpoint's weight_shape of each projection into the expert's row; of
        # gate and up (the same values in a valid checkpoint) up's is loaded last and kept
        proj = "up" if verb == "shape13" else "down"
        rows = []
        for e in experts:
            name = moe.tensor_name(e, proj, moe.fmt.names.shape)
            if name not in reader.files:
                raise reader.files.missing(name)
            rows.append(reader.read(name))
        return weight_shape_rows(rows, dtype)
    per_expert = []
    transposed = verb.endswith("t")  # K-first buffers: the loader transposes each checkpoint tensor
    verb = verb.rstrip("t")
    for e in experts:
        if verb == "w13":
            gate, up = (_expert_read(reader, moe, e, proj, suffix) for proj in ("gate", "up"))
            per_expert.append(w13_shard(gate, up, tp, rank))
        else:
            down = _expert_read(reader, moe, e, "down", suffix)
            per_expert.append(w2_shard(down, tp, rank, whole=full or _w2_whole(moe, kind, k_stored)))
    if per_expert[0].dtype != torch.int32:  # scales: converted to the parameter's dtype
        per_expert = [p.to(dtype) for p in per_expert]
    if transposed:
        per_expert = [p.t() for p in per_expert]
    return stack_experts(per_expert)


def _w2_whole(moe: Any, role: str, k_stored: bool) -> bool:
    """Whether down's tensor of `role` is whole on every rank: channel-wise scales (and, for the
    GPTQ/AWQ methods' K-first stored tensors, channel-wise zero points: the loader's per-channel path)."""
    if moe.scheme.group_size != -1:
        return False
    return role == SCALES or (role == ZERO_POINTS and k_stored)


def _g_idx_of(reader: Any, moe: Any, e: int, verb: str, tp: int, rank: int) -> torch.Tensor:
    """One expert's g_idx row: w13's the whole g_idx of gate or up, whichever vLLM loads last (both
    are copied into it); w2's down's K entries of this rank; zeros where the checkpoint has none."""
    names = _g_idx_names(reader, moe, e, verb)
    if not names:
        size = moe.hidden_size if verb == "gidx13" else moe.intermediate_size // tp
        return torch.zeros(size, dtype=torch.int32)
    g = reader.read(names[-1]).to(torch.int32)
    return g.contiguous() if verb == "gidx13" else column_shard(g, tp, rank)


def _g_idx_names(reader: Any, moe: Any, e: int, verb: str) -> list[str]:
    """The expert's stored g_idx tensors the row reads, in vLLM's load order (the last one kept)."""
    roles = ("gate", "up") if verb == "gidx13" else ("down",)
    names = [moe.stored_name(e, r, G_IDX) for r in roles]
    present = [n for n in names if n in reader.files]
    return sorted(present, key=reader.files.load_order)


def _expert_read(reader: Any, moe: Any, e: int, role: str, suffix: str) -> torch.Tensor:
    name = moe.tensor_name(e, role, suffix)
    if name not in reader.files:
        if suffix == ZERO_POINTS:
            raise BadInput(f"{reader.files.root}: {name} is missing (an old writer's all-zero zero point); vLLM would "
                           "load garbage codes there: rewrite the checkpoint with a current compressed-tensors")
        raise reader.files.missing(name)
    t = reader.read(name)
    if suffix == ZERO_POINTS and t.dtype != torch.int32:
        raise BadInput(f"{reader.files.root}: {name} is {t.dtype} (an unpacked legacy zero point); vLLM's sharded "
                       "state needs the packed int32 form: rewrite the checkpoint with a current compressed-tensors")
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (bf16 compared as bytes: -0.0 and NaN payloads count)."""
    def raw(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.uint8) if x.dtype == torch.bfloat16 else x

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def invert_key(plan: Any, reader: Any, t: Any, parts: list[torch.Tensor]) -> str | None:
    """Key `t` as every rank holds it (`parts`, rank order) inverted back to the checkpoint tensors
    it was made from: None when they are equal bit for bit, else what differs (one phrase)."""
    n_first = _k_first(t)
    if n_first is not None:  # a K-first stored tensor: inverted as the N-first cut of its transpose
        return invert_key(plan, KFirstReader(reader), n_first, [p.t() for p in parts])
    dims = plan.checkpoint.dims
    dtype = parts[0].dtype
    same = same_bits

    def src(name: str) -> torch.Tensor:
        return reader.read(name).to(dtype)

    verb, _, arg = t.fill.partition(" ")
    bad: str | None = None
    if verb == "const":
        if any(not torch.equal(p, torch.full(t.shape, float(arg), dtype=dtype)) for p in parts):
            bad = f"does not hold the fresh parameter's value {arg}"
    elif verb == "copy":
        if any(not same(p, src(arg)) for p in parts):
            bad = f"differs from {arg} on some rank"
    elif verb == "vocab":
        rows, pad = vocab_unshard(parts, dims.vocab_size)
        if not same(rows, src(arg)):
            bad = f"rows differ from {arg}"
        elif bool(pad.any()):
            bad = "padding rows are not zero"
    elif verb in ("column", "row"):
        whole = column_unshard(parts) if verb == "column" else row_unshard(parts)
        if not same(whole, src(arg)):
            bad = f"ranks joined differ from {arg}"
    elif verb == "merged":
        names = arg.split()
        sources = [src(n) for n in names]
        for name, s, got in zip(names, sources, merged_column_unshard(parts, [s.shape[0] for s in sources])):
            if not same(got, s):
                bad = f"the {name} rows differ"
    elif verb == "cat":
        names = arg.split()
        sources = [src(n) for n in names]
        for r, p in enumerate(parts):  # replicated: every rank holds the whole concatenation
            for name, s_, got in zip(names, sources, p.split([x.shape[0] for x in sources], 0)):
                if bad is None and not same(got, s_):
                    bad = f"rank {r}: the {name} rows differ"
    elif verb == "qkv":
        per_head = head_rows(reader.read(arg), dims.num_attention_heads)
        q, k, v, replicas = qkv_unshard(parts, dims.num_attention_heads, dims.num_key_value_heads, per_head)
        for got, letter in zip((q, k, v), "qkv"):
            name = arg.replace(".q_proj.", f".{letter}_proj.")
            if not same(got, src(name)):
                bad = f"the {name} rows differ"
        per_kv = kv_heads_per_rank(dims.num_key_value_heads, plan.tp) * per_head
        for r, first in replicas:
            if not torch.equal(parts[r][-2 * per_kv:], parts[first][-2 * per_kv:]):
                bad = f"rank {r}'s replicated key/value heads differ from rank {first}'s"
    else:
        moe = plan.moe_layers[t.layer]
        bad = _invert_experts(reader, moe, verb, arg, _expert_parts(plan, moe, parts))
    return bad


def _expert_parts(plan: Any, moe: Any, parts: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """Each global expert's slices, in rank order, from the ranks' stacked buffers: one per rank,
    or under EP the one whole copy its rank holds."""
    held: dict[int, list[torch.Tensor]] = {}
    for r, p in enumerate(parts):
        for i, e in enumerate(plan.experts_of(moe, r)):
            held.setdefault(e, []).append(p[i])
    return held


def _invert_g_idx(reader: Any, moe: Any, verb: str, held: dict[int, list[torch.Tensor]]) -> str | None:
    """The g_idx rows: each rank's w13 row the whole g_idx vLLM keeps, the ranks' w2 rows joined."""
    for e in range(moe.num_experts):
        if e not in held:
            return f"expert {e}: no rank holds it"
        names = _g_idx_names(reader, moe, e, verb)
        if verb == "gidx13":
            want = reader.read(names[-1]).to(torch.int32) if names else torch.zeros(moe.hidden_size, dtype=torch.int32)
            got_all = held[e]
        else:
            want = reader.read(names[-1]).to(torch.int32) if names else torch.zeros(moe.intermediate_size,
                                                                                      dtype=torch.int32)
            got_all = [column_unshard(held[e])] if len(held[e]) > 1 else held[e]
        if any(not torch.equal(got, want) for got in got_all):
            return f"expert {e}: differs from {names[-1] if names else 'the zeros of a checkpoint without g_idx'}"
    return None


def _invert_experts(reader: Any, moe: Any, verb: str, kind: str, held: dict[int, list[torch.Tensor]]) -> str | None:
    """`held`: each global expert's slices (`_expert_parts`), joined back as the loader cut them."""
    if verb in ("gidx13", "gidx2"):
        return _invert_g_idx(reader, moe, verb, held)
    k_stored = verb.endswith("_k")
    verb, reader, full = _stored_k_first(verb, reader)
    suffix = moe.fmt.names.suffix(kind) if kind else kind
    same = same_bits
    dtype = next(iter(held.values()))[0].dtype
    if verb in ("w13t", "w2t"):  # K-first: back to the N-first form first
        held = {e: [p.transpose(0, 1) for p in ps] for e, ps in held.items()}
        verb = verb[:-1]
    for e in range(moe.num_experts):
        if e not in held:
            return f"expert {e}: no rank holds it"
        if verb in ("shape13", "shape2"):
            roles = ("gate", "up") if verb == "shape13" else ("down",)
            for role in roles:
                want = weight_shape_rows([reader.read(moe.tensor_name(e, role, moe.fmt.names.shape))], dtype)[0]
                if any(not same(p, want) for p in held[e]):
                    return f"expert {e}: differs from {moe.tensor_name(e, role, moe.fmt.names.shape)}"
            continue
        if verb == "w13":
            gate, up = w13_unshard(held[e])
            for role, got in (("gate", gate), ("up", up)):
                want = _expert_read(reader, moe, e, role, suffix)
                if not same(got, want.to(got.dtype)):
                    return f"expert {e}: differs from {moe.tensor_name(e, role, suffix)}"
        else:
            got, differing = w2_unshard(held[e], whole=full or _w2_whole(moe, kind, k_stored))
            if differing:
                return f"expert {e}: ranks {differing} hold another copy than rank 0"
            want = _expert_read(reader, moe, e, "down", suffix)
            if not same(got, want.to(got.dtype)):
                return f"expert {e}: differs from {moe.tensor_name(e, 'down', suffix)}"
    return None
