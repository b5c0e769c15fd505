"""Human renderings of command results (the JSON forms come from the results' `to_json`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from wna16ctl.planning.inspection import Inspection
from wna16ctl.planning.suggest import KINDS_TRIED
from wna16ctl.sink import human_bytes, plural, simple_table
from wna16ctl.summary import next_step_lines, vllm_backend_lines, vllm_next_step_lines

if TYPE_CHECKING:  # the renderers' inputs, imported lazily at run time (torch behind some)
    from wna16ctl.planning.moe import LayerPlan
    from wna16ctl.planning.rules import Engine
    from wna16ctl.verification.e2e import E2EResult


def _layer_span(indices: list[int | None], names: list[str]) -> str:
    nums = [i for i in indices if i is not None]
    if len(nums) != len(indices) or not nums:
        return ", ".join(names)
    from wna16ctl.planning.moe import _ranges

    return f"layers {_ranges(sorted(nums))}"


def _notes_grid(console: Console, notes: list[tuple[str, str]]) -> None:
    """Notes as `label  text` with the text wrapped under itself (a hanging indent)."""
    if not notes:
        return
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for label, text in notes:
        grid.add_row(f"  {escape(label)}", text)
    console.print(grid)


def _tp_list(tps: list[str]) -> str:
    return "TP " + ", ".join(tps)


def render_inspection(console: Console, insp: Inspection) -> None:
    ck = insp.checkpoint
    cfg = ck.config
    arch = cfg.architectures[0] if cfg.architectures else cfg.model_type or "?"
    layers = ck.layers
    total_packed = sum(lay.packed_bytes for lay in layers)
    schemes = sorted({lay.scheme.describe() for lay in layers if lay.scheme is not None})
    if ck.source is not None:  # a Hub repo: headers read by range request, root is the cache snapshot
        src = ck.source
        console.print(f"[bold]{escape(src['repo_id'])}[/] @ {escape(src['revision'])} (commit {src['commit'][:12]}, Hub)")
    else:
        console.print(f"[bold]{escape(str(ck.root))}[/]")
    console.print(f"  rules of vLLM {insp.engine.version} ({_engine_source(insp.engine)}) on a CUDA {insp.gpu} GPU"
                  + "".join(f", {escape(n)}={escape(v)}" for n, v in insp.switches.env)
                  + (f", --moe-backend {insp.switches.moe_backend}" if insp.switches.moe_backend != "auto" else ""))
    _proposal_line(console, insp)
    console.print(
        f"  {escape(arch)} · hidden {cfg.hidden_size} · {plural(len(layers), 'MoE layer')}"
        + (f" · {plural(layers[0].num_experts, 'expert')} × intermediate {layers[0].intermediate_size}" if layers else "")
    )
    qfmt = cfg.quant.format if cfg.quant else "none"
    qver = f" (compressed-tensors {cfg.quant.version})" if cfg.quant and cfg.quant.version else ""
    console.print(f"  format {escape(qfmt)}{escape(qver)} · schemes: {escape(', '.join(schemes) or 'none')}")
    console.print(f"  {plural(len(ck.files), 'tensor')} in {plural(len(ck.files.shards), 'shard')} "
                  f"({human_bytes(ck.files.total_bytes)}); packed experts {human_bytes(total_packed)}")
    if not layers:
        console.print("[yellow]no routed-expert MoE layers found[/]")
        render_model_section(console, insp)
        return

    # Collapse layers whose plans are identical into one row group.
    groups: dict[str, list] = {}
    for lay in layers:
        plans = insp.plans[lay.prefix]
        key = repr((lay.scheme, lay.num_experts, lay.intermediate_size, [p.to_json() for p in plans]))
        groups.setdefault(key, []).append(lay)

    table = simple_table(
        f"plan per TP size{' (expert parallel)' if insp.ep else ''}",
        ["layers", "scheme", "TP", "I/rank", "backend", "w2 scales", "k full", "bytes/rank", "status"],
        console, drop=("k full", "w2 scales", "bytes/rank", "I/rank"),
    )
    table.columns[0].overflow = "fold"
    for col in table.columns[2:]:  # the status stays on one line: columns are left out first
        col.no_wrap = True
    # notes: (layer span, text) -> the TP sizes it applies to, in first-seen order
    notes: dict[tuple[str, str], list[str]] = {}
    for members in groups.values():
        lay = members[0]
        span = _layer_span([m.layer_index for m in members], [m.prefix for m in members])
        for i, p in enumerate(insp.plans[lay.prefix]):
            tp = f"{p.tp}{' EP' if p.ep else ''}"
            ip = str(p.intermediate_size_per_partition)
            if p.loadable and p.padded_intermediate and p.padded_intermediate != p.intermediate_size_per_partition:
                ip += f"→{p.padded_intermediate}"
            if p.loadable:
                assert p.backend is not None and p.w2 is not None, "a plan that loads has both"
                # backend, w2 sharding and is_k_full are what the engine would use
                backend = p.backend.value
                if p.method is not None:  # a GPTQ/AWQ layer: the MoE method its config builds, then its kernel
                    backend = f"{p.method['name']}: {backend}"
                w2 = f"{'full' if p.w2.load_full_w2 else 'sharded'} {p.w2.w2_scales_size}"
                k_full = "yes" if p.w2.is_k_full else "no"
            else:
                # no backend serves a row that fails: the one the release selected before the refusal
                # is in --json, and the refusal is in the notes
                backend, w2, k_full = "—", "—", "—"
            status = _status(p.loadable, p.hazards)
            table.add_row(
                escape(span) if i == 0 else "",
                escape(lay.scheme.describe()) if (i == 0 and lay.scheme) else ("unquantized" if i == 0 else ""),
                tp, ip, backend, w2, k_full,
                human_bytes(max(p.rank_bytes) * len(members)) if p.loadable and p.rank_bytes and max(p.rank_bytes) else "—",
                status,
            )
            texts = [f"{REFUSAL_LABEL} {escape(e)}" for e in p.errors]
            texts += [_hazard_note(h) for h in p.hazards]
            if not p.loadable:
                # backends that never serve this deployment (another device, batched formats) are in --json
                texts += [f"{NOTE_LABEL} [dim]{name} rejected:[/] {escape(reason)}" for name, reason in p.rejected.items()
                          if not reason.startswith(("lower priority", "kernel does not support the current device",
                                                    "kernel does not support the standard activation format"))]
            for text in texts:
                notes.setdefault((span, text), []).append(tp)
    console.print(table)
    _notes_grid(console, [(f"{span}, {_tp_list(tps)}:", text) for (span, text), tps in notes.items()])
    render_model_section(console, insp)
    if insp.config_refusal is not None:
        verdict = f"[bold red]refused at config parse[/]: {escape(insp.config_refusal.text())}"
    elif not insp.loadable:
        verdict = "[bold red]does not load[/] everywhere (see above)"
    elif not insp.ok:
        verdict = "[bold red]loads, but outputs would be wrong[/] (correctness hazard above)"
    else:
        verdict = "[bold green]loads[/] at every requested TP size"
    console.print(f"verdict: {verdict}")
    console.print(f"summary: {escape(insp.summary()['text'])}")
    render_fits(console, insp)
    render_suggestions(console, insp)
    render_next_steps(console, insp.next_steps())


def render_fits(console: Console, insp: Inspection) -> None:
    """Per TP size that loads: weights (exact), KV per token (exact), and what the KV budget holds
    (a range: the rest of a start is an estimate), each wrapped under itself to the console's width."""
    if insp.fits is None:
        return
    if not insp.fits:
        console.print("memory: no requested TP size loads, nothing to fit")
        return
    f0 = insp.fits[0]
    console.print(f"memory per GPU ({human_bytes(f0.gpu_mem)} x {f0.gpu_memory_utilization_text()}, "
                  f"--max-model-len {f0.max_model_len}, --max-num-seqs {f0.max_num_seqs}, --max-num-batched-tokens "
                  f"{f0.rest.batched_tokens}; the rest of a start is an estimate per TP size):")
    rows: list[tuple[str, str]] = []
    for f in insp.fits:
        lo, hi = f.rest.low, f.rest.high
        if f.not_judged:
            rows.append((f"TP {f.tp}:", f"weights {human_bytes(f.weights.loaded_bytes)} (exact); KV cache size not "
                                        f"known ({escape(f.not_judged)}): [yellow]not judged[/]"))
            continue
        verdict = {"yes": "[green]fits[/]", "maybe": "[yellow]fits only if the rest stays small[/]",
                   "no": f"[red]does not fit[/] (short by at least {human_bytes(f.short_by())})"}[f.fits()]
        weights = "exact" if f.weights_exact() else "as built where processing is not modelled"
        rows.append((f"TP {f.tp}:", f"weights {human_bytes(f.weights.loaded_bytes)} ({weights}), KV "
                                    f"{human_bytes(f.kv.bytes_per_token())}/token (exact); rest "
                                    f"{human_bytes(lo)}-{human_bytes(hi)} (estimate); KV tokens "
                                    f"{_span(f.kv_tokens(hi), f.kv_tokens(lo))}, "
                                    f"{_span(f.concurrency(hi), f.concurrency(lo))} concurrent {f.max_model_len}-token "
                                    f"requests, largest --max-model-len {_span(f.largest_len(hi), f.largest_len(lo))}: "
                                    f"{verdict}"))
    _notes_grid(console, rows)


