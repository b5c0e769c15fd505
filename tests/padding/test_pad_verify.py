"""`verify ORIGINAL PADDED` proves a padding: unchanged originals, zero-code additions, and the
padded layer at its TP size within the rounding interval of the original at TP 1."""

from __future__ import annotations

import json
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import QUESTIONS
import wna16ctl
from wna16ctl.padding.tensors import zero_word

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=1)
# the usual llm-compressor recipe (attention quantized too), 256 wide so that o_proj splits into
# whole groups at TP 2
STANDARD = {**SMALL, "hidden_size": 256, "targets": "linear"}


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
    ("added row code", "gate_proj.weight_packed: an added code is not the zero code"),
    ("original code", "down_proj.weight_packed: an original code changed"),
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
    elif damage == "added row code":  # one code of an added row's word (rows 128..255 of 256 are added)
        t[f"{m}.gate_proj.weight_packed"][-1, 3] = zero_word(4) ^ (1 << 28)
    elif damage == "original code":
        t[f"{m}.down_proj.weight_packed"][5, 0] ^= 1
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


def test_verify_passes_a_padding_of_the_usual_recipe_with_attention_quantized(make_ckpt, tmp_path):
    # every Linear but lm_head and the routers quantized: the attention's weight_shape tensors are
    # the original's, byte for byte, and read as such (not as projections that failed to pad)
    src = make_ckpt(**STANDARD)
    wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    proof = wna16ctl.verify(src, tmp_path / "p", samples=QUESTIONS, num_samples=4)
    assert proof.passed, proof.problems
    assert proof.tensors_padded == 4 * 3 * 2  # packed and scale of 12 projections; attention unchanged
    assert [(lay["layer"], lay["ok"]) for lay in proof.layers] == [("model.layers.0.mlp.experts", True)]
    # and a changed attention weight_shape is still named
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "p", bad)
    t = load_file(bad / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight_shape"][0] += 1
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    proof = wna16ctl.verify(src, bad)
    assert any(p.startswith("model.layers.0.self_attn.k_proj.weight_shape: differs from the original")
               for p in proof.problems), proof.problems


def test_the_padding_proof_on_all_zero_data_says_numerics_not_run_as_repacks_verify_does(make_ckpt, tmp_path):
    # a shard whose data is all zero (a failed download): any padding computes the same zeros, so
    # the numerics prove nothing; the proof says "not run" with the reason repack's verify gives
    src = tmp_path / "zeros"
    shutil.copytree(make_ckpt(**SMALL), src)
    t = load_file(src / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in t.items()}, src / "model.safetensors", metadata={"format": "pt"})
    wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    proof = wna16ctl.verify(src, tmp_path / "p", samples=QUESTIONS, num_samples=4)
    assert not proof.passed and not proof.problems and not proof.next_steps
    (layer,) = proof.layers
    assert layer["status"] == "not run" and not layer["ok"]
    wna16ctl.repack(src, tmp_path / "tp1", tp=1, vllm="0.32.0", device="cpu")
    report = wna16ctl.verify(src, tmp_path / "tp1", samples=QUESTIONS, num_samples=4)
    (row,) = report.numerics
    assert row.status == "not run" and not report.passed
    assert layer["reason"] == row.reason and "all zero" in row.reason
    text = "\n".join(proof.lines())
    assert f"NOT RUN numerics model.layers.0.mlp.experts: {row.reason}" in text and "PASS numerics" not in text
    assert proof.to_json()["passed"] is False


def test_verify_of_a_padding_takes_a_subset_and_says_it_is_one(make_ckpt, tmp_path):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    src = make_ckpt(**{**SMALL, "num_layers": 2})
    wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    run = lambda *a: CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "p"), "--samples", str(QUESTIONS),  # noqa: E731 - verify of this padding, for the lines below
                                              "--num-samples", "4", *a])
    whole = json.loads(run("--json").stdout)
    res = run("--layers", "1", "--experts", "0-1", "--json")
    assert res.exit_code == 0, res.output
    j = json.loads(res.stdout)
    assert j["passed"] and j["partial"] and j["next_steps"] == []
    assert (j["layers_selected"], j["layers_not_checked"]) == ([1], [0])
    assert (j["experts_selected"], j["experts_not_checked"]) == ([0, 1], [2, 3])
    assert [lay["layer"] for lay in j["numerics"]] == ["model.layers.1.mlp.experts"]
    # only the tokens routed to experts 0 and 1 are compared
    assert 0 < j["numerics"][0]["tokens"] < whole["numerics"][1]["tokens"]
    # of the 2 x 4 x 3 x 3 = 72 expert tensors (layers, experts, projections, packed/scale/shape) only
    # layer 1's experts 0 and 1 are compared; every other tensor is
    assert j["tensors_checked"] == whole["tensors_checked"] - 72 + 2 * 3 * 3
    assert not whole["partial"] and whole["next_steps"]
    human = run("--layers", "1")
    assert human.exit_code == 0
    assert "PARTIAL --layers 1: layer 0 not checked (a partial verify: run without --layers for a full one)" \
        in human.stdout and "vllm serve" not in human.stdout, human.stdout
    bad = run("--layers", "5")
    assert bad.exit_code == 2 and "--layers: no MoE layer 5" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = run("--experts", "9")
    assert bad.exit_code == 2 and "--experts: no expert 9 in model.layers.0.mlp.experts" in bad.stderr


