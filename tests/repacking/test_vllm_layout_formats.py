"""`repack --layout vllm` of GPTQ and AWQ checkpoints: the parameters vLLM's GPTQ and AWQ methods
create (AutoGPTQMoEMethod / AutoAWQMoEMethod and their linear methods), the stored K-first tensors
cut per rank as the loader cuts them, proved by `verify`, with a planted fault found.  The key set
against vLLM's own model code is tests/conformance/test_vllm_state_contract.py; the bytes against
vLLM's own load are the engine tier's (tests/test_engine.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.repacking.test_vllm_layout import _keys, _tamper, invoke, one_line

_EXP = "model.layers.0.mlp.experts.routed_experts."
_ATT = "model.layers.1.self_attn."
_MODEL = torch.bfloat16
# (demo spec, release, keys of rank 0 at TP 2 with their shape and dtype).  The demo: H=256, I=256
# (128 per rank), 8 experts, 4 heads / 2 KV heads of 64, 4-bit (pack factor 8), group 128
_CASES = {
    "gptq": ({"format": "gptq", "targets": "linear"}, "0.32.0", {
        _EXP + "w13_qweight": ((8, 256 // 8, 2 * 128), torch.int32),  # K-first, packed along K
        _EXP + "w2_qweight": ((8, 128 // 8, 256), torch.int32),
        _EXP + "w13_scales": ((8, 2, 256), _MODEL),
        _EXP + "w2_scales": ((8, 1, 256), _MODEL),
        _EXP + "w13_qzeros": ((8, 2, 256 // 8), torch.int32),  # symmetric, registered all the same
        _EXP + "w2_qzeros": ((8, 1, 256 // 8), torch.int32),
        _EXP + "w13_bias": ((8, 256), _MODEL),
        _EXP + "w2_bias": ((8, 256), _MODEL),
        _ATT + "qkv_proj.qweight": ((256 // 8, 2 * 64 + 2 * 64), torch.int32),
        _ATT + "qkv_proj.qzeros": ((2, 256 // 8), torch.int32),
        _ATT + "o_proj.qweight": ((128 // 8, 256), torch.int32),  # row parallel: half of K
        _ATT + "o_proj.scales": ((1, 256), _MODEL),
    }),
    # act-order (desc_act) on the newest release that loads it: g_idx, whole w2 scales and zero points
    "gptq_desc_act": ({"format": "gptq", "actorder": "group", "targets": "linear"}, "0.29.0", {
        _EXP + "w2_scales": ((8, 256 // 128, 256), _MODEL),
        _EXP + "w2_qzeros": ((8, 256 // 128, 256 // 8), torch.int32),
        _EXP + "w13_g_idx": ((8, 256), torch.int32),
        _EXP + "w2_g_idx": ((8, 128), torch.int32),
        _EXP + "w13_g_idx_sort_indices": ((8, 256), torch.int32),
        _ATT + "qkv_proj.g_idx": ((256,), torch.int32),
        _ATT + "o_proj.g_idx": ((128,), torch.int32),
        _ATT + "o_proj.scales": ((2, 256), _MODEL),  # act-order: whole on every rank
    }),
    "awq": ({"format": "awq", "symmetric": False, "targets": "linear"}, "0.33.0", {
        _EXP + "w13_qweight": ((8, 256, 2 * 128 // 8), torch.int32),  # K-first, packed along N
        _EXP + "w2_qweight": ((8, 128, 256 // 8), torch.int32),
        _EXP + "w13_qzeros": ((8, 2, 256 // 8), torch.int32),
        _EXP + "w2_scales": ((8, 1, 256), _MODEL),
        _ATT + "qkv_proj.qweight": ((256, (2 * 64 + 2 * 64) // 8), torch.int32),
        _ATT + "o_proj.qzeros": ((1, 256 // 8), torch.int32),
    }),
}
_NOT_WRITTEN = {"gptq": [_EXP + "w13_g_idx", _ATT + "qkv_proj.g_idx", _EXP + "w13_weight_packed",
                         _ATT + "attn.k_scale"],
                "awq": [_EXP + "w13_bias", _EXP + "w13_g_idx"]}


@pytest.fixture(scope="module")
def written(make_ckpt, tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            spec, release, _ = _CASES[case]
            ck = make_ckpt(**spec)
            out = tmp_path_factory.mktemp(case) / "state"
            res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", release, "-o", out, "-q")
            assert res.exit_code == 0, res.output
            made[case] = (ck, out)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(_CASES))
def test_gptq_and_awq_are_written_as_their_vllm_methods_hold_them_and_round_trip(written, case):
    ck, out = written(case)
    keys = _keys(out / "model-rank-0-part-0.safetensors")
    for key, want in _CASES[case][2].items():
        assert keys.get(key) == want, (key, keys.get(key))
    assert not [k for k in _NOT_WRITTEN.get(case, []) if k in keys]
    assert not [k for k in keys if k.endswith(("proj.weight", "weight_packed"))]  # nothing 16-bit or compressed-tensors
    res = invoke("verify", ck, out)
    assert res.exit_code == 0 and "PASS" in res.output, res.output
    assert "--load-format sharded_state --tensor-parallel-size 2" in " ".join(res.output.split())


def test_the_desc_act_w13_g_idx_is_the_checkpoints_and_w2_scales_are_whole_on_both_ranks(written):
    ck, out = written("gptq_desc_act")
    with safe_open(str(out / "model-rank-0-part-0.safetensors"), "pt") as r0, \
            safe_open(str(out / "model-rank-1-part-0.safetensors"), "pt") as r1:
        assert torch.equal(r0.get_tensor(_EXP + "w2_scales"), r1.get_tensor(_EXP + "w2_scales"))
        g13, g2 = r1.get_tensor(_EXP + "w13_g_idx"), r1.get_tensor(_EXP + "w2_g_idx")
    index = {}
    for path in ck.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            index |= {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.0.mlp.experts.3.")}
    assert torch.equal(g13[3], index["model.layers.0.mlp.experts.3.up_proj.g_idx"].to(torch.int32))
    assert torch.equal(g2[3], index["model.layers.0.mlp.experts.3.down_proj.g_idx"][128:].to(torch.int32))
    assert not torch.equal(g13[3], torch.arange(256) // 128)  # a real permutation, not the trivial order


@pytest.mark.parametrize("case,key,where", [
    ("gptq", _EXP + "w13_qweight", (3, 5, 7)),
    ("gptq_desc_act", _EXP + "w2_g_idx", (2, 9)),
    ("awq", _ATT + "qkv_proj.qzeros", (0, 3)),
])
def test_verify_finds_a_word_changed_in_one_rank(written, tmp_path, case, key, where):
    ck, pristine = written(case)

    def change(tensors):
        tensors[key][where] ^= 0x5

    bad = _tamper(pristine, tmp_path / "bad", change)
    res = invoke("verify", ck, bad)
    assert res.exit_code == 1, res.output
    assert f"{key}" in " ".join(res.output.split()) and "differ" in res.output, res.output


def test_desc_act_on_a_release_that_refuses_it_is_refused_in_one_line(make_ckpt, tmp_path):
    ck = make_ckpt(format="gptq", actorder="group")
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", tmp_path / "o")
    assert res.exit_code != 0 and one_line(res.output) and "desc_act" in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_a_layer_vllm_gives_the_moe_wna16_fallback_is_refused_naming_it(make_ckpt, tmp_path):
    """Group 256 is not a Marlin group size: vLLM's GPTQ config builds MoeWNA16Method, whose
    parameters the layout has no rows for; inspect then offers no vllm layout either."""
    import json

    ck = make_ckpt(format="gptq", group_size=256, intermediate_size=512)
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", tmp_path / "o")
    assert res.exit_code == 2 and one_line(res.output), res.output
    assert "MoeWNA16Method" in res.output and "model.layers.0.mlp.experts" in res.output, res.output
    assert not (tmp_path / "o").exists()
    shown = invoke("inspect", ck, "--tp", 2, "--vllm", "0.32.0", "--json")
    assert "--layout vllm" not in json.dumps(json.loads(shown.output).get("next_steps")), shown.output


def test_inspect_offers_the_vllm_layout_for_an_awq_checkpoint_it_takes(make_ckpt):
    import json

    ck = make_ckpt(format="awq", symmetric=False, targets="linear")
    res = invoke("inspect", ck, "--tp", 2, "--vllm", "0.33.0", "--json")
    steps = json.loads(res.output)["next_steps"]
    assert any(s.get("layout") == "vllm" and "--load-format sharded_state" in s["serve"] for s in steps), steps
