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
    PLUGIN_RELEASES,
    VLLM_LAYOUT,
    W13_SCALE_HAZARD,
    NextStep,
    checkpoint_ref,
    has_w13_scale_hazard,
    manifest_next_step,
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
    from wna16ctl.planning.fit import DEFAULT_UTILIZATION
    from wna16ctl.planning.kvcache import BLOCK_SIZE

    if fit.not_judged:
        return None
    rest = fit.rest.high

    def words(f: Any) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if f.positions is None or f.max_model_len != f.positions:
            out += ("--max-model-len", str(f.max_model_len))
        if f.utilization != DEFAULT_UTILIZATION:
            out += ("--gpu-memory-utilization", f"{f.utilization:g}")
        if f.batched_tokens_given:  # the rest of a start was judged at this batch size
            out += ("--max-num-batched-tokens", str(f.rest.batched_tokens))
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


def _plugin_reads(ck: Any) -> bool:
    """Whether the `wna16ctl` load format can serve a Marlin output of this checkpoint: it copies the
    experts into the parameters of vLLM's compressed-tensors MoE method (`w13_weight_packed`, ...),
    which vLLM builds only for a compressed-tensors checkpoint (the default format); its GPTQ/AWQ
    methods hold other parameters."""
    from wna16ctl.sources import formats

    return ck.config.quant is None or formats.of(ck.config.quant) is formats.DEFAULT


def _vllm_layout_fits(ck: Any, version: str, tp: int, ep: bool, gpu: str, sw: Any) -> bool:
    """Whether `repack --layout vllm` takes this checkpoint for this release (its own refusals).  A
    GPTQ/AWQ checkpoint's state depends on the MoE method vLLM builds at this TP size (the MoeWNA16
    fallback has no rows): `moe_methods` says which, as it does for repack."""
    from wna16ctl.errors import WnaError
    from wna16ctl.planning.vllm_support import check_supported, moe_methods

    try:
        check_supported(ck, version)
        moe_methods(ck, tp, version, gpu, sw, ep)
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


def _planned_layout(ck: Any, tp: int, ep: bool, version: str, gpu: str, sw: Any,
                    wrong: list[str]) -> tuple[str | None, str] | None:
    """The layout to write for one TP size (None: serve the checkpoint itself) and why; None where
    outputs would be wrong whichever way it is served."""
    act_order = any(lay.scheme is not None and lay.scheme.act_order for lay in ck.quantized_layers)
    plugin = (_plugin_reads(ck) and plugin_serves(version, ep, act_order)
              and marlin_loads_every_layer(ck, tp, ep, version, gpu, sw))
    if wrong:
        if not (plugin and all(W13_SCALE_HAZARD in h for h in wrong)):
            return None
        return MARLIN_LAYOUT, ("vLLM's own processing gives wrong outputs here (w13 scale permutation, "
                               "PR #50196); the Marlin output carries the corrected layout")
    if rules.vllm_state_known(version, ck.config.model_type) and _vllm_layout_fits(ck, version, tp, ep, gpu, sw):
        return VLLM_LAYOUT, "pre-sharded for stock vLLM (each rank reads only its own files)"
    if plugin:
        return MARLIN_LAYOUT, "pre-sharded and pre-repacked for vLLM's Marlin MoE kernel"
    return None, "no pre-sharded layout applies: vLLM loads and repacks the checkpoint itself"


def _written_layout(ck: Any, tp: int, ep: bool, version: str, gpu: str, sw: Any, written: str) -> tuple[str | None, str]:
    """How an output of `written` is served: stock vLLM reads the vllm layout; the plugin reads a
    Marlin output where it serves the plan (as `_planned_layout` decides it); else the checkpoint."""
    if written == VLLM_LAYOUT:
        return VLLM_LAYOUT, "stock vLLM reads each rank's files with its sharded_state loader"
    act_order = any(lay.scheme is not None and lay.scheme.act_order for lay in ck.quantized_layers)
    if written == MARLIN_LAYOUT and _plugin_reads(ck) and plugin_serves(version, ep, act_order) and marlin_loads_every_layer(
            ck, tp, ep, version, gpu, sw):
        return MARLIN_LAYOUT, "the wna16ctl load format serves the Marlin layout in vLLM"
    # the vllm layout is offered only where `repack --layout vllm` takes the checkpoint
    vllm_layout = rules.vllm_state_known(version, ck.config.model_type) and _vllm_layout_fits(ck, version, tp, ep,
                                                                                               gpu, sw)
    return None, (f"no vLLM load format reads this output (the wna16ctl load format serves vLLM "
                  f"{', '.join(PLUGIN_RELEASES)}, TP only, without act-order, every layer on Marlin); serve the "
                  "checkpoint itself" + (" (or repack with --layout vllm for stock vLLM)" if vllm_layout else ""))


