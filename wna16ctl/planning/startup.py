"""The rest of a start: what vLLM's profiling takes from the KV budget besides the weights.

Every release 0.27-0.33 sizes the KV cache in `Worker.determine_available_memory`
(v1/worker/gpu_worker.py): `ceil(total x gpu_memory_utilization)`, less what was consumed since
the worker's first memory snapshot (the weights and whatever the profiling run keeps), less the
transient peak of that run (`memory_profiling`: torch's peak less what stays allocated), less the
CUDA graph memory `profile_cudagraph_memory` estimates by capturing graphs (applied by default,
`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`).  NCCL's buffers and the CUDA context come before
that snapshot, so they are not taken from the budget.

What depends on the deployment is computed here from the config, per rank:
- the transient peak of `profile_run`: a dummy forward of `--max-num-batched-tokens` tokens (the
  residual stream and one decoder layer's largest step: the attention projections, or the fused MoE
  method's intermediate caches of tokens x top-k rows, or a dense MLP) and the sampler's dummy pass
  over min(`--max-num-seqs`, tokens) rows of the whole vocabulary (`_dummy_sampler_run`);
- the CUDA graphs: how many the release captures (`_set_cudagraph_sizes`: sizes up to
  min(2 x max_num_seqs, 512 (1024 on Blackwell from 0.28.0), max_num_batched_tokens), a PIECEWISE
  graph per size and a FULL graph per decode size up to max_num_seqs), each after the first of its
  mode counted at vLLM's own floor of 1 MiB, the first at the forward's peak at its size.
These are estimates computed from sizes, not measurements: never exact.  What the code gives no
rule for is a stated bracket (`UNMODELLED`, `WARMUP`), and every figure derived from the rest is a
range.  Torch-free; no files read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wna16ctl.planning import rules

MIB, GIB = 1 << 20, 1 << 30
GRAPH_FLOOR = MIB  # profile_cudagraph_memory: "at least 1 MiB per graph for driver overhead"
# Per logit of the sampler's dummy pass: the float32 logits, the softmax probabilities, and the
# top-k/top-p sort's float32 values and int64 indices (the dummy pass sets top-k and top-p)
SAMPLER_BYTES = 4 + 4 + 4 + 8
# No rule in the code: kernels loaded during the profiling run (Inductor's and Triton's modules),
# attention backends' workspaces, the cuBLAS workspace of the releases that create it after the
# snapshot (0.27-0.32), the caching allocator's fragmentation.  A judgement, not fitted to logs.
UNMODELLED = (0, 1 * GIB)


@dataclass(frozen=True)
class Shape:
    """One rank's widths of a decoder layer, in elements (model dtype: `elem` bytes)."""

    hidden: int
    attn_in: int  # the QKV projection's output on the rank (MLA: q, the latent, and its expansion)
    attn_out: int  # the attention's output on the rank
    moe: tuple[int, int, int, int] | None  # experts, top-k, intermediate per rank, shared intermediate per rank
    dense: int  # a dense MLP's intermediate per rank (0: none)
    vocab: int  # the padded vocabulary (the sampler sees all of it)
    elem: int


@dataclass(frozen=True)
class RestOfStart:
    """One rank's rest of a start (bytes): computed estimates and the bracket of what is not derived."""

    batched_tokens: int
    forward: int  # the dummy forward's transient peak
    sampler: int  # the sampler pass's transient peak (the forward's output held)
    graphs: int  # CUDA graphs captured (0: none)
    cudagraph: int  # vLLM's CUDA graph estimate as computed here
    warmup: int  # the first capture's eager warm-up, which may or may not reuse cached blocks (bracket)

    @property
    def activation(self) -> int:
        return max(self.forward, self.sampler)

    @property
    def low(self) -> int:
        return self.activation + self.cudagraph + UNMODELLED[0]

    @property
    def high(self) -> int:
        return self.activation + self.cudagraph + self.warmup + UNMODELLED[1]

    def to_json(self) -> dict[str, Any]:
        def est(v: int) -> dict[str, Any]:
            return {"value": v, "unit": "bytes", "exact": False, "source": "computed"}

        return {"value": [self.low, self.high], "unit": "bytes", "exact": False,
                "max_num_batched_tokens": self.batched_tokens,
                "activation_peak": est(self.activation), "forward_peak": est(self.forward),
                "sampler_peak": est(self.sampler), "cuda_graphs": self.graphs,
                "cuda_graph_memory": est(self.cudagraph),
                "bracket": {"value": [UNMODELLED[0], UNMODELLED[1] + self.warmup], "unit": "bytes", "exact": False,
                            "source": "not derived: kernels loaded while profiling, workspaces, allocator "
                                      "fragmentation, the first graph capture's warm-up (docs/memory.md)"}}