def _span(low: object, high: object) -> str:
    """A range as `low-high`, or one figure where both ends agree."""
    return str(low) if low == high else f"{low}-{high}"


# The three kinds of note under an inspect table, each with its label: the engine computes wrong
# outputs; the engine refuses to load; anything else worth knowing (other releases, padding, ...).
CORRECTNESS_LABEL = "[bold red]correctness hazard[/]"
REFUSAL_LABEL = "[red]engine refusal[/]"
NOTE_LABEL = "[yellow]note[/]"


def _status(loadable: bool, hazards: list[str]) -> str:
    """The status cell: ok, wrong outputs (it loads with a correctness hazard: `wrong_outputs`) or
    fails, and how many notes under the table are about the row beside its correctness hazards."""
    from wna16ctl.planning.inspection import CORRECTNESS, hazard_severity, wrong_outputs

    if not loadable:
        out = "[bold red]fails[/]"
    elif wrong_outputs(hazards):
        out = "[bold red]wrong outputs[/]"
    else:
        out = "[green]ok[/]"
    notes = sum(hazard_severity(h) != CORRECTNESS for h in hazards)
    return out + (f", [yellow]{plural(notes, 'note')}[/]" if notes else "")


def _hazard_note(text: str) -> str:
    from wna16ctl.planning.inspection import CORRECTNESS, hazard_severity

    return f"{CORRECTNESS_LABEL if hazard_severity(text) == CORRECTNESS else NOTE_LABEL} {escape(text)}"


