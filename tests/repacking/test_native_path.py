"""repack's native data path (wna16ctl/repacking/native_path.py, `wna16_marlin_rank_host` in kernels/host.cpp)
against the torch data path: the same rank tensors, the same files and manifest, without torch in
the process, the same refusals; and the digests it writes (BLAKE3) next to sha256 manifests."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wna16ctl.native import build as native
from wna16ctl.errors import BadInput
from wna16ctl.layout.rank import RankLayout, build_rank_tensors
from wna16ctl.layout.spec import marlin_scales_grouped, w2_scale_size_k
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.repacking.native_path import unsupported
from wna16ctl.verification.checks import verify_output
from wna16ctl.output.writer import MANIFEST_NAME, sha256_file

from tests.conftest import ACT_ORDER_RELEASE, QUESTIONS


def _experts(n: int, h: int, i: int, nb: int, gs: int, dtype: torch.dtype, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    pf = 32 // nb

    def proj(rows: int, k: int) -> dict[str, torch.Tensor]:
        groups = 1 if gs == -1 else k // gs
        return {"weight_packed": torch.randint(-(2**31), 2**31 - 1, (rows, k // pf), generator=g, dtype=torch.int32),
                "weight_scale": torch.rand(rows, groups, generator=g).to(dtype)}

    return [{"gate": proj(i, h), "up": proj(i, h), "down": proj(h, i)} for _ in range(n)]


def _native_rank(host: native.NativeLib, experts: list[dict], spec: RankLayout, like: dict[str, torch.Tensor],
                 simd: int) -> dict[str, torch.Tensor]:
    src = (ctypes.c_void_p * (6 * len(experts)))()
    for e, ex in enumerate(experts):
        for j, role in enumerate(("gate", "up", "down")):
            src[6 * e + j] = ex[role]["weight_packed"].data_ptr()
            src[6 * e + 3 + j] = ex[role]["weight_scale"].data_ptr()
    got = {k: torch.full_like(v, -1) for k, v in like.items()}
    scale_bytes = experts[0]["gate"]["weight_scale"].element_size()
    host.call("wna16_marlin_rank_host", src, len(experts), spec.hidden_size, spec.intermediate_size, spec.tp, spec.rank,
              spec.num_bits, spec.group_size, int(spec.load_full_w2), scale_bytes,
              int(marlin_scales_grouped(spec.hidden_size, spec.group_size)),
              int(marlin_scales_grouped(w2_scale_size_k(spec), spec.group_size)),
              *(got[k].data_ptr() for k in ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")),
              simd, 2)
    return got


# H, I, TP, bits, group size, load_full_w2, scale dtype: 8 k-tiles at once and the remainder, 8-bit
# (scalar tiles), channel-wise and fine groups, w2 scales loaded whole, every scale width
CASES = [
    (256, 128, 1, 4, 128, False, torch.bfloat16),
    (2048, 768, 2, 4, 128, False, torch.bfloat16),
    (512, 384, 2, 4, 128, True, torch.bfloat16),
    (384, 256, 2, 8, 128, False, torch.float16),
    (1024, 512, 4, 4, -1, False, torch.bfloat16),
    (512, 256, 2, 4, 32, False, torch.float32),
]


SIMD_LEVELS = {"scalar": 0, "avx2": 2, "avx512": 3, "neon": 4}  # WNA16_SIMD_* in kernels/capi.h


@pytest.mark.parametrize("h,i,tp,nb,gs,full,dtype", CASES)
@pytest.mark.parametrize("level", list(SIMD_LEVELS))
def test_native_rank_builder_equals_torch(host, h, i, tp, nb, gs, full, dtype, level):
    simd = SIMD_LEVELS[level]
    if host.wna16_simd_level(simd) != simd:
        pytest.skip(f"this CPU has no {level} tile loop")
    experts = _experts(3, h, i, nb, gs, dtype, seed=h + i + nb)
    for rank in range(tp):
        spec = RankLayout(layout="marlin", num_bits=nb, group_size=gs, symmetric=True, act_order=False, hidden_size=h,
                          intermediate_size=i, tp=tp, rank=rank, load_full_w2=full, padded_intermediate=i // tp)
        want = build_rank_tensors(experts, spec)
        got = _native_rank(host, experts, spec, want, simd)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, rank)


def test_native_scan_finds_the_first_non_finite_scale(host):
    for dtype, kind in ((torch.float16, 0), (torch.bfloat16, 1), (torch.float32, 2)):
        x = torch.ones(1000, dtype=dtype)
        assert host.wna16_first_nonfinite(x.data_ptr(), x.numel(), kind) == -1
        x[700], x[321] = float("nan"), float("-inf")
        assert host.wna16_first_nonfinite(x.data_ptr(), x.numel(), kind) == 321
        x[321] = torch.finfo(dtype).max  # the largest finite value is finite
        assert host.wna16_first_nonfinite(x.data_ptr(), x.numel(), kind) == 700


# ---- whole runs ------------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _require_native(ck: Path, settings: RepackSettings) -> None:
    plan = plan_repack(ck, settings)
    why = {unsupported(j.layer, j.specs[0], plan.scale_st_dtype, "auto") for j in plan.jobs}
    if why != {None}:
        pytest.skip(f"native data path not taken: {why - {None}}")


SETTINGS = [  # a release whose Marlin MoE takes channel-wise experts too
    RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE),
    RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE, max_shard_bytes=300_000),  # several files per rank
    RepackSettings(tp=1, vllm=ACT_ORDER_RELEASE),
    RepackSettings(tp=2, ep=True, vllm=ACT_ORDER_RELEASE),  # each rank its own experts
]


@pytest.mark.parametrize("spec", [dict(num_experts=8), dict(group_size=-1, num_experts=4),
                                  dict(num_bits=8, num_experts=4)], ids=["int4-g128", "channel", "int8"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["tp2", "tp2-small-files", "tp1", "ep2"])
def test_native_and_torch_paths_write_the_same_bytes(make_ckpt, tmp_path, monkeypatch, spec, settings):
    ck = make_ckpt(**spec)
    _require_native(ck, settings)
    run_repack(plan_repack(ck, settings), tmp_path / "native")
    monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    run_repack(plan_repack(ck, settings), tmp_path / "torch")
    native_tree, torch_tree = _tree(tmp_path / "native"), _tree(tmp_path / "torch")
    assert sorted(native_tree) == sorted(torch_tree)
    for rel in native_tree:  # the manifest too: no field records the data path taken
        if rel == MANIFEST_NAME:
            native_m, torch_m = json.loads(native_tree[rel]), json.loads(torch_tree[rel])
            assert native_m == torch_m
            # the torch path's resume keys stay in the staging journal, out of the manifest
            assert not any(k.startswith("source_") for meta in torch_m["files"].values() for k in meta)
        else:
            assert native_tree[rel] == torch_tree[rel], rel


def test_native_runs_are_byte_identical_and_verify(make_ckpt, tmp_path):
    ck = make_ckpt(num_experts=8)
    _require_native(ck, RepackSettings(tp=2))
    run_repack(plan_repack(ck, RepackSettings(tp=2)), tmp_path / "a")
    run_repack(plan_repack(ck, RepackSettings(tp=2)), tmp_path / "b")
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    report = verify_output(ck, tmp_path / "a", samples=QUESTIONS, num_samples=4)
    assert report.passed, [f.message for f in report.findings]


# What a native repack in one process has no use for, each a measurable share of its start-up:
# torch (seconds), rich (its two result lines are plain text), the compiler driver and temporary
# files (the libraries are built already), and the multi-process and fork helpers.
_UNNEEDED = ("torch", "rich", "subprocess", "tempfile", "socket", "pickle")
_NO_TORCH_CHILD = f"""
import sys
from wna16ctl.cli import main
try:
    main()
