"""`--vllm` through the command line, on checkpoints written by compressed-tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from wna16ctl.cli import cli
from wna16ctl.output.writer import MANIFEST_NAME
from wna16ctl.planning import rules

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def _inspect(ck, *args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--json", *args])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def test_group_actorder_by_release(make_ckpt):
    ck = make_ckpt(group_size=64, actorder="group", **SMALL)
    code, doc = _inspect(ck, "--vllm", "0.33.0", "--tp", "1,2")
    assert code == 1 and doc["loadable"] is False
    assert {k: doc["engine"][k] for k in ("name", "version", "source", "requested", "note")} == {
        "name": "vllm", "version": "0.33.0", "source": "flag", "requested": "0.33.0", "note": None}
    assert doc["failure_stage"] == "config"
    assert doc["config_refusal"]["error"].startswith("Compressed-tensors group/dynamic activation ordering "
                                                     "(actorder='group') is no longer supported.")
    for p in doc["layers"][0]["plans"]:
        assert not p["loadable"] and p["failure_stage"] == "config"
        assert p["errors"][0].startswith("not reached (checkpoint refused at config parse)")
    code, doc = _inspect(ck, "--vllm", "0.29.0", "--tp", "1,2")
    assert code == 0
    for p in doc["layers"][0]["plans"]:
        assert p["backend"] == "marlin" and p["layout"] == "marlin"
        assert any(h.startswith(f"vLLM 0.30.0–{rules.NEWEST}: refused at config parse") for h in p["hazards"])


def test_channel_wise_hidden_not_a_multiple_of_128(make_ckpt):
    ck = make_ckpt(hidden_size=192, intermediate_size=128, group_size=-1, **SMALL)
    for v in ("0.33.0", "0.27.0"):
        code, doc = _inspect(ck, "--vllm", v, "--tp", "1")
        p = doc["layers"][0]["plans"][0]
        assert code == 1 and p["failure_rule"] == "channel assert", (v, p)
        assert "hidden_size 192 is not a multiple of 128" in p["rejected"]["marlin"]
    # with H = 256 the same scheme loads on Marlin on an A100, and not on Hopper with 0.33.0 (Humming first)
    ck = make_ckpt(hidden_size=256, intermediate_size=128, group_size=-1, **SMALL)
    assert _inspect(ck, "--vllm", "0.33.0", "--gpu", "sm80", "--tp", "1")[0] == 0
    code, doc = _inspect(ck, "--vllm", "0.33.0", "--gpu", "sm90", "--tp", "1")
    assert code == 1 and doc["layers"][0]["plans"][0]["backend"] == "humming"


def test_all_releases_matrix_fits_100_columns(make_ckpt):
    ck = make_ckpt()
    env = {**os.environ, "COLUMNS": "100"}
    res = subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(ck), "--vllm", "all", "--tp", "1,2,4,8"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    table = [ln for ln in lines if ln.lstrip().startswith(("│", "┃", "0.", "vLLM"))]
    assert len([ln for ln in lines if rules.OLDEST in ln]) >= 1 and any(rules.NEWEST in ln for ln in lines)
    assert all(len(ln) <= 100 for ln in table), max(table, key=len)
    code, doc = _inspect(ck, "--vllm", "all", "--tp", "1,2")
    assert [v["vllm"] for v in doc["versions"]] == list(rules.RELEASES)


def test_repack_follows_the_release(make_ckpt, tmp_path):
    ck = make_ckpt(group_size=64, actorder="group", **SMALL)
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(tmp_path / "o33"), "--vllm", "0.33.0"])
    assert res.exit_code == 1 and not (tmp_path / "o33").exists()
    assert "vLLM 0.33.0 refuses" in res.stderr and "loads on vLLM 0.27.0–0.29.0" in res.stderr
    out = tmp_path / "o29"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(out), "--vllm", "0.29.0", "-q"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["engine"]["version"] == "0.29.0"
    assert manifest["identity"]["settings"]["vllm"] == "0.29.0"