def _proposal_line(console: Console, insp: Inspection) -> None:
    if insp.proposal is not None:
        console.print(f"  [bold]proposed[/] {escape(insp.proposal.origin)}: planned as the checkpoint llm-compressor "
                      "would write (nothing is quantized yet)")


def render_suggestions(console: Console, insp: Inspection, shown: int = 2) -> None:
    """`--suggest`: under the verdict, the nearest changes that load for each refused TP size
    (every one in --json), each wrapped under itself to the console's width."""
    if insp.suggestions is None:
        return
    from wna16ctl.planning.suggest import shown_suggestions

    by_tp: dict[int, list] = {}
    for s in insp.suggestions:
        by_tp.setdefault(s.for_tp, []).append(s)
    refused = [tp for i, tp in enumerate(insp.tps) if tp not in by_tp and not insp.tp_loads(i)]
    rows: list[tuple[str, str]] = []
    for tp, found in by_tp.items():
        listed = shown_suggestions(found, shown)
        for s in listed:
            how = escape(s.flags) + (f"; vLLM: {escape(s.vllm_flags)}" if s.vllm_flags else "")
            outcome = "[green]outputs right[/]" if s.kind == "load_format" else "re-planned, [green]loads[/]"
            rows.append((f"TP {tp}:", f"[cyan]suggest[/] {escape(s.change)} ({how}): {outcome}"))
        if len(found) > len(listed):
            more = len(found) - len(listed)
            rows.append((f"TP {tp}:", f"{more} more suggestion{'s' if more > 1 else ''} in --json"))
    for tp in refused:
        rows.append((f"TP {tp}:", "no change (or pair of changes) that was tried loads "
                                  f"({', '.join(KINDS_TRIED.values())})"))
    _notes_grid(console, rows)


def render_next_steps(console: Console, steps: list) -> None:
    """What to run next, per TP size: the layout, then the commands, broken between words with a
    trailing backslash where they are wider than the console (so they still paste as they are)."""
    if not steps:
        return
    import textwrap

    from wna16ctl.summary import shell_lines

    console.print("next steps:")
    for s in steps:
        what = f"{s.layout} layout" if s.layout else "the checkpoint as it is"
        head = f"TP {s.tp}{' EP' if s.ep else ''}:"
        for line in textwrap.wrap(f"{what}: {s.why}", max(console.width - len(head) - 3, 20)) or [""]:
            console.print(f"  {head} {line}", markup=False, highlight=False, soft_wrap=True)
            head = " " * len(head)
        for command in s.lines():
            for line in shell_lines(command, console.width, indent=4):
                console.print(f"    {line}", markup=False, soft_wrap=True, highlight=False)


def _span_of_ints(ids: list[int]) -> str:
    from wna16ctl.planning.moe import _ranges

    return _ranges(ids)


