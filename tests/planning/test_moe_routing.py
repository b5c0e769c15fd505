"""The routed experts' routing method decides whether FlashInfer's TRT-LLM int4 MoE takes a layer:
it takes only renormalized softmax top-k, DeepSeek-V3 grouped routing and Llama-4's.  A Qwen3-MoE
config without `norm_topk_prob` (softmax top-k, no renormalization) falls back to Marlin on sm100
with VLLM_USE_FLASHINFER_MOE_INT4=1 (seen in each release's model built on the meta device,
tests/conformance/model_build.py)."""

from __future__ import annotations

import pytest

from tests import modelckpt as m
from wna16ctl.planning.inspection import inspect_checkpoint
from wna16ctl.sources import open_checkpoint

FLASHINFER = ["VLLM_USE_FLASHINFER_MOE_INT4=1"]


def _qwen3_g32(tmp_path, **config):
    c = m.qwen3_30b_a3b(layers=1, group_size=32)
    c.update(config)
    return m.write(tmp_path / "ckpt", c, m.qwen3_moe(c, c["quantization_config"]))


@pytest.mark.parametrize("release", ["0.27.1", "0.33.0"])
def test_unnormalized_topk_is_not_taken_by_trtllm(tmp_path, release):
    ck = _qwen3_g32(tmp_path, norm_topk_prob=False)
    insp = inspect_checkpoint(ck, tps=(2,), vllm=release, gpu="sm100", env=FLASHINFER)
    ((plan,),) = insp.plans.values()
    assert plan.backend.value == "marlin"
    assert "routing method Default" in plan.rejected["flashinfer_trtllm"]


@pytest.mark.parametrize("release", ["0.27.1", "0.33.0"])
def test_renormalized_topk_is_taken_by_trtllm(tmp_path, release):
    ck = _qwen3_g32(tmp_path, norm_topk_prob=True)
    insp = inspect_checkpoint(ck, tps=(2,), vllm=release, gpu="sm100", env=FLASHINFER)
    ((plan,),) = insp.plans.values()
    assert plan.backend.value == "flashinfer_trtllm"


def test_routing_method_per_architecture(tmp_path):
    from wna16ctl.sources.model import moe_routing

    def routing(name, config):
        q = config.get("quantization_config")
        family = {"mixtral": m.mixtral, "deepseek_v3": m.deepseek_v3, "glm4_moe": m.glm4_moe}.get(
            config["model_type"], m.qwen3_moe)
        return moe_routing(open_checkpoint(m.write(tmp_path / name, config, family(config, q))).config)

    unset = {k: v for k, v in m.qwen3_30b_a3b(layers=1).items() if k != "norm_topk_prob"}
    assert routing("q3", unset) == "Default"  # transformers' default: not renormalized
    assert routing("q3n", dict(unset, norm_topk_prob=True)) == "RenormalizeNaive"
    assert routing("mx", m.mixtral_8x7b(layers=1)) == "RenormalizeNaive"
    dsv3 = dict(m.deepseek_v3_671b(layers=2, dense=1), topk_method="noaux_tc", scoring_func="sigmoid", n_group=8)
    assert routing("dsv3", dsv3) == "DeepSeekV3"
    assert routing("glm", dict(m.glm45_air(layers=2), norm_topk_prob=True, n_group=1)) == "DeepSeekV3"
