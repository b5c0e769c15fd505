"""The planner against the release's own model class built on the meta device (model_build.py):
the fast slice of `make test`.  `make conformance` runs every case on sm80/sm90/sm100 with
`python -m tests.conformance.model_build` and prints the counts per release x GPU.

Releases as in test_vllm_conformance.py (WNA16CTL_CONFORMANCE_RELEASES; default the oldest and
newest); uncached and offline, each test skips with one line naming the release."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conformance import adversarial, model_build, vllm_release
from tests.conformance.test_vllm_conformance import RELEASE_PARAMS

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module")
def model_release(request, tmp_path_factory):
    version = request.param
    try:
        vllm_release.release_sources(version)
    except vllm_release.ReleaseUnavailable:
        pytest.skip(vllm_release.fetch_hint(version))
    yield version, tmp_path_factory.mktemp(f"models-{version}")
    vllm_release.close_worker(version)


def _layer_case(root: Path, name: str, gpu: str, tp: int, **changes: Any) -> dict[str, Any]:
    case = {**adversarial.FIXTURES["asym_g64"], "symmetric": True, "group_size": 128, **changes, "tp": tp, "gpu": gpu}
    ckpt = model_build.write_layer_case(case, root / name)
    return {"name": name, "ckpt": str(ckpt), "tp": tp, "ep": False, "gpu": gpu, "env": {}, "load": True}


def _real_case(root: Path, name: str, gpu: str, tp: int, ep: bool = False) -> dict[str, Any]:
    ckpt = model_build.write_real(name, root / "real")
    return {"name": name, "ckpt": str(ckpt), "tp": tp, "ep": ep, "gpu": gpu, "env": {}}


def _slice(root: Path) -> list[dict[str, Any]]:
    """Real configs and the kinds of case a hand-built layer misses: Mixtral's expert names,
    packed lm_heads, act-order "dynamic", 3-bit densely packed weights (through the loader)."""
    return [
        _real_case(root, "qwen3_30b_a3b", "sm90", 2),
        _real_case(root, "qwen3_30b_a3b", "sm80", 4, ep=True),
        _real_case(root, "mixtral_8x7b", "sm90", 8),
        _real_case(root, "deepseek_v3", "sm100", 8),
        _real_case(root, "qwen3_packed_head", "sm90", 2),
        _real_case(root, "qwen3_packed_head_target", "sm90", 2),
        _layer_case(root, "w1_w3_w2_names", "sm90", 2, names="w1_w3_w2", targets="names", hidden_size=512,
                    intermediate_size=256),
        _layer_case(root, "packed_head_untargeted", "sm90", 2, lm_head="packed", hidden_size=512,
                    intermediate_size=256),
        _layer_case(root, "actorder_dynamic", "sm90", 2, actorder="dynamic", hidden_size=512, intermediate_size=256),
        _layer_case(root, "bits3_dense", "sm90", 2, num_bits=3, packing="dense", hidden_size=512,
                    intermediate_size=256),
    ]


@pytest.mark.parametrize("model_release", RELEASE_PARAMS, indirect=True)
def test_model_build_reads_the_releases_decisions(model_release):
    """The build is real: Qwen3-30B-A3B at TP 2 on sm80 has one WNA16 MoE layer with an oracle
    verdict and two quantized attention projections at their per-rank sizes."""
    version, root = model_release
    case = _real_case(root, "qwen3_30b_a3b", "sm80", 2)
    _, _, vllm, _ = model_build.check(version, case)
    assert vllm["stage"] is None, vllm.get("error")
    (moe,) = vllm["moe"].values()
    assert moe["method_class"].startswith("CompressedTensorsWNA16") and moe["oracle_ran"], moe
    assert moe["backend"] == "marlin", moe  # A100: Marlin first in every release
    lin = vllm["linear"]
    assert lin["model.layers.0.self_attn.qkv_proj"]["k_p"] == 2048
    assert lin["model.layers.0.self_attn.qkv_proj"]["n_p"] == (32 + 2 * 4) * 128 // 2
    assert lin["model.layers.0.self_attn.o_proj"]["k_p"] == 32 * 128 // 2
    # a refusal is the release's: 32 heads over 3 ranks
    refused, _, vllm3, plan3 = model_build.check(version, _real_case(root, "qwen3_30b_a3b", "sm80", 3))
    assert vllm3["stage"] == "config" and "divisible" in vllm3["error"] and plan3["stage"] == "config", refused


@pytest.mark.parametrize("model_release", RELEASE_PARAMS, indirect=True)
def test_planner_matches_the_built_model(model_release):
    version, root = model_release
    wrong = []
    for case in _slice(root):
        diffs, known, _, _ = model_build.check(version, case)
        if diffs and known is None:
            wrong.append(f"{case['name']} tp{case['tp']} {case['gpu']}: " + "; ".join(diffs))
    assert not wrong, f"vLLM {version}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("model_release", RELEASE_PARAMS, indirect=True)
def test_weights_and_kv_cache_per_rank_match_the_built_model(model_release):
    """Every parameter and buffer byte of rank 0 of the release's built model (multimodal encoder
    and rotary caches apart) is the planner's weight figure, and every attention layer's KV-cache
    spec gives the planner's bytes per token (a delta-net layer: its state per sequence): GQA with
    KV heads replicated past TP 4, MLA's latent, EP's expert maps, a hybrid model."""
    version, root = model_release
    cases = [_real_case(root, "qwen3_g32", "sm90", 8), _real_case(root, "qwen3_30b_a3b", "sm90", 4, ep=True),
             _real_case(root, "deepseek_v3", "sm90", 2, ep=True), _real_case(root, "qwen35_35b_a3b", "sm90", 2),
             _real_case(root, "qwen3_asym_g64", "sm90", 2)]
    for case in cases:
        _, _, vllm, plan = model_build.check(version, case)
        assert vllm["stage"] is None, vllm.get("error")
        assert plan["weights_bytes"] == model_build.vllm_weight_bytes(vllm), case
        assert [tuple(x) for x in plan["kv_per_layer"]] == model_build.vllm_kv_per_layer(vllm), case
    # Qwen3-30B-A3B (group 32) at TP 8: 4 KV heads, one per rank (replicated): 2 x 128 x 2 bytes per token
    _, _, vllm8, plan8 = model_build.check(version, cases[0])
    assert plan8["kv_per_layer"] == [(False, 512)] == model_build.vllm_kv_per_layer(vllm8)


@pytest.mark.parametrize("model_release", RELEASE_PARAMS, indirect=True)
def test_expert_bytes_after_processing_match_the_release(model_release):
    """The release's own weight processing, run on the built rank's routed experts (compiled ops
    answering with zeros), leaves each layer with the planner's bytes after processing: Marlin's tile
    padding (group 32 at TP 8: 96 -> 128 rows, with zero points when asymmetric), the g_idx tensors
    0.27-0.29 create and free, the per-layer workspace of 0.27-0.30, EP's expert map."""
    from wna16ctl.planning import rules

    version, root = model_release
    cases = [_real_case(root, "qwen3_g32", "sm80", 8),
             _layer_case(root, "asym_g32", "sm80", 8, hidden_size=512, intermediate_size=768,
                         **{"symmetric": False, "group_size": 32}),
             _real_case(root, "qwen3_30b_a3b", "sm80", 4, ep=True), _real_case(root, "mixtral_g128", "sm80", 2)]
    if rules.release(version).has("state.expert_g_idx"):  # act-order "group": the g_idx tensors are kept
        cases.append(_layer_case(root, "actorder_group", "sm80", 2, actorder="group", hidden_size=512,
                                 intermediate_size=256))
    for case in cases:
        theirs, mine = model_build.processed_experts(version, case)
        assert theirs == mine and all(b == "marlin" for b, _ in mine), (case["name"], theirs, mine)


