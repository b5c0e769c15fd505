"""The `wna16ctl` command line: parse options, call the library, hand results to the sink.

Heavy modules (torch, compressed-tensors) are imported inside the commands that need them so
that `inspect` starts in a fraction of a second.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, NoReturn

import click

from wna16ctl import __version__
from wna16ctl.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, UsageError, WnaError
from wna16ctl.output import Sink


def _parse_tp(value: str) -> tuple[int, ...]:
    try:
        tps = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers (e.g. 1,2,4,8)") from None
    if not tps or any(t < 1 for t in tps):
        raise click.BadParameter("TP sizes must be positive integers")
    return tps


def _run(ctx: click.Context, sink: Sink, body: Callable[[], int], *, fast_exit: bool = False) -> NoReturn:
    """Run a command body; map library errors to one stderr line and an exit code."""
    debug = ctx.find_root().params.get("debug", False)
    try:
        code = body()
    except WnaError as e:
        if debug:
            raise
        sink.error(e.message, e.hint)
        code = e.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        sink.error("interrupted; no output was committed (repack keeps its staging directory for --resume)")
        code = 130
    except Exception as e:  # a bug: say so in one line, full traceback only with --debug
        if debug:
            raise
        sink.error(f"internal error: {type(e).__name__}: {e}", "rerun with --debug for the traceback and report it")
        code = EXIT_BAD_INPUT
    if fast_exit and ctx.find_root().info_name == "wna16ctl" and sys.argv[0].endswith(("wna16ctl", "__main__.py")):
        # A real process (not a test runner): skip freeing ~10^6 header objects at interpreter
        # exit (0.3 s on the largest checkpoints); nothing is left to flush but the streams.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ctx.exit(code)
    raise AssertionError("unreachable")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="wna16ctl")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug: bool) -> None:
    """Inspect, repack and verify int4/int8 weight-only (WNA16) compressed-tensors MoE checkpoints."""


@cli.command()
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp", default="1,2,4,8", show_default=True, help="Tensor-parallel sizes to plan, comma-separated.")
@click.option("--ep", is_flag=True, help="Expert parallelism: MoE TP is 1 and experts are split across the ranks.")
@click.option("--json", "json_mode", is_flag=True, help="Print one JSON object (schema: docs/inspect-json.md).")
@click.pass_context
def inspect(ctx: click.Context, ckpt: str, tp: str, ep: bool, json_mode: bool) -> None:
    """Decide per MoE layer and TP size whether and how CKPT loads (headers only, no GPU)."""
    sink = Sink(json_mode=json_mode)
    tps = _parse_tp(tp)

    def body() -> int:
        from wna16ctl.inspection import inspect_checkpoint
        from wna16ctl.render import render_inspection

        insp = inspect_checkpoint(ckpt, tps, ep)
        for w in insp.checkpoint.warnings:
            sink.warn(w)
        sink.result(insp.to_json(), lambda console: render_inspection(console, insp))
        return EXIT_OK if insp.loadable else EXIT_FAILED

    _run(ctx, sink, body, fast_exit=True)


def _parse_size(value: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
             "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}
    text = value.strip().upper()
    num = text.rstrip("KMGTIB")
    unit = text[len(num):]
    try:
        n = float(num) * units[unit]
    except (ValueError, KeyError):
        raise click.BadParameter(f"{value!r} is not a size (e.g. 4GiB, 500MB)") from None
    if n < 1:
        raise click.BadParameter("size must be positive")
    return int(n)


@cli.command()
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.option("--tp", "tp", type=click.IntRange(min=1), required=True, help="Number of ranks to write.")
@click.option("--ep", is_flag=True, help="Expert parallelism: MoE TP 1, experts split across the ranks.")
@click.option("--layout", type=click.Choice(["auto", "marlin", "transposed"]), default="auto", show_default=True,
              help="auto = the planner's backend per layer (Marlin, else the transposed Triton layout).")
@click.option("-o", "--output", "out", type=click.Path(path_type=str), help="Output directory (required unless --dry-run).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the output size per rank; write nothing.")
@click.option("--resume", is_flag=True, help="Reuse files of an earlier run with the same source and settings.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default="4GiB", show_default=True, help="Largest output file (a layer never straddles files).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the Marlin repack runs (cuda needs a GPU and nvcc; auto falls back to the CPU).")
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def repack(ctx: click.Context, ckpt: str, tp: int, ep: bool, layout: str, out: str | None, dry_run: bool, resume: bool,
           force: bool, max_shard_size: str, device: str, json_mode: bool, quiet: bool) -> None:
    """Write per-rank safetensors of CKPT's experts in the kernel layout, with a verifiable manifest."""
    sink = Sink(json_mode=json_mode, quiet=quiet)
    max_bytes = _parse_size(max_shard_size)
    if out is None and not dry_run:
        raise click.UsageError("-o/--output is required (or pass --dry-run)")
    if force and resume:
        raise click.UsageError("--force and --resume exclude each other")

    def body() -> int:
        from wna16ctl.render import render_repack_plan, render_repack_result
        from wna16ctl.repack import RepackSettings, plan_repack, run_repack

        plan = plan_repack(ckpt, RepackSettings(tp=tp, ep=ep, layout=layout, max_shard_bytes=max_bytes))
        for w in plan.checkpoint.warnings:
            sink.warn(w)
        if dry_run:
            sink.result(plan.to_json(), lambda console: render_repack_plan(console, plan))
            return EXIT_OK
        with sink.progress("repacking", total=plan.input_bytes()) as advance:
            result = run_repack(plan, out, force=force, resume=resume, progress=advance, device=device)
        sink.result(result.to_json(), lambda console: render_repack_result(console, plan, result))
        return EXIT_OK

    _run(ctx, sink, body)


