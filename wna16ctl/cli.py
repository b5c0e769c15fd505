"""The `wna16ctl` command line: parse options, call the library, hand results to the sink.

Heavy modules (torch, compressed-tensors) are imported inside the commands that need them so
that `inspect` starts in a fraction of a second.
"""

from __future__ import annotations

import os
import sys

try:  # a Ctrl-C while the command line starts: one line and 130, as anywhere later
    import errno
    import signal
    import threading
    from pathlib import Path
    from typing import Any, Callable, NoReturn

    import click

    from wna16ctl.version import __version__
    from wna16ctl.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError, WnaError
    from wna16ctl.sink import Sink
    # what the option decorators below read while this module loads
    from wna16ctl.planning.engine_env import MOE_BACKENDS
    from wna16ctl.planning.rules import DEFAULT_GPU, GPUS, NEWEST, OLDEST
    from wna16ctl.sources.architectures import DEMO_ARCHITECTURES
    from wna16ctl.sources.formats import CONVERT_TARGETS, DEMO_FORMATS
    from wna16ctl.layout.registry import names as layout_names
    from wna16ctl.layout.spec import AUTO
    from wna16ctl.verification.budget import E2E_HELP, budget_help
except KeyboardInterrupt:
    sys.stderr.write("\nerror: interrupted; nothing was done\n")
    raise SystemExit(130) from None


LAYOUT_NAMES = layout_names()


def _said_interrupted(sink: Sink, debug: bool, e: KeyboardInterrupt, interrupted: str | Callable[[], str]) -> int:
    _traceback(sink, debug)
    if not getattr(e, "quiet", False):
        said = interrupted if isinstance(interrupted, str) else interrupted()
        sink.error(getattr(e, "message", None) or f"interrupted; {said}")
    return int(getattr(e, "exit_code", EXIT_INTERRUPTED))


def _wrapped_interrupt(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C that `e` wraps, if any: Python 3.11 re-raises an exception from a class body's
    `__set_name__` (a dataclass being created while a module is imported) as a RuntimeError whose
    cause is the original, so a Ctrl-C at that moment arrives as a RuntimeError."""
    seen = 0
    cause = e.__cause__
    while cause is not None and seen < 8:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        cause, seen = cause.__cause__, seen + 1
    return None


def _run(ctx: click.Context, sink: Sink, body: Callable[[], int], *, interrupted: str | Callable[[], str],
         fast_exit: bool = False) -> NoReturn:
    """Run a command body; map library errors to one stderr line and an exit code.

    `--debug` (before or after the sub-command) adds the traceback on stderr; the exit code is
    the same with and without it.  `interrupted` is this command's Ctrl-C message (or a function
    that says it from what is on disk by then)."""
    debug = bool(ctx.find_root().params.get("debug") or ctx.params.get("debug"))
    # `quiet` on an error: another process of a torchrun launch prints the line every process shares
    try:
        code = body()
        _settle_redelivered_interrupt()
    except WnaError as e:
        _traceback(sink, debug)
        if not getattr(e, "quiet", False):
            sink.error(e.message, e.hint)
        code = e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C, or torchrun stopping this process (a message of its own)
        code = _said_interrupted(sink, debug, e, interrupted)
    except Exception as e:  # a bug: say so in one line, full traceback only with --debug
        wrapped = _wrapped_interrupt(e)
        if wrapped is not None:
            code = _said_interrupted(sink, debug, wrapped, interrupted)
        else:
            _traceback(sink, debug)
            if not getattr(e, "quiet", False):
                sink.error(f"internal error: {type(e).__name__}: {e}",
                           None if debug else "rerun with --debug for the traceback and report it")
            code = EXIT_BAD_INPUT
    if fast_exit and _own_process(ctx):
        # A real process (not a test runner): skip freeing ~10^6 header objects at interpreter
        # exit (0.3 s on the largest checkpoints); nothing is left to flush but the streams.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ctx.exit(code)
    raise AssertionError("unreachable")


def _own_process(ctx: click.Context) -> bool:
    """Whether this command is the whole process (`wna16ctl ...`, `python -m wna16ctl ...`), not a
    call from a test runner or another program."""
    return ctx.find_root().info_name == "wna16ctl" and sys.argv[0].endswith(("wna16ctl", "__main__.py"))


def _traceback(sink: Sink, debug: bool) -> None:
    if debug:
        sink.traceback()


def _debug_option(f: Callable) -> Callable:
    """`--debug` on every sub-command too, so it works wherever it is typed."""
    return click.option("--debug", is_flag=True, help="Show the traceback of an error (the exit code stays the same).")(f)


class OneLineUsageError(click.UsageError):
    """A usage error as one line on stderr: click's message (which names the option or argument)
    and the fix, instead of click's usage block; `--debug` adds the traceback, as for any error."""

    def __init__(self, error: click.UsageError, command: str, debug: bool):
        super().__init__(error.format_message(), error.ctx)
        self.line = _usage_line(error, command)
        self.debug = debug

    def show(self, file: Any = None) -> None:
        sink = Sink()
        if self.debug:  # click shows the error after its handler has ended: the traceback is this one's
            sink.traceback(self)
        sink.error(self.line)


