"""`pad` tells the story the other commands tell: it refuses the input `repack` refuses with the
same line, its dry run answers as its run does, a `--to` that is too small names the size that
loads, a refusal that another MoE backend fixes names it (as `inspect --suggest` does), and a
written padding ends with the `verify` line that proves it."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import wna16ctl.native.build as native_build
from tests.conftest import QUESTIONS
from tests.repacking.test_pipeline import ckpt, leftovers, patch_tensor  # noqa: F401 - pytest fixtures, found by name
from tests.test_reliability import read_tensor, shard_of
from wna16ctl.cli import cli

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, vocab_size=64)
WIDER = {**SMALL, "hidden_size": 256}  # 4 attention heads: TP 4 splits them
PREFIX = "model.layers.0.mlp.experts"


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_lines(res) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]


def _poisoned(src: Path, dst: Path, name: str, value: float) -> Path:
    shutil.copytree(src, dst)
    t = read_tensor(dst, name).clone()
    t.view(-1)[3] = value
    patch_tensor(shard_of(dst, name), name, t)
    return dst


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_pad_refuses_a_non_finite_scale_with_repacks_line(make_ckpt, tmp_path, monkeypatch, path, value):
    name = f"{PREFIX}.2.down_proj.weight_scale"
    ck = _poisoned(make_ckpt(**SMALL), tmp_path / "ck", name, value)
    if path == "torch":  # no compiler: the scales are checked as repack's torch path checks them
        monkeypatch.setattr(native_build, "host_lib", lambda: None)
    repacked = invoke("repack", ck, "--tp", 1, "-o", tmp_path / "r", "--vllm", "0.32.0")  # loads at TP 1
    padded = invoke("pad", ck, "--tp", 2, "-o", tmp_path / "p", "--vllm", "0.32.0")  # needs padding at TP 2
    assert repacked.exit_code == 2, repacked.output
    assert padded.exit_code == 2, padded.output
    assert error_lines(padded) == error_lines(repacked) and len(error_lines(padded)) == 1, (padded.stderr,
                                                                                           repacked.stderr)
    assert name in padded.stderr and "not finite" in padded.stderr
    assert not (tmp_path / "p").exists() and leftovers(tmp_path / "p") == []


def test_pad_refuses_an_invalid_g_idx_with_repacks_line(ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(ckpt(group_size=32, actorder="group", **SMALL), ck)
    names = [f"{PREFIX}.1.{p}.weight_g_idx" for p in ("gate_proj", "up_proj")]
    bad = read_tensor(ck, names[0]).clone()
    bad[0] = int(bad.max()) + 1  # a group that does not exist
    for n in names:  # gate and up keep one g_idx: only the value check can fire
        patch_tensor(shard_of(ck, n), n, bad)
    repacked = invoke("repack", ck, "--tp", 1, "-o", tmp_path / "r", "--vllm", "0.29.0")
    padded = invoke("pad", ck, "--to", 160, "-o", tmp_path / "p", "--vllm", "0.29.0")
    assert repacked.exit_code == 2 and padded.exit_code == 2, (repacked.output, padded.output)
    assert error_lines(padded) == error_lines(repacked) and names[0] in padded.stderr
    assert not (tmp_path / "p").exists() and leftovers(tmp_path / "p") == []


def test_pad_refuses_a_legacy_zero_point_out_of_range_with_repacks_line(make_ckpt, tmp_path):
    import torch

    from tests.sources.test_legacy_forms import _rewrite
    from wna16ctl.layout.packing import unpack_codes

    def unpack_zp(tensors):  # compressed-tensors <= 0.9.3: signed zero points, one per row
        for name in [n for n in tensors if n.endswith("weight_zero_point")]:
            n_rows = tensors[name.replace("weight_zero_point", "weight_packed")].shape[0]
            tensors[name] = (unpack_codes(tensors[name], 4, dim=0, size=n_rows) - 8).to(torch.int8)
            if ".1.gate_proj." in name:
                tensors[name][2, 0] = 9  # a 4-bit signed zero point is in [-8, 7]
        return tensors

    ck = _rewrite(make_ckpt(symmetric=False, **SMALL), tmp_path / "legacy", unpack_zp)
    repacked = invoke("repack", ck, "--tp", 1, "-o", tmp_path / "r", "--vllm", "0.32.0")
    padded = invoke("pad", ck, "--tp", 2, "-o", tmp_path / "p", "--vllm", "0.32.0")
    assert repacked.exit_code == 2 and padded.exit_code == 2, (repacked.output, padded.output)
    assert error_lines(padded) == error_lines(repacked) and "outside the 4-bit range" in padded.stderr
    assert not (tmp_path / "p").exists() and leftovers(tmp_path / "p") == []


def test_dry_run_answers_as_the_run_when_nothing_needs_padding(make_ckpt, tmp_path):
    src = make_ckpt(**SMALL)  # I = 128 loads at TP 1 as it is
    dry = invoke("pad", src, "--tp", 1, "--vllm", "0.32.0", "--dry-run")
    real = invoke("pad", src, "--tp", 1, "--vllm", "0.32.0", "-o", tmp_path / "p")
    assert dry.exit_code == real.exit_code == 2, (dry.output, real.output)
    assert error_lines(dry) == error_lines(real) and "nothing to pad" in dry.stderr
    assert dry.stdout == "" and not (tmp_path / "p").exists()


def test_a_to_size_too_small_names_the_smallest_that_loads(make_ckpt, tmp_path):
    src = make_ckpt(**WIDER)
    smallest = json.loads(invoke("pad", src, "--tp", 4, "--vllm", "0.32.0", "--dry-run", "--json").stdout)
    assert smallest["fields"]["moe_intermediate_size"]["to"] == 512
    res = invoke("pad", src, "--tp", 4, "--to", 384, "--vllm", "0.32.0", "-o", tmp_path / "p")
    assert res.exit_code == 2, res.output
    (line,) = error_lines(res)
    assert "--to 384" in line and "too small" in line and "512" in line and "cannot fix" not in line
    assert not (tmp_path / "p").exists()
    # the size named loads
    ok = invoke("pad", src, "--tp", 4, "--to", 512, "--vllm", "0.32.0", "--dry-run", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["verdict"]["loads"] is True, ok.output


def test_a_refusal_another_moe_backend_fixes_names_it_as_suggest_does(make_ckpt, tmp_path):
    # Mixtral channel-wise: vLLM 0.32.0's automatic backend refuses it at any width; Marlin loads it
    src = make_ckpt(arch="mixtral", group_size=-1, hidden_size=256, num_experts=4, num_layers=1,
                    intermediate_size=384, vocab_size=64)
    suggested = json.loads(invoke("inspect", src, "--tp", 2, "--vllm", "0.32.0", "--suggest", "--json").stdout)
    flags = [s["flags"] for s in suggested["suggestions"] if s["kind"] == "moe_backend"]
    assert flags and flags[0] == "--moe-backend marlin", suggested["suggestions"]
    res = invoke("pad", src, "--tp", 2, "--vllm", "0.32.0", "-o", tmp_path / "p")
    assert res.exit_code == 1, res.output
    error, hint = error_lines(res)
    assert error.startswith("error:") and "cannot fix" in error
    assert hint.startswith("hint:") and flags[0] in hint
    assert not (tmp_path / "p").exists()


def test_pad_ends_with_the_verify_line_and_it_passes(make_ckpt, tmp_path):
    src, out = make_ckpt(**SMALL), tmp_path / "p"
    res = invoke("pad", src, "--tp", 2, "--vllm", "0.32.0", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    lines = [ln.strip() for ln in res.stdout.splitlines()]
    verify = next(ln for ln in lines if ln.startswith("wna16ctl verify"))
    assert shlex.split(verify) == ["wna16ctl", "verify", str(src), str(out)]
    assert lines.index(verify) < next(i for i, ln in enumerate(lines) if ln.startswith("vllm serve"))
    ran = invoke(*shlex.split(verify)[1:], "--samples", QUESTIONS, "--num-samples", 2)
    assert ran.exit_code == 0 and "PASS tensors" in ran.stdout, ran.output


@pytest.mark.parametrize("release", ["0.31.0", "0.32.0"])
def test_a_padding_is_never_one_inspect_calls_wrong(make_ckpt, tmp_path, release):
    """Up to 0.31.0 Marlin permutes the w13 scales of a rank whose slice is at most one group wide
    as channel-wise (vLLM #50196): padding 128 to 256 at TP 2 gives each rank one group, which loads
    there and computes wrong outputs. pad pads on to the smallest width inspect passes, and says
    so of an original that loads with that hazard."""
    ckpt = make_ckpt(**{**WIDER, "intermediate_size": 128})
    padded = tmp_path / "padded"
    res = invoke("pad", ckpt, "--tp", "2", "--vllm", release, "-o", padded)
    assert res.exit_code == 0, res.output
    want = 512 if release == "0.31.0" else 256
    assert f"moe_intermediate_size: 128 -> {want}" in res.stdout
    res = invoke("inspect", padded, "--tp", "2", "--vllm", release)
    assert res.exit_code == 0 and "summary: loads at TP 2" in res.stdout, res.output

    # an original that loads at TP 2 but computes wrong outputs there is padded, not "nothing to pad"
    wide = make_ckpt(**{**WIDER, "intermediate_size": 256})
    res = invoke("inspect", wide, "--tp", "2", "--vllm", release)
    assert res.exit_code == (1 if release == "0.31.0" else 0), res.output
    res = invoke("pad", wide, "--tp", "2", "--vllm", release, "--dry-run")
    if release == "0.31.0":
        assert res.exit_code == 0, res.output
        assert "moe_intermediate_size: 256 -> 512" in res.stdout
        assert "original loads but outputs would be wrong" in res.stdout
    else:
        assert res.exit_code == 2 and "nothing to pad" in res.stderr, res.output
