"""The e2e reference model against vLLM's own model, per demo architecture (engine tier, `make
test-engine`; skipped without the engine venv).

Each demo checkpoint is written again with its experts as the dense bf16 weights the reference
computes with (`write_dequantized_checkpoint`), so vLLM runs its plain unquantized MoE path on
bit-identical expert weights. For 4 short prompts the reference generates greedily; vLLM then
returns the raw logits of every step teacher-forced on the reference's tokens, and its own greedy
tokens. Criterion (docs/verify.md, "The reference against vLLM's own model"): every logit within
the derived bf16 tolerance, every argmax equal to the reference's token except at a near-tie; at
a step whose token is routed at a near-tie of the router, the logits within the tolerance of the
reference's own outcome or of its outcome with that token routed the other way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ENGINE_DRIVER, REPO_ROOT, engine_python
from wna16ctl.demo import ARCHITECTURES

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 30, 40, 50], [300, 301, 2, 77, 128, 9, 9], [100, 200, 300, 400, 500, 3]]
NEW_TOKENS = 8
# per architecture, the demo fields that differ from the default demo checkpoint: vLLM 0.32.0's CPU
# MLA backend (CPUMLABackend, its decode kernel compiled for one latent size) runs only
# kv_lora_rank + qk_rope_head_dim = 576, the real DeepSeek-V3's 512 + 64; the default demo has 64 + 16.
# The real model's YaRN rope too: with plain rope vLLM's CPU rotary op rotates MLA's strided query and
# key rows by the wrong positions (docs/verify.md, "DeepSeek-V3: the MLA size vLLM's CPU build runs")
ENGINE_SPEC = {"deepseek_v3": {"mla_kv_lora_rank": 512, "mla_qk_rope_head_dim": 64, "mla_yarn_rope": True}}


def engine_env(**extra: str) -> dict[str, str]:
    # the engine venv's own interpreter settings only; a plain bf16 MoE needs no test hooks
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return env | extra


def run_engine(request: dict, tmp_path: Path, name: str, **env: str) -> dict:
    req, res = tmp_path / f"{name}.request.json", tmp_path / f"{name}.result.json"
    req.write_text(json.dumps(request | {"memory_fraction": 0.15}))
    run = subprocess.run([str(engine_python()), str(ENGINE_DRIVER), str(req), str(res)], capture_output=True, text=True,
                         env=engine_env(**env), cwd=tmp_path, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(res.read_text())


@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reference_logits_equal_vllms_own_model(make_ckpt, tmp_path, arch):
    from wna16ctl.verification.engine_reference import (agreement_line, judge_engine, logit_tolerance,
                                                        reference_runs, routing_alternatives, routing_ties,
                                                        write_dequantized_checkpoint)

    engine_python()
    ck = make_ckpt(arch=arch, **ENGINE_SPEC.get(arch, {}))
    dense = write_dequantized_checkpoint(ck, tmp_path / "dense")
    runs = reference_runs(ck, PROMPTS, NEW_TOKENS)
    vocab = runs.logits[0].shape[1]
    # teacher-forced on the prompt and the reference's tokens: prompt position len(prompt)+t holds
    # the logits of generation step t (the scores of the token that follows everything before it)
    forced = [p + t for p, t in zip(runs.prompts, runs.tokens)]
    # one engine start: its own greedy tokens from the prompts, then the teacher-forced logits
    engine = run_engine({"model": str(dense), "prompts": runs.prompts, "max_tokens": NEW_TOKENS, "dtype": "bfloat16",
                         "prompt_logits": vocab, "forced_prompts": forced}, tmp_path, "forced")
    # the driver drops position 0 (no scores): row r is position r + 1
    engine_logits = [torch.tensor(rows[len(p) - 1:]) for p, rows in zip(runs.prompts, engine["prompt_logits"])]
    tolerances, z = logit_tolerance(runs.logits, runs.model_dtype_logits)
    ties, _ = routing_ties(runs)
    alternatives = routing_alternatives(ck, runs, ties)  # the other correct outcomes of a routing near-tie
    results = judge_engine(runs, engine_logits, engine["tokens"], tolerances, ties, alternatives)
    line = f"engine tier: vLLM {engine['vllm']} vs the e2e reference ({runs.model}), " + agreement_line(arch, results, z)
    print(line, file=sys.stderr)
    (REPO_ROOT / "build").mkdir(exist_ok=True)
    with open(REPO_ROOT / "build" / "engine-reference.txt", "a") as log:
        log.write(line + "\n")
    assert all(r.passed for r in results), line
