"""`repack`: plan -> stream experts -> per-rank layout -> staged files -> manifest -> commit.

A validation pass (the planner over every layer, every expert tensor's header) runs before the
first byte is written.  Work then proceeds layer by layer and, within a layer, in chunks of
experts: each chunk is read once and turned into every rank's tensors, which are written at their
final offsets.  Memory is bounded by the chunk size, not by the model.

A run may write only some ranks (`ranks`: a part with a manifest part) and may be one of several
processes (`group`, launched by torchrun; `wna16ctl.repacking.distributed` says which ranks each process
writes): every process plans, the owner of the staging directory prepares it, all write their
ranks into it, and the owner commits once every process has reported its file hashes.

Two data paths write the same bytes: `wna16ctl.repacking.native_path` (no torch; Marlin layers without
zero points, act-order or padding, on the CPU) and the torch code of `wna16ctl.layout` (every
other layer, and `--device cuda`).  File and source digests are BLAKE3 (`writer.FILE_HASH`).
"""

from __future__ import annotations

import ctypes
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from wna16ctl.version import __version__
from wna16ctl.native import simd
from wna16ctl import interrupts
from wna16ctl.repacking import distributed
from wna16ctl.output import outdir
from wna16ctl.output.manifest import FORMAT_NAME, FORMAT_VERSION, SIDE_FILES
from wna16ctl.planning import rules
from wna16ctl.sources import Checkpoint, MoELayer, open_checkpoint, source_fingerprint  # source_fingerprint: re-exported
from wna16ctl.sources.config import SCALE_ST_DTYPES
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.gidx import gate_up_g_idx_mismatch
from wna16ctl.sources.headers import INDEX_NAME
from wna16ctl.sources.moe import ROLE_ORDER
from wna16ctl.sources.raw import RawReader
from wna16ctl.errors import NotLoadable, UsageError
from wna16ctl.layout.registry import EXPERTS, expert_shapes, names as layout_names
from wna16ctl.layout.spec import AUTO, MARLIN, RankLayout
from wna16ctl.planning.config_parse import config_refusal
from wna16ctl.planning.engine_env import EngineSwitches, parse_env
from wna16ctl.planning.inspection import model_refusal
from wna16ctl.planning.moe import BACKEND_OF_LAYOUT, LayerPlan, local_expert_ranges, plan_layer
from wna16ctl.planning.tpsizes import check_tp_sizes, parse_tp_list
from wna16ctl.output.filestream import DEPTH, FileStream, depth_for
from wna16ctl.sink import TaskStarter, no_progress
from wna16ctl.output.writer import (
    FILE_HASH, JOURNAL_NAME, MANIFEST_NAME, PlannedFile, PlannedTensor, ReusedBuffer, StagedOutput, new_hasher,
    split_into_files,
)

# torch is imported only where a layer takes the torch data path (wna16ctl.repacking.native_path covers
# the common layers without it): its import alone costs longer than repacking a gigabyte.

LAYOUTS = (AUTO, *layout_names(EXPERTS))
# Packed input per expert chunk: a chunk and its outputs stay in the CPU caches from the read to
# the write and the hash (64 MiB chunks measured ~2x the system time: every stage went to DRAM).
# 8 MiB (3 experts of a Qwen3-30B-A3B layer) against 4 MiB (1): each chunk is mapped, built by
# both ranks' threads and unmapped once (an unmap interrupts the other core to flush its TLB), so
# fewer chunks measured 10 % less CPU time per run (bench/bench_repack.py, docs/performance.md).
_COPY_PIECE = 16 << 20  # non-expert tensors are copied (and re-digested) in pieces of this size
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class RepackSettings:
    tp: int
    ep: bool = False
    layout: str = "auto"
    max_shard_bytes: int = 4 << 30
    vllm: str = rules.NEWEST  # the release planned for (a member of rules.RELEASES)
    gpu: str = rules.DEFAULT_GPU
    env: tuple[tuple[str, str], ...] = ()  # the engine's environment overrides (planning/engine_env.py)
    moe_backend: str = "auto"  # the engine's --moe-backend

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # recorded only when given, so outputs of runs without them still --resume
        if not self.env:
            del out["env"]
        else:
            out["env"] = dict(self.env)
        if self.moe_backend == "auto":
            del out["moe_backend"]
        return out


@dataclass
class LayerJob:
    layer: MoELayer
    plan: LayerPlan
    layout: str
    specs: list[RankLayout]  # one per rank
    expert_ranges: list[range]  # experts held by each rank
    tensor_names: list[str]  # output parameter names (without the module prefix), in file order

    @property
    def _w2(self):  # W2ScaleSharding of the written layout
        return self.plan.layout_w2 or self.plan.w2

    def to_json(self) -> dict[str, Any]:
        spec = self.specs[0]
        return {
            "name": self.layer.prefix,
            "layout": self.layout,
            "num_experts": self.layer.num_experts,
            "hidden_size": self.layer.hidden_size,
            "intermediate_size": self.layer.intermediate_size,
            "scheme": self.layer.scheme.to_json() if self.layer.scheme else None,
            "quant_type": self.plan.quant_type,
            "is_k_full": self._w2.is_k_full,
            "load_full_w2": self._w2.load_full_w2,
            "intermediate_size_per_partition": self.plan.intermediate_size_per_partition,
            "padded_intermediate": spec.padded_intermediate,
            "expert_ranges": [[r.start, r.stop] for r in self.expert_ranges],
            "tensors": self.tensor_names,
            "plan": self.plan.to_json(),
        }


@dataclass
class RepackPlan:
    checkpoint: Checkpoint
    settings: RepackSettings
    jobs: list[LayerJob]
    copied: list[str]  # tensors copied unchanged into every rank
    files: list[list[PlannedFile]]  # per rank
    fingerprint: str
    scale_dtype_name: str  # config.json's torch_dtype: the dtype scales are written in ("bfloat16")
    units: dict[str, list[tuple]] = field(default_factory=dict)  # relpath -> work units writing into it
    memory: dict[str, Any] | None = None  # a dry run's per-rank memory of the deployment (planning.deployment)

    @property
    def scale_dtype(self) -> Any:  # torch.dtype
        import torch

        return getattr(torch, self.scale_dtype_name)

    @property
    def scale_st_dtype(self) -> str:
        return SCALE_ST_DTYPES[self.scale_dtype_name]

    @property
    def identity(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "source_fingerprint": self.fingerprint, "settings": self.settings.to_json(),
        }

    def input_bytes(self, ranks: Sequence[int] | None = None) -> int:
        """Bytes the run (or the process writing `ranks`) reads: packed experts once (under EP
        those of the ranks' experts), copied tensors once per rank."""
        ranks = range(len(self.files)) if ranks is None else ranks
        copied = sum(self.checkpoint.files.info(n).nbytes for n in self.copied)
        experts = 0
        for j in self.jobs:
            held = {e for r in ranks for e in j.expert_ranges[r]}
            experts += j.layer.packed_bytes * len(held) // max(j.layer.num_experts, 1)
        return experts + copied * len(ranks)

    def rank_bytes(self) -> list[int]:
        return [sum(f.size for f in files) for files in self.files]

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint.root),
            "fingerprint": self.fingerprint,
            "settings": self.settings.to_json(),
            "layers": [j.to_json() for j in self.jobs],
            "ranks": [
                {"rank": r, "bytes": b, "files": [f.relpath for f in self.files[r]]}
                for r, b in enumerate(self.rank_bytes())
            ],
        }


