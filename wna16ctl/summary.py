"""The plain lines that sum up repack's and assemble's results for people (`Sink.result_lines`):
no markup, so printing them needs no rich."""

from __future__ import annotations

from typing import Any

from wna16ctl.sink import human_bytes, plural


def repack_result_lines(plan: Any, result: Any) -> list[str]:
    """What `repack` wrote (a RepackPlan and its RepackResult)."""
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
    return lines


def assemble_result_lines(result: Any) -> list[str]:
    """What `assemble` joined (a repacking.parts.AssembleResult)."""
    return [f"assembled {result.out}: {plural(len(result.parts), 'part')}, "
            f"ranks {', '.join(map(str, result.ranks))}, {plural(result.files, 'file')}",
            f"manifest: {result.out / result.to_json()['manifest_name']} (check it with `wna16ctl verify`)"]
