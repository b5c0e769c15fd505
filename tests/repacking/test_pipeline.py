"""`repack` on checkpoints written by compressed-tensors: every output tensor checked against the
checkpoint read with `safetensors` directly and against the independent layout reference
(`tests/layout/reference.py`), plus the writer's guarantees (determinism, atomic commit, resume)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import wna16ctl.repacking.pipeline as repack_mod
import wna16ctl.repacking.native_path as repack_native
import wna16ctl.output.writer as writer_mod
from tests.conftest import ACT_ORDER_RELEASE, QUESTIONS
from tests.layout import reference
from tests.layout.data import to_numpy
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput, NotLoadable, UsageError
from wna16ctl.layout.marlin import marlin_permute_scales
from wna16ctl.layout.rank import expected_rank_shapes, unbuild_rank_tensors
from wna16ctl.layout.shard import unshard_expert
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack, source_fingerprint
from wna16ctl.verification.checks import verify_output
from wna16ctl.output.writer import MANIFEST_NAME

BASE = dict(num_layers=1, num_experts=4, vocab_size=64)  # H 256, I 256: small, every layout fits
EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z0-9_]+)\.(?P<suffix>[a-z_]+)$")
ROLES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tensors are small: one thread is fastest, and does not collapse on oversubscribed cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def single_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# ---- independent readers -------------------------------------------------------------------------


def read_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path`, read with safetensors itself."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as so:
            for k in so.keys():
                assert k not in out, f"{k} in two files"
                out[k] = so.get_tensor(k)
    return out


def ckpt_expert(src: dict[str, torch.Tensor], prefix: str, e: int) -> dict[str, dict[str, torch.Tensor]]:
    """One expert's checkpoint tensors (without weight_shape), from a `read_dir` dict."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for role, names in ROLES.items():
        proj = next(n for n in names if f"{prefix}.{e}.{n}.weight_packed" in src)
        out[role] = {s: src[f"{prefix}.{e}.{proj}.{s}"]
                     for s in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")
                     if f"{prefix}.{e}.{proj}.{s}" in src}
    return out


def non_expert_names(src: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in src if not EXPERT_RE.match(n)}


def expert_ranges(num_experts: int, tp: int, ep: bool) -> list[range]:
    """Linear expert placement (E // ep each, the first E % ep ranks one more); all experts under TP."""
    if not ep:
        return [range(num_experts)] * tp
    base, extra = divmod(num_experts, tp)
    out, start = [], 0
    for r in range(tp):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def require_native_path(ck: Path, settings: RepackSettings) -> None:
    """Skip unless every layer of this plan takes the native data path here (a C++ compiler)."""
    plan = plan_repack(ck, settings)
    why = {repack_native.unsupported(j.layer, j.specs[0], plan.scale_st_dtype, "auto") for j in plan.jobs}
    if why != {None}:
        pytest.skip(f"native data path not taken: {why - {None}}")


def file_digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file: the input must never change."""
    return {p.relative_to(root).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    """Anything the run left beside OUT (the hidden staging / old directories)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def ref_numpy(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t.to(torch.int32) if t.dtype == torch.int64 else t)


def tensor_extent(path: Path, name: str) -> tuple[int, int]:
    """(absolute start, end) of a tensor's data in a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start, end = header[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def patch_tensor(path: Path, name: str, tensor: torch.Tensor) -> None:
    """Overwrite a tensor's data in place (same dtype and shape), leaving every other byte alone."""
    start, end = tensor_extent(path, name)
    data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    assert len(data) == end - start, (name, len(data), end - start)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(data)


@pytest.fixture(scope="session")
def ckpt(make_ckpt, tmp_path_factory):
    """`make_ckpt`, except that in act-order checkpoints up_proj gets gate_proj's g_idx.

    GPTQ orders gate_proj and up_proj by the same activations, so real checkpoints store one g_idx
    for both (vLLM keeps only up_proj's, and repack refuses experts whose two differ); the demo
    writer draws one per module.  Checkpoints whose g_idx already agree are returned unchanged.
    """
    fixed: dict[tuple, Path] = {}
    gate_re = re.compile(r"\.(gate_proj|w1)\.weight_g_idx$")

    def up_name(gate: str) -> str:
        return gate.replace(".gate_proj.", ".up_proj.").replace(".w1.", ".w3.")

    def make(**spec) -> Path:
        src = make_ckpt(**spec)
        key = tuple(sorted(spec.items()))
        if spec.get("actorder") != "group":
            return src
        if key not in fixed:
            tensors = read_dir(src)
            gates = {n: t for n, t in tensors.items() if gate_re.search(n)}
            if all(tensors[up_name(n)].equal(g) for n, g in gates.items()):
                fixed[key] = src
            else:
                dst = tmp_path_factory.mktemp("ckpt-ao") / "ck"
                shutil.copytree(src, dst)
                shards = {n: p for p in dst.glob("*.safetensors") for n in safe_open(p, "pt").keys()}
                for n, g in gates.items():
                    patch_tensor(shards[up_name(n)], up_name(n), g)
                fixed[key] = dst
        return fixed[key]

    return make


# ---- the independent check -------------------------------------------------------------------------