def _choose_layout(layer: MoELayer, plan: LayerPlan, requested: str) -> str:
    where = f"{layer.prefix} at TP {plan.tp}{' EP' if plan.ep else ''}"
    if plan.errors or plan.backend is None:
        why = list(plan.errors[:1] or ["no backend"])
        if plan.backend is None and plan.rejected:
            # "No WNA16 MoE backend supports ..." alone does not say why: name each backend's reason.
            why.append(", ".join(f"{b}: {r}" for b, r in plan.rejected.items()))
        loads = [v for v in rules.RELEASES if plan_layer(layer, plan.tp, plan.ep, v, plan.gpu).loadable]
        why.append(f"loads on vLLM {rules.span(loads)}" if loads else "no known vLLM release loads it")
        # the engine's sentences end with a full stop: joined by semicolons, without it
        raise NotLoadable(f"vLLM {plan.vllm} refuses {where}: " + "; ".join(w.rstrip(".") for w in why))
    if plan.layout is None:
        raise NotLoadable(f"{where}: vLLM {plan.vllm} runs it on {plan.backend.value}, and neither the Marlin nor "
                          "the Triton layout applies to it, so there is nothing wna16ctl can write")
    if requested == AUTO:
        return plan.layout
    backend = BACKEND_OF_LAYOUT[requested]  # the backend that reads the requested layout
    reason = plan.rejected.get(backend.value)
    if reason and not reason.startswith("lower priority"):
        raise NotLoadable(f"{layer.prefix}: cannot write the {requested} layout: {reason}")
    return requested


def expert_layers(ck: Checkpoint) -> list[MoELayer]:
    """The quantized MoE layers whose experts repack rewrites (and whose data it checks): the
    decoder's and the MTP layers' (repacked like the decoder's)."""
    return ck.quantized_layers + ck.quantized_mtp_layers


def check_expert_data(ck: Checkpoint, *, values: bool = False) -> None:
    """What repack refuses in the experts' data before anything is committed, and so does pad (one
    rule for both): every act-order g_idx a valid group assignment and gate and up carrying the same
    one (the engine keeps one copy for w13; sources/gidx.py); with `values` also every scale finite
    and every legacy zero point in range.  repack checks those two as it reads each chunk of experts
    (no second read); pad, which copies bytes without reading them as numbers, asks for them here,
    before it writes.  Reads only the small g_idx, scale and zero point tensors."""
    layers = expert_layers(ck)
    _check_g_idx(ck, layers)
    if values:
        from wna16ctl.repacking.native_path import check_scale_tensors

        check_scale_tensors(ck.files, [ck.files.info(layer.stored_name(e, role, SCALES))
                                       for layer in layers for e in range(layer.num_experts) for role in ROLE_ORDER])
        _check_legacy_zero_points(ck, layers)


def _check_g_idx(ck: Checkpoint, layers: list[MoELayer]) -> None:
    act = [layer for layer in layers if layer.scheme is not None and layer.scheme.act_order]
    if not act:
        return
    from wna16ctl.sources.tensors import TensorReader, check_g_idx

    with TensorReader(ck.files) as reader:
        for layer in act:
            for e in range(layer.num_experts):
                for role, k in (("gate", layer.hidden_size), ("up", layer.hidden_size), ("down", layer.intermediate_size)):
                    name = layer.stored_name(e, role, G_IDX)
                    if name in ck.files:  # old writers skipped unset g_idx: then k // group_size
                        check_g_idx(reader.read(name), name, k, layer.scheme.group_size)  # type: ignore[union-attr]  # act-order layers are quantized
    for layer in act:
        problem = gate_up_g_idx_mismatch(ck.files, layer)
        if problem is not None:
            raise NotLoadable(problem)


def _check_legacy_zero_points(ck: Checkpoint, layers: list[MoELayer]) -> None:
    """Unpacked signed zero points (compressed-tensors <= 0.9.3) within the bit width, read as
    repack's torch path reads them (`TensorReader.zero_point`); packed ones hold any code."""
    legacy = []
    for layer in layers:
        s = layer.scheme
        if s is None or s.symmetric:
            continue
        for e in range(layer.num_experts):
            for role in ROLE_ORDER:
                name = layer.stored_name(e, role, ZERO_POINTS)
                if name not in ck.files:
                    continue
                n_rows = ck.files.info(layer.stored_name(e, role, CODES)).shape[0]
                zp = ck.files.info(name)
                if zp.dtype != "I32" or zp.shape[0] == n_rows:
                    groups = ck.files.info(layer.stored_name(e, role, SCALES)).shape[1]
                    legacy.append((name, n_rows, groups, s.num_bits))
    if not legacy:
        return
    from wna16ctl.sources.tensors import TensorReader

    with TensorReader(ck.files) as reader:
        for name, n_rows, groups, bits in legacy:
            reader.zero_point(name, n_rows, groups, bits)


def _releases_that_load(ck: Checkpoint, layers: list[MoELayer], settings: RepackSettings,
                        switches: EngineSwitches) -> str:
    """'loads on vLLM 0.29.0–0.33.0' (or 'no known vLLM release loads it'): the releases that parse
    the config and load every repacked MoE layer and the model around them at these settings."""
    tp, ep, gpu = settings.tp, settings.ep, settings.gpu
    loads = [v for v in rules.RELEASES if config_refusal(ck.config.quant, v) is None
             and all(plan_layer(lay, tp, ep, v, gpu, switches).loadable for lay in layers)
             and model_refusal(ck, tp, ep, v, gpu, switches) is None]
    return f"loads on vLLM {rules.span(loads)}" if loads else "no known vLLM release loads it"


def plan_repack(ckpt_path: str | os.PathLike[str], settings: RepackSettings) -> RepackPlan:
    """Validate everything and lay out every output file; writes nothing."""
    if settings.layout not in LAYOUTS:
        raise UsageError(f"--layout {settings.layout!r} is not one of {', '.join(LAYOUTS)}")
    parse_tp_list(settings.tp, single=True)
    if settings.vllm not in rules.RELEASES:
        raise UsageError(f"vLLM {settings.vllm} is not a release the rulebook knows ({', '.join(rules.RELEASES)})")
    if settings.gpu not in rules.GPUS:
        raise UsageError(f"--gpu {settings.gpu!r} is not one of {', '.join(rules.GPUS)}")
    try:
        switches = EngineSwitches(parse_env(dict(settings.env)), settings.moe_backend)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ck = open_checkpoint(ckpt_path)
    layers = expert_layers(ck)
    if layers:  # (none: not a WNA16 checkpoint, said below)
        ck.require_shape_keys()
    refusal = config_refusal(ck.config.quant, settings.vllm)
    if refusal is not None:
        raise NotLoadable(f"vLLM {settings.vllm} refuses {ck.root} at config parse: {refusal.text()}; "
                          + _releases_that_load(ck, layers, settings, switches))
    if not layers:
        ck.require_wna16_moe()
    check_tp_sizes(layers, (settings.tp,), settings.ep)
    scale_dtype = SCALE_ST_DTYPES[ck.config.torch_dtype]  # torch_dtype is one of config.SCALE_DTYPES
    n_ranks = settings.tp
    jobs: list[LayerJob] = []
    for layer in layers:
        plan = plan_layer(layer, settings.tp, settings.ep, settings.vllm, settings.gpu, switches)
        layout = _choose_layout(layer, plan, settings.layout)
        pad = plan.padded_intermediate if layout == MARLIN else plan.intermediate_size_per_partition
        assert layer.scheme is not None
        if settings.ep:
            ranges = local_expert_ranges(layer.num_experts, n_ranks)
        else:
            ranges = [range(layer.num_experts)] * n_ranks
        specs = [
            RankLayout(
                layout=layout, num_bits=layer.scheme.num_bits, group_size=layer.scheme.group_size,
                symmetric=layer.scheme.symmetric, act_order=layer.scheme.act_order,
                hidden_size=layer.hidden_size, intermediate_size=layer.intermediate_size,
                tp=plan.moe_tp, rank=0 if settings.ep else r,
                load_full_w2=(plan.layout_w2 or plan.w2).load_full_w2,  # type: ignore[union-attr]  # a plan that loads has one
                padded_intermediate=pad or plan.intermediate_size_per_partition,
            )
            for r in range(n_ranks)
        ]
        names = list(expert_shapes(specs[0], scale_dtype))
        jobs.append(LayerJob(layer, plan, layout, specs, ranges, names))

    # the model around the experts (heads, KV heads, vocabulary, quantized linear layers): what
    # inspect refuses, repack refuses, so no output is written for a model the release does not load
    refused = model_refusal(ck, settings.tp, settings.ep, settings.vllm, settings.gpu, switches)
    if refused is not None:
        raise NotLoadable(f"vLLM {settings.vllm} refuses {ck.root} at TP {settings.tp}{' EP' if settings.ep else ''}: "
                          f"{refused}; " + _releases_that_load(ck, layers, settings, switches))
    check_expert_data(ck)  # every act-order g_idx a valid group assignment, gate's and up's the same
    repacked = {
        layer.tensor_name(e, role, suffix)
        for job in jobs for layer in [job.layer] for e in range(layer.num_experts) for role in ROLE_ORDER
        for suffix in layer.fmt.names.quantized
    }
    copied = [n for n in ck.files.names() if n not in repacked]

    files: list[list[PlannedFile]] = []
    units: dict[str, list[tuple]] = {}
    # Output tensors are grouped by kind (w13_weight_packed of every layer, then w2_weight_packed,
    # ...), each kind in files of its own: reading the experts chunk by chunk then fills every file
    # front to back, so each is hashed as it is written and needs no read-back (wna16ctl.output.filestream).
    kinds = list(dict.fromkeys(k for job in jobs for k in job.tensor_names))
    for r in range(n_ranks):
        sections: list[tuple[list[list[PlannedTensor]], list[tuple]]] = []
        groups: list[list[PlannedTensor]] = []
        group_units: list[tuple] = []
        cur: list[PlannedTensor] = []
        size = 0
        for name in copied:  # non-expert tensors in groups of at most ~1/4 shard
            info = ck.files.info(name)
            cur.append(PlannedTensor(name, info.dtype, info.shape))
            size += info.nbytes
            if size >= settings.max_shard_bytes // 4:
                groups.append(cur)
                group_units.append(("copy", tuple(t.name for t in cur)))
                cur, size = [], 0
        if cur:
            groups.append(cur)
            group_units.append(("copy", tuple(t.name for t in cur)))
        sections.append((groups, group_units))
        for kind in kinds:
            groups, group_units = [], []
            for j, job in enumerate(jobs):
                n_local = len(job.expert_ranges[r])
                shapes = expert_shapes(job.specs[r], scale_dtype)
                if n_local == 0 or kind not in shapes:
                    continue
                shape, dt = shapes[kind]
                groups.append([PlannedTensor(f"{job.layer.prefix}.{kind}", dt, (n_local, *shape))])
                group_units.append(("layer", j))
            sections.append((groups, group_units))
        pieces = [(split_into_files(g, f"rank-{r}/", settings.max_shard_bytes), g, gu) for g, gu in sections if g]
        n_files = sum(len(fs) for fs, _, _ in pieces)
        rank_files: list[PlannedFile] = []
        for fs, groups, group_units in pieces:
            gi = 0
            for f in fs:  # numbered across the rank: model-00001-of-0000N, ...
                f.relpath = f"rank-{r}/model-{len(rank_files) + 1:05d}-of-{n_files:05d}.safetensors"
                names_in_file = {t.name for t in f.tensors}
                units[f.relpath] = []
                while gi < len(groups) and groups[gi][0].name in names_in_file:
                    units[f.relpath].append(group_units[gi])
                    gi += 1
                rank_files.append(f)
        files.append(rank_files)
    return RepackPlan(ck, settings, jobs, copied, files, source_fingerprint(ck), ck.config.torch_dtype, units)