def _usage_line(error: click.UsageError, command: str) -> str:
    """click's message of `error`, then where the fix is: the usage line when an argument of
    `command` ("wna16ctl demo") is missing or extra, else its --help (what each option accepts)."""
    message = error.format_message().strip().rstrip(".")
    ctx = error.ctx
    param = getattr(error, "param", None)
    if ctx is not None and ((isinstance(error, click.MissingParameter) and param is not None
                             and param.param_type_name == "argument")
                            or message.startswith("Got unexpected extra argument")):
        return f"{message}; usage: {' '.join(ctx.get_usage().split()).removeprefix('Usage: ')}"
    return f"{message}; see '{ctx.command_path if ctx is not None else command} --help'"


class Commands(click.Group):
    """The `wna16ctl` group: every usage error of the group and its commands, click's own (an
    unknown option, a bad value, a missing argument) and the commands' (options that exclude each
    other), goes through `OneLineUsageError`."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        debug = "--debug" in args
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:  # `wna16ctl` alone: the help, as click shows it
            raise
        except click.UsageError as e:
            raise OneLineUsageError(e, info_name or "wna16ctl", debug) from e
        ctx.meta["wna16ctl.debug"] = debug
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except OneLineUsageError:
            raise
        except click.UsageError as e:  # the command's own options, or its body's refusal
            command = f"{ctx.command_path} {ctx.invoked_subcommand or ''}".strip()
            raise OneLineUsageError(e, command, ctx.meta.get("wna16ctl.debug", False)) from e


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="wna16ctl")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (the exit code stays the same).")
def cli(debug: bool) -> None:
    """Inspect, repack and verify int4/int8 weight-only (WNA16) compressed-tensors MoE checkpoints."""


def _vllm_option(allow_all: bool) -> Callable:
    return click.option(
        "--vllm", "vllm", default="installed", show_default=True, metavar="VERSION|installed|latest" + ("|all" if allow_all else ""),
        help=f"vLLM release whose rules apply: a version ({OLDEST} to {NEWEST} are known), the installed vllm package "
             "(else the newest known release), latest" + (", or all (a release x TP matrix)." if allow_all else "."))


# GPU names accepted by --gpu beside the compute capabilities the rulebook knows (a name stands
# for its architecture: backend choice depends on the capability only)
GPU_ALIASES = {
    "t4": "sm75", "a100": "sm80", "a800": "sm80", "a30": "sm80", "a10": "sm86", "a10g": "sm86", "a40": "sm86",
    "rtx3090": "sm86", "l4": "sm89", "l40": "sm89", "l40s": "sm89", "rtx4090": "sm89", "h100": "sm90",
    "h800": "sm90", "h200": "sm90", "h20": "sm90", "gh200": "sm90", "b100": "sm100", "b200": "sm100",
    "gb200": "sm100", "b300": "sm100", "rtx5090": "sm120",
}


class _OptionError(click.ClickException):
    """A bad option value found while the options are read whose message already holds the fix
    (the values that are known): one line on stderr and exit 2, without the `--help` pointer that
    `OneLineUsageError` adds."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file: Any = None) -> None:
        Sink().error(self.message)


def _gpu_option() -> Callable:
    from wna16ctl.planning.fit import GPU_MEMORY

    known = list(GPUS) + [a for a in GPU_ALIASES if GPU_ALIASES[a] in GPUS]
    known += [n for n in GPU_MEMORY if n not in known]

    def to_sm(ctx: click.Context, param: click.Parameter, value: str) -> str:
        name = value.lower()
        ctx.meta["gpu_name"] = name  # a name may carry the GPU's memory (planning.fit.GPU_MEMORY)
        if name in GPU_MEMORY:
            return GPU_MEMORY[name][0]
        if name in GPUS or GPU_ALIASES.get(name) in GPUS:
            return GPU_ALIASES.get(name, name)
        raise _OptionError(f"--gpu {value}: not a GPU architecture or name wna16ctl knows; one of {', '.join(known)}")

    return click.option("--gpu", default=DEFAULT_GPU, show_default=True, callback=to_sm, metavar="SM|NAME",
                        help=f"GPU architecture the engine runs on (backend priority depends on it): {', '.join(GPUS)}, "
                             "or a GPU name for its architecture (h100, h200 = sm90; a100 = sm80; l40s = sm89; "
                             "b200 = sm100; ...).")


def _engine_options(f: Callable) -> Callable:
    """--env and --moe-backend: what the engine is told beyond its release (planning/engine_env.py)."""
    f = click.option("--moe-backend", "moe_backend", type=click.Choice(list(MOE_BACKENDS)), default="auto",
                     show_default=True, help="The engine's --moe-backend (auto: the release's own choice).")(f)
    return click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
                        help="An environment variable the engine runs with, e.g. VLLM_USE_FLASHINFER_MOE_INT4=1 "
                             "(repeatable; docs/inspect-json.md lists those planned).")(f)


