"""What wna16ctl knows of each MoE model family, keyed by config.json's `model_type`: one table.

The config reader, the planners (the model checks, pad's widths, the vllm layout's key contract),
the demo's checkpoints, verify's routing and e2e read a family's facts here; no other module
lists architectures.  A family the table does not hold is still read (from the tensors and the
usual config fields) but is not written by the demo, padded, served as sharded_state or run by e2e.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# where vLLM's model keeps the router in the state dict `sharded_state` saves
ROUTER_IN_RUNNER = "runner"  # handed to the MoE runner, whose shorter key `experts.gate` is kept
ROUTER_IN_BLOCK = "block"  # the block's own `gate`, in the model dtype
ROUTER_IN_BLOCK_FP32 = "block_fp32"  # the block's own `gate`, an fp32 parameter

# the shared experts beside the routed ones
SHARED_EXPERT = "shared_expert"  # Qwen2-MoE: one MLP with its own width and a sigmoid gate
SHARED_EXPERTS = "shared_experts"  # DeepSeek-style: n_shared_experts MLPs of the routed width, fused into one


@dataclass(frozen=True)
class Architecture:
    model_type: str
    model_class: str | None = None  # config.json `architectures[0]`; None: the demo does not write it
    moe_block: str = "mlp"  # the MoE block's module name: model.layers.{L}.{moe_block}.experts...
    # the expert projections as named in the checkpoint: (gate, up, down), and the order the model
    # registers them in (what the demo draws its random tensors in)
    gate_up_down: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    registration_order: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # the config field of the routed experts' width
    expert_width_field: str = "moe_intermediate_size"
    # the config field of the number of routed experts: vLLM builds that many, and a config without
    # it gets transformers' default (128 for Qwen3-MoE), whatever the tensors hold; None: not known
    experts_field: str | None = "num_experts"
    # `intermediate_size` is the dense MLP's width, not the experts' (a missing expert width is
    # then read from the tensors, never from `intermediate_size`)
    separate_expert_width: bool = True
    shared_experts: str | None = None  # SHARED_EXPERT, SHARED_EXPERTS or None
    # config (field, multiplier field or None) of the shared experts' width
    shared_width: tuple[str, str | None] | None = None
    dense_first: bool = False  # the first layer keeps a dense MLP (first_k_dense_replace)
    mla: bool = False  # multi-head latent attention
    qkv_bias: bool = False  # q/k/v projections with biases
    qk_norm: bool = False  # per-head q/k RMSNorm
    router: str | None = None  # where the state dict keeps the router (ROUTER_IN_*; None: not known)
    # where the state dict keeps noaux_tc routing's correction bias: beside the router ("router")
    # or under the routed experts ("experts"); None: the family has none
    correction_bias: str | None = None
    router_takes_quant: bool = False  # the model file hands the quant config to its router
    experts_at_least_tp: bool = False  # the model file asserts num_experts >= TP size
    # the router's top-k weights are renormalised: whatever the config says, or (else) as config
    # `norm_topk_prob` says, with this default
    always_renormalize: bool = False
    norm_topk_prob_default: bool = False  # transformers' default, for a config.json that leaves it out
    # how vLLM's model class routes (sources.model.moe_routing): "softmax" top-k (renormalised as
    # norm_topk_prob says), "naive" (softmax, always renormalised), "grouped" (DeepSeek-style: the
    # config's scoring_func, topk_method and n_group), "sigmoid_bias" (sigmoid with a correction
    # bias); None: not looked up for the family
    routing: str | None = None
    e2e: bool = False  # verify --e2e has a torch reference of the family's forward
    sharded_state: bool = False  # `repack --layout vllm` has a key contract (rules.VLLM_STATE_KEYS)
    pad: bool = False  # `pad` knows the config fields of every MLP width (width_fields)

    def width_fields(self) -> dict[str, tuple[str, str | None]]:
        """kind (routed, shared, dense) -> (config field, multiplier field or None) of that kind's
        MLP width: the width is config[field] * config[multiplier] (None: 1)."""
        out: dict[str, tuple[str, str | None]] = {"routed": (self.expert_width_field, None)}
        if self.separate_expert_width:
            out["dense"] = ("intermediate_size", None)
        if self.shared_width is not None:
            out["shared"] = self.shared_width
        return out


_DEEPSEEK_V3 = Architecture("deepseek_v3", "DeepseekV3ForCausalLM", experts_field="n_routed_experts",
                            shared_experts=SHARED_EXPERTS,
                            shared_width=("moe_intermediate_size", "n_shared_experts"), dense_first=True, mla=True,
                            router=ROUTER_IN_RUNNER, correction_bias="router", norm_topk_prob_default=True,
                            routing="grouped", e2e=True, sharded_state=True, pad=True)
# the families the demo writes come first, in the order `demo --arch` lists them
_TABLE = (
    Architecture("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, router=ROUTER_IN_RUNNER, router_takes_quant=True,
                 experts_at_least_tp=True, routing="softmax", e2e=True, sharded_state=True, pad=True),
    Architecture("mixtral", "MixtralForCausalLM", moe_block="block_sparse_moe", gate_up_down=("w1", "w3", "w2"),
                 registration_order=("w1", "w2", "w3"), expert_width_field="intermediate_size",
                 experts_field="num_local_experts",
                 separate_expert_width=False, router=ROUTER_IN_BLOCK, always_renormalize=True,
                 norm_topk_prob_default=True, routing="naive", e2e=True, sharded_state=True, pad=True),
    Architecture("qwen2_moe", "Qwen2MoeForCausalLM", shared_experts=SHARED_EXPERT,
                 shared_width=("shared_expert_intermediate_size", None), qkv_bias=True, router=ROUTER_IN_BLOCK,
                 experts_at_least_tp=True, routing="softmax", e2e=True, sharded_state=True, pad=True),
    _DEEPSEEK_V3,
    replace(_DEEPSEEK_V3, model_type="deepseek_v2", model_class="DeepseekV2ForCausalLM", norm_topk_prob_default=False,
            e2e=False),
    replace(_DEEPSEEK_V3, model_type="kimi_k2", e2e=False),  # Kimi-K2 is the DeepSeek-V3 architecture
    replace(_DEEPSEEK_V3, model_type="glm4_moe", model_class="Glm4MoeForCausalLM", mla=False, qkv_bias=True,
            router=ROUTER_IN_BLOCK_FP32, correction_bias="experts", routing="sigmoid_bias", e2e=False),
    # families inspect and repack read, which the demo does not write
    Architecture("qwen3_next", qk_norm=True, experts_at_least_tp=True),
    # (their expert width is read as for an unknown family: `intermediate_size` is a fallback)
    Architecture("qwen3_5_moe", qk_norm=True, experts_at_least_tp=True, separate_expert_width=False),
    Architecture("qwen3_5_moe_text", qk_norm=True, experts_at_least_tp=True, separate_expert_width=False),
    Architecture("qwen3_vl_moe"),
    # (their experts' field is not required: read under any of the usual names)
    Architecture("dots1", experts_field=None),
    Architecture("ernie4_5_moe", experts_field=None),
    Architecture("hunyuan_v1_moe", experts_field=None),
    Architecture("bailing_moe", experts_field=None),
    Architecture("step3_text", experts_field=None),
)
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in _TABLE}
# the families the demo writes (those with a model class)
DEMO_ARCHITECTURES = tuple(a.model_type for a in _TABLE if a.model_class is not None)


def architecture(model_type: str | None) -> Architecture | None:
    """The table's row for `model_type` (None: a family the table does not hold)."""
    return ARCHITECTURES.get(model_type or "")


def model_types(**facts: object) -> tuple[str, ...]:
    """The model types whose facts have the given values, in table order (`model_types(mla=True)`)."""
    return tuple(a.model_type for a in _TABLE if all(getattr(a, k) == v for k, v in facts.items()))
