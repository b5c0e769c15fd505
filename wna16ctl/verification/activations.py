"""Activations for `verify`, built from real text: GSM8K questions -> tokens -> embeddings ->
the layer's post-attention RMSNorm -> the layer's router (top-k with the model family's scoring).

This is not the model's true hidden state at that layer (that would need attention and every
earlier layer), but it has the statistics that matter for checking expert weights: real token
embeddings at the scale the norm gives them, routed by the checkpoint's own router, so experts
see the mix of tokens they would see in use.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wna16ctl.sources import Checkpoint, MoELayer
from wna16ctl.sources.architectures import architecture
from wna16ctl.sources.tensors import TensorReader, as_tensor
from wna16ctl.errors import BadInput
from wna16ctl.verification.samples import (  # noqa: F401 - re-exported: the sample sources live in a torch-free module
    DEMO_QUESTIONS, GSM8K_TEST, SAMPLE_SEARCH_ORDER, SAMPLES_ENV, SHARED_ENV, repository_shared_dir, resolve_samples,
)

MAX_TOKENS_PER_SAMPLE = 64

_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _parquet_questions(path: Path, num_samples: int) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInput(f"{path}: reading .parquet needs pyarrow (pip install 'wna16ctl[parquet]'), "
                       "or pass a .jsonl file") from None
    try:
        table = pq.read_table(path, columns=["question"])
    except Exception as e:  # not parquet, no such column, ...
        raise BadInput(f"{path}: cannot read a 'question' column ({type(e).__name__}: {e})") from None
    out = table.column("question").to_pylist()[:num_samples]
    if not out:
        raise BadInput(f"{path}: no samples")
    if not all(isinstance(q, str) for q in out):
        raise BadInput(f"{path}: the 'question' column is not text")
    return out


def read_records(path: Path, limit: int) -> list[dict[str, Any]]:
    """The first `limit` records of a JSON-lines file, each with a string `question` field."""
    out: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("question"), str):
                raise BadInput(f"{path}:{lineno}: has no string 'question' field")
            out.append(rec)
    return out


def load_questions(samples: str | os.PathLike[str], num_samples: int) -> list[str]:
    """`question` fields of a JSON-lines or parquet file, or of a Hugging Face dataset id (needs `datasets`)."""
    path = Path(samples)
    if path.is_file() and path.suffix == ".parquet":
        return _parquet_questions(path, num_samples)
    if path.is_file():
        out = [rec["question"] for rec in read_records(path, num_samples)]
        if not out:
            raise BadInput(f"{path}: no samples")
        return out
    # Only an "owner/name" id goes to `datasets`; a missing local path (absolute, relative with
    # directories, or a .json/.jsonl name) is a missing file, not a dataset to look up online.
    if _DATASET_ID.fullmatch(str(samples)) and not str(samples).endswith((".json", ".jsonl")) and not path.exists():
        try:
            import datasets
        except ImportError:
            raise BadInput(f"{samples}: not a file, and the `datasets` package is not installed to load it as a dataset id") from None
        try:
            ds = datasets.load_dataset(str(samples), "main", split="test")
        except Exception as e:  # offline, unknown id, ...
            raise BadInput(f"{samples}: cannot load as a dataset ({type(e).__name__}: {e})") from None
        return [r["question"] for r in ds.select(range(min(num_samples, len(ds))))]
    if path.is_dir():
        raise BadInput(f"{samples}: is a directory; pass a .jsonl or .parquet file in it with a 'question' field")
    raise BadInput(f"{samples}: no such file; pass a .jsonl or .parquet file with a 'question' field")


def tokenize(ck: Checkpoint, texts: list[str], vocab_size: int) -> tuple[list[list[int]], str]:
    """Token ids per text: the checkpoint's tokenizer.json when it has one, else UTF-8 bytes."""
    tok_path = ck.root / "tokenizer.json"
    if tok_path.is_file():
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_path))
            ids = [[i for i in enc.ids if i < vocab_size][:MAX_TOKENS_PER_SAMPLE] for enc in tok.encode_batch(texts)]
            return ids, "tokenizer.json"
        except ImportError:
            pass
        except Exception as e:
            raise BadInput(f"{tok_path}: cannot be used ({e}); remove it to fall back to byte tokens") from None
    # Byte-level fallback: ids are byte values (folded into the vocabulary if it is smaller).
    return [[b % vocab_size for b in t.encode("utf-8")][:MAX_TOKENS_PER_SAMPLE] for t in texts], "bytes"


@dataclass
class Routing:
    x: torch.Tensor  # [T, H] fp32 normalised activations
    topk_ids: torch.Tensor  # [T, k] int64
    topk_weights: torch.Tensor  # [T, k] fp32
    forced: int  # tokens added so that every expert is exercised
    capped: int = 0  # the samples' tokens left out by the numerics' memory budget (`route`'s max_tokens)