@dataclass
class RepackResult:
    out: Path
    files_written: int
    files_reused: int
    bytes_written: int
    manifest: dict[str, Any]  # the manifest, or the manifest part of an output holding some ranks
    ranks: list[int] = field(default_factory=list)  # the ranks OUT holds
    manifest_name: str = MANIFEST_NAME  # wna16ctl.json, or the part's wna16ctl.part-R_R.json
    processes: list[dict[str, Any]] = field(default_factory=list)  # per process that wrote into OUT
    committed: bool = True  # False in a process that wrote its ranks into another process's OUT
    simd: str | None = None  # this process's native tile loop (wna16ctl.native.simd); None: no layer took the native path
    plan: Any = None  # what was executed: a RepackPlan, or the vllm layout's VllmStatePlan
    layout_json: dict[str, Any] | None = None  # a layout's own JSON form of the result (the vllm layout's)

    def to_json(self) -> dict[str, Any]:
        if self.layout_json is not None:
            return self.layout_json
        return {
            "output": str(self.out),
            "files_written": self.files_written,
            "files_reused": self.files_reused,
            "bytes_written": self.bytes_written,
            "simd": self.simd,
            "ranks": self.ranks,
            "manifest_name": self.manifest_name,
            "processes": self.processes,
            "manifest": self.manifest,
            "next_steps": [s.to_json() for s in self.next_steps],
        }

    @property
    def next_steps(self) -> list[Any]:
        """How to serve what was written (planning.next_steps); none for a part (assemble it first)."""
        from wna16ctl.planning.serving import output_serve_path

        checkpoint = getattr(self.plan, "checkpoint", None)
        step = output_serve_path(self.manifest, self.out, checkpoint) if self.committed else None
        return [] if step is None else [step]


