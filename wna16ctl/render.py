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
    if report.e2e is not None:
        render_e2e(console, report.e2e)
    console.print("verdict: " + ("[bold green]verified[/]" if report.passed else "[bold red]NOT verified[/]"))


def render_e2e(console: Console, res) -> None:  # noqa: ANN001 - E2EResult, imported lazily
    status = {"pass": "[green]pass[/]", "FAIL": "[bold red]FAIL[/]"}.get(res.status, f"[yellow]{res.status}[/]")
    agree = f"{res.tokens_agreeing}/{res.tokens_generated} tokens agree" if res.prompts else ""
    console.print(f"  end to end  {status}  " + "; ".join(escape(x) for x in (agree, res.reason) if x))
    if not res.prompts:
        return
    console.print(f"      {escape(res.model)} on {res.device}, experts in {res.expert_dtype}, {escape(res.prompt_form)}, "
                  f"{res.max_new_tokens} new tokens, {res.seconds:.1f} s")
    table = simple_table("greedy generation: source experts vs repacked experts",
                         ["prompt", "agree", "first diff", "max |Δlogit|", "bound", "max KL", "result"])
    for c in res.prompts:
        j = c.to_json()
        table.add_row(str(c.index), f"{c.agree_prefix}/{len(c.reference_tokens)}",
                      "—" if c.first_divergence is None else str(c.first_divergence),
                      f"{j['max_abs_dlogit']:.3g}", f"{j['min_bound']:.3g}", f"{j['max_kl']:.3g}",
                      "[green]pass[/]" if c.passed else f"[bold red]FAIL[/] (step {c.worst_step})")
    console.print(table)
    if res.score:
        s = res.score
        console.print(f"      GSM8K exact match: reference {s['reference_exact_match']:.0%}, candidate "
                      f"{s['candidate_exact_match']:.0%}; answers agree {s['answers_agree']:.0%}")