def _fit_options(f: Callable) -> Callable:
    """Will it fit: a GPU's memory (--gpu-mem, or a --gpu name carrying it) and vLLM's own options."""
    for opt in reversed((
        click.option("--gpu-mem", "gpu_mem", default=None, metavar="SIZE",
                     help="Memory of one GPU (e.g. 80GiB): report per TP size the weights, KV budget, KV tokens and "
                          "concurrency. A --gpu name such as a100-40, h100, h200, l40s, b200 carries it."),
        click.option("--gpu-memory-utilization", "gpu_memory_utilization", type=float, default=0.9, show_default=True,
                     help="vLLM's --gpu-memory-utilization."),
        click.option("--max-model-len", "max_model_len", type=click.IntRange(min=1), default=None,
                     help="vLLM's --max-model-len (default: the config's max_position_embeddings)."),
        click.option("--max-num-seqs", "max_num_seqs", type=click.IntRange(min=1), default=256, show_default=True,
                     help="vLLM's --max-num-seqs."),
        click.option("--max-num-batched-tokens", "max_num_batched_tokens", type=click.IntRange(min=1), default=None,
                     help="vLLM's --max-num-batched-tokens: the tokens of its profiling pass (default: vllm serve's "
                          "for the GPU's memory)."),
        click.option("--kv-cache-dtype", "kv_cache_dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
                     help="vLLM's --kv-cache-dtype."),
    )):
        f = opt(f)
    return f


def _fit_arguments(ctx: click.Context, fit: dict[str, Any]) -> dict[str, Any]:
    """The memory to plan against: --gpu-mem, else the memory a --gpu name carries, else none."""
    from wna16ctl.planning.fit import GPU_MEMORY

    mem = fit.pop("gpu_mem")
    name = ctx.meta.get("gpu_name")
    if mem is not None:
        from wna16ctl.sink import parse_size

        try:
            fit["gpu_mem"] = parse_size(mem)
        except UsageError as e:
            raise UsageError(f"--gpu-mem: {e.message}") from None
    elif name in GPU_MEMORY:
        fit["gpu_mem"] = name  # the name: its memory and its SM count
    return fit


_REVISION = click.option("--revision", default=None, metavar="REV",
                         help="Branch, tag or commit when CKPT is a Hub repo id (same as ORG/NAME@REV).")


@cli.command(short_help="Whether and how CKPT loads per MoE layer and TP size.")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp", default="1,2,4,8", show_default=True, help="Tensor-parallel sizes to plan, comma-separated.")
@click.option("--ep", is_flag=True, help="Expert parallelism: MoE TP is 1 and experts are split across the ranks.")
@_vllm_option(allow_all=True)
@_gpu_option()
@_engine_options
@click.option("--json", "json_mode", is_flag=True, help="Print one JSON object (schema: docs/inspect-json.md).")
@_REVISION
@click.option("--scheme", default=None, type=click.Choice(["W4A16", "W4A16_ASYM", "W8A16"], case_sensitive=False),
              help="CKPT is unquantized: plan it as llm-compressor would quantize it with this preset.")
@click.option("--recipe", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="CKPT is unquantized: plan it as this llm-compressor recipe (YAML) would quantize it.")
@click.option("--group-size", "group_size", type=int, default=None,
              help="With --scheme/--recipe: the group size (-1 = channel-wise).")
@click.option("--actorder", type=click.Choice(["none", "weight", "static", "group"]), default=None,
              help="With --scheme/--recipe: the activation ordering.")
@click.option("--ignore", "ignore", multiple=True, metavar="PATTERN",
              help="With --scheme: a module left unquantized (name or re:regex; repeat; replaces the default "
                   "lm_head + router gates list).")
@click.option("--suggest", is_flag=True, help="For each TP size that does not load, the nearest changes that do.")
@_fit_options
@_debug_option
@click.pass_context
def inspect(ctx: click.Context, ckpt: str, tp: str, ep: bool, vllm: str, gpu: str, env: tuple[str, ...],
            moe_backend: str, json_mode: bool, revision: str | None, scheme: str | None, recipe: str | None,
            group_size: int | None, actorder: str | None, ignore: tuple[str, ...], suggest: bool, debug: bool,
            **fit: Any) -> None:
    """Decide per MoE layer and TP size whether and how CKPT loads (headers only, no GPU).

    CKPT is a checkpoint directory or a Hugging Face Hub repo id ORG/NAME[@REVISION]; from the
    Hub only config.json, the index and the shard headers are fetched (byte ranges, cached).
    With --scheme or --recipe, CKPT is an unquantized model, planned as the checkpoint that
    quantization would write (docs/user-guide.md, "Before you quantize")."""
    sink = Sink(json_mode=json_mode)

    def body() -> int:
        if _own_process(ctx):
            # Reading the headers allocates ~10^6 containers and frees none of them in cycles: the
            # cyclic collector would only walk them (a full pass when it is switched back on).
            # The process ends with os._exit, so it never has to run.
            import gc

            gc.disable()
        import wna16ctl

        insp = wna16ctl.inspect(ckpt, tp, ep, vllm=vllm, gpu=gpu, revision=revision, env=list(env),
                                moe_backend=moe_backend, scheme=scheme, recipe=recipe, group_size=group_size,
                                actorder=actorder, ignore=list(ignore) or None, suggest=suggest,
                                **_fit_arguments(ctx, fit))
        if insp.engine.note and insp.engine.source != "default":
            sink.warn(insp.engine.note)
        for w in insp.checkpoint.warnings:
            sink.warn(w)
        def render(console) -> None:  # rich is imported only to print for people
            from wna16ctl.render import render_inspection, render_release_matrix

            (render_release_matrix if insp.versions else render_inspection)(console, insp)

        sink.result(insp.to_json(), render)
        return EXIT_OK if insp.ok else EXIT_FAILED  # a correctness hazard fails like a refusal

    _run(ctx, sink, body, interrupted="nothing was written", fast_exit=True)