def _expert_chunks(job: LayerJob) -> list[range]:
    """Expert ranges read at once: bounded bytes, never straddling a rank boundary under EP."""
    layer = job.layer
    per_expert = max(1, layer.packed_bytes // max(layer.num_experts, 1))
    step = max(1, _CHUNK_BYTES // per_expert)
    bounds = sorted({0, layer.num_experts, *(r.start for r in job.expert_ranges), *(r.stop for r in job.expert_ranges)})
    out: list[range] = []
    for a, b in zip(bounds, bounds[1:]):
        out.extend(range(s, min(s + step, b)) for s in range(a, b, step))
    return out


def _identity_differences(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'tp: 2 in OUT, 1 now'-style descriptions of where two run identities differ."""
    out: list[str] = []
    rec_settings, want_settings = recorded.get("settings") or {}, wanted.get("settings") or {}
    for key in want_settings:
        if rec_settings.get(key) != want_settings[key]:
            out.append(f"{key}: {rec_settings.get(key)!r} there, {want_settings[key]!r} now")
    if recorded.get("source_fingerprint") != wanted.get("source_fingerprint"):
        out.append("source: another checkpoint, or the checkpoint changed since")
    for key in ("format", "format_version", "tool_version"):
        if recorded.get(key) != wanted.get(key):
            out.append(f"{key}: {recorded.get(key)!r} there, {wanted.get(key)!r} now")
    return out or ["the recorded identity is unreadable"]


def _check_previous_run(plan: RepackPlan, out_path: Path, *, resume: bool) -> str | None:
    """Before the writer takes over: name the settings that differ when --resume cannot reuse
    OUT; return the notice to give once a staging directory of an interrupted run is discarded."""
    stage = outdir.stage_path(out_path)
    if outdir.in_use(stage):  # a run writing it now, not an interrupted one: refused alike with --resume
        raise outdir.busy(out_path)
    # the owner's journal, else another process's part (a multi-process run whose owner wrote none)
    journals = [_read_json_file(stage / e.name) for e in sorted(os.scandir(stage), key=lambda e: e.name != JOURNAL_NAME)
                if outdir.is_journal_name(e.name)] if stage.is_dir() else []
    journal = next((j for j in journals if j and j.get("identity") == plan.identity), None) or next(
        (j for j in journals if j), None)
    journal_matches = journal is not None and journal.get("identity") == plan.identity
    if resume and not journal_matches and out_path.is_dir() and any(out_path.iterdir()):
        manifest = _read_json_file(out_path / MANIFEST_NAME)
        if manifest is not None and manifest.get("identity") != plan.identity:
            raise UsageError(
                f"{out_path}: holds output for another source or other settings, so --resume cannot reuse it ("
                + "; ".join(_identity_differences(manifest.get("identity") or {}, plan.identity))
                + "); repeat the original settings, or use --force to replace it"
            )
    if resume and journal is not None and not journal_matches:
        # --resume asks to continue that run: throwing it away is --force's to ask for
        raise UsageError(
            f"{stage}: the interrupted run there was made from another source or with other settings, so --resume "
            "cannot continue it (" + "; ".join(_identity_differences(journal.get("identity") or {}, plan.identity))
            + "); repeat the original settings, or use --force to start over"
        )
    if stage.is_dir() and not (resume and journal_matches):
        why = "it records no finished file" if resume else "this run does not --resume it"
        return f"discarded {stage}, the staging directory of an interrupted run: {why}"
    return None


def _read_json_file(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_repack(
    plan: RepackPlan,
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    resume: bool = False,
    progress: TaskStarter | None = None,
    device: str = "auto",
    notice: Callable[[str], None] | None = None,
    ranks: Sequence[int] | None = None,
    node_local: bool = False,
    group: distributed.Group | None = None,
) -> RepackResult:
    """Execute `plan` into `out` (staged, then renamed); see module doc.

    `progress(description, total, unit=...)` starts a progress step and returns its advance
    function (`wna16ctl.sink.Sink.tasks`); `notice(message)` receives what the user should know
    on the way (a discarded staging directory).  `ranks`: write only these TP ranks (OUT gets a
    manifest part).  `group`: this process's place in a multi-process run (default: alone);
    `node_local`: OUT is a separate directory on each node, committed by the node's first process.

    Three steps: open the staging directory (`_open_staged`), write this process's ranks into it
    (`_write_ranks`, which runs `_execute`), and build the manifest and commit (`_commit_output`)."""
    group = group or distributed.SOLO
    tp = plan.settings.tp
    if ranks is not None and (not ranks or any(not 0 <= r < tp for r in ranks)):
        raise UsageError(f"ranks {list(ranks)}: each must be a rank of --tp {tp} (0 to {tp - 1})")
    subset = None if ranks is None else sorted(set(ranks))
    try:
        out_path = Path(out).resolve()  # "-o ." has no name to stage beside and rename
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise UsageError(f"{out}: cannot be resolved ({getattr(e, 'strerror', None) or e}); choose another -o") from None
    place = _place_in_group(group, tp, subset, node_local)
    staged, dev, discarded = _open_staged(plan, out_path, place, group, force=force, resume=resume, device=device)
    if discarded and notice is not None:
        notice(discarded)
    if staged.owner and staged.reusable and notice is not None:
        # checking them reads every byte (minutes for a large output): said, so a run that found
        # an output committed meanwhile does not look like one waiting for another run
        notice(f"--resume: checking the files an earlier run finished for {out_path} before reusing them")
    start = (progress or no_progress) if place.is_owner else no_progress
    exec_device = "cpu" if dev == "cpu" else ("cuda" if device == "cuda" else "auto")
    reports, simd_path = _write_ranks(plan, staged, place, group, start, exec_device)
    ours = [r for r in reports if r["process"] in place.writers]
    manifest, name = _commit_output(plan, staged, place, group, ours, out_path)
    processes = [{k: r[k] for k in ("process", "node", "ranks", "files_written", "files_reused", "bytes_written", "simd")}
                 for r in ours]
    return RepackResult(staged.out, sum(r["files_written"] for r in ours), sum(r["files_reused"] for r in ours),
                        sum(r["bytes_written"] for r in ours), manifest, place.out_ranks, name, processes,
                        committed=place.is_owner, simd=simd_path)


@dataclass(frozen=True)
class _Place:
    """This process's place in a run: the ranks it writes, who writes into its OUT, who owns OUT
    (prepares, locks and commits it)."""

    me: distributed.Launch
    mine: list[int]  # the TP ranks this process writes
    writers: list[int]  # the processes that write into this process's OUT
    out_ranks: list[int]  # the TP ranks this process's OUT holds once every writer is done
    owner: int  # the process that owns this process's OUT

    @property
    def is_owner(self) -> bool:
        return self.me.rank == self.owner


def _place_in_group(group: distributed.Group, tp: int, subset: list[int] | None, node_local: bool) -> _Place:
    """Where this process stands; a UsageError, in every process alike, when a node would write no rank."""
    me = group.launch
    owner = group.node_owner(me.node) if node_local else 0
    writers = [m.rank for m in group.members if not node_local or m.node == me.node]
    mine = distributed.ranks_of_process(tp, me.rank, me.world_size, subset)
    out_ranks = sorted(r for w in writers for r in distributed.ranks_of_process(tp, w, me.world_size, subset))
    if node_local:  # every process knows every member: all refuse alike, before anything is written
        for node in sorted({m.node for m in group.members}):
            if not any(distributed.ranks_of_process(tp, m.rank, me.world_size, subset) for m in group.node_members(node)):
                raise UsageError(
                    f"--node-local: the processes of node {node} would write no rank (rank r is written by process r "
                    f"mod {me.world_size}, of {len(subset) if subset else tp} rank(s)); start fewer processes or "
                    "repack a larger --tp")
    return _Place(me, mine, writers, out_ranks, owner)


def _open_staged(plan: RepackPlan, out_path: Path, place: _Place, group: distributed.Group, *, force: bool,
                 resume: bool, device: str) -> tuple[StagedOutput, str, str | None]:
    """(the staging directory of OUT, the device this process repacks on, the notice of a discarded
    earlier staging directory): the owner prepares and locks it, every other writer joins it."""
    held: list[StagedOutput] = []
    me = place.me

    def prepare() -> tuple[str, str | None]:
        dev = distributed.select_device(repack_device(device), me)
        if not place.is_owner:
            return dev, None
        discarded = _check_previous_run(plan, out_path, resume=resume)
        # OUT, its staging and previous-output names must be clear of the checkpoint (outdir.py)
        held.append(StagedOutput(out_path, force=force, resume=resume, identity=plan.identity,
                                 checkpoint=plan.checkpoint.root))
        return dev, discarded

    try:
        dev, discarded = group.together("preparing the output directory", prepare)
        # the owner announces its staging directory (run id) and what it adopted from an earlier run
        announced = group.all_gather((held[0].run, held[0].reusable) if held else None)
        if not place.is_owner:
            run_id, reusable = announced[place.owner]
            held.append(group.together("joining the output directory", lambda: StagedOutput(
                out_path, force=force, resume=resume, identity=plan.identity, checkpoint=plan.checkpoint.root,
                process=me.rank, join=run_id, reusable=reusable)))
        else:
            group.together("joining the output directory", lambda: None)
    except BaseException:
        if held and held[0].owner:
            held[0].release()
        raise
    return held[0], dev, discarded


def _write_ranks(plan: RepackPlan, staged: StagedOutput, place: _Place, group: distributed.Group,
                 start: TaskStarter, exec_device: str) -> tuple[list[dict[str, Any]], str | None]:
    """Write this process's ranks (the owner also the side files) into `staged`; (every process's
    report of what it wrote, this process's native tile loop or None)."""
    me = place.me

    def write() -> tuple[int, int, int, str | None]:
        # worker threads build into mapped windows and output buffers this thread frees when it
        # unwinds: a Ctrl-C is raised only between chunks (interrupts.check), never mid-build
        with interrupts.deferred():
            simd_path = _native_simd(plan, exec_device)  # refuses a WNA16CTL_SIMD level the CPU lacks first
            counts = _execute(plan, staged, start, exec_device, place.mine, side_files=place.is_owner, launch=me)
            staged.collect_hashes() if place.is_owner else staged.close()  # hashed, synced, journaled
        return (*counts, simd_path)

    try:
        written, reused, nbytes, simd_path = group.together("writing", write)
        reports = group.all_gather({
            "process": me.rank, "node": me.node, "ranks": place.mine, "files_written": written,
            "files_reused": reused, "bytes_written": nbytes, "simd": simd_path, "done": staged.done,
            "sources": staged.sources})
    except KeyboardInterrupt:
        with interrupts.deferred():  # a second Ctrl-C waits until the pools are down and the journal written
            staged.abort(keep_for_resume=True)
        raise
    except BaseException:
        # alone: a failure discards the staging directory; with other processes their finished
        # work is in it (and the failure may be theirs): keep it for --resume
        with interrupts.deferred():
            staged.abort(keep_for_resume=group.world_size > 1)
        raise
    return reports, simd_path


def _commit_output(plan: RepackPlan, staged: StagedOutput, place: _Place, group: distributed.Group,
                   ours: list[dict[str, Any]], out_path: Path) -> tuple[dict[str, Any], str]:
    """The owner builds the manifest (or manifest part) from every writer's report and commits OUT;
    every process then learns whether the commit held.  (the manifest, its file name)."""
    complete = place.out_ranks == list(range(plan.settings.tp))
    name = MANIFEST_NAME if complete else outdir.part_manifest_name(place.out_ranks)
    manifest: dict[str, Any] = {}
    error: BaseException | None = None
    if place.is_owner:
        try:
            for r in ours:
                staged.done.update(r["done"])
                staged.sources.update(r["sources"])
            manifest = build_manifest(plan, staged.done, staged.stage)
            if not complete:
                manifest["part"] = {"ranks": place.out_ranks}
            # OUT moves aside and the staging directory takes its place: both renames or neither.
            # A Ctrl-C meanwhile comes too late to stop anything: the output is complete.
            with interrupts.deferred() as deferral:
                staged.commit(manifest, name)
                deferral.forget()
        except BaseException as e:  # re-raised once the others know
            error = e
            if outdir.is_real_dir(staged.stage):  # not renamed: keep everything for --resume
                staged.abort(keep_for_resume=group.world_size > 1 or isinstance(e, KeyboardInterrupt))
    try:
        outcomes = group.all_gather(None if error is None else distributed.outcome_of(error))
    except distributed.PeerFailed:
        if error is None and place.is_owner:  # committed: a peer that vanished since changes nothing here
            outcomes = [None] * group.world_size
        else:
            raise
    if error is not None:
        raise group.shared(error)
    if outcomes[place.owner] is not None:
        code, message = outcomes[place.owner]
        raise group.shared(distributed.PeerFailed(
            f"process {place.owner} failed while committing {out_path}: {message}", code))
    return manifest, name


def _digest(parts: list[str]) -> str:
    h = new_hasher()
    h.update("\n".join(parts).encode())
    return h.hexdigest()


class _SourceDigests:
    """Digests of the source bytes each output file is made from: its resume key.

    A copy unit's digest covers its tensors' bytes; a layer unit's digest, per rank, covers every
    byte read for the experts that rank holds (chunk by chunk, in read order: the reader feeds the
    bytes it reads to a hasher, so no second pass over the data).  A file's digest is that of its
    units' digests in order.
    """

    def __init__(self, plan: RepackPlan):
        self.plan = plan
        self.copy: dict[tuple, str] = {}
        self.chunks: dict[int, dict[int, str]] = {}  # layer -> chunk start -> digest

    def add_chunk(self, j: int, chunk: range, digest: str) -> None:
        self.chunks.setdefault(j, {})[chunk.start] = digest

    def unit(self, u: tuple, rank: int) -> str:
        if u[0] == "copy":
            return self.copy[u]
        job = self.plan.jobs[u[1]]
        rng = job.expert_ranges[rank]
        got = self.chunks[u[1]]
        return _digest([got[c.start] for c in _expert_chunks(job) if c.start in rng])

    def file(self, f: PlannedFile) -> str:
        rank = int(f.relpath.split("/", 1)[0].removeprefix("rank-"))
        return _digest([f.relpath] + [self.unit(u, rank) for u in self.plan.units[f.relpath]])


def _read_layer_chunk(reader: Any, job: LayerJob, chunk: range) -> tuple[list, str]:
    """The torch path's read of a chunk (a TensorReader): experts as tensors, and their digest."""
    h = new_hasher()
    reader.hasher = h
    try:
        experts = [reader.read_expert(job.layer, e) for e in chunk]
    finally:
        reader.hasher = None
    return experts, h.hexdigest()


def _digest_view(view: memoryview) -> str:
    h = new_hasher()
    h.update(view)  # releases the GIL: runs beside the native build of the same chunk
    return h.hexdigest()


def _copy_tensor(reader: RawReader, info: Any, targets: list[tuple[StagedOutput, PlannedFile, int]],
                 h: Any, buf: ReusedBuffer) -> None:
    """Copy one non-expert tensor into every target file (none: only digest it), digesting its
    bytes once."""
    for start in range(info.start, info.end, buf.size):
        interrupts.check()
        n = min(buf.size, info.end - start)
        sub = type(info)(info.name, info.dtype, (), info.file, start, start + n)
        view = buf.view()[:n]
        reader.read_into(sub, view)
        h.update(view)
        for staged, f, offset in targets:
            staged.pwrite(f, offset + (start - info.start), view)


def _chunk_digest(plan: RepackPlan, job: LayerJob, reader: RawReader, chunk: range,
                  builder: Any | None) -> str:
    """The source digest of one chunk, by whichever path reads that layer (the same bytes in the
    same order, so the same digest)."""
    if builder is not None:
        return _digest_view(builder.read(reader, chunk, 0))
    return _read_layer_chunk(reader, job, chunk)[1]


def _verify_reusable(plan: RepackPlan, staged: StagedOutput, reader: RawReader,
                     candidates: list[PlannedFile], digests: _SourceDigests,
                     builders: dict[int, Any]) -> list[PlannedFile]:
    """Re-digest the source bytes the candidate files were made from; return those still valid."""
    needed: dict[tuple, set[int]] = {}
    for f in candidates:
        rank = int(f.relpath.split("/", 1)[0].removeprefix("rank-"))
        for u in plan.units[f.relpath]:
            needed.setdefault(u, set()).add(rank)
    ck = plan.checkpoint
    buf = ReusedBuffer(_COPY_PIECE)
    for u, ranks in needed.items():
        if u[0] == "copy":
            h = new_hasher()
            for name in u[1]:
                _copy_tensor(reader, ck.files.info(name), [], h, buf)  # no targets: digest only
            digests.copy[u] = h.hexdigest()
            continue
        job = plan.jobs[u[1]]
        wanted = [job.expert_ranges[r] for r in ranks]
        for chunk in _expert_chunks(job):
            if any(chunk.start in rng for rng in wanted):
                digests.add_chunk(u[1], chunk, _chunk_digest(plan, job, reader, chunk, builders.get(u[1])))
    return [f for f in candidates if staged.reuse(f, digests.file(f))]


def _all_native(plan: RepackPlan) -> bool:
    """Whether the native CPU path builds every layer of `plan` (then no GPU is looked for)."""
    from wna16ctl.repacking import native_path as repack_native

    return all(repack_native.unsupported(j.layer, j.specs[0], plan.scale_st_dtype, "auto") is None for j in plan.jobs)


def _native_builders(plan: RepackPlan, device: str) -> dict[int, Any]:
    """Layer index -> repack_native.LayerBuilder for the layers the native path covers."""
    from wna16ctl.repacking import native_path as repack_native

    out: dict[int, Any] = {}
    buffers = repack_native.Buffers()  # one set for all layers: memory stays at two chunks
    level = None
    for j, job in enumerate(plan.jobs):
        if repack_native.unsupported(job.layer, job.specs[0], plan.scale_st_dtype, device) is None:
            if level is None:
                level = simd.resolve()[0]  # WNA16CTL_SIMD, checked against the CPU
            most = max(len(c) for c in _expert_chunks(job))
            out[j] = repack_native.LayerBuilder(plan.checkpoint.files, job.layer, job.specs, buffers,
                                                plan.scale_st_dtype, most, level)
    return out


def _native_simd(plan: RepackPlan, device: str) -> str | None:
    """The tile loop the native rank builder runs for `plan` on this CPU (wna16ctl.native.simd), or None
    when no layer takes the native data path."""
    from wna16ctl.repacking import native_path as repack_native

    if all(repack_native.unsupported(j.layer, j.specs[0], plan.scale_st_dtype, device) is not None for j in plan.jobs):
        return None
    return simd.resolve()[1]


def _execute(plan: RepackPlan, staged: StagedOutput, start: TaskStarter, device: str, ranks: list[int],
             side_files: bool = True, launch: distributed.Launch = distributed.SOLO.launch) -> tuple[int, int, int]:
    """Write the files of `ranks` (and the side files) into `staged`; returns (files written,
    files reused, tensor bytes written).  The caller commits."""
    ck = plan.checkpoint
    by_rel = {f.relpath: f for r in ranks for f in plan.files[r]}
    digests = _SourceDigests(plan)
    if device == "cuda":
        marlin_repacker(device)  # refuses --device cuda without a usable GPU before any work
    builders = _native_builders(plan, device)
    if len(builders) == len(plan.jobs):
        with RawReader(ck.files) as raw:
            return _execute_streamed(plan, staged, raw, builders, by_rel, start, ranks, side_files, launch)
    # some layer takes the torch data path: read through a TensorReader
    advance = start("repacking", plan.input_bytes(ranks), unit="bytes")
    from wna16ctl.sources.tensors import TensorReader

    writer = _BackgroundWrites(staged)
    hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wna16ctl-digest")
    with TensorReader(ck.files) as reader, writer, hash_pool:
        candidates = [f for f in by_rel.values() if staged.staged_file_matches(f)]
        reused_files = ({f.relpath for f in _verify_reusable(plan, staged, reader, candidates, digests, builders)}
                        if candidates else set())
        pending = {rel: f for rel, f in by_rel.items() if rel not in reused_files}
        staged.check_space(sum(f.size for f in pending.values()))
        files = _PendingFiles(plan, staged, digests, pending, launch)
        # 1. non-expert tensors, read once, digested, written into every rank that still needs them
        written = _copy_non_expert(plan, staged, reader, files, digests, advance)
        # 2. expert layers
        layer_io = _LayerIO(staged, reader, writer, hash_pool, digests, marlin_repacker(device), advance)
        for j in range(len(plan.jobs)):
            written += _repack_layer(plan, j, builders.get(j), files, layer_io)
        _write_side_files(plan, staged, ranks, side_files)
    return len(pending), len(by_rel) - len(pending), written


class _PendingFiles:
    """The files still to write, and the units of each still to come: a file is finished (hashed
    and journaled) once its last unit is written."""

    def __init__(self, plan: RepackPlan, staged: StagedOutput, digests: _SourceDigests,
                 pending: dict[str, PlannedFile], launch: distributed.Launch):
        self.staged, self.digests, self.launch = staged, digests, launch
        self.remaining = {rel: len(plan.units[rel]) for rel in pending}
        self.unit_file = _files_by_unit(plan, pending.values())
        self.unit_end: dict[tuple[str, tuple], int] = {}  # (file, unit) -> the end offset of the unit's bytes
        for rel, f in pending.items():
            ends = {t.name: f.offsets[t.name] + t.nbytes for t in f.tensors}
            for u in plan.units[rel]:
                names = u[1] if u[0] == "copy" else [n for n in ends if n.startswith(plan.jobs[u[1]].layer.prefix + ".")]
                self.unit_end[(rel, u)] = max(ends[n] for n in names)
        self.copy_units = list(dict.fromkeys(u for rel in sorted(pending) for u in plan.units[rel] if u[0] == "copy"))

    def of(self, u: tuple) -> list[PlannedFile]:
        """The pending files unit `u` goes into."""
        return self.unit_file.get(u, [])

    def unit_done(self, u: tuple) -> None:
        staged = self.staged
        for f in self.of(u):
            self.remaining[f.relpath] -= 1
            if self.remaining[f.relpath] == 0:
                staged.finish(f, self.digests.file(f))
            else:  # units fill a file front to back: everything before this unit's end is final
                staged.written_upto(f, self.unit_end[(f.relpath, u)])
        staged.checkpoint_journal()
        if any(self.remaining[f.relpath] == 0 for f in self.of(u)):
            distributed.kill_after_first_file_for_tests(self.launch, staged.collect_hashes)


def _copy_non_expert(plan: RepackPlan, staged: StagedOutput, reader: RawReader, files: _PendingFiles,
                     digests: _SourceDigests, advance: Callable[[int], None]) -> int:
    """Copy each non-expert tensor into every pending file that holds it, digesting its bytes
    once; returns the bytes written."""
    ck = plan.checkpoint
    written = 0
    buf = ReusedBuffer(_COPY_PIECE)
    for u in files.copy_units:
        interrupts.check()
        for f in files.of(u):
            staged.open(f)
        h = new_hasher()
        for name in u[1]:
            info = ck.files.info(name)
            _copy_tensor(reader, info, [(staged, f, f.offsets[name]) for f in files.of(u)], h, buf)
            written += info.nbytes * len(files.of(u))
            advance(info.nbytes * len(files.of(u)))
        digests.copy[u] = h.hexdigest()
        files.unit_done(u)
    return written


@dataclass
class _LayerIO:
    """What writing an expert layer uses: the staging directory, the checkpoint reader, the
    background writer and digest thread, the source digests, the torch path's Marlin repack and
    the progress."""

    staged: StagedOutput
    reader: Any  # a TensorReader
    writer: _BackgroundWrites
    hash_pool: ThreadPoolExecutor
    digests: _SourceDigests
    repack_weights: Any
    advance: Callable[[int], None]


def _repack_layer(plan: RepackPlan, j: int, builder: Any | None, files: _PendingFiles, io: _LayerIO) -> int:
    """Read expert layer `j` chunk by chunk and write every pending rank file's tensors of it
    (`builder`: the native path's, else the torch path); returns the tensor bytes written."""
    job = plan.jobs[j]
    u = ("layer", j)
    layer = job.layer
    targets = _layer_targets(job, files.of(u))
    if not targets:
        return 0
    for by_name in targets.values():
        for f in by_name.values():
            io.staged.open(f)
    wanted = [job.expert_ranges[r] for r in targets]
    pending_digests: list[tuple[range, Any]] = []
    written = 0
    chunks = [c for c in _expert_chunks(job) if any(c.start in rng for rng in wanted)]  # EP: skip others
    for i, chunk in enumerate(chunks):
        interrupts.check()
        nbytes = layer.packed_bytes * len(chunk) // layer.num_experts
        slot = i % 2
        experts: list | None = None
        if builder is not None:
            if i >= 2:  # the digest of the chunk read into this slot before must be done
                pending_digests[i - 2][1].result()
            view = builder.read(io.reader, chunk, slot)
            pending_digests.append((chunk, io.hash_pool.submit(_digest_view, view)))
            builder.check_scales(slot)
        else:
            experts, d = _read_layer_chunk(io.reader, job, chunk)
            io.digests.add_chunk(j, chunk, d)
        writes, n_written = _chunk_writes(plan, job, targets, chunk, builder, slot, experts, io.repack_weights)
        written += n_written
        staged = io.staged

        # Writing chunk i overlaps building chunk i+1 (pwrite releases the GIL); at most two
        # chunks of output are alive at a time.  Each file is filled in order, so what was
        # just written is hashed from its buffer while cached (else re-read once final).
        def hash_written(writes: list = writes) -> None:  # in the writer thread, after the writes
            for f, off, t in writes:
                if not (isinstance(t, memoryview) and staged.hash_written(f, off, t)):
                    staged.written_upto(f, off + _nbytes_of(t))

        io.writer.submit(writes, hash_written)
        io.advance(nbytes)
    for chunk, fut in pending_digests:
        io.digests.add_chunk(j, chunk, fut.result())
    io.writer.drain()
    files.unit_done(u)
    return written


def _chunk_writes(plan: RepackPlan, job: LayerJob, targets: dict[int, dict[str, PlannedFile]], chunk: range,
                  builder: Any | None, slot: int, experts: list | None,
                  repack_weights: Any) -> tuple[list[tuple[PlannedFile, int, Any]], int]:
    """Each target rank's tensors of the experts in `chunk`, built by the native `builder` (from
    its `slot`) or the torch path (from `experts`): (file, offset, bytes) writes, and their bytes."""
    layer = job.layer
    writes: list[tuple[PlannedFile, int, Any]] = []
    written = 0
    for r, by_name in targets.items():
        rng = job.expert_ranges[r]
        if chunk.start not in rng:
            continue
        local = chunk.start - rng.start
        if builder is not None:
            tensors: dict[str, Any] = builder.build(r, len(chunk), slot)
            per = builder.per_expert
        else:
            tensors = build_rank_tensors(experts, job.specs[r], scale_dtype=plan.scale_dtype,
                                         expert_ids=list(chunk), repack=repack_weights)
            per = {name: (t[0].numel() * t.element_size() if t.shape[0] else 0) for name, t in tensors.items()}
        for name, t in tensors.items():
            f = by_name.get(name)
            if f is not None:
                writes.append((f, f.offsets[f"{layer.prefix}.{name}"] + local * per[name], t))
                written += per[name] * len(chunk)
    return writes, written


def _execute_streamed(plan: RepackPlan, staged: StagedOutput, reader: RawReader, builders: dict[int, Any],
                      by_rel: dict[str, PlannedFile], start: TaskStarter, ranks: list[int],
                      side_files: bool, launch: distributed.Launch) -> tuple[int, int, int]:
    """`_execute` when the native path builds every layer: each file is produced front to back
    (`_produce_streamed`).  A file staged by an earlier run is reused when its bytes are what the
    journal records and rebuilding it from the checkpoint as it is now gives those bytes again
    (so no digest of the source is needed while writing)."""
    candidates = [f for f in by_rel.values() if staged.staged_file_matches(f, need_source=False)]
    reused: set[str] = set()
    if candidates:
        check = start("checking the staged files", _streamed_input_bytes(plan, candidates), unit="bytes")
        reused = {f.relpath for f in _rebuilt_matches(plan, staged, reader, builders, candidates, check)}
    pending = {rel: f for rel, f in by_rel.items() if rel not in reused}
    advance = start("repacking", _streamed_input_bytes(plan, list(pending.values())), unit="bytes")
    staged.check_space(sum(f.size for f in pending.values()))

    def file_done(f: PlannedFile, stream: FileStream) -> None:
        staged.finish_stream(f)  # its last writes, fsync and digest run in the background
        staged.checkpoint_journal()  # the files finished by now
        distributed.kill_after_first_file_for_tests(launch, staged.collect_hashes)

    written = _produce_streamed(plan, pending, reader, builders, open_stream=staged.stream, file_done=file_done,
                                advance=advance)
    _write_side_files(plan, staged, ranks, side_files)
    return len(pending), len(by_rel) - len(pending), written


def _rebuilt_matches(plan: RepackPlan, staged: StagedOutput, reader: RawReader, builders: dict[int, Any],
                     candidates: list[PlannedFile], advance: Callable[[int], None]) -> list[PlannedFile]:
    """The candidates whose bytes, rebuilt from the checkpoint now (hashed, not written), have the
    digest the journal records; they are adopted as done."""
    results: list[tuple[PlannedFile, Future[str]]] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="wna16ctl-rehash") as pool:
        def open_stream(f: PlannedFile, max_reserve: int, depth: int = DEPTH) -> FileStream:
            s = FileStream(-1, f.size, new_hasher(), pool, max_reserve=max_reserve,
                           on_error=lambda e: e, direct=False, depth=depth)  # fd -1: hashed, never written
            s.write(f.header)
            return s

        def file_done(f: PlannedFile, stream: FileStream) -> None:
            fut: Future[str] = Future()
            stream.finish(lambda err: fut.set_exception(err) if err else fut.set_result(stream.hasher.hexdigest()))
            results.append((f, fut))

        _produce_streamed(plan, {f.relpath: f for f in candidates}, reader, builders, open_stream=open_stream,
                          file_done=file_done, advance=advance)
        return [f for f, fut in results if fut.result() == staged.reusable[f.relpath][0] and staged.adopt(f)]


def _files_by_unit(plan: RepackPlan, files: Iterable[PlannedFile]) -> dict[tuple, list[PlannedFile]]:
    """Work unit -> the files among `files` it writes into (in the order given)."""
    out: dict[tuple, list[PlannedFile]] = {}
    for f in files:
        for u in plan.units[f.relpath]:
            out.setdefault(u, []).append(f)
    return out


def _streamed_input_bytes(plan: RepackPlan, files: list[PlannedFile]) -> int:
    """The bytes `_produce_streamed` reads for `files` (its progress total): each non-expert tensor
    once per file holding it, each chunk of experts once if any of the files' ranks holds it."""
    total = 0
    for u, fs in _files_by_unit(plan, files).items():
        if u[0] == "copy":
            total += sum(plan.checkpoint.files.info(n).nbytes for n in u[1]) * len(fs)
            continue
        job = plan.jobs[u[1]]
        wanted = [job.expert_ranges[r] for r in _layer_targets(job, fs)]
        total += sum(job.layer.packed_bytes * len(c) // job.layer.num_experts
                     for c in _expert_chunks(job) if any(c.start in rng for rng in wanted))
    return total


def _produce_streamed(plan: RepackPlan, files: dict[str, PlannedFile], reader: RawReader, builders: dict[int, Any], *,
                      open_stream: Callable[..., FileStream], file_done: Callable[[PlannedFile, FileStream], None],
                      advance: Callable[[int], None] = lambda n: None) -> int:
    """Produce `files` front to back through FileStreams: the non-expert tensors (read once, into
    every rank's file), then layer after layer, chunk by chunk, each rank's tensors built in place
    at the end of their files.  `file_done(f, stream)` when f's last byte is committed.  Returns
    the tensor bytes produced."""
    ck = plan.checkpoint
    remaining = {rel: len(plan.units[rel]) for rel in files}
    unit_file = _files_by_unit(plan, files.values())
    streams: dict[str, FileStream] = {}
    produced = 0

    def unit_done(u: tuple) -> None:
        for f in unit_file.get(u, []):
            remaining[f.relpath] -= 1
            if remaining[f.relpath] == 0:
                file_done(f, streams.pop(f.relpath))

    # 1. non-expert tensors: read straight into the first rank's file, copied into the others'
    for u in dict.fromkeys(u for rel in sorted(files) for u in plan.units[rel] if u[0] == "copy"):
        targets = unit_file[u]
        for f in targets:
            if f.relpath not in streams:  # deeper: these are written while the first layer is built
                streams[f.relpath] = open_stream(f, 0, 4 * DEPTH)
        for name in u[1]:
            info = ck.files.info(name)
            _copy_into_streams(reader, info, [(streams[f.relpath], f.offsets[name]) for f in targets])
            produced += info.nbytes * len(targets)
            advance(info.nbytes * len(targets))
        unit_done(u)
    # 2. expert layers, the ranks of a chunk built side by side (one build thread per further core)
    with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="wna16ctl-build") as pool:
        for j, job in enumerate(plan.jobs):
            u = ("layer", j)
            rank_files = _layer_targets(job, unit_file.get(u, []))
            if not rank_files:
                continue
            builder = builders[j]
            for by_name in rank_files.values():
                for name, f in by_name.items():
                    if f.relpath not in streams:  # a file's first unit opens it
                        reserve = builder.per_expert[name] * builder.max_experts
                        streams[f.relpath] = open_stream(f, reserve, depth_for(reserve))
            layer = job.layer
            wanted = [job.expert_ranges[r] for r in rank_files]
            for chunk in (c for c in _expert_chunks(job) if any(c.start in rng for rng in wanted)):  # EP: skip others
                interrupts.check()
                produced += _build_chunk(job, builder, reader, chunk, rank_files, streams, pool)
                advance(layer.packed_bytes * len(chunk) // layer.num_experts)
            unit_done(u)
    return produced


def _build_chunk(job: LayerJob, builder: Any, reader: RawReader, chunk: range,
                 targets: dict[int, dict[str, PlannedFile]], streams: dict[str, FileStream],
                 build_pool: ThreadPoolExecutor) -> int:
    """One chunk of experts of one layer into the streams of every target rank; returns the bytes
    committed."""
    layer = job.layer
    produced = 0
    builder.map(reader, chunk, 0)  # read in place: the page cache, not a copy of it
    try:
        builder.check_scales(0)
        builds: list[tuple[int, dict[str, int | None]]] = []
        commits: list[tuple[FileStream, int]] = []
        for r, by_name in targets.items():
            rng = job.expert_ranges[r]
            if chunk.start not in rng:
                continue
            local = chunk.start - rng.start
            # room at the end of each file of the rank (a kind whose file an earlier run
            # already completed is built into scratch memory)
            addrs: dict[str, int | None] = {}
            for name in job.tensor_names:
                f = by_name.get(name)
                n = builder.per_expert[name] * len(chunk)
                if f is None:
                    addrs[name] = None
                    continue
                st = streams[f.relpath]
                if st.position != f.offsets[f"{layer.prefix}.{name}"] + local * builder.per_expert[name]:
                    raise AssertionError(f"{f.relpath}: {name} of experts {chunk} is not next in the file")
                addrs[name] = st.reserve(n)
                commits.append((st, n))
            builds.append((r, addrs))
        # the ranks' builds side by side (the native call releases the GIL); each reads the
        # mapping and writes the streams' buffers, so every one that started has returned before
        # anything unwinds (whatever failed, even a Ctrl-C)
        futs: list[Future[None]] = []
        try:
            for r, addrs in builds[1:]:
                futs.append(build_pool.submit(builder.build_into, r, len(chunk), 0, addrs))
            if builds:
                builder.build_into(builds[0][0], len(chunk), 0, builds[0][1])
        finally:
            interrupts.wait_all(futs)
        for fut in futs:
            fut.result()
        for st, n in commits:
            st.commit(n)
            produced += n
    finally:
        builder.unmap(0)
    return produced


def _copy_into_streams(reader: RawReader, info: Any, targets: list[tuple[FileStream, int]]) -> None:
    """One non-expert tensor into every target (stream, offset of the tensor in its file): read
    in pieces into the first target's memory, copied from there into the others."""
    first = targets[0][0]
    for start in range(info.start, info.end, first.block):
        interrupts.check()
        n = min(first.block, info.end - start)
        for s, offset in targets:
            if s.position != offset + (start - info.start):
                raise AssertionError(f"tensor {info.name} is not next in its file")
        view = memoryview((ctypes.c_char * n).from_address(first.reserve(n))).cast("B")
        reader.read_into(type(info)(info.name, info.dtype, (), info.file, start, start + n), view)
        for s, _ in targets[1:]:
            s.write(view)
        first.commit(n)
        view.release()


def _write_side_files(plan: RepackPlan, staged: StagedOutput, ranks: list[int], side_files: bool) -> None:
    """Per-rank indexes and the checkpoint's side files (the manifest is the caller's: other
    processes may write too)."""
    for r in ranks:
        staged.write_small(f"rank-{r}/{INDEX_NAME}", rank_index_bytes(plan.files[r]))
    if side_files:
        for name in SIDE_FILES:
            src = plan.checkpoint.root / name
            if src.is_file():
                staged.copy_file(src, name)
    staged.collect_hashes()


def _layer_targets(job: LayerJob, files: list[PlannedFile]) -> dict[int, dict[str, PlannedFile]]:
    """rank -> output tensor name (without the layer prefix) -> the file of `files` holding it."""
    targets: dict[int, dict[str, PlannedFile]] = {}
    prefix = job.layer.prefix + "."
    for f in files:
        r = int(f.relpath.split("/", 1)[0].removeprefix("rank-"))
        for t in f.tensors:
            if t.name.startswith(prefix) and t.name[len(prefix):] in job.tensor_names:
                targets.setdefault(r, {})[t.name[len(prefix):]] = f
    return targets


def _nbytes_of(t: Any) -> int:
    return t.nbytes if isinstance(t, memoryview) else t.numel() * t.element_size()


def build_rank_tensors(*args: Any, **kwargs: Any) -> Any:
    """`wna16ctl.layout.rank.build_rank_tensors` (the torch data path), imported on first use."""
    from wna16ctl.layout.rank import build_rank_tensors as build

    return build(*args, **kwargs)


def rank_index_bytes(files: list[PlannedFile]) -> bytes:
    """The `model.safetensors.index.json` of one rank directory, as repack writes it."""
    wm = {t.name: Path(f.relpath).name for f in files for t in f.tensors}
    total = sum(t.nbytes for f in files for t in f.tensors)
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2) + "\n").encode()


