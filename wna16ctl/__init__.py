"""wna16ctl: inspect, repack and verify WNA16 (int4/int8 weight-only) compressed-tensors MoE checkpoints.

The Python API mirrors the commands, with the same defaults:

    import wna16ctl

    insp = wna16ctl.inspect("/models/ckpt", tp="1,2,4")     # -> Inspection (insp.to_json() = inspect --json)
    result = wna16ctl.repack("/models/ckpt", "/fast/tp2", tp=2)   # -> RepackResult
    report = wna16ctl.verify("/models/ckpt", "/fast/tp2")    # -> VerifyReport (report.passed)
    manifest = wna16ctl.pad("/models/ckpt", "/models/ckpt-tp4", tp=4)   # zero-padded to load at TP 4
    manifest = wna16ctl.convert("/models/gptq", "/models/ct")   # GPTQ/AWQ/AutoRound -> compressed-tensors

Errors are `wna16ctl.errors.WnaError` subclasses carrying the one-line message the CLI prints.
Everything heavy (torch, compressed-tensors) is imported on the first call, so `import wna16ctl`
stays cheap.  See docs/python-api.md.
"""

from __future__ import annotations

import os  # loaded with the interpreter already
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    os.write(2, b"\nerror: interrupted; nothing was done\n")
    os._exit(130)


# The `wna16ctl` program answers a Ctrl-C from its first import on with one line and 130, as it
# does later (wna16ctl.cli.main takes over); a program that merely imports the package keeps
# Python's KeyboardInterrupt.
if (os.path.basename(sys.argv[0] if sys.argv else "") == "wna16ctl"
        and getattr(sys.modules.get("__main__"), "__file__", None) == sys.argv[0]):
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)

from wna16ctl.version import __version__  # noqa: E402 - after the SIGINT handler above, set before anything slow is imported

# `typing` is left unimported at run time: the command line imports this package first, and the
# less it loads before it can answer a Ctrl-C (wna16ctl.cli) the better
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable

    from wna16ctl.planning.inspection import Inspection
    from wna16ctl.padding.proof import PadProof
    from wna16ctl.conversion.proof import ConversionProof
    from wna16ctl.planning.vllm_state import VllmStatePlan
    from wna16ctl.repacking.distributed import Group
    from wna16ctl.repacking.pipeline import RepackPlan, RepackResult
    from wna16ctl.verification.checks import VerifyReport

    PathLike = str | os.PathLike  # a checkpoint or output directory
    TpSizes = int | str | Iterable[int]

__all__ = ["inspect", "repack", "verify", "pad", "convert", "__version__", "Inspection", "RepackPlan", "RepackResult", "VerifyReport"]


