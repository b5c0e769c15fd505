"""One front door: the `inspect`, `repack` and `verify` commands call `wna16ctl.inspect` /
`wna16ctl.repack` / `wna16ctl.verify` and only render what they return, whatever the layout; the
options a layout refuses are refused once, with the same line from the function and from the command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import wna16ctl
from wna16ctl.cli import cli
from wna16ctl.errors import UsageError
from tests.conftest import QUESTIONS


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("layout", ["marlin", "vllm"])
def test_the_commands_call_the_public_functions(make_ckpt, tmp_path, monkeypatch, layout):
    calls: list[str] = []
    real_repack, real_verify = wna16ctl.repack, wna16ctl.verify

    def repack(*args, **kwargs):
        calls.append("repack")
        return real_repack(*args, **kwargs)

    def verify(*args, **kwargs):
        calls.append("verify")
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(wna16ctl, "repack", repack)
    monkeypatch.setattr(wna16ctl, "verify", verify)
    ck, out = make_ckpt(), tmp_path / "o"
    assert invoke("repack", ck, "--tp", 2, "--layout", layout, "--dry-run").exit_code == 0
    assert invoke("repack", ck, "--tp", 2, "--layout", layout, "-o", out).exit_code == 0
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", 4)
    assert res.exit_code == 0, res.output
    assert calls == ["repack", "repack", "verify"]


def test_the_inspect_command_calls_the_public_function(make_ckpt, monkeypatch):
    calls: list[tuple[tuple, dict]] = []
    returned = []
    real_inspect = wna16ctl.inspect

    def inspect(*args, **kwargs):
        calls.append((args, kwargs))
        returned.append(real_inspect(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(wna16ctl, "inspect", inspect)
    ck = make_ckpt()
    res = invoke("inspect", ck, "--tp", "1,4", "--vllm", "0.32.0", "--gpu", "sm80", "--suggest", "--json")
    assert res.exit_code == 1, res.output  # TP 4 does not load: the suggestions are asked for
    assert len(calls) == 1, calls
    args, kwargs = calls[0]
    assert args[:2] == (str(ck), "1,4") and kwargs["suggest"] is True
    assert (kwargs["vllm"], kwargs["gpu"]) == ("0.32.0", "sm80")
    assert json.loads(res.stdout) == json.loads(json.dumps(returned[0].to_json())), "the command renders what it got"
    assert returned[0].suggestions, "the suggestions come from the function"


@pytest.mark.parametrize("options,flags", [
    ({"resume": True}, ["--resume"]),
    ({"ranks": "0"}, ["--ranks", "0"]),
    ({"node_local": True}, ["--node-local"]),
])
def test_the_vllm_layout_refuses_an_option_with_one_line_from_both(make_ckpt, tmp_path, options, flags):
    ck = make_ckpt()
    with pytest.raises(UsageError) as refused:
        wna16ctl.repack(ck, tmp_path / "o", 2, layout="vllm", **options)
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "-o", tmp_path / "o", *flags)
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert refused.value.message in " ".join(res.stderr.split()), (refused.value.message, res.stderr)
    assert not (tmp_path / "o").exists()