class _BackgroundWrites:
    """One writer thread, one chunk in flight: the next submit waits for the previous chunk."""

    def __init__(self, staged: StagedOutput):
        from concurrent.futures import ThreadPoolExecutor

        self._staged = staged
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wna16ctl-write")
        self._pending: Future[None] | None = None

    def _write(self, writes: list[tuple[PlannedFile, int, Any]], after: Callable[[], Any] | None) -> None:
        for f, offset, t in writes:
            self._staged.pwrite(f, offset, t)
        if after is not None:
            after()
        spans: dict[str, tuple[PlannedFile, int, int]] = {}  # one writeback call per file
        for f, offset, t in writes:
            end = offset + (len(t) if isinstance(t, memoryview) else t.numel() * t.element_size())
            _, lo, hi = spans.get(f.relpath, (f, offset, end))
            spans[f.relpath] = (f, min(lo, offset), max(hi, end))
        for f, lo, hi in spans.values():  # the disk works on this chunk while the next is built
            self._staged.start_writeback(f, lo, hi - lo)

    def submit(self, writes: list[tuple[PlannedFile, int, Any]], after: Callable[[], Any] | None = None) -> None:
        """Write in the background, then call `after` there (the writes are on the file by then)."""
        self.drain()
        self._pending = self._pool.submit(self._write, writes, after)

    def drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a write error (disk full, ...) in the main thread

    def __enter__(self) -> "_BackgroundWrites":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.drain()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def repack_device(device: str) -> str:
    """Where `--device DEVICE` runs the repack: `auto` is the CPU. The GPU path repacks tensor by
    tensor through the torch data path (a host copy of each transposed source, a synchronous
    transfer each way, an allocation per result) and measured slower than the CPU path on the one
    GPU it ran on (docs/performance.md, "GPU harness"); it runs only when asked for by name."""
    return "cpu" if device == "auto" else device