def render_repack_plan(console: Console, plan, out: str | None = None,  # a RepackPlan or VllmStatePlan (imported lazily)
                       memory: dict | None = None) -> None:
    """`repack --dry-run`: a RepackPlan, or the vllm layout's VllmStatePlan (`out`: named in its serve
    command); `memory`: the per-rank memory of what it would write (planning.fit.memory_lines)."""
    from wna16ctl.planning.fit import memory_lines
    from wna16ctl.planning.vllm_state import VllmStatePlan

    if isinstance(plan, VllmStatePlan):
        _render_vllm_plan(console, plan, out)
    else:
        _render_moe_plan(console, plan)
    for line in memory_lines(memory):
        console.print(line, markup=False, highlight=False)


def _render_moe_plan(console: Console, plan) -> None:
    s = plan.settings
    console.print(f"[bold]{escape(str(plan.checkpoint.root))}[/] → {plural(s.tp, 'rank')}"
                  f"{' (expert parallel)' if s.ep else ''}, layout {s.layout}, for vLLM {s.vllm} on {s.gpu}")
    table = simple_table("layers", ["layers", "layout", "quant type", "I/rank", "padded", "w2 scales", "k full"], console)
    rows: dict[tuple, list] = {}  # identical layers (Kimi-K2: 60 of them) share one row
    for j in plan.jobs:
        p = j.plan
        assert p.w2 is not None, "a layer job is made for a plan that loads, which has its w2 sharding"
        row = (j.layout, p.quant_type or "", str(p.intermediate_size_per_partition), str(j.specs[0].padded_intermediate),
               "full" if p.w2.load_full_w2 else "sharded", "yes" if p.w2.is_k_full else "no")
        rows.setdefault(row, []).append(j.layer)
    table.columns[0].overflow = "fold"
    for row, members in rows.items():
        table.add_row(escape(_layer_span([m.layer_index for m in members], [m.prefix for m in members])), *row)
    console.print(table)
    ranks = simple_table("output per rank", ["ranks", "files", "bytes"], console)
    per_rank = [(len(plan.files[r]), b) for r, b in enumerate(plan.rank_bytes())]
    by_value: dict[tuple[int, int], list[int]] = {}
    for r, v in enumerate(per_rank):
        by_value.setdefault(v, []).append(r)
    for (n_files, b), members in by_value.items():
        each = " each" if len(members) > 1 else ""
        table_ranks = _span_of_ints(members)
        ranks.add_row(table_ranks, f"{n_files}{each}", f"{human_bytes(b)}{each}")
    ranks.add_row("total", str(sum(n for n, _ in per_rank)), human_bytes(sum(b for _, b in per_rank)))
    console.print(ranks)
    console.print(f"{plural(len(plan.copied), 'non-expert tensor')} copied into every rank; "
                  f"fingerprint {plan.fingerprint[:16]}…")


