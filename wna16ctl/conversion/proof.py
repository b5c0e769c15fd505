"""`verify ORIGINAL CONVERTED`: proof that a converted checkpoint says exactly what the source does.

1. Tensors: the output holds the tensors the conversion of the source plans (names, dtypes, shapes)
   and the config it plans; every tensor of an unquantized module is byte for byte the source's;
   every projection's tensors equal the source's stored tensors put in the canonical form by the
   source's format and stored by the target's (codes, scales in their dtype, zero points, g_idx) bit
   for bit.  A compressed-tensors source converted to GPTQ is proved the other way too: the output
   read back by the GPTQ format (the reader `inspect` and `repack` use) is the source's tensors.
2. The library (the compressed-tensors side of either direction: the output, or the source of a
   conversion to GPTQ): compressed-tensors' own decompression of each projection of the output (its
   pack-quantized compressor, the one ModelCompressor runs per module; any warning it gives is a
   failure) equals (q - z)·s of the other side's codes in the scale dtype (`layout.packing.dequantize`).
   compressed-tensors 0.19 and later no longer parse `actorder: "group"`, which an act-order GPTQ
   checkpoint needs (vLLM's compressed-tensors path still reads it): such projections are
   decompressed with the library's own unpacking and its (q - z)·s through the g_idx, said so in
   the report.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from wna16ctl.conversion.plan import LAYOUT, ConversionPlan, Projection, plan_conversion, weights_key
from wna16ctl.conversion.write import PIECE, converted_tensors
from wna16ctl.sources import formats
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, SHAPE, ZERO_POINTS

ACT_ORDER_NOTE = ("compressed-tensors >= 0.19 does not parse actorder group: act-order projections were unpacked by "
                  "its unpack_from_int32 and dequantized by its (q - z)·s through the g_idx")


@dataclass
class ConversionProof:
    original: Path
    converted: Path
    problems: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    projections_checked: int = 0
    library_checked: int = 0  # projections compressed-tensors decompressed to the source's values
    library: str = ""  # how the library decompressed them
    notes: list[str] = field(default_factory=list)
    target: str = ""  # the format written (`written_form`)
    reverse: bool = False  # compressed-tensors is the source's format (the library decompresses the source)

    @property
    def passed(self) -> bool:
        return (not self.problems and self.projections_checked > 0
                and self.library_checked == self.projections_checked)

    @property
    def partial(self) -> bool:
        return False

    @property
    def next_steps(self) -> list[Any]:
        return []

    def to_json(self) -> dict[str, Any]:
        return {"original": str(self.original), "converted": str(self.converted), "layout": LAYOUT,
                "passed": self.passed, "tensors_checked": self.tensors_checked,
                "projections_checked": self.projections_checked, "library_checked": self.library_checked,
                "library": self.library, "notes": self.notes, "target": self.target, "partial": False,
                "next_steps": [],
                "problems": self.problems}

    def lines(self) -> list[str]:
        out = [f"FAIL {p}" for p in self.problems[:20]]
        if len(self.problems) > 20:
            out.append(f"... and {len(self.problems) - 20} more")
        ok = "PASS" if self.projections_checked and not self.problems else "FAIL"
        out.append(f"{ok} tensors: {self.tensors_checked} checked, {self.projections_checked} quantized projections "
                   "carried exactly (codes, scales, zero points, g_idx)")
        lib = "PASS" if self.library_checked == self.projections_checked and self.library_checked else "FAIL"
        whose, other = ("of the source ", "the output's (q - z)·s as GPTQ reads it") if self.reverse else \
            ("", "the source's (q - z)·s")
        out.append(f"{lib} compressed-tensors decompresses {self.library_checked} of {self.projections_checked} "
                   f"projections {whose}to {other} ({self.library})")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"{'PASS' if self.passed else 'FAIL'} {self.converted} is {self.original} in {self.target}")
        return out


def is_converted_output(out: str | os.PathLike[str]) -> bool:
    """Whether `out` is a committed `convert` output (its manifest says so)."""
    from wna16ctl.output.outdir import our_manifest

    manifest = our_manifest(Path(out)) if Path(out).is_dir() else None
    return manifest is not None and manifest.get("layout") == LAYOUT


def verify_conversion(original: str | os.PathLike[str], converted: str | os.PathLike[str]) -> ConversionProof:
    from wna16ctl.conversion.plan import identity
    from wna16ctl.output.outdir import our_manifest
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    proof = ConversionProof(Path(original), Path(converted))
    manifest = our_manifest(Path(converted)) or {}
    plan = plan_conversion(original, _target_of(manifest))
    proof.target, proof.reverse = plan.writer.written_form, plan.target is not formats.DEFAULT
    if manifest.get("identity") != identity(plan.checkpoint, plan.writer):
        proof.problems.append(f"{converted}: its manifest records another source or other settings than {original}")
    out = open_checkpoint(converted)
    _check_layout(plan, out, proof)
    if proof.problems:
        return proof
    fmt = formats.of(plan.checkpoint.config.quant)
    ct_side = plan.checkpoint.config if proof.reverse else out.config
    library = _Library(ct_side.quant.raw if ct_side.quant is not None else {}, plan)
    proof.library = library.how
    with TensorReader(plan.checkpoint.files) as src, TensorReader(out.files) as dst:
        for _, f in plan.files:
            for name in _copied(plan, f):
                proof.tensors_checked += 1
                if not _same_bytes(src, dst, name):
                    proof.problems.append(f"tensor {name}: differs from the source's bytes")
        for p in plan.projections.values():
            proof.projections_checked += 1
            problem = _check_projection(p, fmt, src, dst, library, proof)
            if problem is None:
                proof.library_checked += 1
            else:
                proof.problems.append(problem)
    proof.notes += library.notes
    return proof


def _target_of(manifest: dict[str, Any]) -> str | None:
    """The CONVERT_TARGETS key of the format a `convert` output's manifest records (None: unknown)."""
    written = ((manifest.get("identity") or {}).get("settings") or {}).get("target")
    return next((k for k, (_, w) in formats.CONVERT_TARGETS.items() if w.written_form == written), None)