def _parse_size(value: str, option: str = "--max-shard-size") -> int:
    from wna16ctl.sink import parse_size

    try:
        return parse_size(value)
    except UsageError as e:
        raise click.BadParameter(e.message, param_hint=f"'{option}'") from None


@cli.command(short_help="Write CKPT's experts per rank in the kernel layout, with a manifest.")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp", required=True, help="Number of ranks to write (one TP size).")
@click.option("--ep", is_flag=True, help="Expert parallelism: MoE TP 1, experts split across the ranks.")
@click.option("--layout", type=click.Choice([AUTO, *LAYOUT_NAMES]), default=AUTO, show_default=True,
              help="auto = the planner's backend per layer (Marlin, else the transposed Triton layout); vllm = each "
                   "rank's whole-model state for `vllm serve OUT --load-format sharded_state`.")
@click.option("-o", "--output", "out", type=click.Path(path_type=str), help="Output directory (required unless --dry-run).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the output size per rank; write nothing.")
@click.option("--resume", is_flag=True, help="Reuse files of an earlier run with the same source and settings.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default="4GiB", show_default=True, help="Largest output file (a layer never straddles files).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the Marlin repack runs. auto = the CPU (the native path where it applies, else torch); "
                   "it never picks the GPU, which measured slower than the CPU path. cuda = the GPU kernel for "
                   "every layer (needs a GPU and nvcc; under torchrun each process uses the GPU of its LOCAL_RANK).")
@click.option("--ranks", "ranks", default=None, metavar="R,R,...",
              help="Write only these TP ranks: OUT becomes a part with a manifest part (join parts with assemble).")
@click.option("--node-local", is_flag=True,
              help="Under torchrun: OUT is local to each node; each node commits the ranks its processes wrote as a part.")
@_vllm_option(allow_all=False)
@_gpu_option()
@_engine_options
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_REVISION
@_fit_options
@_debug_option
@click.pass_context
def repack(ctx: click.Context, ckpt: str, tp: str, ep: bool, layout: str, out: str | None, dry_run: bool, resume: bool,
           force: bool, max_shard_size: str, device: str, ranks: str | None, node_local: bool, vllm: str, gpu: str,
           env: tuple[str, ...], moe_backend: str,
           json_mode: bool, quiet: bool, revision: str | None, debug: bool, **fit: Any) -> None:
    """Write per-rank safetensors of CKPT's experts in the kernel layout, with a verifiable manifest.

    CKPT may be a Hub repo id ORG/NAME[@REVISION]: it is downloaded into the Hugging Face cache first.
    Launched by torchrun, the processes share the work: rank r is written by process r mod the
    number of processes, and process 0 commits once all have finished (docs/user-guide.md)."""
    from wna16ctl.repacking import distributed

    launch = distributed.launch_or_single()  # a broken launch: the body refuses it
    # progress from the first process of each node; results from the processes that commit
    sink = Sink(json_mode=json_mode, quiet=quiet or launch.local_rank != 0)
    max_bytes = _parse_size(max_shard_size)
    if out is None and not dry_run:
        raise click.UsageError("-o/--output is required (or pass --dry-run)")
    if force and resume:
        raise click.UsageError("--force and --resume exclude each other")

    committed = False

    def interrupted() -> str:
        """What a Ctrl-C left behind, as it is on disk."""
        if committed:
            return f"{out} was complete and committed before it"
        if out is not None and not dry_run:
            from wna16ctl.output import outdir

            try:
                stage = outdir.stage_path(Path(out).resolve())  # as repack named it ("-o ." included)
            except (OSError, RuntimeError):  # a symbolic-link loop: repack refused it before staging
                stage = None
            if stage is not None and outdir.is_real_dir(stage):
                return f"no output was committed; the staging directory {stage} is kept for --resume"
        return "no output was committed; nothing was left behind"

    def body() -> int:
        nonlocal committed
        import wna16ctl
        from wna16ctl.errors import NotLoadable

        first = launch.rank == 0  # what every process would say alike is said once
        with distributed.joined() as group:
            source = group.together("opening the checkpoint", lambda: _local_checkpoint(sink, ckpt, revision))
            try:
                with sink.tasks() as progress:
                    outcome = wna16ctl.repack(
                        source, out, tp, ep=ep, layout=layout, max_shard_size=max_bytes, dry_run=dry_run,
                        resume=resume, force=force, device=device, vllm=vllm, gpu=gpu, env=list(env),
                        moe_backend=moe_backend, progress=progress, ranks=ranks, node_local=node_local,
                        notice=lambda message: sink.warn(message, always=True),
                        warn=sink.warn if first else lambda message: None, group=group,
                        **_fit_arguments(ctx, fit))
            except NotLoadable as e:
                if dry_run and json_mode and first:  # the plan's answer is "no": still one JSON object on stdout
                    sink.result({"checkpoint": ckpt, "settings": getattr(e, "settings", None), "loadable": False,
                                 "error": e.message}, lambda console: None)
                raise
            if dry_run:
                if first:
                    from wna16ctl.render import render_repack_plan

                    memory = getattr(outcome, "memory", None)  # a dry run returns a plan, which carries it
                    sink.result({**outcome.to_json(), "loadable": True, "memory": memory},
                                lambda console: render_repack_plan(console, outcome, out, memory))
                return EXIT_OK
            from wna16ctl.repacking.pipeline import RepackResult

            assert isinstance(outcome, RepackResult)  # not a dry run: what was written
            result = outcome
            committed = result.committed
        if result.committed:  # one result per output directory (one per node with --node-local)
            from wna16ctl.summary import repack_result_lines

            sink.result_lines(result.to_json(), lambda: repack_result_lines(result))
        return EXIT_OK

    _run(ctx, sink, body, interrupted=interrupted)