def inspect(path: PathLike, tp: TpSizes = "1,2,4,8", ep: bool = False, *, vllm: str = "installed", gpu: str = "sm90",
            revision: str | None = None, env: dict[str, str] | Iterable[str] | None = None,
            moe_backend: str = "auto", scheme: str | None = None, recipe: PathLike | None = None,
            group_size: int | None = None, actorder: str | None = None, ignore: Iterable[str] | None = None,
            suggest: bool = False, gpu_mem: int | str | None = None, gpu_memory_utilization: float = 0.9,
            max_model_len: int | None = None, max_num_seqs: int = 256, kv_cache_dtype: str = "auto",
            max_num_batched_tokens: int | None = None) -> Inspection:
    """Plan every MoE layer of the checkpoint at `path` for each TP size (headers only, no GPU).

    `path`: a checkpoint directory or a Hub repo id `ORG/NAME[@REVISION]` (`revision` says the same).
    `tp`: one size, a comma-separated string (`"1,2,4"`) or a sequence; duplicates are dropped.
    `ep`: expert parallelism (MoE TP 1, experts split across the ranks).
    `vllm`: the release whose rules apply (`"0.33.0"`, `"latest"`, `"installed"` = the vllm package
    here, else the newest known; `"all"` plans every known release into `.versions`).
    `gpu`: the GPU architecture (`"sm80"`, `"sm90"`, ...): backend priority depends on it.
    `env`: the engine's environment (`{"VLLM_USE_FLASHINFER_MOE_INT4": "1"}` or `["NAME=VALUE"]`);
    `moe_backend`: the engine's `--moe-backend` (`"auto"`, `"marlin"`, `"triton"`, ...).
    `scheme` (`"W4A16"`, `"W4A16_ASYM"`, `"W8A16"`) or `recipe` (an llm-compressor recipe file): `path`
    is an unquantized model, planned as the checkpoint that quantization would write; `group_size`
    (-1 = channel-wise), `actorder` (`"none"`, `"weight"`, `"static"`, `"group"`) and `ignore` (the
    whole ignore list, `scheme` only) as the CLI options of the same names.
    `suggest`: fill `.suggestions` with the nearest changes that load, for each TP size that does not.
    `gpu_mem` (bytes or "80GiB"; or a `gpu` name that carries its memory, e.g. `"a100-40"`): fill
    `.fits` with each loading TP size's weights and KV cache against that memory
    (`gpu_memory_utilization`, `max_model_len` (the config's positions), `max_num_seqs`,
    `kv_cache_dtype`, `max_num_batched_tokens` (vllm serve's default for that GPU) as vLLM's
    options of the same names).
    Returns the `Inspection` whose `to_json()` is `wna16ctl inspect --json` (docs/inspect-json.md);
    `.ok` is the exit-0 condition (every TP size loads, no correctness hazard).  Raises
    `BadInput`/`UsageError` on unusable input.
    """
    from wna16ctl.planning.inspection import inspect_checkpoint
    from wna16ctl.planning.tpsizes import parse_tp_list
    from wna16ctl.sources.recipe import make_proposal

    proposal = make_proposal(scheme, None if recipe is None else os.fspath(recipe), group_size, actorder,
                             None if ignore is None else list(ignore))
    insp = inspect_checkpoint(path, parse_tp_list(tp), ep, vllm=vllm, gpu=gpu, revision=revision, env=_env_list(env),
                              moe_backend=moe_backend, proposal=proposal)
    if gpu_mem is not None:
        from wna16ctl.planning.fit import GPU_MEMORY, fit_settings, fits, gpu_memory
        from wna16ctl.sink import parse_size

        name = gpu_mem.lower() if isinstance(gpu_mem, str) and gpu_mem.lower() in GPU_MEMORY else None
        insp.fit_settings = fit_settings(insp, gpu_memory(name) if name else parse_size(gpu_mem),
                                         gpu_memory_utilization, max_model_len, max_num_seqs, kv_cache_dtype,
                                         gpu_name=name, max_num_batched_tokens=max_num_batched_tokens)
        insp.fits = fits(insp, insp.fit_settings)
    if suggest:
        from wna16ctl.planning.suggest import suggest as find_suggestions

        insp.suggestions = find_suggestions(insp)
    return insp


