"""`verify --ranks` and verify under torchrun: only the ranks given are read, the report says which
ranks were covered (a partial run never reads as a full one), and two processes give the report one
process gives, a fault in a rank only the second process reads included."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from tests.conftest import QUESTIONS
from tests.repacking.test_distributed import clean_env, free_port, stdout_objects, torchrun
from tests.verification.faults import _rewrite_expert, _source_expert
from wna16ctl.cli import cli
from wna16ctl.demo import DemoSpec, write_demo_checkpoint
from wna16ctl.layout.packing import pack_codes, unpack_codes
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.sources.formats import CODES

SPEC = dict(num_layers=1, num_experts=4, intermediate_size=512, vocab_size=64)
MARLIN_TP4 = RepackSettings(tp=4, max_shard_bytes=300_000)
TRANSPOSED_TP2 = RepackSettings(tp=2, layout="transposed")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), DemoSpec(**SPEC))


@pytest.fixture(scope="module")
def marlin(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("marlin") / "out"
    run_repack(plan_repack(ckpt, MARLIN_TP4), out)
    return out


def flip_code_on_rank(ck, out, settings, rank: int, expert: int = 1) -> None:
    """One gate code of `expert` one step off, in `rank`'s files only (manifest re-hashed): the
    first gate row of the rank's slice."""
    ex = _source_expert(ck, expert)
    codes = unpack_codes(ex["gate"][CODES], 4, dim=1)
    codes[rank * codes.shape[0] // settings.tp, 0] ^= 1
    ex["gate"][CODES] = pack_codes(codes, 4, dim=1)
    assert _rewrite_expert(ck, out, settings, rank, expert, ex, ("w13_weight_packed",)) == 1


def verify_json(*args: object) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["verify", *map(str, args), "--samples", str(QUESTIONS), "--num-samples", "4",
                                      "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_ranks_reads_only_those_ranks_and_says_so(ckpt, marlin, tmp_path):
    code, full = verify_json(ckpt, marlin, "--no-numerics")
    assert code == 0 and full["ranks_checked"] == [0, 1, 2, 3] and not full["partial"]
    code, some = verify_json(ckpt, marlin, "--no-numerics", "--ranks", "2,0")
    assert code == 0 and some["passed"] and some["partial"]
    assert some["ranks_checked"] == [0, 2] and some["ranks_not_checked"] == [1, 3]
    assert some["files_checked"] < full["files_checked"]
    left = next(c for c in some["checks"] if c["name"] == "all_ranks")
    assert left["status"] == "not run" and "--ranks 0,2 of 4: ranks 1, 3 not checked" in left["reason"]
    assert some["next_steps"] == []
    # a fault in rank 1 is unseen by --ranks 0,2 (and said not checked), found by --ranks 1
    bad = tmp_path / "bad"
    shutil.copytree(marlin, bad)
    flip_code_on_rank(ckpt, bad, MARLIN_TP4, rank=1)
    assert verify_json(ckpt, bad, "--no-numerics", "--ranks", "0,2")[0] == 0
    code, one = verify_json(ckpt, bad, "--no-numerics", "--ranks", "1")
    assert code == 1 and one["round_trip_ok"] is False
    assert all(f["rank"] == 1 for f in one["findings"]) and one["findings"]


def test_ranks_the_output_lacks_or_a_pad_output_are_one_line(ckpt, marlin, tmp_path):
    result = CliRunner().invoke(cli, ["verify", str(ckpt), str(marlin), "--no-numerics", "--ranks", "1,4"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --ranks 1,4: rank 4 not in {marlin} (it holds ranks 0, 1, 2, 3); pass ranks it holds"]
    padded = tmp_path / "padded"
    assert CliRunner().invoke(cli, ["pad", str(ckpt), "--tp", "2", "--to", "1024", "-o", str(padded), "-q"]).exit_code == 0
    result = CliRunner().invoke(cli, ["verify", str(ckpt), str(padded), "--ranks", "0"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--ranks" in result.stderr and "a pad output" in result.stderr


def test_which_process_checks_what():
    from wna16ctl.verification import across

    assert across.ranks_to_check([0, 1, 2, 3], None) == [0, 1, 2, 3]
    assert across.ranks_to_check([0, 1, 2, 3], [2, 0]) == [0, 2]
    assert across.hashes_file("rank-1/model.safetensors", [1, 3], [0, 1, 2, 3])
    assert not across.hashes_file("rank-2/model.safetensors", [1, 3], [0, 1, 2, 3])
    # a file of no rank: the process of the lowest rank checked, and only it
    assert not across.hashes_file("config.json", [1, 3], [0, 1, 2, 3])
    assert across.hashes_file("config.json", [1, 3], [1, 3])


def run_two(ckpt, out, *extra: str) -> tuple[int, list[dict], str]:
    code, stdout, stderr = torchrun(["verify", str(ckpt), str(out), "--samples", str(QUESTIONS), "--num-samples", "4",
                                     "--json", *extra], cwd=out.parent, port=free_port(), env=clean_env())
    return code, stdout_objects(stdout), stderr


def test_two_processes_give_the_report_of_one(ckpt, marlin, tmp_path):
    code, one = verify_json(ckpt, marlin)
    assert code == 0 and one["numerics_ok"] and one["numerics"]
    code, reports, stderr = run_two(ckpt, marlin)
    assert code == 0, stderr
    assert reports == [one]  # printed once, every field the same (the numerics rows included)
    transposed = tmp_path / "transposed"
    run_repack(plan_repack(ckpt, TRANSPOSED_TP2), transposed)
    code, alone = verify_json(ckpt, transposed, "--no-numerics")
    code2, reports, stderr = run_two(ckpt, transposed, "--no-numerics")
    assert (code, code2) == (0, 0) and reports == [alone], stderr


def test_a_fault_only_the_second_process_reads_fails_the_run(ckpt, marlin, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(marlin, bad)
    flip_code_on_rank(ckpt, bad, MARLIN_TP4, rank=3)  # rank 3: process 1 of 2
    code, reports, stderr = run_two(ckpt, bad, "--no-numerics")
    assert code == 1, stderr
    (report,) = reports
    assert not report["passed"] and report["round_trip_ok"] is False and report["ranks_checked"] == [0, 1, 2, 3]
    assert [f["rank"] for f in report["findings"]] == [3]
    # a rank whose files cannot be read: every process stops, the rank named, one report
    sorted((bad / "rank-1").glob("*.safetensors"))[0].write_bytes(b"\0" * 16)
    code, reports, stderr = run_two(ckpt, bad, "--no-numerics")
    assert code == 1, stderr
    (report,) = reports
    assert any(f["rank"] == 1 and f["check"] == "round_trip" for f in report["findings"])
    assert report["checks"][1]["status"] == "FAIL"