@cli.command(short_help="Join repack parts (--ranks, --node-local) copied into one directory.")
@click.argument("out", type=click.Path(file_okay=False, path_type=str))
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object (docs/repack-json.md).")
@_debug_option
@click.pass_context
def assemble(ctx: click.Context, out: str, json_mode: bool, debug: bool) -> None:
    """Join the manifest parts in OUT (the contents of several `repack --ranks` or `--node-local`
    outputs copied together) into the wna16ctl.json a single run writes.

    Checks that the parts are of one run, cover every rank and that each listed file is there with
    its size; run `verify` afterwards to check the contents."""
    sink = Sink(json_mode=json_mode)

    def body() -> int:
        from wna16ctl.repacking.parts import assemble as assemble_parts
        from wna16ctl.summary import assemble_result_lines

        result = assemble_parts(out)
        sink.result_lines(result.to_json(), lambda: assemble_result_lines(result))
        return EXIT_OK

    _run(ctx, sink, body, interrupted="run assemble again")


@cli.command(short_help="Write a small demo checkpoint quantized by compressed-tensors.")
@click.argument("out", type=click.Path(path_type=str))
@click.option("--arch", type=click.Choice(DEMO_ARCHITECTURES), default=DEMO_ARCHITECTURES[0], show_default=True)
@click.option("--format", "fmt", type=click.Choice(DEMO_FORMATS), default=DEMO_FORMATS[0], show_default=True,
              help="The checkpoint's format: compressed-tensors as the library writes it, or the same "
                   "quantization stored as GPTQModel writes GPTQ (v1; --actorder group gives desc_act) or as "
                   "AutoAWQ/AutoRound write AWQ (GEMM, 4 bits; --asym gives zero_point).")
@click.option("--bits", type=click.Choice([str(b) for b in range(2, 9)]), default="4", show_default=True,
              help="Weight bit width (2-8; compressed-tensors packs the codes densely into int32 words; GPTQ "
                   "stores 2, 3, 4 or 8, AWQ 4).")
@click.option("--group-size", type=click.Choice(["-1", "32", "64", "128"]), default="128", show_default=True)
@click.option("--asym", is_flag=True, help="Asymmetric quantization (zero points).")
@click.option("--actorder", type=click.Choice(["none", "weight", "static", "group"]), default="none", show_default=True)
@click.option("--mixed", type=click.Choice(["none", "layer", "expert"]), default="none", show_default=True,
              help="Mixed precision: odd layers (or odd experts) int8.")
@click.option("--targets", type=click.Choice(["experts", "linear"]), default="experts", show_default=True,
              help="What is quantized: the routed experts only, or every Linear but lm_head, the routers and the "
                   "shared-expert gate (llm-compressor's usual W4A16 recipe: attention too).")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--hidden", type=click.IntRange(min=16), default=256, show_default=True)
