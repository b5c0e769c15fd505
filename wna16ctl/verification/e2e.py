"""`verify --e2e`: the model itself answers GSM8K prompts, once with the source checkpoint's experts
and once with the repacked ones, and the two greedy generations are compared token by token.

The model is built by transformers from the checkpoint's own config, with every non-expert weight
read from the checkpoint. Only the routed experts' module of each MoE block is replaced (the
router, attention, norms, shared experts and residual stream stay transformers'):

* reference — experts dequantised from the SOURCE checkpoint files ((q − z)·s in the model dtype,
  one rounding), sliced per rank the way the all-reduce sums them, fp32 accumulation;
* candidate — each rank's REPACKED tensors as written, through the project's MoE GEMM op
  (`torch.ops.wna16ctl.moe_wna16_gemm`: the CUDA kernel on a GPU, its CPU twin elsewhere);
  EP ranks compute their local experts; rank outputs are summed as the all-reduce would.

Both round at the same points (activations, GEMM outputs, the gated product, per-rank partials
and their sum, all in the model dtype), so a correct repack differs from the reference only by
accumulation order. The non-expert part runs in fp32 so that logits carry no ties of their own.

Pass criterion (docs/verify.md, "e2e"): at every step where the two runs have seen the same
tokens, max |Δlogit| must stay within the logit change that the rounding model's largest allowed
error causes: the reference re-run (teacher-forced on its own tokens) with every MoE block's
output perturbed by a relative error of √ROUNDINGS·u per token, the limit of the layer check.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from wna16ctl.verification.activations import read_records
from wna16ctl.errors import BadInput

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
FEW_SHOT = 2  # worked GSM8K examples before the question when the checkpoint has no chat template
PROBE_SEED = 0
SMALL_MODEL_HIDDEN = 2048  # up to this width the CPU run uses one intra-op thread
INSTALL_HINT = "pip install 'wna16ctl[e2e]'"
TRANSFORMERS_RANGE = ">=4.57,<6"


@dataclass
class E2EOptions:
    prompts: int = 8
    max_new_tokens: int = 32
    score: bool = False


@dataclass
class PromptComparison:
    """One GSM8K prompt: reference and candidate greedy tokens and their logits, step by step."""

    index: int
    prompt_tokens: int
    reference_tokens: list[int]
    candidate_tokens: list[int]
    agree_prefix: int  # tokens equal before the first divergence
    agree_total: int  # positions (of the shorter run) where the tokens are equal
    first_divergence: int | None  # step of the first differing token (None: identical runs)
    max_abs_dlogit: list[float]  # per compared step (every step up to and including the divergence)
    kl: list[float]  # KL(reference ‖ candidate) per compared step
    bound: list[float]  # the rounding model's logit change per compared step
    reference_margin: float | None = None  # reference logit of its token minus that of the candidate's, at the divergence
    reference_text: str = ""
    candidate_text: str = ""
    reference_answer: str | None = None
    candidate_answer: str | None = None
    gold_answer: str | None = None

    @property
    def worst_step(self) -> int | None:
        """First compared step whose max |Δlogit| exceeds the bound."""
        return next((t for t, (d, b) in enumerate(zip(self.max_abs_dlogit, self.bound)) if d > b), None)

    @property
    def passed(self) -> bool:
        return self.worst_step is None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "prompt_tokens": self.prompt_tokens, "passed": self.passed,
            "generated": len(self.reference_tokens), "agree_prefix": self.agree_prefix, "agree_total": self.agree_total,
            "first_divergence": self.first_divergence, "first_step_over_bound": self.worst_step,
            "max_abs_dlogit": max(self.max_abs_dlogit, default=0.0), "max_kl": max(self.kl, default=0.0),
            "min_bound": min(self.bound, default=0.0),
            "steps": [{"max_abs_dlogit": d, "kl": k, "bound": b} for d, k, b in zip(self.max_abs_dlogit, self.kl, self.bound)],
            "reference_margin": self.reference_margin,
            "reference_tokens": self.reference_tokens, "candidate_tokens": self.candidate_tokens,
            "reference_text": self.reference_text, "candidate_text": self.candidate_text,
            "reference_answer": self.reference_answer, "candidate_answer": self.candidate_answer,
            "gold_answer": self.gold_answer,
        }


@dataclass
class E2EResult:
    """The end-to-end check's outcome: status "pass" | "FAIL" | "not run", and why."""

    status: str
    reason: str = ""
    model: str = ""
    device: str = ""
    expert_dtype: str = ""
    prompt_form: str = ""
    max_new_tokens: int = 0
    seconds: float = 0.0
    prompts: list[PromptComparison] = field(default_factory=list)
    score: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def tokens_generated(self) -> int:
        return sum(len(p.reference_tokens) for p in self.prompts)

    @property
    def tokens_agreeing(self) -> int:
        """Tokens before each prompt's first divergence, summed (the strict agreement)."""
        return sum(p.agree_prefix for p in self.prompts)

    @property
    def first_failure(self) -> tuple[int, int] | None:
        """(prompt index, step) of the first step over the bound."""
        return next(((p.index, p.worst_step) for p in self.prompts if p.worst_step is not None), None)

    def to_json(self) -> dict[str, Any]:
        gen = self.tokens_generated
        return {
            "status": self.status, "passed": self.passed, "reason": self.reason, "model": self.model,
            "device": self.device, "expert_dtype": self.expert_dtype, "prompt_form": self.prompt_form,
            "max_new_tokens": self.max_new_tokens, "seconds": round(self.seconds, 2),
            "tokens_generated": gen, "tokens_agreeing": self.tokens_agreeing,
            "agreement": (self.tokens_agreeing / gen) if gen else None,
            "first_failure": None if self.first_failure is None else
            {"prompt": self.first_failure[0], "step": self.first_failure[1]},
            "prompts": [p.to_json() for p in self.prompts],
            "score": self.score,
        }


