"""verify is honest by construction: a check that did not run reads `not run` with its reason,
never `pass`, and the verdict needs every required check to have run and passed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import wna16ctl.verification.checks as verify_mod
from tests.conftest import QUESTIONS
from tests.repacking.test_pipeline import BASE, ckpt, one_torch_thread  # noqa: F401 - pytest fixtures, found by name
from wna16ctl.cli import cli
from wna16ctl.errors import LayoutMismatch
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.verification.checks import FAIL, NOT_RUN, PASS, Check, VerifyReport, agreement, verify_output


@pytest.fixture(scope="module")
def repacked(ckpt, tmp_path_factory):
    """layout -> (checkpoint, pristine TP-2 output)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(layout: str) -> tuple[Path, Path]:
        if layout not in made:
            ck = ckpt(**BASE)
            out = tmp_path_factory.mktemp(f"verify-{layout}") / "out"
            run_repack(plan_repack(ck, RepackSettings(tp=2, layout=layout)), out)
            made[layout] = (ck, out)
        return made[layout]

    return get


def cli_verify(ck: Path, out: Path, *extra: str):
    return CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS), "--num-samples", "8",
                                    *extra])


def statuses(doc: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in doc["checks"]}


def test_pristine_output_every_check_ran_and_passed(repacked):
    res = cli_verify(*repacked("marlin"), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert statuses(doc) == {"manifest": PASS, "round_trip": PASS, "numerics": PASS}
    assert doc["passed"] and doc["manifest_ok"] is True and doc["numerics_ok"] is True
    assert all(n["status"] == PASS and n["reason"] == "" for n in doc["numerics"])


def test_wrong_checkpoint_dependent_checks_not_run(repacked, make_ckpt):
    # another checkpoint with other shapes: the planner refuses the recorded settings for it
    _, out = repacked("marlin")
    other = make_ckpt(num_layers=1, num_experts=4, vocab_size=64, hidden_size=128, intermediate_size=128)
    res = cli_verify(other, out, "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert statuses(doc) == {"manifest": FAIL, "round_trip": NOT_RUN, "numerics": NOT_RUN}
    assert doc["passed"] is False and doc["manifest_ok"] is False
    assert doc["round_trip_ok"] is None and doc["numerics_ok"] is None  # not run: neither true nor false
    assert doc["numerics"] == []
    assert all(c["reason"] for c in doc["checks"] if c["status"] == NOT_RUN)
    human = cli_verify(other, out)
    assert human.exit_code == 1
    lines = human.stdout.splitlines()
    for name in ("round trip", "numerics"):
        line = next(ln for ln in lines if ln.strip().startswith(name))
        assert "not run" in line and "pass" not in line, human.stdout
    assert "NOT verified" in human.stdout


def test_wrong_checkpoint_same_shapes_fails_every_dependent_check(repacked, make_ckpt):
    _, out = repacked("marlin")
    # same shapes, other weights: the headers (the fingerprint) agree, the data checks run and fail
    other = make_ckpt(**BASE, seed=7)
    doc = json.loads(cli_verify(other, out, "--json").stdout)
    assert statuses(doc) == {"manifest": PASS, "round_trip": FAIL, "numerics": FAIL}
    assert doc["passed"] is False
    assert all(n["status"] == FAIL for n in doc["numerics"])


def test_missing_rank(repacked, tmp_path):
    ck, src = repacked("marlin")
    out = tmp_path / "out"
    shutil.copytree(src, out)
    shutil.rmtree(out / "rank-1")
    res = cli_verify(ck, out, "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert statuses(doc) == {"manifest": FAIL, "round_trip": FAIL, "numerics": NOT_RUN}
    assert doc["numerics_ok"] is None and "rank-1" in doc["checks"][2]["reason"]
    assert doc["numerics"] == []


def _fail_unbuild_of(expert: int, monkeypatch) -> None:
    real = verify_mod.unbuild_expert_tensors

    def unbuild(tensors, spec, *, expert_id):
        if expert_id == expert and spec.rank == 1:
            raise LayoutMismatch("injected: cannot undo the layout")
        return real(tensors, spec, expert_id=expert_id)

    monkeypatch.setattr(verify_mod, "unbuild_expert_tensors", unbuild)


def test_round_trip_failure_in_one_expert_transposed(repacked, monkeypatch):
    # The transposed candidate is computed from the tensors read back: without them the layer's
    # numerics cannot be computed, and must say so (they used to pass on empty sums).
    ck, out = repacked("transposed")
    _fail_unbuild_of(2, monkeypatch)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert not report.passed
    assert report.check("round_trip").status == FAIL
    (row,) = report.numerics
    assert row.status == NOT_RUN and "expert 2 rank 1" in row.reason
    assert row.cosine is None and row.max_abs_error is None and row.violations is None
    assert report.check("numerics").status == NOT_RUN and "expert 2 rank 1" in report.check("numerics").reason
    doc = report.to_json()
    assert doc["numerics_ok"] is None and doc["numerics"][0]["passed"] is False
    assert doc["numerics"][0]["cosine"] is None


def test_round_trip_failure_in_one_expert_marlin(repacked, monkeypatch):
    # Marlin: the candidate runs through the GEMM on the tensors as written and the reference
    # never depends on the output, so the numerics still cover every expert and run honestly.
    ck, out = repacked("marlin")
    _fail_unbuild_of(2, monkeypatch)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert not report.passed and report.check("round_trip").status == FAIL
    (row,) = report.numerics
    assert row.status == PASS and row.experts_exercised == row.num_experts  # the tensors are in fact right


def test_gemm_that_cannot_run_is_not_run(repacked, monkeypatch):
    ck, out = repacked("marlin")

    def broken(*a, **kw):
        raise RuntimeError("kernel refused the tensors")

    monkeypatch.setattr(verify_mod, "rank_moe_output", broken)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    (row,) = report.numerics
    assert row.status == NOT_RUN and "kernel refused the tensors" in row.reason
    assert report.check("numerics").status == NOT_RUN and not report.passed
    assert report.check("round_trip").status == PASS  # the other checks are unaffected


def test_verdict_needs_every_required_check():
    report = VerifyReport("ck", "out", "cpu", "bytes", 1)
    assert not report.passed  # nothing ran
    for c in report.checks:
        report.conclude(c.name)
    assert report.passed
    report.checks.append(Check("extra", "an optional check", required=False))
    assert report.passed  # an optional check that did not run does not block
    report.conclude("extra", failed="it failed")
    assert not report.passed  # but one that ran and failed does
    report.checks[-1] = Check("another", "a required check")
    assert not report.passed


def test_cosine_in_float64_never_exceeds_one():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4000, 1024, generator=g)
    c = (y + 1e-3 * torch.randn(y.shape, generator=g)).to(torch.bfloat16).float()
    rel, cos = agreement(c, y)
    assert cos <= 1.0 and cos == pytest.approx(float(torch.nn.functional.cosine_similarity(
        c.double().reshape(1, -1), y.double().reshape(1, -1))), abs=1e-12)
    assert agreement(y, y)[1] <= 1.0 and agreement(-y, y)[1] >= -1.0
    assert rel == pytest.approx(float((c.double() - y.double()).norm() / y.double().norm()), rel=1e-9)
