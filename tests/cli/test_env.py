"""`wna16ctl env` and `--version` for bug reports; GPU names for --gpu."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from click.testing import CliRunner

from wna16ctl.cli import GPU_ALIASES, cli
from wna16ctl.planning.rules import GPUS
from wna16ctl.version import __version__


def test_version():
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"wna16ctl, version {__version__}"


def test_env_names_the_versions_a_bug_report_needs():
    res = CliRunner().invoke(cli, ["env", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["wna16ctl"] == __version__
    for dist in ("torch", "compressed-tensors", "safetensors", "huggingface_hub"):
        assert doc["packages"][dist] == metadata.version(dist)
    assert "vllm" in doc["packages"] and "nvcc" in doc and "gpus" in doc
    text = CliRunner().invoke(cli, ["env"]).stdout
    assert f"torch: {metadata.version('torch')}" in text and "nvcc: " in text and "gpus: " in text


@pytest.mark.parametrize("name, sm", [("h100", "sm90"), ("H200", "sm90"), ("a100", "sm80"), ("b200", "sm100"),
                                      ("l40s", "sm89"), ("sm86", "sm86")])
def test_gpu_names_are_aliases_of_their_architecture(make_ckpt, name, sm):
    ck = make_ckpt(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "1", "--gpu", name, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["gpu"] == sm, res.output


def test_every_alias_names_a_known_architecture():
    assert set(GPU_ALIASES.values()) <= set(GPUS)
    res = CliRunner().invoke(cli, ["inspect", ".", "--gpu", "x100"])
    assert res.exit_code == 2 and "h100" in res.output