def marlin_repacker(device: str) -> Callable[..., Any]:
    """The Marlin weight repack for `device`: the CUDA kernel, the native CPU library, or torch.

    All three are bit-identical (tests/native/test_kernels.py); the choice only changes speed.
    """
    from wna16ctl.native import ops as kernels

    if device == "cuda" and not kernels.cuda_available():
        raise UsageError("--device cuda: no usable CUDA GPU and kernel library here; use --device cpu")
    use_cuda = device == "cuda"  # `auto` never picks the GPU (repack_device)

    def repack(packed: Any, num_bits: int, perm: Any = None, *, out: Any) -> Any:
        if use_cuda:
            src = _to_gpu(packed)
            result = kernels.marlin_repack_fast(src, num_bits, None if perm is None else perm.to(src.device))
            return out.copy_(result)  # one device-to-host copy, straight into the output's columns
        return kernels.marlin_repack_fast(packed, num_bits, perm, out=out)

    return repack


def _to_gpu(t: Any) -> Any:
    """`t` on the current GPU. A K-first source is a transposed view of the checkpoint's N-first
    words: it is moved as it lies in memory and transposed on the GPU (`.cuda()` of the view would
    first make a transposing copy on the host)."""
    if not t.is_contiguous() and t.ndim >= 2 and t.transpose(-1, -2).is_contiguous():
        return t.transpose(-1, -2).cuda().transpose(-1, -2)
    return t.cuda()