def check_output_independently(ck: Path, out: Path, plan) -> None:
    """Rank files read with safe_open: names/shapes/dtypes as planned, copied tensors unchanged, the
    expert tensors equal the reference layout of the checkpoint and invert back to it."""
    src = read_dir(ck)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    tp = manifest["tp"]
    assert len(plan.files) == tp
    per_layer_rank: dict[str, list[list[dict]]] = {}
    for r in range(tp):
        got = read_dir(out / f"rank-{r}")
        expected = {n: (tuple(src[n].shape), src[n].dtype) for n in non_expert_names(src)}
        for job in plan.jobs:
            n_local = len(job.expert_ranges[r])
            if n_local:
                for name, (shape, dt) in expected_rank_shapes(job.specs[r], n_local, plan.scale_dtype).items():
                    expected[f"{job.layer.prefix}.{name}"] = (tuple(shape), dt)
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == expected
        for n in non_expert_names(src):
            assert got[n].view(torch.uint8).equal(src[n].view(torch.uint8)), n
        for job in plan.jobs:
            prefix, spec = job.layer.prefix, job.specs[r]
            rng = expert_ranges(job.layer.num_experts, tp, manifest["ep"])[r]
            assert job.expert_ranges[r] == rng
            if not len(rng):
                continue
            tensors = {n: got[f"{prefix}.{n}"] for n in expected_rank_shapes(spec, 1, plan.scale_dtype)}
            # the independent reference, from the checkpoint's codes
            experts_np = [{role: {k: to_numpy(v) for k, v in proj.items()}
                           for role, proj in ckpt_expert(src, prefix, e).items()} for e in rng]
            ref = reference.rank_tensors(
                experts_np, layout=spec.layout, tp=spec.tp, rank=spec.rank,
                load_full_w2=spec.act_order and spec.group_size != -1, group_size=spec.group_size,
                num_bits=spec.num_bits, act_order=spec.act_order)
            assert sorted(ref) == sorted(tensors)
            for name, t in tensors.items():
                assert np.array_equal(to_numpy(t), ref[name]), f"rank {r} {prefix}.{name} differs from the reference"
            per_layer_rank.setdefault(prefix, [[] for _ in range(tp)])[r] = unbuild_rank_tensors(tensors, spec)
    # the ranks re-assemble into the checkpoint
    for job in plan.jobs:
        prefix, spec = job.layer.prefix, job.specs[0]
        ranges = expert_ranges(job.layer.num_experts, tp, manifest["ep"])
        for e in range(job.layer.num_experts):
            if manifest["ep"]:
                r = next(r for r, rng in enumerate(ranges) if e in rng)
                parts = [per_layer_rank[prefix][r][e - ranges[r].start]]
            else:
                parts = [per_layer_rank[prefix][r][e] for r in range(tp)]
            back = unshard_expert(parts, tp=len(parts), load_full_w2=spec.load_full_w2,
                                  group_size=spec.group_size, expert_id=e)
            want = ckpt_expert(src, prefix, e)
            for role in ROLES:
                assert sorted(back[role]) == sorted(want[role]), (e, role)
                for k, v in want[role].items():
                    b = back[role][k]
                    assert b.shape == v.shape and np.array_equal(ref_numpy(b), ref_numpy(v)), (prefix, e, role, k)


# ---- the matrix -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    bits: int
    gs: int
    sym: bool
    actorder: str | None
    tp: int
    ep: bool = False
    layout: str = "auto"
    refuse: str | None = None  # substring of the planner's refusal

    @property
    def id(self) -> str:
        return (f"int{self.bits}-g{self.gs}-{'sym' if self.sym else 'asym'}-{self.actorder or 'none'}-"
                f"{'ep' if self.ep else 'tp'}{self.tp}{'' if self.layout == 'auto' else '-' + self.layout}")

    def ckpt(self, make) -> Path:
        return make(num_bits=self.bits, group_size=self.gs, symmetric=self.sym, actorder=self.actorder, **BASE)

    def settings(self, **kw) -> RepackSettings:
        return RepackSettings(vllm=ACT_ORDER_RELEASE, tp=self.tp, ep=self.ep, layout=self.layout, **kw)


