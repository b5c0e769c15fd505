"""`verify ORIGINAL PADDED`: proof that a padded checkpoint is the original plus exact zeros.

1. Tensors: the padded checkpoint holds the original's tensors and no others; a tensor of a module
   that was not padded is byte for byte the original; a padded projection holds every original
   code, scale, zero point and g_idx entry where it was, and every added one is the zero code (an
   added zero point too), a finite scale, or (act-order) the g_idx of a whole new group after the
   last; `weight_shape` says the padded size; unquantized weights gain exact zeros.  Every file the
   manifest lists has its recorded digest, computed from the bytes this proof reads (each padded
   file read once, in file order; what the proof skips is read for the digest alone); the tensors
   are compared on every core.
2. Numerics, per routed MoE layer: the padded layer split over the TP ranks it was padded for and
   the original at TP 1 get the same activations in the model dtype and routing (verify's own:
   GSM8K questions embedded, normalised and routed by the layer's router, every expert exercised;
   seeded random activations where there are no questions or no router to use); each is computed as an engine computes it (fp32 accumulation, the
   model dtype between stages, per-rank partials all-reduced in fp32) and must lie in its own
   derived rounding interval (`verification.bounds`); the two intervals share their float64
   centre, since the added products are exact zeros, so the two outputs differ by at most the two
   intervals' half-widths, which is checked too.  A layer whose original output is all zero (all-zero
   weights, as a zero-filled shard gives) is `not run`, by the rule repack's verify follows
   (`verification.bounds.nothing_to_compare`), and the proof does not pass.
3. With e2e (`verify ORIGINAL PADDED --e2e`): greedy generation on GSM8K prompts with the original at
   TP 1 and the padded model computed as its TP ranks compute it, every padded MoE block output
   judged against the interval of the original's experts extended by exact zeros
   (`verification.e2e.run_padding_e2e`); a required check once asked for.

`--layers` / `--experts` check only those routed layers' (experts') tensors and numerics, as for a
repack output: a partial proof, said so, with no serve step; e2e then does not run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from wna16ctl.errors import BadInput
from wna16ctl.layout.packing import unpack_codes
from wna16ctl.padding.tensors import zero_code, zero_word
from wna16ctl.padding.write import LAYOUT
from wna16ctl.sources import Checkpoint, formats, open_checkpoint
from wna16ctl.sources.tensors import as_tensor
from wna16ctl.sources.formats import CANONICAL, CODES, WEIGHT, G_IDX, SCALES, SHAPE, ZERO_POINTS

_ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
TOKENS = 32  # activations per layer in the numerics check


@dataclass
class PadProof:
    original: Path
    padded: Path
    tp: int | None
    problems: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    tensors_padded: int = 0
    layers: list[dict[str, Any]] = field(default_factory=list)  # numerics per routed layer
    activations: str = ""  # where the numerics' activations came from
    e2e: Any = None  # wna16ctl.verification.e2e.E2EResult when e2e was asked
    # `--layers` / `--experts`: the routed layers and experts checked, and those left out (a partial proof)
    layers_selected: list[int] | None = None
    layers_not_checked: list[int] = field(default_factory=list)
    experts_selected: list[int] | None = None
    padding: dict[str, Any] | None = None  # the padded manifest's plan (TP, EP, release, GPU): how it is served
    experts_not_checked: list[int] = field(default_factory=list)
    numerics_asked: bool = True  # False: `verify --no-numerics`, the tensor proof alone

    @property
    def partial(self) -> bool:
        """Some routed layers or experts were left out: what ran may pass, the padding is not proved whole."""
        return bool(self.layers_not_checked or self.experts_not_checked)

    def left_out(self) -> list[str]:
        """What the subset left out, as every verify says it."""
        from wna16ctl.verification.checks import left_out_reason

        out = []
        if self.layers_not_checked and self.layers_selected is not None:
            out.append(left_out_reason("--layers", self.layers_selected, "layer", self.layers_not_checked))
        if self.experts_not_checked and self.experts_selected is not None:
            out.append(left_out_reason("--experts", self.experts_selected, "expert", self.experts_not_checked))
        return out

    @property
    def passed(self) -> bool:
        """Every check passed, the e2e one too when it was asked (not run is not a pass)."""
        return (not self.problems and bool(self.tensors_checked) and all(lay["ok"] for lay in self.layers)
                and (self.e2e is None or self.e2e.passed))

    @property
    def next_steps(self) -> list[Any]:
        """How to serve the padded checkpoint: only once it is proved whole."""
        from wna16ctl.planning.next_steps import NextStep, serve_command

        if not self.passed or self.partial or not self.tp:
            return []
        if self.padding and all(self.padding.get(k) is not None for k in ("vllm", "gpu")):
            from wna16ctl.planning.padding import padded_serve_path

            step = padded_serve_path(str(self.padded), self.padding, "auto")
            if step is not None:
                return [step]
        return [NextStep(self.tp, False, None, None, serve_command(self.padded, None, self.tp),
                         "serve the padded checkpoint as it is (stock vLLM, the default load format)")]

    def to_json(self) -> dict[str, Any]:
        return {"original": str(self.original), "padded": str(self.padded), "layout": LAYOUT, "tp": self.tp,
                "passed": self.passed, "tensors_checked": self.tensors_checked,
                "tensors_padded": self.tensors_padded, "activations": self.activations, "numerics": self.layers,
                "numerics_asked": self.numerics_asked,
                "e2e": self.e2e.to_json() if self.e2e is not None else None, "partial": self.partial,
                "layers_selected": self.layers_selected, "layers_not_checked": self.layers_not_checked,
                "experts_selected": self.experts_selected, "experts_not_checked": self.experts_not_checked,
                "not_checked": self.left_out(),
                "next_steps": [s.to_json() for s in self.next_steps], "problems": self.problems}

    def lines(self) -> list[str]:
        out = [f"FAIL {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            out.append(f"... and {len(self.problems) - 20} more")
        out.append(f"{'PASS' if not self.problems else 'FAIL'} tensors: {self.tensors_checked} checked, "
                   f"{self.tensors_padded} padded (originals unchanged, additions the zero code)")
        if self.layers:
            out.append(f"numerics on {self.activations}")
        for lay in self.layers:
            if lay["status"] == "not run":  # nothing to compare (verification.bounds.nothing_to_compare)
                out.append(f"NOT RUN numerics {lay['layer']}: {lay['reason']}")
                continue
            out.append(f"{'PASS' if lay['ok'] else 'FAIL'} numerics {lay['layer']}: padded at TP {lay['tp']} vs original "
                       f"at TP 1 on {lay['tokens']} tokens, max |difference| {lay['max_abs_difference']:.3g}; "
                       f"{lay['violations']} outputs outside the rounding interval (largest error/bound "
                       f"{lay['max_ratio']:.3g})")
        if not self.numerics_asked:
            from wna16ctl.verification.checks import NO_NUMERICS

            out.append(f"NOT RUN numerics: {NO_NUMERICS}")
        elif not self.layers and not self.problems:
            out.append("numerics not run: no padded quantized MoE layer to compare")
        if self.e2e is not None:
            out += _e2e_lines(self.e2e)
        out += [f"PARTIAL {why}" for why in self.left_out()]  # never read as a whole proof
        return out  # the next steps are the renderer's (render.render_verify)


def _e2e_lines(res: Any) -> list[str]:
    """The e2e result as the proof's lines: the verdict, the block outputs per layer, each prompt."""
    head = {"pass": "PASS", "FAIL": "FAIL"}.get(res.status, "NOT RUN")
    agree = f"{res.tokens_agreeing}/{res.tokens_generated} tokens agree" if res.prompts else ""
    out = [f"{head} e2e: " + "; ".join(x for x in (agree, res.reason) if x)]
    if not res.prompts:
        return out
    out.append(f"  {res.model} on {res.device}, {res.kernel}, {res.prompt_form}, {res.max_new_tokens} new tokens, "
               f"{res.seconds:.1f} s")
    for lay in res.layers:
        out.append(f"  {lay.layer}: {lay.calls} block calls, {lay.elements} outputs, {lay.violations} outside the "
                   f"interval of the original extended by zeros (largest error/bound {lay.max_ratio:.3g}); experts "
                   f"routed {len(lay.routed)}/{lay.num_experts}, forced {len(lay.forced)}")
    for c in res.prompts:
        verdict = "pass" if c.first_divergence is None else "near-tie" if c.near_tie else "FAIL"
        where = "" if c.first_divergence is None else (f", first difference at step {c.first_divergence} (top-2 margin "
                                                       f"{c.reference_top2_margin:.3g}, bound {c.bound[-1]:.3g})")
        out.append(f"  prompt {c.index}: {c.agree_prefix}/{len(c.reference_tokens)} tokens agree{where}; max "
                   f"|dlogit| {max(c.max_abs_dlogit, default=0.0):.3g} {verdict}")
    return out


