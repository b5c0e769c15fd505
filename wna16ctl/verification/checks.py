"""`verify`: prove a repack output equals its source.

Three independent checks (a failure in one does not hide the others).  Each is a `Check` that
starts as `not run` and becomes `pass` or `FAIL` only once it ran to its end; a check whose input
is missing stays `not run` with the reason, and the verdict needs every required check to pass:

1. manifest — the output was made from this checkpoint (fingerprint), every file is the one the
   manifest hashed, and the settings and per-layer plan are what the planner gives today;
2. round trip — every rank's expert tensors, undone by the layout's inverse, equal the rank's
   slice of the checkpoint's codes, scales, zero points and g_idx bit for bit, and the ranks
   re-assemble into the checkpoint; every rank holds exactly the planned tensors, the non-expert
   ones byte-equal to the checkpoint's;
3. numerics — per MoE layer, activations of the samples (GSM8K by default) through the repacked per-rank weights
   (model dtype, fp32 accumulation, partial sums added across ranks like the all-reduce)
   against the dequantized checkpoint in fp32, within an element-wise bound derived from the
   dtype's rounding (docs/verify.md).

An output holding some of the ranks (manifest parts, `wna16ctl.repacking.parts`) is verified for the ranks
it holds, the numerics over those ranks' partial sums; an extra `all_ranks` check, not required,
stays `not run` and names the ranks that were not checked (and the re-assembly across ranks).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from wna16ctl.repacking import parts
from wna16ctl.repacking.distributed import SOLO, Group
from wna16ctl.verification import across
from wna16ctl.output import outdir
from wna16ctl.verification.activations import Routing, embed, load_questions, resolve_samples, route, tokenize
from wna16ctl.verification.samples import samples_label
from wna16ctl.sources import Checkpoint, open_checkpoint
from wna16ctl.sources.tensors import TensorReader, dtype_from_name, writable_view
from wna16ctl.errors import BadInput, LayoutMismatch, NotLoadable, UsageError
from wna16ctl.layout.packing import dequantize, unpack_codes
from wna16ctl.layout.rank import RankLayout, unbuild_expert_tensors
from wna16ctl.layout.spec import MARLIN
from wna16ctl.layout.shard import shard_expert, unshard_expert
from wna16ctl.layout._mismatch import first_difference
from wna16ctl.sources.config import SCALE_DTYPES
from wna16ctl.sources.headers import INDEX_NAME, read_shard_header
from wna16ctl.sink import TaskStarter, WholeRun, no_progress
from wna16ctl.output.manifest import FORMAT_NAME, SIDE_FILES
from wna16ctl.repacking.pipeline import LayerJob, RepackPlan, RepackSettings, plan_repack, rank_index_bytes
from wna16ctl.sources import source_fingerprint
from wna16ctl.sources.formats import G_IDX
import wna16ctl.native.ops  # noqa: F401 - installs the native un-tiling (kernels/untile.cpp) into the layout's inverse
from wna16ctl.verification.budget import EXPERTS_SIDE_BY_SIDE_BYTES, SLABS_AHEAD
from wna16ctl.verification.bounds import (JUDGE_ROWS, SLAB_BYTES, AllReduced, Interval, IntervalSum,
                                          expert_slots_interval, gemm_bound_used, judge, nothing_to_compare, numerics_tokens, rank_groups)
from wna16ctl.verification.rank_gemm import GEMM_DTYPES, ROUNDINGS, UNIT_ROUNDOFF, EmulatedGemm, RankFiles, rank_moe_output  # noqa: F401 - ROUNDINGS and UNIT_ROUNDOFF re-exported
from wna16ctl.verification.digests import LayerByLayerDigests
from wna16ctl.output.writer import JOURNAL_NAME, MANIFEST_NAME, PLANNED_METADATA, FILE_HASHES, hash_file, recorded_hash, sha256_file



PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"
# why the numerics did not run when only the exactness proof was asked for (`verify --no-numerics`)
NO_NUMERICS = ("not asked (--no-numerics): the exactness proof alone; "
               "run verify without --no-numerics for the numerics")


@dataclass
class Finding:
    check: str  # the name of the Check it belongs to: "manifest" | "round_trip" | "numerics" | ...
    message: str
    layer: str | None = None
    rank: int | None = None
    expert: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "message": self.message, "layer": self.layer, "rank": self.rank, "expert": self.expert}


@dataclass
class Check:
    """One check of the report.  It starts `not run`; only code that ran it to the end may set
    `pass` or `FAIL` (through `VerifyReport.conclude`), so a check that was skipped can never
    read as a pass."""

    name: str
    description: str
    required: bool = True
    status: str = NOT_RUN
    reason: str = "not reached"  # why it did not run, or what failed

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "required": self.required,
                "status": self.status, "reason": self.reason}


@dataclass
class LayerNumerics:
    """One MoE layer's numerics.  The error figures are None when the comparison did not run."""

    layer: str
    tokens: int
    forced_tokens: int
    experts_exercised: int
    num_experts: int
    status: str = NOT_RUN
    reason: str = ""
    max_abs_error: float | None = None
    rel_l2_error: float | None = None
    cosine: float | None = None
    max_error_over_bound: float | None = None
    violations: int | None = None
    rel_l2_limit: float | None = None  # no longer a criterion: the interval of `bounds` is (kept for readers)
    elements: int | None = None
    exact_elements: int | None = None  # elements whose interval is one value: equality required
    # over the other elements: max distance from the interval's midpoint / its half-width (≤ 1 passes)
    max_offset: float | None = None
    # the margin (bounds.gemm_bound_used): over the kernel's GEMM outputs, the largest error beyond
    # their own rounding as a fraction of the derived accumulation bound; ≤ 1 when correct, far
    # below it in practice; None where no GEMM kernel ran (the transposed layout)
    bound_used: float | None = None
    kernel: str = ""  # what computed the candidate (the kernel source, emulated on the CPU)
    capped_tokens: int = 0  # the samples' tokens left out by the numerics' memory budget (bounds.numerics_tokens)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "passed": self.passed}


def _default_checks() -> list[Check]:
    return [
        Check("manifest", "fingerprint, file hashes, settings and plan"),
        Check("round_trip", "every expert of every rank undone and compared bit for bit"),
        Check("numerics", "activations of the samples through the repacked layers against the fp32 reference"),
    ]


