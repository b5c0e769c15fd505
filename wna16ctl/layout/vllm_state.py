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
prove a written state is the checkpoint, bit for bit.  No I/O, no vLLM.
"""

from __future__ import annotations

import torch

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
