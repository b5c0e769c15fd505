"""`verify --experts` (and `--layers`): a subset of the experts is checked and reported as such: a
partial verdict, a `not run` check naming what was left out, never a full pass, no serve step.
The subset is really what is compared: a fault in an expert outside it goes unseen (and the
verdict says that expert was not checked), a fault inside it fails the run."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

import wna16ctl
from tests.conftest import QUESTIONS
from tests.verification import faults
from wna16ctl.cli import cli
from wna16ctl.demo import DemoSpec, write_demo_checkpoint
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack

SPEC = dict(num_layers=2, num_experts=4, top_k=2, vocab_size=64)


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def repacked(tmp_path_factory):
    """(checkpoint, output, settings): a correct TP 1 output of a 2-layer, 4-expert checkpoint."""
    ck = write_demo_checkpoint(tmp_path_factory.mktemp("ck"), DemoSpec(**SPEC))
    settings = RepackSettings(tp=1)
    out = tmp_path_factory.mktemp("out") / "o"
    run_repack(plan_repack(ck, settings), out)
    return ck, out, settings


def verify_json(ck, out, *extra):
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "2", "--json", *extra)
    return res, json.loads(res.stdout)


def test_some_experts_are_a_partial_verify(repacked):
    ck, out, _ = repacked
    res, doc = verify_json(ck, out, "--experts", "1-2")
    assert res.exit_code == 0 and doc["passed"] and doc["partial"], res.output
    assert doc["experts_selected"] == [1, 2] and doc["experts_not_checked"] == [0, 3]
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["all_experts"]["status"] == "not run" and not checks["all_experts"]["required"]
    assert "experts 0,3 not checked" in checks["all_experts"]["reason"]
    assert checks["round_trip"]["status"] == "pass" and checks["numerics"]["status"] == "pass"
    assert doc["experts_checked"] == 4  # 2 experts × 2 layers
    assert [(n["num_experts"], n["experts_exercised"], n["status"]) for n in doc["numerics"]] == [(2, 2, "pass")] * 2
    assert doc["next_steps"] == []  # a partial proof offers nothing to serve
    human = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "2", "--experts", "1-2").stdout
    verdict = next(ln for ln in human.splitlines() if ln.startswith("verdict:"))
    assert "verified in part" in verdict and "experts 0,3 not checked" in verdict, human
    assert "next steps" not in human


def test_experts_combine_with_layers(repacked):
    ck, out, _ = repacked
    res, doc = verify_json(ck, out, "--layers", "1", "--experts", "3")
    assert doc["passed"] and doc["partial"], res.output
    assert doc["layers_selected"] == [1] and doc["experts_selected"] == [3]
    assert [n["layer"] for n in doc["numerics"]] == ["model.layers.1.mlp.experts"]
    assert doc["experts_checked"] == 1 and doc["layers_checked"] == 1
    names = {c["name"]: c["status"] for c in doc["checks"]}
    assert names["all_layers"] == names["all_experts"] == "not run"


def test_every_expert_named_is_not_partial(repacked):
    ck, out, _ = repacked
    res, doc = verify_json(ck, out, "--experts", "0-3")
    assert doc["passed"] and not doc["partial"] and doc["experts_not_checked"] == [], res.output
    assert "all_experts" not in {c["name"] for c in doc["checks"]} and doc["next_steps"]


def test_a_fault_is_seen_only_inside_the_subset(repacked, tmp_path):
    ck, good, settings = repacked
    out = tmp_path / "o"
    shutil.copytree(good, out)
    faults.flipped_code(ck, out, settings, expert=2)  # layer 0, expert 2, one code
    _, outside = verify_json(ck, out, "--experts", "0,1,3")
    assert outside["passed"] and outside["partial"] and "expert 2 not checked" in \
        {c["name"]: c for c in outside["checks"]}["all_experts"]["reason"]
    res, inside = verify_json(ck, out, "--experts", "2")
    assert res.exit_code == 1 and not inside["passed"]
    assert {f["expert"] for f in inside["findings"] if f["check"] == "round_trip"} == {2}


def test_the_api_takes_experts_too(repacked):
    ck, out, _ = repacked
    report = wna16ctl.verify(ck, out, samples=QUESTIONS, num_samples=2, experts=[0], layers="0")
    assert report.passed and report.partial and report.next_steps == []
    assert report.experts_selected == [0] and report.experts_not_checked == [1, 2, 3]


@pytest.mark.parametrize("spec, said", [("4", "no expert 4"), ("1-x", "'1-x' is not an index or range")])
def test_bad_expert_spec_is_one_line(repacked, spec, said):
    ck, out, _ = repacked
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--experts", spec)
    assert res.exit_code == 2 and said in res.output and "Traceback" not in res.output, res.output
