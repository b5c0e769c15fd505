"""The e2e reference model against an engine's own model of the same architecture.

`verify --e2e` judges repacked experts against a reference model (transformers' model of the
checkpoint's config, non-expert layers in fp32, experts dequantised from the source files in the
model dtype). That reference is only worth something if it is the model an engine runs. This
module gives the pieces of the comparison (the engine tier, tests/test_engine_reference.py):

* `write_dequantized_checkpoint` -- the same checkpoint with every routed expert stored as the
  dense model-dtype weight the reference computes with ((q - z)·s, one rounding): an unquantized
  MoE checkpoint that an engine loads with its plain MoE path, so that no WNA16 kernel is involved
  and both sides multiply by bit-identical expert weights;
* `reference_runs` -- the reference's greedy tokens for given prompt ids, its logits teacher-forced
  on them in fp32, and the same run with the non-expert layers cast to the model dtype;
* `logit_tolerance` -- how far a correct model-dtype implementation may move each step's logits
  (derived in docs/verify.md, "The reference against vLLM's own model");
* `judge_engine` -- the engine's teacher-forced logits and greedy tokens against all that.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import torch

# the chance that a correct engine fails the comparison somewhere (all compared logits together)
FALSE_ALARM = 1e-3
NEAR_TIE_FACTOR = 2.0  # two logits each within the tolerance: their difference moves by twice it
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


# ---- the dequantised checkpoint -----------------------------------------------------------------------


def dequantized_expert_weights(ckpt: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """`<experts prefix>.<e>.<projection>.weight` -> [N, K] in the model dtype, exactly the values the
    e2e reference multiplies by (its own dequantisation of the source files)."""
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.verification.e2e import _dequantize_source

    ck = open_checkpoint(ckpt)
    dtype = dtype_from_name(ck.config.torch_dtype or "bfloat16")
    out: dict[str, torch.Tensor] = {}
    with TensorReader(ck.files) as reader:
        for layer in ck.layers:
            k_of = {"gate": layer.hidden_size, "up": layer.hidden_size, "down": layer.intermediate_size}
            for e in range(layer.num_experts):
                for role, proj in reader.read_expert(layer, e).items():
                    out[layer.tensor_name(e, role, "weight")] = _dequantize_source(proj, k_of[role], dtype).contiguous()
    return out


def write_dequantized_checkpoint(ckpt: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write CKPT with its quantized routed experts replaced by their dequantised model-dtype weights.

    Every other tensor is copied as stored; config.json loses its `quantization_config`; the
    tokenizer files are copied. One `model.safetensors` (demo-size checkpoints). The result is the
    unquantized checkpoint of the reference's own weights. `out_dir` must be new or empty."""
    from safetensors.torch import save_file

    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    src = Path(ckpt)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: the dequantised checkpoint needs a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    experts = dequantized_expert_weights(src)
    quantized_modules = {name.removesuffix(".weight") for name in experts}
    ck = open_checkpoint(src)
    tensors: dict[str, torch.Tensor] = {}
    with TensorReader(ck.files) as reader:
        for name in sorted(ck.files.names()):
            module, _, _ = name.rpartition(".")
            if module in quantized_modules:
                continue  # weight_packed, weight_scale, weight_zero_point, weight_shape, weight_g_idx
            tensors[name] = reader.read(name).contiguous()
    tensors |= experts
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in _COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


# ---- the reference's runs --------------------------------------------------------------------------------