except SystemExit as e:
    print(",".join(m for m in {_UNNEEDED!r} if m in sys.modules) or "-", e.code)
"""


def test_native_repack_imports_neither_torch_nor_rich(make_ckpt, tmp_path):
    ck = make_ckpt(num_experts=8)
    _require_native(ck, RepackSettings(tp=2))
    from wna16ctl.native.build import header_scan_lib, host_lib

    host_lib(), header_scan_lib()  # built here first (cached), as a run after the first finds them
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_CHILD, "repack", str(ck), "--tp", "2", "-o", str(out), "-q"],
                          capture_output=True, text=True, env={**os.environ, "WNA16CTL_NO_NATIVE": ""})
    assert proc.stdout.split()[-2:] == ["-", "0"], (proc.stdout, proc.stderr)
    assert proc.stdout.startswith(f"wrote {out}: ")  # the result, in plain lines
    assert (out / MANIFEST_NAME).is_file()


def test_native_path_refuses_a_non_finite_scale_before_commit(make_ckpt, tmp_path):
    src = make_ckpt(num_experts=8)
    _require_native(src, RepackSettings(tp=2))
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    name = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    shard = next(p for p in sorted(ck.glob("*.safetensors")) if name in load_file(p))
    tensors = load_file(shard)
    tensors[name][3, 1] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(BadInput, match=rf"tensor {name}: scale inf at \[3, 1\] is not finite"):
        run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    assert not out.exists() and not any(tmp_path.glob(".out*"))


def test_verify_reads_sha256_manifests_and_blake3_ones(make_ckpt, tmp_path):
    ck = make_ckpt(num_experts=8)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert all("blake3" in meta and "sha256" not in meta for meta in m["files"].values())
    # a manifest as earlier versions wrote it: sha256 per file
    for rel, meta in m["files"].items():
        m["files"][rel] = {"sha256": sha256_file(out / rel), "bytes": meta["bytes"]}
    (out / MANIFEST_NAME).write_text(json.dumps(m, indent=2) + "\n")
    assert verify_output(ck, out, samples=QUESTIONS, num_samples=4).passed
    rel = "rank-1/model.safetensors.index.json"
    m["files"][rel]["sha256"] = "0" * 64
    (out / MANIFEST_NAME).write_text(json.dumps(m, indent=2) + "\n")
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=4)
    assert not report.passed and any(f"{rel}: sha256 differs" in f.message for f in report.findings)


# ---- files produced front to back (wna16ctl.output.filestream) ---------------------------------------------


def test_each_rank_file_holds_one_kind_of_tensor_in_layer_order(make_ckpt):
    ck = make_ckpt(num_layers=3, num_experts=4)
    plan = plan_repack(ck, RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE, max_shard_bytes=300_000))
    layers = [j.layer.prefix for j in plan.jobs]
    for files in plan.files:
        kinds = []
        for f in files:
            found = {t.name.rsplit(".", 1)[1] if t.name.rsplit(".", 1)[0] in layers else "non-expert" for t in f.tensors}
            assert len(found) == 1, (f.relpath, found)
            kinds.append(found.pop())
            expert = [t.name.rsplit(".", 1)[0] for t in f.tensors if t.name.rsplit(".", 1)[0] in layers]
            assert expert == sorted(expert, key=layers.index)  # layer order inside a file
        # non-expert tensors first, then each kind in its own run of files, in the layers' tensor order
        runs = list(dict.fromkeys(kinds))
        assert runs == ["non-expert", *plan.jobs[0].tensor_names]
        assert kinds == sorted(kinds, key=runs.index)


def test_native_files_are_hashed_as_written_never_read_back(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.output.writer as writer_mod

    ck = make_ckpt(num_layers=2, num_experts=4)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE, max_shard_bytes=300_000)
    _require_native(ck, settings)

    def no_read_back(*a, **kw):
        raise AssertionError("an output file was read back to be hashed")

    monkeypatch.setattr(writer_mod, "_hash_range", no_read_back)
    run_repack(plan_repack(ck, settings), tmp_path / "out")
    report = verify_output(ck, tmp_path / "out", samples=QUESTIONS, num_samples=8)
    assert report.passed, [f.to_json() for f in report.findings]


@pytest.mark.parametrize("direct", ["1", "0"])
def test_direct_and_buffered_writes_give_the_same_output(make_ckpt, tmp_path, monkeypatch, direct):
    ck = make_ckpt(num_layers=2, num_experts=4)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE, max_shard_bytes=300_000)
    _require_native(ck, settings)
    monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")  # the torch path: positioned writes through the page cache
    run_repack(plan_repack(ck, settings), tmp_path / "torch")
    monkeypatch.delenv("WNA16CTL_NO_NATIVE")
    monkeypatch.setenv("WNA16CTL_DIRECT_IO", direct)
    run_repack(plan_repack(ck, settings), tmp_path / "native")
    got, want = _tree(tmp_path / "native"), _tree(tmp_path / "torch")
    assert sorted(got) == sorted(want)
    assert all(got[rel] == want[rel] for rel in got if rel != MANIFEST_NAME)


def test_native_resume_rebuilds_and_rewrites_only_the_files_a_source_change_touches(make_ckpt, tmp_path):
    from tests.test_reliability import copy_ckpt, read_tensor, shard_of
    from tests.repacking.test_pipeline import file_digests, patch_tensor

    ck = copy_ckpt(make_ckpt(num_layers=2, num_experts=4), tmp_path / "ck")
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE)
    _require_native(ck, settings)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, settings), out)
    plan = plan_repack(ck, settings)
    layer0 = plan.jobs[0].layer
    name = layer0.tensor_name(1, "down", "weight_scale")  # same header, other bytes
    patch_tensor(shard_of(ck, name), name, read_tensor(ck, name) * 2)
    res = run_repack(plan_repack(ck, settings), out, resume=True)
    # only the files of w2_weight_scale (one per rank) change: every other file is rebuilt,
    # found equal and kept
    touched = {f.relpath for fs in plan.files for f in fs
               if any(t.name == f"{layer0.prefix}.w2_weight_scale" for t in f.tensors)}
    assert len(touched) == 2
    assert res.files_written == len(touched)
    assert res.files_reused == sum(len(fs) for fs in plan.files) - len(touched)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(ck, settings), fresh)
    assert file_digests(out) == file_digests(fresh)


def test_progress_steps_add_up_to_their_totals_on_a_run_and_a_resume(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=2, num_experts=4)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE, max_shard_bytes=300_000)
    _require_native(ck, settings)
    steps: list[list] = []

    def progress(description, total, unit="bytes"):
        steps.append([description, total, 0])

        def advance(n):
            steps[-1][2] += n
        return advance

    out = tmp_path / "out"
    run_repack(plan_repack(ck, settings), out, progress=progress)
    assert [s[0] for s in steps] == ["repacking"] and steps[0][1] == steps[0][2] > 0
    sorted((out / "rank-1").glob("*.safetensors"))[2].unlink()  # one file to write again
    steps.clear()
    res = run_repack(plan_repack(ck, settings), out, resume=True, progress=progress)
    assert res.files_written == 1
    assert [s[0] for s in steps] == ["checking the staged files", "repacking"]
    assert all(total == done > 0 for _, total, done in steps), steps


# ---- the shards read in place (mapped), and a shard that shrinks meanwhile ---------------------------

_TRUNCATING_CHILD = """
import os, sys
import wna16ctl.repacking.native_path as n
hook = sys.argv[1]  # truncate right after the chunk is mapped (the scale check faults) or checked (the build does)
real = getattr(n.LayerBuilder, hook)
def then_truncate(self, *a):
    real(self, *a)
    for path in self.mapped_files(0):  # mapped and populated: the next read of these pages faults (SIGBUS)
        os.truncate(path, 4096)