def is_padded_output(path: str | os.PathLike[str]) -> bool:
    from wna16ctl.output.outdir import MANIFEST_NAME, read_json_file

    m = read_json_file(Path(path) / MANIFEST_NAME)
    return isinstance(m, dict) and m.get("layout") == LAYOUT


def verify_padding(original: str | os.PathLike[str], padded: str | os.PathLike[str], numerics: bool = True,
                   samples: str | os.PathLike[str] | None = None, num_samples: int = 16, e2e: Any = None,
                   notice: Any = None, layers: Any = None, experts: Any = None) -> PadProof:
    """The proof (module doc); `e2e` (verification.e2e.E2EOptions) adds the generation check.
    `layers` / `experts` ("0-3,7" or indices, as for a repack output) check only those routed MoE
    layers and experts, tensors and numerics: a partial proof, said so, with no serve step and no e2e."""
    from wna16ctl.output.outdir import MANIFEST_NAME, read_json_file
    from wna16ctl.sources import source_fingerprint

    a, b = open_checkpoint(original), open_checkpoint(padded)
    selected = _select(a, layers, experts)
    if e2e is not None:  # the inputs in the order a user fixes them: the samples before any work
        from wna16ctl.sources.tensors import dtype_from_name
        from wna16ctl.verification.e2e import require_e2e_memory, require_transformers
        from wna16ctl.verification.samples import resolve_samples

        require_transformers()
        require_e2e_memory(b, dtype_from_name(a.config.torch_dtype or "bfloat16"), copies=2)
        e2e_samples = Path(resolve_samples(samples, a.root, notice))
    manifest = read_json_file(Path(padded) / MANIFEST_NAME)
    tp = manifest.get("padding", {}).get("tp") if isinstance(manifest, dict) else None
    proof = PadProof(Path(original), Path(padded), tp, numerics_asked=numerics, **selected)
    proof.padding = manifest.get("padding") if isinstance(manifest, dict) else None
    if manifest.get("identity", {}).get("source_fingerprint") != source_fingerprint(a):
        proof.problems.append(f"{padded}: its manifest names another source than {original} (or the original changed "
                              "since it was padded)")
    digests = _file_digests(Path(padded), manifest.get("files") or {})
    from wna16ctl.verification.checks import torch_threads

    with torch_threads(None):  # byte comparisons on every core, as verify's round trip
        _check_tensors(a, b, proof, {os.path.realpath(d.path): d for d, _ in digests.values() if d is not None})
    proof.problems[:0] = _digest_problems(Path(padded), digests)  # the files' check first, as it reads
    if numerics and not proof.problems:
        _check_numerics(a, b, proof, samples, num_samples)
    if e2e is not None:  # also on a damaged padding: how far the damage moves the model is reported too
        from wna16ctl.verification.checks import e2e_subset_reason
        from wna16ctl.verification.e2e import not_run, run_padding_e2e

        why = e2e_subset_reason(proof.layers_not_checked, proof.experts_not_checked)
        proof.e2e = not_run(why) if why else run_padding_e2e(a, b, tp or 1, e2e_samples, e2e)
    return proof


