"""KV-cache bytes per rank, as vLLM's KV-cache specs compute them, and what a budget holds.

Per decoder layer, the spec the layer reports (`get_kv_cache_spec`): full attention stores K and V
of its KV heads on this rank (`FullAttentionSpec`: 2 x heads x head size x dtype per token; the KV
heads replicated, one per rank, when TP exceeds them); sliding-window layers the same per token but
only the window's tokens (`SlidingWindowSpec`); multi-head latent attention one latent of
kv_lora_rank + qk_rope_head_dim per token on every rank, not split (`MLAAttentionSpec`); the gated
delta-net of hybrid models (Qwen3-Next, Qwen3.5) a fixed state per sequence (`MambaSpec`: the
convolution state of the rank's q/k/v channels and the recurrent state of its value heads).  The
conformance harness compares each figure with the page size over the block size of the specs of
each release's built model.  Torch-free; no files read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wna16ctl.dtypes import ST_SIZES
from wna16ctl.errors import UsageError
from wna16ctl.sources import Checkpoint
from wna16ctl.sources.architectures import architecture

FULL, SLIDING, MLA, MAMBA = "full", "sliding", "mla", "mamba"
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
BLOCK_SIZE = 16  # vLLM's default KV-cache block size on CUDA


@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's cache on one rank."""

    kind: str  # FULL, SLIDING, MLA or MAMBA
    bytes_per_token: int  # attention layers; 0 for MAMBA
    state_bytes: int = 0  # MAMBA: one sequence's state
    window: int | None = None  # SLIDING: the tokens kept


@dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerKV, ...]
    tp: int
    dtype_bytes: int
    unknown: str | None = None  # why the cache's size is not known from the config (None: it is)

    def bytes_per_token(self) -> int:
        """All attention layers of the rank, per token of one sequence (sliding windows not capped)."""
        return sum(lay.bytes_per_token for lay in self.layers)

    def tokens_in(self, budget: int) -> int:
        """Tokens of cache `budget` bytes hold, in whole blocks (vLLM's "GPU KV cache size")."""
        per_block = self.bytes_per_token() * BLOCK_SIZE
        return max(0, budget // per_block * BLOCK_SIZE) if per_block else 0

    def state_bytes(self) -> int:
        return sum(lay.state_bytes for lay in self.layers)

    def sequence_bytes(self, tokens: int) -> int:
        """What one sequence of `tokens` tokens holds on the rank, in whole blocks."""
        out = 0
        for lay in self.layers:
            kept = tokens if lay.window is None else min(tokens, lay.window + BLOCK_SIZE)
            out += lay.bytes_per_token * BLOCK_SIZE * -(-kept // BLOCK_SIZE) + lay.state_bytes
        return out

    def to_json(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for lay in self.layers:
            kinds[lay.kind] = kinds.get(lay.kind, 0) + 1
        return {"bytes_per_token": self.bytes_per_token(), "state_bytes_per_sequence": self.state_bytes(),
                "dtype_bytes": self.dtype_bytes, "block_size": BLOCK_SIZE, "layers": kinds, "unknown": self.unknown}


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype_st: str) -> int:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"--kv-cache-dtype {kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or ST_SIZES[model_dtype_st]


def _text(ck: Checkpoint) -> dict[str, Any]:
    raw = ck.config.raw
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def _layer_kinds(ck: Checkpoint) -> list[str]:
    text = _text(ck)
    n = ck.config.num_hidden_layers or 0
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        kinds = {"linear_attention": MAMBA, "sliding_attention": SLIDING, "full_attention": FULL}
        return [kinds.get(t, FULL) for t in types]
    interval = text.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and ck.dims.linear_num_value_heads:
        return [FULL if (i + 1) % interval == 0 else MAMBA for i in range(n)]
    if text.get("sliding_window") and text.get("use_sliding_window", True) and not ck.dims.mla:
        return [SLIDING] * n
    return [FULL] * n


def _mla_family(ck: Checkpoint) -> bool:
    arch = architecture(ck.config.model_type)
    return arch is not None and arch.mla


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    return max(1, kv_heads // tp)  # replicated, one per rank, when TP exceeds the KV heads


def kv_cache(ck: Checkpoint, tp: int, dtype_bytes: int, model_bytes: int) -> KVCache:
    """Every decoder layer's cache on one of `tp` ranks (`dtype_bytes`: the KV-cache dtype's size;
    `model_bytes`: the model dtype's, which the delta-net states use)."""
    dims, text = ck.dims, _text(ck)
    layers: list[LayerKV] = []
    for kind in _layer_kinds(ck):
        if dims.mla or _mla_family(ck):
            latent = int(text.get("kv_lora_rank") or 0) + int(text.get("qk_rope_head_dim") or 0)
            layers.append(LayerKV(MLA, latent * dtype_bytes))
        elif kind == MAMBA:
            layers.append(LayerKV(MAMBA, 0, state_bytes=_delta_net_state(ck, tp, model_bytes)))
        else:
            heads = _kv_heads_per_rank(dims.num_key_value_heads or 1, tp)
            per = 2 * heads * (dims.head_dim or 0) * dtype_bytes
            window = int(text["sliding_window"]) if kind == SLIDING else None
            layers.append(LayerKV(kind, per, window=window))
    return KVCache(tuple(layers), tp, dtype_bytes, _unknown(ck, layers))


def _unknown(ck: Checkpoint, layers: list[LayerKV]) -> str | None:
    """Why the config does not give the cache's size (vLLM would build the model with defaults
    this module does not know, or the sizes are missing): None when it does."""
    dims, text = ck.dims, _text(ck)
    if not layers:
        return "config.json gives no num_hidden_layers"
    if dims.mla or _mla_family(ck):
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if not isinstance(text.get(k), int)]
        if missing:
            return f"config.json has no {' or '.join(missing)}: the size of the MLA latent per token is not known"
    elif any(lay.kind in (FULL, SLIDING) for lay in layers) and not (dims.num_key_value_heads and dims.head_dim):
        return "config.json has no num_key_value_heads/num_attention_heads or head_dim: the KV heads' size is not known"
    if any(lay.kind == MAMBA for lay in layers) and not (dims.linear_key_dim and dims.linear_value_dim):
        return "config.json has no linear_num_*_heads/linear_*_head_dim: the delta-net state is not known"
    if not any(lay.bytes_per_token or lay.state_bytes for lay in layers):
        return "every layer's cache computes to 0 bytes"
    return None


def _delta_net_state(ck: Checkpoint, tp: int, model_bytes: int) -> int:
    """The gated delta-net's state of one sequence on one rank: the causal convolution's last
    kernel - 1 inputs of the rank's q/k/v channels, and the recurrent state (key x value per value
    head), both in the model dtype (vLLM's mamba_cache_dtype and mamba_ssm_cache_dtype "auto")."""
    dims, text = ck.dims, _text(ck)
    conv_dim = 2 * (dims.linear_key_dim or 0) + (dims.linear_value_dim or 0)
    kernel = int(text.get("linear_conv_kernel_dim") or 4)
    conv = conv_dim // tp * (kernel - 1) * model_bytes
    ssm = (dims.linear_num_value_heads or 0) // tp * (dims.linear_key_head_dim or 0) * (dims.linear_value_head_dim or 0)
    return conv + ssm * model_bytes
