"""`repack --layout vllm` of llm-compressor's usual recipe (every Linear but lm_head and the routers
quantized): the parameters vLLM's compressed-tensors WNA16 linear scheme creates for attention,
dense MLPs and shared experts, written per rank and proved by `verify`.  The key set against vLLM's
own model code is tests/conformance/test_vllm_state_contract.py; the bytes against vLLM's own load
are the engine tier's (tests/test_engine.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.repacking.test_vllm_layout import _tamper, invoke, one_line, repack_vllm_tp2

_ATT = "model.layers.1.self_attn."
# (demo spec, keys of rank 0 at TP 2 with their shape and dtype).  The demo: H=256, 4 heads / 2 KV
# heads of 64 (GQA), W4A16 group 128 unless said: pack factor 8
_CASES = {
    "qwen3_moe": ({"targets": "linear"}, {
        _ATT + "qkv_proj.weight_packed": ((2 * 64 + 2 * 64, 256 // 8), torch.int32),  # 2 q heads + 1 k + 1 v head
        _ATT + "qkv_proj.weight_scale": ((256, 2), torch.bfloat16),
        _ATT + "qkv_proj.weight_shape": ((2,), torch.int64),
        _ATT + "o_proj.weight_packed": ((256, 128 // 8), torch.int32),  # row parallel: half of K
        _ATT + "o_proj.weight_scale": ((256, 1), torch.bfloat16),  # one group of 128 per rank
    }),
    "mixtral": ({"arch": "mixtral", "targets": "linear", "symmetric": False}, {
        _ATT + "qkv_proj.weight_zero_point": ((256 // 8, 2), torch.int32),  # packed along N, per head
        _ATT + "o_proj.weight_zero_point": ((256 // 8, 1), torch.int32),
    }),
    "int8_channel": ({"targets": "linear", "num_bits": 8, "group_size": -1}, {
        _ATT + "qkv_proj.weight_packed": ((256, 256 // 4), torch.int32),
        _ATT + "o_proj.weight_packed": ((256, 128 // 4), torch.int32),
        _ATT + "o_proj.weight_scale": ((256, 1), torch.bfloat16),  # channel-wise, row parallel: whole
    }),
    # MLA: q_lora 128, kv_lora 64, rope 32, nope 32, v 32; group 32
    "deepseek_v3": ({"arch": "deepseek_v3", "targets": "linear", "group_size": 32, "mla_qk_rope_head_dim": 32}, {
        _ATT + "fused_qkv_a_proj.weight_packed": ((128 + 64 + 32, 256 // 8), torch.int32),  # replicated
        _ATT + "mla_attn.q_b_proj.weight_packed": ((2 * (32 + 32), 128 // 8), torch.int32),
        _ATT + "kv_b_proj.weight_scale": ((2 * (32 + 32), 64 // 32), torch.bfloat16),
        _ATT + "mla_attn.o_proj.weight_packed": ((256, 2 * 32 // 8), torch.int32),
        "model.layers.0.mlp.gate_up_proj.weight_packed": ((512, 256 // 8), torch.int32),  # the dense layer
        "model.layers.0.mlp.down_proj.weight_scale": ((256, 256 // 32), torch.bfloat16),
        "model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight_packed": ((256, 256 // 8), torch.int32),
    }),
    "qwen2_moe": ({"arch": "qwen2_moe", "targets": "linear"}, {
        "model.layers.1.mlp.experts._shared_experts._layer.down_proj.weight_packed": ((256, 256 // 8), torch.int32),
        _ATT + "qkv_proj.bias": ((256,), torch.bfloat16),
    }),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_the_standard_recipe_is_written_as_vllm_holds_it_and_round_trips(make_ckpt, tmp_path, case):
    spec, expect = _CASES[case]
    ck = make_ckpt(**spec)
    out = tmp_path / case
    keys = repack_vllm_tp2(ck, out)
    for key, want in expect.items():
        assert keys.get(key) == want, (key, keys.get(key))
    assert not [k for k in keys if k.endswith("proj.weight") and "self_attn" in k]  # no 16-bit attention left
    res = invoke("verify", ck, out)
    assert res.exit_code == 0 and "PASS" in res.output, res.output


def _move_to_a_later_file(ck: Path, dst: Path, names: list[str]) -> Path:
    """A copy of `ck` with `names` moved into a file that vLLM's natural file order reads last."""
    shutil.copytree(ck, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = {}
    for name in names:
        src = dst / index["weight_map"][name]
        tensors = load_file(str(src))
        moved[name] = tensors.pop(name)
        save_file(tensors, str(src), metadata={"format": "pt"})
        index["weight_map"][name] = "model-00010-of-00010.safetensors"
    save_file(moved, str(dst / "model-00010-of-00010.safetensors"), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return dst


def test_a_fused_layers_weight_shape_is_the_one_vllm_loads_last(make_ckpt, tmp_path):
    """Every shard's load copies its whole weight_shape into the fused layer's one parameter: the
    value kept is the last loaded (files in natural order, keys sorted): v_proj's in the demo, q_proj's
    once q_proj's comes from a later file (file 10 after file 2, not before it as a string sort says)."""
    ck = make_ckpt(targets="linear")
    key = "model.layers.0.self_attn.qkv_proj.weight_shape"
    out = tmp_path / "o"
    repack_vllm_tp2(ck, out)
    with safe_open(str(out / "model-rank-0-part-0.safetensors"), framework="pt") as f:
        assert f.get_tensor(key).tolist() == [128, 256]  # v_proj: 2 KV heads of 64
    moved = _move_to_a_later_file(ck, tmp_path / "moved", ["model.layers.0.self_attn.q_proj.weight_shape"])
    out2 = tmp_path / "o2"
    assert invoke("repack", moved, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", out2, "-q").exit_code == 0
    with safe_open(str(out2 / "model-rank-1-part-0.safetensors"), framework="pt") as f:
        assert f.get_tensor(key).tolist() == [256, 256]  # q_proj: 4 heads of 64
    res = invoke("verify", moved, out2)
    assert res.exit_code == 0, res.output


def test_verify_catches_swapped_key_and_value_zero_points(make_ckpt, tmp_path):
    ck = make_ckpt(arch="mixtral", targets="linear", symmetric=False)
    out = tmp_path / "o"
    repack_vllm_tp2(ck, out)
    key = "model.layers.0.self_attn.qkv_proj.weight_zero_point"
    # rank 1's packed rows: 16 of its two query heads, 8 of its key head, 8 of its value head
    bad = _tamper(out, tmp_path / "bad", lambda t: t.__setitem__(key, torch.cat([t[key][:16], t[key][24:],
                                                                                   t[key][16:24]]).contiguous()))
    res = invoke("verify", ck, bad)
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and f"{key}: the model.layers.0.self_attn.v_proj.weight_zero_point rows differ" in text, text


def test_a_quantized_layer_the_layout_does_not_write_is_refused_naming_it(make_ckpt, tmp_path):
    """A quantized lm_head (the recipe without its ignore entry) has no row in the layout: one line."""
    ck = tmp_path / "head"
    shutil.copytree(make_ckpt(targets="linear"), ck)
    _quantize_lm_head(ck)
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", tmp_path / "o")
    assert res.exit_code == 2 and one_line(res.stderr), res.output
    assert "lm_head: a quantized lm_head is not written by the vllm layout" in res.stderr, res.stderr


def _quantize_lm_head(ck: Path) -> None:
    """Replace the demo's 16-bit lm_head with a W4A16 one (zero codes, unit scales) and target it."""
    index_path = ck / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    path = ck / index["weight_map"].pop("lm_head.weight")
    tensors = load_file(str(path))
    n, k = tensors.pop("lm_head.weight").shape
    tensors |= {"lm_head.weight_packed": torch.zeros(n, k // 8, dtype=torch.int32),
                "lm_head.weight_scale": torch.ones(n, k // 128, dtype=torch.bfloat16),
                "lm_head.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    for name in ("lm_head.weight_packed", "lm_head.weight_scale", "lm_head.weight_shape"):
        index["weight_map"][name] = path.name
    index_path.write_text(json.dumps(index))
    config = json.loads((ck / "config.json").read_text())
    q = config["quantization_config"]
    q["ignore"] = [p for p in q["ignore"] if p != "lm_head"]
    q["config_groups"]["group_0"]["targets"] = ["Linear", "lm_head"]
    (ck / "config.json").write_text(json.dumps(config))


def test_readme_example_plans_the_real_qwen3_30b_a3b_w4a16(tmp_path, monkeypatch):
    """README's line on a header-only copy of Qwen3-30B-A3B-Instruct-2507-W4A16's config (48 layers,
    every Linear quantized): the plan holds vLLM's quantized attention of each rank."""
    from tests import modelckpt as m
    from wna16ctl.planning.vllm_state import plan_vllm_state

    q = m.qwen3_30b_a3b(layers=48)
    m.write(tmp_path / "Qwen3-30B-A3B-W4A16", q, m.qwen3_moe(q, q["quantization_config"]), shards=16)
    monkeypatch.chdir(tmp_path)
    res = invoke("repack", "./Qwen3-30B-A3B-W4A16", "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0",
                 "-o", "./q3-vllm", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "--load-format sharded_state --tensor-parallel-size 2" in " ".join(res.output.split())
    assert not (tmp_path / "q3-vllm").exists()
    plan = plan_vllm_state(tmp_path / "Qwen3-30B-A3B-W4A16", 2, "0.32.0")
    keys = {t.key: (t.shape, t.dtype) for t in plan.keys[1]}
    att = "model.layers.47.self_attn."
    assert keys[att + "qkv_proj.weight_packed"] == ((16 * 128 + 2 * 2 * 128, 2048 // 8), "I32")  # 16 q + 2 k + 2 v heads
    assert keys[att + "qkv_proj.weight_scale"] == ((2560, 2048 // 128), "BF16")
    assert keys[att + "o_proj.weight_packed"] == ((2048, 2048 // 8), "I32")  # K = 32 heads x 128 over 2 ranks
    assert keys[att + "o_proj.weight_scale"] == ((2048, 2048 // 128), "BF16")
    assert keys[att + "o_proj.weight_shape"] == ((2,), "I64")


@pytest.mark.parametrize("release,code,expect", [
    ("0.29.0", 2, "(CompressedTensorsWNA16.create_weights, marlin_repeat_scales_on_all_ranks)"),
    ("0.32.0", 1, "actorder 'group': vLLM 0.32.0 refuses the checkpoint"),
])
def test_act_order_linear_layers_are_refused_with_vllms_reason(make_ckpt, tmp_path, release, code, expect):
    """Act-order attention: before 0.30 vLLM keeps whole scales on every rank and adds weight_g_idx
    (no faithful state to write, said with the code that does it); from 0.30 vLLM refuses the
    checkpoint itself."""
    ck = make_ckpt(targets="linear", actorder="group")
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", release, "-o", tmp_path / "o")
    assert res.exit_code == code and one_line(res.stderr), res.output
    assert "model.layers.0.self_attn" in res.stderr and expect in res.stderr, res.stderr