def _check_projection(p: Projection, fmt: Any, src: Any, dst: Any, library: "_Library",
                      proof: ConversionProof) -> str | None:
    """The first problem with one projection: its output tensors against the conversion of the
    source's, bit for bit; a conversion to GPTQ read back by GPTQ against the source's tensors; then
    the library's decompression of the compressed-tensors side against the other side's (q - z)·s."""
    want = converted_tensors(p, fmt, src)
    got = {name: dst.read(name) for name in want}
    proof.tensors_checked += len(want)
    bad = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    if bad:
        return f"tensor {bad[0]}: differs from the source's {p.module} in the canonical form"
    target = p.writer.fmt
    roles = (CODES, SCALES, ZERO_POINTS, G_IDX) + ((SHAPE,) if target.names.shape is not None else ())
    by_role = {r: got[target.names.tensor(p.module, r)] for r in roles if target.names.tensor(p.module, r) in got}
    if not proof.reverse:
        return library.check(p, by_role, by_role)
    names = {r: target.names.tensor(p.module, r) for r in by_role}
    canon = target.canonical(by_role, p.target_scheme, names)  # GPTQ's own reading of the output
    source = {r: src.read(n) for r, n in p.stored.items()}
    if set(canon) != set(source) or any(not torch.equal(canon[r], source[r]) for r in canon):
        return f"tensor {names[CODES]}: GPTQ reads the output back otherwise than the source's {p.module}"
    return library.check(p, source, canon)


def _check_layout(plan: ConversionPlan, out: Any, proof: ConversionProof) -> None:
    want = {t.name: (t.dtype, list(t.shape)) for _, f in plan.files for t in f.tensors}
    got = {n: (out.files.raw(n)["dtype"], list(out.files.raw(n)["shape"])) for n in out.files.names()}
    for name in sorted(set(want) ^ set(got))[:5]:
        proof.problems.append(f"tensor {name}: {'missing from' if name in want else 'not planned in'} the output")
    for name in sorted(n for n in set(want) & set(got) if want[n] != got[n])[:5]:
        proof.problems.append(f"tensor {name}: {got[name]}, the conversion plans {want[name]}")
    written = out.config.quant.raw if out.config.quant is not None else None
    if written != plan.config:
        proof.problems.append(f"{out.root / 'config.json'}: quantization_config is not the one the conversion plans")


def _copied(plan: ConversionPlan, f: Any) -> Iterator[str]:
    made = {name for p in plan.projections.values() for name, _, _ in p.written()}
    return (t.name for t in f.tensors if t.name not in made)


def _same_bytes(src: Any, dst: Any, name: str) -> bool:
    a, b = src.files.info(name), dst.files.info(name)
    if a.nbytes != b.nbytes:
        return False
    for start in range(0, a.nbytes, PIECE):
        n = min(PIECE, a.nbytes - start)
        pieces = []
        for reader, info in ((src, a), (dst, b)):
            buf = bytearray(n)
            reader.read_into(type(info)(info.name, info.dtype, (), info.file, info.start + start, info.start + start + n),
                             memoryview(buf))
            pieces.append(buf)
        if pieces[0] != pieces[1]:
            return False
    return True