def _select(a: Checkpoint, layers: Any, experts: Any) -> dict[str, Any]:
    """The PadProof fields of a `--layers` / `--experts` subset of the routed MoE layers, read as a
    repack output's verify reads them (the same parsing, the same one-line refusals)."""
    from wna16ctl.verification.checks import experts_left_out, parse_indices, unknown_layers

    out: dict[str, Any] = {}
    routed = a.quantized_layers
    if layers is not None:
        wanted = parse_indices(layers, "--layers", "MoE layer")
        known = [lay.layer_index for lay in routed if lay.layer_index is not None]
        unknown_layers(known, wanted)
        out |= {"layers_selected": wanted, "layers_not_checked": sorted(i for i in known if i not in wanted)}
        routed = [lay for lay in routed if lay.layer_index in wanted]
    if experts is not None:
        wanted = parse_indices(experts, "--experts", "expert")
        out |= {"experts_not_checked": experts_left_out(routed, wanted), "experts_selected": wanted}
    return out


def _left_out_tensors(a: Checkpoint, proof: PadProof, names: set[str]) -> set[str]:
    """The tensors of the routed experts a subset leaves out (`{layer prefix}.{expert}.{projection}.{suffix}`)."""
    if not proof.partial:
        return set()
    layers = {lay.prefix: lay for lay in a.quantized_layers}
    out = set()
    for name in names:
        prefix, expert, _, _ = (name.rsplit(".", 3) + ["", "", ""])[:4]
        lay = layers.get(prefix)
        if lay is None or not expert.isdigit():
            continue
        if proof.layers_selected is not None and lay.layer_index not in proof.layers_selected \
                or proof.experts_selected is not None and int(expert) not in proof.experts_selected:
            out.add(name)
    return out


# -- tensors ---------------------------------------------------------------------------------------------

def _bits(ck: Checkpoint, module: str) -> int:
    quant = ck.config.quant
    s = quant.schemes_for([module])[0] if quant is not None else None
    if s is None:
        raise BadInput(f"{ck.root}: {module} is packed but no config group targets it")
    return s.num_bits