# (checkpoint, how it is padded, vLLM's native MoE method for it): at TP 4, I 768 gives 192 rows per
# rank, not a multiple of group 128, and the Marlin MoE gate sends the experts to MoeWNA16 (`pad --tp 4`
# answers "loads at TP 4 as it is": the fallback loads; --to pads to the size Marlin takes)
QWEIGHT_PADS = [("qwen3_30b_a3b_gptq_int4", ("--to", "1024"), "AutoGPTQMoEMethod"),
                ("qwen3_30b_a3b_awq", ("--to", "1024"), "AutoAWQMoEMethod")]


@pytest.mark.parametrize("model_release", RELEASE_PARAMS, indirect=True)
def test_gptq_and_awq_padded_at_tp4_build_and_load_on_their_native_method(model_release):
    """Qwen3-30B-A3B's GPTQ-Int4 and AWQ shapes at TP 4, built and loaded by the release's own model
    class and weight loader: the original's experts on the MoeWNA16 fallback, the padded set's
    (I 768 -> 1024) on the format's own Marlin method, each as the planner says; the loader reads
    every tensor of the padded set and writes every expert parameter the checkpoint holds."""
    import subprocess
    import sys

    version, root = model_release
    for name, how, native in QWEIGHT_PADS:
        src = model_build.write_qweight(name, root / "qweight")
        out = root / "qweight" / f"{name}-padded"
        if not out.exists():
            r = subprocess.run([sys.executable, "-m", "wna16ctl", "pad", str(src), *how, "--vllm", version,
                                "-o", str(out), "-q"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        for ckpt, method in ((src, "MoeWNA16Method"), (out, native)):
            case = {"name": ckpt.name, "ckpt": str(ckpt), "tp": 4, "ep": False, "gpu": "sm90", "env": {}, "load": True}
            diffs, vllm, plan = model_build.format_check(version, case)
            assert not diffs, (ckpt.name, diffs)
            assert vllm["stage"] is None and plan["stage"] is None, (ckpt.name, vllm.get("error"))
            layers = {n.removesuffix(".routed_experts"): v["method_class"] for n, v in vllm["moe"].items()}
            assert layers == {n: p["method_class"] for n, p in plan["moe"].items()} == \
                {"model.layers.0.mlp.experts": method}, (ckpt.name, layers)
        # the padded set: every tensor read and passed to the model's loader; the expert parameters
        # it leaves unwritten are those no checkpoint holds (biases, act-order sort indices made
        # while processing)
        assert vllm["loaded"]["names_read"] == model_build.checkpoint_tensor_names(out)
        assert all(p.endswith(("_bias", "_g_idx_sort_indices")) for p in vllm["loaded"]["not_written"]), \
            vllm["loaded"]["not_written"]
        assert json.loads((out / "config.json").read_text())["moe_intermediate_size"] == 1024