def not_run(reason: str) -> E2EResult:
    return E2EResult(status="not run", reason=reason)


def require_transformers() -> None:
    """The one optional dependency of --e2e; a one-line error with the install command without it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise BadInput(f"verify --e2e needs transformers ({TRANSFORMERS_RANGE}): {INSTALL_HINT}") from None


# ---- prompts ---------------------------------------------------------------------------------------------


def gsm8k_answer(text: str | None) -> str | None:
    """GSM8K's final number: the first after '####' when there is one, else the last in the text."""
    if not text:
        return None
    marked = "####" in text
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text.split("####", 1)[1] if marked else text)
    if not nums:
        return None
    num = (nums[0] if marked else nums[-1]).replace(",", "")
    return num.rstrip("0").rstrip(".") if "." in num else num


@dataclass
class _Prompts:
    ids: list[list[int]]
    gold: list[str | None]
    form: str
    decode: Callable[[list[int]], str]


def _build_prompts(ck_root: Path, samples: Path, n: int, vocab: int) -> _Prompts:
    if not samples.is_file():
        raise BadInput(f"{samples}: no such file; --e2e needs GSM8K records (JSON lines with 'question'/'answer')")
    records = read_records(samples, n)
    if not records:
        raise BadInput(f"{samples}: no samples")
    gold = [gsm8k_answer(r.get("answer")) for r in records]
    tok_path = ck_root / "tokenizer.json"
    tokenizer = None
    template = None
    if tok_path.is_file():
        from transformers import PreTrainedTokenizerFast

        cfg_path = ck_root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
        template = cfg.get("chat_template")
        if not template and (ck_root / "chat_template.jinja").is_file():
            template = (ck_root / "chat_template.jinja").read_text()
    if tokenizer is not None and template:
        tokenizer.chat_template = template
        ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
               for r in records]
        form = "chat template"
    else:
        train = samples.parent / "train.jsonl"
        shots = read_records(train, FEW_SHOT) if train.is_file() else []
        prefix = "".join(f"Question: {s['question']}\nAnswer: {s.get('answer', '')}\n\n" for s in shots)
        texts = [f"{prefix}Question: {r['question']}\nAnswer:" for r in records]
        form = f"few-shot ({len(shots)} worked examples)"
        if tokenizer is not None:
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        else:
            ids = [[b % vocab for b in t.encode("utf-8")] for t in texts]
            form += ", byte tokens"
    if tokenizer is not None:
        decode = lambda toks: tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
    else:
        decode = lambda toks: bytes(t for t in toks if t < 256).decode("utf-8", "replace")  # noqa: E731
    return _Prompts([[i for i in p if i < vocab] for p in ids], gold, form, decode)


# ---- the model -------------------------------------------------------------------------------------------


