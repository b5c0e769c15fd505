"""Checking every expert tensor's header, shard by shard (a map), then per layer (a reduce).

Each shard is checked on its own: a tensor's name says which expert projection it belongs to,
the config says that projection's scheme and shape, so dtype, shape and byte extent are checked
where the header is decoded.  What crosses shards is small: which tensors exist per
(layer, role, suffix) and the scheme of each expert projection.  That makes the work splittable
over processes without sending decoded headers around (see `_fork.split_map`); `inspect` on a
Kimi-K2-sized checkpoint (2×10^5 tensors) spends its time here.
"""

from __future__ import annotations

from dataclasses import astuple
from collections import defaultdict
from itertools import chain, repeat
from operator import itemgetter, methodcaller
from pathlib import Path
from typing import Any

from wna16ctl.sources import formats
from wna16ctl.sources.config import ModelConfig
from wna16ctl.sources.formats import WEIGHT, InputFormat
from wna16ctl.sources.header_digest import Group, HeaderDigest
from wna16ctl.sources.headers import ShardHeader, read_shard_header
from wna16ctl.errors import BadInput

PROJECTION_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _suffixes(fmt: InputFormat) -> tuple[str, ...]:
    """The suffixes of an expert projection's tensors in `fmt`: its stored ones and the dense weight."""
    return fmt.names.quantized + (WEIGHT,)


def _dense_suffixes(fmt: InputFormat) -> tuple[str, ...]:
    """Header entries of non-expert tensors that a worker process sends back in full (not only their
    names): the packed weights and scales of quantized linear layers, whose shapes are planned."""
    n = fmt.names
    return tuple(f".{s}" for s in (n.codes, n.scales, n.zero_points, n.g_idx))


def _shape_suffix(fmt: InputFormat) -> str | None:
    """`.<suffix>` of a stored projection shape (never read: shapes come from the config)."""
    return f".{fmt.names.shape}" if fmt.names.shape else None


def _packing_of(exp: dict, suffix: str, shape: list | None) -> str | None:
    """Which packing a packed tensor's shape is in ("dense", "word"), "same" where the two
    packings coincide, None where it is neither."""
    if f"{suffix}@word" not in exp:
        return "same" if shape == exp[suffix][1] else None
    if shape == exp[suffix][1]:
        return "dense"
    return "word" if shape == exp[f"{suffix}@word"][1] else None


def scan_shard(path: str, config: ModelConfig, intermediate: int, *, keep_entries: bool,
               header: ShardHeader | None = None) -> dict[str, Any]:
    """Decode one shard's header and check its expert tensors.

    Returns plain data (marshal-able): the shard's facts, its entries (or only their names when
    `keep_entries` is false) and, per experts prefix, which (role, suffix) tensors of which
    experts it holds, the schemes of those projections, zero-point forms and scale dtypes.
    """
    sh = header if header is not None else read_shard_header(Path(path))
    fmt = formats.of(config.quant)
    found = _scan_grouped(path, _expert_groups(sh.entries, fmt), config, intermediate)
    layers, table = found if found is not None else _scan_each(path, sh, config, intermediate)
    dense: dict[str, dict] = {}  # non-expert quantized tensors (the linear planner reads their shapes)
    if not keep_entries:
        # dtype, shape and extent of every entry were checked by read_shard_header
        entries = sh.entries
        ends = _dense_suffixes(fmt)
        dense = {n: entries[n] for n in entries if n.endswith(ends) and ".experts." not in n}
    return {
        "path": path, "size": sh.size, "data_start": sh.data_start, "metadata": sh.metadata,
        "entries": sh.entries if keep_entries else list(sh.entries),
        "layers": layers, "schemes": table, "dense": dense,
    }


def scan_digest(path: str, size: int, data_start: int, digest: HeaderDigest, config: ModelConfig,
                intermediate: int) -> dict[str, Any] | None:
    """`scan_shard`'s result from a natively checked header (`header_digest`), in the form a worker
    process sends back: the names, the non-expert entries in full, the per-layer summaries.  None
    when the groups are out of the ordinary: `scan_shard` on the full header then decides."""
    found = _scan_grouped(path, digest.groups, config, intermediate)
    if found is None:
        return None
    layers, table = found
    return {
        "path": path, "size": size, "data_start": data_start, "metadata": digest.metadata,
        "entries": digest.names, "layers": layers, "schemes": table, "dense": digest.plain,
        "sorted_names": digest.sorted_names,
    }