class _Library:
    """compressed-tensors' decompression of one converted projection, warnings caught."""

    def __init__(self, raw: dict[str, Any], plan: ConversionPlan):
        import compressed_tensors

        self.notes: list[str] = []
        self.schemes: dict[tuple, Any] = {}
        self.version = compressed_tensors.__version__
        self.how = f"compressed-tensors {self.version}, its pack-quantized compressor"
        self.raw = raw
        self.parse_error: str | None = None
        try:
            with _no_warnings() as caught:
                from compressed_tensors.quantization import QuantizationConfig

                config = QuantizationConfig.model_validate(raw)
            self.warned = caught
            for name, group in config.config_groups.items():
                self.schemes[_key_of(raw["config_groups"][name]["weights"])] = group
        except ValueError as e:
            self.parse_error = str(e).splitlines()[0]
            self.warned = []

    def check(self, p: Projection, by_role: dict[str, torch.Tensor], canon: dict[str, torch.Tensor]) -> str | None:
        """The library's decompression of the pack-quantized tensors `by_role` (one projection) against
        (q - z)·s of the canonical tensors `canon` of the other side (the same tensors where the
        output is the pack-quantized side)."""
        from wna16ctl.layout.packing import dequantize
        from wna16ctl.sources.formats.bits import unpack_bits
        from wna16ctl.sources.formats.compressed_tensors import NAMES

        codes_name = NAMES.tensor(p.module, CODES)
        if self.warned:
            return f"compressed-tensors warned while reading the config: {self.warned[0]}"
        by_role = dict(by_role)
        by_role.setdefault(SHAPE, torch.tensor([p.n, p.k], dtype=torch.int64))
        try:
            with _no_warnings() as caught:
                weight = self._decompress(p, by_role, self.schemes.get(weights_key(p.scheme)))
        except Exception as e:  # the library's own refusal, named
            return f"tensor {codes_name}: compressed-tensors cannot decompress it ({type(e).__name__}: {e})"
        if caught:
            return f"tensor {codes_name}: compressed-tensors warned: {caught[0]}"
        s, b = canon[SCALES], p.scheme.num_bits
        codes = unpack_bits(canon[CODES], b, dim=1, size=p.k).t()
        groups = canon[G_IDX].long() if G_IDX in canon else _groups(p)
        zeros = unpack_bits(canon[ZERO_POINTS], b, dim=0, size=p.n).t() if ZERO_POINTS in canon else None
        want = dequantize(codes, s.t(), groups, b, s.dtype, zeros).t()
        if weight.dtype != want.dtype or not torch.equal(weight, want):
            return f"tensor {codes_name}: compressed-tensors decompresses it to other values than the source's"
        return None

    def _decompress(self, p: Projection, by_role: dict[str, torch.Tensor], scheme: Any) -> torch.Tensor:
        from wna16ctl.sources.formats.compressed_tensors import NAMES, PACK_QUANTIZED

        if scheme is not None and not p.scheme.act_order:
            from compressed_tensors.compressors import BaseCompressor

            compressor = BaseCompressor.get_value_from_registry(scheme.format or PACK_QUANTIZED)
            return compressor.decompress({NAMES.suffix(r): t for r, t in by_role.items()}, scheme)["weight"]
        if not p.scheme.act_order:
            raise ValueError(self.parse_error or "no config group of the output's config holds this scheme")
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        if ACT_ORDER_NOTE not in self.notes:
            self.notes.append(ACT_ORDER_NOTE)
        s = by_role[SCALES]
        q = unpack_from_int32(by_role[CODES], p.scheme.num_bits, torch.Size((p.n, p.k)))
        if ZERO_POINTS in by_role:
            z = unpack_from_int32(by_role[ZERO_POINTS], p.scheme.num_bits, torch.Size(s.shape), packed_dim=0)
        else:
            z = torch.zeros(s.shape, dtype=torch.int8)
        g = by_role[G_IDX].long()
        return (q.to(s.dtype) - z[:, g].to(s.dtype)) * s[:, g]


def _groups(p: Projection) -> torch.Tensor:
    if p.scheme.group_size > 0:
        return torch.arange(p.k) // p.scheme.group_size
    return torch.zeros(p.k, dtype=torch.long)


def _key_of(weights: dict[str, Any]) -> tuple:
    from wna16ctl.sources.scheme import WeightScheme

    group = int(weights["group_size"]) if weights.get("strategy") == "group" else -1
    s = WeightScheme(int(weights["num_bits"]), group, bool(weights["symmetric"]), str(weights["strategy"]),
                     weights.get("actorder"), "")
    return weights_key(s)


class _no_warnings:
    """Collects the warnings (Python's and compressed-tensors' loguru ones) given inside it."""

    def __enter__(self) -> list[str]:
        self.caught: list[str] = []
        self._warnings = warnings.catch_warnings(record=True)
        self._records = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._sink = None
        try:
            from loguru import logger

            self._sink = logger.add(lambda m: self.caught.append(str(m).strip()), level="WARNING")
        except ImportError:
            pass
        return self.caught

    def __exit__(self, *exc: Any) -> None:
        if self._sink is not None:
            from loguru import logger

            logger.remove(self._sink)
        self.caught += [str(w.message) for w in self._records]
        self._warnings.__exit__(*exc)