_STATUS_MARKUP = {"pass": "[green]pass[/]", "FAIL": "[bold red]FAIL[/]", "not run": "[bold yellow]not run[/]"}


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def render_verify(console: Console, report) -> None:  # a VerifyReport, PadProof or ConversionProof (imported lazily)
    from wna16ctl.conversion.proof import ConversionProof
    from wna16ctl.padding.proof import PadProof

    if isinstance(report, (PadProof, ConversionProof)):  # a `pad` or `convert` output: its proof's own lines
        for line in report.lines() + next_step_lines(report.next_steps):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    if report.layout_state is not None:  # a --layout vllm output: its contract and round trip
        render_vllm_report(console, report.layout_state)
        return
    console.print(f"[bold]{escape(report.output)}[/] against [bold]{escape(report.checkpoint)}[/] "
                  f"({plural(report.samples, 'sample')}, tokens via {report.tokenizer or '—'}, device {report.device})")
    from rich.table import Table

    counts = {"manifest": plural(report.files_checked, "file") + " hashed",
              "round_trip": plural(report.experts_checked, "expert") + " checked on "
              + (f"ranks {', '.join(map(str, report.ranks_checked))}" if report.ranks_not_checked else "every rank")}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)  # check name, or the mark of a detail line
    grid.add_column(no_wrap=True)  # status
    grid.add_column(overflow="fold")  # what, wrapped under itself
    for c in report.checks:
        what = c.description + (f" ({counts[c.name]})" if c.name in counts and c.status != "not run" else "")
        grid.add_row(f"  {c.name.replace('_', ' ')}", _STATUS_MARKUP.get(c.status, c.status), escape(what))
        bad = report.by_check(c.name)
        if c.status == "not run" or (c.status == "FAIL" and not bad):
            grid.add_row("", "[yellow]→[/]", escape(c.reason))
        for f in bad[:10]:
            grid.add_row("", "[red]✗[/]", escape(f.message))
        if len(bad) > 10:
            grid.add_row("", "…", f"{len(bad) - 10} more (see --json)")
    console.print(grid)
    if report.numerics:
        # "exact": elements whose rounding interval is one value (the output must equal it);
        # "bound used": the largest error beyond the last rounding as a fraction of the derived
        # bound (at most 1 on a correct output, far below it in practice: docs/verify.md)
        table = simple_table("numerics per MoE layer (candidate vs fp32 dequantized reference)",
                             ["layer", "tokens", "experts", "max |err|", "rel L2", "cosine", "exact", "bound used",
                              "result"], console,
                             drop=("rel L2", "tokens", "cosine", "experts", "exact", "max |err|"))
        reasons: list[tuple[str, str]] = []  # under the table, wrapped under themselves: the result stays one word
        for n in report.numerics:
            result = _STATUS_MARKUP.get(n.status, n.status) + ("*" if n.reason else "")
            if n.reason:
                reasons.append((f"* {n.layer}:", escape(n.reason)))
            exact = "—" if n.exact_elements is None else str(n.exact_elements)
            table.add_row(escape(n.layer), f"{n.tokens} (+{n.forced_tokens} forced)" if n.forced_tokens else str(n.tokens),
                          f"{n.experts_exercised}/{n.num_experts}", _num(n.max_abs_error, ".3g"), _num(n.rel_l2_error, ".3g"),
                          _num(n.cosine, ".6f"), exact, _num(n.bound_used, ".2g"), result)
        table.columns[0].overflow = "fold"  # a layer name is the key of the row: wrap it, never cut it
        for col in table.columns[1:]:
            col.no_wrap = True
        console.print(table)
        _notes_grid(console, reasons)
        cov = report.numerics_coverage
        console.print(f"numerics covered {cov['layers']} of {plural(cov['layers_checked'], 'MoE layer')} checked, "
                      f"{cov['experts_exercised']} of {plural(cov['experts'], 'expert')}, "
                      f"{plural(cov['tokens'], 'token')}", markup=False, highlight=False)
    if report.e2e is not None:
        render_e2e(console, report.e2e)
    part = (f" (ranks {', '.join(map(str, report.ranks_checked))} only; ranks "
            f"{', '.join(map(str, report.ranks_not_checked))} not checked)" if report.ranks_not_checked else "")
    if report.layers_not_checked:
        part += (f" (partial: MoE {_plural_layers(report.layers_selected or [])} only; "
                 f"{_plural_layers(report.layers_not_checked)} not checked)")
    if report.experts_not_checked:
        part += (f" (partial: {_plural_indices('expert', report.experts_selected or [])} only; "
                 f"{_plural_indices('expert', report.experts_not_checked)} not checked)")
    good = "[bold yellow]verified in part[/]" if report.partial else "[bold green]verified[/]"
    if not report.numerics_asked:
        part += " (exactness only: numerics not run, --no-numerics)"
    console.print("verdict: " + (good if report.passed else "[bold red]NOT verified[/]") + part)
    for line in next_step_lines(report.next_steps):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _plural_layers(indices: list[int]) -> str:
    return _plural_indices("layer", indices)


def _plural_indices(noun: str, indices: list[int]) -> str:
    from wna16ctl.planning.moe import indices_text

    return indices_text(noun, indices)


def _engine_source(engine: Engine) -> str:
    if engine.source == "installed":
        return f"installed {engine.requested}" if engine.requested != engine.version else "installed"
    if engine.source == "default":
        return "no vllm installed: newest known"
    return "--vllm " + engine.requested


def _cell(p: LayerPlan) -> str:
    """A release matrix cell: the backend that loads the layer, the rule that refuses it, or "wrong
    outputs" where it loads but computes them wrong (the same verdict as the release's own table)."""
    from wna16ctl.planning.inspection import wrong_outputs

    if p.loadable and wrong_outputs(p.hazards):
        return f"[bold red]✗ {WRONG_CELL}[/]"
    if p.loadable:
        assert p.backend is not None, "a plan that loads has a backend"
        return f"[green]{p.backend.value}[/]"
    return f"[red]✗ {escape(p.failure_rule or 'fails')}[/]"


# the matrix cell of a layer that loads with a correctness hazard
WRONG_CELL = "wrong outputs"


