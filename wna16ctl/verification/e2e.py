"""`verify --e2e`: the model itself answers GSM8K prompts with the source checkpoint's experts and
with the repacked ones, and every MoE block output of the repacked run is judged.

The model is built by transformers from the checkpoint's own config, with every non-expert weight
read from the checkpoint. Only the routed experts' module of each MoE block is replaced (the
router, attention, norms, shared experts and residual stream stay transformers'):

* reference — experts dequantised from the SOURCE checkpoint files ((q − z)·s in the model dtype,
  one rounding), sliced per rank the way the all-reduce sums them, fp32 accumulation;
* candidate — each rank's REPACKED tensors as written, through the MoE GEMM kernel: on a GPU the
  CUDA kernels, on the CPU the same kernel sources (`moe_gemm_v3.cu`, `moe_gemm_v2.cu` and
  `moe_gemm.cu` where the faster one declines) executed by the CPU emulation (`wna16ctl.native.emulated`) -- never the layout's own
  inverse functions; EP ranks compute their local experts; rank outputs summed as the all-reduce.

Criterion (docs/verify.md, "e2e"), all deterministic:

1. every MoE block output the candidate produces, at every step of every prompt (teacher-forced
   on the reference's tokens: one batched call per block), lies element by element in the
   interval every correct implementation lands in (`verification.bounds`: same inputs and
   weights, only fp32 accumulation order free); where that interval is one value, it must be
   equal. Experts no prompt routes to run on a forced-routing pass with the kept block inputs;
2. the candidate's greedy tokens equal the reference's, unless at the first divergence the
   reference's own top-2 margin is below twice the logit bound (a near-tie, reported with its
   figures): the largest logit change found when every MoE block output is moved to the low or
   to the high end of its interval.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn.functional as F

from wna16ctl.verification.activations import read_records
from wna16ctl.verification.block_check import BlockChecker, LayerCheck
from wna16ctl.errors import BadInput
from wna16ctl.layout.spec import MARLIN
from wna16ctl.sources.architectures import model_types

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from wna16ctl.sources import Checkpoint

    from wna16ctl.verification.rank_gemm import EmulatedGemm

SUPPORTED_MODEL_TYPES = model_types(e2e=True)  # the families whose forward `_run_e2e` has in torch
FEW_SHOT = 2  # worked GSM8K examples before the question when the checkpoint has no chat template
SMALL_MODEL_HIDDEN = 2048  # up to this width the CPU run uses one intra-op thread
INSTALL_HINT = "pip install 'wna16ctl[e2e]'"
TRANSFORMERS_RANGE = ">=4.57,<6"
NEAR_TIE_FACTOR = 2.0  # a margin moves by at most twice the largest logit change


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
    bound: list[float]  # the logit bound per compared step (interval ends through the model)
    reference_margin: float | None = None  # reference logit of its token minus that of the candidate's, at the divergence
    reference_top2_margin: float | None = None  # the reference's top-1 minus top-2 logit at the divergence
    near_tie: bool = False  # the divergence is at a near-tie (top-2 margin < 2 × bound)
    reference_text: str = ""
    candidate_text: str = ""
    reference_answer: str | None = None
    candidate_answer: str | None = None
    gold_answer: str | None = None

    @property
    def passed(self) -> bool:
        return self.first_divergence is None or self.near_tie

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "prompt_tokens": self.prompt_tokens, "passed": self.passed,
            "generated": len(self.reference_tokens), "agree_prefix": self.agree_prefix, "agree_total": self.agree_total,
            "first_divergence": self.first_divergence, "near_tie": self.near_tie,
            "reference_margin": self.reference_margin, "reference_top2_margin": self.reference_top2_margin,
            "max_abs_dlogit": max(self.max_abs_dlogit, default=0.0), "max_kl": max(self.kl, default=0.0),
            "min_bound": min(self.bound, default=0.0),
            "steps": [{"max_abs_dlogit": d, "kl": k, "bound": b} for d, k, b in zip(self.max_abs_dlogit, self.kl, self.bound)],
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
    kernel: str = ""  # what computed the candidate's experts
    kernel_seconds: float = 0.0
    expert_dtype: str = ""
    prompt_form: str = ""
    max_new_tokens: int = 0
    seconds: float = 0.0
    prompts: list[PromptComparison] = field(default_factory=list)
    layers: list[Any] = field(default_factory=list)  # block_check.LayerCheck per MoE layer
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
    def block_violations(self) -> int:
        return sum(lay.violations for lay in self.layers)

    @property
    def max_error_over_bound(self) -> float | None:
        return max((lay.max_ratio for lay in self.layers), default=None)

    @property
    def experts_exercised(self) -> dict[str, Any]:
        return {"exercised": sum(lay.exercised for lay in self.layers),
                "experts": sum(lay.num_experts for lay in self.layers),
                "routed": sum(len(lay.routed) for lay in self.layers),
                "forced": sum(len(lay.forced) for lay in self.layers),
                "per_layer": {lay.layer: {"routed": sorted(lay.routed), "forced": lay.forced, "of": lay.num_experts}
                              for lay in self.layers}}

    def to_json(self) -> dict[str, Any]:
        gen = self.tokens_generated
        return {
            "status": self.status, "passed": self.passed, "reason": self.reason, "model": self.model,
            "device": self.device, "kernel": self.kernel, "kernel_seconds": round(self.kernel_seconds, 2),
            "expert_dtype": self.expert_dtype, "prompt_form": self.prompt_form,
            "max_new_tokens": self.max_new_tokens, "seconds": round(self.seconds, 2),
            "tokens_generated": gen, "tokens_agreeing": self.tokens_agreeing,
            "agreement": (self.tokens_agreeing / gen) if gen else None,
            "block_violations": self.block_violations, "max_error_over_bound": self.max_error_over_bound,
            "experts_exercised": self.experts_exercised if self.layers else None,
            "layers": [lay.to_json() for lay in self.layers],
            "prompts": [p.to_json() for p in self.prompts],
            "score": self.score,
        }


def not_run(reason: str) -> E2EResult:
    return E2EResult(status="not run", reason=reason)


def require_transformers() -> None:
    """The one optional dependency of --e2e; a one-line error with the install command without it."""
    try:
        import transformers  # noqa: F401 - only whether transformers can be imported
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


def _eos_ids(config: Mapping[str, Any]) -> set[int]:
    """config.json's end-of-sequence token ids (`eos_token_id`: one id, a list, or absent)."""
    ids = config.get("eos_token_id")
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