def _file_digests(padded: Path, files: dict[str, Any]) -> dict[str, tuple[Any, str | None]]:
    """rel -> (its digest, fed by the tensor proof's reads: `writer.InOrderDigest`, or None where
    the file is missing; the digest the manifest records, None where it records none)."""
    from wna16ctl.output.writer import InOrderDigest, recorded_hash

    out: dict[str, tuple[Any, str | None]] = {}
    for rel, meta in files.items():
        rec = recorded_hash(meta)
        path = padded / rel
        out[rel] = (InOrderDigest(path, rec[0]) if rec is not None and path.is_file() else None,
                    None if rec is None else rec[1])
    return out


def _digest_problems(padded: Path, digests: dict[str, tuple[Any, str | None]]) -> list[str]:
    """Each manifest file whose digest differs from the recorded one (or that is missing)."""
    out = []
    for rel, (digest, want) in digests.items():
        try:
            same = digest is not None and want is not None and digest.hexdigest() == want
        except OSError:
            same = False
        if not same:
            out.append(f"{padded / rel}: missing or changed since it was written (its digest differs)")
    return out


class _Reads:
    """One check's reads: the original's tensors, and the padded one's, whose bytes are kept to
    feed their file's digest (in file order, by `_run_checks`)."""

    def __init__(self, ra: Any, rb: Any):
        self.ra, self.rb = ra, rb
        self.fed: list[tuple[Any, torch.Tensor]] = []  # (TensorInfo, bytes) of the padded tensors read

    def a_bytes(self, name: str) -> torch.Tensor:
        return self.ra.read_bytes(self.ra.files.info(name))

    def b_bytes(self, name: str) -> torch.Tensor:
        info = self.rb.files.info(name)
        raw = self.rb.read_bytes(info)
        self.fed.append((info, raw))
        return raw

    def a(self, name: str) -> torch.Tensor:
        info = self.ra.files.info(name)
        return as_tensor(self.a_bytes(name), info.dtype, info.shape)

    def b(self, name: str) -> torch.Tensor:
        info = self.rb.files.info(name)
        return as_tensor(self.b_bytes(name), info.dtype, info.shape)


# a check of the tensor proof: (the padded tensors it reads, what it finds from its reads)
_Item = tuple[list[str], Callable[[_Reads], list[str]]]


def _check_tensors(a: Checkpoint, b: Checkpoint, proof: PadProof, digests: dict[str, Any] | None = None) -> None:
    """The tensor proof (module doc, 1.).  `digests`: real path -> `writer.InOrderDigest` of the
    padded files, fed the bytes the proof reads, so that each file is read once."""
    names_a, names_b = set(a.files.names()), set(b.files.names())
    for n in sorted(names_a - names_b)[:5]:
        proof.problems.append(f"{b.root}: tensor {n} of the original is missing")
    for n in sorted(names_b - names_a)[:5]:
        proof.problems.append(f"{b.root}: tensor {n} is not in the original")
    stored = formats.of(a.config.quant).names
    grown = _grown_modules(a, b, names_a & names_b)
    left_out = _left_out_tensors(a, proof, names_a & names_b)
    apart = _stored_apart(a, grown)
    projections: dict[str, list[str]] = {}  # a grown module stored apart -> its tensors
    items: list[_Item] = []
    for name in sorted(names_a & names_b - left_out):
        module, _, suffix = name.rpartition(".")
        if module in apart and stored.role_of(suffix) in CANONICAL and module.rpartition(".")[2] in _ROLE \
                and a.files.info(name).dtype == b.files.info(name).dtype:
            projections.setdefault(module, []).append(name)
            continue
        items.append(_tensor_item(a, b, proof, grown, name))
    for module, names in projections.items():
        proof.tensors_checked += len(names)
        proof.tensors_padded += sum(a.files.info(n).shape != b.files.info(n).shape for n in names)
        items.append((names, _projection_item(a, module, apart[module], names)))
    proof.problems += _run_checks(a, b, items, digests or {})


def _projection_item(a: Checkpoint, module: str, scheme: Any, names: list[str]) -> Callable[[_Reads], list[str]]:
    """The check of a padded projection stored apart (`_projection_problems`) on a check's reads."""
    return lambda r: _projection_problems(a, module, scheme, names, r.a, r.b)