def test_a_padded_checkpoint_repacks_and_verifies_like_any_other(padded_pair, tmp_path):
    src, out = padded_pair
    plan = wna16ctl.repack(out, None, tp=2, dry_run=True, vllm="0.31.0").to_json()
    assert [(lay["intermediate_size"], lay["intermediate_size_per_partition"], lay["layout"]) for lay in plan["layers"]] \
        == [(256, 128, "marlin")]
    wna16ctl.repack(out, tmp_path / "tp2", tp=2, vllm="0.31.0", device="cpu")
    report = wna16ctl.verify(out, tmp_path / "tp2", samples=QUESTIONS, num_samples=4)
    assert report.passed, report.to_json()


# -- `verify ORIGINAL PADDED --e2e`: the padded model at its TP size against the original at TP 1 ------------

E2E_ARGS = ["--e2e", "--prompts", "1", "--max-new-tokens", "4", "--num-samples", "4"]


def test_verify_e2e_of_a_padding_generates_as_the_original(padded_pair):
    from click.testing import CliRunner


    from wna16ctl.cli import cli

    pytest.importorskip("transformers")
    src, out = padded_pair
    r = CliRunner().invoke(cli, ["verify", str(src), str(out), "--samples", str(QUESTIONS), *E2E_ARGS, "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    e2e = j["e2e"]
    assert j["passed"] and e2e["status"] == "pass", e2e
    assert e2e["tokens_generated"] == 4 and e2e["tokens_agreeing"] == 4
    # every padded block output the padded model used, judged; every expert exercised
    (layer,) = e2e["layers"]
    assert layer["layer"] == "model.layers.0.mlp.experts" and layer["calls"] >= 1 and layer["violations"] == 0
    assert layer["experts_exercised"] == 4
    assert "2 TP ranks" in e2e["kernel"]
    # the serve path inspect prints for the padded checkpoint at the padding's TP size and release
    padding = json.loads((Path(out) / "wna16ctl.json").read_text())["padding"]
    planned = wna16ctl.inspect(out, tp=2, vllm=padding["vllm"], gpu=padding["gpu"]).next_steps()
    assert [s["serve"] for s in j["next_steps"]] == [s.serve for s in planned]
    # the library gives the same proof, and its lines say it
    proof = wna16ctl.verify(src, out, samples=QUESTIONS, num_samples=4, e2e=True, prompts=1, max_new_tokens=4)
    same = proof.to_json()
    for doc in (same["e2e"], e2e):
        doc.pop("seconds")
    assert same == j
    text = "\n".join(proof.lines())
    assert "PASS e2e: 4/4 tokens agree" in text and [s.serve for s in proof.next_steps] == [j["next_steps"][0]["serve"]]


def _damage_padding(out, bad, damage: str) -> None:
    shutil.copytree(out, bad)
    f = bad / "model.safetensors"
    t = load_file(f)
    m = "model.layers.0.mlp.experts.2"
    if damage == "original scale":
        t[f"{m}.gate_proj.weight_scale"][:, 0] *= 2
    else:  # an added neuron that computes: non-zero codes in its gate and up rows and its down column
        t[f"{m}.gate_proj.weight_packed"][128] = -1  # every 4-bit code 15
        t[f"{m}.up_proj.weight_packed"][128] = -1
        t[f"{m}.down_proj.weight_packed"][:, 128 // 8] = -1
    save_file(t, f, metadata={"format": "pt"})


@pytest.mark.parametrize("damage", ["original scale", "added neuron"])
def test_verify_e2e_fails_a_damaged_padding(padded_pair, tmp_path, damage):


    pytest.importorskip("transformers")
    src, out = padded_pair
    bad = tmp_path / "bad"
    _damage_padding(out, bad, damage)
    proof = wna16ctl.verify(src, bad, samples=QUESTIONS, num_samples=4, e2e=True, prompts=1, max_new_tokens=4)
    assert not proof.passed and proof.e2e.status == "FAIL", proof.e2e.to_json()
    assert "outside the rounding interval" in proof.e2e.reason
    assert proof.e2e.block_violations > 0 and not proof.next_steps