def _build_prompts(ck_root: Path, samples: Path, n: int, vocab: int) -> _Prompts:
    if not samples.is_file():
        what = "is a directory" if samples.is_dir() else "no such file"
        raise BadInput(f"{samples}: {what}; --e2e needs a file of GSM8K records (JSON lines with 'question'/'answer')")
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
        form = (f"few-shot ({len(shots)} worked example{'s' if len(shots) != 1 else ''})" if shots
                else "zero-shot (no train.jsonl beside the samples for worked examples)")
        if tokenizer is not None:
            ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        else:
            ids = [[b % vocab for b in t.encode("utf-8")] for t in texts]
            form += ", byte tokens"
    return _Prompts([[i for i in p if i < vocab] for p in ids], gold, form,
                    _tokenizer_text(tokenizer) if tokenizer is not None else _byte_text)


def _tokenizer_text(tokenizer: PreTrainedTokenizerFast) -> Callable[[list[int]], str]:
    def decode(tokens: list[int]) -> str:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text
    return decode


def _byte_text(tokens: list[int]) -> str:
    """The text of byte tokens (a checkpoint without a tokenizer): ids past 255 have none."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", "replace")


# ---- the model -------------------------------------------------------------------------------------------


def _build_model(ck: Checkpoint, device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
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
    """One source projection [N, K] (the canonical form) in `dtype`: (q − z)·s with one rounding, as
    the kernel dequantises.  A slab of rows at a time (`budget.SLAB_BYTES` of int32 codes): the
    codes and their temporaries stay a constant whatever the projection's size; each element is
    its own, so the slabs give the values the whole projection gives."""
    from wna16ctl.layout.packing import dequantize, unpack_codes
    from wna16ctl.layout.spec import CODES, G_IDX, SCALES, ZERO_POINTS
    from wna16ctl.verification.budget import SLAB_BYTES

    packed = proj[CODES]
    n = packed.shape[0]
    num_bits = 32 // (k // packed.shape[1])  # from the shapes: mixed-precision experts differ per expert
    scale = proj[SCALES]  # [N, G]
    groups = scale.shape[1]
    if G_IDX in proj:
        g = proj[G_IDX].long()
    else:
        g = torch.arange(k) // (k // groups)
    z = unpack_codes(proj[ZERO_POINTS], num_bits, dim=0).to(torch.int32)[:n] if ZERO_POINTS in proj else None
    out = torch.empty(n, k, dtype=dtype)
    rows = max(1, SLAB_BYTES // (4 * k))
    for r in range(0, n, rows):
        s = slice(r, r + rows)
        codes = unpack_codes(packed[s], num_bits, dim=1, size=k).to(torch.int32)  # int32: q − z is exact
        # K-first for the one dequantizer, then back to [N, K]
        out[s] = dequantize(codes.t(), scale[s].t(), g, num_bits, dtype, None if z is None else z[s].t()).t()
    return out


class _ReferenceExperts:
    """A block's experts from the source checkpoint, per rank as the all-reduce sums them."""

    def __init__(self, ck, reader, job, dtype: torch.dtype, device: torch.device):
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