# Every value of every axis, most pairs of values (int4/int8 x each group size, actorder, TP/EP;
# asym x actorder, TP/EP, layout); what vLLM refuses is asserted to be refused, for its reason.
MATRIX = [
    Case(4, 128, True, None, 1),
    Case(4, 128, True, None, 2),
    Case(4, 64, False, "static", 4),
    Case(4, 32, True, "group", 2),                   # act-order under TP: full w2 scales, is_k_full False
    Case(4, -1, False, None, 2),
    Case(4, 32, False, None, 2, ep=True),
    Case(4, 64, True, "group", 3, ep=True),          # 4 experts on 3 ranks: 2, 1, 1
    Case(4, 128, False, "group", 1),                 # asym act-order is fine at TP 1
    Case(4, 128, False, None, 2, layout="transposed"),
    Case(4, -1, True, "static", 2, ep=True, layout="transposed"),
    Case(8, 128, True, None, 2),
    Case(8, -1, True, "static", 4),
    Case(8, 64, True, "group", 2),
    Case(8, 32, True, None, 2, ep=True),
    Case(8, 128, True, "static", 1),
    Case(8, 32, True, None, 4, layout="transposed"),
    # refused
    Case(8, 64, False, None, 2, refuse="No WNA16 MoE backend supports"),
    Case(8, -1, False, "static", 1, ep=True, refuse="uint8 generic group with zero points"),
    Case(4, 128, True, None, 4, refuse="to be divisible by group_size (128)"),
    Case(4, 128, True, "group", 4, refuse="assert actorder != 'group'"),
    Case(4, 32, False, "group", 2, refuse="asymmetric zero points under tensor parallelism"),
    Case(4, 64, True, "group", 2, layout="transposed", refuse="cannot write the transposed layout"),
    Case(4, 128, True, None, 3, refuse="assert intermediate_size % tp_size == 0"),
]


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.id)
def test_round_trip_matrix(ckpt, tmp_path, case, monkeypatch):
    ck = case.ckpt(ckpt)
    if case.tp == 3 and not case.refuse:
        # vLLM refuses the demo model at TP 3 (4 attention heads, a vocabulary padded to 64): this
        # case is about 4 experts placed unevenly on 3 ranks, so the model-level check is set aside
        monkeypatch.setattr("wna16ctl.repacking.pipeline.model_refusal", lambda *a, **k: None)
    if case.refuse:
        with pytest.raises(NotLoadable, match=re.escape(case.refuse)):
            plan_repack(ck, case.settings())
        return
    plan = plan_repack(ck, case.settings())
    want_layout = "transposed" if case.layout == "transposed" else "marlin"
    assert [j.layout for j in plan.jobs] == [want_layout]
    res = run_repack(plan, tmp_path / "out")
    # per rank a file of non-expert tensors and one per expert tensor kind of the layer
    assert res.files_written == case.tp * (1 + len(plan.jobs[0].tensor_names)) and res.files_reused == 0
    assert res.files_written == sum(len(fs) for fs in plan.files)
    check_output_independently(ck, tmp_path / "out", plan)
    report = verify_output(ck, tmp_path / "out", samples=QUESTIONS, num_samples=8)
    assert report.passed, [f.to_json() for f in report.findings] + [n.to_json() for n in report.numerics]
    assert report.layers_checked == 1 and report.experts_checked == 4


def test_refused_mixed_experts(make_ckpt):
    ck = make_ckpt(mixed="expert", **BASE)
    with pytest.raises(NotLoadable, match="per-expert mixed precision"):
        plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1))


# ---- layouts against the spec's closed forms -----------------------------------------------------------


def _codes(packed: torch.Tensor, bits: int, size: int) -> np.ndarray:
    """[N, K/pf] checkpoint words -> [N, K] codes."""
    return reference.unpack(packed.numpy(), bits, axis=1, size=size)


@pytest.mark.parametrize("rank,expert", [(0, 0), (1, 2)])
def test_marlin_equals_closed_form(make_ckpt, tmp_path, rank, expert):
    ck = make_ckpt(**BASE)
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2))
    run_repack(plan, tmp_path / "out")
    src = read_dir(ck)
    prefix = plan.jobs[0].layer.prefix
    h = i = 256
    i_p = i // 2
    rows = slice(rank * i_p, (rank + 1) * i_p)
    gate = _codes(src[f"{prefix}.{expert}.gate_proj.weight_packed"], 4, h)
    up = _codes(src[f"{prefix}.{expert}.up_proj.weight_packed"], 4, h)
    down = _codes(src[f"{prefix}.{expert}.down_proj.weight_packed"], 4, i)
    got = read_dir(tmp_path / "out" / f"rank-{rank}")
    w13 = got[f"{prefix}.w13_weight_packed"][expert].numpy()
    w2 = got[f"{prefix}.w2_weight_packed"][expert].numpy()
    # §6.4: the K-first codes (gate | up columns of this rank; down rows of this rank), closed form
    assert np.array_equal(w13, reference.marlin_closed_form(np.concatenate([gate[rows].T, up[rows].T], axis=1), 4))
    assert np.array_equal(w2, reference.marlin_closed_form(np.ascontiguousarray(down[:, rows].T), 4))
    # the scalar-loop variant of the formula on one k-tile row
    q = np.concatenate([gate[rows].T, up[rows].T], axis=1)[:16].tolist()
    loops = np.array(reference.marlin_closed_form_loops(q, 4), dtype=np.int64).astype(np.uint32).view(np.int32)
    assert np.array_equal(w13[:1], loops)


@pytest.mark.parametrize("bits,gs,sym,tp", [(4, 128, False, 2), (8, 32, True, 4)])
def test_transposed_layout_is_spec_7_1(make_ckpt, tmp_path, bits, gs, sym, tp):
    ck = make_ckpt(num_bits=bits, group_size=gs, symmetric=sym, **BASE)
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=tp, layout="transposed"))
    run_repack(plan, tmp_path / "out")
    src = read_dir(ck)
    prefix = plan.jobs[0].layer.prefix
    for r in range(tp):
        kfirst = [reference.shard({role: {k: to_numpy(v) for k, v in p.items()}
                                   for role, p in ckpt_expert(src, prefix, e).items()},
                                  tp, r, False, gs, bits) for e in range(4)]
        got = read_dir(tmp_path / "out" / f"rank-{r}")
        for which in ("w13", "w2"):
            w = torch.from_numpy(np.stack([k[f"{which}_weight_packed"] for k in kfirst]))  # [E, K/pf, N] int32
            assert got[f"{prefix}.{which}_weight_packed"].equal(w.transpose(1, 2).contiguous().view(torch.uint8))
            s = torch.from_numpy(np.stack([k[f"{which}_weight_scale"] for k in kfirst])).view(torch.bfloat16)
            assert got[f"{prefix}.{which}_weight_scale"].view(torch.int16).equal(
                s.transpose(1, 2).contiguous().view(torch.int16))
        if not sym:  # §7.2: zero-point byte n//2 holds z[n] at nibble (n mod 2)·4
            ref = [reference.transposed_expert(k, bits) for k in kfirst]
            for which in ("w13", "w2"):
                name = f"{which}_weight_zero_point"
                assert np.array_equal(got[f"{prefix}.{name}"].numpy(), np.stack([x[name] for x in ref]))