def repack(path: PathLike, out: PathLike | None, tp: int | str, *, ep: bool = False, layout: str = "auto",
           max_shard_size: int | str = "4GiB", dry_run: bool = False, resume: bool = False, force: bool = False,
           device: str = "auto", vllm: str = "installed", gpu: str = "sm90",
           env: dict[str, str] | Iterable[str] | None = None, moe_backend: str = "auto",
           progress: Callable[..., Callable[[int], None]] | None = None,
           notice: Callable[[str], None] | None = None, ranks: list[int] | str | None = None,
           node_local: bool = False, revision: str | None = None, warn: Callable[[str], None] | None = None,
           group: Group | None = None, gpu_mem: int | str | None = None, gpu_memory_utilization: float = 0.9,
           max_model_len: int | None = None, max_num_seqs: int = 256, kv_cache_dtype: str = "auto",
           max_num_batched_tokens: int | None = None) -> RepackResult | RepackPlan | VllmStatePlan:
    """Write the checkpoint's experts per rank in the kernel layout into `out`, with a manifest.

    Same options and defaults as `wna16ctl repack` (`layout` auto|marlin|transposed|vllm, `device`
    auto|cpu|cuda, `max_shard_size` bytes or "4GiB").  With `dry_run` nothing is written and the
    plan is returned (`to_json()` = `repack --dry-run --json`): a `RepackPlan`, or for
    `layout="vllm"` a `VllmStatePlan`; otherwise the `RepackResult` (`to_json()` = `repack --json`,
    docs/repack-json.md), whatever the layout.  `vllm` and `gpu` as for
    `inspect` (not `"all"`), and so are `env` and `moe_backend`: the plan follows that release and the manifest records it.  `progress` and `notice`
    receive what the CLI shows on stderr (see `wna16ctl.sink.Sink.tasks`), `warn` the warnings about
    the input (the release chosen, the checkpoint's oddities).  A layer that cannot
    be produced raises `NotLoadable` before anything is written.  `ranks` (e.g. [0, 3] or "0,3") writes
    only those TP ranks: `out` is then a part with a manifest part (`wna16ctl.repacking.parts`);
    `node_local` as `--node-local` under torchrun, where `group` (`wna16ctl.repacking.distributed.Group`)
    is this process's place in the launch.  `revision`: the branch, tag or commit of a Hub
    repo id `path` (downloaded into the Hugging Face cache first).  Every result's
    `next_steps` holds the serve command of what was written.  A dry run's plan carries in `.memory`
    the per-rank memory of the deployment it writes (`repack --dry-run --json`'s `memory`), judged
    against `gpu_mem` (bytes, "80GiB" or a GPU name such as "h100") and vLLM's options as for
    `inspect`; without `gpu_mem`, what one rank holds.
    """
    from wna16ctl.errors import NotLoadable, UsageError
    from wna16ctl.layout.spec import VLLM
    from wna16ctl.planning.inspection import resolve, resolve_switches
    from wna16ctl.sink import parse_size
    from wna16ctl.repacking import distributed
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
    from wna16ctl.planning.tpsizes import parse_tp_list

    group = group or distributed.SOLO
    warn = warn or (lambda message: None)
    fit = {"gpu_mem": gpu_mem, "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
           "max_num_seqs": max_num_seqs, "kv_cache_dtype": kv_cache_dtype,
           "max_num_batched_tokens": max_num_batched_tokens}

    def check_options() -> tuple[int, Any, Any, list[int] | None]:
        (n_ranks,) = parse_tp_list(tp, single=True)
        if force and resume:
            raise UsageError("force and resume exclude each other")
        if vllm == "all":
            raise UsageError("repack plans for one vLLM release: pass a version, 'installed' or 'latest'")
        if layout == VLLM:
            from wna16ctl.repacking.vllm_state import check_options as check_vllm_options

            check_vllm_options(ranks=ranks, resume=resume, node_local=node_local,
                               processes=group.launch.world_size)
        subset = distributed.parse_ranks(ranks, n_ranks) if isinstance(ranks, str) else ranks
        return n_ranks, resolve(vllm, gpu), resolve_switches(_env_list(env), moe_backend), subset

    # every process of a launch meets the same answer: said once per node
    n_ranks, engine, switches, subset = group.together("checking the options", check_options)
    if engine.note and engine.source != "default":
        warn(engine.note)
    source = group.together("opening the checkpoint", lambda: _local(path, revision))
    if not dry_run and out is None:
        raise UsageError("an output directory is required (or pass dry_run=True)")
    if layout == VLLM:  # the whole model per rank for vLLM's sharded_state loader
        from wna16ctl.planning.vllm_state import plan_vllm_state
        from wna16ctl.repacking.vllm_state import write_vllm_state

        vplan = plan_vllm_state(source, n_ranks, engine.version, max_shard_bytes=parse_size(max_shard_size),
                                gpu=gpu, switches=switches, ep=ep)
        vplan.out = None if out is None else os.fspath(out)
        if dry_run or out is None:
            vplan.memory = _plan_memory(vplan, fit)
            return vplan
        return write_vllm_state(vplan, out, force=force, progress=progress)
    settings = RepackSettings(tp=n_ranks, ep=ep, layout=layout, max_shard_bytes=parse_size(max_shard_size),
                              vllm=engine.version, gpu=gpu, env=switches.env, moe_backend=switches.moe_backend)
    try:
        # every process validates the whole plan before any of them writes a byte
        plan = group.together("planning", lambda: plan_repack(source, settings))
    except NotLoadable as e:
        e.settings = settings.to_json()  # what was asked, for a dry run's answer "no"
        raise
    for w in plan.checkpoint.warnings:
        warn(w)
    if dry_run or out is None:
        plan.memory = _plan_memory(plan, fit)
        return plan
    result = run_repack(plan, out, force=force, resume=resume, progress=progress, device=device, notice=notice,
                        ranks=subset, node_local=node_local, group=group)
    result.plan = plan
    return result