def _legend_entry(legend: dict[str, str], p) -> None:  # a LayerPlan or LinearPlan
    """The legend under a matrix: the first text behind each ✗ cell (a refusal, or the correctness
    hazard behind a "wrong outputs" cell, with the backend that loads it)."""
    from wna16ctl.planning.inspection import CORRECTNESS, hazard_severity

    if not p.loadable and p.failure_rule and p.failure_rule not in legend:
        legend[p.failure_rule] = p.errors[0].splitlines()[0]
    elif p.loadable:
        for h in p.hazards:
            if hazard_severity(h) == CORRECTNESS and WRONG_CELL not in legend:
                backend = getattr(p, "backend", None)
                kernel = backend.value if backend is not None else (p.kernel or "").removesuffix("LinearKernel")
                legend[WRONG_CELL] = f"loads on {kernel}, but {h}"


def render_release_matrix(console: Console, insp: Inspection) -> None:
    """`--vllm all`: per group of identical layers, one row per release and one column per TP size;
    each cell is the backend that loads the layer, the first rule that refuses it, or "wrong outputs"."""
    from wna16ctl.planning.rules import RELEASES

    ck = insp.checkpoint
    cfg = ck.config
    arch = cfg.architectures[0] if cfg.architectures else cfg.model_type or "?"
    console.print(f"[bold]{escape(str(ck.root))}[/]")
    _proposal_line(console, insp)
    console.print(f"  {escape(arch)} · {len(ck.layers)} MoE layer{'s' if len(ck.layers) != 1 else ''} · "
                  f"CUDA {insp.gpu}{' · expert parallel' if insp.ep else ''}")
    groups: dict[str, list] = {}
    for lay in ck.layers:
        key = repr([[p.to_json() for p in insp.versions[v][lay.prefix]] for v in RELEASES])
        groups.setdefault(key, []).append(lay)
    legend: dict[str, str] = {}
    for members in groups.values():
        lay = members[0]
        span = _layer_span([m.layer_index for m in members], [m.prefix for m in members])
        scheme = lay.scheme.describe() if lay.scheme else "unquantized"
        # the title on a line of its own: a narrow table would wrap it to its own width
        console.print(f"{escape(span)} · {escape(scheme)}", soft_wrap=True)
        table = simple_table("", ["vLLM"] + [f"TP {t}{' EP' if insp.ep else ''}" for t in insp.tps], console)
        for v in RELEASES:
            plans = insp.versions[v][lay.prefix]
            table.add_row(v, *[_cell(p) for p in plans])
            for p in plans:
                _legend_entry(legend, p)
        console.print(table)
    _print_legend(console, legend)
    render_linear_matrix(console, insp)
    _release_verdicts(console, insp)
    console.print(f"summary (vLLM {insp.engine.version}): {escape(insp.summary()['text'])}")
    render_suggestions(console, insp)


def _print_legend(console: Console, legend: dict[str, str]) -> None:
    _notes_grid(console, [(f"✗ {rule}:", escape(text)) for rule, text in legend.items()])


def _release_verdicts(console: Console, insp: Inspection) -> None:
    """Under the matrices: the releases where every requested TP size loads with right outputs, and
    those where some TP size loads with wrong ones (`Inspection.outcomes`, as each release's table)."""
    from wna16ctl.planning.inspection import WRONG
    from wna16ctl.planning.rules import RELEASES, span as release_span

    console.print(f"loads at every requested TP size on: {release_span([v for v in RELEASES if insp.ok_in(v)])}")
    wrong = {v: [tp for tp, (o, _) in insp.outcomes(v).items() if o == WRONG] for v in RELEASES}
    wrong = {v: tps for v, tps in wrong.items() if tps}
    if wrong:
        tps = sorted({tp for found in wrong.values() for tp in found})
        console.print(f"[bold red]outputs would be wrong[/] on: {release_span(list(wrong))} at {_tp_list([str(t) for t in tps])} "
                      f"(✗ {WRONG_CELL} above)", soft_wrap=False)