@pytest.mark.parametrize("i,gs,padded", [(96, -1, 128), (32, 32, 64)])
def test_marlin_tile_padding(make_ckpt, tmp_path, i, gs, padded):
    ck = make_ckpt(intermediate_size=i, group_size=gs, **BASE)
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1))
    assert plan.jobs[0].specs[0].padded_intermediate == padded
    run_repack(plan, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["layers"][0]["padded_intermediate"] == padded
    assert manifest["layers"][0]["intermediate_size_per_partition"] == i
    check_output_independently(ck, tmp_path / "out", plan)  # shapes [.., 2P ..] and reference padding
    got = read_dir(tmp_path / "out" / "rank-0")
    prefix = plan.jobs[0].layer.prefix
    assert got[f"{prefix}.w13_weight_packed"].shape == (4, 256 // 16, 2 * padded * 2)
    assert got[f"{prefix}.w2_weight_packed"].shape == (4, padded // 16, 256 * 2)
    # the padded w13 scale columns are zero in each half (the scale permutation stays within 64-chunks)
    s13 = got[f"{prefix}.w13_weight_scale"].float()
    assert (s13 != 0).sum().item() == 4 * s13.shape[1] * 2 * i
    report = verify_output(ck, tmp_path / "out", samples=QUESTIONS, num_samples=8)
    assert report.passed, [f.to_json() for f in report.findings]


def test_w13_scales_use_hidden_size_when_partition_equals_group(make_ckpt, tmp_path):
    # H 256, I 256, g128, TP 2: I_p == group_size; vLLM's size_k = I_p picks the single permutation.
    ck = make_ckpt(**BASE)
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2))
    run_repack(plan, tmp_path / "out")
    src = read_dir(ck)
    prefix = plan.jobs[0].layer.prefix
    h, i_p, gs = 256, 128, 128
    for r in range(2):
        got = read_dir(tmp_path / "out" / f"rank-{r}")[f"{prefix}.w13_weight_scale"]
        for e in range(4):
            rows = slice(r * i_p, (r + 1) * i_p)
            kfirst = torch.cat([src[f"{prefix}.{e}.gate_proj.weight_scale"][rows].T,
                                src[f"{prefix}.{e}.up_proj.weight_scale"][rows].T], dim=1).contiguous()
            right = marlin_permute_scales(kfirst, h, 2 * i_p, gs)
            quirk = marlin_permute_scales(kfirst, i_p, 2 * i_p, gs)
            assert got[e].equal(right)
            assert not got[e].equal(quirk)
            assert np.array_equal(to_numpy(got[e]), reference.permute_scales(to_numpy(kfirst), h, gs))


# ---- determinism, manifest and rank files ----------------------------------------------------------------


def test_two_runs_are_byte_identical(ckpt, tmp_path):
    ck = ckpt(group_size=64, symmetric=False, actorder="group", **BASE)
    for name in ("a", "b"):
        run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1, max_shard_bytes=200_000)), tmp_path / name)
    a, b = file_digests(tmp_path / "a"), file_digests(tmp_path / "b")
    assert len(a) > 4 and a == b