def _tensor_item(a: Checkpoint, b: Checkpoint, proof: PadProof, grown: set[str], name: str) -> _Item:
    """The check of one tensor not stored apart, counted in `proof`."""
    stored = formats.of(a.config.quant).names
    ia, ib = a.files.info(name), b.files.info(name)
    proof.tensors_checked += 1
    module, _, suffix = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if ia.dtype != ib.dtype:
        return [], lambda r: [f"{name}: dtype {ib.dtype}, the original's is {ia.dtype}"]
    # a module that did not grow is the original byte for byte, its weight_shape too (the
    # attention of a checkpoint quantized with every Linear); only a grown one says a new size
    if ia.shape == ib.shape and (stored.role_of(suffix) != SHAPE or module not in grown):
        return [name], lambda r: [] if torch.equal(r.a_bytes(name), r.b_bytes(name)) else [f"{name}: differs from the original"]
    if leaf not in _ROLE:
        return [], lambda r: [f"{name}: shape {list(ib.shape)} differs from the original's {list(ia.shape)}, "
                              "and it is not an MLP projection"]
    proof.tensors_padded += ia.shape != ib.shape

    def check(r: _Reads) -> list[str]:
        why = _padded_tensor_problem(a, b, module, _ROLE[leaf], suffix, r.a(name), r.b(name))
        return [f"{name}: {why}"] if why else []
    return [name], check


def _run_checks(a: Checkpoint, b: Checkpoint, items: list[_Item], digests: dict[str, Any]) -> list[str]:
    """The checks on every core, each reading its own tensors (positioned reads and torch's
    comparisons release the GIL), taken in the padded files' order so that the bytes read feed each
    file's digest in order, a few checks ahead at most; the problems in the order of `items`, as
    one thread gives them."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from wna16ctl.native.emulated import usable_cores
    from wna16ctl.sources.tensors import TensorReader, writable_view

    def where(i: int) -> tuple[str, int]:
        infos = [b.files.info(n) for n in items[i][0]]
        first = min(infos, key=lambda info: (str(info.file), info.start), default=None)
        return ("", 0) if first is None else (str(first.file), first.start)

    def run(i: int) -> tuple[int, list[str], _Reads]:
        reads = _Reads(ra, rb)
        return i, items[i][1](reads), reads

    found: list[list[str]] = [[] for _ in items]
    workers = min(usable_cores(), max(1, len(items)))
    with TensorReader(a.files) as ra, TensorReader(b.files) as rb, ThreadPoolExecutor(workers) as pool:
        window: deque[Any] = deque()

        def merge() -> None:
            i, problems, reads = window.popleft().result()
            found[i] = problems
            for info, raw in sorted(reads.fed, key=lambda x: x[0].start):
                digest = digests.get(os.path.realpath(info.file))
                if digest is not None:
                    digest.feed(info.start, writable_view(raw))
        for i in sorted(range(len(items)), key=where):
            window.append(pool.submit(run, i))
            if len(window) > workers:
                merge()
        while window:
            merge()
    return [p for problems in found for p in problems]


def _stored_apart(a: Checkpoint, modules: set[str]) -> dict[str, Any]:
    """module -> its scheme, for the quantized modules (of `modules`) whose format stores them in a
    form other than the canonical one: those are proved through the format's canonical read."""
    quant = a.config.quant
    fmt = formats.of(quant)
    if quant is None or not modules:
        return {}
    names = sorted(modules)
    return {m: s for m, s in zip(names, quant.schemes_for(names)) if s is not None and fmt.read_roles(s) is not None}


def _projection_problems(a: Checkpoint, module: str, scheme: Any, names: list[str], read_a: Callable[[str], torch.Tensor],
                         read_b: Callable[[str], torch.Tensor]) -> list[str]:
    """A padded projection stored apart, proved on its canonical form: the original's and the
    padded one's stored tensors are read into the canonical form by their format (which checks
    what it reads), and every canonical tensor must hold the original's values where they were and
    the padding's values after them, as a canonical projection must; and each stored tensor that is
    exactly the format's form of the original (`stored_form`) is exactly that of the padded one."""
    fmt = formats.of(a.config.quant)
    role_of = {role: n for n in names if (role := fmt.names.role_of(n.rpartition(".")[2])) is not None}
    old = {role: read_a(n) for role, n in role_of.items()}
    new = {role: read_b(n) for role, n in role_of.items()}
    try:
        ca = fmt.canonical(old, scheme, role_of)
        cb = fmt.canonical(new, scheme, role_of)
    except BadInput as e:
        return [f"{module}: {e.message}"]
    if set(ca) != set(cb):
        return [f"{module}: holds {sorted(cb)} in the canonical form, the original {sorted(ca)}"]
    rows = _ROLE[module.rpartition(".")[2]] in ("gate", "up")
    n_old, n_new = ca[SCALES].shape[0], cb[SCALES].shape[0]
    out = []
    for role in sorted(ca):
        why = _canonical_problem(role, rows, scheme.num_bits, ca[role], cb[role], n_old, n_new)
        if why:
            out.append(f"{role_of.get(role) or module + ' ' + role}: {why}")
    was, now = fmt.stored_form(ca, scheme), fmt.stored_form(cb, scheme)
    for role, name in role_of.items():
        exact = role in was and torch.equal(was[role].to(old[role].dtype), old[role])
        if exact and not (role in now and torch.equal(now[role].to(new[role].dtype), new[role])):
            out.append(f"{name}: is not the {fmt.quant_method} stored form of the padded projection (the original's is)")
    return out


