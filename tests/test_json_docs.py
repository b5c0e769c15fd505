"""Every key the repack and verify JSON outputs carry is documented in docs/*-json.md."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from tests.conftest import QUESTIONS, REPO_ROOT
from wna16ctl.cli import cli

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def documented(doc: str) -> set[str]:
    text = (REPO_ROOT / "docs" / doc).read_text()
    return set(re.findall(r"`([a-z_0-9]+)`", text)) | set(re.findall(r'"([a-z_0-9]+)":', text))


def keys(obj: dict) -> set[str]:
    return set(obj)


def test_repack_json_keys_are_documented(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    doc = documented("repack-json.md")
    run = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "1", "-o", str(tmp_path / "o"), "--json"])
    assert keys(json.loads(run.stdout)) <= doc
    dry = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "1", "--dry-run", "--json"])
    plan = json.loads(dry.stdout)
    assert keys(plan) <= doc and keys(plan["ranks"][0]) <= doc
    refused = CliRunner().invoke(cli, ["repack", str(make_ckpt()), "--tp", "4", "--dry-run", "--json"])
    assert keys(json.loads(refused.stdout)) <= doc
    # the manifest and the layer objects are documented with the output format
    fmt = documented("repack-format.md")
    assert keys(plan["layers"][0]) - {"plan"} <= fmt


def test_verify_json_keys_are_documented(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    CliRunner().invoke(cli, ["repack", str(ck), "--tp", "1", "-o", str(tmp_path / "o"), "-q"])
    (tmp_path / "o" / "extra.txt").write_text("x")  # one finding; every check still runs
    res = CliRunner().invoke(cli, ["verify", str(ck), str(tmp_path / "o"), "--samples", str(QUESTIONS),
                                   "--num-samples", "4", "--json"])
    report = json.loads(res.stdout)
    doc = documented("verify-json.md")
    assert keys(report) <= doc, keys(report) - doc
    for part in ("checks", "findings", "numerics"):
        assert report[part], part
        assert keys(report[part][0]) <= doc, (part, keys(report[part][0]) - doc)
