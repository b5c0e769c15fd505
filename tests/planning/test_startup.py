"""The rest of a start (planning/startup.py): computed from the deployment's sizes and vLLM's rules
for --max-num-batched-tokens, CUDA graph sizes and the sampler's dummy pass, never shown as exact."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tests import modelckpt as m
from wna16ctl.cli import cli
from wna16ctl.planning.startup import GRAPH_FLOOR, UNMODELLED, Shape, capture_sizes, default_batched_tokens, \
    forward_peak, rest_of_start

GIB = 1 << 30


def _qwen3_30b(root: Path) -> Path:
    config = dict(m.qwen3_30b_a3b(layers=48), max_position_embeddings=40960, norm_topk_prob=True)
    return m.write(root / "Qwen3-30B-A3B-W4A16", config, m.qwen3_moe(config, config["quantization_config"]))


def _inspect(ck: Path, *args: str) -> dict:
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--json", "--vllm", "0.33.0", *args])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def test_vllm_serve_default_batched_tokens_per_gpu_and_release():
    """EngineArgs.get_batch_defaults for vllm serve: 2048 below 70 GiB and on an A100, 8192 from
    70 GiB, 16384 from 160 GiB in the releases that have that tier (0.28.0 on)."""
    assert default_batched_tokens("0.33.0", 40 * GIB, "a100-40") == 2048
    assert default_batched_tokens("0.33.0", 80 * GIB, "a100-80") == 2048
    assert default_batched_tokens("0.33.0", 80 * GIB, "h100") == 8192
    assert default_batched_tokens("0.33.0", 180 * GIB, "b200") == 16384
    assert default_batched_tokens("0.27.1", 180 * GIB, "b200") == 8192


def test_cuda_graph_sizes_follow_the_release():
    """_set_cudagraph_sizes: 1, 2, 4, then steps of 8 below 256 and of 16 up to min(2 x max_num_seqs,
    512, max_num_batched_tokens); 1024 instead of 512 on Blackwell from 0.28.0."""
    sizes = capture_sizes("0.33.0", "sm90", 256, 8192)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert capture_sizes("0.33.0", "sm90", 8, 8192) == [1, 2, 4, 8, 16]
    assert capture_sizes("0.33.0", "sm90", 256, 100)[-1] == 100  # the batch size itself, where it is smaller
    assert capture_sizes("0.33.0", "sm100", 1024, 16384)[-1] == 1024
    assert capture_sizes("0.27.1", "sm100", 1024, 16384)[-1] == 512


def test_forward_peak_of_a_small_moe_shape():
    """Residual stream and hidden states, plus the largest step of one layer (here the MoE's)."""
    s = Shape(hidden=64, attn_in=96, attn_out=64, moe=(8, 2, 32, 0), dense=0, vocab=128, elem=2)
    t = 10
    attention = t * (96 + 64 + 64) * 2
    moe = 4 * t * 8 + 8 * t * 2 + 2 * (t * 2 * (max(64, 64) + 32) + t * 64)
    assert moe > attention and forward_peak(s, t) == 2 * t * 64 * 2 + moe


def test_the_rest_is_computed_and_bracketed():
    """The sampler pass covers min(max_num_seqs, tokens) rows of the whole vocabulary; each mode's
    graphs after the first count vLLM's 1 MiB floor; the bracket adds the warm-up and the unmodelled."""
    s = Shape(hidden=64, attn_in=96, attn_out=64, moe=(8, 2, 32, 0), dense=0, vocab=128, elem=2)
    r = rest_of_start(s, "0.33.0", "sm90", 4, 2048)
    assert r.sampler == 2048 * 64 * 2 + 4 * 128 * (2 + 20)
    assert r.graphs == 4 + 3  # PIECEWISE 1, 2, 4, 8; FULL 1, 2, 4
    assert r.cudagraph == forward_peak(s, 8) + 3 * GRAPH_FLOOR + forward_peak(s, 4) + 2 * GRAPH_FLOOR
    assert r.low == r.activation + r.cudagraph + UNMODELLED[0]
    assert r.high == r.low + forward_peak(s, 8) + forward_peak(s, 4) + UNMODELLED[1] - UNMODELLED[0]


def test_max_num_batched_tokens_moves_the_rest_and_the_kv_budget(tmp_path):
    """--max-num-batched-tokens is the profiling pass's size: a larger one takes more from the KV
    budget; without it, vllm serve's default for the GPU (8192 on an H100).  Every figure that
    depends on the rest is an estimate."""
    ck = _qwen3_30b(tmp_path)
    (default,) = _inspect(ck, "--tp", "2", "--gpu", "h100")["memory"]
    (big,) = _inspect(ck, "--tp", "2", "--gpu", "h100", "--max-num-batched-tokens", "65536")["memory"]
    assert default["max_num_batched_tokens"] == 8192 and big["max_num_batched_tokens"] == 65536
    rd, rb = default["rest_of_start"], big["rest_of_start"]
    assert rd["exact"] is False and rd["activation_peak"]["exact"] is False and rd["bracket"]["exact"] is False
    assert rb["forward_peak"]["value"] > 4 * rd["forward_peak"]["value"]
    assert rb["value"][0] > rd["value"][0] and big["kv_tokens"]["value"][1] < default["kv_tokens"]["value"][1]
    assert big["kv_budget"]["value"] == [math.ceil(80 * GIB * 0.9) - big["weights"]["value"] - r
                                         for r in reversed(rb["value"])]


def test_serve_lines_and_dry_runs_carry_max_num_batched_tokens(tmp_path):
    """The serve line of a start judged at an asked --max-num-batched-tokens carries it; pad's and
    repack's dry runs report the rest at that size."""
    ck = _qwen3_30b(tmp_path)
    doc = _inspect(ck, "--tp", "2", "--gpu", "h100", "--max-num-batched-tokens", "4096")
    assert "--max-num-batched-tokens 4096" in doc["next_steps"][0]["serve"]
    assert "--max-num-batched-tokens" not in _inspect(ck, "--tp", "2", "--gpu", "h100")["next_steps"][0]["serve"]
    for cmd in (["pad", str(ck), "--tp", "4", "--dry-run"], ["repack", str(ck), "-o", str(tmp_path / "o"), "--tp", "2",
                                                            "--dry-run", "--vllm", "0.33.0"]):
        res = subprocess.run([sys.executable, "-m", "wna16ctl", *cmd, "--gpu", "h100", "--max-num-batched-tokens",
                              "4096"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "--max-num-batched-tokens 4096: rest of a start" in res.stdout and "(estimate)" in res.stdout, res.stdout
