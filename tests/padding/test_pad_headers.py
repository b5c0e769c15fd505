"""Padding a Qwen3-30B-A3B-shaped checkpoint (headers over sparse files): I = 768 cannot split
into whole groups of 128 at TP 4 (192 per rank); padded to 1024 it loads there on Marlin."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import modelckpt as m


def _inspect(path, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(path), "--json", *args],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def _moe_rows(j: dict) -> list[dict]:
    return [p for lay in j["layers"] for p in lay["plans"]]


def test_full_size_plan_pads_768_to_1024_at_tp4(tmp_path):
    ck = m.write(tmp_path / "q", m.qwen3_30b_a3b(layers=2), m.qwen3_moe(m.qwen3_30b_a3b(layers=2), m.qwen3_30b_a3b()["quantization_config"]))
    r = subprocess.run([sys.executable, "-m", "wna16ctl", "pad", str(ck), "--tp", "4", "--vllm", "0.31.0", "--dry-run",
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["fields"] == {"moe_intermediate_size": {"from": 768, "to": 1024}}
    assert plan["padded"]["routed"]["modules"] == 2 * 128 * 3
    assert plan["original"]["loads"] is False and plan["verdict"] == {"loads": True, "refused": [], "moe_backends": ["marlin"]}
    # the cost: a third more expert bytes
    experts = 2 * 128 * 3 * (768 * 2048 // 2 + 768 * 2048 // 128 * 2)
    assert abs(plan["extra_bytes"] - experts / 3) < experts * 0.01


def test_inspect_of_the_padded_checkpoint_says_marlin_at_tp4(tmp_path):
    # the published expert shapes (H 2048, I 768, group 128, 32/4 heads); 8 experts and a small
    # vocabulary keep the written bytes small: neither decides the MoE plan at TP 4
    config = {**m.qwen3_30b_a3b(layers=1), "num_experts": 8, "vocab_size": 1024}
    src = m.write(tmp_path / "q", config, m.qwen3_moe(config, config["quantization_config"]), shards=2)
    before = _inspect(src, "--tp", "4", "--vllm", "0.31.0")
    assert before["loadable"] is False
    assert all("192 is not a multiple of group_size 128" in p["rejected"]["marlin"] for p in _moe_rows(before))
    r = subprocess.run([sys.executable, "-m", "wna16ctl", "pad", str(src), "--tp", "4", "--vllm", "0.31.0",
                        "-o", str(tmp_path / "p"), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "moe_intermediate_size: 768 -> 1024" in r.stdout
    after = _inspect(tmp_path / "p", "--tp", "4", "--vllm", "0.31.0")
    assert after["loadable"] is True
    rows = _moe_rows(after)
    assert rows and all(p["backend"] == "marlin" and p["intermediate_size_per_partition"] == 256 for p in rows)


def test_suggest_lists_pad_with_its_size_cost_and_verdict_in_cost_order(tmp_path):
    config = {**m.qwen3_30b_a3b(layers=1), "num_experts": 8, "vocab_size": 1024}
    src = m.write(tmp_path / "q", config, m.qwen3_moe(config, config["quantization_config"]))
    j = _inspect(src, "--tp", "4", "--vllm", "0.31.0", "--suggest")
    kinds = [s["kind"] for s in j["suggestions"]]
    pad = next(s for s in j["suggestions"] if s["kind"] == "pad")
    assert pad["pad"]["fields"] == {"moe_intermediate_size": {"from": 768, "to": 1024}}
    assert pad["pad"]["verdict"]["loads"] and pad["pad"]["verdict"]["moe_backends"] == ["marlin"]
    assert pad["pad"]["extra_bytes"] > 0 and "768 -> 1024" in pad["change"] and "33%" in pad["change"]
    assert pad["flags"] == "wna16ctl pad CKPT --tp 4 --vllm 0.31.0 --gpu sm90 -o OUT"
    # cheaper than requantizing, dearer than serving with expert parallelism
    assert kinds.index("ep") < kinds.index("pad") < kinds.index("group_size"), kinds