def test_manifest_and_rank_files(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=2, num_experts=4, vocab_size=64)
    out = tmp_path / "out"
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2, max_shard_bytes=300_000))
    run_repack(plan, out)
    m = json.loads((out / MANIFEST_NAME).read_text())
    # the keys of docs/repack-format.md
    assert set(m) == {"format", "format_version", "tool_version", "identity", "source", "engine", "tp", "ep", "layout",
                      "scale_dtype", "ranks", "layers", "copied_tensors", "files"}
    assert m["format"] == "wna16ctl-repack" and m["format_version"] == 1
    assert set(m["identity"]) == {"format", "format_version", "tool_version", "source_fingerprint", "settings"}
    assert set(m["source"]) == {"path", "fingerprint", "architecture"} and m["source"]["path"] == str(ck)
    assert m["identity"]["settings"] == {"tp": 2, "ep": False, "layout": "auto", "max_shard_bytes": 300_000,
                                         "vllm": ACT_ORDER_RELEASE, "gpu": "sm90"}
    assert m["engine"] == {"name": "vllm", "version": ACT_ORDER_RELEASE, "gpu": "sm90"}
    assert m["source"]["fingerprint"] == m["identity"]["source_fingerprint"] == source_fingerprint(plan.checkpoint)
    assert m["source"]["architecture"] == "Qwen3MoeForCausalLM"
    assert (m["tp"], m["ep"], m["layout"], m["scale_dtype"]) == (2, False, "auto", "bfloat16")
    src = read_dir(ck)
    assert m["copied_tensors"] == len(non_expert_names(src))
    # files: every file of OUT but the manifest, with its BLAKE3 digest and size
    on_disk = {p.relative_to(out).as_posix(): blake3.blake3(p.read_bytes()).hexdigest()
               for p in sorted(out.rglob("*")) if p.is_file()}
    del on_disk[MANIFEST_NAME]
    assert sorted(m["files"]) == sorted(on_disk)
    for rel, meta in m["files"].items():
        assert {k: meta[k] for k in ("blake3", "bytes")} == {"blake3": on_disk[rel], "bytes": (out / rel).stat().st_size}, rel
        # the native data path checks a staged file for --resume by rebuilding it: no source digest
        assert set(meta) == {"blake3", "bytes"}, rel
    assert "config.json" in m["files"]
    assert (out / "config.json").read_bytes() == (ck / "config.json").read_bytes()
    # ranks
    assert [(x["rank"], x["dir"]) for x in m["ranks"]] == [(0, "rank-0"), (1, "rank-1")]
    for x in m["ranks"]:
        assert len(x["files"]) > 1  # several files at this max_shard_bytes
        assert sorted(x["files"]) == sorted(k for k in m["files"] if k.startswith(x["dir"] + "/") and
                                            k.endswith(".safetensors"))
        assert x["bytes"] == sum((out / f).stat().st_size for f in x["files"])
        assert all((out / f).stat().st_size <= 300_000 for f in x["files"])
    # layers
    assert [lay["name"] for lay in m["layers"]] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for lay in m["layers"]:
        assert set(lay) == {"name", "layout", "num_experts", "hidden_size", "intermediate_size", "scheme",
                            "quant_type", "is_k_full", "load_full_w2", "intermediate_size_per_partition",
                            "padded_intermediate", "expert_ranges", "tensors", "plan"}
        assert (lay["num_experts"], lay["hidden_size"], lay["intermediate_size"]) == (4, 256, 256)
        assert lay["scheme"]["num_bits"] == 4 and lay["scheme"]["group_size"] == 128
        assert lay["expert_ranges"] == [[0, 4], [0, 4]] and lay["plan"]["backend"] == "marlin"
        assert lay["is_k_full"] is True and lay["load_full_w2"] is False
        assert (lay["quant_type"], lay["layout"], lay["padded_intermediate"]) == ("uint4b8", "marlin", 128)
        assert lay["intermediate_size_per_partition"] == 128
        assert lay["tensors"] == ["w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"]
    # each rank directory loads with safetensors.torch, its index covers it, non-expert tensors unchanged
    for r in range(2):
        tensors: dict[str, torch.Tensor] = {}
        for f in m["ranks"][r]["files"]:
            tensors |= load_file(out / f)
            with safe_open(out / f, framework="pt") as so:
                assert so.metadata() == {"format": "pt"}
        index = json.loads((out / f"rank-{r}" / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(tensors)
        for n in non_expert_names(src):
            assert tensors[n].view(torch.uint8).equal(src[n].view(torch.uint8)), n
        assert sorted(tensors) == sorted(non_expert_names(src) | {
            f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in m["layers"][0]["tensors"]})


# ---- atomic commit, failures, resume ---------------------------------------------------------------------


def _repack_cli(*args: str):
    return CliRunner().invoke(cli, ["repack", "--vllm", ACT_ORDER_RELEASE, *args])


def test_existing_output_refused_then_forced(make_ckpt, tmp_path):
    ck = make_ckpt(**BASE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = _repack_cli(str(ck), "--tp", "2", "-o", str(out))
    assert res.exit_code == 2, res.output
    assert "exists and is not empty" in res.stderr and "--force" in res.stderr
    assert "Traceback" not in res.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert leftovers(out) == []
    # --force replaces only what wna16ctl wrote: a user's file is named and kept
    res = _repack_cli(str(ck), "--tp", "2", "-o", str(out), "--force")
    assert res.exit_code == 2, res.output
    assert "keep.txt" in res.stderr and "not written by wna16ctl" in res.stderr
    assert (out / "keep.txt").read_text() == "mine" and leftovers(out) == []
    (out / "keep.txt").unlink()
    res = _repack_cli(str(ck), "--tp", "2", "-o", str(out), "--force", "--json")  # an empty directory
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["files_written"] == 2 * 5  # per rank: non-expert tensors, 4 expert kinds
    res = _repack_cli(str(ck), "--tp", "1", "-o", str(out), "--force", "--json")  # an earlier output
    assert res.exit_code == 0, res.output
    assert json.loads((out / MANIFEST_NAME).read_text())["tp"] == 1 and not (out / "rank-1").exists()
    assert leftovers(out) == []


@pytest.mark.parametrize("where", ["inside", "parent"])
def test_output_around_the_checkpoint_refused(make_ckpt, tmp_path, where):
    ck = tmp_path / "models" / "ck"
    shutil.copytree(make_ckpt(**BASE), ck)
    before = snapshot(ck)
    out = ck / "tp2" if where == "inside" else tmp_path / "models"
    # --force replaces OUT whole at the commit: an OUT holding the checkpoint would take it along
    with pytest.raises(UsageError, match="inside the checkpoint" if where == "inside" else "contains the checkpoint"):
        run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)), out, force=True)
    assert snapshot(ck) == before and sorted(p.name for p in (tmp_path / "models").iterdir()) == ["ck"]


