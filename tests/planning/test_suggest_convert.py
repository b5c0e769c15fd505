"""`inspect --suggest` names `wna16ctl convert` where the compressed-tensors path loads and the
source format's does not, and `convert --to gptq` where a compressed-tensors checkpoint is refused
and vLLM's GPTQ path loads it (its MoeWNA16 fallback, which compressed-tensors does not have): the
converted checkpoint's verdict is the planner's own, on the headers `convert` would write
(conversion.plan.converted_checkpoint), never the source's."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from tests import modelckpt
from tests.sources import qweight_ckpt
from tests.sources.test_format_gptq import QWEN3_30B_A3B_GPTQ_INT4

# GPTQ with zero points: vLLM's GPTQ configs take symmetric codes only, compressed-tensors' W4A16
# asymmetric scheme loads on Marlin
ASYM = dict(QWEN3_30B_A3B_GPTQ_INT4, sym=False)


def _wna16(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True)


def _suggestions(ck: Path, tps: str, vllm: str) -> dict:
    r = _wna16("inspect", str(ck), "--tp", tps, "--vllm", vllm, "--suggest", "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_suggest_names_convert_where_only_the_compressed_tensors_path_loads(tmp_path):
    ck = qweight_ckpt.header_only(tmp_path / "ck", modelckpt.qwen3_30b_a3b(layers=1), copy.deepcopy(ASYM))
    for vllm in ("0.27.1", "0.33.0"):
        j = _suggestions(ck, "2,4", vllm)
        assert not j["loadable"]
        convert = [s for s in j["suggestions"] if s["kind"] == "convert"]
        # TP 4: I 768 / 4 = 192 is not whole groups of 128, on compressed-tensors' path too
        assert [(s["for_tp"], s["tp"], s["flags"], s["vllm"]) for s in convert] == \
            [(2, 2, "wna16ctl convert CKPT -o OUT", vllm)], j["suggestions"]
        assert "bits/sym" in convert[0]["refused"] and "exact" in convert[0]["change"]


def test_the_suggested_conversion_loads_where_the_suggestion_says(tmp_path):
    src, _ = qweight_ckpt.tiny(tmp_path / "src", copy.deepcopy(dict(ASYM, group_size=32)), form="gptq",
                               symmetric=False, hidden=128)
    j = _suggestions(src, "1", "0.33.0")
    assert [s["kind"] for s in j["suggestions"] if s["kind"] == "convert"] == ["convert"], j["suggestions"]
    r = _wna16("convert", str(src), "-o", str(tmp_path / "ct"))
    assert r.returncode == 0, r.stderr
    converted = _suggestions(tmp_path / "ct", "1", "0.33.0")
    assert converted["loadable"] and converted["quantization"]["format"] == "pack-quantized", converted


def test_suggest_names_convert_to_gptq_where_only_the_gptq_path_loads(tmp_path):
    config = modelckpt.qwen3_30b_a3b(layers=1)
    ck = modelckpt.write(tmp_path / "ck", config, modelckpt.qwen3_moe(config, config["quantization_config"]))
    j = _suggestions(ck, "4,8,16", "0.33.0")
    convert = [s for s in j["suggestions"] if s["kind"] == "convert"]
    # TP 4 and 8: I 768 / TP is not whole groups of 128: compressed-tensors' MoE method is refused,
    # GPTQ's falls back to MoeWNA16; TP 16 (48 per rank) is refused on both paths
    assert [(s["for_tp"], s["tp"], s["flags"]) for s in convert] == \
        [(4, 4, "wna16ctl convert CKPT --to gptq -o OUT"), (8, 8, "wna16ctl convert CKPT --to gptq -o OUT")], convert
    assert "gptq (checkpoint_format gptq)" in convert[0]["change"] and "exact" in convert[0]["change"]


# (model, TP) -> (the compressed-tensors checkpoint loads, its GPTQ conversion loads) wherever the two
# differ, vLLM 0.33.0 on sm90, over the published shapes with llm-compressor's W4A16 recipe (g128;
# Mixtral channel-wise).  Qwen3: I / TP not whole groups of 128, where GPTQ falls back to MoeWNA16;
# Mixtral: 0.33.0 picks the humming MoE backend for compressed-tensors, which asserts on channel-wise
# experts, where GPTQ's MoE method runs Marlin
DIFFERING = {("qwen3_30b_a3b", 4): (False, True), ("qwen3_30b_a3b", 8): (False, True),
             ("qwen3_235b_a22b", 8): (False, True), ("qwen3_235b_a22b", 16): (False, True),
             **{("mixtral_8x7b", tp): (False, True) for tp in (1, 2, 4, 8, 16)}}
SWEPT = {"qwen3_30b_a3b": modelckpt.qwen3_moe, "qwen3_235b_a22b": modelckpt.qwen3_moe,
         "mixtral_8x7b": modelckpt.mixtral, "glm45_air": modelckpt.glm4_moe}


def test_real_shapes_where_the_gptq_path_loads_and_compressed_tensors_does_not(tmp_path):
    """Sweeps real model shapes and TP sizes: the planner's verdict of each compressed-tensors
    checkpoint against its own verdict of the GPTQ checkpoint `convert --to gptq` would write.  They
    differ at real TP sizes (vLLM's GPTQ MoE falls back to MoeWNA16 where Marlin's group divisibility
    fails; compressed-tensors has no such fallback), and there the suggestion names the conversion."""
    from wna16ctl.planning.inspection import inspect_checkpoint, replan_loads
    from wna16ctl.planning.suggest import _converted, converted_loads, suggest

    found = {}
    for name, family in SWEPT.items():
        config = getattr(modelckpt, name)(layers=2)
        ck = modelckpt.write(tmp_path / name, config, family(config, config["quantization_config"]))
        insp = inspect_checkpoint(ck, (1, 2, 4, 8, 16), vllm="0.33.0")
        converted = _converted(insp)
        assert converted, name
        for tp in insp.tps:
            verdicts = (replan_loads(insp, tp, False, "0.33.0", insp.gpu), converted_loads(insp, converted, tp))
            if verdicts[0] != verdicts[1]:
                found[(name, tp)] = verdicts
        named = {s.for_tp for s in suggest(insp) if s.kind == "convert"}
        assert named == {tp for (n, tp), (_, gptq) in found.items() if n == name and gptq}, name
    assert found == DIFFERING