class _EdgeExperts:
    """A block's output moved to one end of its interval (`bounds.block_interval`): the largest
    change a correct kernel may make, in one direction, for the logit bound."""

    def __init__(self, reference: list, dtype: torch.dtype, high: bool):
        self.reference, self.dtype, self.high = reference, dtype, high

    def __call__(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from wna16ctl.verification.bounds import block_interval

        iv = block_interval(self.reference, a.cpu(), ids.cpu(), w.cpu(), self.dtype)
        return (iv.hi if self.high else iv.lo).to(self.dtype).to(a.device)


class _ExpertsModule(torch.nn.Module):
    """Stands in for transformers' experts module: forward(hidden [T, H], top_k_index, top_k_weights).

    The activations enter in the model dtype and the output leaves in it (rounded once more to the
    residual's fp32, exactly)."""

    def __init__(self, compute: Callable, dtype: torch.dtype):
        super().__init__()
        self.compute, self.dtype = compute, dtype

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        y = self.compute(hidden_states.to(self.dtype), top_k_index, top_k_weights).float()
        return y.to(hidden_states.dtype)



def _install(blocks: dict[str, torch.nn.Module], modules: Mapping[str, torch.nn.Module]) -> None:
    for prefix, block in blocks.items():
        block.experts = modules[prefix]


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int, eos: set[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
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
def _teacher_forced(model, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:
    """Logits of every generation step given the tokens before it ([steps, vocab])."""
    seq = prompt + tokens[:-1]
    out = model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    return out.logits[0, len(prompt) - 1:].float().cpu()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp = F.log_softmax(p_logits.double(), -1)
    lq = F.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def compare_runs(index: int, prompt_len: int, ref_tokens: list[int], plain: torch.Tensor, cand: torch.Tensor,
                 bound: torch.Tensor) -> PromptComparison:
    """The candidate's greedy choices against the reference's tokens. `plain` and `cand` are the
    reference's and the candidate's logits teacher-forced on the reference's tokens ([steps, vocab]):
    up to the first divergence both runs have seen the same tokens, so the candidate's greedy run
    is its argmax there. Steps are compared up to and including the first divergence."""
    n = min(len(ref_tokens), plain.shape[0], cand.shape[0])
    choice = cand[:n].argmax(-1).tolist()
    first = next((t for t in range(n) if choice[t] != ref_tokens[t]), None)
    steps = first + 1 if first is not None else n
    d = (cand[:steps] - plain[:steps]).abs().amax(-1)
    cmp = PromptComparison(
        index=index, prompt_tokens=prompt_len, reference_tokens=list(ref_tokens),
        candidate_tokens=list(ref_tokens[:first]) + [choice[first]] if first is not None else list(ref_tokens[:n]),
        agree_prefix=first if first is not None else n, agree_total=first if first is not None else n,
        first_divergence=first, max_abs_dlogit=d.tolist(), kl=_kl(plain[:steps], cand[:steps]).tolist(),
        bound=bound[:steps].tolist())
    if first is not None:
        top2 = plain[first].topk(2).values
        cmp.reference_top2_margin = float(top2[0] - top2[1])
        cmp.reference_margin = float(plain[first, ref_tokens[first]] - plain[first, choice[first]])
        cmp.near_tie = cmp.reference_top2_margin < NEAR_TIE_FACTOR * float(bound[first])
    return cmp


def score_summary(prompts: list[PromptComparison]) -> dict[str, Any]:
    """GSM8K figures that mean what their names say. A tiny random model rarely ends with a number:
    when the reference answers fewer than half of the prompts with one, the score is flagged as not
    meaningful (it measures the model, not the repack)."""
    n = len(prompts)
    gold = [c for c in prompts if c.gold_answer is not None]
    ref_answered = [c for c in prompts if c.reference_answer is not None]
    cand_answered = [c for c in prompts if c.candidate_answer is not None]
    both = [c for c in prompts if c.reference_answer is not None and c.candidate_answer is not None]
    meaningful = 2 * len(ref_answered) >= n and n > 0
    return {
        "meaningful": meaningful,
        "note": "" if meaningful else (f"not meaningful: the reference answers {len(ref_answered)} of {n} prompts "
                                       "with a number"),
        "prompts": n,
        "prompts_with_gold_answer": len(gold),
        "reference_answered": len(ref_answered),
        "candidate_answered": len(cand_answered),
        "both_answered": len(both),
        "reference_exact_match": sum(c.reference_answer == c.gold_answer for c in gold) / len(gold) if gold else None,
        "candidate_exact_match": sum(c.candidate_answer == c.gold_answer for c in gold) / len(gold) if gold else None,
        "answers_agree": sum(c.reference_answer == c.candidate_answer for c in both) / len(both) if both else None,
    }


def run_e2e(ck, out: Path, plan, samples: Path, options: E2EOptions, device: torch.device,
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


def _candidate_gemm(device: torch.device) -> tuple[EmulatedGemm | None, str, str]:
    """(gemm, description, why not) for the candidate: the CUDA kernels on a GPU, the emulated
    kernel sources on the CPU; no gemm (and the reason) when neither can run."""
    if device.type == "cuda":
        return None, "CUDA kernels (moe_gemm_v3.cu, v2 where v3 declines, v1 where v2 declines)", ""
    from wna16ctl.native.emulated import emulated_gemm_lib, emulated_unavailable_reason
    from wna16ctl.verification.rank_gemm import EmulatedGemm

    if emulated_gemm_lib() is None:
        return None, "", emulated_unavailable_reason()
    return EmulatedGemm(), "moe_gemm_v3.cu (v2, then v1 where it declines) on the CPU emulation", ""


def e2e_memory(ck: Checkpoint, dtype: torch.dtype, copies: int = 1) -> tuple[int, int, int]:
    """What `--e2e` holds, in bytes: (total, the routed experts, the rest). The model runs every
    layer at each step, so it holds every MoE layer's experts dequantised in the model dtype
    (`copies` checkpoints of them: two for a padding proof), their packed tensors as read, and the
    model's other weights in fp32; nothing else of its size. The numerics and the exactness
    proof hold a bounded amount (bounds.NUMERICS_MEMORY)."""
    from wna16ctl.dtypes import ST_SIZES

    expert_bytes, prefixes = 0.0, tuple(lay.prefix + "." for lay in ck.layers)
    item = torch.tensor([], dtype=dtype).element_size()
    for lay in ck.layers:
        per = 3 * lay.hidden_size * lay.intermediate_size
        bits = lay.scheme.num_bits if lay.scheme is not None else 8 * item
        expert_bytes += copies * lay.num_experts * per * (item + bits / 8)
    rest = sum(4 * (ck.files.info(n).nbytes // ST_SIZES.get(ck.files.info(n).dtype, 1))
               for n in ck.files.names() if not n.startswith(prefixes))
    return int(expert_bytes + rest), int(expert_bytes), int(rest)


def available_memory() -> int | None:
    """The memory this machine can give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_e2e_memory(ck: Checkpoint, dtype: torch.dtype, copies: int = 1) -> None:
    """Refuse `--e2e` before any work, in one line with the figures, when the machine's available
    memory cannot hold what it holds (`e2e_memory`)."""
    from wna16ctl.errors import UsageError

    need, experts, rest = e2e_memory(ck, dtype, copies)
    have = available_memory()
    if have is not None and need > have:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731 - one figure format, for the line below
        raise UsageError(f"--e2e needs about {gib(need)} ({gib(experts)} for every MoE layer's experts dequantised in "
                         f"{str(dtype).removeprefix('torch.')} with their packed tensors, {gib(rest)} for the other "
                         f"weights in fp32); this machine has {gib(have)} available: verify without --e2e (its "
                         "checks run in bounded memory), or on a machine with more memory")


def _unable(model_type: str | None) -> E2EResult | None:
    """Why e2e cannot run for this model type here (not run, with the reason), else None."""
    try:
        import transformers  # noqa: F401 - only whether transformers can be imported
    except ImportError:
        return not_run(f"transformers is not installed: {INSTALL_HINT}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return not_run(f"model type {model_type!r} is not supported for --e2e (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return None


def _run_e2e(ck, out: Path, plan, samples: Path, options: E2EOptions, device: torch.device,
             dtype: torch.dtype) -> E2EResult:
    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.verification.rank_gemm import UNIT_ROUNDOFF, RankFiles

    started = time.monotonic()
    unable = _unable(ck.config.model_type)
    if unable is not None:
        return unable
    if plan is None or not plan.jobs:
        return not_run("no repack plan to run the repacked experts with (see the manifest check)")
    jobs = {j.layer.prefix: j for j in plan.jobs}
    missing = [lay.prefix for lay in ck.layers if lay.prefix not in jobs]
    if missing:
        return not_run(f"{missing[0]}: routed experts that were not repacked (unquantized); --e2e needs every MoE block repacked")
    other = next((j for j in plan.jobs if j.layout != MARLIN), None)
    if other is not None:
        return not_run(f"{other.layer.prefix}: layout {other.layout!r}; the MoE GEMM kernels read the Marlin layout only")
    if dtype not in UNIT_ROUNDOFF or dtype == torch.float32:
        return not_run(f"model dtype {dtype}: the MoE GEMM runs in bfloat16 or float16 only")
    gemm, kernel, why_not = _candidate_gemm(device)
    if not kernel:
        return not_run(f"the MoE GEMM kernel cannot run here ({why_not}); the layout's own inverses would judge "
                       "themselves, so the check is not run")
    vocab = int(ck.config.raw.get("vocab_size") or 0)
    eos = _eos_ids(ck.config.raw)
    try:
        prompts = _build_prompts(ck.root, samples, options.prompts, vocab)
        model, blocks = _build_model(ck, device)
    except BadInput as e:  # no usable prompts, or the checkpoint lacks a weight of the model
        return not_run(e.message)
    result = E2EResult(status="pass", model=type(model).__name__, device=device.type, kernel=kernel,
                       expert_dtype=str(dtype).removeprefix("torch."), prompt_form=prompts.form,
                       max_new_tokens=options.max_new_tokens)
    with TensorReader(ck.files) as reader:
        ref_compute = {p: _ReferenceExperts(ck, reader, j, dtype, device) for p, j in jobs.items()}
    reference = {p: _ExpertsModule(c, dtype) for p, c in ref_compute.items()}
    low = {p: _ExpertsModule(_EdgeExperts(c.ranks, dtype, high=False), dtype) for p, c in ref_compute.items()}
    high = {p: _ExpertsModule(_EdgeExperts(c.ranks, dtype, high=True), dtype) for p, c in ref_compute.items()}
    checkers: dict[str, BlockChecker] = {}
    try:
        for p, j in jobs.items():
            tensors = []
            for r in range(len(j.specs)):
                rf = RankFiles(out / f"rank-{r}")
                try:
                    tensors.append({n: rf.reader.read(f"{p}.{n}").to(device) for n in j.tensor_names}
                                   if len(j.expert_ranges[r]) else {})
                finally:
                    rf.reader.close()
            check = LayerCheck(p, j.layer.num_experts)
            result.layers.append(check)
            checkers[p] = BlockChecker(j, tensors, ref_compute[p].ranks, dtype, device, gemm, check)
    except (BadInput, KeyError) as e:
        return E2EResult(status="FAIL", reason=f"the repacked tensors cannot be read: {getattr(e, 'message', e)}")
    empty = next((i for i, ids in enumerate(prompts.ids) if not ids), None)
    if empty is not None:
        return not_run(f"{samples}: prompt {empty} has no tokens in the model's vocabulary")
    candidate = {p: _ExpertsModule(c, dtype) for p, c in checkers.items()}
    failure = _compare_prompts(result, prompts, options, eos, device, checkers.values(),
                               reference=_Run(model, blocks, reference), candidate=_Run(model, blocks, candidate),
                               low=_Run(model, blocks, low), high=_Run(model, blocks, high),
                               fault="the MoE GEMM cannot run on the repacked tensors")
    if gemm is not None:
        result.kernel_seconds = gemm.seconds
        launches = ", ".join(f"{k} × {v}" for k, v in sorted(gemm.launches.items()))
        result.kernel += f" ({launches} launches)" if launches else ""
    result.status, result.reason = _verdict(result, failure)
    if options.score and result.prompts:
        result.score = score_summary(result.prompts)
    result.seconds = time.monotonic() - started
    return result


@dataclass
class _Run:
    """A model with one set of experts installed in its MoE blocks (several runs may share a model)."""

    model: Any
    blocks: dict[str, torch.nn.Module]
    experts: Mapping[str, torch.nn.Module]

    def teacher_forced(self, ids: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:
        _install(self.blocks, self.experts)
        return _teacher_forced(self.model, ids, tokens, device)

    def greedy(self, ids: list[int], n: int, eos: set[int], device: torch.device) -> list[int]:
        _install(self.blocks, self.experts)
        return _greedy(self.model, ids, n, eos, device)[0]


def _compare_prompts(result: E2EResult, prompts: _Prompts, options: E2EOptions, eos: set[int], device: torch.device,
                     checkers: Any, *, reference: _Run, candidate: _Run, low: _Run, high: _Run,
                     fault: str) -> str:
    """Criterion 2 of the module doc for every prompt (appended to `result.prompts`), then the
    forced-routing pass of each block checker. Returns the failure ("" for none): an exception of
    the candidate's experts is a finding (`fault` says what could not run), not a crash."""
    for i, ids in enumerate(prompts.ids):
        ref_tokens = reference.greedy(ids, options.max_new_tokens, eos, device)
        plain = reference.teacher_forced(ids, ref_tokens, device)
        for c in checkers:
            c.where = f"prompt {i}"
        try:
            cand = candidate.teacher_forced(ids, ref_tokens, device)
        except Exception as e:  # malformed tensors make the experts fail: a finding, not a crash
            msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            return f"prompt {i}: {fault}: {msg}"
        lo_logits = low.teacher_forced(ids, ref_tokens, device)
        hi_logits = high.teacher_forced(ids, ref_tokens, device)
        bound = torch.maximum((lo_logits - plain).abs().amax(-1), (hi_logits - plain).abs().amax(-1))
        cmp = compare_runs(i, len(ids), ref_tokens, plain, cand, bound)
        if options.score and cmp.first_divergence is not None and cmp.candidate_tokens[-1] not in eos \
                and len(cmp.candidate_tokens) < options.max_new_tokens:
            # the candidate's own continuation after the divergence (its blocks are judged too)
            cmp.candidate_tokens += candidate.greedy(ids + cmp.candidate_tokens,
                                                     options.max_new_tokens - len(cmp.candidate_tokens), eos, device)
            cmp.agree_total = sum(a == b for a, b in zip(cmp.reference_tokens, cmp.candidate_tokens))
        cmp.reference_text, cmp.candidate_text = prompts.decode(ref_tokens), prompts.decode(cmp.candidate_tokens)
        cmp.gold_answer = prompts.gold[i]
        if options.score:
            cmp.reference_answer, cmp.candidate_answer = gsm8k_answer(cmp.reference_text), gsm8k_answer(cmp.candidate_text)
        result.prompts.append(cmp)
    try:
        for c in checkers:
            c.forced_pass()
    except Exception as e:  # as above
        msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
        return f"forced routing: {fault}: {msg}"
    return ""


def _verdict(result: E2EResult, failure: str) -> tuple[str, str]:
    if failure:
        return "FAIL", failure
    bad = next((lay for lay in result.layers if lay.violations), None)
    if bad is not None:
        return "FAIL", (f"{bad.layer}: {bad.violations} of {bad.elements} block output elements outside the rounding "
                        f"interval (first at {bad.first_violation}; max error {bad.max_ratio:.3g} × the bound)")
    unexercised = next((lay for lay in result.layers if lay.exercised < lay.num_experts), None)
    if unexercised is not None:
        return "not run", (f"{unexercised.layer}: {unexercised.num_experts - unexercised.exercised} experts were "
                           "not exercised (no block input to force them with)")
    div = next((c for c in result.prompts if not c.passed), None)
    if div is not None:
        return "FAIL", (f"prompt {div.index}, step {div.first_divergence}: the tokens diverge where the reference's "
                        f"top-2 margin {div.reference_top2_margin:.3g} is not a near-tie (bound "
                        f"{NEAR_TIE_FACTOR:g} × {div.bound[-1]:.3g})")
    ties = [c for c in result.prompts if c.first_divergence is not None]
    if ties:
        return "pass", "; ".join(f"prompt {c.index}, step {c.first_divergence}: near-tie (top-2 margin "
                                 f"{c.reference_top2_margin:.3g} < {NEAR_TIE_FACTOR:g} × {c.bound[-1]:.3g})" for c in ties)
    return "pass", ""


def reference_model(ckpt: str | os.PathLike[str], device: torch.device = torch.device("cpu")):
    """(checkpoint, model, MoE blocks by prefix, expert dtype): the TP-1 reference model of CKPT with
    the reference experts installed in every MoE block, for runs of the reference alone."""
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
    return ck, model, blocks, dtype


def reference_generation(ckpt: str | os.PathLike[str], samples: Path, options: E2EOptions,
                         device: torch.device = torch.device("cpu")) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """The reference run alone at TP 1 (prompt ids, greedy tokens, step logits per prompt): what an
    engine that loads CKPT itself should generate for the same prompt ids."""
    ck, model, _, _ = reference_model(ckpt, device)
    prompts = _build_prompts(ck.root, samples, options.prompts, int(ck.config.raw.get("vocab_size") or 0))
    eos = _eos_ids(ck.config.raw)
    runs = [_greedy(model, ids, options.max_new_tokens, eos, device) for ids in prompts.ids]
    return prompts.ids, [r[0] for r in runs], [r[1] for r in runs]


def model_dtype_logit_change(ckpt: str | os.PathLike[str], prompts: list[list[int]], tokens: list[list[int]],
                             device: torch.device = torch.device("cpu"), tp: int = 1) -> list[torch.Tensor]:
    """Per prompt and step, max |Δlogit| between the TP-1 reference run teacher-forced in fp32 and
    the same run computed as an engine at TP `tp` computes it: the non-expert layers in the model
    dtype and, for `tp` > 1, every row-parallel product (attention output projections, dense and
    shared MLP down projections, the routed experts) as `tp` partial sums over contiguous slices
    of its input, each rounded to the model dtype and then summed in fp32 and rounded (the
    all-reduce). How far such an engine may legitimately move the logits: one sample of its
    rounding, with whatever a router near-tie amplifies it into."""
    ck, model, blocks, dtype = reference_model(ckpt, device)
    full = [_teacher_forced(model, p, t, device) for p, t in zip(prompts, tokens)]
    model.to(dtype)
    if tp > 1:
        _split_row_parallel(ck, model, blocks, dtype, tp, device)
    low = [_teacher_forced(model, p, t, device) for p, t in zip(prompts, tokens)]
    return [(a - b).abs().amax(-1) for a, b in zip(full, low)]


ROW_PARALLEL = ("o_proj", "down_proj")  # the linear layers a TP engine splits along their input


class _RankPartials(torch.nn.Module):
    """A row-parallel linear layer as `tp` ranks compute it: each rank's product over its slice of
    the input (fp32 accumulation, rounded to the model dtype), the partials summed in fp32 and
    rounded once more."""

    def __init__(self, linear: torch.nn.Linear, tp: int):
        super().__init__()
        if linear.in_features % tp:
            raise BadInput(f"a {linear.in_features}-wide row-parallel layer does not split into {tp} ranks")
        self.linear, self.tp = linear, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight.float()
        k = w.shape[1] // self.tp
        parts = [(x[..., r * k:(r + 1) * k].float() @ w[:, r * k:(r + 1) * k].T).to(x.dtype).float()
                 for r in range(self.tp)]
        y = torch.stack(parts).sum(0)
        if self.linear.bias is not None:  # added once, after the all-reduce
            y = y.to(x.dtype).float() + self.linear.bias.float()
        return y.to(x.dtype)


def _split_row_parallel(ck, model, blocks: dict[str, torch.nn.Module], dtype: torch.dtype, tp: int,
                        device: torch.device) -> None:
    """Every row-parallel product of `model` (in the model dtype) computed as `tp` ranks compute it."""
    from wna16ctl.sources.tensors import TensorReader

    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in ROW_PARALLEL:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _RankPartials(module, tp))
    with TensorReader(ck.files) as reader:
        _install(blocks, {lay.prefix: _ExpertsModule(_ReferenceExperts(ck, reader, tp_split(lay, tp), dtype, device), dtype)
                          for lay in ck.quantized_layers if lay.prefix in blocks})


# ---- a `pad` output: the padded model at TP N against the original at TP 1 -------------------------------


def tp_split(layer: Any, tp: int) -> Any:
    """A job of `layer` (what `_ReferenceExperts` reads) split as TP `tp` shards a MoE layer:
    contiguous slices of the intermediate dimension, every rank holding every expert."""
    from types import SimpleNamespace

    i_p = layer.intermediate_size // tp
    return SimpleNamespace(layer=layer, specs=[SimpleNamespace(rank=r, intermediate_per_partition=i_p) for r in range(tp)],
                           expert_ranges=[range(layer.num_experts)] * tp)


def zero_extended_ranks(original: _ReferenceExperts, size: int, tp: int) -> list:
    """The original layer's dequantised experts (one TP-1 rank) with the intermediate dimension
    extended by exact zeros to `size` at its end, then split into `tp` ranks as `tp_split`: what a
    correct padding computes, built from the original alone."""
    (experts, weights), = original.ranks
    i = next(iter(weights.values()))[1].shape[0]
    i_p = size // tp
    ranks = []
    for r in range(tp):
        kept = slice(min(r * i_p, i), min((r + 1) * i_p, i))
        zeros = i_p - (kept.stop - kept.start)
        out = {}
        for e, (w13, w2) in weights.items():
            z13 = w13.new_zeros(w13.shape[0], zeros)
            gate, up = torch.cat([w13[:, :i][:, kept], z13], 1), torch.cat([w13[:, i:][:, kept], z13], 1)
            out[e] = (torch.cat([gate, up], 1).contiguous(),
                      torch.cat([w2[kept], w2.new_zeros(zeros, w2.shape[1])]).contiguous())
        ranks.append((experts, out))
    return ranks


def run_padding_e2e(original, padded, tp: int, samples: Path, options: E2EOptions) -> E2EResult:
    """`verify ORIGINAL PADDED --e2e` (Checkpoints `original`, `padded`, padded for TP `tp`): the
    module doc's two criteria with
    * reference -- the ORIGINAL's experts at TP 1 (greedy tokens, logits);
    * candidate -- the PADDED checkpoint's model (its own config and non-expert weights) with its
      experts read from its files and computed as `tp` TP ranks compute them (fp32 accumulation,
      each rank's partial rounded to the model dtype, the partials summed as the all-reduce);
    * every candidate block output judged against the interval of the original's experts extended
      by exact zeros and split into the same `tp` ranks (`zero_extended_ranks`): the interval any
      correct padding lands in; the logit bound moves every block output to that interval's ends.
    CPU only: the arithmetic of the reference computation, no kernel."""
    threads = torch.get_num_threads()
    if (original.config.hidden_size or 0) <= SMALL_MODEL_HIDDEN:
        torch.set_num_threads(1)  # as in run_e2e: a small model's decode steps are tiny ops
    try:
        return _run_padding_e2e(original, padded, tp, samples, options)
    finally:
        torch.set_num_threads(threads)


def _run_padding_e2e(a, b, tp: int, samples: Path, options: E2EOptions) -> E2EResult:
    from wna16ctl.errors import WnaError
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.verification.rank_gemm import UNIT_ROUNDOFF

    started = time.monotonic()
    unable = _unable(a.config.model_type)
    if unable is not None:
        return unable
    dtype = dtype_from_name(a.config.torch_dtype or "bfloat16")
    if dtype not in UNIT_ROUNDOFF or dtype == torch.float32:
        return not_run(f"model dtype {dtype}: the rounding intervals are for bfloat16 or float16 experts")
    quantized = {lay.prefix for lay in a.quantized_layers}
    plain_experts = [lay.prefix for lay in a.layers if lay.prefix not in quantized]
    if plain_experts:
        return not_run(f"{plain_experts[0]}: routed experts that are not quantized; --e2e compares quantized experts")
    padded_layers = {lay.prefix: lay for lay in b.layers}
    missing = [lay.prefix for lay in a.layers if lay.prefix not in padded_layers]
    if missing:
        return E2EResult(status="FAIL", reason=f"{missing[0]}: the padded checkpoint has no such MoE layer")
    uneven = [p for p, lay in padded_layers.items() if lay.intermediate_size % tp]
    if uneven:
        return E2EResult(status="FAIL", reason=f"{uneven[0]}: intermediate size {padded_layers[uneven[0]].intermediate_size} "
                                               f"does not split into {tp} ranks")
    device = torch.device("cpu")
    vocab = int(a.config.raw.get("vocab_size") or 0)
    eos = _eos_ids(a.config.raw)
    try:
        prompts = _build_prompts(a.root, samples, options.prompts, vocab)
        model_a, blocks_a = _build_model(a, device)
        model_b, blocks_b = _build_model(b, device)
    except BadInput as e:  # no usable prompts, or a checkpoint lacks a weight of the model
        return not_run(e.message)
    empty = next((i for i, ids in enumerate(prompts.ids) if not ids), None)
    if empty is not None:
        return not_run(f"{samples}: prompt {empty} has no tokens in the model's vocabulary")
    result = E2EResult(status="pass", model=type(model_a).__name__, device=device.type,
                       kernel=f"the padded experts as {tp} TP ranks compute them (fp32 accumulation, rank partials "
                              f"in {str(dtype).removeprefix('torch.')} summed as the all-reduce)",
                       expert_dtype=str(dtype).removeprefix("torch."), prompt_form=prompts.form,
                       max_new_tokens=options.max_new_tokens)
    reference, low, high, candidate, checkers = {}, {}, {}, {}, []
    try:
        with TensorReader(a.files) as ra, TensorReader(b.files) as rb:
            for lay in a.layers:
                lay_b = padded_layers[lay.prefix]
                ref = _ReferenceExperts(a, ra, tp_split(lay, 1), dtype, device)
                ranks = zero_extended_ranks(ref, lay_b.intermediate_size, tp)
                pad = _ReferenceExperts(b, rb, tp_split(lay_b, tp), dtype, device)
                check = LayerCheck(lay.prefix, lay.num_experts)
                result.layers.append(check)
                checker = _PaddedBlock(pad, ranks, dtype, device, check)
                checkers.append(checker)
                reference[lay.prefix] = _ExpertsModule(ref, dtype)
                low[lay.prefix] = _ExpertsModule(_EdgeExperts(ranks, dtype, high=False), dtype)
                high[lay.prefix] = _ExpertsModule(_EdgeExperts(ranks, dtype, high=True), dtype)
                candidate[lay.prefix] = _ExpertsModule(checker, dtype)
    except (WnaError, KeyError, RuntimeError, ValueError) as e:
        return E2EResult(status="FAIL", reason=f"the padded experts cannot be read: {getattr(e, 'message', e)}")
    failure = _compare_prompts(result, prompts, options, eos, device, checkers,
                               reference=_Run(model_a, blocks_a, reference), candidate=_Run(model_b, blocks_b, candidate),
                               low=_Run(model_a, blocks_a, low), high=_Run(model_a, blocks_a, high),
                               fault="the padded experts cannot run")
    result.status, result.reason = _verdict(result, failure)
    if options.score and result.prompts:
        result.score = score_summary(result.prompts)
    result.seconds = time.monotonic() - started
    return result


class _PaddedBlock(BlockChecker):
    """A block checker whose candidate is the padded experts' TP-rank computation (no repack job:
    the forced-routing pass and the judging are BlockChecker's)."""

    def __init__(self, compute: _ReferenceExperts, reference: list, dtype: torch.dtype, device: torch.device,
                 check: LayerCheck):
        super().__init__(None, [], reference, dtype, device, None, check)
        self.compute = compute

    def candidate(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.compute(a, ids, w)