def serve_path(ck: Any, tp: int, *, ep: bool, version: str, gpu: str, switches: Any, written: str | None = None,
               out: str | None = None, wrong: list[str] | None = None, memory: MemoryOptions | None = None
               ) -> NextStep | None:
    """The one answer to "how is this served": for the checkpoint `ck` planned at `tp` on `version`
    and `gpu`, the layout and the `vllm serve` line (with the `repack` line that writes it where
    nothing is written yet).  `written`: the layout of the output at `out` that repack wrote or
    verify proved (None: nothing written; inspect and pad).  `wrong`: the correctness hazards of
    the plan.  None where no way of serving gives right outputs."""
    from wna16ctl.planning.engine_env import make_switches

    sw = switches if switches is not None else make_switches()
    ckpt, revision = checkpoint_ref(ck)
    env = list(sw.env)
    mem_words = memory.words if memory is not None else ()
    mem_why = f"; memory: {memory.why}" if memory is not None and memory.why else ""
    if written is None:
        chosen = _planned_layout(ck, tp, ep, version, gpu, sw, wrong or [])
        if chosen is None:
            return None
    else:
        chosen = _written_layout(ck, tp, ep, version, gpu, sw, written)
    layout, why = chosen
    if layout is None:
        return NextStep(tp, ep, None, None,
                        serve_command(ckpt.split("@", 1)[0] if revision else ckpt, None, tp, ep=ep,
                                      moe_backend=sw.moe_backend, env=env, revision=revision, memory=mem_words),
                        why + mem_why)
    repack = None
    if written is None:
        out = output_name(ckpt, layout, tp, hub=ck.source is not None, ep=ep)
        backend = sw.moe_backend if layout == VLLM_LAYOUT else ("marlin" if sw.moe_backend == "marlin" else "auto")
        repack = repack_command(ckpt, out, layout, tp, vllm=version, gpu=gpu, moe_backend=backend, env=env, ep=ep)
    return NextStep(tp, ep, layout, repack,
                    serve_command(str(out), layout, tp, ep=ep, moe_backend=sw.moe_backend, env=env, memory=mem_words),
                    why + mem_why, needs=PLUGIN_INSTALL if layout == MARLIN_LAYOUT else None)


def output_serve_path(manifest: dict[str, Any], out: Any, checkpoint: Any) -> NextStep | None:
    """How the output at `out` (its manifest `manifest`) written from the opened `checkpoint` is
    served: `serve_path` with the plan the manifest records (None for a manifest part: the parts
    are joined first).  Without the checkpoint, the manifest alone answers."""
    from wna16ctl.planning.engine_env import make_switches

    tp = int(manifest["tp"])
    part = manifest.get("part")
    if checkpoint is None or (isinstance(part, dict) and len(part.get("ranks") or ()) != tp):
        return manifest_next_step(manifest, out, None if checkpoint is None else checkpoint.root)
    settings = (manifest.get("identity") or {}).get("settings") or {}
    engine = manifest.get("engine") or {}
    switches = make_switches(dict(engine.get("env") or settings.get("env") or {}),
                             str(engine.get("moe_backend") or settings.get("moe_backend") or "auto"))
    return serve_path(checkpoint, tp, ep=bool(manifest.get("ep")), version=str(engine.get("version", "")),
                      gpu=str(engine.get("gpu") or settings.get("gpu") or rules.DEFAULT_GPU), switches=switches,
                      written=str(manifest.get("layout")), out=str(out))


def inspect_next_steps(insp: Any) -> list[NextStep]:
    """Per requested TP size that loads (wrong outputs included where the plugin is the fix), how
    to serve it (`serve_path`).  Nothing for a proposal (there is nothing quantized to repack or
    serve yet)."""
    if insp.proposal is not None or insp.config_refusal is not None:
        return []
    severity = {h["text"]: h["severity"] for h in insp.hazards()}
    fits = {f.tp: memory_options(f) for f in insp.fits or ()}
    steps: list[NextStep] = []
    for i, tp in enumerate(insp.tps):
        if not insp.tp_loads(i):
            continue
        wrong = [h for _, _, p in insp._all_plans() if p.tp == tp for h in p.hazards if severity.get(h) == CORRECTNESS]
        step = serve_path(insp.checkpoint, tp, ep=insp.ep, version=insp.engine.version, gpu=insp.gpu,
                          switches=insp.switches, wrong=wrong, memory=fits.get(tp))
        if step is not None:
            steps.append(step)
    return steps


def plugin_fix(insp: Any, i: int) -> NextStep | None:
    """Where the i-th TP size loads with the #50196 hazard and the plugin serves it: the step that
    fixes it (`repack --layout marlin`, served with `--load-format wna16ctl`)."""
    tp = insp.tps[i]
    return next((s for s in inspect_next_steps(insp) if s.tp == tp and s.layout == MARLIN_LAYOUT
                 and has_w13_scale_hazard([h for _, _, p in insp._all_plans() if p.tp == tp for h in p.hazards])),
                None)