def _plan_memory(plan: Any, fit: dict[str, Any]) -> dict[str, Any]:
    """The per-rank memory of what `repack --dry-run` would write: a RepackPlan's own MoE plans (the
    vllm layout's plan is planned again) with the linear layers planned at its TP size."""
    from wna16ctl.planning.deployment import planned_memory
    from wna16ctl.planning.engine_env import make_switches
    from wna16ctl.planning.vllm_state import VllmStatePlan
    from wna16ctl.sink import parse_size

    mem = fit.get("gpu_mem")
    if isinstance(mem, str) and mem.lower() not in _gpu_names():
        fit = {**fit, "gpu_mem": parse_size(mem)}
    if isinstance(plan, VllmStatePlan):
        return planned_memory(plan.checkpoint, plan.tp, plan.ep, plan.vllm, plan.gpu, plan.switches or make_switches(),
                              **fit)
    s = plan.settings
    return planned_memory(plan.checkpoint, s.tp, s.ep, s.vllm, s.gpu, make_switches(dict(s.env), s.moe_backend),
                          {j.layer.prefix: j.plan for j in plan.jobs}, **fit)


def _gpu_names() -> Any:
    from wna16ctl.planning.fit import GPU_MEMORY

    return GPU_MEMORY


def verify(path: PathLike, out: PathLike, *, samples: PathLike | None = None, num_samples: int = 64, device: str = "auto",
           e2e: bool = False, prompts: int = 8, max_new_tokens: int = 32, score: bool = False,
           layers: str | Iterable[int] | None = None, experts: str | Iterable[int] | None = None, revision: str | None = None, progress: Callable[..., Callable[[int], None]] | None = None,
           notice: Callable[[str], None] | None = None, numerics: bool = True, ranks: str | Iterable[int] | None = None,
           group: Any = None) -> VerifyReport | PadProof | ConversionProof:
    """Prove that `out` (a repack output, a `pad` output or a `convert` output) equals the checkpoint at `path`.

    `samples`: a .jsonl or .parquet file with a 'question' field; when None, the first source of
    `wna16ctl.verification.samples.SAMPLE_SEARCH_ORDER` that exists (docs/verify.md).  `notice`
    receives the one line given when a demo checkpoint's own questions stand in for GSM8K.
    `e2e` adds greedy generation with `prompts`, `max_new_tokens` and `score` as `verify --e2e`
    (needs wna16ctl[e2e]; not for a `layout="vllm"` output; for a `pad` output the padded model
    computed as its TP ranks compute it against the original at TP 1, in `PadProof.e2e`).  `layers` ("0-3,7" or indices) checks
    only those MoE layers' experts: a partial verify (`.partial`, the verdict says so, no
    `next_steps`).  `experts` (the same form) checks only those experts of each layer checked, alone or
    with `layers`: a partial verify too.  Both apply to a `pad` output as well (`PadProof.partial`).  `revision` as for `repack`.
    `numerics=False` (`verify --no-numerics`) runs the exactness proof alone: the numerics are not
    run, said so, and no samples are read.
    `ranks` ("0,2" or indices) checks only those TP ranks' files of a repack output: a partial
    verify unless they are all (`.ranks_checked`, `.ranks_not_checked`).  `group` (a
    `wna16ctl.repacking.distributed.Group`, from `init_group()` under torchrun): this process
    checks its share of the ranks, rank r by process r mod the number of processes, and every
    process returns the whole run's report.
    Returns the `VerifyReport` (`to_json()` = `verify --json`, docs/verify-json.md), whatever the
    layout: for a `layout="vllm"` output its manifest check is the files against vLLM's contract,
    its round trip every tensor, its numerics not run (`.layout_state` holds the contract figures).
    `.passed` is true only when every required check ran and passed.  Raises
    `BadInput` on unusable input.
    """
    from wna16ctl.errors import UsageError
    from wna16ctl.padding.proof import is_padded_output, verify_padding
    from wna16ctl.verification.checks import parse_indices, verify_output

    if not e2e and (prompts, max_new_tokens, score) != (8, 32, False):
        raise UsageError("prompts, max_new_tokens and score only apply with e2e=True")
    path = _local(path, revision)
    options = None
    if e2e:  # transformers is required once the checkpoint and the output are known good
        from wna16ctl.verification.e2e import E2EOptions

        options = E2EOptions(prompts=prompts, max_new_tokens=max_new_tokens, score=score)
    from wna16ctl.conversion.proof import is_converted_output, verify_conversion
    from wna16ctl.repacking.distributed import SOLO

    group = group or SOLO
    if (ranks is not None or group.world_size > 1) and (is_converted_output(out) or is_padded_output(out)):
        what = "a convert output" if is_converted_output(out) else "a pad output"
        how = "--ranks" if ranks is not None else "torchrun"
        raise UsageError(f"{how}: {out} is {what}, a checkpoint verified tensor by tensor, not per rank; "
                         f"verify it in one process without --ranks")
    if is_converted_output(out):  # a `convert` output: its ConversionProof (`.passed`, `.problems`, `.to_json()`)
        if e2e or layers is not None or experts is not None:
            raise UsageError("a convert output is verified whole: e2e, layers and experts do not apply")
        return verify_conversion(path, out)
    if is_padded_output(out):  # a `pad` output: its PadProof (`.passed`, `.partial`, `.problems`, `.to_json()`)
        if options is not None and not numerics:
            raise UsageError("--e2e and --no-numerics: e2e runs the model on samples; drop one of them")
        return verify_padding(path, out, numerics=numerics, samples=samples, num_samples=num_samples, e2e=options,
                              notice=notice, layers=layers, experts=experts)
    wanted_ranks = None if ranks is None else parse_indices(ranks, "--ranks", "TP rank")
    return verify_output(path, out, samples=samples, num_samples=num_samples, device=device, progress=progress,
                         e2e=options, notice=notice, layers=layers, experts=experts, numerics=numerics,
                         ranks=wanted_ranks, group=group)