@click.option("--intermediate", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--tokenizer/--no-tokenizer", default=True, show_default=True, help="Also write a small tokenizer.json.")
@click.option("--force", is_flag=True, help="Replace an earlier demo checkpoint in OUT (nothing else is removed).")
@_debug_option
@click.pass_context
def demo(ctx: click.Context, out: str, arch: str, fmt: str, bits: str, group_size: str, asym: bool, actorder: str, mixed: str,
         targets: str, layers: int, experts: int, hidden: int, intermediate: int, tokenizer: bool, force: bool, debug: bool) -> None:
    """Write a small demo checkpoint quantized by compressed-tensors itself to OUT (--format gptq or awq: the
    same quantization stored in that format)."""
    sink = Sink()

    def body() -> int:
        from wna16ctl.demo import DemoSpec, write_demo_output

        spec = DemoSpec(
            arch=arch, num_layers=layers, num_experts=experts, hidden_size=hidden, intermediate_size=intermediate,
            num_bits=int(bits), group_size=int(group_size), symmetric=not asym,
            actorder=None if actorder == "none" else actorder, mixed=None if mixed == "none" else mixed,
            top_k=min(2, experts), tokenizer=tokenizer, targets=targets, format=fmt,
        )
        try:
            with sink.tasks() as progress:
                path = write_demo_output(out, spec, force=force, progress=progress)
        except ValueError as e:  # an impossible combination of options
            raise UsageError(str(e).removeprefix("DemoSpec: ")) from None
        import shlex

        step = shlex.join(["wna16ctl", "inspect", str(path), "--tp", "1,2"])

        def render(console) -> None:
            console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
            console.print(f"next: see how it loads per TP size\n  {step}", markup=False, highlight=False, soft_wrap=True)

        sink.result({"checkpoint": str(path), "spec": spec.__dict__, "next_steps": [step]}, render)
        return EXIT_OK

    _run(ctx, sink, body, interrupted=f"nothing was written to {out}")


def _samples_order_help() -> str:
    """verify's sample search order for --help, from the one statement of it (without step 1, the option itself)."""
    from wna16ctl.verification.samples import SAMPLE_SEARCH_ORDER

    return "; else ".join(step.replace("`", "") for step in SAMPLE_SEARCH_ORDER[1:])


@cli.command(short_help="Prove OUT (a repack output) equals CKPT.")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(file_okay=False, path_type=str))
@click.option("--samples", default=None, help="GSM8K-style questions: a .jsonl or .parquet file with a 'question' "
              f"field. Without it: {_samples_order_help()}.")
@click.option("--num-samples", type=click.IntRange(min=1), default=64, show_default=True,
              help=f"Questions the numerics embed and route. {budget_help()}")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the repacked layers run: the CUDA GEMM kernel or its CPU twin.")
@click.option("--e2e", "e2e", is_flag=True, help="Also generate greedily on GSM8K prompts with the source and the "
              f"repacked experts in the transformers model and compare the tokens (needs wna16ctl[e2e]). {E2E_HELP}")