def _grown_modules(a: Checkpoint, b: Checkpoint, names: set[str]) -> set[str]:
    """The modules of which a stored tensor other than a stored shape changed shape."""
    stored = formats.of(a.config.quant).names
    return {name.rpartition(".")[0] for name in names
            if stored.role_of(name.rpartition(".")[2]) != SHAPE and a.files.info(name).shape != b.files.info(name).shape}


def _padded_tensor_problem(a: Checkpoint, b: Checkpoint, module: str, role: str, suffix: str, old: torch.Tensor,
                           new: torch.Tensor) -> str | None:
    rows = role in ("gate", "up")
    stored = formats.of(a.config.quant).names
    kind = stored.role_of(suffix) or suffix
    if kind == SHAPE:
        (n, k), got = old.tolist(), new.tolist()
        ok = (got[1] == k and got[0] >= n) if rows else (got[0] == n and got[1] >= k)
        return None if ok else f"says {got}, the original {[n, k]}: only the intermediate dimension may grow"
    if kind in (WEIGHT, "bias"):
        kept, added = _split(old, new, 0 if rows or new.ndim == 1 else 1)
        if kept is None:
            return "does not start with the original"
        return None if torch.count_nonzero(added) == 0 else "an added weight is not 0"
    n_old = n_new = 0
    if kind == ZERO_POINTS:
        n_old, n_new = (ck.files.info(stored.tensor(module, CODES)).shape[0] for ck in (a, b))
    return _canonical_problem(kind, rows, _bits(a, module), old, new, n_old, n_new) \
        if kind in CANONICAL else f"a {suffix} tensor cannot be padded"


def _canonical_problem(kind: str, rows: bool, bits: int, old: torch.Tensor, new: torch.Tensor, n_old: int,
                       n_new: int) -> str | None:
    """What is wrong with a padded canonical tensor of role `kind` (None: nothing): `rows` for a
    gate/up projection (its rows grew), `n_old`/`n_new` the projection's N before and after."""
    code = zero_code(bits)
    if kind == CODES and 32 % bits == 0 and old.dtype == new.dtype == torch.int32:
        # on the packed words: K is whole words (packed along it), so the original's codes are its
        # words and each added code is the zero code exactly when each added word is the zero word
        kept, added = _split(old, new, 0 if rows else 1)
        if kept is None:
            return "an original code changed"
        return None if bool((added == zero_word(bits)).all()) else "an added code is not the zero code"
    if kind == CODES:
        if rows:
            kept, added = _split(old, new, 0)
        else:
            kept, added = _split(unpack_codes(old, bits, dim=1), unpack_codes(new, bits, dim=1), 1)
        if kept is None:
            return "an original code changed"
        codes = unpack_codes(added, bits, dim=1) if rows else added
        return None if bool((codes == code).all()) else "an added code is not the zero code"
    if kind == SCALES:
        kept, added = _split(old, new, 0 if rows else 1)
        if kept is None:
            return "an original scale changed"
        return None if bool(torch.isfinite(added).all()) else "an added scale is not finite"
    if kind == ZERO_POINTS:
        if rows:  # packed along the rows that grew: compare the codes of the original and the added rows
            kept, added = _split(unpack_codes(old, bits, dim=0, size=n_old), unpack_codes(new, bits, dim=0, size=n_new),
                                 0)
        else:
            kept, added = _split(old, new, 1)
            added = unpack_codes(added, bits, dim=0, size=n_old)
        if kept is None:
            return "an original zero point changed"
        return None if bool((added == code).all()) else "an added zero point is not the zero code"
    if kind == G_IDX:
        if rows:
            return None if torch.equal(old, new) else "g_idx of the input columns changed"
        kept, added = _split(old, new, 0)
        if kept is None:
            return "an original g_idx entry changed"
        group = int(torch.bincount(old.long()).max()) if old.numel() else 1
        groups = int(old.max()) + 1 if old.numel() else 0
        want = torch.arange(added.numel()) // group + groups
        return None if torch.equal(added.long(), want) else "the added columns are not whole new groups after the last"
    return f"a {kind} tensor cannot be padded"