@cli.command()
@click.argument("out", type=click.Path(path_type=str))
@click.option("--arch", type=click.Choice(["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"]), default="qwen3_moe", show_default=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True)
@click.option("--group-size", type=click.Choice(["-1", "32", "64", "128"]), default="128", show_default=True)
@click.option("--asym", is_flag=True, help="Asymmetric quantization (zero points).")
@click.option("--actorder", type=click.Choice(["none", "weight", "static", "group"]), default="none", show_default=True)
@click.option("--mixed", type=click.Choice(["none", "layer", "expert"]), default="none", show_default=True,
              help="Mixed precision: odd layers (or odd experts) int8.")
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--hidden", type=click.IntRange(min=16), default=256, show_default=True)
@click.option("--intermediate", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--tokenizer/--no-tokenizer", default=True, show_default=True, help="Also write a small tokenizer.json.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.pass_context
def demo(ctx: click.Context, out: str, arch: str, bits: str, group_size: str, asym: bool, actorder: str, mixed: str,
         layers: int, experts: int, hidden: int, intermediate: int, tokenizer: bool, force: bool) -> None:
    """Write a small demo checkpoint quantized by compressed-tensors itself to OUT."""
    sink = Sink()

    def body() -> int:
        from wna16ctl.demo import DemoSpec, write_demo_checkpoint

        spec = DemoSpec(
            arch=arch, num_layers=layers, num_experts=experts, hidden_size=hidden, intermediate_size=intermediate,
            num_bits=int(bits), group_size=int(group_size), symmetric=not asym,
            actorder=None if actorder == "none" else actorder, mixed=None if mixed == "none" else mixed,
            top_k=min(2, experts), tokenizer=tokenizer,
        )
        target = Path(out)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            if not force:
                raise UsageError(f"{target}: exists and is not empty; pass --force to replace it")
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        try:
            path = write_demo_checkpoint(target, spec)
        except ValueError as e:  # an impossible combination of options
            raise UsageError(str(e).removeprefix("DemoSpec: ")) from None
        except FileNotFoundError as e:
            raise UsageError(f"{e}", hint="pass --no-tokenizer when the GSM8K files are not beside the project") from None
        sink.result({"checkpoint": str(path), "spec": spec.__dict__}, lambda console: console.print(f"wrote {path}"))
        return EXIT_OK

    _run(ctx, sink, body)


@cli.command()
@click.argument("ckpt", type=click.Path(file_okay=False, path_type=str))
@click.argument("out", type=click.Path(file_okay=False, path_type=str))
@click.option("--samples", default=None, help="JSON-lines file with a 'question' field (default: GSM8K test.jsonl "
              "beside the project), or a Hugging Face dataset id when `datasets` is installed and online.")
@click.option("--num-samples", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the repacked layers run: the CUDA GEMM kernel or its CPU twin.")
@click.option("--e2e", "e2e", is_flag=True, help="Also generate greedily on GSM8K prompts with the source and the "
              "repacked experts in the transformers model and compare the tokens (needs wna16ctl[e2e]).")
@click.option("--prompts", type=click.IntRange(min=1), default=8, show_default=True, help="--e2e: GSM8K prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="--e2e: tokens generated per prompt.")
@click.option("--score", is_flag=True, help="--e2e: extract the final numbers and report GSM8K exact match.")
@click.option("--json", "json_mode", is_flag=True, help="Print the report as one JSON object.")
@click.pass_context
def verify(ctx: click.Context, ckpt: str, out: str, samples: str | None, num_samples: int, device: str, e2e: bool,
           prompts: int, max_new_tokens: int, score: bool, json_mode: bool) -> None:
    """Prove OUT (a repack output) equals CKPT: manifest, bit-exact round trip, numerics (and --e2e)."""
    sink = Sink(json_mode=json_mode)
    given = [f"--{n.replace('_', '-')}" for n in ("prompts", "max_new_tokens", "score")
             if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given and not e2e:
        raise click.UsageError(f"{', '.join(given)} only apply with --e2e")

    def body() -> int:
        from wna16ctl.activations import default_samples
        from wna16ctl.render import render_verify
        from wna16ctl.verify import verify_output

        options = None
        if e2e:
            from wna16ctl.e2e import E2EOptions, require_transformers

            require_transformers()
            options = E2EOptions(prompts=prompts, max_new_tokens=max_new_tokens, score=score)
        report = verify_output(ckpt, out, samples=samples or default_samples(), num_samples=num_samples, device=device,
                               e2e=options)
        sink.result(report.to_json(), lambda console: render_verify(console, report))
        return EXIT_OK if report.passed else EXIT_FAILED

    _run(ctx, sink, body)


def main() -> None:
    cli(prog_name="wna16ctl")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
