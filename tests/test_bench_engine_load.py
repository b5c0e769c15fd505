"""bench/bench_engine_load.py without an engine: the GPU case reports `not run` with its reason, and
the synthetic checkpoint it starts engines from is one `repack --layout vllm` accepts."""

from __future__ import annotations

import json
import sys

from click.testing import CliRunner

from bench import bench_engine_load, synthetic_checkpoint
from wna16ctl.cli import cli


def test_the_gpu_case_is_not_run_without_vllm(tmp_path, capsys):
    report = tmp_path / "engine_load.json"
    code = bench_engine_load.main(["--device", "cuda", "--engine-python", sys.executable, "--json", str(report),
                                   "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert code == 2
    assert out.startswith("not run: vLLM does not import in "), out
    result = json.loads(report.read_text())
    assert result["status"] == "not-run" and "vLLM does not import" in result["reason"]
    assert not (tmp_path / "work").exists(), "nothing is written before the engine is known to run"


def test_the_engine_checkpoint_repacks_to_the_vllm_layout(tmp_path):
    ck = synthetic_checkpoint.write(tmp_path / "ck", layers=1, experts=8, hidden=256, intermediate=256, vocab=512,
                                    engine=True)
    config = json.loads((ck / "config.json").read_text())
    assert config["num_attention_heads"] == 32 and config["head_dim"] == 128 and config["num_experts"] == 8
    out = tmp_path / "vllm"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", "0.32.0",
                                   "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-rank-0-part-0.safetensors",
                                                                "model-rank-1-part-0.safetensors"]
