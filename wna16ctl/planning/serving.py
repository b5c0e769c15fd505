"""Which repack layout serves each TP size `inspect` planned, and how: the next steps it prints.

Which layout a TP size gets, in order:

* the Marlin layout served by the `wna16ctl` load format, where vLLM's own processing would give
  wrong outputs (the w13 scale permutation of vLLM PR #50196) and the plugin serves the release:
  the output carries the corrected permutation, so it is the fix;
* the `vllm` layout (stock vLLM, `--load-format sharded_state`) where the rulebook has the
  release's key contract for the architecture and the checkpoint fits it;
* the Marlin layout with the plugin where every layer runs on Marlin;
* else the checkpoint itself, served as it is (vLLM repacks it at load).

The commands themselves come from `planning.next_steps`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from wna16ctl.planning import rules
from wna16ctl.planning.next_steps import (
    MARLIN_LAYOUT,
    PLUGIN_INSTALL,
    VLLM_LAYOUT,
    W13_SCALE_HAZARD,
    NextStep,
    checkpoint_ref,
    has_w13_scale_hazard,
    output_name,
    plugin_serves,
    repack_command,
    serve_command,
)

CORRECTNESS = "correctness"  # planning.inspection's severity of a hazard that makes outputs wrong
# The highest --gpu-memory-utilization a serve line is given to make a start fit: above it the
# memory left outside vLLM's share (the CUDA context, other processes) is too thin to rely on.
MAX_UTILIZATION = 0.95


@dataclass(frozen=True)
class MemoryOptions:
    """What a serve line needs to fit in the GPU's memory: the words to add (none where the
    settings asked for already fit) and why, in words."""

    words: tuple[str, ...]
    why: str | None  # None: the settings asked for fit as they are


def memory_options(fit: Any) -> MemoryOptions | None:
    """The `--max-model-len` / `--gpu-memory-utilization` under which one TP size's start fits
    (planning.fit.Fit), judged at the high end of the rest-of-a-start estimate so that the line
    works whatever the rest turns out within it: the settings asked for where they fit; else the
    lowest utilization up to MAX_UTILIZATION at which one sequence of the asked length fits; else
    the largest length that fits at the asked utilization (or at MAX_UTILIZATION); else a words-less
    answer saying that nothing fits on that GPU.  None where the fit is not judged."""
    from wna16ctl.planning.fit import DEFAULT_UTILIZATION, REST_ESTIMATE
    from wna16ctl.planning.kvcache import BLOCK_SIZE

    if fit.not_judged:
        return None
    rest = REST_ESTIMATE[1]

    def words(f: Any) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if f.positions is None or f.max_model_len != f.positions:
            out += ("--max-model-len", str(f.max_model_len))
        if f.utilization != DEFAULT_UTILIZATION:
            out += ("--gpu-memory-utilization", f"{f.utilization:g}")
        return out

    need = fit.kv.sequence_bytes(fit.max_model_len)
    if fit.budget(rest) >= need:
        return MemoryOptions(words(fit), None)
    util = math.ceil((fit.weights.loaded_bytes + rest + need) * 100 / fit.gpu_mem) / 100
    if util <= MAX_UTILIZATION:
        return MemoryOptions(words(dataclasses.replace(fit, utilization=util)),
                             f"--gpu-memory-utilization {util:g} holds one {fit.max_model_len}-token sequence")
    for f in (fit, dataclasses.replace(fit, utilization=max(fit.utilization, MAX_UTILIZATION))):
        length = f.largest_len(rest) // BLOCK_SIZE * BLOCK_SIZE
        if length >= BLOCK_SIZE:
            return MemoryOptions(words(dataclasses.replace(f, max_model_len=length)),
                                 f"{fit.max_model_len} tokens do not fit; --max-model-len {length} does")
    return MemoryOptions((), f"nothing fits on this GPU at TP {fit.tp}: the weights and the rest of a start leave no "
                             f"room for the KV cache even at --gpu-memory-utilization {MAX_UTILIZATION:g}")


def _vllm_layout_fits(ck: Any, version: str) -> bool:
    """Whether `repack --layout vllm` takes this checkpoint for this release (its own refusals)."""
    from wna16ctl.errors import WnaError
    from wna16ctl.planning.vllm_state import check_supported

    try:
        check_supported(ck, version)
    except WnaError:
        return False
    return True


def marlin_loads_every_layer(ck: Any, tp: int, ep: bool, version: str, gpu: str, switches: Any) -> bool:
    """Whether every MoE layer loads on Marlin with the backend pinned to it, as the `wna16ctl`
    load format pins it (and as `repack --layout marlin` writes every layer): the one condition,
    beside `plugin_serves`, under which a Marlin output is served, whichever backend vLLM's oracle
    would pick by itself (Humming on sm90 from 0.32)."""
    from dataclasses import replace

    from wna16ctl.planning.moe import plan_layer

    pinned = replace(switches, moe_backend="marlin")
    return all(p.loadable and p.backend is not None and p.backend.value == "marlin"
               for lay in ck.quantized_layers for p in [plan_layer(lay, tp, ep, version, gpu, pinned)])


def inspect_next_steps(insp: Any) -> list[NextStep]:
    """Per requested TP size that loads (wrong outputs included where the plugin is the fix), how
    to serve it.  Nothing for a proposal (there is nothing quantized to repack or serve yet)."""
    if insp.proposal is not None or insp.config_refusal is not None:
        return []
    severity = {h["text"]: h["severity"] for h in insp.hazards()}
    ck = insp.checkpoint
    ckpt, revision = checkpoint_ref(ck)
    version, gpu, sw = insp.engine.version, insp.gpu, insp.switches
    env = list(sw.env)
    act_order = any(lay.scheme is not None and lay.scheme.act_order for lay in ck.quantized_layers)
    fits_vllm = None  # computed once, on first need
    fits = {f.tp: memory_options(f) for f in insp.fits or ()}
    steps: list[NextStep] = []
    for i, tp in enumerate(insp.tps):
        memory = fits.get(tp)
        mem_words = memory.words if memory is not None else ()
        mem_why = f"; memory: {memory.why}" if memory is not None and memory.why else ""
        plans = [p for _, _, p in insp._all_plans() if p.tp == tp]
        if not insp.tp_loads(i):
            continue
        hazards = [h for p in plans for h in p.hazards]
        wrong = [h for h in hazards if severity.get(h) == CORRECTNESS]
        plugin = plugin_serves(version, insp.ep, act_order) and marlin_loads_every_layer(ck, tp, insp.ep, version, gpu, sw)
        if wrong:
            if not (plugin and all(W13_SCALE_HAZARD in h for h in wrong)):
                continue  # outputs would be wrong whichever way it is served: no step to offer
            layout, why = MARLIN_LAYOUT, ("vLLM's own processing gives wrong outputs here (w13 scale permutation, "
                                          "PR #50196); the Marlin output carries the corrected layout")
        else:
            if fits_vllm is None:
                fits_vllm = (not insp.ep and rules.vllm_state_known(version, ck.config.model_type)
                             and _vllm_layout_fits(ck, version))
            if fits_vllm:
                layout, why = VLLM_LAYOUT, "pre-sharded for stock vLLM (each rank reads only its own files)"
            elif plugin:
                layout, why = MARLIN_LAYOUT, "pre-sharded and pre-repacked for vLLM's Marlin MoE kernel"
            else:
                steps.append(NextStep(tp, insp.ep, None, None,
                                      serve_command(ckpt.split("@", 1)[0] if revision else ckpt, None, tp, ep=insp.ep,
                                                    moe_backend=sw.moe_backend, env=env, revision=revision,
                                                    memory=mem_words),
                                      "no pre-sharded layout applies: vLLM loads and repacks the checkpoint itself"
                                      + mem_why))
                continue
        out = output_name(ckpt, layout, tp, hub=ck.source is not None)
        backend = sw.moe_backend if layout == VLLM_LAYOUT else ("marlin" if sw.moe_backend == "marlin" else "auto")
        steps.append(NextStep(
            tp, insp.ep, layout,
            repack_command(ckpt, out, layout, tp, vllm=version, gpu=gpu, moe_backend=backend, env=env),
            serve_command(out, layout, tp, moe_backend=sw.moe_backend, env=env, memory=mem_words), why + mem_why,
            needs=PLUGIN_INSTALL if layout == MARLIN_LAYOUT else None))
    return steps


def plugin_fix(insp: Any, i: int) -> NextStep | None:
    """Where the i-th TP size loads with the #50196 hazard and the plugin serves it: the step that
    fixes it (`repack --layout marlin`, served with `--load-format wna16ctl`)."""
    tp = insp.tps[i]
    return next((s for s in inspect_next_steps(insp) if s.tp == tp and s.layout == MARLIN_LAYOUT
                 and has_w13_scale_hazard([h for _, _, p in insp._all_plans() if p.tp == tp for h in p.hazards])),
                None)