def _env_list(env: dict[str, str] | Iterable[str] | None) -> dict[str, str] | list[str] | None:
    """The engine environment as the planner takes it: a mapping, or `NAME=VALUE` items in a list."""
    return env if env is None or isinstance(env, dict) else list(env)


def _local(path: PathLike, revision: str | None) -> str:
    """A Hub repo id (`ORG/NAME[@REV]`, or with `revision`) as its downloaded snapshot; a directory as itself."""
    from wna16ctl.sources.hub import parse_ref, resolve_local

    if revision is None and os.path.exists(path):
        return os.fspath(path)
    if parse_ref(os.fspath(path), revision) is None:
        return os.fspath(path)
    return resolve_local(os.fspath(path), revision, quiet=True)[0]


def pad(path: PathLike, out: PathLike | None, tp: int | str | None = None, *, to: int | None = None, ep: bool = False,
        vllm: str = "installed", gpu: str = "sm90", env: dict[str, str] | Iterable[str] | None = None,
        moe_backend: str = "auto", scheme: str | None = None, group_size: int | None = None,
        actorder: str | None = None, dry_run: bool = False, force: bool = False,
        progress: Callable[..., Callable[[int], None]] | None = None, memory: dict[str, Any] | None = None) -> Any:
    """Zero-pad the MLP intermediate sizes of the checkpoint at `path` so that it loads at TP `tp`.

    The padded sizes are the smallest that load at `tp` under the release's rules (`vllm`, `gpu`,
    `ep`, `env`, `moe_backend` as for `inspect`), for the routed experts, shared experts and dense
    MLPs, each only where needed; `to` sets the routed experts' size instead.  An unquantized base
    is planned as `scheme` (with `group_size`, `actorder`) would quantize it.  Writes the same format
    to `out` (atomically, with a manifest) and returns the manifest; with `dry_run` returns the
    `PadPlan` and writes nothing; a dry run refuses what the run refuses.  Raises `NotLoadable` for
    what padding cannot fix (heads, KV heads, vocabulary, hidden size; its `.hint` names another
    `moe_backend` where one loads the model without padding), `UsageError` where nothing needs
    padding or `to` does not load at `tp`, and `BadInput` on unusable input, the experts' data
    refused as `repack` refuses it.
    With `tp`, the per-rank memory of the padded checkpoint at `tp` is the plan's `.memory` and the
    returned manifest's `memory` (not written into the output's manifest file); `memory` gives the
    GPU and vLLM options it is judged against (`gpu_mem`, `gpu_memory_utilization`, `max_model_len`,
    `max_num_seqs`, `kv_cache_dtype`, `max_num_batched_tokens` as for `inspect`; without `gpu_mem`,
    what one rank holds).
    """
    from wna16ctl.errors import NotLoadable, UsageError
    from wna16ctl.planning.padding import open_for_padding, plan_padding
    from wna16ctl.padding.write import write_padded
    from wna16ctl.planning.tpsizes import parse_tp_list
    from wna16ctl.repacking.pipeline import check_expert_data
    from wna16ctl.sources.recipe import make_proposal

    if tp is None and to is None:
        raise UsageError("pad needs --tp (the size to load at) or --to (the routed experts' padded size)")
    if vllm == "all":
        raise UsageError("pad plans for one vLLM release: pass a version, 'installed' or 'latest'")
    n = None if tp is None else parse_tp_list(tp, single=True)[0]
    proposal = make_proposal(scheme, None, group_size, actorder, None) \
        if scheme is not None or group_size is not None or actorder is not None else None
    insp, source = open_for_padding(os.fspath(path), n, ep, vllm, gpu, env, moe_backend, proposal)
    try:
        plan = plan_padding(insp, n, to, source)  # refuses a plan that pads nothing, dry run or not
    except NotLoadable as e:
        if n is not None and e.hint is None:
            e.hint = _serving_fix(insp, n)
        raise
    # the experts' data is refused as repack refuses it: g_idx now, the scales before writing (as
    # repack checks them while it writes)
    check_expert_data(plan.checkpoint, values=not dry_run)
    if n is not None:
        from dataclasses import replace

        from wna16ctl.planning.deployment import planned_memory

        padded_ck = replace(plan.checkpoint, layers=plan.padded_layers, linear_layers=plan.padded_linear)
        plan.memory = planned_memory(padded_ck, n, ep, insp.engine.version, insp.gpu, insp.switches, **(memory or {}))
    if dry_run:
        return plan
    if out is None:
        raise UsageError("an output directory is required (or pass dry_run=True)")
    return {**write_padded(plan, out, force=force, progress=progress), "memory": plan.memory}