@dataclass
class VerifyReport:
    checkpoint: str
    output: str
    device: str
    tokenizer: str
    samples: int
    layers_checked: int = 0
    experts_checked: int = 0
    files_checked: int = 0
    ranks_checked: list[int] = field(default_factory=list)
    ranks_not_checked: list[int] = field(default_factory=list)  # absent from a part
    checks: list[Check] = field(default_factory=_default_checks)
    findings: list[Finding] = field(default_factory=list)
    numerics: list[LayerNumerics] = field(default_factory=list)
    e2e: Any = None  # wna16ctl.verification.e2e.E2EResult when --e2e was asked
    serve_step: Any = None  # how to serve the output (planning.next_steps.NextStep); None for a part
    # `--layers`: the MoE layer indices checked, and those of the output left out (a partial verify)
    layers_selected: list[int] | None = None
    layers_not_checked: list[int] = field(default_factory=list)
    # `--experts`: the expert indices checked in each checked layer, and those left out
    experts_selected: list[int] | None = None
    experts_not_checked: list[int] = field(default_factory=list)
    # a `--layout vllm` output: its VllmStateReport (contract figures, problems, serve line), whose
    # JSON object this report prints (docs/verify-json.md); None for the other layouts
    layout_state: Any = None
    numerics_asked: bool = True  # False: `verify --no-numerics`, the exactness proof alone

    @property
    def partial(self) -> bool:
        """Some ranks, layers or experts were not checked: the verdict speaks for the rest only."""
        return bool(self.ranks_not_checked or self.layers_not_checked or self.experts_not_checked)

    @property
    def next_steps(self) -> list[Any]:
        """The serve command of what was proved: only once it is proved."""
        return [self.serve_step] if self.passed and not self.partial and self.serve_step is not None else []

    @property
    def passed(self) -> bool:
        """Every check that ran passed, and every required check ran."""
        return (all(c.status != FAIL for c in self.checks)
                and all(c.status == PASS for c in self.checks if c.required))

    @property
    def numerics_coverage(self) -> dict[str, int]:
        """What the numerics covered: MoE layers compared (of those checked), experts exercised (of
        those selected) and tokens, summed over the layers, so that a partial run is never read as
        a full one."""
        rows = self.numerics
        return {"layers": sum(n.status != NOT_RUN for n in rows), "layers_checked": self.layers_checked,
                "experts_exercised": sum(n.experts_exercised for n in rows),
                "experts": sum(n.num_experts for n in rows), "tokens": sum(n.tokens for n in rows)}

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def by_check(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def not_run(self, name: str, reason: str) -> None:
        c = self.check(name)
        c.status, c.reason = NOT_RUN, reason

    def conclude(self, name: str, *, failed: str | None = None, incomplete: str | None = None) -> None:
        """Mark check `name` as run: FAIL when it has findings or `failed` says why, else `not run`
        when `incomplete` says what part could not run, else pass."""
        c = self.check(name)
        bad = self.by_check(name)
        if bad or failed:
            c.status = FAIL
            c.reason = failed or f"{len(bad)} finding{'s' if len(bad) != 1 else ''}"
        elif incomplete:
            c.status, c.reason = NOT_RUN, incomplete
        else:
            c.status, c.reason = PASS, ""

    def ok(self, name: str) -> bool | None:
        """True = ran and passed, False = failed, None = did not run."""
        status = self.check(name).status
        return None if status == NOT_RUN else status == PASS

    def to_json(self) -> dict[str, Any]:
        if self.layout_state is not None:  # the --layout vllm object, with the checks every report has
            return {**self.layout_state.to_json(), "passed": self.passed, "partial": self.partial,
                    "checks": [c.to_json() for c in self.checks],
                    "next_steps": [s.to_json() for s in self.next_steps]}
        return {
            "checkpoint": self.checkpoint, "output": self.output, "device": self.device, "tokenizer": self.tokenizer,
            "samples": self.samples, "passed": self.passed,
            "checks": [c.to_json() for c in self.checks],
            "manifest_ok": self.ok("manifest"), "round_trip_ok": self.ok("round_trip"),
            "numerics_ok": self.ok("numerics"), "numerics_asked": self.numerics_asked,
            "layers_checked": self.layers_checked, "experts_checked": self.experts_checked,
            "files_checked": self.files_checked,
            "ranks_checked": self.ranks_checked, "ranks_not_checked": self.ranks_not_checked,
            "layers_selected": self.layers_selected, "layers_not_checked": self.layers_not_checked,
            "experts_selected": self.experts_selected, "experts_not_checked": self.experts_not_checked,
            "partial": self.partial,
            "findings": [f.to_json() for f in self.findings],
            "numerics": [n.to_json() for n in self.numerics], "numerics_coverage": self.numerics_coverage,
            "e2e": self.e2e.to_json() if self.e2e is not None else None,
            "next_steps": [s.to_json() for s in self.next_steps],
        }


# ---- 1. manifest -------------------------------------------------------------------------------


def _read_manifest(out: Path) -> dict[str, Any]:
    from wna16ctl.sources.jsonfile import JSONError, loads

    path = out / MANIFEST_NAME
    if not out.is_dir():
        raise BadInput(f"{out}: not a directory; pass the output of `wna16ctl repack`")
    names = outdir.part_manifest_names(out)
    if not os.path.lexists(path) and names:  # one part, or several copied together
        manifest = parts.merge_parts(out, names)
        _check_manifest_types(out / names[0], manifest)
        return manifest
    if not path.is_file() or path.is_symlink():
        hint = " (an interrupted run: rerun repack with --resume)" if (out / JOURNAL_NAME).exists() else ""
        raise BadInput(f"{path}: missing; {out} is not a complete wna16ctl repack output{hint}")
    try:
        manifest = loads(path.read_bytes())
    except OSError as e:
        raise BadInput(f"{path}: unreadable ({e.strerror})") from None
    except JSONError as e:
        raise BadInput(f"{path}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise BadInput(f"{path}: not a wna16ctl repack manifest")
    _check_manifest_types(path, manifest)
    return manifest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# key -> (type check, what it must be): the manifest fields verify relies on
_MANIFEST_FIELDS: dict[str, tuple[Any, str]] = {
    "format_version": (_is_int, "an integer"),
    "identity": (lambda v: isinstance(v, dict) and isinstance(v.get("settings"), dict), "an object with settings"),
    "source": (lambda v: isinstance(v, dict) and isinstance(v.get("fingerprint"), str), "an object with a fingerprint"),
    "tp": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "ep": (lambda v: isinstance(v, bool), "true or false"),
    "layout": (lambda v: isinstance(v, str), "a string"),
    "scale_dtype": (lambda v: v in SCALE_DTYPES, f"one of {', '.join(SCALE_DTYPES)}"),
    "ranks": (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects"),
    "layers": (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v), "a list of objects"),
    "files": (lambda v: isinstance(v, dict) and all(
        recorded_hash(m) is not None and _is_int(m.get("bytes")) for m in v.values()),
        f"an object mapping paths to {{{' or '.join(FILE_HASHES)}, bytes}}"),
}
_SETTINGS_FIELDS: dict[str, tuple[Any, str]] = {
    "tp": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "ep": (lambda v: isinstance(v, bool), "true or false"),
    "layout": (lambda v: isinstance(v, str), "a string"),
    "max_shard_bytes": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "vllm": (lambda v: isinstance(v, str), "a vLLM release"),
    "gpu": (lambda v: isinstance(v, str), "a GPU architecture"),
}


def _check_manifest_types(path: Path, manifest: dict[str, Any]) -> None:
    """One line for a malformed manifest (wrong JSON types), before anything relies on it."""
    for key, (ok, what) in _MANIFEST_FIELDS.items():
        if key not in manifest or not ok(manifest[key]):
            got = "missing" if key not in manifest else f"{type(manifest[key]).__name__} {str(manifest[key])[:40]!r}"
            raise BadInput(f"{path}: field {key!r} must be {what} (got {got}); the manifest is corrupt")
    settings = manifest["identity"]["settings"]
    for key, (ok, what) in _SETTINGS_FIELDS.items():
        if key not in settings or not ok(settings[key]):
            raise BadInput(f"{path}: identity.settings.{key} must be {what}; the manifest is corrupt")
    if set(settings) != set(_SETTINGS_FIELDS):
        raise BadInput(f"{path}: identity.settings has keys {sorted(settings)}, expected {sorted(_SETTINGS_FIELDS)}")


def _expected_files(ck: Checkpoint, plan: RepackPlan, ranks: list[int]) -> dict[str, bytes | Path | None]:
    """Every file repack writes for `plan` and `ranks`: rel -> exact bytes (rank index), source
    side file, or None (a tensor file, checked by its header and the round trip)."""
    want: dict[str, bytes | Path | None] = {}
    for r in ranks:
        files = plan.files[r]
        for f in files:
            want[f.relpath] = None
        want[f"rank-{r}/{INDEX_NAME}"] = rank_index_bytes(files)
    for name in SIDE_FILES:
        src = ck.root / name
        if src.is_file():
            want[name] = src
    return want


def _check_files_against_plan(ck: Checkpoint, out: Path, plan: RepackPlan, manifest: dict[str, Any],
                              add: Any) -> None:
    """What OUT holds is what the plan implies: the same file set, rank indexes as repack writes
    them, each tensor file's header as planned, side files equal to the checkpoint's today."""
    want = _expected_files(ck, plan, _present_ranks(manifest, len(plan.files)))
    listed = set(manifest["files"])
    for rel in sorted(set(want) - listed):
        add(f"{rel}: repack writes this file for these settings, but the manifest does not list it")
    for rel in sorted(listed - set(want)):
        add(f"{rel}: listed in the manifest, but repack does not write it for these settings")
    planned_meta = dict(PLANNED_METADATA)
    for rel in sorted(set(want) & listed):
        path = out / rel
        if not path.is_file() or path.is_symlink():
            continue  # reported by the file check
        expected = want[rel]
        if isinstance(expected, bytes):
            if path.read_bytes() != expected:
                add(f"{rel}: differs from the index repack writes for this plan (edited after repack)")
        elif isinstance(expected, Path):
            try:
                same = sha256_file(path) == sha256_file(expected, follow_links=True)  # HF cache: links
            except OSError as e:
                add(f"{expected}: cannot be read to compare with {rel} ({e.strerror})")
                continue
            if not same:
                add(f"{rel}: differs from the checkpoint's {expected.name} (copied side files must equal the source's)")
        else:
            # the tensors themselves are the round trip's; the metadata is fixed by the plan
            try:
                meta = read_shard_header(path).metadata
            except BadInput as e:
                add(e.message)
                continue
            if meta != planned_meta:
                add(f"{rel}: safetensors __metadata__ {meta} differs from the planned {planned_meta}")


def _check_manifest(ck: Checkpoint, out: Path, manifest: dict[str, Any], report: VerifyReport,
                    progress: TaskStarter = no_progress, hashes: Callable[[str], bool] = lambda rel: True,
                    later: LayerByLayerDigests | None = None, defer: Callable[[str], bool] = lambda rel: False
                    ) -> RepackPlan | None:
    """`hashes(rel)`: whether this run checks the manifest's file `rel` (`--ranks`, a process's share);
    `defer(rel)`: whether its digest is left to `later`, taken as the round trip reads the file."""
    add = lambda msg, **kw: report.findings.append(Finding("manifest", msg, **kw))  # noqa: E731 - one finding of this check, for the lines below
    fp = source_fingerprint(ck)
    if manifest["source"]["fingerprint"] != fp or manifest["identity"].get("source_fingerprint") != fp:
        add(f"fingerprint mismatch: {out} was made from another checkpoint, or {ck.root} changed since "
            f"(manifest {str(manifest['source']['fingerprint'])[:16]}…, checkpoint {fp[:16]}…)")
    files = {rel: meta for rel, meta in manifest["files"].items() if hashes(rel)}
    present = {rel: out / rel for rel in files if _inside(rel) and not (out / rel).is_symlink() and (out / rel).is_file()}
    advance = progress("hashing output files", sum(p.stat().st_size for p in present.values()), unit="bytes")
    for rel, meta in sorted(files.items()):
        path = out / rel
        report.files_checked += 1
        if not _inside(rel):
            add(f"{rel}: the manifest names a path outside the output directory")
        elif path.is_symlink():
            add(f"{rel}: is a symbolic link (repack writes regular files only)")
        elif not path.is_file():
            add(f"{rel}: listed in the manifest but missing")
        elif path.stat().st_size != meta["bytes"]:
            add(f"{rel}: {path.stat().st_size} bytes, the manifest says {meta['bytes']} (modified after repack)")
            advance(path.stat().st_size)
        else:
            # blake3, or sha256 from earlier versions; _MANIFEST_FIELDS admits no entry without one
            algorithm, digest = recorded_hash(meta)  # type: ignore[misc]  # not None: see the line above
            if later is not None and defer(rel):
                later.defer(rel, path, algorithm, digest, len(report.findings), advance)
            elif hash_file(path, algorithm, progress=advance) != digest:
                add(f"{rel}: {algorithm} differs from the manifest (modified after repack)")
    files = manifest["files"]
    parents = {p.as_posix() for rel in files for p in Path(rel).parents if p.as_posix() != "."}
    manifests = {MANIFEST_NAME} if parts.part_ranks(manifest) is None else set(outdir.part_manifest_names(out))
    for dirpath, dirnames, filenames in os.walk(out):
        base = Path(dirpath).relative_to(out)
        for d in sorted(dirnames):
            rel = (base / d).as_posix()
            if rel not in parents:
                add(f"{rel}/: a directory the manifest does not account for (added after repack)")
        for fname in sorted(filenames):
            rel = (base / fname).as_posix()
            if rel not in manifests and rel not in files:
                add(f"{rel}: not listed in the manifest (added after repack)")
    settings = manifest["identity"]["settings"]
    for key in ("tp", "ep", "layout"):
        if manifest[key] != settings[key]:
            add(f"the manifest's {key} ({manifest[key]!r}) differs from its identity's settings ({settings[key]!r})")
    if manifest["scale_dtype"] != ck.config.torch_dtype:
        add(f"scale_dtype {manifest['scale_dtype']} differs from the checkpoint's torch_dtype {ck.config.torch_dtype}")
    try:
        rs = RepackSettings(**settings)
        plan = plan_repack(ck.root, rs)
    except (TypeError, ValueError):
        raise BadInput(f"{out / MANIFEST_NAME}: settings {settings!r} are not valid repack settings") from None
    except NotLoadable as e:
        add(f"the planner today refuses these settings: {e.message}")
        report.not_run("round_trip", "no plan to compare against: the planner refuses the recorded settings (see manifest)")
        report.not_run("numerics", "no plan to run: the planner refuses the recorded settings")
        return None
    except UsageError as e:
        raise BadInput(f"{out / MANIFEST_NAME}: settings {settings!r} cannot be planned: {e.message}") from None
    today = {j.layer.prefix: j.to_json() for j in plan.jobs}
    recorded = {lay.get("name"): lay for lay in manifest["layers"]}
    for name in sorted(set(today) | set(recorded), key=str):
        if name not in recorded:
            add(f"{name}: the planner expects this layer but the output has none", layer=name)
        elif name not in today:
            add(f"{name}: in the output but not a quantized MoE layer of the checkpoint", layer=name)
        elif recorded[name] != today[name]:
            keys = sorted(k for k in today[name] if recorded[name].get(k) != today[name][k])
            add(f"{name}: the output's plan differs from today's planner in {', '.join(keys)}", layer=name)
    for r, rank in enumerate(manifest["ranks"]):
        expected = [f.relpath for f in plan.files[r]] if r < len(plan.files) else None
        if rank.get("files") != expected:
            add(f"rank {r}: files {rank.get('files')} differ from the planned {expected}", rank=r)
    if len(manifest["ranks"]) != rs.tp:
        add(f"the manifest lists {len(manifest['ranks'])} ranks for tp {rs.tp}")
    _check_files_against_plan(ck, out, plan, manifest, add)
    return plan


def _present_ranks(manifest: dict[str, Any], n_ranks: int) -> list[int]:
    """The ranks an output holds: all, or a part's (parts copied together: all of theirs)."""
    covered = parts.part_ranks(manifest)
    return list(range(n_ranks)) if covered is None else [r for r in covered if r < n_ranks]


def _inside(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and "\\" not in rel and all(p not in ("", ".", "..") for p in parts)


# ---- 2 + 3. round trip and numerics --------------------------------------------------------------


def _tensor_digest(reader: TensorReader, info: Any, chunk: int = 64 << 20) -> str:
    """sha256 of one tensor's bytes, read in bounded chunks."""
    h = hashlib.sha256()
    for start in range(info.start, info.end, chunk):
        sub = type(info)(info.name, info.dtype, (), info.file, start, min(start + chunk, info.end))
        h.update(writable_view(reader.read_bytes(sub)))
    return h.hexdigest()


def _verify_rank_contents(ck: Checkpoint, reader: TensorReader, plan: RepackPlan, ranks: dict[int, RankFiles],
                          report: VerifyReport) -> None:
    """Each rank holds exactly the planned tensors, and the non-expert ones byte for byte as in the
    checkpoint (the round trip below only covers the expert tensors)."""
    source_digest: dict[str, str] = {}
    for r, rf in ranks.items():
        add = lambda msg, **kw: report.findings.append(Finding("round_trip", f"rank {r}: {msg}", rank=r, **kw))  # noqa: E731 - one finding of this rank's round trip, for the lines below
        planned = {t.name for f in plan.files[r] for t in f.tensors} if r < len(plan.files) else set()
        have = set(rf.files.names())
        for name in sorted(planned - have):
            add(f"tensor {name} is missing")
        for name in sorted(have - planned):
            add(f"tensor {name} is not part of the planned output")
        for name in plan.copied:
            if name not in have:
                continue
            got, want = rf.files.info(name), ck.files.info(name)
            if (got.dtype, got.shape) != (want.dtype, want.shape):
                add(f"{name} is {got.dtype} {list(got.shape)}, the checkpoint's is {want.dtype} {list(want.shape)}")
                continue
            if name not in source_digest:
                source_digest[name] = _tensor_digest(reader, want)
            try:
                same = _tensor_digest(rf.reader, got) == source_digest[name]
            except BadInput as e:
                add(e.message)
                continue
            if not same:
                add(f"{name} differs from the checkpoint's (non-expert tensors must be copied unchanged)")


def _projection_of(key: str, col: int | None, i_p: int) -> str:
    if key.startswith("w2_"):
        return "down_proj"
    if key.endswith("g_idx"):
        return "gate_proj/up_proj"
    return "gate_proj" if col is None or col < i_p else "up_proj"


def _cast_scales(kf: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if k.endswith("_scale") else v) for k, v in kf.items()}


def _compare(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], spec: RankLayout) -> str | None:
    """First difference between the rank's expected and recovered K-first tensors, described."""
    for key in sorted(set(expected) | set(got)):
        if key not in got or key not in expected:
            return f"{key} is {'missing' if key not in got else 'unexpected'}"
        a, b = expected[key], got[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{key}: {b.dtype} {list(b.shape)}, expected {a.dtype} {list(a.shape)}"
        where = first_difference(a, b)
        if where is not None:
            pf = 32 // spec.num_bits
            col = where[-1] if len(where) == 2 else None
            if key.endswith("zero_point") and col is not None:
                col *= pf  # packed along N
            proj = _projection_of(key, col, spec.intermediate_per_partition)
            return f"{key} ({proj}) differs at rank-local [{', '.join(map(str, where))}]: {b[where].item()!r} != {a[where].item()!r}"
    return None


def _dequantize_kfirst(kf: dict[str, torch.Tensor], spec: RankLayout, which: str, dtype: torch.dtype) -> torch.Tensor:
    """K-first weight [K, N] of `which` ∈ {w13, w2} in `dtype`: (code − zero)·scale, one rounding."""
    nb = spec.num_bits
    codes = unpack_codes(kf[f"{which}_weight_packed"], nb, dim=0).to(torch.int32)  # [K, N]; int32: q − z is exact
    K, N = codes.shape
    scale = kf[f"{which}_weight_scale"]
    if spec.group_size > 0 and spec.act_order:
        groups = kf[f"{which}_weight_g_idx"].long()
        if which == "w2" and not spec.load_full_w2:
            groups = groups - spec.rank * (spec.intermediate_per_partition // spec.group_size)
    elif spec.group_size > 0:
        groups = torch.arange(K) // spec.group_size
    else:
        groups = torch.zeros(K, dtype=torch.long)
    zp, zg = None, None
    if f"{which}_weight_zero_point" in kf:
        zp = unpack_codes(kf[f"{which}_weight_zero_point"], nb, dim=1).to(torch.int32)[:, :N]
        zg = groups if spec.group_size > 0 else torch.zeros(K, dtype=torch.long)
        if spec.group_size > 0 and spec.act_order and which == "w2" and spec.load_full_w2:
            zg = groups - spec.rank * (spec.intermediate_per_partition // spec.group_size)
    return dequantize(codes, scale, groups, nb, dtype, zp, zg)


def _gemm_device(device: str) -> torch.device:
    from wna16ctl.native import ops as kernels

    if device == "cuda" and not kernels.cuda_available():
        raise UsageError("--device cuda: no usable CUDA GPU and kernel library here; use --device cpu")
    if device == "cuda" or (device == "auto" and kernels.cuda_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def verify_output(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    samples: str | os.PathLike[str] | None = None,
    num_samples: int = 64,
    device: str = "auto",
    progress: TaskStarter | None = None,
    e2e: Any = None,
    notice: Callable[[str], None] | None = None,
    layers: str | Iterable[int] | None = None,
    experts: str | Iterable[int] | None = None,
    numerics: bool = True,
    ranks: Iterable[int] | None = None,
    group: Group = SOLO,
) -> VerifyReport:
    """Run every check of OUT against CKPT; see the module doc.  With `e2e` (a
    wna16ctl.verification.e2e.E2EOptions) also the end-to-end generation, a required check then.  Bad input
    raises a WnaError; a failing or skipped check is recorded in the returned report, never raised.
    `layers` ("0-3,7" or indices): check only those MoE layers' experts; `experts` (the same form): only
    those experts of each layer checked.  Either makes a partial verify, said so.  `numerics=False`
    runs the exactness proof alone (manifest and bit-exact round trip, expert by expert, memory
    bounded by one expert): the numerics check is `not run`, not required, and says why.
    `ranks` (TP ranks): check only those ranks' files, a partial verify unless they are all.
    `group` (`repacking.distributed.init_group` under torchrun): this process checks its share of
    the ranks and the returned report is the whole run's, the same in every process
    (`verification.across`)."""
    from wna16ctl.verification.vllm_state import is_vllm_output

    if is_vllm_output(out):  # whole-model sharded_state files: contract and round trip
        asked = [flag for flag, value in (("--e2e", e2e), ("--layers", layers), ("--experts", experts),
                                          ("--ranks", ranks)) if value is not None]
        if group.world_size > 1:
            asked.append("torchrun")
        if asked:
            raise UsageError(f"{', '.join(asked)} {'does' if len(asked) == 1 else 'do'} not apply to a --layout vllm "
                             "output: it is checked whole (serve it with vLLM to run it)")
        return verify_vllm_output(ckpt, out)
    if e2e is not None and group.world_size > 1:
        raise UsageError("--e2e runs the whole model in one process: run verify --e2e without torchrun")
    here = lambda: _verify_output_here(ckpt, out, samples, num_samples, device, progress or no_progress, e2e, notice,  # noqa: E731 - this process's verify, run alone or as its share of a torchrun launch
                                       layers, experts, numerics, ranks, group)
    if group.world_size == 1:
        return here()[0]
    got = group.exchange(f"verifying {out}", here)
    return merge_reports([report for report, _ in got], ep=got[0][1], asked=ranks is not None)


def _verify_output_here(ckpt: str | os.PathLike[str], out: str | os.PathLike[str], samples: str | os.PathLike[str] | None,
                        num_samples: int, device: str, progress: TaskStarter, e2e: Any,
                        notice: Callable[[str], None] | None, layers: str | Iterable[int] | None,
                        experts: str | Iterable[int] | None, numerics: bool, ranks: Iterable[int] | None,
                        group: Group) -> tuple[VerifyReport, bool]:
    """`verify_output` in this process, over its share of the ranks: (its report, whether the output is EP)."""
    ck = open_checkpoint(ckpt)
    if not (ck.quantized_layers or ck.quantized_mtp_layers):  # nothing repack would have written from it
        ck.require_wna16_moe()
    out_path = Path(out)
    manifest = _read_manifest(out_path)
    gemm_device = _gemm_device(device)
    if e2e is not None and not numerics:
        raise UsageError("--e2e and --no-numerics: e2e runs the model on samples; drop one of them")
    if e2e is not None:
        from wna16ctl.verification.e2e import require_e2e_memory, require_transformers

        require_transformers()
        require_e2e_memory(ck, dtype_from_name(manifest.get("scale_dtype") or ck.config.torch_dtype))
    wanted = None if layers is None else parse_indices(layers, "--layers", "MoE layer")
    wanted_experts = None if experts is None else parse_indices(experts, "--experts", "expert")
    if wanted is not None:  # a layer the checkpoint does not have is the checkpoint's answer, before samples
        unknown_layers([lay.layer_index for lay in ck.quantized_layers if lay.layer_index is not None], wanted)
    # inputs in the order a user fixes them: checkpoint, output, device, samples (none without numerics)
    samples_path = resolve_samples(samples, ck.root, notice) if numerics else None
    report, plan = _verify_checks(ck, out_path, manifest, samples_path, num_samples, gemm_device, progress, wanted,
                                  wanted_experts, None if ranks is None else sorted(set(ranks)), group)
    if e2e is not None and samples_path is not None and (report.partial or plan is None):
        from wna16ctl.verification import e2e as e2e_mod

        why = ("no plan to run: see the manifest check" if plan is None else
               e2e_subset_reason(report.layers_not_checked, report.experts_not_checked)
               or "needs every rank; this output is a part")
        report.checks.append(Check("e2e", f"greedy generation on prompts of {samples_label(samples_path)} with the source "
                                   "and the repacked experts", reason=why))
        report.e2e = e2e_mod.not_run(why)
    elif e2e is not None and samples_path is not None:
        from wna16ctl.verification import e2e as e2e_mod

        check = Check("e2e", f"greedy generation on prompts of {samples_label(samples_path)} with the source and the "
                      "repacked experts")
        report.checks.append(check)
        dtype = dtype_from_name(manifest.get("scale_dtype") or ck.config.torch_dtype)
        report.e2e = e2e_mod.run_e2e(ck, out_path, plan, Path(samples_path), e2e, gemm_device, dtype)
        check.status = {"pass": PASS, "FAIL": FAIL}.get(report.e2e.status, NOT_RUN)
        check.reason = report.e2e.reason or ""
    if "tp" in manifest:
        from wna16ctl.planning.serving import output_serve_path

        report.serve_step = output_serve_path(manifest, out_path, ck)
    return report, bool(manifest.get("ep"))


def verify_vllm_output(ckpt: str | os.PathLike[str], out: str | os.PathLike[str]) -> VerifyReport:
    """A `--layout vllm` output (verification.vllm_state checks it) as a report like every layout's: the
    files against vLLM's contract and the manifest's hashes are its manifest check, every tensor
    inverted back to the checkpoint bit for bit its round trip.  The numerics do not run (not
    required, said so): the files hold vLLM's own parameters, which the round trip proves equal to
    the checkpoint's, and vLLM's kernels compute with them."""
    from wna16ctl.verification.vllm_state import verify_vllm_state

    state = verify_vllm_state(ckpt, out)
    report = VerifyReport(str(ckpt), str(out), "cpu", tokenizer="", samples=0, layout_state=state, checks=[
        Check("manifest", f"files against vLLM {state.vllm}'s sharded_state contract (every key, shape and dtype) "
                          "and the manifest's hashes"),
        Check("round_trip", "every tensor of every rank inverted back to the checkpoint bit for bit"),
        Check("numerics", "activations through the layers", required=False,
              reason="a --layout vllm output holds vLLM's own parameters, proved equal to the checkpoint's by the "
                     "round trip; vLLM's kernels compute with them"),
    ])
    check = "round_trip" if state.round_trip_ran else "manifest"
    report.findings = [Finding(check, line) for line in state.problems]
    report.conclude("manifest")
    if state.round_trip_ran:
        report.conclude("round_trip")
    else:
        report.not_run("round_trip", "not reached: the files break the contract (see manifest)")
    report.serve_step = next(iter(state.next_steps), None)
    return report


def _verify_checks(ck: Checkpoint, out_path: Path, manifest: dict[str, Any], samples: str | os.PathLike[str] | None,
                   num_samples: int, gemm_device: torch.device,
                   progress: TaskStarter, layers: list[int] | None = None,
                   experts: list[int] | None = None, asked_ranks: list[int] | None = None,
                   group: Group = SOLO) -> tuple[VerifyReport, RepackPlan | None]:
    """The checks; `samples` None: the exactness proof alone (numerics not asked, see NO_NUMERICS).
    `asked_ranks`, `group`: the ranks checked, this process's share of them (`verification.across`)."""
    device = gemm_device.type
    questions = load_questions(samples, num_samples) if samples is not None else []
    report = VerifyReport(str(ck.root), str(out_path), device, tokenizer="", samples=len(questions))
    if samples is None:
        numerics = report.check("numerics")
        numerics.required, numerics.reason = False, NO_NUMERICS
        report.numerics_asked = False
    else:
        report.check("numerics").description = (f"activations of {samples_label(samples)} through the repacked layers "
                                                "against the fp32 reference")
    tp = manifest["tp"] if _is_int(manifest.get("tp")) else len(manifest["ranks"])
    held = _present_ranks(manifest, tp)
    checked = held if asked_ranks is None else across.ranks_to_check(held, asked_ranks, what=str(out_path))
    present = across.ranks_to_check(held, asked_ranks, group, str(out_path))
    hashes = lambda rel: across.hashes_file(rel, present, checked)  # noqa: E731 - the files this process hashes
    what = "round trip and numerics" if samples is not None else "round trip"
    share = _checked_share(ck, layers, experts)
    whole = WholeRun(progress, "whole verify", _verify_work(ck, manifest, hashes, present, share, what,
                                                            _likely_tokens(ck, len(questions))))
    # the rank files this process round-trips are hashed as the round trip reads them (`digests`)
    rank_dirs = {f"rank-{r}" for r in present}
    later = LayerByLayerDigests()
    try:
        plan = _check_manifest(ck, out_path, manifest, report, whole.start, hashes=hashes, later=later,
                               defer=lambda rel: rel.split("/", 1)[0] in rank_dirs)
        return _rank_checks(ck, out_path, manifest, plan, report, samples, questions, gemm_device, whole, hashes,
                            present, checked, share, what, layers, experts, asked_ranks, group, later)
    finally:
        later.close()


def _rank_checks(ck: Checkpoint, out_path: Path, manifest: dict[str, Any], plan: RepackPlan | None,
                 report: VerifyReport, samples: str | os.PathLike[str] | None, questions: list[Any],
                 gemm_device: torch.device, whole: WholeRun, hashes: Callable[[str], bool], present: list[int],
                 checked: list[int], share: float, what: str, layers: list[int] | None, experts: list[int] | None,
                 asked_ranks: list[int] | None, group: Group,
                 later: LayerByLayerDigests) -> tuple[VerifyReport, RepackPlan | None]:
    """The checks after the manifest's (`_verify_checks`).  The manifest check concludes when they
    stop: by then `later` holds the digest of every rank file they read."""
    def concluded(report: VerifyReport, plan: RepackPlan | None) -> tuple[VerifyReport, RepackPlan | None]:
        later.finish(report.findings, lambda msg: Finding("manifest", msg))
        report.conclude("manifest")
        return report, plan

    if plan is None:
        return concluded(report, plan)
    jobs = plan.jobs
    if layers is not None:
        jobs = _select_layers(jobs, layers, report)
    if experts is not None:
        _select_experts(jobs, experts, report)
    report.ranks_checked = present
    report.ranks_not_checked = [r for r in range(len(plan.files)) if r not in checked]
    if report.ranks_not_checked:
        report.checks.append(all_ranks_check(checked, report.ranks_not_checked, asked_ranks is not None))
    dtype = dtype_from_name(manifest["scale_dtype"])
    if dtype not in GEMM_DTYPES and any(j.layout == MARLIN for j in jobs):
        raise UsageError(
            f"{out_path}: scales are {manifest['scale_dtype']} (torch_dtype of {ck.root.name}); the MoE GEMM verify "
            "runs, like vLLM's Marlin MoE kernels, takes float16/bfloat16 only, so this output cannot be verified"
        )
    with TensorReader(ck.files) as reader:
        reader.mapped = True  # an expert at a time: mapped, not copied out of the page cache
        hidden = None  # without numerics: no activations, the round trip alone
        dropped = 0  # the samples' tokens past the budget of every layer
        if samples is not None:
            map_large_allocations()  # the numerics' peak memory the same at every layer
            vocab = int(ck.config.raw.get("vocab_size") or 1 << 30)
            token_ids, report.tokenizer = tokenize(ck, questions, vocab)
            hidden = embed(ck, reader, token_ids)
            dropped = max(0, hidden.shape[0] - numerics_tokens(hidden.shape[1]))
            hidden = hidden[:numerics_tokens(hidden.shape[1])]  # no layer runs on more (the memory budget)
            whole.restate(what, _verify_work(ck, manifest, hashes, present, share, what, hidden.shape[0])[what])
        ranks: dict[int, RankFiles] = {}
        unreadable: list[int] = []
        for r in present:
            try:
                ranks[r] = RankFiles(out_path / f"rank-{r}")
            except BadInput as e:
                report.findings.append(Finding("round_trip", f"rank {r}: {e.message}", rank=r))
                unreadable.append(r)
        # every process stops where one rank cannot be read, as one process would
        unreadable = sorted(r for got in group.exchange("opening the ranks' files", lambda: unreadable) for r in got)
        if unreadable:
            for rf in ranks.values():
                rf.reader.close()
            report.conclude("round_trip")
            which = ", ".join(f"rank-{r}" for r in unreadable)
            report.not_run("numerics", f"{which} cannot be read (see round trip)")
            return concluded(report, plan)
        try:
            _verify_rank_contents(ck, reader, plan, ranks, report)
            chosen = {j.layer.prefix: _experts_of(j, experts) for j in jobs}
            # every expert once for the round trip, once more for the numerics
            passes = 1 if hidden is None else 2
            advance = whole.start(what, passes * sum(len(c) for c in chosen.values()), unit="experts")
            with torch_threads(None if hidden is None else "every core"):
                for i, job in enumerate(jobs):
                    later.through_layer(ranks.values(), _stored_names(job),
                                        _stored_names(jobs[i + 1]) if i + 1 < len(jobs) else None)
                    _verify_layer(ck, reader, job, ranks, hidden, dtype, report, gemm_device, advance,
                                  chosen[job.layer.prefix], group, dropped=dropped)
        finally:
            for rf in ranks.values():
                rf.reader.close()
    report.conclude("round_trip")
    if hidden is None:
        return concluded(report, plan)
    failed = [n for n in report.numerics if n.status == FAIL]
    skipped = [n for n in report.numerics if n.status == NOT_RUN]
    report.conclude(
        "numerics",
        failed=(f"{len(failed)} of {len(report.numerics)} layer{'s' if len(report.numerics) != 1 else ''} "
                f"out of bound" if failed else None),
        incomplete="; ".join(f"{n.layer}: {n.reason}" for n in skipped) or None,
    )
    return concluded(report, plan)


def _stored_names(job: LayerJob) -> list[str]:
    """The names of a layer's tensors in the rank files."""
    return [f"{job.layer.prefix}.{n}" for n in job.tensor_names]


NUMERICS_TOKEN_COST = 1 / 8  # one token through an expert against reading the expert's bytes once: a prior, which the rate measured on the run replaces
TOKENS_PER_QUESTION = 64  # what a sample question tokenizes to, about: the numerics' tokens before the samples are read


def _verify_work(ck: Checkpoint, manifest: dict[str, Any], hashes: Callable[[str], bool], present: list[int],
                 share: float, what: str, tokens: int) -> dict[str, float]:
    """Each step of a verify priced in bytes read, for the whole run's time left (sink.WholeRun):
    hashing reads the files; the round trip reads each checked expert in the rank files and in
    the checkpoint; the numerics read it again and run its share of the `tokens` through it."""
    files = manifest["files"]
    hashed = sum(int(meta.get("bytes", 0)) for rel, meta in files.items() if hashes(rel))
    experts = share * sum(int(meta.get("bytes", 0)) for rel, meta in files.items()
                          if rel.split("/", 1)[0] in {f"rank-{r}" for r in present})
    work = 2 * experts
    if what != "round trip":
        top_k = ck.config.num_experts_per_tok or 1
        per_expert = tokens * top_k / max(1, max((lay.num_experts for lay in ck.quantized_layers), default=1))
        work += experts * (1 + NUMERICS_TOKEN_COST * per_expert)
    return {"hashing output files": float(hashed), what: work}


def _checked_share(ck: Checkpoint, layers: list[int] | None, experts: list[int] | None) -> float:
    """The share of the checkpoint's routed experts that `--layers` / `--experts` check."""
    moe = ck.quantized_layers
    every = sum(lay.num_experts for lay in moe)
    checked = sum(len([e for e in experts if e < lay.num_experts]) if experts is not None else lay.num_experts
                  for lay in moe if layers is None or lay.layer_index in layers)
    return checked / every if every else 1.0


def _likely_tokens(ck: Checkpoint, questions: int) -> int:
    """The tokens a layer's numerics will run on, before the samples are tokenized."""
    moe = ck.quantized_layers
    return min(questions * TOKENS_PER_QUESTION, numerics_tokens(moe[0].hidden_size)) if moe else 0


# glibc's mallopt parameters (malloc.h), and the size from which the numerics' allocations are mapped
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LARGE_ALLOCATION_BYTES = 1 << 20


def map_large_allocations() -> bool:
    """Have glibc's malloc map every block of `LARGE_ALLOCATION_BYTES` or more that its heaps
    cannot hold, and unmap it when freed, for the rest of the process, and give back now what its
    heaps hold free (True where it was set; False where malloc is not glibc's).  By default glibc
    raises the size from which it maps to that of the largest mapped block freed (up to 32 MiB),
    and the free top of a heap it keeps to twice that: once a layer's [tokens, hidden] sums were
    freed, the numerics' tensors of a few MiB came from the heaps, where the blocks freed between
    live ones stayed resident, and the resident set grew from layer to layer (955 MiB at the first
    layer of a Qwen3-30B-shaped checkpoint, 1,132 MiB at the third).  Set, the sizes stay fixed."""
    import ctypes

    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (AttributeError, OSError, ValueError):  # no such confstr name, or no mallopt: not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * LARGE_ALLOCATION_BYTES))
    trim(0)
    return done


@contextlib.contextmanager
def torch_threads(cores: str | None) -> Iterator[None]:
    """torch's intra-op threads for the round trip and the numerics, restored afterwards (the
    caller's setting is its own).  "every core": every core this process may run on, for the
    numerics' GEMMs (torch's default counts the machine's cores, which an affinity mask may not
    grant).  None: one thread, for the round trip alone: its work is byte comparisons of a few MB,
    which one core does at memory speed, and which intra-op threads slow several-fold as soon as
    another process holds a core (each op waits for its slowest thread)."""
    from wna16ctl.native.emulated import usable_cores

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores() if cores == "every core" else 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_indices(value: str | Iterable[int], option: str = "--layers", what: str = "MoE layer") -> list[int]:
    """`--layers 0-3,7` / `--experts 0-3,7` (or indices) -> [0, 1, 2, 3, 7]."""
    if not isinstance(value, str):
        out_ints = sorted({int(v) for v in value})
        if not out_ints or out_ints[0] < 0:
            raise UsageError(f"{option} {out_ints}: give one or more {what} indices (0 or more)")
        return out_ints
    out: set[int] = set()
    for part in value.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or (b and not b.isdigit()) or (b and int(b) < int(a)):
            raise UsageError(f"{option} {value!r}: {part.strip()!r} is not an index or range; pass e.g. "
                             f"{option} 0-3,7 ({what} indices)")
        out.update(range(int(a), int(b or a) + 1))
    return sorted(out)


def _experts_of(job: LayerJob, experts: list[int] | None) -> list[int]:
    """The experts of a layer the run checks: all, or the `--experts` ones."""
    return list(range(job.layer.num_experts)) if experts is None else list(experts)


def e2e_subset_reason(layers_not_checked: list[int], experts_not_checked: list[int]) -> str | None:
    """Why e2e does not run on a subset (`--layers`, `--experts`), else None."""
    if layers_not_checked:
        return "needs every layer; --layers checks some"
    return "needs every expert; --experts checks some" if experts_not_checked else None


def left_out_reason(option: str, asked: list[int], noun: str, left_out: list[int]) -> str:
    """What a subset (`--layers`, `--experts`) left out, as every verify says it."""
    from wna16ctl.planning.moe import _ranges, indices_text

    return (f"{option} {_ranges(asked)}: {indices_text(noun, left_out)} not checked (a partial verify: run without "
            f"{option} for a full one)")


def experts_left_out(layers: list[Any], experts: list[int]) -> list[int]:
    """The experts of the MoE `layers` checked that `--experts` leaves out; an asked expert that one
    of them lacks is one line naming that layer."""
    from wna16ctl.planning.moe import _ranges

    if not layers:
        return []
    fewest = min(lay.num_experts for lay in layers)
    unknown = [e for e in experts if e >= fewest]
    if unknown:
        layer = next(lay.prefix for lay in layers if lay.num_experts == fewest)
        raise UsageError(f"--experts: no expert {_ranges(unknown)} in {layer} (its experts: 0-{fewest - 1})")
    most = max(lay.num_experts for lay in layers)
    return [e for e in range(most) if e not in experts]


def _select_experts(jobs: list[LayerJob], experts: list[int], report: VerifyReport) -> None:
    """Check that every asked expert exists in the layers checked; record the others as not checked."""
    if not jobs:
        return
    report.experts_not_checked = experts_left_out([j.layer for j in jobs], experts)
    report.experts_selected = list(experts)
    if report.experts_not_checked:
        report.checks.append(Check(
            "all_experts", "every expert of each layer checked round-tripped and run", required=False,
            reason=left_out_reason("--experts", experts, "expert", report.experts_not_checked)))


def restricted_routing(routing: Routing, experts: list[int]) -> Routing:
    """The routing with only the slots of `experts` (the others' ids -1, weight 0, as a padded slot),
    and only the tokens left with one such slot: the numerics then compare those experts' sum."""
    keep_slot = torch.isin(routing.topk_ids, torch.tensor(experts, dtype=routing.topk_ids.dtype))
    ids = torch.where(keep_slot, routing.topk_ids, torch.full_like(routing.topk_ids, -1))
    weights = torch.where(keep_slot, routing.topk_weights, torch.zeros_like(routing.topk_weights))
    rows = keep_slot.any(1)
    first_forced = routing.x.shape[0] - routing.forced
    forced = int(rows[first_forced:].sum())
    return Routing(x=routing.x[rows], topk_ids=ids[rows], topk_weights=weights[rows], forced=forced,
                   capped=routing.capped)


def unknown_layers(known: list[int], layers: list[int]) -> None:
    """--layers naming a MoE layer the output does not hold: one line with the ones it holds."""
    from wna16ctl.planning.moe import _ranges

    unknown = [i for i in layers if i not in known]
    if unknown:
        raise UsageError(f"--layers: no MoE layer {_ranges(unknown)} in this output (its MoE layers: "
                         f"{_ranges(sorted(known))})")


def _select_layers(jobs: list[LayerJob], layers: list[int], report: VerifyReport) -> list[LayerJob]:
    """The jobs of the asked layers; the others are recorded as not checked (a partial verify)."""
    known = [j.layer.layer_index for j in jobs if j.layer.layer_index is not None]
    unknown_layers(known, layers)
    report.layers_selected = list(layers)
    report.layers_not_checked = sorted(i for i in known if i not in layers)
    if report.layers_not_checked:
        report.checks.append(Check(
            "all_layers", "every MoE layer's experts round-tripped and run", required=False,
            reason=left_out_reason("--layers", layers, "layer", report.layers_not_checked)))
    return [j for j in jobs if j.layer.layer_index in layers]


EMULATED_TOKENS_PER_EXPERT = 4
EMULATED_FIRST_TOKENS = 32


def _emulated_rows(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The tokens the emulated kernel runs in the numerics: the first few, and the first few routed
    to each expert, so that every expert's tensors go through the kernel source."""
    rows = [torch.arange(min(EMULATED_FIRST_TOKENS, topk_ids.shape[0]))]
    for e in range(num_experts):
        tok = (topk_ids == e).any(1).nonzero().squeeze(1)
        rows.append(tok[:EMULATED_TOKENS_PER_EXPERT])
    return torch.unique(torch.cat(rows))


def _numerics_gemm(device: torch.device):
    """(gemm, what it is) for the layer numerics: see `_marlin_slab`."""
    if device.type == "cuda":
        return None, "CUDA kernels"
    from wna16ctl.native.emulated import emulated_gemm_lib, emulated_unavailable_reason

    if emulated_gemm_lib() is None:
        return None, f"torch twin of the kernel (layout inverses; {emulated_unavailable_reason()})"
    return EmulatedGemm(), "moe_gemm_v3.cu (v2, then v1 where it declines) on the CPU emulation"


@dataclass
class _LayerSums:
    """What the round trip of a layer tells its numerics, and what the numerics gather over the
    ranks, one group of ranks at a time (`bounds.rank_groups`): the layer's memory grows neither
    with its experts nor with its ranks."""

    # Why the candidate is incomplete: an expert whose tensors cannot be read back, a rank the
    # GEMM cannot run on.  The reference never depends on the output, so it is always complete.
    no_candidate: list[str] = field(default_factory=list)
    layer_ok: bool = True  # no round-trip finding in this layer yet
    bound_used: float | None = None  # the kernel's GEMMs: error beyond their rounding / the derived bound
    exercised: set[int] = field(default_factory=set)  # experts some token is routed to
    # the all-reduced rounding interval (verification.bounds), each rank's added once it is done
    interval: AllReduced | None = None
    candidate: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # Σ ranks' rounded partials (fp32) [T, H]
    reference: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # the fp32 reference, summed in float64 [T, H]
    kernel: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # the emulated kernel's rows, as `candidate`
    launches: dict[str, int] = field(default_factory=dict)  # the emulated kernel's launches, by kernel


def _verify_layer(ck: Checkpoint, reader: TensorReader, job: LayerJob, ranks: dict[int, RankFiles],
                  hidden: torch.Tensor | None, dtype: torch.dtype, report: VerifyReport,
                  gemm_device: torch.device = torch.device("cpu"),
                  advance: Callable[[int], None] = lambda n: None, experts: list[int] | None = None,
                  group: Group = SOLO, dropped: int = 0) -> None:
    """One MoE layer: the round trip of every selected expert on every rank present, one expert in
    memory at a time; then, with `hidden`, the layer's numerics (`_layer_numerics`; `dropped`: the
    samples' tokens already left out of `hidden` by the memory budget), over the ranks of every
    process of `group`."""
    selected = list(range(job.layer.num_experts)) if experts is None else experts
    sums = _LayerSums()
    _round_trip_experts(reader, job, ranks, dtype, report, sums, selected, advance)
    report.layers_checked += 1
    if hidden is not None:
        _layer_numerics(ck, reader, job, ranks, hidden, dtype, report, gemm_device, advance, selected, sums,
                        group, dropped)


@dataclass
class _ExpertCheck:
    """One expert's round trip, checked apart (on a worker thread) and merged in expert order."""

    findings: list[Finding] = field(default_factory=list)
    experts_checked: int = 0


def _check_expert(reader: TensorReader, job: LayerJob, ranks: dict[int, RankFiles], dtype: torch.dtype,
                  e: int) -> tuple[_ExpertCheck, _LayerSums]:
    """Expert `e`'s round trip into a report and sums of its own (`_verify_expert`)."""
    own, sums = _ExpertCheck(), _LayerSums()
    _verify_expert(reader, job, ranks, dtype, own, sums, e)  # type: ignore[arg-type]  # the fields it writes
    return own, sums


def _merge_expert(report: VerifyReport, sums: _LayerSums, own: _ExpertCheck, mine: _LayerSums) -> None:
    """One expert's round trip into the layer's, in expert order."""
    report.findings += own.findings
    report.experts_checked += own.experts_checked
    sums.no_candidate += mine.no_candidate
    sums.layer_ok = sums.layer_ok and mine.layer_ok


def _round_trip_experts(reader: TensorReader, job: LayerJob, ranks: dict[int, RankFiles], dtype: torch.dtype,
                        report: VerifyReport, sums: _LayerSums, selected: list[int],
                        advance: Callable[[int], None]) -> None:
    """The round trip of a layer's selected experts on every core, reads overlapped with checks:
    each worker thread reads and checks one expert at a time (positioned reads and torch's ops
    release the GIL), a few experts ahead at most, and the results are merged in expert order, so
    that the report is the one a single thread gives."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from wna16ctl.native.emulated import usable_cores

    n_ranks = len(job.specs)
    reassembly = None
    if selected and not job.plan.ep and all(r in ranks for r in range(n_ranks)):
        reassembly = _sharding_reassembles(reader.read_expert(job.layer, selected[0]), job)
    workers = min(usable_cores(), max(1, len(selected)))
    with ThreadPoolExecutor(workers) as pool:
        window: deque[Any] = deque()
        for e in selected:
            window.append(pool.submit(_check_expert, reader, job, ranks, dtype, e))
            if len(window) > workers:
                _merge_expert(report, sums, *window.popleft().result())
                advance(1)
        while window:
            _merge_expert(report, sums, *window.popleft().result())
            advance(1)
    if reassembly is not None and sums.layer_ok:  # said only where no rank's own finding explains it
        report.findings.append(Finding("round_trip", f"{job.layer.prefix}: {reassembly}", layer=job.layer.prefix))


def _verify_expert(reader: TensorReader, job: LayerJob, ranks: dict[int, RankFiles], dtype: torch.dtype,
                   report: VerifyReport, sums: _LayerSums, e: int) -> None:
    """Expert `e`: each rank's tensors undone by the layout's inverse against the rank's slice of
    the checkpoint (that the slices re-assemble the checkpoint: `_sharding_reassembles`)."""
    layer, n_ranks = job.layer, len(job.specs)
    ck_expert = reader.read_expert(layer, e)
    for r, spec in enumerate(job.specs):
        rng = job.expert_ranges[r]
        if e not in rng or r not in ranks:  # a part: only the ranks it holds
            continue
        expected = _cast_scales(shard_expert(ck_expert, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2,
                                             expert_id=e), dtype)
        _read_back(job, ranks[r], r, spec, e - rng.start, e, expected, report, sums)
    # an EP part holds some experts only: count those whose tensors were read back here
    if any(e in job.expert_ranges[r] and r in ranks for r in range(n_ranks)):
        report.experts_checked += 1


def _reference_weights(expected: dict[str, torch.Tensor], spec: RankLayout,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's slice of an expert (K-first), dequantised in the model dtype: (w13, w2)."""
    return _dequantize_kfirst(expected, spec, "w13", dtype), _dequantize_kfirst(expected, spec, "w2", dtype)


def _read_back(job: LayerJob, rank: RankFiles, r: int, spec: RankLayout, local: int, e: int,
               expected: dict[str, torch.Tensor], report: VerifyReport,
               sums: _LayerSums) -> dict[str, torch.Tensor] | None:
    """Expert `e`'s tensors on rank `r` undone by the layout's inverse, each difference from the
    rank's slice of the checkpoint a finding (None: they cannot be read back)."""
    layer = job.layer
    try:
        tensors = {n: rank.expert_slice(f"{layer.prefix}.{n}", local) for n in job.tensor_names}
        got = unbuild_expert_tensors(tensors, spec, expert_id=e)
    except (LayoutMismatch, BadInput) as err:
        report.findings.append(Finding("round_trip", f"{layer.prefix} expert {e} rank {r}: {err.message}",
                                       layer=layer.prefix, rank=r, expert=e))
        sums.layer_ok = False
        if job.layout != MARLIN:
            sums.no_candidate.append(f"expert {e} rank {r} cannot be read back (see round trip)")
        return None
    diff = _compare(expected, got, spec)
    if diff is not None:
        report.findings.append(Finding("round_trip", f"{layer.prefix} expert {e} rank {r}: {diff}",
                                       layer=layer.prefix, rank=r, expert=e))
        sums.layer_ok = False
    return got




def _sharding_reassembles(ck_expert: dict[str, dict[str, torch.Tensor]], job: LayerJob) -> str | None:
    """Whether the ranks' slices of an expert re-assemble the checkpoint's tensors: what is wrong,
    or None.  Sharding and re-assembly only move elements, the same way for every expert of a
    layer, so they are run once per layer on an expert of the checkpoint's shapes whose every
    element is its own index: any element moved, lost or duplicated shows.  With each rank's
    slices equal to their shard bit for bit (the round trip), every expert then re-assembles."""
    spec0, n = job.specs[0], 0
    tagged: dict[str, dict[str, torch.Tensor]] = {}
    for role, tensors in ck_expert.items():
        tagged[role] = {}
        for key, t in tensors.items():
            if role == "up" and key == G_IDX:  # the engine keeps one g_idx for gate and up: equal
                continue
            tagged[role][key] = torch.arange(n, n + t.numel(), dtype=torch.int64).reshape(t.shape)
            n += t.numel()
    if G_IDX in tagged.get("gate", {}) and G_IDX in ck_expert.get("up", {}):
        tagged["up"][G_IDX] = tagged["gate"][G_IDX].clone()
    try:
        shards = [shard_expert(tagged, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2)
                  for spec in job.specs]
        back = unshard_expert(shards, tp=spec0.tp, load_full_w2=spec0.load_full_w2, group_size=spec0.group_size)
    except (LayoutMismatch, ValueError) as err:
        return f"the ranks' slices do not re-assemble the checkpoint's experts: {err}"
    for role, tensors in tagged.items():
        for key, want in tensors.items():
            got = back.get(role, {}).get(key)
            if got is None or got.shape != want.shape or first_difference(got, want) is not None:
                return f"re-assembled {role} {key} differs from the checkpoint (elements moved by the sharding)"
    return None


# ---- 3. numerics, a group of ranks at a time ------------------------------------------------------


def _layer_numerics(ck: Checkpoint, reader: TensorReader, job: LayerJob, ranks: dict[int, RankFiles],
                    hidden: torch.Tensor, dtype: torch.dtype, report: VerifyReport, gemm_device: torch.device,
                    advance: Callable[[int], None], selected: list[int], sums: _LayerSums, group: Group = SOLO,
                    dropped: int = 0) -> None:
    """The layer's numerics, in memory bounded by `bounds.NUMERICS_MEMORY`: the samples' tokens
    routed (at most `bounds.numerics_tokens`), then the ranks a group at a time
    (`bounds.rank_groups`): each group reads the checkpoint's experts once, builds each rank's
    rounding interval and fp32 reference expert by expert and its candidate a slab of experts at a
    time (`_marlin_slab`), and adds each rank's partial to the layer's sums before the next group;
    then the sums of every process of `group` are added up like the all-reduce
    (`across.exchange_layer`), and the layer is judged against the candidate."""
    layer = job.layer
    routing = route(ck, reader, layer, hidden, max_tokens=numerics_tokens(layer.hidden_size))
    if len(selected) < layer.num_experts:  # --experts: only those experts' contributions are compared
        routing = restricted_routing(routing, selected)
    T, H = routing.x.shape
    sums.interval = AllReduced(T, H)
    # the reference is summed in float64: its fp32 addends then add up to the same value in any
    # order, so processes that each hold some of the ranks (verification.across) report the figures one does
    sums.candidate, sums.reference = torch.zeros(T, H), torch.zeros(T, H, dtype=torch.float64)
    emulated, kernel = (_numerics_gemm(gemm_device) if job.layout == MARLIN
                        else (None, "the layer's math in torch (transposed layout)"))
    rows = None if emulated is None else _emulated_rows(routing.topk_ids, layer.num_experts)
    sums.kernel = torch.zeros(0 if rows is None else len(rows), H)
    routed = set(routing.topk_ids.reshape(-1).tolist())
    sums.exercised = {e for e in selected if e in routed}
    groups = rank_groups([r for r in ranks if len(job.expert_ranges[r])], T, H)
    steps = [0]

    def step() -> None:  # the layer's experts once more on the progress, spread over the groups
        steps[0] += 1
        advance(steps[0] // max(1, len(groups)) - (steps[0] - 1) // max(1, len(groups)))

    for some in groups:
        _rank_group(reader, job, {r: ranks[r] for r in some}, routing, dtype, gemm_device, emulated, rows, selected,
                    sums, step)
    if not groups:
        for _ in selected:
            advance(1)
    if emulated is not None:
        sums.launches = dict(emulated.launches)  # into `kernel` once every process's are known
    across.exchange_layer(group, layer.prefix, sums)
    if emulated is not None and rows is not None:
        kernel = (f"{kernel} on {len(rows)} of {T} tokens (every expert; "
                  + ", ".join(f"{k} × {v}" for k, v in sorted(sums.launches.items()))
                  + " launches), the torch twin of the kernel on all")
    row = LayerNumerics(layer=layer.prefix, tokens=T, forced_tokens=routing.forced, experts_exercised=len(sums.exercised),
                        num_experts=len(selected), kernel=kernel,
                        capped_tokens=routing.capped + dropped)
    report.numerics.append(row)
    _judge_layer(row, dtype, sums, rows, len(selected))


def _rank_group(reader: TensorReader, job: LayerJob, group: dict[int, RankFiles], routing: Routing,
                dtype: torch.dtype, device: torch.device, emulated: Any, rows: torch.Tensor | None,
                selected: list[int], sums: _LayerSums, step: Callable[[], None]) -> None:
    """The numerics of the ranks of `group`: their partials, built slab by slab of experts, added
    to the layer's sums (each rank's rounded, as the all-reduce takes it), then let go.  On every
    core: each rank's candidate over a slab, then each expert's reference, runs on a worker thread
    with one torch thread (torch's own threads wait on their slowest as soon as another process
    holds a core), as many experts at once as cores where their weights fit; their terms are added
    to the sums on this thread in expert order, so the figures are those one thread gives."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from wna16ctl.native.emulated import usable_cores

    T, H = routing.x.shape
    k = routing.topk_ids.shape[1]
    a = routing.x.to(dtype)
    acc = {r: IntervalSum(T, H) for r in group}
    part = {r: torch.zeros(T, H) for r in group}
    part_k = {r: torch.zeros(sums.kernel.shape[0], H) for r in group}
    failed: set[int] = set()
    workers = usable_cores()
    # experts side by side as far as their weights fit (budget.EXPERTS_SIDE_BY_SIDE_BYTES); one at
    # a time, a large expert keeps torch's threads on every core instead
    ahead = max(1, min(workers, EXPERTS_SIDE_BY_SIDE_BYTES // (6 * job.layer.hidden_size * job.layer.intermediate_size)))
    side_by_side = ahead > 1 or len(group) > 1
    inline = _InlinePool()
    slabs = _slabs(job, group, selected)
    with torch_threads(None if side_by_side else "every core"), \
            (ThreadPoolExecutor(workers) if side_by_side else inline) as pool, \
            (ThreadPoolExecutor(1) if side_by_side else inline) as runner:
        experts_pool = pool if ahead > 1 else inline  # one at a time: on this thread, in its heap

        def candidates(slab: range) -> Any:
            return runner.submit(_marlin_ranks, pool, job, group, slab, routing, dtype, device, emulated, rows, part,
                                 part_k, sums, failed)

        # The next slab's candidates (the GEMMs of its ranks, one worker each) run while this slab's
        # experts build their references: a slab of one rank's GEMMs alone would hold one core.
        # The slabs' candidates still run one after another, each adding into its ranks' partials
        # in slab order, and only they touch those partials (a Marlin layer's expert terms add
        # none), so the figures are the same.
        upcoming = None
        for i, slab in enumerate(slabs):
            kept = (upcoming or candidates(slab)).result()
            upcoming = candidates(slabs[i + 1]) if side_by_side and SLABS_AHEAD and i + 1 < len(slabs) else None
            window: deque[Any] = deque()
            for e in slab:
                window.append(experts_pool.submit(_expert_terms, reader, job, group, routing, a, dtype, e, kept))
                if len(window) >= ahead:
                    _add_expert_terms(window.popleft().result(), acc, part, sums)
                    step()
            while window:
                _add_expert_terms(window.popleft().result(), acc, part, sums)
                step()
    assert sums.interval is not None
    for r in group:
        sums.interval.add_rank(acc.pop(r), k, dtype)
        sums.candidate += part.pop(r).to(dtype).float()
        sums.kernel += part_k.pop(r).to(dtype).float()


class _InlinePool(contextlib.AbstractContextManager):
    """A pool's `submit` on the calling thread, for work with nothing to run side by side: its
    memory stays in the calling thread's heap rather than in a worker's too."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        from concurrent.futures import Future

        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done

    def __exit__(self, *exc: Any) -> None:
        return None


def _marlin_ranks(pool: Any, job: LayerJob, group: dict[int, RankFiles], slab: range, routing: Routing,
                  dtype: torch.dtype, device: torch.device, emulated: Any, rows: torch.Tensor | None,
                  part: dict[int, torch.Tensor], part_k: dict[int, torch.Tensor], sums: _LayerSums,
                  failed: set[int]) -> dict[int, Any]:
    """`_marlin_slab` of each rank of the group over `slab`, the ranks side by side (each adds into
    its own partial); what cannot run is said in rank order."""
    if job.layout != MARLIN:
        return {}
    notes: dict[int, list[str]] = {r: [] for r in group}
    futures = {r: pool.submit(_marlin_slab, job, r, group[r], slab, routing, dtype, device, emulated, rows, part[r],
                              part_k[r], notes[r], failed) for r in group if r not in failed}
    kept = {r: f.result() for r, f in futures.items()}
    for r in group:
        sums.no_candidate += notes[r]
    return kept


def _slabs(job: LayerJob, group: dict[int, RankFiles], selected: list[int]) -> list[range]:
    """The selected experts in runs of consecutive ids, each at most `bounds.SLAB_BYTES` of a rank's
    tensors (at least one expert): what one read of a rank's stacked tensors takes."""
    files = next(iter(group.values())).files
    per = 0
    for n in job.tensor_names:
        name = f"{job.layer.prefix}.{n}"
        if name in files and files.info(name).shape:
            per += files.info(name).nbytes // max(1, files.info(name).shape[0])
    size = max(1, SLAB_BYTES // max(1, per))
    out: list[range] = []
    for e in selected:
        if out and out[-1].stop == e and len(out[-1]) < size:
            out[-1] = range(out[-1].start, e + 1)
        else:
            out.append(range(e, e + 1))
    return out


@dataclass
class _ExpertTerms:
    """Expert e's terms on each rank of a group, computed apart (on a worker thread) and added to
    the sums in expert order (`_add_expert_terms`)."""

    intervals: dict[int, tuple[Interval, torch.Tensor]] = field(default_factory=dict)  # rank: (interval, rows)
    outputs: list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)  # (rank, tok, candidate, reference)
    bound_used: float | None = None


def _expert_terms(reader: TensorReader, job: LayerJob, group: dict[int, RankFiles], routing: Routing,
                  a: torch.Tensor, dtype: torch.dtype, e: int, kept: dict[int, Any]) -> _ExpertTerms:
    """Expert `e` on each rank of the group: its rounding interval and fp32 reference from the
    checkpoint's slice, the kernel's margin on its slots (Marlin), its candidate from the tensors
    read back (the transposed layout); its weights let go before the next expert."""
    terms = _ExpertTerms()
    tok, slot = (routing.topk_ids == e).nonzero(as_tuple=True)
    w = routing.topk_weights[tok, slot].unsqueeze(1)
    ck_expert = reader.read_expert(job.layer, e)
    for r, rank in group.items():
        rng, spec = job.expert_ranges[r], job.specs[r]
        if e not in rng:
            continue
        expected = _cast_scales(shard_expert(ck_expert, tp=spec.tp, rank=spec.rank, load_full_w2=spec.load_full_w2,
                                             expert_id=e), dtype)
        w13, w2 = _reference_weights(expected, spec, dtype)
        iv = expert_slots_interval(a, routing.topk_ids, routing.topk_weights, e, w13, w2, dtype)
        if iv is not None:
            terms.intervals[r] = iv
        if kept.get(r) is not None:
            terms.bound_used = max(terms.bound_used or 0.0, _expert_bound_used(kept[r], e, w13, w2, spec, dtype))
        del w13, w2
        if tok.numel():
            got = None if job.layout == MARLIN else _candidate_tensors(job, rank, spec, e - rng.start, e)
            terms.outputs.append((r, tok, *_expert_numerics(routing.x[tok], a[tok].float(), w, expected, got, spec,
                                                            dtype)))
    return terms


def _add_expert_terms(terms: _ExpertTerms, acc: dict[int, IntervalSum], part: dict[int, torch.Tensor],
                      sums: _LayerSums) -> None:
    """One expert's terms into its ranks' sums and the layer's (on one thread, in expert order)."""
    for r, iv in terms.intervals.items():
        acc[r].add(*iv)
    if terms.bound_used is not None:
        sums.bound_used = max(sums.bound_used or 0.0, terms.bound_used)
    for r, tok, candidate, reference in terms.outputs:
        if candidate is not None:
            part[r].index_add_(0, tok, candidate)
        sums.reference.index_add_(0, tok, reference)


def _candidate_tensors(job: LayerJob, rank: RankFiles, spec: RankLayout, local: int,
                       e: int) -> dict[str, torch.Tensor] | None:
    """Expert `e`'s tensors on a rank undone by the layout's inverse (None: they cannot be, which
    the round trip reported, and the layer's candidate says)."""
    try:
        tensors = {n: rank.expert_slice(f"{job.layer.prefix}.{n}", local) for n in job.tensor_names}
        return unbuild_expert_tensors(tensors, spec, expert_id=e)
    except (LayoutMismatch, BadInput):
        return None


@dataclass
class _Kept:
    """A slab's GEMM outputs on one rank, for the kernel's margin: the slots the margin is taken on
    (the emulated kernel's, else all), their experts, inputs and router weights."""

    experts: torch.Tensor  # [S] the expert of each slot
    a: torch.Tensor  # [S, H] the w13 GEMM's input (model dtype)
    weights: torch.Tensor  # [S] fp32
    outputs: dict[str, torch.Tensor]  # rank_moe_output's `keep`


def _marlin_slab(job: LayerJob, r: int, rank: RankFiles, slab: range, routing: Routing, dtype: torch.dtype,
                 device: torch.device, emulated: Any, rows: torch.Tensor | None, part: torch.Tensor,
                 part_k: torch.Tensor, no_candidate: list[str], failed: set[int]) -> _Kept | None:
    """Rank r's candidate over the experts of `slab`: the MoE GEMM over the tensors as written (one
    read of the slab's experts), on the slots routed to them, added into `part`.  On the CPU every
    slot goes through the torch twin (the layout's inverses) and those of the emulated rows through
    the kernel source on the CPU emulation too, into `part_k` (all tokens would take minutes); on a
    GPU the CUDA kernel.  A rank whose tensors make the GEMM fail joins `failed`, said in
    `no_candidate`."""
    rng = job.expert_ranges[r]
    lo, hi = max(slab.start, rng.start), min(slab.stop, rng.stop)
    k = routing.topk_ids.shape[1]
    ids, wts = routing.topk_ids.reshape(-1), routing.topk_weights.reshape(-1).float()
    slots = ((ids >= lo) & (ids < hi)).nonzero().squeeze(1)
    if lo >= hi or not slots.numel():
        return None
    tok = slots // k
    a = routing.x[tok].to(dtype)
    keep: dict[str, torch.Tensor] = {}
    try:
        t = {n: rank.expert_slab(f"{job.layer.prefix}.{n}", lo - rng.start, hi - rng.start).to(device)
             for n in job.tensor_names}
        # the margin figure is the kernel's: the emulated one's slots on the CPU, else the GEMM
        # that ran on every slot (the CUDA kernel, or the twin without g++)
        part.index_add_(0, tok, rank_moe_output(job, r, t, a, ids[slots].unsqueeze(1), wts[slots].unsqueeze(1), dtype,
                                                device, keep=keep if emulated is None else None, experts=range(lo, hi)))
        if emulated is None or rows is None:
            return _Kept(ids[slots], a, wts[slots], keep)
        m = torch.isin(tok, rows)
        if not bool(m.any()):
            return None
        part_k.index_add_(0, torch.searchsorted(rows, tok[m]), rank_moe_output(
            job, r, t, a[m], ids[slots[m]].unsqueeze(1), wts[slots[m]].unsqueeze(1), dtype, device, emulated,
            keep=keep, experts=range(lo, hi)))
        return _Kept(ids[slots[m]], a[m], wts[slots[m]], keep)
    except Exception as err:  # malformed tensors make the kernel fail: the comparison cannot run
        msg = err.message if isinstance(err, (LayoutMismatch, BadInput)) else f"{type(err).__name__}: {err}"
        no_candidate.append(f"the GEMM cannot run on rank {r}'s tensors ({msg})")
        failed.add(r)
        return None


def _expert_bound_used(kept: _Kept, e: int, w13: torch.Tensor, w2: torch.Tensor, spec: RankLayout,
                       dtype: torch.dtype) -> float:
    """`bounds.gemm_bound_used` of expert e's two GEMMs on one rank, on the inputs they were given
    (a; the kernel's own h for w2) against the checkpoint's dequantised weights: how much of the
    derived accumulation bound the kernel's outputs use beyond their own rounding."""
    m = (kept.experts == e).nonzero().squeeze(1)
    if not m.numel() or not kept.outputs:
        return 0.0
    i_p, pad = spec.intermediate_per_partition, spec.padded_intermediate
    g13 = kept.outputs["w13"][m]
    g13 = torch.cat([g13[:, :i_p], g13[:, pad:pad + i_p]], 1)  # padding columns left out
    return max(gemm_bound_used(kept.a[m], w13, g13, dtype),
               gemm_bound_used(kept.outputs["h"][m][:, :i_p], w2, kept.outputs["w2"][m], dtype, weight=kept.weights[m]))


def _judge_layer(row: LayerNumerics, dtype: torch.dtype, sums: _LayerSums, emulated_rows: torch.Tensor | None,
                 selected: int) -> None:
    """The layer's numerics row: the candidate's output against the rounding interval, a few rows
    at a time (`bounds.JUDGE_ROWS`)."""
    no_candidate = sums.no_candidate
    if no_candidate:
        row.reason = "; ".join(no_candidate[:3]) + (f"; … {len(no_candidate) - 3} more" if len(no_candidate) > 3 else "")
        return
    empty = nothing_to_compare(sums.reference)
    if empty is not None:
        row.reason = empty
        return
    # the interval every correct implementation lands in, from the same rounded inputs and the
    # checkpoint's weights, over the ranks present (all, or a part's share): docs/verify.md.
    # All-reduce: each rank's partial was rounded to the model dtype, the sum is too
    assert sums.interval is not None
    T = sums.candidate.shape[0]
    verdicts = [judge(sums.candidate[s:s + JUDGE_ROWS].to(dtype).float(),
                      sums.interval.interval(dtype, slice(s, s + JUDGE_ROWS))) for s in range(0, T, JUDGE_ROWS)]
    if emulated_rows is not None:  # the kernel source's outputs on its tokens, against the same rows
        y_k = sums.kernel.to(dtype).float()
        for s in range(0, len(emulated_rows), JUDGE_ROWS):
            at = emulated_rows[s:s + JUDGE_ROWS]
            verdicts.append(judge(y_k[s:s + JUDGE_ROWS], sums.interval.interval(dtype, at)))
    verdict = verdicts[0]
    for v in verdicts[1:]:
        verdict = verdict.merged(v)
    rel, cos = agreement(sums.candidate.to(dtype).float(), sums.reference)
    row.max_abs_error, row.rel_l2_error, row.cosine = verdict.max_abs_error, rel, cos
    row.max_error_over_bound, row.violations = verdict.max_ratio, verdict.violations
    row.elements, row.exact_elements = verdict.elements, verdict.exact_elements
    row.max_offset, row.bound_used = verdict.max_offset, sums.bound_used
    if row.violations:
        row.status, row.reason = FAIL, (f"{row.violations} of {row.elements} elements outside the rounding interval "
                                        f"(max error {row.max_error_over_bound:.3g} × the bound)")
    elif len(sums.exercised) < selected:
        missing = selected - len(sums.exercised)
        row.reason = f"{missing} expert{'s' if missing != 1 else ''} not exercised by any token"
        if row.capped_tokens:
            row.reason += (f" ({row.capped_tokens} of the samples' tokens left out by the numerics' memory budget: "
                           "verify fewer experts at a time with --experts)")
    else:
        row.status = PASS


def agreement(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, cosine similarity) of two outputs, summed in float64 a chunk at a time:
    over millions of elements fp32 sums drift enough to print a cosine above 1.  The reference
    must not be zero."""
    c_flat, r_flat = candidate.reshape(-1), reference.reshape(-1)
    dd = rr = cc = cr = 0.0
    for s in range(0, c_flat.numel(), 1 << 20):
        c64, r64 = c_flat[s:s + (1 << 20)].double(), r_flat[s:s + (1 << 20)].double()
        dd += float(((c64 - r64) ** 2).sum())
        rr += float((r64 * r64).sum())
        cc += float((c64 * c64).sum())
        cr += float((c64 * r64).sum())
    rel = dd ** 0.5 / rr ** 0.5
    cos = cr / (cc ** 0.5 * rr ** 0.5) if cc else 0.0
    return rel, min(1.0, max(-1.0, cos))


def _expert_numerics(x: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, expected: dict[str, torch.Tensor],
                     got: dict[str, torch.Tensor] | None, spec: RankLayout,
                     dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One expert's contribution on one rank, (candidate, reference) per slot: the reference from
    the checkpoint's slice in fp32 (float64 out, as the layer sums it); the candidate too when
    `got` is given (layouts the GEMM kernel does not read), else None.  The layer is judged
    afterwards against the interval of `bounds`."""
    i_p = spec.intermediate_per_partition
    # reference (fp32, exact dequantization of the checkpoint slice)
    w13_ref = _dequantize_kfirst(expected, spec, "w13", torch.float32)  # [H, 2I_p]
    w2_ref = _dequantize_kfirst(expected, spec, "w2", torch.float32)  # [I_p, H]
    g13 = x @ w13_ref
    gate, up = g13[:, :i_p], g13[:, i_p:]
    h = F.silu(gate) * up
    y = (h @ w2_ref) * w
    y_c = None
    if got is not None:
        # candidate: the repacked tensors in the model dtype, fp32 accumulation, each output rounded
        w13_c = _dequantize_kfirst(got, spec, "w13", dtype).float()
        w2_c = _dequantize_kfirst(got, spec, "w2", dtype).float()
        g13_c = (x_c @ w13_c).to(dtype).float()
        h_c = (F.silu(g13_c[:, :i_p]) * g13_c[:, i_p:]).to(dtype).float()
        y_c = ((h_c @ w2_c) * w).to(dtype).float()
    return y_c, y.double()


# ---- one report from the processes of a torchrun launch (verification.across) -------------------------------------------------------------------------------------------


def all_ranks_check(checked: list[int], not_checked: list[int], asked: bool) -> Check:
    """The `all_ranks` check of a verify that left ranks out: not required, not run, naming them."""
    n = len(checked) + len(not_checked)
    left = f"rank{'s' if len(not_checked) != 1 else ''} {', '.join(map(str, not_checked))} not checked"
    held = (f"--ranks {','.join(map(str, checked))} of {n}" if asked else
            f"a part holding rank{'s' if len(checked) != 1 else ''} {', '.join(map(str, checked))} of {n}")
    rerun = "verify without --ranks for that" if asked else "verify the parts copied together for that"
    return Check("all_ranks", "every rank present, and the ranks re-assembled into the checkpoint", required=False,
                 reason=f"{held}: {left}, nor the re-assembly across ranks ({rerun})")


def merge_reports(reports: list[VerifyReport], *, ep: bool, asked: bool) -> VerifyReport:
    """The report of one verify from its processes' reports (by process): each check as bad as its
    worst (FAIL, then not run), the findings of each check process by process (a finding every
    process makes, such as a manifest field, once), the ranks and files added up.  The numerics
    rows are the same in every process (`exchange_layer`): the first process's."""
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    checks = [c for c in first.checks if c.name != "all_ranks"]
    for check in checks:
        mine = [next(c for c in r.checks if c.name == check.name) for r in reports]
        worst = next((c for c in mine if c.status == FAIL), None) or next((c for c in mine if c.status == NOT_RUN), None)
        if worst is not None:
            check.status, check.reason = worst.status, worst.reason
    seen: set[tuple] = set()
    findings = []
    for name in [c.name for c in checks]:
        for report in reports:
            for f in report.by_check(name):
                key = (f.check, f.message, f.layer, f.rank, f.expert)
                if key not in seen:
                    seen.add(key)
                    findings.append(f)
    first.findings = findings
    first.files_checked = sum(r.files_checked for r in reports)
    first.experts_checked = (sum if ep else max)(r.experts_checked for r in reports)
    first.ranks_checked = sorted({x for r in reports for x in r.ranks_checked})
    first.ranks_not_checked = sorted(set.intersection(*(set(r.ranks_not_checked) for r in reports)))
    first.checks = checks
    if first.ranks_not_checked:
        first.checks.append(all_ranks_check(first.ranks_checked, first.ranks_not_checked, asked))
    for check in first.checks:  # "N findings" counted over every process
        bad = len(first.by_check(check.name))
        if check.status == FAIL and re.fullmatch(r"\d+ findings?", check.reason) and bad:
            check.reason = f"{bad} finding{'s' if bad != 1 else ''}"
    return first