def _expert_groups(entries: dict[str, dict], fmt: InputFormat = formats.DEFAULT) -> list[Group] | None:
    """The names under `.experts.` (but a stored projection shape), grouped by their (prefix, proj, suffix)
    when split as `<prefix>.<expert>.<proj>.<suffix>`, in header order, each group with its expert
    numbers as written, its distinct dtypes and the shape its tensors share (None if they differ).
    Nothing is judged here.  None when some such name has fewer parts.  (The native reader,
    `header_digest`, computes the same groups.)"""
    groups: defaultdict[tuple[str, str, str], list[str]] = defaultdict(list)
    shape = _shape_suffix(fmt)
    names = [n for n in entries if ".experts." in n and not (shape and n.endswith(shape))]
    try:
        for name, (prefix, _, proj, suffix) in zip(names, map(_SPLIT, names)):
            groups[(prefix, proj, suffix)].append(name)
    except ValueError:
        return None
    out: list[Group] = []
    for (prefix, proj, suffix), members in groups.items():
        first, last = len(prefix) + 1, -len(proj) - len(suffix) - 2
        es = list(map(entries.__getitem__, members))
        shape = es[0]["shape"]
        out.append((prefix, proj, suffix, [n[first:last] for n in members], list(dict.fromkeys(map(_DTYPE, es))),
                    shape if list(map(_SHAPE, es)).count(shape) == len(es) else None))
    return out


_SPLIT = methodcaller("rsplit", ".", 3)
_DTYPE = itemgetter("dtype")
_SHAPE = itemgetter("shape")


def _scan_grouped(path: str, groups: list[Group] | None, config: ModelConfig,
                  intermediate: int) -> tuple[dict[str, dict[str, Any]], list[tuple | None]] | None:
    """`_scan_each`'s result, computed per group of tensors that share (experts prefix, projection,
    suffix) rather than per tensor: one comparison of the group's dtypes and shape against the
    expected ones.  None when anything is out of the ordinary (a name that is not an expert
    tensor's, per-expert schemes within a projection, a tensor that does not match, a scheme
    that refuses): `_scan_each` then decides, and names the tensor at fault."""
    if groups is None:
        return None
    quant = config.quant
    fmt = formats.of(quant)
    suffixes, stored = _suffixes(fmt), fmt.names
    # per (prefix, proj): its suffix groups, and the union of its experts (each module once)
    by_module: dict[tuple[str, str], list[tuple[str, list[str], list[str], list | None]]] = {}
    for prefix, proj, suffix, experts, dtypes, shape in groups:
        if proj not in PROJECTION_ROLES or suffix not in suffixes or not prefix.endswith(".experts"):
            continue  # not an expert projection's tensor
        digits = "".join(experts)
        if not (all(experts) and digits.isdigit() and digits.isascii()):
            return None  # some expert numbers are not numbers
        by_module.setdefault((prefix, proj), []).append((suffix, experts, dtypes, shape))
    spans: list[tuple[str, str, list[str]]] = []  # (prefix, proj, expert strings of its modules)
    modules: list[str] = []
    for (prefix, proj), sgroups in by_module.items():
        experts = sgroups[0][1]
        if any(g[1] != experts for g in sgroups[1:]):  # usually every suffix has the same experts
            experts = list(dict.fromkeys(chain.from_iterable(g[1] for g in sgroups)))
        spans.append((prefix, proj, experts))
        modules += [f"{prefix}.{x}.{proj}" for x in experts]
    schemes = quant.schemes_for(modules) if quant is not None else [None] * len(modules)
    H = config.hidden_size
    table: list[tuple | None] = []
    sid_of: dict[int, int] = {}
    expected: dict[tuple[str, int], dict | None] = {}
    layers: dict[str, dict[str, Any]] = {}
    present: dict[str, dict[tuple[str, str], list[int]]] = {}
    pos = 0
    for (prefix, proj, experts), sgroups in zip(spans, by_module.values()):
        mine = schemes[pos:pos + len(experts)]
        pos += len(experts)
        scheme = mine[0]
        if len(set(map(id, mine))) != 1:
            return None  # per-expert schemes within one projection: checked tensor by tensor
        if scheme is None:
            if any(g[0] == stored.codes for g in sgroups):
                return None  # refused tensor by tensor, with the name
        elif not fmt.known_format(scheme):
            return None
        role = PROJECTION_ROLES[proj]
        lay = layers.get(prefix)
        if lay is None:
            lay = layers[prefix] = {"family": "w1_w3_w2" if proj.startswith("w") else "gate_up_down",
                                    "present": {}, "schemes": {}, "zp": {}, "scales": {},
                                    "packing": {}}
            present[prefix] = {}
        sid = sid_of.get(id(scheme))
        if sid is None:
            sid = sid_of[id(scheme)] = len(table)
            table.append(None if scheme is None else astuple(scheme))
        key = (role, sid)
        if key not in expected:
            expected[key] = fmt.stored_tensors(scheme, role, H, intermediate) if fmt.stores_packed(scheme) else None
        exp = expected[key]
        pres = present[prefix]
        numbers = list(map(int, experts))
        for suffix, experts_of, dtypes, shape in sgroups:
            ids = numbers if experts_of == experts else list(map(int, experts_of))
            pres.setdefault((role, suffix), []).extend(ids)
            if suffix == stored.codes or suffix == WEIGHT:
                lay["schemes"].setdefault(role, []).extend(zip(ids, repeat(sid)))
            if (exp is None or scheme is None or suffix == WEIGHT
                    or (suffix == stored.zero_points and not fmt.stores_zero_points(scheme))
                    or (suffix == stored.g_idx and not scheme.act_order)):
                continue
            # zero points: the packed form here; the unpacked one (int8, older writers) goes tensor by tensor
            allowed, expected_shape = exp[suffix]
            if suffix == stored.codes or suffix == stored.zero_points:
                packing = _packing_of(exp, suffix, shape)
                if packing is None or not set(dtypes).issubset(allowed):
                    return None
                if packing != "same":
                    lay["packing"][packing] = 1
            elif not set(dtypes).issubset(allowed) or shape != expected_shape:
                return None
            if suffix == stored.zero_points:
                if not scheme.symmetric:  # a symmetric one stores the midpoint: no zero points to plan
                    lay["zp"]["packed"] = 1
            elif suffix == stored.scales:
                lay["scales"].update(dict.fromkeys(sorted(dtypes), 1))
    for prefix, lay in layers.items():
        lay["present"] = {f"{r}.{sfx}": experts for (r, sfx), experts in present[prefix].items()}
    return layers, table