def test_disk_full_mid_run_leaves_nothing(make_ckpt, tmp_path, monkeypatch):
    ck = make_ckpt(num_layers=2, num_experts=4, vocab_size=64)
    before = snapshot(ck)
    out = tmp_path / "out"
    real_pwrite = os.pwrite
    calls = []

    def pwrite(fd, data, offset):  # the third write into an output file fails (others may be in flight)
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    res = _repack_cli(str(ck), "--tp", "2", "-o", str(out), "--max-shard-size", "300000")
    assert len(calls) >= 3
    assert res.exit_code == 2, res.output
    assert "No space left on device" in res.stderr and "nothing was left behind" in res.stderr
    assert "free space" in res.stderr and "Traceback" not in res.output
    assert not out.exists() and leftovers(out) == []
    assert snapshot(ck) == before


@pytest.mark.parametrize("layout", ["auto", "vllm"])
def test_disk_full_at_the_commit_leaves_nothing(make_ckpt, tmp_path, monkeypatch, layout):
    """The disk fills while the manifest, the last file, is written: the line says nothing was left
    behind, and nothing is (no staging directory with half a manifest); an earlier output that
    --force was to replace stays as it was."""
    import wna16ctl.output.outdir as outdir_mod

    ck = make_ckpt(**BASE)
    out = tmp_path / "out"
    real_write_file = outdir_mod.write_file

    def write_file(path, data):
        if path.name == MANIFEST_NAME:  # half of it fits, as on a filling disk
            real_write_file(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write_file(path, data)

    for earlier in (False, True):
        if earlier:
            assert _repack_cli(str(ck), "--tp", "1", "-o", str(out), "-q").exit_code == 0
            before = snapshot(out)
        with monkeypatch.context() as m:
            m.setattr(outdir_mod, "write_file", write_file)
            res = _repack_cli(str(ck), "--tp", "2", "--layout", layout, "-o", str(out), *(["--force"] if earlier else []))
        assert res.exit_code == 2, res.output
        assert "No space left on device" in res.stderr and "nothing was left behind" in res.stderr, res.stderr
        assert leftovers(out) == [], leftovers(out)
        assert snapshot(out) == before if earlier else not out.exists()


def test_source_truncated_after_planning(make_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(make_ckpt(**BASE), ck)
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2))
    shard = max(ck.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    out = tmp_path / "out"
    with pytest.raises(BadInput) as info:
        run_repack(plan, out)
    assert str(shard) in info.value.message and "truncated" in info.value.message
    assert not out.exists() and leftovers(out) == []


def test_unwritable_output_parent_chmod(make_ckpt, tmp_path):
    ck = make_ckpt(**BASE)
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("running as root: chmod does not take write permission away")
        res = _repack_cli(str(ck), "--tp", "2", "-o", str(parent / "out"))
        assert res.exit_code == 2, res.output
        assert "Permission denied" in res.stderr and "Traceback" not in res.output
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_unwritable_output_parent_simulated(make_ckpt, tmp_path, monkeypatch):
    # Same path as a read-only parent (which root cannot produce): creating the staging dir fails.
    ck = make_ckpt(**BASE)
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if self.name.endswith(".wna16ctl-partial"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    res = _repack_cli(str(ck), "--tp", "2", "-o", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and "Permission denied" in lines[0]
    assert all(ln.startswith(("error:", "hint:")) for ln in lines) and len(lines) <= 2
    assert not (tmp_path / "out").exists()


@pytest.fixture
def two_layer_ckpt(make_ckpt):
    return make_ckpt(num_layers=2, num_experts=4, vocab_size=64)


RESUME_SETTINGS = RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2, max_shard_bytes=300_000)


@pytest.mark.parametrize("data_path", ["native", "torch"])
def test_interrupt_then_resume(two_layer_ckpt, tmp_path, monkeypatch, data_path):
    ck = two_layer_ckpt
    if data_path == "torch":
        monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    else:
        require_native_path(ck, RESUME_SETTINGS)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(ck, RESUME_SETTINGS), fresh)
    out = tmp_path / "out"
    real_build = repack_mod.build_rank_tensors
    real_native_build = repack_native.LayerBuilder.build_into
    real_sha = writer_mod.hash_file
    calls = []
    first_layer = plan_repack(ck, RESUME_SETTINGS).jobs[0].layer.prefix

    def build(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # layer 0 written on both ranks, layer 1 under way
            raise KeyboardInterrupt
        return real_build(*a, **kw)

    def native_build(self, *a, **kw):
        if self.layer.prefix != first_layer:  # layer 0 written on both ranks, layer 1 under way
            raise KeyboardInterrupt
        return real_native_build(self, *a, **kw)

    def slow_sha(path, *a, **kw):  # hashes still queued when the interrupt comes
        time.sleep(0.05)
        return real_sha(path, *a, **kw)

    monkeypatch.setattr(repack_mod, "build_rank_tensors", build)
    monkeypatch.setattr(repack_native.LayerBuilder, "build_into", native_build)
    monkeypatch.setattr(writer_mod, "hash_file", slow_sha)
    with pytest.raises(KeyboardInterrupt):
        run_repack(plan_repack(ck, RESUME_SETTINGS), out)
    assert not out.exists()
    # only the staging dir (for --resume): the lock was the staging dir's flock, no lock file
    assert leftovers(out) == [".out.wna16ctl-partial"]
    assert not (tmp_path / ".out.wna16ctl-partial" / MANIFEST_NAME).exists()
    monkeypatch.undo()
    if data_path == "torch":
        monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    res = run_repack(plan_repack(ck, RESUME_SETTINGS), out, resume=True)
    total = sum(len(f) for f in plan_repack(ck, RESUME_SETTINGS).files)
    assert res.files_reused > 0 and res.files_reused + res.files_written == total and res.files_written > 0
    assert file_digests(out) == file_digests(fresh)
    assert leftovers(out) == []


def test_resume_refuses_other_settings(two_layer_ckpt, tmp_path):
    out = tmp_path / "out"
    run_repack(plan_repack(two_layer_ckpt, RESUME_SETTINGS), out)
    before = file_digests(out)
    with pytest.raises(UsageError, match="another source or other settings"):
        run_repack(plan_repack(two_layer_ckpt, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1, max_shard_bytes=300_000)), out, resume=True)
    assert file_digests(out) == before and leftovers(out) == []
    # same settings: everything is reused and the output is unchanged
    res = run_repack(plan_repack(two_layer_ckpt, RESUME_SETTINGS), out, resume=True)
    assert res.files_written == 0 and res.files_reused > 0
    assert file_digests(out) == before and leftovers(out) == []


def _interrupted_run(ck, out, settings, monkeypatch):
    """Leave the staging directory of a run interrupted after its first layer (journal included)."""
    first_layer = plan_repack(ck, settings).jobs[0].layer.prefix
    real_build, real_native_build = repack_mod.build_rank_tensors, repack_native.LayerBuilder.build_into
    calls = []

    def build(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # layer 0 on both ranks, layer 1 under way
            raise KeyboardInterrupt
        return real_build(*a, **kw)

    def native_build(self, *a, **kw):
        if self.layer.prefix != first_layer:
            raise KeyboardInterrupt
        return real_native_build(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(repack_mod, "build_rank_tensors", build)
        m.setattr(repack_native.LayerBuilder, "build_into", native_build)
        with pytest.raises(KeyboardInterrupt):
            run_repack(plan_repack(ck, settings), out)
    stage = out.parent / f".{out.name}.wna16ctl-partial"
    assert stage.is_dir() and not out.exists()
    return stage


def test_resume_of_an_interrupted_run_with_other_settings_is_refused(two_layer_ckpt, tmp_path, monkeypatch):
    """--resume continues a run or says why it cannot; only --force throws the partial run away."""
    out = tmp_path / "out"
    stage = _interrupted_run(two_layer_ckpt, out, RESUME_SETTINGS, monkeypatch)
    before = file_digests(stage)
    other = RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1, max_shard_bytes=200_000)
    with pytest.raises(UsageError) as refused:
        run_repack(plan_repack(two_layer_ckpt, other), out, resume=True)
    message = refused.value.message
    assert "tp: 2 there, 1 now" in message and "max_shard_bytes: 300000 there, 200000 now" in message, message
    assert "--force" in message and "\n" not in message
    assert file_digests(stage) == before and not out.exists()
    # through the command line: one line, exit 2, the staging directory untouched
    res = _repack_cli(str(two_layer_ckpt), "--tp", "1", "--max-shard-size", "200000", "-o", str(out), "--resume")
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and "tp: 2 there, 1 now" in errors[0], res.stderr
    assert file_digests(stage) == before and not out.exists()
    # --force starts over with the new settings
    res = run_repack(plan_repack(two_layer_ckpt, other), out, force=True)
    assert res.files_reused == 0 and res.manifest["tp"] == 1 and not stage.exists()


_SLOW_CHILD = """
import sys, time, pathlib
import wna16ctl.repacking.pipeline as r
import wna16ctl.repacking.native_path as n
marker = pathlib.Path(sys.argv[1])
real, real_native = r.build_rank_tensors, n.LayerBuilder.build_into
def slow(*a, **kw):
    marker.touch()
    time.sleep(0.4)
    return real(*a, **kw)
def slow_native(*a, **kw):
    marker.touch()
    time.sleep(0.4)
    return real_native(*a, **kw)
r.build_rank_tensors = slow  # whichever data path the layers take
n.LayerBuilder.build_into = slow_native
sys.argv = ["wna16ctl"] + sys.argv[2:]
from wna16ctl.cli import main
main()
"""


def test_sigkill_leaves_nothing_complete(two_layer_ckpt, tmp_path):
    out = tmp_path / "out"
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CHILD, str(marker), "repack", str(two_layer_ckpt),
                             "--vllm", ACT_ORDER_RELEASE, "--tp", "2", "-o", str(out), "--max-shard-size", "300000",
                             "-q"],  # RESUME_SETTINGS, which resume below
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=single_thread_env())
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "child never started writing"
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists()
    assert not list(tmp_path.rglob(MANIFEST_NAME))
    # only the staging dir (for --resume): the flock died with the process, no lock file is left
    assert leftovers(out) == [".out.wna16ctl-partial"]
    # the partial output is still a valid resume point
    run_repack(plan_repack(two_layer_ckpt, RESUME_SETTINGS), out, resume=True)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(two_layer_ckpt, RESUME_SETTINGS), fresh)
    assert file_digests(out) == file_digests(fresh)


