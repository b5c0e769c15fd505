"""WNA16CTL_SIMD: every tile loop of the native rank builder this CPU has writes the same output,
`repack --json` says which one ran, and a level the CPU lacks (or an unknown name) is refused with
one line.  The tile loops themselves are compared with the torch layout code per level in
tests/repacking/test_native_path.py (test_native_rank_builder_equals_torch); the NEON loop runs under
qemu-user in tests/native/test_simd_cross.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from wna16ctl.native import simd
from wna16ctl.cli import cli
from wna16ctl.errors import UsageError
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.repacking.native_path import unsupported


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _native_ckpt(make_ckpt, **spec) -> Path:
    ck = make_ckpt(**spec)
    plan = plan_repack(ck, RepackSettings(tp=2))
    if {unsupported(j.layer, j.specs[0], plan.scale_st_dtype, "auto") for j in plan.jobs} != {None}:
        pytest.skip("native data path not taken")
    return ck


def test_auto_is_the_best_level_this_cpu_has(host, monkeypatch):
    monkeypatch.delenv(simd.ENV, raising=False)
    have = simd.available(host)
    assert have[-1] == "scalar"
    assert simd.resolve()[1] == have[0]


@pytest.mark.parametrize("spec", [dict(num_experts=4), dict(num_bits=8, num_experts=4)], ids=["int4", "int8"])
def test_every_level_writes_the_same_files_and_json_names_it(host, make_ckpt, tmp_path, monkeypatch, spec):
    ck = _native_ckpt(make_ckpt, **spec)
    trees = {}
    for level in simd.available(host):
        monkeypatch.setenv(simd.ENV, level)
        out = tmp_path / level
        run = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(out), "--json"])
        assert run.exit_code == 0, run.output
        result = json.loads(run.stdout)
        assert result["simd"] == level and [p["simd"] for p in result["processes"]] == [level]
        trees[level] = _tree(out)
    assert len(trees) >= 1
    first = next(iter(trees.values()))
    for level, tree in trees.items():
        assert tree == first, level


def test_a_level_the_cpu_lacks_is_refused_in_one_line(host, make_ckpt, tmp_path, monkeypatch):
    ck = _native_ckpt(make_ckpt, num_experts=4)
    missing = next((name for name in ("neon", "avx2", "avx512") if name not in simd.available(host)), None)
    if missing is None:
        pytest.skip("this CPU has every level")
    monkeypatch.setenv(simd.ENV, missing)
    with pytest.raises(UsageError, match=rf"WNA16CTL_SIMD={missing}: this CPU has no {missing} instructions"):
        simd.resolve()
    out = tmp_path / "out"
    run = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(out)])
    assert run.exit_code == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"WNA16CTL_SIMD={missing}" in lines[0] and "Traceback" not in run.stderr
    assert not out.exists() and not any(tmp_path.glob(".out*"))


def test_an_unknown_level_is_refused(monkeypatch):
    monkeypatch.setenv(simd.ENV, "sse9")
    with pytest.raises(UsageError, match="WNA16CTL_SIMD=sse9: not one of auto, avx512, avx2, neon, scalar"):
        simd.requested()


def test_the_torch_path_reports_no_level(make_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    ck = make_ckpt(num_experts=4)
    result = run_repack(plan_repack(ck, RepackSettings(tp=2)), tmp_path / "out")
    assert result.simd is None and result.to_json()["simd"] is None


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("size_k", [256, 272])  # 272: 17 k-tiles, not a multiple of 4 (the scalar fallback)
def test_the_torch_paths_host_repack_equals_torch_at_every_level(host, monkeypatch, num_bits, size_k):
    """The torch data path's host repack (asymmetric layers, cast scales, ...) of the checkpoint's
    N-first words read in place runs the same vector tile loops; each level against the torch code."""
    import torch

    from wna16ctl.native import ops as kernels
    from wna16ctl.layout.marlin import marlin_repack

    pf, size_n, experts = 32 // num_bits, 192, 3
    g = torch.Generator().manual_seed(size_k + num_bits)
    n_first = torch.randint(-(2**31), 2**31 - 1, (experts, size_n, size_k // pf), generator=g, dtype=torch.int32)
    kfirst_view = n_first.transpose(1, 2)  # [E, K/pf, N], not contiguous: read in place
    want = marlin_repack(kfirst_view.contiguous(), num_bits)
    for level in simd.available(host):
        monkeypatch.setenv(simd.ENV, level)
        wide = torch.full((experts, size_k // 16, 2 * want.shape[-1]), -1, dtype=torch.int32)
        kernels.marlin_repack_fast(kfirst_view, num_bits, out=wide[:, :, want.shape[-1]:])
        assert torch.equal(wide[:, :, want.shape[-1]:], want), level
        assert bool((wide[:, :, : want.shape[-1]] == -1).all()), level  # the other half is untouched