def _scan_each(path: str, sh: ShardHeader, config: ModelConfig,
               intermediate: int) -> tuple[dict[str, dict[str, Any]], list[tuple | None]]:
    """The expert tensors of one shard, tensor by tensor: the definition of what `scan_shard`
    accepts, and the errors that name the tensor at fault."""
    quant = config.quant
    fmt = formats.of(quant)
    suffixes, stored, shape_suffix = _suffixes(fmt), fmt.names, _shape_suffix(fmt)
    H = config.hidden_size
    # 1. group this shard's expert tensors by projection module
    modules: dict[str, tuple[str, int, str]] = {}  # module -> (prefix, expert, proj)
    tensors: list[tuple[str, str, str, dict]] = []  # (name, module, suffix, entry)
    for name, e in sh.entries.items():
        if ".experts." not in name:
            continue
        if shape_suffix and name.endswith(shape_suffix):
            continue  # a third of all expert tensors, never read (shapes come from the config)
        parts = name.rsplit(".", 3)
        if (len(parts) != 4 or parts[2] not in PROJECTION_ROLES or parts[3] not in suffixes or not parts[1].isdigit()
                or not parts[0].endswith(".experts")):
            continue
        prefix, number, proj, suffix = parts
        module = name[: -len(suffix) - 1]
        if module not in modules:
            modules[module] = (prefix, int(number), proj)
        tensors.append((name, module, suffix, e))
    names = list(modules)
    schemes = quant.schemes_for(names) if quant is not None else [None] * len(names)
    # 2. per module once: its layer summary, role, scheme id and expected headers
    table: list[tuple | None] = []  # distinct schemes, as field tuples
    sid_of: dict[int, int] = {}  # id(scheme) -> index in table (schemes are shared objects)
    expected: dict[tuple[str, int], dict | None] = {}
    layers: dict[str, dict[str, Any]] = {}
    present: dict[str, dict[tuple[str, str], list[int]]] = {}
    info: dict[str, tuple] = {}
    for module, scheme in zip(names, schemes):
        prefix, expert, proj = modules[module]
        role = PROJECTION_ROLES[proj]
        lay = layers.get(prefix)
        if lay is None:
            lay = layers[prefix] = {"family": "w1_w3_w2" if proj.startswith("w") else "gate_up_down",
                                    "present": {}, "schemes": {}, "zp": {}, "scales": {},
                                    "packing": {}}
            present[prefix] = {}
        sid = sid_of.get(id(scheme))
        if sid is None:
            sid = sid_of[id(scheme)] = len(table)
            table.append(None if scheme is None else astuple(scheme))
            if scheme is not None and not fmt.known_format(scheme):
                raise BadInput(
                    f"{Path(path).parent / 'config.json'}: {module} uses quantization format "
                    f"{scheme.format!r}, which is not a compressed-tensors format wna16ctl knows"
                )
        key = (role, sid)
        if key not in expected:
            expected[key] = fmt.stored_tensors(scheme, role, H, intermediate) if fmt.stores_packed(scheme) else None
        info[module] = (lay, present[prefix], expert, role, scheme, sid, expected[key])
    # 3. check each tensor against its projection's scheme
    for name, module, suffix, e in tensors:
        lay, pres, expert, role, scheme, sid, exp = info[module]
        k = (role, suffix)
        lst = pres.get(k)
        if lst is None:
            lst = pres[k] = []
        lst.append(expert)
        if suffix == stored.codes or suffix == WEIGHT:
            lay["schemes"].setdefault(role, []).append((expert, sid))
            if scheme is None and suffix == stored.codes and quant is None:
                raise BadInput(
                    f"{path}: {name} is a packed quantized tensor but {Path(path).parent / 'config.json'} has no "
                    "quantization_config; restore the config that came with the checkpoint"
                )
            if scheme is None and suffix == stored.codes:
                raise BadInput(
                    f"{path}: {name} exists but quantization_config does not quantize {module}; "
                    "the config's targets/ignore do not match the tensors"
                )
        if exp is None or suffix == WEIGHT:
            continue
        if suffix == stored.zero_points:
            if not fmt.stores_zero_points(scheme):
                continue
            packing = _packing_of(exp, suffix, e["shape"]) if e["dtype"] == "I32" else None
            form = "packed" if packing is not None else "unpacked"
            _check_entry(path, name, e, exp, suffix if form == "packed" else f"{suffix}@unpacked")
            if not scheme.symmetric:
                lay["zp"][form] = 1
            if packing not in (None, "same"):
                lay["packing"][packing] = 1
            continue
        if suffix == stored.g_idx and not scheme.act_order:
            continue
        if suffix == stored.codes:
            packing = _packing_of(exp, suffix, e["shape"])
            if packing == "word":
                suffix = f"{suffix}@word"
            if packing not in (None, "same"):
                lay["packing"][packing] = 1
        dtype = _check_entry(path, name, e, exp, suffix)
        if suffix == stored.scales:
            lay["scales"][dtype] = 1
    for prefix, lay in layers.items():
        lay["present"] = {f"{r}.{sfx}": experts for (r, sfx), experts in present[prefix].items()}
    return layers, table


def _check_entry(path: str, name: str, e: dict, exp: dict, suffix: str) -> str:
    dtypes, shape = exp[suffix]
    dt = e["dtype"]
    if dt not in dtypes or e["shape"] != shape:
        N, K = exp["@NK"]
        word = exp.get(suffix + "@word")
        alt = f" (dense packing; {word[1]} with whole codes per word)" if word else ""
        raise BadInput(
            f"{path}: tensor {name} is {dt}{list(e['shape'])}, expected {'/'.join(dtypes)}{shape}{alt} for a "
            f"[{N}, {K}] projection; the tensors contradict config.json"
        )
    return dt


def shard_header(scan: dict[str, Any]) -> ShardHeader:
    entries = scan["entries"]
    if isinstance(entries, list):  # scanned in a worker process: only the names came back
        entries = dict.fromkeys(entries)
        entries.update(scan.get("dense") or {})
    return ShardHeader(Path(scan["path"]), scan["size"], scan["data_start"], entries, scan["metadata"],
                       scan.get("sorted_names"))
