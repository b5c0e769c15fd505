"""Small but authentic compressed-tensors WNA16 MoE checkpoints, written by the library itself.

`write_demo_checkpoint` builds a random bf16 model with the tensor names of a real
architecture (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2/V3, Kimi-K2 or GLM-4.5), quantizes the routed experts
with compressed-tensors (`apply_quantization_config`, `calculate_qparams`, `ModelCompressor`)
and saves it the way `save_pretrained` does: sharded safetensors, an index, and a
`config.json` whose `quantization_config` is the library's own output.  It is the `demo`
checkpoint of the CLI and the fixture factory of the tests.

`actorder: "group"` checkpoints (with `weight_g_idx`) can no longer be written by
compressed-tensors >= 0.19, so for those the expert tensors are quantized and packed with the
library's helpers here and the config is written in the verbose form of 0.18, the last
release that wrote them.

`spec.format` "gptq" and "awq" write the same quantization in those formats: the library's
pack-quantized tensors of every quantized module, read through the compressed-tensors format and
written through the GPTQ (v1, as GPTQModel writes it) or AWQ (GEMM, as AutoAWQ and AutoRound write
it) format's `stored_form`, the scales in float16 as those tools store them, and the config keys
those tools write (GPTQModel's `quantize_config.json` beside config.json too).  The config is read
back through the format's own module rules before anything is written, so every module quantized is
one the config says is, and every Linear left in float is one it skips.

`library_dequantize` is the reference the rest of the test suite compares against: it
decompresses a checkpoint's quantized modules with the library's own compressors.

compressed-tensors is imported inside the functions that need it: it takes ~5 s to import.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from safetensors import safe_open
from safetensors.torch import save

from wna16ctl import interrupts
from wna16ctl.sink import TaskStarter, no_progress
from wna16ctl.sources.formats import DEMO_FORMATS, awq, gptq
from wna16ctl.sources.formats.compressed_tensors import COMPRESSED_TENSORS
from wna16ctl.sources.architectures import ARCHITECTURES as _FACTS, DEMO_ARCHITECTURES, SHARED_EXPERT, SHARED_EXPERTS
from wna16ctl.verification.samples import DEMO_QUESTIONS

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

# the families the demo writes, with their facts (module names, config fields, attention kind)
# from the architecture table
ARCHITECTURES = DEMO_ARCHITECTURES
ACTORDERS = (None, "weight", "static", "group")
MIXED_MODES = (None, "layer", "expert")
# which modules are quantized: "experts" the routed experts only; "linear" the usual llm-compressor
# W4A16 recipe, every Linear but those of its usual MoE ignore list (lm_head, the routers, the
# shared-expert gate): attention, shared experts and dense MLPs too
TARGETS = ("experts", "linear")
# the checkpoint formats the demo writes: compressed-tensors itself (the default), then GPTQ and AWQ
# converted from it (module docstring)
FORMATS = DEMO_FORMATS
# the bit widths each format stores; the actorders the qweight formats store (GPTQ's desc_act)
_FORMAT_BITS = {gptq.QUANT_METHOD: gptq.BITS, awq.QUANT_METHOD: awq.BITS}
_FORMAT_ACTORDERS = {gptq.QUANT_METHOD: (None, "group"), awq.QUANT_METHOD: (None,)}
# GPTQModel, AutoRound and AutoAWQ store the scales of these formats in float16 whatever the model's dtype
QWEIGHT_SCALE_DTYPE = torch.float16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# the version whose verbose config form `actorder: "group"` checkpoints are written in
GROUP_ACTORDER_WRITER_VERSION = "0.18.0"

WEIGHT_STD = 0.02
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")  # ids 0 and 1 = bos/eos in config.json
TOKENIZER_TRAINING_LINES = 400

# DeepSeek-V3 MLA dimensions (small; the real model uses 512/1536/64/128/128). kv_lora_rank and
# qk_rope_head_dim are DemoSpec fields (an engine's MLA kernel may accept only the real sizes)
_MLA_QK_ROPE_HEAD_DIM = 16
_MLA_QK_NOPE_HEAD_DIM = 32
_MLA_V_HEAD_DIM = 32


# the rope scaling of the released DeepSeek-V3 (its config.json): YaRN stretching a 4096-position
# rope 40-fold, with the attention scale corrected by mscale_all_dim
DEEPSEEK_V3_YARN: dict[str, Any] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class DemoSpec:
    """What demo checkpoint to write.  Every field combination is deterministic in `seed`."""

    arch: str = "qwen3_moe"  # one of ARCHITECTURES
    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 256  # the routed expert's intermediate size
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 512
    num_bits: int = 4
    group_size: int = 128  # -1 = channel-wise
    symmetric: bool = True
    actorder: str | None = None  # None | "weight" | "static" | "group"
    mixed: str | None = None  # None | "layer" (odd layers int8) | "expert" (odd experts int8 in every layer)
    channel_group_size_null: bool = False  # channel strategy written with group_size null instead of -1
    dtype: str = "bfloat16"
    num_shards: int = 2  # 1 = a single model.safetensors without index, like save_pretrained
    seed: int = 0
    tokenizer: bool = False  # also write tokenizer.json (byte-level BPE trained on generated word problems)
    # DeepSeek-V3 only: the MLA latent width (None = max(16, hidden_size // 4)) and the rotary part of
    # each query/key head. vLLM's CPU MLA kernel takes only kv_lora_rank + qk_rope_head_dim = 576
    # (the real model's 512 + 64)
    mla_kv_lora_rank: int | None = None
    mla_qk_rope_head_dim: int = _MLA_QK_ROPE_HEAD_DIM
    # DeepSeek-V3 only: the real model's YaRN rope scaling (DEEPSEEK_V3_YARN) instead of plain rope
    mla_yarn_rope: bool = False
    # also quantize the shared experts and dense MLPs (with the routed experts' scheme), as a
    # recipe without an ignore entry for them does (targets "linear" quantizes them anyway)
    quantize_mlp: bool = False
    targets: str = "experts"  # one of TARGETS
    format: str = FORMATS[0]  # one of FORMATS: the checkpoint's quantization format


# ----------------------------------------------------------------------------------------------
# spec checks and derived sizes


def moe_layer_indices(spec: DemoSpec) -> list[int]:
    """Layers that have routed experts (DeepSeek-V3's first layer is dense)."""
    first = 1 if _FACTS[spec.arch].dense_first else 0
    return list(range(first, spec.num_layers))


def expert_projection_names(arch: str) -> tuple[str, ...]:
    """Expert projection module names of `arch`, in module registration order (Mixtral: w1, w2, w3)."""
    return _FACTS[arch].registration_order


def _check_spec(spec: DemoSpec) -> None:
    def bad(message: str) -> ValueError:
        return ValueError(f"DemoSpec: {message}")

    if spec.arch not in ARCHITECTURES:
        raise bad(f"arch {spec.arch!r} is not one of {ARCHITECTURES}")
    if not 2 <= spec.num_bits <= 8:  # the widths vLLM's WNA16 schemes name
        raise bad(f"num_bits must be 2 to 8, got {spec.num_bits}")
    if spec.group_size != -1 and spec.group_size <= 0:
        raise bad(f"group_size must be -1 (channel) or positive, got {spec.group_size}")
    if spec.group_size > 0:
        for what, size in (("hidden_size", spec.hidden_size), ("intermediate_size", spec.intermediate_size)):
            if size % spec.group_size:
                raise bad(f"{what} {size} is not a multiple of group_size {spec.group_size}")
    if spec.actorder not in ACTORDERS:
        raise bad(f"actorder {spec.actorder!r} is not one of {ACTORDERS}")
    if spec.actorder == "group" and spec.group_size <= 0:
        raise bad("actorder 'group' needs a positive group_size")
    if spec.channel_group_size_null and spec.group_size != -1:
        raise bad("channel_group_size_null needs group_size -1")
    if spec.mixed not in MIXED_MODES:
        raise bad(f"mixed {spec.mixed!r} is not one of {MIXED_MODES}")
    if spec.targets not in TARGETS:
        raise bad(f"targets {spec.targets!r} is not one of {TARGETS}")
    if spec.targets != "experts" and spec.mixed is not None:
        raise bad("mixed precision is written for the routed experts only: use it with targets 'experts'")
    if spec.mixed is not None and spec.num_bits != 4:
        raise bad("mixed precision puts int8 next to int4: num_bits must be 4")
    if spec.mixed == "layer" and not (
        any(i % 2 == 0 for i in moe_layer_indices(spec)) and any(i % 2 == 1 for i in moe_layer_indices(spec))
    ):
        raise bad("mixed 'layer' needs an even and an odd MoE layer (more layers)")
    if spec.mixed == "expert" and spec.num_experts < 2:
        raise bad("mixed 'expert' needs at least 2 experts")
    _check_format(spec)
    if spec.dtype not in DTYPES:
        raise bad(f"dtype {spec.dtype!r} is not one of {tuple(DTYPES)}")
    if spec.num_layers < 1 or (_FACTS[spec.arch].dense_first and spec.num_layers < 2):
        raise bad(f"num_layers too small to have an MoE layer ({spec.arch} layer 0 is dense)")
    if spec.num_experts < 1 or not 1 <= spec.top_k <= spec.num_experts:
        raise bad(f"need 1 <= top_k <= num_experts, got top_k {spec.top_k}, num_experts {spec.num_experts}")
    if spec.hidden_size < 16 or spec.intermediate_size < 1:
        raise bad("hidden_size must be >= 16 and intermediate_size >= 1")
    if spec.num_shards < 1:
        raise bad("num_shards must be >= 1")
    if spec.tokenizer and spec.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise bad("a byte-level tokenizer needs vocab_size >= 259")
    if spec.vocab_size < len(SPECIAL_TOKENS):
        raise bad("vocab_size too small")
    if spec.mla_kv_lora_rank is not None and spec.mla_kv_lora_rank < 1:
        raise bad(f"mla_kv_lora_rank must be positive, got {spec.mla_kv_lora_rank}")
    if spec.mla_qk_rope_head_dim < 2 or spec.mla_qk_rope_head_dim % 2:
        raise bad(f"mla_qk_rope_head_dim must be even and >= 2 (rotary pairs), got {spec.mla_qk_rope_head_dim}")
    if spec.targets == "linear" and spec.group_size > 0 and _FACTS[spec.arch].mla:
        # the attention's own input widths (every other quantized Linear reads hidden_size or a
        # multiple of intermediate_size): the library cannot group a width the group does not divide
        for what, size in _mla_input_widths(spec).items():
            if size % spec.group_size:
                raise bad(f"{what} {size} is not a multiple of group_size {spec.group_size} (targets 'linear' "
                          "quantizes the attention too)")


def _check_format(spec: DemoSpec) -> None:
    """What the GPTQ and AWQ formats can store of the spec (compressed-tensors stores all of it)."""
    if spec.format not in FORMATS:
        raise ValueError(f"DemoSpec: format {spec.format!r} is not one of {FORMATS}")
    if spec.format == COMPRESSED_TENSORS.quant_method:
        return
    bits, actorders = _FORMAT_BITS[spec.format], _FORMAT_ACTORDERS[spec.format]
    if spec.num_bits not in bits:
        raise ValueError(f"DemoSpec: format {spec.format} stores {', '.join(map(str, bits))} bits, "
                         f"not {spec.num_bits}")
    if spec.actorder not in actorders:
        raise ValueError(f"DemoSpec: format {spec.format} stores actorder "
                         f"{' or '.join(a or 'none' for a in actorders)}, not {spec.actorder}")
    if spec.mixed is not None:
        raise ValueError(f"DemoSpec: mixed precision is written in format {FORMATS[0]} only")
    if spec.channel_group_size_null:
        raise ValueError(f"DemoSpec: channel_group_size_null is a {FORMATS[0]} config form")


def _mla_input_widths(spec: DemoSpec) -> dict[str, int]:
    """The input widths of the MLA projections that do not read hidden_size."""
    heads = _attention_heads(spec.hidden_size)[0]
    mla = _mla_dims(spec)
    widths = {"kv_lora_rank": mla["kv_lora_rank"], "o_proj input (heads x v_head_dim)": heads * mla["v_head_dim"]}
    if spec.arch != "deepseek_v2":  # V2-Lite has no query LoRA
        widths["q_lora_rank"] = mla["q_lora_rank"]
    return widths


def _attention_heads(hidden_size: int) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) for a small model of this width."""
    heads = max(1, hidden_size // 64)
    while hidden_size % heads:
        heads -= 1
    kv_heads = heads // 2 if heads % 2 == 0 else heads
    return heads, kv_heads, hidden_size // heads


def _deepseek_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) that keep DeepSeek-V3's group-limited routing well defined."""
    n_group = 2 if num_experts % 2 == 0 and num_experts >= 4 else 1
    per_group = num_experts // n_group
    return n_group, min(n_group, max(1, math.ceil(top_k / per_group)))


