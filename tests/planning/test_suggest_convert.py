"""`inspect --suggest` names `wna16ctl convert` where the compressed-tensors path loads and the
source format's does not: the converted checkpoint's verdict is the planner's own, on the headers
`convert` would write (conversion.plan.converted_checkpoint), never the source's."""

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


def test_no_conversion_is_suggested_for_a_compressed_tensors_checkpoint(tmp_path):
    config = modelckpt.qwen3_30b_a3b(layers=1)
    ck = modelckpt.write(tmp_path / "ck", config, modelckpt.qwen3_moe(config, config["quantization_config"]))
    j = _suggestions(ck, "4,8", "0.33.0")
    assert j["suggestions"] and not [s for s in j["suggestions"] if s["kind"] == "convert"], j["suggestions"]