def default_batched_tokens(vllm: str, gpu_mem: int, gpu_name: str | None) -> int:
    """`vllm serve`'s default --max-num-batched-tokens on a GPU of `gpu_mem` bytes
    (EngineArgs.get_batch_defaults, OPENAI_API_SERVER)."""
    if gpu_mem >= 160 * GIB and rules.release(vllm).has("serve.batch_defaults_160gib"):
        return 16384
    if gpu_mem >= 70 * GIB and not (gpu_name or "").lower().startswith("a100"):
        return 8192
    return 2048


def capture_sizes(vllm: str, arch: str, max_num_seqs: int, batched_tokens: int) -> list[int]:
    """The CUDA graph sizes a release captures by default (VllmConfig._set_cudagraph_sizes)."""
    largest = 1024 if arch == "sm100" and rules.release(vllm).has("serve.cudagraph_1024_on_sm100") else 512
    top = min(2 * max_num_seqs, largest, batched_tokens)
    sizes = [i for i in (1, 2, 4) if i <= top] + list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))
    if batched_tokens <= top and batched_tokens not in sizes:
        sizes.append(batched_tokens)
    return sizes


def forward_peak(s: Shape, tokens: int) -> int:
    """The transient peak of a forward of `tokens` tokens: the residual stream and the hidden states,
    and on top the largest step of one decoder layer."""
    attention = tokens * (s.attn_in + s.attn_out + s.hidden) * s.elem
    steps = [attention, tokens * (3 * s.dense + s.hidden) * s.elem if s.dense else 0]
    if s.moe is not None:
        experts, top_k, inter, shared = s.moe
        rows = tokens * top_k
        # router logits (float32), top-k weights and ids, the method's intermediate caches (w13's
        # output and w2's, sharing one buffer, and the activation's), the output, a shared expert
        steps.append(4 * tokens * experts + 8 * rows + s.elem * (rows * (max(2 * inter, s.hidden) + inter)
                                                                + tokens * (s.hidden + 3 * shared)))
    return 2 * tokens * s.hidden * s.elem + max(steps)


def rest_of_start(s: Shape, vllm: str, arch: str, max_num_seqs: int, batched_tokens: int) -> RestOfStart:
    """The rest of a start on one rank for a layer shape `s` (see `shape`)."""
    rows = min(max_num_seqs, batched_tokens)
    sampler = batched_tokens * s.hidden * s.elem + rows * s.vocab * (s.elem + SAMPLER_BYTES)
    sizes = capture_sizes(vllm, arch, max_num_seqs, batched_tokens)
    full = [n for n in sizes if n <= max_num_seqs]
    graphs, cudagraph, warmup = 0, 0, 0
    for mode in (sizes, full):
        if mode:
            graphs += len(mode)
            first = forward_peak(s, max(mode))
            cudagraph += first + GRAPH_FLOOR * (len(mode) - 1)
            warmup += first
    return RestOfStart(batched_tokens, forward_peak(s, batched_tokens), sampler, graphs, cudagraph, warmup)


def _text(raw: dict[str, Any]) -> dict[str, Any]:
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def _int(text: dict[str, Any], *keys: str) -> int:
    for k in keys:
        v = text.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


def shape(ck: Any, tp: int, moe_plans: dict[str, Any], model_bytes: int) -> Shape:
    """One rank's layer widths for the checkpoint `ck` (sources.Checkpoint) at `tp`, the MoE
    intermediate per rank from its plans (prefix -> plan at that size)."""
    from wna16ctl.planning.memory import padded_vocab

    dims, text = ck.dims, _text(ck.config.raw)
    hidden = ck.config.hidden_size
    heads = max(1, (dims.num_attention_heads or 1) // tp)
    kv = max(1, (dims.num_key_value_heads or 1) // tp)
    hd = dims.head_dim or hidden // max(1, dims.num_attention_heads or 1)
    if dims.mla:
        nope, rope, v_hd = (_int(text, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        attn_in = heads * (nope + rope) + _int(text, "kv_lora_rank") + rope + heads * (nope + v_hd)
        attn_out = heads * v_hd
    else:
        attn_in, attn_out = (heads + 2 * kv) * hd, heads * hd
    moe = None
    if ck.layers:
        lay = ck.layers[0]
        plan = moe_plans.get(lay.prefix)
        inter = plan.intermediate_size_per_partition if plan is not None else lay.intermediate_size // tp
        top_k = ck.config.num_experts_per_tok or 1
        shared = _int(text, "shared_expert_intermediate_size") or \
            _int(text, "n_shared_experts") * (ck.config.moe_intermediate_size or 0)
        moe = (lay.num_experts, top_k, inter, shared // tp)
    dense = _int(text, "intermediate_size") // tp if not ck.layers or _int(text, "first_k_dense_replace") else 0
    return Shape(hidden, attn_in, attn_out, moe, dense, padded_vocab(dims.vocab_size or 0), model_bytes)