@dataclass
class ReferenceRuns:
    """Per prompt: the reference's greedy tokens, and its logits at each generation step
    ([steps, vocab]) teacher-forced on those tokens, in fp32 and with the non-expert layers in the
    model dtype."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]
    model_dtype_logits: list[torch.Tensor]
    model: str = ""


def reference_runs(ckpt: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int,
                   device: torch.device = torch.device("cpu")) -> ReferenceRuns:
    """The e2e reference model of CKPT (TP 1) on PROMPTS; no end-of-sequence stop, so every prompt
    has MAX_NEW_TOKENS steps."""
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.verification.e2e import _build_model, _ExpertsModule, _greedy, _install, _ReferenceExperts, _teacher_forced

    ck = open_checkpoint(ckpt)
    plan = plan_repack(ck.root, RepackSettings(tp=1))
    dtype = dtype_from_name(ck.config.torch_dtype or "bfloat16")
    model, blocks = _build_model(ck, device)
    with TensorReader(ck.files) as reader:
        _install(blocks, {j.layer.prefix: _ExpertsModule(_ReferenceExperts(ck, reader, j, dtype, device), dtype)
                          for j in plan.jobs})
    tokens = [_greedy(model, ids, max_new_tokens, set(), device)[0] for ids in prompts]
    logits = [_teacher_forced(model, ids, toks, device) for ids, toks in zip(prompts, tokens)]
    model.to(dtype)
    low = [_teacher_forced(model, ids, toks, device) for ids, toks in zip(prompts, tokens)]
    return ReferenceRuns([list(p) for p in prompts], tokens, logits, low, type(model).__name__)


# ---- the tolerance ---------------------------------------------------------------------------------------


def gaussian_multiplier(comparisons: int, false_alarm: float = FALSE_ALARM) -> float:
    """z with P(|N(0,1)| > z) = false_alarm / comparisons: by the union bound, a correct engine
    exceeds z·σ at any of COMPARISONS logits with probability at most FALSE_ALARM."""
    if comparisons < 1 or not 0 < false_alarm < 1:
        raise ValueError("need comparisons >= 1 and 0 < false_alarm < 1")
    return NormalDist().inv_cdf(1 - false_alarm / (2 * comparisons))


def logit_tolerance(logits: list[torch.Tensor], model_dtype_logits: list[torch.Tensor],
                    false_alarm: float = FALSE_ALARM) -> tuple[list[torch.Tensor], float]:
    """Per prompt and step, how far a correct model-dtype engine may move a logit of the fp32
    reference, and the multiplier z used.

    Model: an engine's logit error is the sum of many independent roundings (every activation
    stored in the model dtype), ~N(0, σ_t²) at step t for every vocabulary entry. The reference
    run with its non-expert layers cast to the model dtype is one draw of the same process: σ_t is
    its RMS deviation from the fp32 run over the vocabulary at that step. Tolerance z·σ_t with z
    from `gaussian_multiplier` over every compared logit (vocab × steps × prompts)."""
    count = sum(x.numel() for x in logits)
    z = gaussian_multiplier(count, false_alarm)
    sigmas = [(low.double() - ref.double()).pow(2).mean(-1).sqrt() for ref, low in zip(logits, model_dtype_logits)]
    return [(z * s).float() for s in sigmas], z


# ---- the judgement ---------------------------------------------------------------------------------------


@dataclass
class PromptAgreement:
    index: int
    steps: int
    max_abs_dlogit: float  # over every step and vocabulary entry
    worst_ratio: float  # max over steps of max |Δlogit| / tolerance
    worst_step: int
    tolerance_at_worst: float
    tokens_equal: bool  # the engine's own greedy tokens equal the reference's
    teacher_forced_divergences: list[dict[str, Any]] = field(default_factory=list)  # argmax ≠ reference token
    greedy_first_divergence: int | None = None

    @property
    def passed(self) -> bool:
        return self.worst_ratio <= 1.0 and all(d["near_tie"] for d in self.teacher_forced_divergences) and (
            self.tokens_equal or self.greedy_first_divergence in {d["step"] for d in self.teacher_forced_divergences})


def judge_engine(runs: ReferenceRuns, engine_logits: list[torch.Tensor], engine_tokens: list[list[int]],
                 tolerances: list[torch.Tensor]) -> list[PromptAgreement]:
    """Every step's logits within the tolerance; the engine's teacher-forced argmax equal to the
    reference's token except at a near-tie (reference top-2 margin below twice the tolerance); its
    own greedy tokens equal to the reference's, or diverging first where its teacher-forced argmax
    does (that near-tie)."""
    out = []
    for i, (ref, got, tol) in enumerate(zip(runs.logits, engine_logits, tolerances)):
        if got.shape != ref.shape:
            raise ValueError(f"prompt {i}: engine logits {tuple(got.shape)}, reference {tuple(ref.shape)}")
        d = (got.double() - ref.double()).abs().amax(-1)
        ratio = d / tol.double()
        worst = int(ratio.argmax())
        agreement = PromptAgreement(index=i, steps=ref.shape[0], max_abs_dlogit=float(d.max()),
                                    worst_ratio=float(ratio[worst]), worst_step=worst,
                                    tolerance_at_worst=float(tol[worst]),
                                    tokens_equal=list(engine_tokens[i]) == list(runs.tokens[i]))
        choice = got.argmax(-1).tolist()
        for t, (c, r) in enumerate(zip(choice, runs.tokens[i])):
            if c != r:
                top2 = ref[t].topk(2).values
                margin = float(top2[0] - top2[1])
                agreement.teacher_forced_divergences.append(
                    {"step": t, "reference": r, "engine": c, "reference_top2_margin": margin,
                     "reference_margin": float(ref[t, r] - ref[t, c]), "tolerance": float(tol[t]),
                     "near_tie": margin < NEAR_TIE_FACTOR * float(tol[t])})
        if not agreement.tokens_equal:
            agreement.greedy_first_divergence = next(
                (t for t, (a, b) in enumerate(zip(engine_tokens[i], runs.tokens[i])) if a != b),
                min(len(engine_tokens[i]), len(runs.tokens[i])))
        out.append(agreement)
    return out


def agreement_line(arch: str, results: list[PromptAgreement], z: float) -> str:
    worst = max(results, key=lambda r: r.worst_ratio)
    ties = [d | {"prompt": r.index} for r in results for d in r.teacher_forced_divergences]
    return (f"{arch}: max |Δlogit| {max(r.max_abs_dlogit for r in results):.4g}; worst step {worst.worst_ratio:.3g} × "
            f"its tolerance ({worst.tolerance_at_worst:.4g}, z = {z:.2f}; prompt {worst.index} step {worst.worst_step}); "
            f"greedy tokens equal in {sum(r.tokens_equal for r in results)}/{len(results)} prompts; "
            f"teacher-forced argmax divergences {[(d['prompt'], d['step'], round(d['reference_top2_margin'], 4), d['near_tie']) for d in ties]}"
            + ("" if all(r.passed for r in results) else "; FAIL"))



# ---- layer by layer --------------------------------------------------------------------------------------


def reference_layer_outputs(ckpt: str | os.PathLike[str], ids: list[int], model_dtype: bool = False,
                            device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """The reference's prefill of IDS, module by module ([tokens, hidden] fp32 each):
    `layers.{i}.attention` (attention output), `layers.{i}.moe` (the MoE or MLP block's output),
    `layers.{i}.stream` (the residual stream after the layer) and `norm` (the final norm's output).
    With MODEL_DTYPE the non-expert layers run in the model dtype (one sample of its rounding)."""
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.verification.e2e import _build_model, _ExpertsModule, _install, _ReferenceExperts

    ck = open_checkpoint(ckpt)
    plan = plan_repack(ck.root, RepackSettings(tp=1))
    dtype = dtype_from_name(ck.config.torch_dtype or "bfloat16")
    model, blocks = _build_model(ck, device)
    with TensorReader(ck.files) as reader:
        _install(blocks, {j.layer.prefix: _ExpertsModule(_ReferenceExperts(ck, reader, j, dtype, device), dtype)
                          for j in plan.jobs})
    if model_dtype:
        model.to(dtype)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, output):  # noqa: ANN001
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out.detach().float().reshape(-1, out.shape[-1]).cpu()
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [layer.self_attn.register_forward_hook(keep(f"layers.{i}.attention")),
                    layer.mlp.register_forward_hook(keep(f"layers.{i}.moe")),
                    layer.register_forward_hook(keep(f"layers.{i}.stream"))]
    handles.append(model.model.norm.register_forward_hook(keep("norm")))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def engine_layer_outputs(capture_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The same quantities from vLLM's forward hooks (scripts/vllm_greedy.py "capture"): a vLLM
    decoder layer returns (block output, residual stream before the block), so the stream after it is
    their sum; its final norm returns (normed, residual)."""
    import re

    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(capture_dir).glob("*.pt")):
        saved = torch.load(path, weights_only=True)
        name = path.stem
        m = re.search(r"layers\.(\d+)(?:\.(\w+))?$", name)
        if m is None:
            if name.endswith("norm"):
                out["norm"] = saved["output"]
            continue
        i, part = m.group(1), m.group(2)
        if part is None:
            out[f"layers.{i}.stream"] = saved["output"] + saved.get("residual", 0)
        elif part == "self_attn":
            out[f"layers.{i}.attention"] = saved["output"]
        else:  # mlp / block_sparse_moe
            out[f"layers.{i}.moe"] = saved["output"]
    return {k: v.reshape(-1, v.shape[-1]) for k, v in out.items()}