@click.option("--prompts", type=click.IntRange(min=1), default=8, show_default=True, help="--e2e: GSM8K prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="--e2e: tokens generated per prompt.")
@click.option("--score", is_flag=True, help="--e2e: extract the final numbers and report GSM8K exact match.")
@click.option("--layers", "layers", default=None, metavar="I,J-K",
              help="Check only these MoE layers' experts (layer indices, e.g. 0-3,7): a partial verify, reported "
                   "as such.")
@click.option("--experts", "experts", default=None, metavar="I,J-K",
              help="Check only these experts of each MoE layer checked (expert indices, e.g. 0-7): a partial "
                   "verify, reported as such; combines with --layers.")
@click.option("--numerics/--no-numerics", "numerics", default=True,
              help="--no-numerics: the exactness proof alone, at disk speed and in memory bounded by one expert: the manifest and "
                   "the bit-exact round trip of a repack output, the tensor proof of a pad output. The numerics "
                   "are reported as not run (no samples are read).")
@click.option("--ranks", "ranks", default=None, metavar="R,R,...",
              help="Check only these TP ranks' files (a repack output): a partial verify, reported as such. Under "
                   "torchrun each process checks its share, rank r by process r mod the number of processes, "
                   "and the first process prints the one report.")
@click.option("--json", "json_mode", is_flag=True, help="Print the report as one JSON object (docs/verify-json.md).")
@_REVISION
@_debug_option
@click.pass_context
def verify(ctx: click.Context, ckpt: str, out: str, samples: str | None, num_samples: int, device: str, e2e: bool,
           prompts: int, max_new_tokens: int, score: bool, layers: str | None, experts: str | None, numerics: bool,
           ranks: str | None, json_mode: bool, revision: str | None, debug: bool) -> None:
    """Prove OUT (a repack output) equals CKPT: manifest, bit-exact round trip, numerics (and --e2e).

    CKPT may be a Hub repo id ORG/NAME[@REVISION] (downloaded into the Hugging Face cache).
    Launched by torchrun, the processes share the ranks, as repack's do (docs/user-guide.md)."""
    from wna16ctl.repacking import distributed

    launch = distributed.launch_or_single()  # a broken launch: the body refuses it
    # progress from the first process of each node; the report from the first process of the run
    sink = Sink(json_mode=json_mode, quiet=launch.local_rank != 0)
    given = [f"--{n.replace('_', '-')}" for n in ("prompts", "max_new_tokens", "score")
             if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given and not e2e:
        raise click.UsageError(f"{', '.join(given)} only apply with --e2e")

    def body() -> int:
        import wna16ctl

        with distributed.joined() as group:
            source = group.together("opening the checkpoint", lambda: _local_checkpoint(sink, ckpt, revision))
            with sink.tasks() as progress:
                report = wna16ctl.verify(source, out, samples=samples, num_samples=num_samples, device=device, e2e=e2e,
                                         prompts=prompts, max_new_tokens=max_new_tokens, score=score, layers=layers,
                                         experts=experts, numerics=numerics, progress=progress,
                                         notice=lambda m: sink.warn(m, always=True) if launch.rank == 0 else None,
                                         ranks=ranks, group=group)
        if launch.rank == 0:  # every process holds the run's report: the first prints it
            from wna16ctl.render import render_verify

            sink.result(report.to_json(), lambda console: render_verify(console, report))
        return EXIT_OK if report.passed else EXIT_FAILED

    _run(ctx, sink, body, interrupted="nothing was verified")


# -- pad -------------------------------------------------------------------------------------------

@cli.command(short_help="Zero-pad CKPT's MLP intermediate sizes so that it loads at a TP size.")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", "out", type=click.Path(path_type=str), help="Output directory (required unless --dry-run).")
@click.option("--tp", "tp", default=None, help="The TP size the padded checkpoint must load at.")
@click.option("--to", "to", type=click.IntRange(min=1), default=None,
              help="The routed experts' padded intermediate size (instead of the smallest that loads).")
@click.option("--ep", is_flag=True, help="Plan for expert parallelism (experts whole; shared and dense MLPs split).")
@_vllm_option(allow_all=False)
@_gpu_option()
@_engine_options
@click.option("--scheme", default=None, type=click.Choice(["W4A16", "W4A16_ASYM", "W8A16"], case_sensitive=False),
              help="CKPT is unquantized: pad for the checkpoint this preset would quantize it into.")
@click.option("--group-size", "group_size", type=int, default=None, help="With --scheme: the group size (-1 = channel-wise).")
@click.option("--actorder", type=click.Choice(["none", "weight", "static", "group"]), default=None,
              help="With --scheme: the activation ordering.")
@click.option("--dry-run", is_flag=True, help="Print the padded sizes, the cost and the verdict; write nothing.")
@click.option("--force", is_flag=True, help="Replace an earlier wna16ctl output at OUT.")
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_fit_options
@_debug_option
@click.pass_context
def pad(ctx: click.Context, ckpt: str, out: str | None, tp: str | None, to: int | None, ep: bool, vllm: str, gpu: str,
        env: tuple[str, ...], moe_backend: str, scheme: str | None, group_size: int | None, actorder: str | None,
        dry_run: bool, force: bool, json_mode: bool, quiet: bool, debug: bool, **fit: Any) -> None:
    """Write CKPT with its MLP intermediate sizes zero-padded (exactly: the added weights are zeros)
    to the smallest sizes that load at --tp under the release's rules; same format, new config sizes."""
    sink = Sink(json_mode=json_mode, quiet=quiet)
    if out is None and not dry_run:
        raise click.UsageError("-o/--output is required (or pass --dry-run)")

    def body() -> int:
        import wna16ctl
        from wna16ctl.planning.padding import summary_lines

        def padded(out: str | None, **run: Any) -> Any:
            return wna16ctl.pad(ckpt, out, tp=tp, to=to, ep=ep, vllm=vllm, gpu=gpu, env=list(env),
                                moe_backend=moe_backend, scheme=scheme, group_size=group_size, actorder=actorder,
                                memory=_fit_arguments(ctx, fit), **run)

        if dry_run:
            plan = padded(None, dry_run=True)
            plan_json = {**plan.to_json(), "memory": plan.memory}
            sink.result_lines(plan_json, lambda: summary_lines(plan_json))
            return EXIT_OK
        with sink.tasks() as progress:
            manifest = padded(out, force=force, progress=progress)
        sink.result_lines(manifest, lambda: summary_lines({**manifest["padding"], "memory": manifest.get("memory")}, out,
                                                          ckpt, moe_backend))
        return EXIT_OK

    _run(ctx, sink, body, interrupted="no output was committed")


# -- convert ---------------------------------------------------------------------------------------

@cli.command(short_help="Convert a GPTQ, AWQ or AutoRound CKPT to compressed-tensors (or back to GPTQ), exactly.")
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", "out", type=click.Path(path_type=str), help="Output directory (required unless --dry-run).")
@click.option("--to", "to", type=click.Choice(list(CONVERT_TARGETS)), default=None,
              help="The format to write (default: compressed-tensors; a compressed-tensors CKPT: GPTQ).")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@click.option("--resume", is_flag=True, help="Reuse files of an earlier run with the same source.")
@click.option("--force", is_flag=True, help="Replace an earlier wna16ctl output at OUT.")
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_debug_option
@click.pass_context
def convert(ctx: click.Context, ckpt: str, out: str | None, to: str | None, dry_run: bool, resume: bool, force: bool,
            json_mode: bool, quiet: bool, debug: bool) -> None:
    """Write CKPT (GPTQ, AWQ or AutoRound) as a compressed-tensors pack-quantized checkpoint, or a
    compressed-tensors CKPT as GPTQ (--to gptq: v1, as GPTQModel writes it): every code, scale, zero
    point and g_idx carried exactly; refused in one line where the target cannot say what CKPT stores."""
    sink = Sink(json_mode=json_mode, quiet=quiet)
    if out is None and not dry_run:
        raise click.UsageError("-o/--output is required (or pass --dry-run)")
    if force and resume:
        raise click.UsageError("--force and --resume exclude each other")

    def body() -> int:
        from shlex import quote

        if _own_process(ctx):
            # The data path calls no BLAS: numpy's would start a thread per core at import
            # (~60 ms of a run of about a second).  Planning and converting allocate no cycles
            # worth collecting: the cyclic collector would only walk the plan's objects again
            # and again (the process ends with os._exit).
            import gc

            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            gc.disable()
        import wna16ctl

        if dry_run:
            plan = wna16ctl.convert(ckpt, None, dry_run=True, to=to).to_json()
            sink.result_lines(plan, lambda: [f"{k}: {v}" for k, v in plan.items()])
            return EXIT_OK
        with sink.tasks() as progress:
            manifest = wna16ctl.convert(ckpt, out, force=force, resume=resume, progress=progress, to=to)
        conv = manifest["conversion"]
        sink.result_lines(manifest, lambda: [
            f"converted {conv['projections']} projections ({', '.join(conv['schemes'])}) from {conv['source_format']} "
            f"to {conv['target']}: {out}",
            f"next: wna16ctl verify {quote(ckpt)} {quote(str(out))}"])
        return EXIT_OK

    _run(ctx, sink, body, interrupted="no output was committed; an interrupted run's finished files are kept for --resume")


@cli.command("env", short_help="Versions and hardware, for bug reports.")
@click.option("--json", "json_mode", is_flag=True, help="Print one JSON object.")
@_debug_option
@click.pass_context
def env_command(ctx: click.Context, json_mode: bool, debug: bool) -> None:
    """Print the versions of wna16ctl, Python, torch, compressed-tensors, safetensors,
    huggingface_hub, transformers and an installed vLLM, and whether nvcc and a GPU are present."""
    sink = Sink(json_mode=json_mode)

    def body() -> int:
        from wna16ctl.envreport import environment

        data = environment()

        def render(console) -> None:
            for key in ("wna16ctl", "python", "platform"):
                console.print(f"{key}: {data[key]}", markup=False, highlight=False)
            console.print(f"cpu simd: {', '.join(data['cpu_simd']) or 'none of avx2/avx512'}", markup=False)
            for name, version in data["packages"].items():
                console.print(f"{name}: {version or 'not installed'}", markup=False)
            nvcc = data["nvcc"]
            console.print(f"nvcc: {'not found' if nvcc is None else nvcc['version'] or nvcc['path']}", markup=False)
            gpus = data["gpus"]
            console.print(f"gpus: {'no nvidia-smi' if gpus is None else '; '.join(gpus) or 'none'}", markup=False)

        sink.result(data, render)
        return EXIT_OK

    _run(ctx, sink, body, interrupted="nothing was done")


def _local_checkpoint(sink: Sink, ckpt: str, revision: str | None) -> str:
    """CKPT as a directory: a Hub repo id is downloaded (huggingface_hub's progress on stderr)."""
    from wna16ctl.sources.hub import parse_ref, resolve_local

    if parse_ref(ckpt, revision) is not None:
        sink.info(f"{ckpt}: downloading from the Hugging Face Hub into its cache (or finding it there)")
    return resolve_local(ckpt, revision, quiet=sink.quiet)[0]


_redelivery: threading.Timer | None = None  # the Ctrl-C `_redeliver_interrupt` is sending again


def _settle_redelivered_interrupt() -> None:
    """A Ctrl-C being sent again (`_redeliver_interrupt`) lands before the command reports: on a
    busy machine the rest of a short command can end before the sending thread runs."""
    again = _redelivery
    if again is not None:
        again.join()  # the signal interrupts this wait, or is raised at the next line
        signal.getsignal(signal.SIGINT)


def _redeliver_interrupt(unraisable: Any) -> None:
    """sys.unraisablehook: a Ctrl-C that lands in a weakref callback or a __del__ (an import's
    module-lock cleanup, a freed tensor) is only printed there and lost, and the command would
    carry on to exit 0 after a traceback; send it again, to the code that runs next."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        # Python looks for signals as soon as a call returns, so a signal sent from here would be
        # raised in this hook and lost again: another thread sends it once the hook has returned
        global _redelivery
        again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT))
        again.daemon = True
        _redelivery = again
        again.start()
    else:
        sys.__unraisablehook__(unraisable)


def main() -> None:
    """The `wna16ctl` program: click's standalone mode, except that a Ctrl-C outside a command's
    body (while the options are read) exits 130 with one line like one inside it, not click's
    "Aborted!" and 1."""
    sys.unraisablehook = _redeliver_interrupt
    starting = getattr(sys.modules.get("wna16ctl"), "_interrupted_while_starting", None)
    if starting is not None and signal.getsignal(signal.SIGINT) is starting:  # the imports are done
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.main(prog_name="wna16ctl", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except (click.Abort, KeyboardInterrupt):
        Sink().error("interrupted; nothing was done")
        code = EXIT_INTERRUPTED
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        # the reader of stdout went away (`| head`): exit quietly, as click does. What stdout still
        # holds goes to /dev/null, so that the interpreter's last flush does not fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor has no pipe to lose
            pass
        code = 1
    # The command is over and its exit status decided: a Ctrl-C while the interpreter shuts down
    # would only turn that status into a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
