"""`verify ORIGINAL PADDED` proves a padding: unchanged originals, zero-code additions, and the
padded layer at its TP size within the rounding interval of the original at TP 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import wna16ctl
from wna16ctl.padding.tensors import zero_word

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=1)


@pytest.fixture(scope="module")
def padded_pair(make_ckpt, tmp_path_factory):
    src = make_ckpt(**SMALL, symmetric=False)
    out = tmp_path_factory.mktemp("pad") / "p"
    wna16ctl.pad(src, out, tp=2, vllm="0.32.0")
    return src, out


def test_verify_passes_a_padding_with_numerics(padded_pair):
    src, out = padded_pair
    r = subprocess.run([sys.executable, "-m", "wna16ctl", "verify", str(src), str(out), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads(r.stdout)
    assert j["passed"] and j["tensors_padded"] == 4 * 3 * 3  # packed, scale, zero point of 12 projections
    assert [lay["layer"] for lay in j["numerics"]] == ["model.layers.0.mlp.experts"]
    assert all(lay["ok"] and lay["tp"] == 2 and lay["violations"] == 0 for lay in j["numerics"])


@pytest.mark.parametrize("damage,expected", [
    ("added code", "down_proj.weight_packed: an added code is not the zero code"),
    ("original scale", "gate_proj.weight_scale: an original scale changed"),
    ("added zero point", "up_proj.weight_zero_point: an added zero point is not the zero code"),
])
def test_verify_names_a_damaged_tensor(padded_pair, tmp_path, damage, expected):
    src, out = padded_pair
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    f = bad / "model.safetensors"
    t = load_file(f)
    m = "model.layers.0.mlp.experts.2"
    if damage == "added code":
        w = t[f"{m}.down_proj.weight_packed"]
        w[:, -1] = zero_word(4) ^ 1
    elif damage == "original scale":
        t[f"{m}.gate_proj.weight_scale"][0, 0] *= 2
    else:
        z = t[f"{m}.up_proj.weight_zero_point"]
        z[-1, 0] ^= 1  # the last word holds added rows only (rows 128..255 of 256)
    save_file(t, f, metadata={"format": "pt"})
    proof = wna16ctl.verify(src, bad)
    assert not proof.passed
    assert any(expected in p for p in proof.problems), proof.problems
    assert any("changed since it was written" in p for p in proof.problems)


def test_a_padded_checkpoint_repacks_and_verifies_like_any_other(padded_pair, tmp_path):
    src, out = padded_pair
    plan = wna16ctl.repack(out, None, tp=2, dry_run=True, vllm="0.31.0").to_json()
    assert [(lay["intermediate_size"], lay["intermediate_size_per_partition"], lay["layout"]) for lay in plan["layers"]] \
        == [(256, 128, "marlin")]
    wna16ctl.repack(out, tmp_path / "tp2", tp=2, vllm="0.31.0", device="cpu")
    report = wna16ctl.verify(out, tmp_path / "tp2", num_samples=4)
    assert report.passed, report.to_json()
