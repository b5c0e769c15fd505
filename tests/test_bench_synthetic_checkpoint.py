"""bench/synthetic_checkpoint.py writes checkpoints inspect accepts at any expert count: the
top-k follows the experts unless `--top-k` names one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from wna16ctl.cli import cli

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "synthetic_checkpoint.py"
SMALL = ["--layers", "1", "--hidden", "256", "--intermediate", "256", "--vocab", "512"]


def _generate(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *SMALL, *args], capture_output=True, text=True,
                          timeout=300)


def test_four_experts_route_to_four_and_inspect_accepts_it(tmp_path):
    ck = tmp_path / "ck"
    gen = _generate(ck, "--experts", "4")
    assert gen.returncode == 0, gen.stderr
    config = json.loads((ck / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 4)
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "1", "--vllm", "0.32.0", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["loads"] == [1], res.stdout


def test_an_explicit_top_k_is_written_and_one_above_the_experts_is_refused(tmp_path):
    gen = _generate(tmp_path / "k2", "--experts", "4", "--top-k", "2")
    assert gen.returncode == 0, gen.stderr
    assert json.loads((tmp_path / "k2" / "config.json").read_text())["num_experts_per_tok"] == 2
    bad = _generate(tmp_path / "k5", "--experts", "4", "--top-k", "5")
    assert bad.returncode == 2 and "--top-k 5 must be between 1 and --experts (4)" in bad.stderr, bad.stderr
    assert not (tmp_path / "k5").exists(), "nothing is written for a refused --top-k"
