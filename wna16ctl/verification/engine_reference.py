"""The e2e reference model against an engine's own model of the same architecture.

`verify --e2e` judges repacked experts against a reference model (transformers' model of the
checkpoint's config, non-expert layers in fp32, experts dequantised from the source files in the
model dtype). That reference is only worth something if it is the model an engine runs. This
module gives the pieces of the comparison (the engine tier, tests/verification/test_engine_reference.py):

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
from typing import Any, Protocol, cast

import torch

from wna16ctl.output.manifest import SIDE_FILES

# the chance that a correct engine fails the comparison somewhere (all compared logits together)
FALSE_ALARM = 1e-3
NEAR_TIE_FACTOR = 2.0  # two logits each within the tolerance: their difference moves by twice it


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
    for name in SIDE_FILES:  # config.json is written above, without its quantization
        if name == "config.json":
            continue
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


# ---- the reference's runs --------------------------------------------------------------------------------


@dataclass
class ReferenceRuns:
    """Per prompt: the reference's greedy tokens, and its logits at each generation step
    ([steps, vocab]) teacher-forced on those tokens, in fp32 and with the non-expert layers in the
    model dtype; per MoE layer the routing margin of the token each step is computed from
    ([steps]: `routing_margin`, the fp32 run's and the model-dtype run's scores measured against
    the fp32 run's selection)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]
    model_dtype_logits: list[torch.Tensor]
    model: str = ""
    margins: list[torch.Tensor] = field(default_factory=list)  # per prompt [layers, steps], fp32 run
    model_dtype_margins: list[torch.Tensor] = field(default_factory=list)


class _GroupedRouter(Protocol):
    """DeepSeek-V3's router (the one with an e_score_correction_bias): its settings are plain
    attributes, which torch's Module.__getattr__ would type as tensors or submodules."""

    num_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def routing_margin(gate: torch.nn.Module, logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Per token, how far the router's scores are from choosing other experts than SELECTED ([T, k]):
    the lowest selected score minus the highest unselected one (in the scores the choice is made
    on: the router logits, or DeepSeek-V3's sigmoid + correction bias, where the margin of the
    chosen groups over the others counts too). Negative: the scores choose otherwise."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    experts = logits.shape[1]
    if selected.shape[1] >= experts:
        return torch.full((logits.shape[0],), float("inf"))
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, selected.long(), True)
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:
        scores = logits
        allowed = torch.ones_like(mask)
        group_margin = torch.full((logits.shape[0],), float("inf"))
    else:  # DeepSeek-V3: group-limited choice on sigmoid scores + bias
        scores = logits.sigmoid() + bias.float()
        groups = cast(_GroupedRouter, gate).num_group
        per_group = scores.view(-1, groups, experts // groups)
        group_scores = per_group.topk(min(2, experts // groups), dim=-1).values.sum(-1)
        chosen = mask.view(-1, groups, experts // groups).any(-1)
        if bool(chosen.all()):
            group_margin = torch.full((logits.shape[0],), float("inf"))
        else:
            group_margin = (group_scores.masked_fill(~chosen, float("inf")).amin(-1)
                            - group_scores.masked_fill(chosen, float("-inf")).amax(-1))
        allowed = chosen.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    low = scores.masked_fill(~mask, float("inf")).amin(-1)
    high = scores.masked_fill(mask | ~allowed, float("-inf")).amax(-1)
    return torch.minimum(low - high, group_margin)


def _routing_recorder(blocks: dict[str, torch.nn.Module]):
    """Forward hooks on every MoE block's router that keep (router, logits, selection) per call."""
    records: dict[str, list] = {p: [] for p in blocks}
    handles = []
    for prefix, block in blocks.items():
        def hook(module, args, output, prefix=prefix):
            logits, _, selected = output
            records[prefix].append((module, logits.detach(), selected.detach()))
        handles.append(block.get_submodule("gate").register_forward_hook(hook))
    return records, handles


def reference_runs(ckpt: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int,
                   device: torch.device = torch.device("cpu")) -> ReferenceRuns:
    """The e2e reference model of CKPT (TP 1) on PROMPTS; no end-of-sequence stop, so every prompt
    has MAX_NEW_TOKENS steps."""
    from wna16ctl.verification.e2e import _greedy, _teacher_forced, reference_model

    _, model, blocks, dtype = reference_model(ckpt, device)
    tokens = [_greedy(model, ids, max_new_tokens, set(), device)[0] for ids in prompts]

    def forced_with_routing() -> tuple[list[torch.Tensor], list[list]]:
        logits, routing = [], []
        for ids, toks in zip(prompts, tokens):
            records, handles = _routing_recorder(blocks)
            try:
                logits.append(_teacher_forced(model, ids, toks, device))
            finally:
                for h in handles:
                    h.remove()
            routing.append([records[p][0] for p in blocks])  # one teacher-forced call per prompt
        return logits, routing

    logits, routing = forced_with_routing()
    model.to(dtype)
    low, low_routing = forced_with_routing()
    margins, low_margins = [], []
    for ids, per_layer, low_per_layer in zip(prompts, routing, low_routing):
        steps = slice(len(ids) - 1, None)  # the token each step's logits are computed from
        margins.append(torch.stack([routing_margin(g, x, sel)[steps] for g, x, sel in per_layer]))
        low_margins.append(torch.stack([routing_margin(g, y, sel)[steps]
                                        for (g, _, sel), (_, y, _) in zip(per_layer, low_per_layer)]))
    return ReferenceRuns([list(p) for p in prompts], tokens, logits, low, type(model).__name__, margins, low_margins)


def routing_ties(runs: ReferenceRuns, false_alarm: float = FALSE_ALARM) -> tuple[list[dict[int, list[int]]], float]:
    """Steps whose token the router of some MoE layer assigns at a near-tie: its margin (see
    `routing_margin`) below z·σ, σ the RMS change of the margin in the model-dtype run (per layer,
    over every step of every prompt), z from `gaussian_multiplier` over every (layer, step). A
    correct model-dtype engine may route such a token to the other expert; the step's logits then
    move by that expert's share, far beyond rounding. Returns per prompt {step: [layers]} and z."""
    if not runs.margins:
        return [{} for _ in runs.prompts], 0.0
    both = [(m, lo) for m, lo in zip(runs.margins, runs.model_dtype_margins)]
    count = sum(m.numel() for m, _ in both)
    z = gaussian_multiplier(count, false_alarm)
    finite = [torch.where(torch.isfinite(m), lo - m, torch.zeros_like(m)) for m, lo in both]
    sigma = torch.cat(finite, dim=1).double().pow(2).mean(-1).sqrt()  # per layer
    ties = []
    for m, _ in both:
        near = m.double() < z * sigma.unsqueeze(1)
        ties.append({int(t): [int(i) for i in near[:, t].nonzero().flatten()] for t in range(m.shape[1])
                     if bool(near[:, t].any())})
    return ties, z


def _swapped_routing(gate: torch.nn.Module, logits: torch.Tensor, weights: torch.Tensor,
                     selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token's other routing at a near-tie: its lowest-scoring chosen expert replaced by the
    best unchosen one (within the chosen groups for DeepSeek-V3), with the weights the router
    would give that choice. None where the tie is between expert groups (not recomputed here)."""
    logits = logits.float()
    bias = getattr(gate, "e_score_correction_bias", None)
    scores = logits if bias is None else logits.sigmoid() + bias.float()
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(0, selected.long(), True)
    allowed = torch.ones_like(chosen)
    if bias is not None:
        groups = cast(_GroupedRouter, gate).num_group
        in_group = chosen.view(groups, -1).any(-1)
        allowed = in_group.unsqueeze(-1).expand(groups, scores.numel() // groups).reshape(-1)
    if not bool((allowed & ~chosen).any()):
        return None
    low = int(selected[scores[selected.long()].argmin()])
    best = int(scores.masked_fill(chosen | ~allowed, float("-inf")).argmax())
    new = selected.clone()
    new[new == low] = best
    if bias is None:
        w = logits.softmax(-1)[new.long()]
        if getattr(gate, "norm_topk_prob", True):  # Mixtral always renormalises
            w = w / w.sum()
    else:
        w = logits.sigmoid()[new.long()]
        grouped = cast(_GroupedRouter, gate)
        if grouped.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        w = w * grouped.routed_scaling_factor
    return new, w.to(weights.dtype)


def routing_alternatives(ckpt: str | os.PathLike[str], runs: ReferenceRuns, ties: list[dict[int, list[int]]],
                         device: torch.device = torch.device("cpu")) -> list[dict[int, list[torch.Tensor]]]:
    """Per prompt and routing near-tie step: the fp32 reference's logits of that step ([vocab] each)
    with the step's token routed the other way in each non-empty subset of the tied layers (the
    other correct outcomes of the step). Steps whose tie is between DeepSeek-V3 expert groups get
    no alternative."""
    from itertools import combinations

    from wna16ctl.verification.e2e import _teacher_forced, reference_model

    _, model, blocks, _ = reference_model(ckpt, device)
    gates = [block.gate for block in blocks.values()]
    out: list[dict[int, list[torch.Tensor]]] = []
    for ids, toks, tied in zip(runs.prompts, runs.tokens, ties):
        found: dict[int, list[torch.Tensor]] = {}
        for step, layers in tied.items():
            position = len(ids) - 1 + step
            for n in range(1, len(layers) + 1):
                for subset in combinations(layers, n):
                    missing = []

                    def swap(module, args, output):
                        logits, weights, selected = output
                        other = _swapped_routing(module, logits[position], weights[position], selected[position])
                        if other is None:
                            missing.append(True)
                            return output
                        selected, weights = selected.clone(), weights.clone()
                        selected[position], weights[position] = other
                        return logits, weights, selected

                    handles = [gates[i].register_forward_hook(swap) for i in subset]
                    try:
                        logits = _teacher_forced(model, ids, toks, device)
                    finally:
                        for h in handles:
                            h.remove()
                    if not missing:
                        found.setdefault(step, []).append(logits[step])
        out.append(found)
    return out


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
    max_abs_dlogit: float  # over every judged step (routing near-ties excluded) and vocabulary entry
    worst_ratio: float  # max over judged steps of max |Δlogit| / tolerance
    worst_step: int
    tolerance_at_worst: float
    tokens_equal: bool  # the engine's own greedy tokens equal the reference's
    teacher_forced_divergences: list[dict[str, Any]] = field(default_factory=list)  # argmax ≠ reference token
    greedy_first_divergence: int | None = None
    # at the first greedy divergence: the reference's token and the engine's, the reference's margin
    # between them, the step's tolerance and whether that margin is a near-tie
    greedy_divergence: dict[str, Any] | None = None
    routing_tie_steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step: layers, max |Δlogit|

    @property
    def passed(self) -> bool:
        allowed = {d["step"] for d in self.teacher_forced_divergences}
        return self.worst_ratio <= 1.0 and all(d["near_tie"] or d["routing_tie"]
                                               for d in self.teacher_forced_divergences) and (
            self.tokens_equal or self.greedy_first_divergence in allowed
            or bool(self.greedy_divergence and self.greedy_divergence["near_tie"]))


def judge_engine(runs: ReferenceRuns, engine_logits: list[torch.Tensor], engine_tokens: list[list[int]],
                 tolerances: list[torch.Tensor], ties: list[dict[int, list[int]]] | None = None,
                 alternatives: list[dict[int, list[torch.Tensor]]] | None = None) -> list[PromptAgreement]:
    """Every step's logits within the tolerance; the engine's teacher-forced argmax equal to the
    reference's token except at a near-tie (reference top-2 margin below twice the tolerance); its
    own greedy tokens equal to the reference's, or diverging first where its teacher-forced argmax
    does or where the reference prefers its own token to the engine's by less than twice the
    tolerance (a near-tie of the decode path). At a routing near-tie (TIES, from `routing_ties`) a correct engine may choose the other
    expert: such a step is judged against the closest of the reference's outcomes (its own and the
    ALTERNATIVES of `routing_alternatives`) and passes within the tolerance of one of them; a tie
    step without alternatives is reported, not judged."""
    ties = ties or [{} for _ in runs.logits]
    alternatives = alternatives or [{} for _ in runs.logits]
    out = []
    for i, (ref, got, tol) in enumerate(zip(runs.logits, engine_logits, tolerances)):
        if got.shape != ref.shape:
            raise ValueError(f"prompt {i}: engine logits {tuple(got.shape)}, reference {tuple(ref.shape)}")
        d = (got.double() - ref.double()).abs().amax(-1)
        plain_d = d.clone()
        for t, others in alternatives[i].items():  # the closest correct outcome of a routing near-tie
            d[t] = min([float(d[t])] + [float((got[t].double() - o.double()).abs().max()) for o in others])
        judged = torch.tensor([t not in ties[i] or t in alternatives[i] for t in range(ref.shape[0])])
        ratio = torch.where(judged, d / tol.double(), torch.zeros_like(d))
        worst = int(ratio.argmax())
        agreement = PromptAgreement(index=i, steps=ref.shape[0], max_abs_dlogit=float(torch.where(judged, d, 0).max()),
                                    worst_ratio=float(ratio[worst]), worst_step=worst,
                                    tolerance_at_worst=float(tol[worst]),
                                    tokens_equal=list(engine_tokens[i]) == list(runs.tokens[i]),
                                    routing_tie_steps={t: {"layers": layers, "max_abs_dlogit": float(plain_d[t]),
                                                           "closest_outcome_dlogit": float(d[t]),
                                                           "alternatives": len(alternatives[i].get(t, [])),
                                                           "tolerance": float(tol[t])}
                                                       for t, layers in ties[i].items()})
        choice = got.argmax(-1).tolist()
        for t, (c, r) in enumerate(zip(choice, runs.tokens[i])):
            if c != r:
                top2 = ref[t].topk(2).values
                margin = float(top2[0] - top2[1])
                agreement.teacher_forced_divergences.append(
                    {"step": t, "reference": r, "engine": c, "reference_top2_margin": margin,
                     "reference_margin": float(ref[t, r] - ref[t, c]), "tolerance": float(tol[t]),
                     "near_tie": margin < NEAR_TIE_FACTOR * float(tol[t]), "routing_tie": t in ties[i]})
        if not agreement.tokens_equal:
            t = agreement.greedy_first_divergence = next(
                (t for t, (a, b) in enumerate(zip(engine_tokens[i], runs.tokens[i])) if a != b),
                min(len(engine_tokens[i]), len(runs.tokens[i])))
            if t < min(len(engine_tokens[i]), len(runs.tokens[i])):
                # the greedy run decodes step by step, which an engine may compute otherwise than the
                # teacher-forced prefill (vLLM's MLA: attention in the latent space against the whole-head
                # prefill): its token is judged by the reference's own margin over it, as a near-tie
                r, e = runs.tokens[i][t], engine_tokens[i][t]
                margin = float(ref[t, r] - ref[t, e])
                agreement.greedy_divergence = {"step": t, "reference": r, "engine": e, "reference_margin": margin,
                                               "tolerance": float(tol[t]),
                                               "near_tie": margin < NEAR_TIE_FACTOR * float(tol[t])}
        out.append(agreement)
    return out


def agreement_line(arch: str, results: list[PromptAgreement], z: float) -> str:
    worst = max(results, key=lambda r: r.worst_ratio)
    flips = [(r.index, d["step"], round(d["reference_top2_margin"], 4),
              "near-tie" if d["near_tie"] else "routing near-tie" if d["routing_tie"] else "CLEAR")
             for r in results for d in r.teacher_forced_divergences]
    routed = [(r.index, t, v["layers"], round(v["max_abs_dlogit"], 4), round(v["closest_outcome_dlogit"], 4))
              for r in results for t, v in r.routing_tie_steps.items()]
    greedy = [(r.index, g["step"], round(g["reference_margin"], 4), "near-tie" if g["near_tie"] else "CLEAR")
              for r in results if (g := r.greedy_divergence)]
    unjudged = sum(1 for r in results for v in r.routing_tie_steps.values() if not v["alternatives"])
    steps = sum(r.steps for r in results)
    return (f"{arch}: max |Δlogit| {max(r.max_abs_dlogit for r in results):.4g} over {steps - unjudged}/{steps} "
            f"judged steps; worst step {worst.worst_ratio:.3g} × its tolerance ({worst.tolerance_at_worst:.4g}, "
            f"z = {z:.2f}; prompt {worst.index} step {worst.worst_step}); greedy tokens equal in "
            f"{sum(r.tokens_equal for r in results)}/{len(results)} prompts (first greedy divergences: prompt, step, "
            f"reference margin over the engine's token, kind {greedy}); teacher-forced argmax divergences "
            f"(prompt, step, reference top-2 margin, kind) {flips}; routing near-tie steps (prompt, step, layers, "
            f"max |Δlogit| to the reference, to its closest routing outcome) {routed}" + ("" if all(r.passed for r in results) else "; FAIL"))


# ---- layer by layer --------------------------------------------------------------------------------------


def reference_layer_outputs(ckpt: str | os.PathLike[str], ids: list[int], model_dtype: bool = False,
                            device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """The reference's prefill of IDS, module by module ([tokens, hidden] fp32 each):
    `layers.{i}.attention` (attention output), `layers.{i}.moe` (the MoE or MLP block's output),
    `layers.{i}.stream` (the residual stream after the layer), `layers.{i}.router` (the router
    logits) and `norm` (the final norm's output).
    With MODEL_DTYPE the non-expert layers run in the model dtype (one sample of its rounding)."""
    from wna16ctl.verification.e2e import reference_model

    _, model, _, dtype = reference_model(ckpt, device)
    if model_dtype:
        model.to(dtype)
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out.detach().float().reshape(-1, out.shape[-1]).cpu()
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [layer.self_attn.register_forward_hook(keep(f"layers.{i}.attention")),
                    layer.mlp.register_forward_hook(keep(f"layers.{i}.moe")),
                    layer.register_forward_hook(keep(f"layers.{i}.stream"))]
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(keep(f"layers.{i}.router")))
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
        m = re.search(r"layers\.(\d+)(?:\.(\w+(?:\.gate)?))?$", name)
        if m is None:
            if name.endswith("norm"):
                out["norm"] = saved["output"]
            continue
        i, part = m.group(1), m.group(2)
        if part is None:
            out[f"layers.{i}.stream"] = saved["output"] + saved.get("residual", 0)
        elif part.endswith(".gate"):
            out[f"layers.{i}.router"] = saved["output"]
        elif part == "self_attn":
            out[f"layers.{i}.attention"] = saved["output"]
        else:  # mlp / block_sparse_moe
            out[f"layers.{i}.moe"] = saved["output"]
    return {k: v.reshape(-1, v.shape[-1]) for k, v in out.items()}