def _mla_dims(spec: DemoSpec) -> dict[str, int]:
    return {
        "q_lora_rank": max(16, spec.hidden_size // 2),
        "kv_lora_rank": spec.mla_kv_lora_rank or max(16, spec.hidden_size // 4),
        "qk_rope_head_dim": spec.mla_qk_rope_head_dim,
        "qk_nope_head_dim": _MLA_QK_NOPE_HEAD_DIM,
        "v_head_dim": _MLA_V_HEAD_DIM,
    }


# ----------------------------------------------------------------------------------------------
# config.json (before quantization_config)


def model_config(spec: DemoSpec) -> dict[str, Any]:
    """The architecture part of config.json, with the fields the real model family uses."""
    _check_spec(spec)
    heads, kv_heads, head_dim = _attention_heads(spec.hidden_size)
    common: dict[str, Any] = {
        "architectures": [_FACTS[spec.arch].model_class],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "num_experts_per_tok": spec.top_k,
        "output_router_logits": False,
    }
    if spec.arch == "qwen3_moe":
        return common | {
            "head_dim": head_dim,
            "attention_bias": False,
            "num_experts": spec.num_experts,
            "moe_intermediate_size": spec.intermediate_size,
            "intermediate_size": 2 * spec.intermediate_size,  # dense MLP size (mlp_only_layers), unused here
            "norm_topk_prob": True,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": spec.num_layers,
        }
    if spec.arch == "mixtral":
        return common | {
            "num_local_experts": spec.num_experts,
            "intermediate_size": spec.intermediate_size,
            "rms_norm_eps": 1e-5,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
        }
    if spec.arch == "qwen2_moe":
        return common | {
            "num_experts": spec.num_experts,
            "moe_intermediate_size": spec.intermediate_size,
            "shared_expert_intermediate_size": _shared_expert_size(spec),
            "intermediate_size": _shared_expert_size(spec),
            "norm_topk_prob": False,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": spec.num_layers,
        }
    n_group, topk_group = _deepseek_groups(spec.num_experts, spec.top_k)
    routed = {
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": _n_shared_experts(spec),
        "moe_intermediate_size": spec.intermediate_size,
        "intermediate_size": _dense_mlp_size(spec),
        "first_k_dense_replace": 1,
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,  # no MTP layer is written
    }
    if spec.arch == "glm4_moe":  # grouped-query attention with q/k/v biases and half-rotary heads
        return common | routed | {
            "head_dim": head_dim,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": False,
            "rope_theta": 10000.0,
        }
    mla: dict[str, int | None] = dict(_mla_dims(spec))
    if spec.arch == "deepseek_v2":  # V2-Lite's shape: no query LoRA, softmax top-k without groups
        mla["q_lora_rank"] = None
        routed |= {"n_group": 1, "topk_group": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
                   "norm_topk_prob": False}
    if spec.arch == "kimi_k2":  # one expert group, like the real model
        routed |= {"n_group": 1, "topk_group": 1}
    return common | mla | routed | {
        "num_key_value_heads": heads,  # MLA: every head has its own k/v
        "head_dim": mla["qk_rope_head_dim"],
        "attention_bias": False,
        "moe_layer_freq": 1,
        "scoring_func": "softmax" if spec.arch == "deepseek_v2" else "sigmoid",
        "ep_size": 1,
        "rope_theta": 10000.0,
    } | ({"rope_scaling": dict(DEEPSEEK_V3_YARN),
          "max_position_embeddings": DEEPSEEK_V3_YARN["original_max_position_embeddings"] * DEEPSEEK_V3_YARN["factor"]}
         if spec.mla_yarn_rope else {})


def _n_shared_experts(spec: DemoSpec) -> int:
    return 2 if spec.arch == "deepseek_v2" else 1  # V2-Lite has two


def _shared_expert_size(spec: DemoSpec) -> int:
    return 2 * spec.intermediate_size


def _dense_mlp_size(spec: DemoSpec) -> int:
    return 2 * spec.intermediate_size


# ----------------------------------------------------------------------------------------------
# the dense (pre-quantization) tensors


class _TensorMaker:
    """Draws every tensor from one seeded generator, in state-dict order, so output is reproducible."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def normal(self, *shape: int, std: float = WEIGHT_STD, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = torch.randn(shape, generator=self.generator, dtype=torch.float32) * std
        return values.to(dtype or self.dtype)

    def norm(self, size: int) -> torch.Tensor:
        # RMSNorm weights of a trained model sit near 1
        return (1.0 + torch.randn((size,), generator=self.generator, dtype=torch.float32) * 0.05).to(self.dtype)


def demo_source_weights(spec: DemoSpec = DemoSpec()) -> dict[str, torch.Tensor]:
    """The unquantized state dict the checkpoint of `spec` is made from, in `spec.dtype`.

    Expert weights are the values before quantization (the `...experts.{e}.<proj>.weight`
    that the checkpoint stores as `weight_packed` + `weight_scale`).  Only the shape, arch,
    dtype and seed fields matter: checkpoints that differ in quantization options share them.
    """
    _check_spec(spec)
    make = _TensorMaker(spec.seed, DTYPES[spec.dtype])
    hidden = spec.hidden_size
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": make.normal(spec.vocab_size, hidden)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        # HF module registration order: self_attn, mlp, input_layernorm, post_attention_layernorm
        tensors |= {prefix + name: t for name, t in _attention_tensors(spec, make).items()}
        tensors |= {prefix + name: t for name, t in _mlp_tensors(spec, make, layer).items()}
        tensors[prefix + "input_layernorm.weight"] = make.norm(hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = make.norm(hidden)
    tensors["model.norm.weight"] = make.norm(hidden)
    tensors["lm_head.weight"] = make.normal(spec.vocab_size, hidden)
    return tensors


def _attention_tensors(spec: DemoSpec, make: _TensorMaker) -> dict[str, torch.Tensor]:
    hidden = spec.hidden_size
    heads, kv_heads, head_dim = _attention_heads(hidden)
    if _FACTS[spec.arch].mla:
        mla = _mla_dims(spec)
        qk_head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        query = {
            "self_attn.q_a_proj.weight": make.normal(mla["q_lora_rank"], hidden),
            "self_attn.q_a_layernorm.weight": make.norm(mla["q_lora_rank"]),
            "self_attn.q_b_proj.weight": make.normal(heads * qk_head_dim, mla["q_lora_rank"]),
        } if spec.arch != "deepseek_v2" else {"self_attn.q_proj.weight": make.normal(heads * qk_head_dim, hidden)}
        return query | {
            "self_attn.kv_a_proj_with_mqa.weight": make.normal(mla["kv_lora_rank"] + mla["qk_rope_head_dim"], hidden),
            "self_attn.kv_a_layernorm.weight": make.norm(mla["kv_lora_rank"]),
            "self_attn.kv_b_proj.weight": make.normal(
                heads * (mla["qk_nope_head_dim"] + mla["v_head_dim"]), mla["kv_lora_rank"]
            ),
            "self_attn.o_proj.weight": make.normal(hidden, heads * mla["v_head_dim"]),
        }
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    tensors = {"self_attn.q_proj.weight": make.normal(q_size, hidden)}
    biased = _FACTS[spec.arch].qkv_bias
    if biased:
        tensors["self_attn.q_proj.bias"] = make.normal(q_size)
    tensors["self_attn.k_proj.weight"] = make.normal(kv_size, hidden)
    if biased:
        tensors["self_attn.k_proj.bias"] = make.normal(kv_size)
    tensors["self_attn.v_proj.weight"] = make.normal(kv_size, hidden)
    if biased:
        tensors["self_attn.v_proj.bias"] = make.normal(kv_size)
    tensors["self_attn.o_proj.weight"] = make.normal(hidden, q_size)
    if _FACTS[spec.arch].qk_norm:
        tensors["self_attn.q_norm.weight"] = make.norm(head_dim)
        tensors["self_attn.k_norm.weight"] = make.norm(head_dim)
    return tensors


def _swiglu_tensors(prefix: str, names: tuple[str, str, str], hidden: int, inner: int, make: _TensorMaker) -> dict[str, torch.Tensor]:
    """gate/up [inner, hidden] and down [hidden, inner]; `names` are (gate, up, down)."""
    gate, up, down = names
    shapes = {gate: (inner, hidden), up: (inner, hidden), down: (hidden, inner)}
    # modules are registered (and drawn) in the model's order: Mixtral's is w1, w2, w3
    order = (gate, down, up) if gate == "w1" else names
    return {f"{prefix}{name}.weight": make.normal(*shapes[name]) for name in order}


def _mlp_tensors(spec: DemoSpec, make: _TensorMaker, layer: int) -> dict[str, torch.Tensor]:
    hidden, inner = spec.hidden_size, spec.intermediate_size
    block = _FACTS[spec.arch].moe_block
    gate_up_down = _FACTS[spec.arch].gate_up_down
    if layer not in moe_layer_indices(spec):  # DeepSeek-V3 dense layer
        return _swiglu_tensors("mlp.", gate_up_down, hidden, _dense_mlp_size(spec), make)

    router = {f"{block}.gate.weight": make.normal(spec.num_experts, hidden)}
    experts: dict[str, torch.Tensor] = {}
    for expert in range(spec.num_experts):
        experts |= _swiglu_tensors(f"{block}.experts.{expert}.", gate_up_down, hidden, inner, make)
    if _FACTS[spec.arch].shared_experts == SHARED_EXPERTS:
        # DeepseekV3MoE (and GLM-4.5's) registers experts, gate (weight + fp32 correction bias under
        # noaux_tc routing), shared_experts
        if spec.arch != "deepseek_v2":
            router[f"{block}.gate.e_score_correction_bias"] = make.normal(spec.num_experts, std=0.01, dtype=torch.float32)
        shared = _swiglu_tensors("mlp.shared_experts.", gate_up_down, hidden, inner * _n_shared_experts(spec), make)
        return experts | router | shared
    tensors = router | experts
    if _FACTS[spec.arch].shared_experts == SHARED_EXPERT:
        tensors |= _swiglu_tensors("mlp.shared_expert.", gate_up_down, hidden, _shared_expert_size(spec), make)
        tensors["mlp.shared_expert_gate.weight"] = make.normal(1, hidden)
    return tensors


# ----------------------------------------------------------------------------------------------
# quantization scheme


def _expert_target(spec: DemoSpec, layer_pattern: str = r"\d+", expert_pattern: str = r"\d+") -> str:
    projections = "|".join(expert_projection_names(spec.arch))
    block = _FACTS[spec.arch].moe_block
    return rf"re:model\.layers\.{layer_pattern}\.{block}\.experts\.{expert_pattern}\.({projections})$"


def _mlp_target(spec: DemoSpec) -> str:
    """The shared experts' and dense MLPs' projections (not the routed experts)."""
    projections = "|".join(expert_projection_names(spec.arch))
    return rf"re:model\.layers\.\d+\.{_FACTS[spec.arch].moe_block}\.(shared_experts?\.)?({projections})$"


def _weight_args(spec: DemoSpec, num_bits: int, actorder: str | None) -> "QuantizationArgs":
    from compressed_tensors.quantization import QuantizationArgs

    fields: dict[str, Any] = {"num_bits": num_bits, "type": "int", "symmetric": spec.symmetric, "dynamic": False}
    if spec.group_size > 0:
        fields |= {"strategy": "group", "group_size": spec.group_size}
    elif spec.channel_group_size_null:
        fields |= {"strategy": "channel"}
    else:
        fields |= {"strategy": "channel", "group_size": -1}
    if actorder is not None:
        fields["actorder"] = actorder
    return QuantizationArgs(**fields)


def _quantization_config(spec: DemoSpec) -> "QuantizationConfig":
    """The config groups of `spec` and, for targets "linear", llm-compressor's usual MoE ignore list."""
    from compressed_tensors.quantization import QuantizationConfig

    from wna16ctl.sources.proposed import DEFAULT_IGNORE

    ignore = list(DEFAULT_IGNORE) if spec.targets == "linear" else None
    return QuantizationConfig(config_groups=_expert_schemes(spec), ignore=ignore)


def _expert_schemes(spec: DemoSpec) -> dict[str, "QuantizationScheme"]:
    """Config groups for the routed experts (every Linear for targets "linear"); everything else
    stays untargeted (bf16)."""
    from compressed_tensors.quantization import QuantizationScheme

    # 0.20 refuses actorder "group": the library scheme carries none, the g_idx is added here
    actorder = None if spec.actorder == "group" else spec.actorder
    base = _weight_args(spec, spec.num_bits, actorder)
    if spec.targets == "linear":
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=base)}
    if spec.mixed is None:
        targets = [_expert_target(spec)] + ([_mlp_target(spec)] if spec.quantize_mlp else [])
        return {"group_0": QuantizationScheme(targets=targets, weights=base)}
    wide = _weight_args(spec, 8, actorder)
    even, odd = r"\d*[02468]", r"\d*[13579]"
    if spec.mixed == "layer":
        int4_target, int8_target = _expert_target(spec, layer_pattern=even), _expert_target(spec, layer_pattern=odd)
    else:
        int4_target, int8_target = _expert_target(spec, expert_pattern=even), _expert_target(spec, expert_pattern=odd)
    return {
        "group_0": QuantizationScheme(targets=[int4_target], weights=base),
        "group_1": QuantizationScheme(targets=[int8_target], weights=wide),
    }


