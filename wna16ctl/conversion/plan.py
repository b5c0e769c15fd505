"""What `convert` writes: every quantized projection of a checkpoint in another format, exactly --
a GPTQ, AWQ or AutoRound checkpoint as the compressed-tensors `pack-quantized` tensors llm-compressor
writes, or a compressed-tensors one as GPTQ (v1, as GPTQModel writes it) -- and the config that says so.

A projection's scheme is the one its format resolves (GPTQModel's `dynamic`, AWQ's
`modules_to_not_convert`, AutoRound's `extra_config`, compressed-tensors' groups applied).  Written
as compressed-tensors, the `quantization_config` says the same scheme of every module: first the
source's own groups (its rules as config groups and ignore entries), kept only when
compressed-tensors' matching (`sources.config`, the library's rules) gives every module the scheme
the source gives it; else the default scheme for `Linear` and the other modules by their exact
names.  Each unquantized Linear is ignored by name, as llm-compressor writes `lm_head` and the
routers.  Written as GPTQ, the config is GPTQModel's, read back by the GPTQ format's own rules
(`GPTQWriter.converted_config`).  Torch-free: the planned tensors come from the headers alone.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wna16ctl.errors import BadInput, UsageError
from wna16ctl.output.manifest import FORMAT_NAME
from wna16ctl.sources import Checkpoint, WeightScheme, formats, open_checkpoint
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.formats import compressed_tensors as ct
from wna16ctl.sources.formats.compressed_tensors import weights_of
from wna16ctl.version import __version__

LAYOUT = "convert"  # the manifest's `layout`: a checkpoint converted to another format
TARGET = ct.WRITER.written_form  # the default target's name (a GPTQ, AWQ or AutoRound source's)


@dataclass(frozen=True)
class Projection:
    """One quantized module of the source: its scheme, [N, K] and stored tensors by role."""

    module: str
    scheme: WeightScheme
    n: int
    k: int
    stored: dict[str, str]  # role -> the source tensor's name (those the conversion reads)
    scale_dtype: str
    writer: Any  # the target format's writer (`formats.CONVERT_TARGETS`)
    owned: tuple[str, ...] = ()  # every stored tensor of the module: none is copied as it is

    @property
    def target_scheme(self) -> WeightScheme:
        return self.writer.stored_as(self.scheme)

    def written(self) -> list[tuple[str, str, list[int]]]:
        """The target format's tensors (name, dtype, shape), in its writer's order."""
        return self.writer.written_tensors(self.module, self.target_scheme, self.n, self.k, self.scale_dtype)


@dataclass
class ConversionPlan:
    checkpoint: Checkpoint
    projections: dict[str, Projection]
    config: dict[str, Any]  # the compressed-tensors quantization_config written
    ignored: list[str]  # the unquantized Linear modules, by name
    target: Any = ct.COMPRESSED_TENSORS  # the format written
    writer: Any = ct.WRITER
    files: list[tuple[Any, Any]] = field(default_factory=list)  # (source shard, output PlannedFile)

    @property
    def source_method(self) -> str:
        quant = self.checkpoint.config.quant
        return quant.quant_method if quant is not None else ""

    def to_json(self) -> dict[str, Any]:
        schemes = Counter(p.scheme.describe() for p in self.projections.values())
        return {"source": str(self.checkpoint.root), "source_format": self.source_method,
                "target": self.writer.written_form,
                "projections": len(self.projections), "schemes": dict(schemes), "ignored": len(self.ignored),
                "config_groups": len(self.config.get("config_groups") or {}),
                "files": [f.relpath for _, f in self.files]}


def _same(a: WeightScheme | None, b: WeightScheme | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.num_bits, a.group_size, a.symmetric, a.strategy, a.act_order) == \
           (b.num_bits, b.group_size, b.symmetric, b.strategy, b.act_order)


def identity(ck: Checkpoint, writer: Any = ct.WRITER) -> dict[str, Any]:
    from wna16ctl.sources import source_fingerprint

    return {"format": FORMAT_NAME, "layout": LAYOUT, "tool_version": __version__,
            "source_fingerprint": source_fingerprint(ck), "settings": {"target": writer.written_form}}


def plan_conversion(path: str | os.PathLike[str], to: str | None = None) -> ConversionPlan:
    """The conversion of the checkpoint at `path` to the format `to` (a `formats.CONVERT_TARGETS`
    key; None: `formats.convert_target`'s choice); BadInput naming the tensor or key where the
    target cannot say exactly what the source stores."""
    return plan_of(open_checkpoint(path), to)


def plan_of(ck: Checkpoint, to: str | None = None) -> ConversionPlan:
    """The conversion of the opened checkpoint `ck` (see `plan_conversion`)."""
    quant = ck.config.quant
    if quant is None:
        raise BadInput(f"{ck.root}: config.json has no quantization_config; there are no quantized weights to convert")
    source = formats.of(quant)
    target, writer = formats.convert_target(source, to)
    if target is source:
        raise UsageError(f"{ck.root}: is already a {source.quant_method} checkpoint; convert writes it in another "
                         f"format ({', '.join(m for m in formats.CONVERT_TARGETS if m != source.quant_method)})")
    if source is not formats.DEFAULT and target is not formats.DEFAULT:
        raise UsageError(f"{ck.root}: a {source.quant_method} checkpoint converts to {formats.DEFAULT.quant_method} "
                         "only")
    why = quant.unsayable()
    if why is not None:
        raise BadInput(why)
    projections = _projections(ck, writer)
    if not projections:
        raise BadInput(f"{ck.root}: stores no quantized projection ({source.names.codes} tensors); "
                       "nothing to convert")
    ignored = _unquantized_linear(ck, projections)
    if target is formats.DEFAULT:
        config = _config(ck, projections, ignored)
    else:
        wanted = {m: p.scheme for m, p in projections.items()} | {m: None for m in ignored}
        config = writer.converted_config(wanted, f"wna16ctl:{__version__}", ck.config.path)
    plan = ConversionPlan(ck, projections, config, ignored, target, writer)
    plan.files = _planned_files(plan)
    return plan


def converted_checkpoint(ck: Checkpoint, to: str | None = None) -> Checkpoint:
    """The checkpoint `convert` would write from `ck` (in the format `to`, as `plan_of` picks it),
    from the headers alone (nothing is written): an ordinary `Checkpoint` of the target format, so
    the planner judges the converted model rule for rule, never by the source's verdict.
    BadInput / UsageError where `convert` refuses `ck`."""
    from dataclasses import replace

    from wna16ctl.sources import HeaderSource
    from wna16ctl.sources.config import parse_quantization_config
    from wna16ctl.sources.headers import ShardHeader, ShardList

    plan = plan_of(ck, to)
    headers: dict[Path, ShardHeader] = {}
    for sh, f in plan.files:
        entries, offset = {}, 0
        for t in f.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        headers[sh.path] = ShardHeader(sh.path, sh.data_start + offset, sh.data_start, entries, dict(sh.metadata))
    cfg = ck.config
    config = replace(cfg, raw={**cfg.raw, "quantization_config": plan.config},
                     quant=parse_quantization_config(plan.config, cfg.path))
    paths = list(headers)
    out = open_checkpoint(ck.root, HeaderSource(locate=lambda r: ShardList(r, paths), read=lambda p: headers[p]),
                          config=config)
    out.source = ck.source
    return out


def _projections(ck: Checkpoint, writer: Any) -> dict[str, Projection]:
    quant = ck.config.quant
    assert quant is not None
    fmt = formats.of(quant)
    by_module: dict[str, dict[str, str]] = {}
    for name in ck.files.names():
        split = fmt.names.split(name)
        if split is not None and split[1] != formats.WEIGHT:
            by_module.setdefault(split[0], {})[split[1]] = name
    modules = [m for m, roles in by_module.items() if CODES in roles]
    out = {}
    for module, scheme in zip(modules, quant.schemes_for(modules)):
        roles = by_module[module]
        codes = roles[CODES]
        if scheme is None:
            raise BadInput(f"tensor {codes}: stored packed, but the quantization_config leaves {module} unquantized; "
                           "the config and the tensors disagree")
        if not fmt.stores_packed(scheme):
            raise BadInput(f"tensor {codes}: {scheme.describe()} in stored form {scheme.format!r} is not one "
                           "wna16ctl converts")
        if SCALES not in roles:
            raise BadInput(f"tensor {module}.{fmt.names.scales}: missing; every quantized projection stores its scales")
        n, k = fmt.codes_nk(list(ck.files.info(codes).shape), scheme)
        why = writer.cannot_store(scheme, n, k)
        if why is not None:
            raise BadInput(f"tensor {codes}: {why}; nothing was written")
        read = _read_roles(ck, fmt, module, scheme, roles, n, k)
        out[module] = Projection(module, scheme, n, k, read, ck.files.info(roles[SCALES]).dtype, writer,
                                 tuple(roles.values()))
    return out


def _read_roles(ck: Checkpoint, fmt: Any, module: str, scheme: WeightScheme, roles: dict[str, str], n: int,
                k: int) -> dict[str, str]:
    """The stored tensors a projection's conversion reads, by role.  A qweight format's canonical
    form reads them all (it checks a symmetric one's midpoint zero points); compressed-tensors is
    read as stored, which must be the pack-quantized form it writes (dense packing, packed zero
    points): its zero points where asymmetric, its g_idx where act-ordered."""
    if fmt is not formats.DEFAULT:
        return dict(roles)
    wanted = {CODES, SCALES} | ({ZERO_POINTS} if not scheme.symmetric else set()) | ({G_IDX} if scheme.act_order else set())
    shapes = {name: (dtype, shape) for name, dtype, shape in ct.WRITER.written_tensors(module, scheme, n, k, "")}
    for role in sorted(wanted):
        name = fmt.names.tensor(module, role)
        if role not in roles:
            raise BadInput(f"tensor {name}: missing; a {scheme.describe()} projection stores it")
        shape = list(ck.files.info(name).shape)
        if role != SCALES and list(shapes[name][1]) != shape:
            raise BadInput(f"tensor {name}: shape {shape}, not {shapes[name][1]} of the {ct.PACK_QUANTIZED} form "
                           f"compressed-tensors >= 0.20 writes (dense packing, packed zero points); convert reads "
                           "that form")
    return {r: roles[r] for r in wanted}


def _unquantized_linear(ck: Checkpoint, projections: dict[str, Projection]) -> list[str]:
    from wna16ctl.sources.proposed import is_linear_weight

    weight = formats.WEIGHT
    return [n[: -len(weight) - 1] for n in ck.files.names()
            if n.endswith("." + weight) and n[: -len(weight) - 1] not in projections and is_linear_weight(n, ck.files.raw(n))]


def _config(ck: Checkpoint, projections: dict[str, Projection], ignored: list[str]) -> dict[str, Any]:
    """The first candidate config whose matching gives every module its source scheme."""
    quant = ck.config.quant
    assert quant is not None
    wanted = {m: p.scheme for m, p in projections.items()} | {m: None for m in ignored}
    own = [(list(g.targets), g.scheme) for g in quant.groups if g.scheme is not None]
    own_ignore = [t for t in quant.ignore if t.startswith("re:")]
    counts = Counter(weights_key(p.scheme) for p in projections.values())
    base = next(p.scheme for p in projections.values() if weights_key(p.scheme) == counts.most_common(1)[0][0])
    by_name: list[tuple[list[str], WeightScheme]] = [(["Linear"], base)]
    for key in dict.fromkeys(weights_key(p.scheme) for p in projections.values()):
        if key != weights_key(base):
            members = [m for m, p in projections.items() if weights_key(p.scheme) == key]
            by_name.append((members, projections[members[0]].scheme))
    for groups, ignore in ((own, own_ignore + ignored), (by_name, list(ignored))):
        config = ct.written_config({f"group_{i}": {"targets": targets, "weights": weights_of(s)}
                                    for i, (targets, s) in enumerate(groups)}, tuple(dict.fromkeys(ignore)))
        if _says(config, wanted, ck.root):
            return config
    raise AssertionError("the config by module names does not say the source's schemes")


def weights_key(s: WeightScheme) -> tuple:
    return (s.num_bits, s.group_size, s.symmetric, s.strategy, s.act_order)


def _says(config: dict[str, Any], wanted: dict[str, WeightScheme | None], root: Path) -> bool:
    from wna16ctl.sources.config import parse_quantization_config

    parsed = parse_quantization_config(config, root / "config.json")
    names = list(wanted)
    return all(_same(got, wanted[n]) for n, got in zip(names, parsed.schemes_for(names)))


def _planned_files(plan: ConversionPlan) -> list[tuple[Any, Any]]:
    """(source shard, output PlannedFile) per shard: the same names, each tensor in the source's data
    order, a projection's pack-quantized tensors where its codes were, its other stored tensors gone."""
    from wna16ctl.output.writer import PlannedFile, PlannedTensor

    files = plan.checkpoint.files
    placed = {p.stored[CODES]: p for p in plan.projections.values()}
    owned = {name for p in plan.projections.values() for name in p.owned}
    out = []
    for sh in files.shards:
        tensors = []
        for name in sorted(sh.entries, key=lambda n: files.entry(n)["data_offsets"][0]):
            if name in placed:
                tensors += [PlannedTensor(n, dt, tuple(shape)) for n, dt, shape in placed[name].written()]
            elif name not in owned:
                e = files.entry(name)
                tensors.append(PlannedTensor(name, e["dtype"], tuple(e["shape"])))
        f = PlannedFile(_relpath(plan.checkpoint.root, sh.path), tensors)
        f.layout()
        out.append((sh, f))
    return out


def _relpath(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name
