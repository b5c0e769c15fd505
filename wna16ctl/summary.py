"""The plain lines that sum up repack's and assemble's results for people (`Sink.result_lines`):
no markup, so printing them needs no rich."""

from __future__ import annotations

from typing import Any

from wna16ctl.layout.spec import VLLM
from wna16ctl.sink import human_bytes, plural


def repack_result_lines(result: Any) -> list[str]:
    """What `repack` wrote (a RepackResult and the plan it carries), then how to serve it."""
    plan = result.plan
    if result.manifest.get("layout") == VLLM:
        files = [f for r in result.manifest["ranks"] for f in r["files"]]
        ep = " (expert parallel)" if plan.ep else ""
        return ([f"wrote {plural(len(files), 'file')} for {plural(plan.tp, 'rank')}{ep} of vLLM {plan.vllm} into {result.out}"]
                + vllm_backend_lines(plan) + vllm_next_step_lines(result.manifest["serve"]))
    lines = [f"wrote {result.out}: {plural(result.files_written, 'file')} written"
             + (f", {result.files_reused} reused" if result.files_reused else "")
             + f", {human_bytes(sum(plan.rank_bytes()[r] for r in result.ranks))} in "
             + plural(len(result.ranks), "rank directory", "rank directories")]
    if len(result.ranks) != plan.settings.tp:
        lines.append(f"ranks {', '.join(map(str, result.ranks))} of {plan.settings.tp}: a part (join the parts with "
                     "`wna16ctl assemble`, docs/user-guide.md)")
    if len(result.processes) > 1:
        lines.append(f"written by {plural(len(result.processes), 'process', 'processes')}")
    lines.append(f"manifest: {result.out / result.manifest_name}")
    return lines + next_step_lines(result.next_steps)


def vllm_backend_lines(plan: Any) -> list[str]:
    """Where the release's expert buffers follow the backend (a VllmStatePlan), which one was
    planned: the files load only into an engine that picks the same one."""
    if not plan.backends:
        return []
    chosen = sorted(set(plan.backends.values()))
    orient = plan.experts_json()["orientation"]
    return [f"expert buffers {orient.replace('_', '-')}: vLLM {plan.vllm} shapes them by the MoE backend, "
            f"planned {', '.join(chosen)} on {plan.gpu}; serve where vLLM picks the same backend "
            f"(or pass --moe-backend {chosen[0]})"]


def vllm_next_step_lines(serve: str) -> list[str]:
    """How to serve a vllm layout output (its serve command)."""
    return ["next: serve it with stock vLLM", f"  {serve}"]


def assemble_result_lines(result: Any) -> list[str]:
    """What `assemble` joined (a repacking.parts.AssembleResult)."""
    return [f"assembled {result.out}: {plural(len(result.parts), 'part')}, "
            f"ranks {', '.join(map(str, result.ranks))}, {plural(result.files, 'file')}",
            f"manifest: {result.out / result.to_json()['manifest_name']}"] + \
        [f"next: check the contents\n  {line}" for line in result.next_steps[:1]]


def next_step_lines(steps: list[Any]) -> list[str]:
    """What to run next (planning.next_steps.NextStep), each command on its own line."""
    import shutil
    import textwrap

    width = shutil.get_terminal_size((100, 24)).columns  # $COLUMNS first, as for every table
    out: list[str] = []
    for s in steps:
        head = f"next: {s.why}" if s.layout is None else f"next: serve the {s.layout} layout ({s.why})"
        out += textwrap.wrap(head, width, subsequent_indent="      ")
        out += [f"  {line}" for command in s.lines() for line in shell_lines(command, width, 2)]
    return out


def shell_lines(command: str, width: int | None, indent: int = 0) -> list[str]:
    """`command` as lines of at most `width` columns (None: one line), broken between shell words
    with a trailing backslash, so that the lines paste and run as the one command."""
    import shlex

    if width is None or indent + len(command) <= width:
        return [command]
    lines: list[str] = []
    current = ""
    for w in (shlex.quote(x) for x in shlex.split(command)):
        room = width - indent - (4 if lines else 0) - 2
        if current and len(current) + 1 + len(w) > room:
            lines.append(current + " \\")
            current = w
        else:
            current = f"{current} {w}" if current else w
    lines.append(current)
    return [lines[0]] + ["    " + ln for ln in lines[1:]]