setattr(n.LayerBuilder, hook, then_truncate)
sys.argv = ["wna16ctl"] + sys.argv[2:]
from wna16ctl.cli import main
main()
"""


@pytest.mark.parametrize("hook", ["map", "check_scales"])
def test_a_shard_truncated_while_mapped_is_a_one_line_error_not_a_crash(make_ckpt, tmp_path, hook):
    from tests.repacking.test_pipeline import leftovers

    ck = tmp_path / "ck"
    shutil.copytree(make_ckpt(num_layers=2, num_experts=8), ck)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE)
    _require_native(ck, settings)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-c", _TRUNCATING_CHILD, hook, "repack", str(ck), "--tp", "2", "-o", str(out),
                          "--vllm", ACT_ORDER_RELEASE, "-q"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)  # not -SIGBUS
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated or replaced after planning" in lines[0], res.stderr
    assert ".safetensors" in lines[0] and str(ck) in lines[0]
    assert not out.exists() and leftovers(out) == []


def test_a_shard_truncated_after_planning_is_named_before_it_is_mapped(make_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(make_ckpt(num_layers=2, num_experts=8), ck)
    settings = RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE)
    _require_native(ck, settings)
    plan = plan_repack(ck, settings)
    shard = plan.checkpoint.files.info(plan.jobs[-1].layer.tensor_name(7, "down", "weight_packed")).file
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(BadInput, match="truncated or replaced after planning") as info:
        run_repack(plan, tmp_path / "out")
    assert str(shard) in info.value.message
    assert not (tmp_path / "out").exists()
