"""The Python API (`wna16ctl.inspect/repack/verify`): the CLI's results and defaults, documented."""

from __future__ import annotations

import inspect as pyinspect
import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

import wna16ctl
from tests.conftest import QUESTIONS
from wna16ctl.cli import cli
from wna16ctl.errors import NotLoadable, UsageError

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def test_import_is_cheap():
    code = "import sys, wna16ctl; print(sorted(m for m in ('torch', 'rich', 'compressed_tensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_have_docstrings():
    for name in ("inspect", "repack", "verify", "pad"):
        fn = getattr(wna16ctl, name)
        assert fn.__doc__ and len(fn.__doc__.split()) > 20, name
    assert wna16ctl.VerifyReport.__name__ == "VerifyReport" and wna16ctl.Inspection.__name__ == "Inspection"
    with pytest.raises(AttributeError):
        wna16ctl.no_such_thing


def _cli_defaults(command: str) -> dict[str, object]:
    cmd: click.Command = cli.commands[command]
    ctx = click.Context(cmd)
    return {p.name: p.get_default(ctx) for p in cmd.params if isinstance(p, click.Option)}


@pytest.mark.parametrize("command,mapping", [
    ("inspect", {"tp": "tp", "ep": "ep", "vllm": "vllm", "gpu": "gpu", "revision": "revision"}),
    ("repack", {"ep": "ep", "layout": "layout", "max_shard_size": "max_shard_size", "dry_run": "dry_run",
                "resume": "resume", "force": "force", "device": "device", "vllm": "vllm", "gpu": "gpu"}),
    ("verify", {"samples": "samples", "num_samples": "num_samples", "device": "device"}),
    ("pad", {"tp": "tp", "to": "to", "ep": "ep", "vllm": "vllm", "gpu": "gpu", "moe_backend": "moe_backend",
             "dry_run": "dry_run", "force": "force"}),
])
def test_defaults_equal_the_cli(command, mapping):
    api = pyinspect.signature(getattr(wna16ctl, command)).parameters
    cli_defaults = _cli_defaults(command)
    for api_name, cli_name in mapping.items():
        assert api[api_name].default == cli_defaults[cli_name], (command, api_name)


def test_inspect_is_the_cli_json(make_ckpt):
    ck = make_ckpt(**SMALL)
    insp = wna16ctl.inspect(ck, tp=[1, 2, 2])
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "1,2", "--json"])
    assert insp.to_json() == json.loads(res.stdout)
    assert wna16ctl.inspect(ck).tps == (1, 2, 4, 8)  # the CLI's default
    with pytest.raises(UsageError, match="not a positive integer"):
        wna16ctl.inspect(ck, tp=0)


def test_repack_and_verify(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    plan = wna16ctl.repack(ck, None, tp=2, dry_run=True)
    assert isinstance(plan, wna16ctl.RepackPlan) and plan.settings.tp == 2
    result = wna16ctl.repack(ck, tmp_path / "out", tp=2, max_shard_size="1MiB")
    assert isinstance(result, wna16ctl.RepackResult) and result.files_reused == 0 and result.files_written > 0
    assert (tmp_path / "out" / "wna16ctl.json").is_file()
    assert result.to_json()["manifest"]["identity"]["settings"]["max_shard_bytes"] == 1 << 20
    report = wna16ctl.verify(ck, tmp_path / "out", samples=QUESTIONS, num_samples=4)
    assert isinstance(report, wna16ctl.VerifyReport) and report.passed
    assert [c.status for c in report.checks] == ["pass", "pass", "pass"]
    with pytest.raises(NotLoadable):
        wna16ctl.repack(make_ckpt(), tmp_path / "tp4", tp=4)  # TP 4 splits the 128-wide groups
    assert not (tmp_path / "tp4").exists()
    with pytest.raises(UsageError, match="one TP size"):
        wna16ctl.repack(ck, tmp_path / "x", tp="1,2")