def convert(path: PathLike, out: PathLike | None, *, dry_run: bool = False, force: bool = False, resume: bool = False,
            progress: Callable[..., Callable[[int], None]] | None = None) -> Any:
    """Convert the GPTQ, AWQ or AutoRound checkpoint at `path` to compressed-tensors `pack-quantized`
    in `out`: every code, scale, zero point and g_idx carried exactly, the `quantization_config` as
    llm-compressor writes it, the other files copied.  Written atomically with a manifest (returned);
    `resume` reuses the files an earlier run finished for the same source.  With `dry_run` returns the
    `ConversionPlan` and writes nothing.  Raises `BadInput` (nothing written) where compressed-tensors
    cannot say what the source stores (the tensor or key, and why)."""
    from wna16ctl.conversion.plan import plan_conversion
    from wna16ctl.conversion.write import write_converted
    from wna16ctl.errors import UsageError

    if force and resume:
        raise UsageError("force and resume exclude each other")
    plan = plan_conversion(os.fspath(path))
    if dry_run:
        return plan
    if out is None:
        raise UsageError("an output directory is required (or pass dry_run=True)")
    return write_converted(plan, out, force=force, resume=resume, progress=progress)


def _serving_fix(insp: Inspection, tp: int) -> str | None:
    """Where padding cannot make the model load at `tp` but another MoE backend does without it,
    as `inspect --suggest` finds it: that change, for the refusal's hint."""
    from wna16ctl.planning.suggest import suggest

    fix = next((s for s in suggest(insp) if s.kind == "moe_backend" and s.tp == tp), None)
    if fix is None:
        return None
    return f"it loads at TP {tp} without padding if you {fix.change} (as inspect --suggest finds)"


_TYPES = {"Inspection": "wna16ctl.planning.inspection", "RepackPlan": "wna16ctl.repacking.pipeline",
          "RepackResult": "wna16ctl.repacking.pipeline", "VerifyReport": "wna16ctl.verification.checks"}


def __getattr__(name: str) -> Any:  # the result types, imported on first use
    if name in _TYPES:
        import importlib

        return getattr(importlib.import_module(_TYPES[name]), name)
    raise AttributeError(f"module 'wna16ctl' has no attribute {name!r}")