def render_e2e(console: Console, res: E2EResult) -> None:
    status = {"pass": "[green]pass[/]", "FAIL": "[bold red]FAIL[/]"}.get(res.status, f"[yellow]{res.status}[/]")
    agree = f"{res.tokens_agreeing}/{res.tokens_generated} tokens agree" if res.prompts else ""
    console.print(f"  end to end  {status}  " + "; ".join(escape(x) for x in (agree, res.reason) if x))
    if not res.prompts:
        return
    console.print(f"      {escape(res.model)} on {res.device}, experts in {res.expert_dtype} through "
                  f"{escape(res.kernel)}, {escape(res.prompt_form)}, {res.max_new_tokens} new tokens, {res.seconds:.1f} s")
    if res.layers:
        table = simple_table("MoE block outputs against the rounding interval",
                             ["layer", "calls", "elements", "exact", "outside", "max err / bound", "experts routed",
                              "forced"], console, drop=("calls", "forced", "experts routed", "elements", "max err / bound"))
        for lay in res.layers:
            table.add_row(escape(lay.layer), str(lay.calls), str(lay.elements), str(lay.exact_elements),
                          "0" if not lay.violations else f"[bold red]{lay.violations}[/]", f"{lay.max_ratio:.3g}",
                          f"{len(lay.routed)}/{lay.num_experts}", str(len(lay.forced)))
        console.print(table)
    table = simple_table("greedy generation: source experts vs repacked experts",
                         ["prompt", "agree", "first diff", "top-2 margin", "bound", "max |Δlogit|", "result"], console,
                         drop=("max |Δlogit|", "bound", "top-2 margin"))
    for c in res.prompts:
        j = c.to_json()
        table.add_row(str(c.index), f"{c.agree_prefix}/{len(c.reference_tokens)}",
                      "—" if c.first_divergence is None else str(c.first_divergence),
                      "—" if c.reference_top2_margin is None else f"{c.reference_top2_margin:.3g}",
                      f"{c.bound[-1]:.3g}" if c.bound else "—", f"{j['max_abs_dlogit']:.3g}",
                      "[green]pass[/]" if c.first_divergence is None else
                      "[yellow]near-tie[/]" if c.near_tie else "[bold red]FAIL[/]")
    console.print(table)
    if res.score:
        s = res.score
        pct = lambda v: "—" if v is None else f"{v:.0%}"  # noqa: E731 - a share as a percentage, or a dash, for the lines below
        console.print(f"      GSM8K exact match: reference {pct(s['reference_exact_match'])}, candidate "
                      f"{pct(s['candidate_exact_match'])}; answers agree {pct(s['answers_agree'])} of "
                      f"{s['both_answered']} answered by both" + (f" ({escape(s['note'])})" if s["note"] else ""))


def render_model_section(console: Console, insp: Inspection) -> None:
    """The model around the experts: engine-level TP checks, quantized linear layers (layers with
    identical plans collapsed into one row group), MTP layers and modules that were not planned."""
    ck = insp.checkpoint
    _notes_grid(console, [(f"model TP {c.tp}:", f"{REFUSAL_LABEL if c.fatal else NOTE_LABEL} {escape(c.rule)}: "
                           + escape(c.error or c.detail)) for c in insp.checks if not c.ok])
    if ck.linear_layers:
        groups: dict[str, list] = {}
        for lay in ck.linear_layers:
            key = repr((lay.kind, lay.tp_role, lay.scheme, _unnamed(lay.name, insp.linear_plans[lay.name])))
            groups.setdefault(key, []).append(lay)
        table = simple_table("quantized linear layers per TP size",
                             ["layers", "layer", "role", "scheme", "TP", "K/rank", "N/rank", "kernel", "status"], console,
                             drop=("role", "K/rank", "N/rank", "scheme"))
        table.columns[-1].no_wrap = True  # the status stays on one line: columns are left out first
        notes: list[tuple[str, str, str]] = []
        for members in groups.values():
            lay = members[0]
            span = _layer_span([m.layer_index for m in members], [m.name for m in members])
            for i, p in enumerate(insp.linear_plans[lay.name]):
                status = _status(p.loadable, p.hazards)
                table.add_row(escape(span) if i == 0 else "", escape(lay.kind) if i == 0 else "",
                              lay.tp_role if i == 0 else "",
                              escape(lay.scheme.describe()) if (i == 0 and lay.scheme) else "",
                              str(p.tp), "—" if p.k is None else str(p.k), "—" if p.n is None else str(p.n),
                              escape(p.kernel.removesuffix("LinearKernel")) if p.kernel else "[red]none[/]", status)
                where = f"{span} {lay.kind}"
                for e in p.errors:
                    notes.append((where, f"TP {p.tp}", f"{REFUSAL_LABEL} {escape(e)}"))
                for h in p.hazards:
                    notes.append((where, f"TP {p.tp}", _hazard_note(h)))
                if not p.loadable or p.hazards:
                    # why each kernel ranked ahead of the chosen one passed (every reason is in --json)
                    for name, reason in p.rejected.items():
                        if reason.startswith("lower priority"):
                            break
                        notes.append((where, f"TP {p.tp}", f"{NOTE_LABEL} [dim]{name} rejected:[/] {escape(reason)}"))
        console.print(table)
        # per layer group: errors, hazards, rejected kernels, each with the TP sizes it applies to; a
        # note that more than two layer groups share is printed once (every plan keeps it in --json)
        groups_of: dict[str, set[str]] = {}
        for where, _tp, text in notes:
            groups_of.setdefault(text, set()).add(where)
        shared = {t for t, ws in groups_of.items() if len(ws) > 2}
        by_where: dict[str, dict[str, list[str]]] = {}
        for where, tp, text in notes:
            if text not in shared:
                tps = by_where.setdefault(where, {}).setdefault(text, [])
                if tp not in tps:
                    tps.append(tp)
        _notes_grid(console, [(f"{where} TP {','.join(t.removeprefix('TP ') for t in tps)}:", text)
                              for where, texts in by_where.items() for text, tps in texts.items()]
                    + [(f"{len(groups_of[text])} layer groups:", text) for text in groups_of if text in shared])
    for mtp in ck.mtp_layers:
        scheme = mtp.scheme.describe() if mtp.scheme else "unquantized"
        console.print(f"  MTP layer {escape(mtp.prefix)} ({mtp.num_experts} experts, {escape(scheme)}): not a decoder "
                      "layer; vLLM loads it only for MTP speculative decoding, and it is not part of this verdict")
    if ck.unplaced_linear:
        shown = ", ".join(ck.unplaced_linear[:5]) + (f" … ({len(ck.unplaced_linear)} in all)" if len(ck.unplaced_linear) > 5 else "")
        console.print(f"  [yellow]not planned[/]: quantized modules whose vLLM layer wna16ctl does not know: {escape(shown)}")