def test_act_order_with_differing_gate_up_g_idx_is_refused_before_writing(tmp_path):
    from tests.rawckpt import write_raw_checkpoint
    from wna16ctl.errors import NotLoadable

    # hand-built: every projection draws its own act-order permutation
    ck = write_raw_checkpoint(tmp_path / "ck", hidden=256, intermediate=128, group_size=64, actorder="group")
    with pytest.raises(NotLoadable, match=r"gate_proj.weight_g_idx and .*up_proj.weight_g_idx differ"):
        plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1))
    assert not (tmp_path / "out").exists()


def test_concurrent_repack_into_the_same_output_is_refused(make_ckpt, tmp_path):
    import fcntl

    from wna16ctl.errors import UsageError

    ck = make_ckpt(num_layers=1, num_experts=4)
    out = tmp_path / "out"
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1))
    # another writer holds OUT: its staging directory is locked (flock) while it works
    first = writer_mod.StagedOutput(out, force=False, resume=False, identity=plan.identity, checkpoint=ck)
    stage = tmp_path / ".out.wna16ctl-partial"
    assert stage.is_dir()
    fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)
    with pytest.raises(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    try:
        for resume in (False, True):
            with pytest.raises(UsageError, match="another wna16ctl repack"):
                run_repack(plan, out, resume=resume)
            assert stage.is_dir()  # the second writer touched nothing of the first's
    finally:
        first.abort(keep_for_resume=False)
    assert leftovers(out) == []
    run_repack(plan, out)
    assert (out / "wna16ctl.json").is_file()
    assert leftovers(out) == []  # no lock file is ever left beside OUT


def test_a_run_writing_out_is_refused_alike_with_and_without_resume(make_ckpt, tmp_path):
    """Another repack is writing OUT (its staging directory locked, its journal there) with other
    settings: --resume is refused with the same line as a plain run, not told that an interrupted
    run had other settings."""
    ck = make_ckpt(num_layers=1, num_experts=4)
    out = tmp_path / "out"
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1, max_shard_bytes=300_000))
    first = writer_mod.StagedOutput(out, force=False, resume=False, identity=plan.identity, checkpoint=ck)
    first.checkpoint_journal()  # what a run writes after each finished file
    try:
        lines = []
        for extra in ([], ["--resume"], ["--force"]):
            res = _repack_cli(str(ck), "--tp", "1", "-o", str(out), *extra)
            assert res.exit_code == 2, res.output
            lines.append(res.stderr.strip())
        assert lines == [f"error: {out}: another wna16ctl repack is writing it; wait for it to finish"] * 3, lines
        assert sorted(p.name for p in first.stage.iterdir()) == [".wna16ctl-journal.json", ".wna16ctl-stage.json"]
    finally:
        first.abort(keep_for_resume=False)
    assert leftovers(out) == []


