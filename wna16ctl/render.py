"""Human renderings of command results (the JSON forms come from the results' `to_json`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from wna16ctl.inspection import Inspection
from wna16ctl.output import human_bytes, simple_table


def _layer_span(indices: list[int | None], names: list[str]) -> str:
    nums = [i for i in indices if i is not None]
    if len(nums) != len(indices) or not nums:
        return ", ".join(names)
    from wna16ctl.plan import _ranges

    return f"layers {_ranges(sorted(nums))}"


def render_inspection(console: Console, insp: Inspection) -> None:
    ck = insp.checkpoint
    cfg = ck.config
    arch = cfg.architectures[0] if cfg.architectures else cfg.model_type or "?"
    layers = ck.layers
    total_packed = sum(lay.packed_bytes for lay in layers)
    schemes = sorted({lay.scheme.describe() for lay in layers if lay.scheme is not None})
    console.print(f"[bold]{escape(str(ck.root))}[/]")
    console.print(f"  rules of vLLM {insp.engine.version} ({_engine_source(insp.engine)}) on a CUDA {insp.gpu} GPU")
    console.print(
        f"  {escape(arch)} · hidden {cfg.hidden_size} · {len(layers)} MoE layers"
        + (f" · {layers[0].num_experts} experts × intermediate {layers[0].intermediate_size}" if layers else "")
    )
    qfmt = cfg.quant.format if cfg.quant else "none"
    qver = f" (compressed-tensors {cfg.quant.version})" if cfg.quant and cfg.quant.version else ""
    console.print(f"  format {escape(qfmt)}{escape(qver)} · schemes: {escape(', '.join(schemes) or 'none')}")
    console.print(f"  {len(ck.files)} tensors in {len(ck.files.shards)} shards ({human_bytes(ck.files.total_bytes)}); "
                  f"packed experts {human_bytes(total_packed)}")
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
        ["layers", "scheme", "TP", "I/rank", "backend", "w2 scales", "is_k_full", "bytes/rank", "status"],
    )
    notes: list[tuple[str, str, str]] = []
    for members in groups.values():
        lay = members[0]
        span = _layer_span([m.layer_index for m in members], [m.prefix for m in members])
        for i, p in enumerate(insp.plans[lay.prefix]):
            ip = str(p.intermediate_size_per_partition)
            if p.padded_intermediate and p.padded_intermediate != p.intermediate_size_per_partition:
                ip += f"→{p.padded_intermediate}"
            w2 = "—" if not p.quant_type else (
                f"full ({p.w2.w2_scales_size})" if p.w2.load_full_w2 else f"sharded ({p.w2.w2_scales_size})")
            status = "[green]ok[/]" if p.loadable else "[bold red]fails[/]"
            if p.hazards:
                status += f" [yellow]{len(p.hazards)} hazard{'s' if len(p.hazards) > 1 else ''}[/]"
            table.add_row(
                escape(span) if i == 0 else "",
                escape(lay.scheme.describe()) if (i == 0 and lay.scheme) else ("unquantized" if i == 0 else ""),
                f"{p.tp}{' EP' if p.ep else ''}",
                ip,
                p.backend.value if p.backend else "[red]none[/]",
                w2,
                "yes" if p.w2.is_k_full else "no",
                human_bytes(max(p.rank_bytes) * len(members)) if p.rank_bytes and max(p.rank_bytes) else "—",
                status,
            )
            for e in p.errors:
                notes.append((span, f"TP {p.tp}", f"[red]error[/] {escape(e)}"))
            for h in p.hazards:
                notes.append((span, f"TP {p.tp}", f"[yellow]hazard[/] {escape(h)}"))
            for name, reason in p.rejected.items():
                if not p.loadable and not reason.startswith("lower priority"):
                    notes.append((span, f"TP {p.tp}", f"[dim]{name} rejected:[/] {escape(reason)}"))
    console.print(table)
    seen: set[tuple[str, str]] = set()
    for span, tp, text in notes:
        if (span, text) in seen:
            continue
        seen.add((span, text))
        console.print(f"  {escape(span)} {tp}: {text}")
    render_model_section(console, insp)
    verdict = "[bold green]loads[/] at every requested TP size" if insp.loadable else "[bold red]does not load[/] everywhere (see above)"
    console.print(f"verdict: {verdict}")


def render_repack_plan(console: Console, plan) -> None:  # noqa: ANN001 - RepackPlan, imported lazily
    s = plan.settings
    console.print(f"[bold]{escape(str(plan.checkpoint.root))}[/] → {s.tp} rank{'s' if s.tp > 1 else ''}"
                  f"{' (expert parallel)' if s.ep else ''}, layout {s.layout}")
    table = simple_table("layers", ["layer", "layout", "quant type", "I/rank", "padded", "w2 scales", "is_k_full"])
    for j in plan.jobs:
        p = j.plan
        table.add_row(escape(j.layer.prefix), j.layout, p.quant_type or "", str(p.intermediate_size_per_partition),
                      str(j.specs[0].padded_intermediate), "full" if p.w2.load_full_w2 else "sharded",
                      "yes" if p.w2.is_k_full else "no")
    console.print(table)
    ranks = simple_table("output per rank", ["rank", "files", "bytes"])
    for r, b in enumerate(plan.rank_bytes()):
        ranks.add_row(str(r), str(len(plan.files[r])), human_bytes(b))
    console.print(ranks)
    console.print(f"{len(plan.copied)} non-expert tensors copied into every rank; fingerprint {plan.fingerprint[:16]}…")


def render_repack_result(console: Console, plan, result) -> None:  # noqa: ANN001
    console.print(
        f"wrote [bold]{escape(str(result.out))}[/]: {result.files_written} files written"
        + (f", {result.files_reused} reused" if result.files_reused else "")
        + f", {human_bytes(sum(plan.rank_bytes()))} in {plan.settings.tp} rank director{'ies' if plan.settings.tp > 1 else 'y'}"
    )
    console.print(f"manifest: {escape(str(result.out / 'wna16ctl.json'))}")


def _numerics_failure(n) -> str:  # noqa: ANN001 - LayerNumerics
    why = []
    if n.violations:
        why.append(f"{n.violations} elements over bound")
    if n.rel_l2_error > n.rel_l2_limit:
        why.append(f"rel L2 > {n.rel_l2_limit:.3g}")
    if n.experts_exercised < n.num_experts:
        why.append(f"{n.num_experts - n.experts_exercised} experts not exercised")
    return ", ".join(why) or "see --json"


def render_verify(console: Console, report) -> None:  # noqa: ANN001 - VerifyReport, imported lazily
    console.print(f"[bold]{escape(report.output)}[/] against [bold]{escape(report.checkpoint)}[/] "
                  f"({report.samples} samples, tokens via {report.tokenizer or '—'}, device {report.device})")
    checks = [
        ("manifest", f"fingerprint, {report.files_checked} file hashes, settings and plan"),
        ("round_trip", f"{report.experts_checked} experts × ranks, bit-exact"),
    ]
    for key, what in checks:
        bad = report.by_check(key)
        status = "[green]pass[/]" if not bad else f"[bold red]FAIL[/] ({len(bad)})"
        console.print(f"  {key.replace('_', ' '):<11} {status}  {what}")
        for f in bad[:10]:
            console.print(f"      [red]✗[/] {escape(f.message)}")
        if len(bad) > 10:
            console.print(f"      … {len(bad) - 10} more (see --json)")
    if report.numerics:
        table = simple_table("numerics per MoE layer (candidate vs fp32 dequantized reference)",
                             ["layer", "tokens", "experts", "max |err|", "rel L2", "cosine", "err/bound", "result"])
        for n in report.numerics:
            table.add_row(escape(n.layer), f"{n.tokens} (+{n.forced_tokens} forced)" if n.forced_tokens else str(n.tokens),
                          f"{n.experts_exercised}/{n.num_experts}", f"{n.max_abs_error:.3g}", f"{n.rel_l2_error:.3g}",
                          f"{n.cosine:.6f}", f"{n.max_error_over_bound:.3f}",
                          "[green]pass[/]" if n.passed else f"[bold red]FAIL[/] ({_numerics_failure(n)})")
        console.print(table)
    console.print("verdict: " + ("[bold green]verified[/]" if report.passed else "[bold red]NOT verified[/]"))


def _engine_source(engine) -> str:  # noqa: ANN001 - rules.Engine
    if engine.source == "installed":
        return f"installed {engine.requested}" if engine.requested != engine.version else "installed"
    if engine.source == "default":
        return "no vllm installed: newest known"
    return "--vllm " + engine.requested


def _cell(p) -> str:  # noqa: ANN001 - LayerPlan
    if p.loadable:
        return f"[green]{p.backend.value}[/]"
    return f"[red]✗ {escape(p.failure_rule or 'fails')}[/]"


def render_release_matrix(console: Console, insp: Inspection) -> None:
    """`--vllm all`: per group of identical layers, one row per release and one column per TP size;
    each cell is the backend that loads the layer or the first rule that refuses it."""
    from wna16ctl.rules import RELEASES

    ck = insp.checkpoint
    cfg = ck.config
    arch = cfg.architectures[0] if cfg.architectures else cfg.model_type or "?"
    console.print(f"[bold]{escape(str(ck.root))}[/]")
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
        table = simple_table(f"{span} · {scheme}", ["vLLM"] + [f"TP {t}{' EP' if insp.ep else ''}" for t in insp.tps])
        for v in RELEASES:
            plans = insp.versions[v][lay.prefix]
            table.add_row(v, *[_cell(p) for p in plans])
            for p in plans:
                if not p.loadable and p.failure_rule and p.failure_rule not in legend:
                    legend[p.failure_rule] = p.errors[0]
        console.print(table)
    for rule, text in legend.items():
        console.print(f"  [red]✗ {escape(rule)}[/]: {escape(text)}")
    render_linear_matrix(console, insp)
    ok = [v for v in RELEASES if insp.loadable_in(v)]
    from wna16ctl.rules import span as release_span

    console.print(f"loads at every requested TP size on: {release_span(ok)}")


def render_model_section(console: Console, insp: Inspection) -> None:
    """The model around the experts: engine-level TP checks, quantized linear layers (layers with
    identical plans collapsed into one row group), MTP layers and modules that were not planned."""
    ck = insp.checkpoint
    bad = [c for c in insp.checks if not c.ok]
    for c in bad:
        colour = "red" if c.fatal else "yellow"
        console.print(f"  model TP {c.tp}: [{colour}]{'error' if c.fatal else 'note'}[/] {escape(c.rule)}: "
                      f"{escape(c.error or c.detail)}")
    if ck.linear_layers:
        groups: dict[str, list] = {}
        for lay in ck.linear_layers:
            key = repr((lay.kind, lay.tp_role, lay.scheme, _unnamed(lay.name, insp.linear_plans[lay.name])))
            groups.setdefault(key, []).append(lay)
        table = simple_table("quantized linear layers per TP size",
                             ["layers", "layer", "role", "scheme", "TP", "K/rank", "N/rank", "kernel", "status"])
        notes: list[tuple[str, str, str]] = []
        for members in groups.values():
            lay = members[0]
            span = _layer_span([m.layer_index for m in members], [m.name for m in members])
            for i, p in enumerate(insp.linear_plans[lay.name]):
                status = "[green]ok[/]" if p.loadable else "[bold red]fails[/]"
                if p.hazards:
                    status += f" [yellow]{len(p.hazards)} hazard{'s' if len(p.hazards) > 1 else ''}[/]"
                table.add_row(escape(span) if i == 0 else "", escape(lay.kind) if i == 0 else "",
                              lay.tp_role if i == 0 else "",
                              escape(lay.scheme.describe()) if (i == 0 and lay.scheme) else "",
                              str(p.tp), "—" if p.k is None else str(p.k), "—" if p.n is None else str(p.n),
                              escape(p.kernel.removesuffix("LinearKernel")) if p.kernel else "[red]none[/]", status)
                where = f"{span} {lay.kind}"
                for e in p.errors:
                    notes.append((where, f"TP {p.tp}", f"[red]error[/] {escape(e)}"))
                for h in p.hazards:
                    notes.append((where, f"TP {p.tp}", f"[yellow]hazard[/] {escape(h)}"))
                if not p.loadable or p.hazards:
                    # why each kernel ranked ahead of the chosen one passed (every reason is in --json)
                    for name, reason in p.rejected.items():
                        if reason.startswith("lower priority"):
                            break
                        notes.append((where, f"TP {p.tp}", f"[dim]{name} rejected:[/] {escape(reason)}"))
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
        for where, texts in by_where.items():
            for text, tps in texts.items():
                console.print(f"  {escape(where)} TP {','.join(t.removeprefix('TP ') for t in tps)}: {text}")
        for text in (t for t in groups_of if t in shared):
            console.print(f"  {len(groups_of[text])} layer groups: {text}")
    for lay in ck.mtp_layers:
        scheme = lay.scheme.describe() if lay.scheme else "unquantized"
        console.print(f"  MTP layer {escape(lay.prefix)} ({lay.num_experts} experts, {escape(scheme)}): not a decoder "
                      "layer; vLLM loads it only for MTP speculative decoding, and it is not part of this verdict")
    if ck.unplaced_linear:
        shown = ", ".join(ck.unplaced_linear[:5]) + (f" … ({len(ck.unplaced_linear)} in all)" if len(ck.unplaced_linear) > 5 else "")
        console.print(f"  [yellow]not planned[/]: quantized modules whose vLLM layer wna16ctl does not know: {escape(shown)}")


def render_linear_matrix(console: Console, insp: Inspection) -> None:
    """`--vllm all` for the quantized linear layers: per group of identical layers, the kernel each
    release picks at each TP size, or the first rule that refuses the layer; then the failing model checks."""
    from wna16ctl.rules import RELEASES

    ck = insp.checkpoint
    groups: dict[str, list] = {}
    for lay in ck.linear_layers:
        key = repr((lay.kind, [_unnamed(lay.name, insp.linear_versions[v][lay.name]) for v in RELEASES]))
        groups.setdefault(key, []).append(lay)
    legend: dict[str, str] = {}
    for members in groups.values():
        lay = members[0]
        span = _layer_span([m.layer_index for m in members], [m.name for m in members])
        table = simple_table(f"{span} · {lay.kind} ({lay.tp_role})", ["vLLM"] + [f"TP {t}" for t in insp.tps])
        for v in RELEASES:
            plans = insp.linear_versions[v][lay.name]
            table.add_row(v, *[f"[green]{escape(p.kernel.removesuffix('LinearKernel'))}[/]" if p.loadable
                               else f"[red]✗ {escape(p.failure_rule or 'fails')}[/]" for p in plans])
            for p in plans:
                if not p.loadable and p.failure_rule and p.failure_rule not in legend:
                    legend[p.failure_rule] = p.errors[0].splitlines()[0]
        console.print(table)
    for rule, text in legend.items():
        console.print(f"  [red]✗ {escape(rule)}[/]: {escape(text)}")
    for c in insp.checks:
        if not c.ok:
            console.print(f"  model TP {c.tp}: [{'red' if c.fatal else 'yellow'}]{escape(c.rule)}[/]: {escape(c.error or c.detail)}")


def _unnamed(name: str, plans: list) -> str:
    """The plans' JSON with the layer's own name blanked: layers whose plans differ only in the
    name the engine's texts quote are shown as one group."""
    import json

    return json.dumps([p.to_json() for p in plans]).replace(name, "<layer>")