def render_linear_matrix(console: Console, insp: Inspection) -> None:
    """`--vllm all` for the quantized linear layers: per group of identical layers, the kernel each
    release picks at each TP size, or the first rule that refuses the layer; then the failing model checks."""
    from wna16ctl.planning.rules import RELEASES

    ck = insp.checkpoint
    groups: dict[str, list] = {}
    for lay in ck.linear_layers:
        key = repr((lay.kind, [_unnamed(lay.name, insp.linear_versions[v][lay.name]) for v in RELEASES]))
        groups.setdefault(key, []).append(lay)
    legend: dict[str, str] = {}
    for members in groups.values():
        lay = members[0]
        span = _layer_span([m.layer_index for m in members], [m.name for m in members])
        console.print(f"{escape(span)} · {escape(lay.kind)} ({lay.tp_role})", soft_wrap=True)
        table = simple_table("", ["vLLM"] + [f"TP {t}" for t in insp.tps], console)
        for v in RELEASES:
            plans = insp.linear_versions[v][lay.name]
            # a plan that loads names its kernel
            table.add_row(v, *[_linear_cell(p) for p in plans])
            for p in plans:
                _legend_entry(legend, p)
        console.print(table)
    _print_legend(console, legend)
    for c in insp.checks:
        if not c.ok:
            console.print(f"  model TP {c.tp}: [{'red' if c.fatal else 'yellow'}]{escape(c.rule)}[/]: {escape(c.error or c.detail)}")


def _linear_cell(p) -> str:  # a LinearPlan
    from wna16ctl.planning.inspection import wrong_outputs

    if p.loadable and wrong_outputs(p.hazards):
        return f"[bold red]✗ {WRONG_CELL}[/]"
    if p.loadable:
        return f"[green]{escape((p.kernel or '').removesuffix('LinearKernel'))}[/]"
    return f"[red]✗ {escape(p.failure_rule or 'fails')}[/]"


def _unnamed(name: str, plans: list) -> str:
    """The plans' JSON with the layer's own name blanked: layers whose plans differ only in the
    name the engine's texts quote are shown as one group."""
    import json

    return json.dumps([p.to_json() for p in plans]).replace(name, "<layer>")


# -- the vllm layout (whole-model sharded_state files) -----------------------------------------------

def _render_vllm_plan(console: Console, plan, out: str | None) -> None:  # a VllmStatePlan
    """`repack --layout vllm --dry-run`: per rank its keys, bytes and files, then the serve command."""
    data = plan.to_json(out)
    for r in data["ranks"]:
        console.print(f"rank {r['rank']}: {r['keys']} keys, {human_bytes(r['bytes'])} in {plural(len(r['files']), 'file')}")
    for line in vllm_backend_lines(plan):
        console.print(line, soft_wrap=True)
    console.print(f"then serve with: {data['serve']}", soft_wrap=True, markup=False)


def render_vllm_report(console: Console, report) -> None:  # a verification.vllm_state.VllmStateReport
    for line in report.problems:
        console.print(f"FAIL {line}")
    if report.ok:
        console.print(f"PASS {report.keys_checked} keys on {plural(report.tp, 'rank')} match vLLM {report.vllm}'s sharded_state "
                      f"contract; {report.tensors_round_tripped} tensors round-trip to the checkpoint bit for bit")
    if report.passed:
        for line in vllm_next_step_lines(report.serve):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
