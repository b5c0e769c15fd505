"""`wna16ctl repack` and `verify` end to end as real processes on the default demo checkpoint
(qwen3_moe, 2 layers, 8 experts, H 256, I 256, int4 g128) at TP 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUESTIONS
from tests.repacking.test_pipeline import one_torch_thread, single_thread_env  # noqa: F401 - pytest fixtures (one autouse), found by name
from wna16ctl.output.writer import MANIFEST_NAME

_SCRIPT = Path(sys.executable).parent / "wna16ctl"
COMMAND = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "wna16ctl"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=single_thread_env())


def expect_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """One `error:` line on stderr (plus at most one `hint:` line), nothing on stdout, no traceback."""
    assert res.returncode == code, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error: "), res.stderr
    assert len(lines) <= 2 and all(ln.startswith(("error: ", "hint: ")) for ln in lines), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def repacked(make_ckpt, tmp_path_factory):
    """(checkpoint, output, dry-run JSON, repack stdout) of one real `repack --tp 2`."""
    ck = make_ckpt()
    out = tmp_path_factory.mktemp("cli") / "tp2"
    dry = run("repack", ck, "--tp", "2", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert not out.exists()  # a dry run writes nothing
    res = run("repack", ck, "--tp", "2", "-o", out, "-q")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    return ck, out, json.loads(dry.stdout), res.stdout


def test_dry_run_json_sizes_per_rank(repacked):
    ck, out, plan, _ = repacked
    assert plan["checkpoint"] == str(ck) and plan["settings"]["tp"] == 2
    assert [lay["name"] for lay in plan["layers"]] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for lay in plan["layers"]:
        assert lay["layout"] == "marlin" and lay["intermediate_size_per_partition"] == 128
        assert lay["expert_ranges"] == [[0, 8], [0, 8]]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert [r["rank"] for r in plan["ranks"]] == [0, 1]
    for r, rank in enumerate(plan["ranks"]):
        # the sizes the dry run promised are the sizes written
        assert rank["files"] == manifest["ranks"][r]["files"]
        assert rank["bytes"] == sum((out / f).stat().st_size for f in rank["files"]) > 0
    assert plan["ranks"][0]["bytes"] == plan["ranks"][1]["bytes"]


def test_repack_human_output(repacked):
    _, out, _, stdout = repacked
    assert stdout.strip()  # a summary for people
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank-0", "rank-1", MANIFEST_NAME]
    assert not list(out.parent.glob(".tp2.*"))  # no staging leftovers


def test_verify_exit_0_and_json(repacked):
    ck, out, _, _ = repacked
    res = run("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "8", "--json")
    assert res.returncode == 0, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    assert doc["passed"] is True and doc["findings"] == []
    assert doc["layers_checked"] == 2 and doc["experts_checked"] == 16 and doc["samples"] == 8
    assert [n["layer"] for n in doc["numerics"]] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(n["passed"] and n["experts_exercised"] == 8 for n in doc["numerics"])


def test_existing_output_is_one_line_error(repacked):
    ck, out, _, _ = repacked
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    res = run("repack", ck, "--tp", "2", "-o", out)
    expect_error(res, 2, str(out), "--force")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_not_loadable_is_one_line_error(repacked, tmp_path):
    # TP 4: I_p 64 splits the 128-wide scale groups
    ck = repacked[0]
    res = run("repack", ck, "--tp", "4", "-o", tmp_path / "tp4", "--json")
    expect_error(res, 1, "TP 4", "divisible by group_size (128)")
    assert not (tmp_path / "tp4").exists()



def test_output_inside_another_output_is_refused(make_ckpt, tmp_path):
    """`-o tp2/sub` inside a finished output: a later --force of tp2 would delete it; exit 2, one
    line, and nothing written into tp2."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    ck = make_ckpt(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
    out = tmp_path / "tp2"
    assert CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(out), "-q"]).exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "1", "-o", str(out / "sub")])
    assert res.exit_code == 2 and f"{out / 'sub'}: is inside the repack output {out}" in res.stderr, res.output
    assert sorted(p.name for p in out.iterdir()) == before