def build_manifest(plan: RepackPlan, hashes: dict[str, str], root: Path) -> dict[str, Any]:
    """The manifest of a finished output: the same whichever data path wrote it.  The source
    digests the torch path keys `--resume` on stay in the staging journal (what resumes read)."""
    out_files: dict[str, dict[str, Any]] = {}
    for rel, digest in sorted(hashes.items()):
        out_files[rel] = {FILE_HASH: digest, "bytes": (root / rel).stat().st_size}
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "identity": plan.identity,
        "source": {
            "path": os.path.abspath(plan.checkpoint.root),
            "fingerprint": plan.fingerprint,
            "architecture": (plan.checkpoint.config.architectures or ("",))[0],
        },
        "engine": {"name": "vllm", "version": plan.settings.vllm, "gpu": plan.settings.gpu},
        "tp": plan.settings.tp,
        "ep": plan.settings.ep,
        "layout": plan.settings.layout,
        "scale_dtype": plan.scale_dtype_name,
        "ranks": [
            {"rank": r, "dir": f"rank-{r}", "files": [f.relpath for f in files], "bytes": sum(f.size for f in files)}
            for r, files in enumerate(plan.files)
        ],
        "layers": [j.to_json() for j in plan.jobs],
        "copied_tensors": len(plan.copied),
        "files": out_files,
    }
