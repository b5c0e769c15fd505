"""Checkpoints written by old compressed-tensors versions read like current ones.

* zero points stored unpacked (int8 [N, G], signed; <= 0.9.3) instead of packed int32 [N/pf, G];
* an asymmetric layer whose all-zero zero points were not written at all;
* actorder "group" whose g_idx was never set (not written).
Each is rewritten from a current checkpoint; `inspect` warns, and `repack` output is byte-identical
to the output of the current form (the reader normalises once, for everything downstream).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from tests.conftest import ACT_ORDER_RELEASE
from wna16ctl.cli import cli
from wna16ctl.layout.packing import unpack_codes
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack

SMALL = dict(num_layers=1, num_experts=4, top_k=1, vocab_size=64)


def _rewrite(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(idx["weight_map"].values())):
        tensors = load_file(str(dst / shard))
        tensors = fn(tensors)
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    idx["weight_map"] = {n: s for s in sorted(set(idx["weight_map"].values())) for n in load_file(str(dst / s))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    return dst


def _rank_digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.glob("rank-*/*.safetensors"))}


def _repack(ck: Path, out: Path) -> dict[str, str]:
    run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)), out)
    return _rank_digests(out)


def test_unpacked_zero_points_read_as_packed(make_ckpt, tmp_path):
    src = make_ckpt(symmetric=False, **SMALL)

    def unpack_zp(tensors):
        for name in [n for n in tensors if n.endswith("weight_zero_point")]:
            n_rows = tensors[name.replace("weight_zero_point", "weight_packed")].shape[0]
            codes = unpack_codes(tensors[name], 4, dim=0, size=n_rows)
            tensors[name] = (codes - 8).to(torch.int8)  # signed, [N, G]
        return tensors

    legacy = _rewrite(src, tmp_path / "legacy", unpack_zp)
    res = CliRunner().invoke(cli, ["inspect", str(legacy), "--tp", "2", "--json", "--vllm", ACT_ORDER_RELEASE])
    doc = json.loads(res.stdout)
    # it loads; exit 1 only for this release's w13 scale permutation at I_p <= group (vllm PR #50196)
    assert doc["loadable"] and res.exit_code == (0 if doc["ok"] else 1), res.output
    assert doc["layers"][0]["zero_point_form"] == "unpacked"
    assert any("unpacked" in w for w in doc["warnings"])
    assert _repack(legacy, tmp_path / "o-legacy") == _repack(src, tmp_path / "o-src")


def test_missing_zero_points_are_zero(make_ckpt, tmp_path):
    src = make_ckpt(symmetric=False, **SMALL)

    def zero_then_drop(tensors):
        return {n: t for n, t in tensors.items() if not n.endswith("weight_zero_point")}

    def zero_zp(tensors):  # the same checkpoint with explicit zero (code 8) zero points
        for name in [n for n in tensors if n.endswith("weight_zero_point")]:
            tensors[name] = torch.full_like(tensors[name], 0x88888888 - (1 << 32))
        return tensors

    dropped = _rewrite(src, tmp_path / "dropped", zero_then_drop)
    explicit = _rewrite(src, tmp_path / "explicit", zero_zp)
    res = CliRunner().invoke(cli, ["inspect", str(dropped), "--tp", "1", "--json", "--vllm", ACT_ORDER_RELEASE])
    assert res.exit_code == 0, res.output
    assert any("without weight_zero_point" in w for w in json.loads(res.stdout)["warnings"])
    assert _repack(dropped, tmp_path / "o1") == _repack(explicit, tmp_path / "o2")


def test_missing_g_idx_means_column_order(make_ckpt, tmp_path):
    src = make_ckpt(actorder="group", group_size=64, **SMALL)

    def trivial(tensors):
        for name in [n for n in tensors if n.endswith("weight_g_idx")]:
            tensors[name] = (torch.arange(tensors[name].numel(), dtype=torch.int32) // 64)
        return tensors

    def drop(tensors):
        return {n: t for n, t in trivial(tensors).items() if not n.endswith("weight_g_idx")}

    explicit = _rewrite(src, tmp_path / "explicit", trivial)
    dropped = _rewrite(src, tmp_path / "dropped", drop)
    res = CliRunner().invoke(cli, ["inspect", str(dropped), "--tp", "1", "--json", "--vllm", ACT_ORDER_RELEASE])
    assert res.exit_code == 0, res.output
    assert any("without weight_g_idx" in w for w in json.loads(res.stdout)["warnings"])
    assert _repack(dropped, tmp_path / "o1") == _repack(explicit, tmp_path / "o2")