def _module_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module tree whose dotted names are the checkpoint's names.

    Leaves with a 2-D `weight` become nn.Linear (nn.Embedding for embed_tokens), the module
    types the library quantizes and lists in `ignore`; norms are bare modules.
    """
    root = torch.nn.Module()
    leaves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        leaves.setdefault(module_name, {})[param_name] = tensor
    for module_name, params in leaves.items():
        weight = params["weight"]
        if module_name.endswith("embed_tokens"):
            leaf: torch.nn.Module = torch.nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
        elif weight.ndim == 2:
            leaf = torch.nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in params, device="meta")
        else:
            leaf = torch.nn.Module()
        for param_name, tensor in params.items():
            setattr(leaf, param_name, torch.nn.Parameter(tensor, requires_grad=False))
        parent = root
        *path, last = module_name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(last, leaf)
    return root


def _observe_qparams(weight: torch.Tensor, args: "QuantizationArgs") -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero point of `weight` [N, K] per row group, as the library's observers compute them."""
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = weight.shape
    group = args.group_size if args.strategy == "group" else cols
    grouped = weight.reshape(rows, cols // group, group)
    return calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)


def _group_permutation(generator: torch.Generator, cols: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, g_idx) as GPTQ act-order writes them: g_idx[perm[i]] = i // group_size."""
    perm = torch.randperm(cols, generator=generator)
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[perm] = (torch.arange(cols) // group_size).to(torch.int32)
    return perm, g_idx


class _QuantizedLinear(Protocol):
    """A Linear as compressed-tensors' apply_quantization_config leaves it: the attributes it adds
    (the library has no type information; its scheme objects are taken as they come)."""

    weight: torch.nn.Parameter
    weight_scale: torch.nn.Parameter
    weight_zero_point: torch.nn.Parameter
    quantization_scheme: Any
    quantization_status: Any


def _compress_with_g_idx(module: _QuantizedLinear, perm: torch.Tensor, g_idx: torch.Tensor) -> None:
    """Quantize and pack `module` like compressed-tensors <= 0.18 does for actorder "group".

    Group g holds the columns k with g_idx[k] == g (= perm[g*gs:(g+1)*gs]); the codes stay in
    the original column order, so w[:, k] = (q[:, k] - z[:, g_idx[k]]) * s[:, g_idx[k]].
    """
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.utils import replace_direct_state_dict

    args = module.quantization_scheme.weights
    weight = module.weight.data
    scale, zero_point = _observe_qparams(weight[:, perm], args)
    codes_in_group_order = quantize(weight[:, perm], scale, zero_point, args, dtype=torch.int8)
    codes = torch.empty_like(codes_in_group_order)
    codes[:, perm] = codes_in_group_order
    compressed = {
        "weight_packed": pack_to_int32(codes, args.num_bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor(weight.shape),
        "weight_g_idx": g_idx,
    }
    if not args.symmetric:
        compressed["weight_zero_point"] = pack_to_int32(zero_point, args.num_bits, packed_dim=0)
    replace_direct_state_dict(module, compressed)
    module.quantization_status = QuantizationStatus.COMPRESSED


def _verbose_group_actorder_config(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the library's terse 0.20 dump in the verbose form 0.18 wrote for actorder "group"."""
    config = dict(quantization_config)
    config["version"] = GROUP_ACTORDER_WRITER_VERSION
    config.pop("moe_sparsity_config", None)  # added in 0.19
    for scheme in config["config_groups"].values():
        weights = scheme["weights"]
        weights["actorder"] = "group"
        weights.setdefault("block_structure", None)
        weights.setdefault("scale_dtype", None)
        weights["observer"] = "memoryless_minmax"  # 0.18's default weight observer
        weights.setdefault("observer_kwargs", {})
        weights["zp_dtype"] = None if weights["symmetric"] else "torch.int8"
    return config


# ----------------------------------------------------------------------------------------------
# GPTQ and AWQ: the library's output in another format


def _gptq_config(spec: DemoSpec, skipped: list[str]) -> dict[str, Any]:
    """The quantization_config GPTQModel writes (v1 storage), its `dynamic` skipping `skipped`."""
    from wna16ctl.sources.formats.qweight import SchemeCache
    from wna16ctl.version import __version__

    scheme = SchemeCache().get(spec.num_bits, spec.group_size, spec.symmetric, spec.actorder == "group", gptq.V1)
    # "name:version", the form GPTQModel's meta.quantizer takes; the writer is this demo
    return gptq.written_config(scheme, skipped, False, f"wna16ctl:{__version__}")


def _awq_config(spec: DemoSpec, skipped: list[str]) -> dict[str, Any]:
    """The quantization_config AutoAWQ and AutoRound write (GEMM), skipping `skipped` and lm_head."""
    return {"quant_method": awq.QUANT_METHOD, "bits": spec.num_bits, "group_size": spec.group_size,
            "zero_point": not spec.symmetric, "version": awq.VERSION,
            "modules_to_not_convert": [entry.rstrip(".") for entry in skipped] + ["lm_head"]}


def _in_qweight_format(spec: DemoSpec, tensors: dict[str, torch.Tensor],
                       linear: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The library's pack-quantized tensors of every quantized module in `spec.format`, and its
    quantization_config; `linear` are the model's Linear modules (lm_head among them)."""
    from wna16ctl.sources.formats import CODES, FORMATS as READ_FORMATS, G_IDX, SCALES, ZERO_POINTS
    from wna16ctl.sources.formats.qweight import is_head

    fmt, source = READ_FORMATS[spec.format], COMPRESSED_TENSORS.names
    quantized = [module for module in linear if source.tensor(module, CODES) in tensors]
    skipped = gptq.skip_entries([m for m in linear if m not in quantized and not is_head(m)], linear)
    qc = _gptq_config(spec, skipped) if spec.format == gptq.QUANT_METHOD else _awq_config(spec, skipped)
    where = Path("config.json")
    read_back = fmt.resolver(fmt.parse_config(qc, where), qc, where)
    if read_back is None:  # the qweight formats resolve modules by rules of their own
        raise AssertionError(f"the {spec.format} format has no module rules")
    schemes = dict(zip(linear, read_back(linear)))
    wrong = [m for m in linear if (schemes[m] is None) != (m not in quantized)]
    if wrong:  # the config and the tensors would disagree
        raise AssertionError(f"the {spec.format} config reads {wrong[0]} as {schemes[wrong[0]]}")
    out: dict[str, torch.Tensor] = {}
    done = set(quantized)
    for name, tensor in tensors.items():
        split = source.split(name)
        if split is None or split[0] not in done:
            out[name] = tensor
        elif split[1] == CODES:  # the module's tensors where its codes were
            module, scheme = split[0], schemes[split[0]]
            assert scheme is not None
            canonical = {role: tensors[source.tensor(module, role)] for role in (CODES, SCALES, ZERO_POINTS, G_IDX)
                         if source.tensor(module, role) in tensors}
            canonical[SCALES] = canonical[SCALES].to(QWEIGHT_SCALE_DTYPE)
            stored = fmt.stored_form(canonical, scheme)
            out |= {fmt.names.tensor(module, role): stored[role] for role in (CODES, ZERO_POINTS, SCALES, G_IDX)
                    if role in stored}
    return out, qc


# ----------------------------------------------------------------------------------------------
# writing


def _shard_assignment(sizes: list[int], num_shards: int) -> list[int]:
    """Shard index of each tensor: consecutive runs of about equal bytes, none empty."""
    if num_shards > len(sizes):
        raise ValueError(f"DemoSpec: {num_shards} shards for only {len(sizes)} tensors")
    total = sum(sizes)
    assignment, before = [], 0
    for size in sizes:
        assignment.append(min(num_shards - 1, before * num_shards // total))
        before += size
    if len(set(assignment)) == num_shards:
        return assignment
    # a few huge tensors left a shard empty: split by count instead
    return [i * num_shards // len(sizes) for i in range(len(sizes))]


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' bytes, written by Python: a full disk is an OSError naming the file (the
    library's own writer raises its own error type), and the file gets the mode any new file gets
    (0644 under the usual umask; the library itself creates it 0600)."""
    path.write_bytes(save(tensors, metadata=metadata))


def _write_safetensors(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int,
                       whole_modules: bool = False) -> None:
    """`whole_modules`: each module's tensors in one shard (GPTQModel's dequantizer reads a
    projection's qweight, qzeros, scales and g_idx from one file, as its writer puts them)."""
    metadata = {"format": "pt"}
    if num_shards == 1:
        _save_file(tensors, out_dir / "model.safetensors", metadata)
        return
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    if whole_modules:
        modules = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
        module_bytes = dict.fromkeys(modules, 0)
        for name, size in zip(names, sizes):
            module_bytes[name.rpartition(".")[0]] += size
        shard_of = dict(zip(modules, _shard_assignment(list(module_bytes.values()), num_shards)))
        assignment = [shard_of[n.rpartition(".")[0]] for n in names]
    else:
        assignment = _shard_assignment(sizes, num_shards)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        shard_tensors = {n: tensors[n] for n, a in zip(names, assignment) if a == shard}
        _save_file(shard_tensors, out_dir / file_name, metadata)
        weight_map |= {n: file_name for n in shard_tensors}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # the layout ModelCompressor.update_config uses
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def write_demo_checkpoint(out_dir: str | os.PathLike[str], spec: DemoSpec = DemoSpec(),
                          progress: TaskStarter | None = None) -> Path:
    """Write the checkpoint of `spec` into `out_dir` and return its path.

    `out_dir` must not exist or be empty (stale shards of another spec would be read as part
    of this checkpoint).  Files: config.json (+ quantization_config),
    model-0000i-of-0000n.safetensors + model.safetensors.index.json (or one model.safetensors),
    and with `spec.tokenizer` tokenizer.json + tokenizer_config.json + demo_questions.jsonl (the
    generated questions verify uses when GSM8K is not found).
    Same spec -> byte-identical files.
    """
    _check_spec(spec)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: the demo checkpoint needs a new or empty folder")
    return _write_files(out, spec, progress)


def demo_file_names(spec: DemoSpec) -> list[str]:
    """The files `write_demo_checkpoint` writes for `spec`, by name."""
    if spec.num_shards == 1:
        shards = ["model.safetensors"]
    else:
        shards = [f"model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors" for i in range(spec.num_shards)]
        shards.append("model.safetensors.index.json")
    tokenizer = ["tokenizer.json", "tokenizer_config.json", DEMO_QUESTIONS] if spec.tokenizer else []
    side = [gptq.QUANTIZE_CONFIG] if spec.format == gptq.QUANT_METHOD else []
    return ["config.json", *side, *shards, *tokenizer]


def write_demo_output(out_dir: str | os.PathLike[str], spec: DemoSpec = DemoSpec(), *, force: bool = False,
                      progress: TaskStarter | None = None) -> Path:
    """`wna16ctl demo OUT`: write the checkpoint of `spec` into a new or empty OUT, or with `force`
    over a demo checkpoint written there before, and nothing else.

    The files are written into the staging directory beside OUT (`outdir.stage_path`) and OUT
    becomes them in one rename (`outdir.commit_stage`, as repack's output does): an interrupted or
    failed run (read-only or full filesystem) leaves OUT as it was and removes what it staged.  The
    checkpoint holds a marker (`outdir.DEMO_MARKER`) listing the demo's files, so a later `--force`
    can prove every entry is the demo's; a directory holding anything else, a file, a device or a
    symbolic link is refused."""
    from wna16ctl.errors import OutputError
    from wna16ctl.output import outdir

    _check_spec(spec)
    out = Path(out_dir)
    _check_demo_out(out, force)
    # "." and ".." have no name to stage beside: the absolute path does (links are not followed:
    # OUT itself is never one, `_check_demo_out`)
    target = Path(os.path.abspath(out))
    stage = outdir.stage_path(target)
    lock, committed = -1, False
    try:
        lock = _lock_demo_stage(stage, out)
        outdir.clear_dir(stage)  # what an interrupted demo left
        outdir.write_file(stage / outdir.DEMO_MARKER, outdir.demo_marker(demo_file_names(spec)))
        _write_files(stage, spec, progress)
        with interrupts.deferred() as deferral:  # both renames or neither; after them the output is complete
            outdir.commit_stage(stage, target, _remove_earlier_demo)
            committed = True
            deferral.forget()
        return out
    except OSError as e:
        raise OutputError(f"{out}: cannot write the demo checkpoint ({e.strerror or e}); nothing was written "
                          "there; choose a writable folder with free space") from None
    finally:
        if lock >= 0:
            if not committed:  # created (or emptied) and locked by this run: all of it is ours
                shutil.rmtree(stage, ignore_errors=True)
            os.close(lock)


def _check_demo_out(out: Path, force: bool) -> None:
    """Refuse an OUT the demo must not replace: a link, a file, a folder holding anything but an
    earlier demo checkpoint (that one only with `force`), a mount point (the rename cannot reach it)."""
    from wna16ctl.errors import OutputError, UsageError
    from wna16ctl.output import outdir

    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as e:  # a parent that is a file, a loop of links, ...
        raise OutputError(f"{out}: cannot be used for the demo checkpoint ({e.strerror or e}); choose another folder") from None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{out}: is a symbolic link; the demo is never written through one (name the folder "
                         "itself, or choose another)")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{out}: exists and is not a folder; the demo writes a new or empty folder, or with "
                         "--force one holding an earlier demo checkpoint; choose another name")
    foreign = outdir.foreign_demo_entry(out)
    if foreign is not None:
        raise UsageError(f"{out}: holds files the demo did not write (first: {foreign}); --force replaces only "
                         "an earlier demo checkpoint; choose a new or empty folder")
    if any(out.iterdir()) and not force:
        raise UsageError(f"{out}: holds an earlier demo checkpoint; pass --force to replace it")
    if st.st_dev != os.stat(Path(os.path.abspath(out)).parent).st_dev:
        raise UsageError(f"{out}: is a mount point; the demo replaces its folder in one rename, so choose a "
                         "folder inside it")


def _lock_demo_stage(stage: Path, out: Path) -> int:
    """Create (or take over, when an earlier demo left it) and lock the staging directory of OUT;
    returns the lock's descriptor."""
    from wna16ctl.errors import UsageError
    from wna16ctl.output import outdir

    if os.path.lexists(stage):
        if not outdir.is_real_dir(stage) or outdir.foreign_demo_entry(stage) is not None:
            raise UsageError(f"{stage}: exists but was not written by the demo; move it away and run again")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
    lock = outdir.lock_dir(stage)
    if lock < 0:
        raise outdir.busy(out, "demo")
    return lock


def _remove_earlier_demo(old: Path) -> None:
    """`outdir.commit_stage`'s proof for a previous OUT an earlier demo left moved aside."""
    from wna16ctl.errors import UsageError
    from wna16ctl.output import outdir

    if not os.path.lexists(old):
        return
    if not outdir.is_real_dir(old) or outdir.foreign_demo_entry(old) is not None:
        raise UsageError(f"{old}: exists but was not written by the demo; move it away and run again")
    shutil.rmtree(old)


def _write_files(out: Path, spec: DemoSpec, progress: TaskStarter | None) -> Path:
    step = (progress or no_progress)("writing the demo checkpoint", 4, unit="steps")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config

    step(1)  # importing compressed-tensors takes seconds
    out.mkdir(parents=True, exist_ok=True)

    model = _module_tree(demo_source_weights(spec))
    apply_quantization_config(model, _quantization_config(spec), show_progress=False)
    # the modules the config quantizes: each now carries the attributes of a _QuantizedLinear
    experts = [cast(_QuantizedLinear, module) for module in model.modules() if hasattr(module, "quantization_scheme")]
    compressor = ModelCompressor.from_pretrained_model(model)
    group_actorder_config: dict[str, Any] | None = None
    if spec.actorder == "group":
        # a separate random stream, so the weights do not depend on whether g_idx is drawn
        permutations = torch.Generator().manual_seed(spec.seed + 1)
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in model.named_modules():
            if not hasattr(module, "quantization_scheme"):
                continue
            # gate and up (and q, k, v) read the same input, so GPTQ derives one act-order from one
            # Hessian and writes the same g_idx for both (vLLM keeps only one copy for w13 and qkv)
            key = re.sub(r"\.(up_proj|w3)$", ".gate_proj", re.sub(r"\.w1$", ".gate_proj", name))
            key = re.sub(r"\.(k_proj|v_proj)$", ".q_proj", key)
            if key not in shared:
                shared[key] = _group_permutation(permutations, module.weight.shape[1], spec.group_size)
            perm, g_idx = shared[key]
            _compress_with_g_idx(cast(_QuantizedLinear, module), perm, g_idx.clone())  # own storage: safetensors refuses shared tensors
        compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
        library_dump = compressor.quantization_config.model_dump(exclude=["quant_method"])
        # wrapped in the keys update_config adds around the dump
        group_actorder_config = _verbose_group_actorder_config(
            {"quant_method": "compressed-tensors", "sparsity_config": {}, "transform_config": {}, **library_dump}
        )
    else:
        for module in experts:
            scale, zero_point = _observe_qparams(module.weight.data, module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero_point)
        # compress_model shows a progress bar that cannot be turned off
        with contextlib.redirect_stderr(io.StringIO()):
            compressor.compress_model(model)

    step(1)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if spec.format != COMPRESSED_TENSORS.quant_method:
        linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
        tensors, qweight_config = _in_qweight_format(spec, tensors, linear)
        _write_safetensors(out, tensors, spec.num_shards, whole_modules=True)
        _write_json(out / "config.json", model_config(spec) | {"quantization_config": qweight_config})
        if spec.format == gptq.QUANT_METHOD:  # GPTQModel writes its config beside config.json too
            _write_json(out / gptq.QUANTIZE_CONFIG, qweight_config)
    elif group_actorder_config is None:
        _write_safetensors(out, tensors, spec.num_shards)
        _write_json(out / "config.json", model_config(spec))
        compressor.update_config(str(out))  # adds the library's quantization_config
    else:
        _write_safetensors(out, tensors, spec.num_shards)
        _write_json(out / "config.json", model_config(spec) | {"quantization_config": group_actorder_config})
    step(1)
    if spec.tokenizer:
        _write_tokenizer(out, spec.vocab_size, tokenizer_training_text())
        write_demo_questions(out / DEMO_QUESTIONS)
    step(1)
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer


_NAMES = ("Natalia", "James", "Maria", "Tom", "Aisha", "Ken", "Lily", "Omar", "Sofia", "Ben", "Grace", "Carlos",
          "Mei", "John", "Priya", "Sam", "Olivia", "Noah", "Emma", "Liam")
_ITEMS = (("apple", "apples"), ("book", "books"), ("cookie", "cookies"), ("marble", "marbles"), ("ticket", "tickets"),
          ("pencil", "pencils"), ("egg", "eggs"), ("flower", "flowers"), ("card", "cards"), ("toy car", "toy cars"),
          ("cupcake", "cupcakes"), ("shirt", "shirts"), ("stamp", "stamps"), ("sticker", "stickers"), ("box", "boxes"))
_PLACES = ("the store", "the market", "school", "the farm", "the bakery", "the library", "the park", "work")
_UNITS = ("hours", "minutes", "days", "weeks", "miles", "dollars", "pounds", "meters")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "fifteen", "twenty", "thirty", "forty", "fifty", "hundred", "thousand", "half", "twice",
                 "third", "quarter", "percent", "dozen")


def tokenizer_training_text(lines: int = TOKENIZER_TRAINING_LINES, seed: int = 0) -> list[str]:
    """Grade-school arithmetic word problems with worked answers, generated from templates, one
    text each (question, newline, answer).

    The demo tokenizer is trained on these so that the package needs no data files: the text has
    the vocabulary of GSM8K-style questions (names, objects, money, time, number words, the
    `<<a*b=c>>` calculator notation and `#### answer` lines), so it tokenizes real questions into
    word pieces rather than bytes.
    """
    return [question + "\n" + answer for question, answer in word_problems(lines, seed)]


def word_problems(lines: int, seed: int) -> list[tuple[str, str]]:
    """(question, worked answer ending in `#### N`) pairs; see `tokenizer_training_text`."""
    import random

    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for i in range(lines):
        name, other = rng.sample(_NAMES, 2)
        one, many = rng.choice(_ITEMS)
        a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(1, 9)
        price = rng.choice((2, 3, 5, 8, 10, 12, 15, 20, 25))
        unit, place, word = rng.choice(_UNITS), rng.choice(_PLACES), rng.choice(_NUMBER_WORDS)
        kind = i % 6
        if kind == 0:
            q = (f"{name} had {a} {many}. {name} gave {c} {many} to {other} and then bought {b} more at {place}. "
                 f"How many {many} does {name} have now?")
            ans = f"After giving some away, {name} had {a}-{c} = <<{a}-{c}={a - c}>>{a - c} {many}.\n" \
                  f"Then {name} had {a - c}+{b} = <<{a - c}+{b}={a - c + b}>>{a - c + b} {many}.\n#### {a - c + b}"
        elif kind == 1:
            q = (f"Each {one} costs ${price}. If {name} buys {b} {many} and pays with a ${price * b + 10} bill, "
                 f"how much change does {name} get back?")
            ans = f"The {many} cost {b}*{price} = $<<{b}*{price}={b * price}>>{b * price}.\n" \
                  f"The change is {price * b + 10}-{b * price} = $<<{price * b + 10}-{b * price}=10>>10.\n#### 10"
        elif kind == 2:
            q = (f"{name} works {b} {unit} a day for {c} days a week. How many {unit} does {name} work in "
                 f"{word} weeks if {word} means {a}?")
            ans = f"In one week {name} works {b}*{c} = <<{b}*{c}={b * c}>>{b * c} {unit}.\n" \
                  f"In {a} weeks that is {b * c}*{a} = <<{b * c}*{a}={b * c * a}>>{b * c * a} {unit}.\n#### {b * c * a}"
        elif kind == 3:
            q = (f"There are {a * b} {many} in {b} boxes with the same number in each box. "
                 f"{other} takes half of one box. How many {many} are left in that box?")
            ans = f"Each box has {a * b}/{b} = <<{a * b}/{b}={a}>>{a} {many}.\n" \
                  f"Half of {a} is {a}/2 = <<{a}/2={a / 2:g}>>{a / 2:g}, so {a / 2:g} are left.\n#### {a / 2:g}"
        elif kind == 4:
            pct = rng.choice((10, 20, 25, 40, 50, 75))
            total = a * 20
            q = (f"A class at {place} has {total} students. {pct}% of them walk to school and the rest ride the bus. "
                 f"How many students ride the bus?")
            walk = total * pct / 100
            ans = f"{pct}% of {total} is {total}*{pct}/100 = <<{total}*{pct}/100={walk:g}>>{walk:g} students.\n" \
                  f"So {total}-{walk:g} = <<{total}-{walk:g}={total - walk:g}>>{total - walk:g} ride the bus.\n" \
                  f"#### {total - walk:g}"
        else:
            q = (f"{name} is {a} years old. {other} is {c} years younger than twice {name}'s age. "
                 f"What is the sum of their ages?")
            age = 2 * a - c
            ans = f"Twice {name}'s age is 2*{a} = <<2*{a}={2 * a}>>{2 * a}.\n{other} is {2 * a}-{c} = " \
                  f"<<{2 * a}-{c}={age}>>{age} years old.\nTogether they are {a}+{age} = <<{a}+{age}={a + age}>>" \
                  f"{a + age} years old.\n#### {a + age}"
        out.append((q, ans))
    return out


DEMO_QUESTION_COUNT = 256
DEMO_QUESTION_SEED = 1  # not the tokenizer's training text (seed 0): held-out problems


def write_demo_questions(path: Path, count: int = DEMO_QUESTION_COUNT, seed: int = DEMO_QUESTION_SEED) -> None:
    """GSM8K-style JSON lines ('question', 'answer') verify falls back to on a demo checkpoint when
    GSM8K itself is not found, so that the demo needs no data files."""
    lines = [json.dumps({"question": q, "answer": a}) for q, a in word_problems(count, seed)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_tokenizer(out_dir: Path, vocab_size: int, training_text: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text, trainer)
    # its own writer raises its own error type on a full disk: Python's raises OSError
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    bos, eos = SPECIAL_TOKENS
    _write_json(
        out_dir / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "model_max_length": 4096},
    )


# ----------------------------------------------------------------------------------------------
# reference decompression


def _read_checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(ckpt_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def _is_group_actorder(weights: dict[str, Any] | None) -> bool:
    actorder = (weights or {}).get("actorder")
    return actorder is True or actorder in ("group", "dynamic")


def library_dequantize(ckpt_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """fp32 weights of every quantized module, by `<module>.weight`, decompressed by compressed-tensors.

    Each config group's compressor (its declared `format`, else the top-level one) decompresses
    the modules its targets select (the library's matching, `ignore` honoured).  compressed-tensors
    0.19+ cannot parse `actorder: "group"`; such checkpoints are unpacked with the library's
    `unpack_from_int32` and dequantized with its arithmetic through the g_idx:
    w[:, k] = (q[:, k] - z[:, g_idx[k]]) * s[:, g_idx[k]].
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    path = Path(ckpt_dir)
    raw_config = json.loads((path / "config.json").read_text())["quantization_config"]
    remaining = _read_checkpoint_tensors(path)
    if any(_is_group_actorder(group.get("weights")) for group in raw_config["config_groups"].values()):
        return _dequantize_with_g_idx(raw_config, remaining)

    config = QuantizationConfig.model_validate(raw_config)
    weights: dict[str, torch.Tensor] = {}
    for scheme in config.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        param_names = compressor.compression_param_names(scheme)
        matches = list(
            match_quantizable_tensors(remaining, config.ignore or [], scheme.targets, param_targets=[param_names[0]])
        )
        for module_name, _ in matches:
            local = {p: remaining.pop(f"{module_name}.{p}") for p in param_names if f"{module_name}.{p}" in remaining}
            weights[f"{module_name}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return weights


def _dequantize_with_g_idx(raw_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.utils.match import match_name

    ignore = raw_config.get("ignore") or []
    weights: dict[str, torch.Tensor] = {}
    modules = [name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed")]
    for module_name in modules:
        if any(match_name(module_name, pattern) for pattern in ignore):
            continue
        group = next(
            (g for g in raw_config["config_groups"].values() if any(match_name(module_name, t) for t in g["targets"])),
            None,
        )
        if group is None:
            continue
        args = group["weights"]
        shape = tuple(int(v) for v in tensors[f"{module_name}.weight_shape"])
        scale = tensors[f"{module_name}.weight_scale"]
        codes = unpack_from_int32(tensors[f"{module_name}.weight_packed"], args["num_bits"], torch.Size(shape))
        zero_point = torch.zeros(scale.shape, dtype=torch.int8)
        if f"{module_name}.weight_zero_point" in tensors:
            zero_point = unpack_from_int32(
                tensors[f"{module_name}.weight_zero_point"], args["num_bits"], torch.Size((shape[0], scale.shape[1])), packed_dim=0
            )
        cols = shape[1]
        if f"{module_name}.weight_g_idx" in tensors:
            g_idx = tensors[f"{module_name}.weight_g_idx"].long()
        else:
            group_size = args.get("group_size") or -1
            g_idx = torch.arange(cols) // group_size if group_size > 0 else torch.zeros(cols, dtype=torch.long)
        # the library's _dequantize arithmetic: (q - z) and the product in the scale's dtype
        offset = codes.to(scale.dtype) - zero_point[:, g_idx].to(scale.dtype)
        weights[f"{module_name}.weight"] = (offset * scale[:, g_idx]).float()
    return weights