def _split(old: torch.Tensor, new: torch.Tensor, dim: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the original part if it equals `old`, else None; the added part) of `new` along `dim`."""
    if new.ndim != old.ndim or any(new.shape[d] != old.shape[d] for d in range(old.ndim) if d != dim) \
            or new.shape[dim] < old.shape[dim]:
        return None, new
    kept = new.narrow(dim, 0, old.shape[dim])
    added = new.narrow(dim, old.shape[dim], new.shape[dim] - old.shape[dim])
    return (kept if torch.equal(kept, old) else None), added


# -- numerics ----------------------------------------------------------------------------------------------

def _streamed_block(ck: Checkpoint, layer: Any, experts: list[int], tp: int, a: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """The block's rounding interval, all-reduced (`verification.bounds.AllReduced`), and its
    output as an engine computes it (fp32 GEMMs, the model dtype between stages, per-slot outputs
    summed in fp32 per rank and rounded, the ranks' partials summed in fp32), split over `tp`
    ranks, built expert by expert and a group of ranks at a time (`bounds.rank_groups`, each group
    reading the experts once): one expert's weights and one group's partials in memory at a time,
    whatever the layer's number of experts."""
    from wna16ctl.verification.bounds import AllReduced, IntervalSum, rank_groups

    T, k = topk_ids.shape
    H = a.shape[1]
    total, out = AllReduced(T, H), torch.zeros(T, H)
    for group in rank_groups(list(range(tp)), T, H, blocks=2):
        accs = {r: IntervalSum(T, H) for r in group}
        outs = {r: torch.zeros(T, H) for r in group}
        _block_ranks(ck, layer, experts, tp, a, topk_ids, topk_weights, dtype, accs, outs)
        for r in group:
            total.add_rank(accs.pop(r), k, dtype)
            out += outs.pop(r).to(dtype).float()
    return total, out.to(dtype)


def _block_ranks(ck: Checkpoint, layer: Any, experts: list[int], tp: int, a: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, dtype: torch.dtype, accs: dict[int, Any], outs: dict[int, torch.Tensor]) -> None:
    """The ranks of `accs` of a block split over `tp`: each expert read once, its slices' intervals
    and outputs added to each rank's sums."""
    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.verification.bounds import add_expert_interval, upcast_matmul
    from wna16ctl.verification.e2e import _dequantize_source

    k, H = topk_ids.shape[1], a.shape[1]
    flat, wf = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    i, step = layer.intermediate_size, layer.intermediate_size // tp
    with TensorReader(ck.files) as reader:
        for e in experts:
            idx = (flat == e).nonzero().squeeze(1)
            p = reader.read_expert(layer, e)
            g, u, d = (_dequantize_source(p["gate"], H, dtype), _dequantize_source(p["up"], H, dtype),
                       _dequantize_source(p["down"], i, dtype))
            x = a[idx // k].to(dtype).float()
            for r in accs:
                s = slice(r * step, (r + 1) * step)
                w13, w2 = torch.cat([g[s].T, u[s].T], 1), d[:, s].T.contiguous()
                add_expert_interval(accs[r], a, topk_ids, topk_weights, e, w13, w2, dtype)
                g13 = upcast_matmul(x, w13).to(dtype).float()  # no fp32 copy of the whole weight
                h = (torch.nn.functional.silu(g13[:, :step]) * g13[:, step:]).to(dtype).float()
                outs[r].index_add_(0, idx // k, (upcast_matmul(h, w2) * wf[idx].unsqueeze(1)).to(dtype).float())


def _activations(a: Checkpoint, samples: Any, num_samples: int) -> tuple[torch.Tensor | None, str]:
    """Embedded question tokens (fp32 [T, H]), and where they came from; None: none to use."""
    from wna16ctl.errors import WnaError
    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.verification.activations import embed, load_questions, tokenize
    from wna16ctl.verification.bounds import numerics_tokens
    from wna16ctl.verification.samples import resolve_samples, samples_label

    try:
        path = resolve_samples(samples, a.root)
        questions = load_questions(path, num_samples)
        with TensorReader(a.files) as reader:
            ids, _ = tokenize(a, questions, int(a.config.raw.get("vocab_size") or 1 << 30))
            hidden = embed(a, reader, ids)
            # no layer runs on more tokens (the numerics' memory budget, verification.bounds)
            return hidden[:numerics_tokens(hidden.shape[1], blocks=2)], f"{samples_label(path)}, {len(questions)} questions"
    except WnaError as e:
        return None, f"seeded random activations ({e.message})"


def _judged(iv_ref: Any, out_ref: torch.Tensor, iv_pad: Any, out_pad: torch.Tensor,
            dtype: torch.dtype) -> tuple[Any, Any, int, float, float]:
    """Each output against its own interval, and their difference against the two half-widths and
    the centres' gap, a few rows at a time (`bounds.JUDGE_ROWS`): (the original's verdict, the
    padded one's, outputs whose difference is beyond the bound, the largest difference, the
    centres' largest gap)."""
    from wna16ctl.verification.bounds import JUDGE_ROWS, judge

    T = out_ref.shape[0]
    centre_gap = float((iv_ref.total.centre - iv_pad.total.centre).abs().max()) if T else 0.0
    half = lambda iv: torch.maximum((iv.hi - iv.centre).abs(), (iv.lo - iv.centre).abs())  # noqa: E731 - an interval's half width, for the lines below
    verdicts, outside, max_diff = [], 0, 0.0
    for s in range(0, T, JUDGE_ROWS):
        rows = slice(s, s + JUDGE_ROWS)
        ref, pad = iv_ref.interval(dtype, rows), iv_pad.interval(dtype, rows)
        verdicts.append((judge(out_ref[rows], ref), judge(out_pad[rows], pad)))
        diff = (out_ref[rows].double() - out_pad[rows].double()).abs()
        outside += int((diff > half(ref) + half(pad) + centre_gap).sum())
        max_diff = max(max_diff, float(diff.max()))
    v_ref, v_pad = verdicts[0]
    for r, p in verdicts[1:]:
        v_ref, v_pad = v_ref.merged(r), v_pad.merged(p)
    return v_ref, v_pad, outside, max_diff, centre_gap


def _check_numerics(a: Checkpoint, b: Checkpoint, proof: PadProof, samples: Any = None, num_samples: int = 16) -> None:
    from wna16ctl.errors import WnaError
    from wna16ctl.sources.tensors import TensorReader, dtype_from_name
    from wna16ctl.verification.activations import Routing, route
    from wna16ctl.verification.bounds import nothing_to_compare, numerics_tokens
    from wna16ctl.verification.checks import FAIL, NOT_RUN, PASS, restricted_routing

    dtype = dtype_from_name(a.config.torch_dtype or "bfloat16")
    if dtype not in (torch.bfloat16, torch.float16):
        return
    tp = proof.tp or 1
    hidden, proof.activations = _activations(a, samples, num_samples)
    padded_layers = {lay.prefix: lay for lay in b.quantized_layers}
    for lay in a.quantized_layers:
        lay_b = padded_layers.get(lay.prefix)
        if lay_b is None or lay_b.intermediate_size == lay.intermediate_size or lay_b.intermediate_size % tp:
            continue
        if proof.layers_selected is not None and lay.layer_index not in proof.layers_selected:
            continue
        routing = None
        if hidden is not None:
            try:
                with TensorReader(a.files) as reader:
                    routing = route(a, reader, lay, hidden, max_tokens=numerics_tokens(lay.hidden_size, blocks=2))
            except WnaError as e:
                proof.activations += f"; {lay.prefix}: seeded random activations ({e.message})"
        if routing is None:
            gen = torch.Generator().manual_seed(lay.layer_index or 0)
            k = min(2, lay.num_experts)
            x = torch.randn(min(max(TOKENS, lay.num_experts), numerics_tokens(lay.hidden_size, blocks=2)),
                            lay.hidden_size, generator=gen)
            ids = torch.stack([torch.randperm(lay.num_experts, generator=gen)[:k] for _ in range(x.shape[0])])
            routing = Routing(x=x, topk_ids=ids, topk_weights=torch.rand(x.shape[0], k, generator=gen), forced=0)
        if proof.experts_selected is not None:  # only the slots of those experts, as a repack output's verify
            routing = restricted_routing(routing, proof.experts_selected)
        x, ids, weights = routing.x.to(dtype), routing.topk_ids, routing.topk_weights.float()
        tokens = x.shape[0]
        experts = sorted({int(e) for e in ids.reshape(-1) if int(e) >= 0})
        iv_ref, out_ref = _streamed_block(a, lay, experts, 1, x, ids, weights, dtype)
        iv_pad, out_pad = _streamed_block(b, lay_b, experts, tp, x, ids, weights, dtype)
        empty = nothing_to_compare(iv_ref.total.centre)  # the rule repack's verify follows too
        if empty is not None:
            proof.layers.append({"layer": lay.prefix, "tp": tp, "tokens": tokens, "ok": False, "status": NOT_RUN,
                                 "reason": empty})
            continue
        v_ref, v_pad, outside, max_diff, centre_gap = _judged(iv_ref, out_ref, iv_pad, out_pad, dtype)
        ok = v_ref.violations == 0 and v_pad.violations == 0 and outside == 0
        proof.layers.append({"layer": lay.prefix, "tp": tp, "tokens": tokens, "ok": ok, "status": PASS if ok else FAIL,
                             "reason": "", "max_abs_difference": max_diff, "violations": outside + v_ref.violations
                             + v_pad.violations, "max_ratio": max(v_ref.max_ratio, v_pad.max_ratio),
                             "centre_difference": centre_gap})
        if not ok:
            proof.problems.append(f"{lay.prefix}: the padded layer at TP {tp} differs from the original beyond the "
                                  f"rounding interval ({outside + v_ref.violations + v_pad.violations} outputs)")