def embed(ck: Checkpoint, reader: TensorReader, token_ids: list[list[int]]) -> torch.Tensor:
    name = next((n for n in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                             "transformer.wte.weight") if n in ck.files), None)
    if name is None:
        raise BadInput(f"{ck.root}: no embed_tokens weight to build activations from")
    flat = torch.tensor([i for ids in token_ids for i in ids], dtype=torch.int64)
    if flat.numel() == 0:
        raise BadInput("the samples produced no tokens")
    # the rows the tokens name, read one by one: the table (vocabulary × hidden) is GBs at scale
    info = ck.files.info(name)
    if len(info.shape) != 2:
        return reader.read(name)[flat].float()
    ids, where = torch.unique(flat, return_inverse=True)
    row = info.nbytes // info.shape[0]
    rows = [as_tensor(reader.read_bytes(type(info)(info.name, info.dtype, info.shape[1:], info.file,
                                                   info.start + i * row, info.start + (i + 1) * row)),
                      info.dtype, info.shape[1:]) for i in ids.tolist() if 0 <= i < info.shape[0]]
    if len(rows) != len(ids):
        raise BadInput(f"{ck.root}: a token id is outside {name} ({info.shape[0]} rows)")
    return torch.stack(rows)[where].float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def route(ck: Checkpoint, reader: TensorReader, layer: MoELayer, hidden: torch.Tensor, min_tokens_per_expert: int = 2,
          max_tokens: int | None = None) -> Routing:
    """Normalise with the layer's post-attention norm, route with its router, force idle experts.
    `max_tokens` caps the tokens (the numerics' memory budget): the samples' first tokens are kept,
    as many as leave room for the forced ones; `Routing.capped` says how many were left out."""
    cfg = ck.config.raw
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    norm = reader.read(layer.norm) if layer.norm else None
    x = rms_norm(hidden, norm, eps)
    E = layer.num_experts
    k = min(int(ck.config.num_experts_per_tok or 2), E)
    if layer.router is None:
        raise BadInput(f"{ck.root}: {layer.block} has no router weight (gate.weight) to route tokens with")
    router = reader.read(layer.router).float()
    if tuple(router.shape) != (E, layer.hidden_size):
        raise BadInput(f"{ck.root}: {layer.router} is {list(router.shape)}, expected [{E}, {layer.hidden_size}]")
    logits = x @ router.T
    ids, weights = _topk(ck, reader, layer, logits, k)
    if max_tokens is not None and min_tokens_per_expert * E > max_tokens:  # one each, so every expert fits
        min_tokens_per_expert = max(1, max_tokens // E)
    keep = _tokens_kept(ids, E, min_tokens_per_expert, max_tokens)
    capped = x.shape[0] - keep
    pool = x
    x, ids, weights = x[:keep], ids[:keep], weights[:keep]
    # Experts no sample routes to get extra tokens (top-1, weight 1), so every expert is checked.
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    extra_x: list[torch.Tensor] = []
    extra_ids: list[int] = []
    g = torch.Generator().manual_seed(0)
    for e in range(E):
        need = min_tokens_per_expert - int(counts[e])
        if max_tokens is not None:  # past the cap an expert goes unexercised, which the numerics report
            need = min(need, max_tokens - keep - len(extra_ids))
        if need > 0:
            pick = torch.randint(0, pool.shape[0], (need,), generator=g)
            extra_x.append(pool[pick])
            extra_ids.extend([e] * need)
    forced = len(extra_ids)
    if forced:
        x = torch.cat([x, *extra_x])
        pad_ids = torch.full((forced, k), -1, dtype=torch.int64)
        pad_ids[:, 0] = torch.tensor(extra_ids)
        pad_w = torch.zeros(forced, k)
        pad_w[:, 0] = 1.0
        ids = torch.cat([ids, pad_ids])
        weights = torch.cat([weights, pad_w])
    return Routing(x=x, topk_ids=ids, topk_weights=weights, forced=forced, capped=capped)


def _tokens_kept(ids: torch.Tensor, experts: int, per_expert: int, max_tokens: int | None) -> int:
    """How many of the samples' tokens (in order) fit under `max_tokens` with the tokens forced for
    the experts they leave idle: fewer kept means more forced, so shrink until both fit."""
    keep = ids.shape[0] if max_tokens is None else min(ids.shape[0], max_tokens)
    while max_tokens is not None and keep > 0:
        counts = torch.bincount(ids[:keep].reshape(-1), minlength=experts)
        forced = int((per_expert - counts).clamp_min(0).sum())
        if keep + forced <= max_tokens:
            break
        keep = max(0, min(keep - 1, max_tokens - forced))
    return keep


def _topk(ck: Checkpoint, reader: TensorReader, layer: MoELayer, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ck.config.raw
    if cfg.get("scoring_func") == "sigmoid" or layer.router_bias is not None:
        # DeepSeek-V3 / Kimi-K2 / GLM-4.5: sigmoid scores, bias only for selection, group-limited.
        scores = logits.sigmoid()
        sel = scores + (reader.read(layer.router_bias).float() if layer.router_bias else 0.0)
        n_group = int(cfg.get("n_group") or 1)
        topk_group = int(cfg.get("topk_group") or n_group)
        if n_group > 1 and layer.num_experts % n_group == 0:
            grouped = sel.view(sel.shape[0], n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_scores.topk(topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
            sel = sel.masked_fill(~mask.repeat_interleave(layer.num_experts // n_group, dim=1), float("-inf"))
        ids = sel.topk(k, dim=-1).indices
        w = scores.gather(1, ids)
        if cfg.get("norm_topk_prob", True):
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * float(cfg.get("routed_scaling_factor", 1.0))
    probs = logits.softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    arch = architecture(ck.config.model_type)
    renorm = cfg.get("norm_topk_prob", arch is not None and arch.norm_topk_prob_default)
    if (arch is not None and arch.always_renormalize) or renorm:
        w = w / w.sum(-1, keepdim=True)
    return ids, w