def _build_model(ck, device: torch.device):  # noqa: ANN001 - Checkpoint
    """transformers' model of the checkpoint's config (fp32), non-expert weights from the checkpoint.
    Returns (model, {checkpoint experts prefix: the model's MoE block})."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from wna16ctl.sources.tensors import TensorReader

    raw = {k: v for k, v in ck.config.raw.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):  # no memory for weights that are read from the checkpoint next
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    blocks: dict[str, torch.nn.Module] = {}
    by_index = {lay.layer_index: lay for lay in ck.layers}
    renames: list[tuple[str, str]] = []  # (model prefix, checkpoint prefix) of MoE blocks
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "experts") or i not in by_index:
            continue
        lay = by_index[i]
        blocks[lay.prefix] = block
        block.experts = torch.nn.Identity()  # each run installs its own experts
        renames.append((f"model.layers.{i}.mlp.", lay.block + "."))
    model.to_empty(device="cpu")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with TensorReader(ck.files) as reader, torch.no_grad():
        for name, t in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            src = next((cp + name[len(mp):] for mp, cp in renames if name.startswith(mp)), name)
            if src not in ck.files:
                raise BadInput(f"{ck.root}: has no tensor {src} for the model's {name}; --e2e needs every "
                               "non-expert weight of the architecture")
            w = reader.read(src)
            if tuple(w.shape) != tuple(t.shape):
                raise BadInput(f"{ck.root}: {src} is {list(w.shape)}, the model expects {list(t.shape)}")
            t.copy_(w.to(torch.float32))
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):  # its buffers are computed at construction, not stored
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(module)(config=config))
    if tied:
        model.tie_weights()
    return model.to(device).eval(), blocks


# ---- the two experts implementations ----------------------------------------------------------------------


def _dequantize_source(proj: dict[str, torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """One source projection [N, K] in `dtype`: (q − z)·s with one rounding, as the kernel dequantises."""
    from wna16ctl.layout.packing import unpack_codes

    packed = proj["weight_packed"]
    n = packed.shape[0]
    num_bits = 32 // (k // packed.shape[1])  # from the shapes: mixed-precision experts differ per expert
    codes = unpack_codes(packed, num_bits, dim=1, size=k).long()  # [N, K]
    scale = proj["weight_scale"]  # [N, G]
    groups = scale.shape[1]
    if "weight_g_idx" in proj:
        g = proj["weight_g_idx"].long()
    else:
        g = torch.arange(k) // (k // groups)
    if "weight_zero_point" in proj:
        z = unpack_codes(proj["weight_zero_point"], num_bits, dim=0).long()[:n][:, g]
    else:
        z = 1 << (num_bits - 1)
    return (codes - z).to(dtype) * scale.to(dtype)[:, g]


class _ReferenceExperts:
    """A block's experts from the source checkpoint, per rank as the all-reduce sums them."""

    def __init__(self, ck, reader, job, dtype: torch.dtype, device: torch.device):  # noqa: ANN001
        layer = job.layer
        H, I = layer.hidden_size, layer.intermediate_size
        self.dtype = dtype
        experts = [reader.read_expert(layer, e) for e in range(layer.num_experts)]
        gate = [_dequantize_source(ex["gate"], H, dtype) for ex in experts]  # [I, H]
        up = [_dequantize_source(ex["up"], H, dtype) for ex in experts]
        down = [_dequantize_source(ex["down"], I, dtype) for ex in experts]  # [H, I]
        # per rank: its experts, each as K-first w13 [H, 2·I_p] (gate | up) and w2 [I_p, H] of its
        # slice of the intermediate dimension
        self.ranks: list[tuple[range, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = []
        for spec, rng in zip(job.specs, job.expert_ranges):
            i_p = spec.intermediate_per_partition
            cols = slice(spec.rank * i_p, (spec.rank + 1) * i_p)
            weights = {e: (torch.cat([gate[e][cols], up[e][cols]]).T.contiguous().to(device),
                           down[e][:, cols].T.contiguous().to(device)) for e in rng}  # model dtype, upcast per use
            self.ranks.append((rng, weights))

    def __call__(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.reshape(-1)
        wf = w.reshape(-1).float()
        total = torch.zeros(T, a.shape[1], device=a.device)
        for rng, weights in self.ranks:
            if not len(rng):
                continue
            slots_out = torch.zeros(T * k, a.shape[1], dtype=self.dtype, device=a.device)
            for e, (w13, w2) in weights.items():
                slots = (flat == e).nonzero().squeeze(1)
                if not slots.numel():
                    continue
                g13 = (a[slots // k].float() @ w13.float()).to(self.dtype).float()
                i_p = w2.shape[0]
                h = (F.silu(g13[:, :i_p]) * g13[:, i_p:]).to(self.dtype).float()
                slots_out[slots] = ((h @ w2.float()) * wf[slots].unsqueeze(1)).to(self.dtype)
            partial = slots_out.float().view(T, k, -1).sum(1)
            total += partial.to(self.dtype).float()  # each rank's partial in the model dtype, then all-reduced
        return total.to(self.dtype)


class _CandidateExperts:
    """A block's experts from the repacked per-rank tensors, through the MoE GEMM op."""

    def __init__(self, job, rank_tensors: list[dict[str, torch.Tensor]], dtype: torch.dtype, device: torch.device):  # noqa: ANN001
        self.job, self.tensors, self.dtype, self.device = job, rank_tensors, dtype, device

    def __call__(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from wna16ctl.verification.rank_gemm import rank_moe_output

        total = torch.zeros(a.shape[0], a.shape[1])
        for r, t in enumerate(self.tensors):
            if not len(self.job.expert_ranges[r]):  # EP with more ranks than experts: nothing written
                continue
            partial = rank_moe_output(self.job, r, t, a, ids, w, self.dtype, self.device)
            total += partial.to(self.dtype).float()
        return total.to(self.dtype).to(a.device)


class _ExpertsModule(torch.nn.Module):
    """Stands in for transformers' experts module: forward(hidden [T, H], top_k_index, top_k_weights).

    The activations enter in the model dtype and the output leaves in it (rounded once more to the
    residual's fp32, exactly); `noise` adds the rounding model's largest allowed error (the probe)."""

    def __init__(self, compute: Callable, dtype: torch.dtype, noise: float = 0.0, generator: torch.Generator | None = None):
        super().__init__()
        self.compute, self.dtype, self.noise, self.generator = compute, dtype, noise, generator

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        y = self.compute(hidden_states.to(self.dtype), top_k_index, top_k_weights).float()
        if self.noise:
            z = torch.randn(y.shape, generator=self.generator).to(y.device)
            rms = y.norm(dim=-1, keepdim=True) / math.sqrt(y.shape[-1])
            y = y + self.noise * rms * z  # per token a relative L2 error of `noise` (in expectation)
        return y.to(hidden_states.dtype)


# ---- generation and comparison ------------------------------------------------------------------------------


def _install(blocks: dict[str, torch.nn.Module], modules: dict[str, torch.nn.Module]) -> None:
    for prefix, block in blocks.items():
        block.experts = modules[prefix]


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int, eos: set[int], device: torch.device) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """Greedy tokens and the fp32 logits each was chosen from ([steps, vocab])."""
    import inspect

    # transformers 5.x names the KV cache `cache` (`past_key_values` before)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens: list[int] = []
    logits = [out.logits[0, -1].float().cpu()]
    while True:
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        if tok in eos or len(tokens) >= n:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), use_cache=True, **{key: getattr(out, key)})
        logits.append(out.logits[0, -1].float().cpu())
    return tokens, torch.stack(logits)


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:  # noqa: ANN001
    """Logits of every generation step given the tokens before it ([steps, vocab])."""
    seq = prompt + tokens[:-1]
    out = model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    return out.logits[0, len(prompt) - 1:].float().cpu()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp = F.log_softmax(p_logits.double(), -1)
    lq = F.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def compare_runs(index: int, prompt_len: int, ref: tuple[list[int], torch.Tensor], cand: tuple[list[int], torch.Tensor],
                 bound: torch.Tensor) -> PromptComparison:
    """Token agreement and per-step logit differences of two greedy runs from the same prompt;
    steps are compared while both runs have seen the same tokens (up to the first divergence)."""
    (rt, rl), (ct, cl) = ref, cand
    n = min(len(rt), len(ct))
    first = next((t for t in range(n) if rt[t] != ct[t]), None)
    if first is None and len(rt) != len(ct):
        first = n
    steps = (first + 1 if first is not None else n)
    steps = min(steps, rl.shape[0], cl.shape[0])
    d = (cl[:steps] - rl[:steps]).abs().amax(-1)
    margin = None
    if first is not None and first < n:
        margin = float(rl[first, rt[first]] - rl[first, ct[first]])
    return PromptComparison(
        index=index, prompt_tokens=prompt_len, reference_tokens=list(rt), candidate_tokens=list(ct),
        agree_prefix=first if first is not None else n, agree_total=sum(a == b for a, b in zip(rt, ct)),
        first_divergence=first, max_abs_dlogit=d.tolist(), kl=_kl(rl[:steps], cl[:steps]).tolist(),
        bound=bound[:steps].tolist(), reference_margin=margin)


def run_e2e(ck, out: Path, plan, samples: Path, options: E2EOptions, device: torch.device,  # noqa: ANN001
            dtype: torch.dtype) -> E2EResult:
    """The end-to-end comparison (see the module docstring). Never raises for a repack fault: a
    fault is a FAIL; a check that cannot run is 'not run' with the reason."""
    threads = torch.get_num_threads()
    if device.type == "cpu" and (ck.config.hidden_size or 0) <= SMALL_MODEL_HIDDEN:
        # a decode step of a small model is hundreds of tiny ops: intra-op threads cost more in
        # hand-offs than they save, and on a loaded machine they make the run several-fold slower
        torch.set_num_threads(1)
    try:
        return _run_e2e(ck, out, plan, samples, options, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _run_e2e(ck, out: Path, plan, samples: Path, options: E2EOptions, device: torch.device,  # noqa: ANN001
             dtype: torch.dtype) -> E2EResult:
    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.verification.rank_gemm import ROUNDINGS, UNIT_ROUNDOFF, RankFiles

    started = time.monotonic()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return not_run(f"transformers is not installed: {INSTALL_HINT}")
    model_type = ck.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        return not_run(f"model type {model_type!r} is not supported for --e2e (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if plan is None or not plan.jobs:
        return not_run("no repack plan to run the repacked experts with (see the manifest check)")
    jobs = {j.layer.prefix: j for j in plan.jobs}
    missing = [lay.prefix for lay in ck.layers if lay.prefix not in jobs]
    if missing:
        return not_run(f"{missing[0]}: routed experts that were not repacked (unquantized); --e2e needs every MoE block repacked")
    other = next((j for j in plan.jobs if j.layout != "marlin"), None)
    if other is not None:
        return not_run(f"{other.layer.prefix}: layout {other.layout!r}; the MoE GEMM op reads the Marlin layout only")
    if dtype not in UNIT_ROUNDOFF or dtype == torch.float32:
        return not_run(f"model dtype {dtype}: the MoE GEMM runs in bfloat16 or float16 only")
    vocab = int(ck.config.raw.get("vocab_size") or 0)
    eos_cfg = ck.config.raw.get("eos_token_id")
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    try:
        prompts = _build_prompts(ck.root, samples, options.prompts, vocab)
        model, blocks = _build_model(ck, device)
    except BadInput as e:  # no usable prompts, or the checkpoint lacks a weight of the model
        return not_run(e.message)
    result = E2EResult(status="pass", model=type(model).__name__, device=device.type, expert_dtype=str(dtype).removeprefix("torch."),
                       prompt_form=prompts.form, max_new_tokens=options.max_new_tokens)
    noise = math.sqrt(ROUNDINGS) * UNIT_ROUNDOFF[dtype]
    with TensorReader(ck.files) as reader:
        reference = {p: _ExpertsModule(_ReferenceExperts(ck, reader, j, dtype, device), dtype) for p, j in jobs.items()}
    generator = torch.Generator().manual_seed(PROBE_SEED)
    probe = {p: _ExpertsModule(m.compute, dtype, noise, generator) for p, m in reference.items()}
    try:
        candidate = {}
        for p, j in jobs.items():
            tensors = []
            for r in range(len(j.specs)):
                rf = RankFiles(out / f"rank-{r}")
                try:
                    tensors.append({n: rf.reader.read(f"{p}.{n}").to(device) for n in j.tensor_names}
                                   if len(j.expert_ranges[r]) else {})
                finally:
                    rf.reader.close()
            candidate[p] = _ExpertsModule(_CandidateExperts(j, tensors, dtype, device), dtype)
    except (BadInput, KeyError) as e:
        return E2EResult(status="FAIL", reason=f"the repacked tensors cannot be read: {getattr(e, 'message', e)}")
    for i, ids in enumerate(prompts.ids):
        if not ids:
            return not_run(f"{samples}: prompt {i} has no tokens in the model's vocabulary")
        _install(blocks, reference)
        ref = _greedy(model, ids, options.max_new_tokens, eos, device)
        try:
            _install(blocks, candidate)
            cand = _greedy(model, ids, options.max_new_tokens, eos, device)
        except Exception as e:  # malformed tensors make the kernel fail: a finding, not a crash
            msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            result.status, result.reason = "FAIL", f"prompt {i}: the MoE GEMM cannot run on the repacked tensors: {msg}"
            break
        _install(blocks, reference)
        plain = _teacher_forced(model, ids, ref[0], device)
        _install(blocks, probe)
        perturbed = _teacher_forced(model, ids, ref[0], device)
        bound = (perturbed - plain).abs().amax(-1)
        cmp = compare_runs(i, len(ids), ref, cand, bound)
        cmp.reference_text, cmp.candidate_text = prompts.decode(ref[0]), prompts.decode(cand[0])
        cmp.gold_answer = prompts.gold[i]
        if options.score:
            cmp.reference_answer, cmp.candidate_answer = gsm8k_answer(cmp.reference_text), gsm8k_answer(cmp.candidate_text)
        result.prompts.append(cmp)
    if result.status == "pass" and result.first_failure is not None:
        p, t = result.first_failure
        c = result.prompts[p]
        result.status = "FAIL"
        result.reason = (f"prompt {p}, step {t}: max |Δlogit| {c.max_abs_dlogit[t]:.3g} exceeds the rounding bound "
                         f"{c.bound[t]:.3g}" + (f" (tokens diverge at step {c.first_divergence})" if c.first_divergence is not None else ""))
    if options.score and result.prompts:
        scored = [c for c in result.prompts if c.gold_answer is not None]
        result.score = {
            "prompts_with_answers": len(scored),
            "reference_exact_match": sum(c.reference_answer == c.gold_answer for c in scored) / len(scored) if scored else None,
            "candidate_exact_match": sum(c.candidate_answer == c.gold_answer for c in scored) / len(scored) if scored else None,
            "answers_agree": sum(c.reference_answer == c.candidate_answer for c in result.prompts) / len(result.prompts),
        }
    result.seconds = time.monotonic() - started
    return result


def reference_generation(ckpt: str | os.PathLike[str], samples: Path, options: E2EOptions,
                         device: torch.device = torch.device("cpu")) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """The reference run alone at TP 1 (prompt ids, greedy tokens, step logits per prompt): what an
    engine that loads CKPT itself should generate for the same prompt ids."""
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack

    ck = open_checkpoint(ckpt)
    plan = plan_repack(ck.root, RepackSettings(tp=1))
    dtype = dtype_from_name(ck.config.torch_dtype or "bfloat16")
    prompts = _build_prompts(ck.root, samples, options.prompts, int(ck.config.raw.get("vocab_size") or 0))
    eos_cfg = ck.config.raw.get("eos_token_id")
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    model, blocks = _build_model(ck, device)
    with TensorReader(ck.files) as reader:
        _install(blocks, {j.layer.prefix: _ExpertsModule(_ReferenceExperts(ck, reader, j, dtype, device), dtype)
                          for j in plan.jobs})
    runs = [_greedy(model, ids, options.max_new_tokens, eos, device) for ids in prompts.ids]
    return prompts.ids, [r[0] for r in runs], [r[1] for r in runs]


def model_dtype_logit_change(ckpt: str | os.PathLike[str], prompts: list[list[int]], tokens: list[list[int]],
                             device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """Per prompt and step, max |Δlogit| between the TP-1 reference run teacher-forced in fp32 and
    the same run with the non-expert layers in the model dtype: how far an engine that computes
    them in that dtype may legitimately move the logits (one sample of its rounding)."""
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack

    ck = open_checkpoint(ckpt)
    plan = plan_repack(ck.root, RepackSettings(tp=1))
    dtype = dtype_from_name(ck.config.torch_dtype or "bfloat16")
    model, blocks = _build_model(ck, device)
    with TensorReader(ck.files) as reader:
        _install(blocks, {j.layer.prefix: _ExpertsModule(_ReferenceExperts(ck, reader, j, dtype, device), dtype)
                          for j in plan.jobs})
    full = [_teacher_forced(model, p, t, device) for p, t in zip(prompts, tokens)]
    model.to(dtype)
    low = [_teacher_forced(model, p, t, device) for p, t in zip(prompts, tokens)]
    return [(a - b).abs().amax(-1) for a, b in zip(full, low)]