def test_output_dot_and_ep_rank_without_experts(make_ckpt, tmp_path, monkeypatch):
    from tests.conftest import QUESTIONS
    from wna16ctl.verification.checks import verify_output

    ck = make_ckpt(num_layers=1, num_experts=2, top_k=1)
    out = tmp_path / "here"
    out.mkdir()
    monkeypatch.chdir(out)
    # vLLM refuses the demo model at TP 3 (4 attention heads): this test is about a rank without
    # experts and OUT given as ".", so the model-level check is set aside
    monkeypatch.setattr("wna16ctl.repacking.pipeline.model_refusal", lambda *a, **k: None)
    run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=3, ep=True)), ".")  # rank 2 holds no expert
    assert (out / "wna16ctl.json").is_file() and (out / "rank-2").is_dir()
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=4)
    assert report.passed, [f.message for f in report.findings]


@pytest.mark.parametrize("layout", ["auto", "vllm"])
def test_dry_run_reports_the_memory_per_rank(make_ckpt, layout):
    """`repack --dry-run` reports the per-rank memory of the deployment it writes: with a GPU's
    memory the same fit `inspect` judges at that TP size (the plan's own MoE plans), without one
    what a rank holds; in --json and in text."""
    import wna16ctl

    ck = make_ckpt(num_layers=2, num_experts=4, hidden_size=256, intermediate_size=256)
    args = ["repack", str(ck), "--tp", "2", "--layout", layout, "--vllm", "0.33.0", "--dry-run"]
    res = CliRunner().invoke(cli, [*args, "--gpu", "h100", "--max-model-len", "2048", "--json"])
    assert res.exit_code == 0, res.output
    memory = json.loads(res.stdout)["memory"]
    insp = wna16ctl.inspect(ck, "2", vllm="0.33.0", gpu="sm90", gpu_mem="h100", max_model_len=2048)
    assert memory == insp.fits[0].to_json()
    plain = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)["memory"]
    assert plain == insp.fits[0].per_rank_json() and "fits" not in plain
    text = CliRunner().invoke(cli, [*args, "--gpu", "h100"]).output
    assert "memory per rank at TP 2: weights" in text and "on 80.0 GiB x 0.9, --max-num-batched-tokens 8192: rest of a start" in text
