"""`repack --layout vllm` and `verify` on its output: the sharded_state contract, the tensor math
and its inverse, and the one-line refusals.  The engine itself is exercised by the engine tier
(tests/test_engine.py); the key contract against vLLM's model code by tests/conformance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from wna16ctl.cli import cli
from wna16ctl.layout import vllm_state as vs
from wna16ctl.output.writer import FILE_HASH, MANIFEST_NAME, hash_file


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1


# -- the tensor math and its inverse ------------------------------------------------------------------

def test_vocab_is_padded_to_64_then_split():
    w = torch.arange(100 * 3, dtype=torch.float32).reshape(100, 3)
    parts = [vs.vocab_shard(w, 2, r) for r in range(2)]
    assert [p.shape[0] for p in parts] == [64, 64]  # 100 -> 128 rows, 64 per rank
    assert torch.equal(parts[0], w[:64]) and torch.equal(parts[1][:36], w[64:])
    assert not parts[1][36:].any()
    rows, pad = vs.vocab_unshard(parts, 100)
    assert torch.equal(rows, w) and pad.shape[0] == 28 and not pad.any()


@pytest.mark.parametrize("heads,kv,tp", [(8, 4, 2), (8, 2, 4), (4, 1, 4), (4, 2, 4), (6, 6, 3)])
def test_qkv_round_trip_with_replicated_kv_heads(heads, kv, tp):
    hd, h = 4, 5
    gen = torch.Generator().manual_seed(heads * 31 + kv * 7 + tp)
    q, k, v = (torch.randn(n * hd, h, generator=gen) for n in (heads, kv, kv))
    parts = [vs.qkv_shard(q, k, v, heads, kv, hd, tp, r) for r in range(tp)]
    per_kv = max(1, kv // tp) * hd
    for r, p in enumerate(parts):
        assert p.shape[0] == heads // tp * hd + 2 * per_kv
        head = r * kv // tp if kv >= tp else r // (tp // kv)  # first KV head of the rank
        assert torch.equal(p[heads // tp * hd:heads // tp * hd + hd], k[head * hd:(head + 1) * hd])
    q2, k2, v2, replicas = vs.qkv_unshard(parts, heads, kv, hd)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    assert len(replicas) == (tp - kv if kv < tp else 0)


def test_experts_n_first_round_trip():
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randint(-2**31, 2**31 - 1, (16, 4), generator=gen, dtype=torch.int64).to(torch.int32)
                for _ in range(2))
    down = torch.randint(-2**31, 2**31 - 1, (8, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    w13 = [vs.w13_shard(gate, up, 2, r) for r in range(2)]
    assert torch.equal(w13[1][:8], gate[8:]) and torch.equal(w13[1][8:], up[8:])  # gate rows, then up rows
    g2, u2 = vs.w13_unshard(w13)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    w2 = [vs.w2_shard(down, 2, r) for r in range(2)]
    assert torch.equal(vs.w2_unshard(w2)[0], down)
    scale = torch.randn(8, 1)
    whole = [vs.w2_shard(scale, 2, r, whole=True) for r in range(2)]
    assert vs.w2_unshard(whole, whole=True) == (whole[0], [])


def test_weight_shape_rows_take_the_model_dtype():
    rows = vs.weight_shape_rows([torch.tensor([768, 2048]), torch.tensor([768, 2048])], torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 2) and rows[0].tolist() == [768.0, 2048.0]


# -- repack --layout vllm + verify ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def q3_tp2(make_ckpt, tmp_path_factory):
    ck = make_ckpt(tokenizer=True)
    out = tmp_path_factory.mktemp("vllm") / "q3-tp2"
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    return ck, out, res.output


def _keys(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}


def repack_vllm_tp2(ck: Path, out: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`repack --tp 2 --layout vllm --vllm 0.32.0` of `ck` into `out`, which must succeed; rank 0's
    keys (shape, dtype)."""
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.32.0", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    return _keys(out / "model-rank-0-part-0.safetensors")


def test_repack_writes_vllms_default_pattern_and_prints_the_serve_command(q3_tp2):
    ck, out, output = q3_tp2
    names = sorted(p.name for p in out.iterdir())
    assert "model-rank-0-part-0.safetensors" in names and "model-rank-1-part-0.safetensors" in names
    assert {"config.json", "tokenizer.json", MANIFEST_NAME} <= set(names)
    assert f"vllm serve {out} --load-format sharded_state --tensor-parallel-size 2" in output.replace("\n", "")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["layout"] == "vllm" and manifest["engine"]["load_format"] == "sharded_state"


def test_demo_state_has_the_contract_keys(q3_tp2):
    """The demo (Qwen3-MoE, 2 layers, 8 experts, H=256, I=256, vocab 512, 4 heads / 2 KV heads of 64,
    W4A16 group 128) at TP 2, as vLLM 0.32.0 creates it (same set as the engine tier's dump)."""
    _, out, _ = q3_tp2
    keys = _keys(out / "model-rank-1-part-0.safetensors")
    assert len(keys) == 49
    exp = "model.layers.1.mlp.experts.routed_experts."
    assert keys[exp + "w13_weight_packed"] == ((8, 256, 32), torch.int32)  # 2 * 256/2 rows, 256/8 words
    assert keys[exp + "w2_weight_packed"] == ((8, 256, 16), torch.int32)
    assert keys[exp + "w13_weight_scale"] == ((8, 256, 2), torch.bfloat16)
    assert keys[exp + "w2_weight_scale"] == ((8, 256, 1), torch.bfloat16)
    assert keys[exp + "w13_weight_shape"] == ((8, 2), torch.bfloat16)
    assert keys["model.layers.0.mlp.experts.gate.weight"] == ((8, 256), torch.bfloat16)
    assert keys["model.layers.0.self_attn.qkv_proj.weight"] == ((64 * 2 + 2 * 64, 256), torch.bfloat16)
    assert keys["model.embed_tokens.weight"] == ((256, 256), torch.bfloat16)
    assert keys["model.layers.0.self_attn.attn._k_scale"] == ((), torch.float32)
    assert keys["model.layers.0.self_attn.attn.k_scale"] == ((1,), torch.float32)
    assert "model.layers.0.mlp.gate.weight" not in keys  # the router's larger key is filtered by vLLM


def test_verify_passes_and_prints_the_serve_command(q3_tp2):
    ck, out, _ = q3_tp2
    res = invoke("verify", ck, out)
    assert res.exit_code == 0, res.output
    assert "PASS 98 keys" in res.output and "round-trip" in res.output
    assert "--load-format sharded_state --tensor-parallel-size 2" in res.output


def _tamper(src: Path, dst: Path, change) -> Path:
    """A copy of the output with rank 1's file changed by `change(dict)`, manifest hash updated, so
    that only the contract can catch it."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "model-rank-1-part-0.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest["files"][path.name] = {FILE_HASH: hash_file(path), "bytes": path.stat().st_size}
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dst


_EXP = "model.layers.0.mlp.experts.routed_experts."


@pytest.mark.parametrize("what,change,expect", [
    ("missing", lambda t: t.pop(_EXP + "w2_weight_scale"), f"rank 1: key {_EXP}w2_weight_scale is missing"),
    ("extra", lambda t: t.__setitem__("model.layers.0.mlp.gate.weight", t["model.layers.0.mlp.experts.gate.weight"].clone()),
     "extra key model.layers.0.mlp.gate.weight"),
    ("int64 shape", lambda t: t.__setitem__(_EXP + "w13_weight_shape", t[_EXP + "w13_weight_shape"].to(torch.int64)),
     f"{_EXP}w13_weight_shape is I64, vLLM 0.32.0 creates it as BF16"),
    ("unpadded vocab", lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:250].clone()),
     "(the vocabulary is not padded to a multiple of 64)"),
    ("wrong value", lambda t: t[_EXP + "w13_weight_packed"].__setitem__((3, 0, 0), 12345),
     f"{_EXP}w13_weight_packed: expert 3: differs from"),
])
def test_verify_names_each_contract_violation_in_one_line(q3_tp2, tmp_path, what, change, expect):
    ck, out, _ = q3_tp2
    bad = _tamper(out, tmp_path / "bad", change)
    res = invoke("verify", ck, bad)
    assert res.exit_code == 1, res.output
    fails = [line for line in res.output.replace("\n ", " ").splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1, res.output
    assert expect in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_other_architectures_round_trip(make_ckpt, tmp_path, arch):
    ck = make_ckpt(arch=arch)
    out = tmp_path / arch
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.33.0", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    res = invoke("verify", ck, out)
    assert res.exit_code == 0, res.output
    keys = _keys(out / "model-rank-0-part-0.safetensors")
    if arch == "qwen2_moe":
        assert "model.layers.0.mlp.experts._shared_experts._layer.gate_up_proj.weight" in keys
        assert "model.layers.0.self_attn.qkv_proj.bias" in keys
    else:
        assert "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight_packed" in keys


# (arch, keys that only that architecture's contract has, with their rank-0 shape and dtype at TP 2)
_MLA = "model.layers.1.self_attn."
_NEW_ARCHS = [
    ("deepseek_v3", {_MLA + "fused_qkv_a_proj.weight": ((128 + 64 + 16, 256), torch.bfloat16),  # q_a + kv_a rows, replicated
                     _MLA + "mla_attn.q_b_proj.weight": ((2 * (32 + 16), 128), torch.bfloat16),
                     _MLA + "kv_b_proj.weight": ((2 * (32 + 32), 64), torch.bfloat16),
                     _MLA + "mla_attn.o_proj.weight": ((256, 2 * 32), torch.bfloat16),
                     _MLA + "mla_attn.mla_attn._k_scale": ((), torch.float32),
                     "model.layers.1.mlp.experts.gate.e_score_correction_bias": ((8,), torch.float32),
                     "model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight": ((256, 256), torch.bfloat16),
                     "model.layers.0.mlp.gate_up_proj.weight": ((512, 256), torch.bfloat16)}),  # the dense first layer
    ("deepseek_v2", {_MLA + "kv_a_proj_with_mqa.weight": ((64 + 16, 256), torch.bfloat16),
                     _MLA + "mla_attn.q_proj.weight": ((2 * (32 + 16), 256), torch.bfloat16),
                     "model.layers.1.mlp.experts._shared_experts._layer.down_proj.weight": ((256, 256), torch.bfloat16)}),
    ("kimi_k2", {_MLA + "fused_qkv_a_proj.weight": ((208, 256), torch.bfloat16),
                 "model.layers.1.mlp.experts.gate.weight": ((8, 256), torch.bfloat16)}),
    ("glm4_moe", {"model.layers.1.self_attn.qkv_proj.bias": ((256,), torch.bfloat16),
                  "model.layers.1.mlp.gate.weight": ((8, 256), torch.float32),  # GLM's router stays fp32
                  "model.layers.1.mlp.experts.routed_experts.e_score_correction_bias": ((8,), torch.float32),
                  "model.layers.0.mlp.down_proj.weight": ((256, 256), torch.bfloat16)}),
]
_ABSENT = {"deepseek_v3": [_MLA + "qkv_proj.weight", _MLA + "attn.k_scale", "model.layers.1.mlp.gate.weight"],
           "deepseek_v2": [_MLA + "fused_qkv_a_proj.weight", "model.layers.1.mlp.experts.gate.e_score_correction_bias"],
           "kimi_k2": [_MLA + "kv_a_proj_with_mqa.weight"],
           "glm4_moe": ["model.layers.1.mlp.experts.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"]}


@pytest.mark.parametrize("arch,expect", _NEW_ARCHS, ids=[a for a, _ in _NEW_ARCHS])
def test_mla_and_glm_architectures_write_their_contract_and_round_trip(make_ckpt, tmp_path, arch, expect):
    """DeepSeek-V2 (MLA without a query LoRA), V3 and Kimi-K2 (MLA with one, correction bias),
    GLM-4.5 (biased GQA, fp32 router): each key as vLLM 0.32.0 creates it, and the round trip."""
    ck = make_ckpt(arch=arch)
    out = tmp_path / arch
    keys = repack_vllm_tp2(ck, out)
    for key, want in expect.items():
        assert keys.get(key) == want, (key, keys.get(key))
    for key in _ABSENT[arch]:
        assert key not in keys
    res = invoke("verify", ck, out)
    assert res.exit_code == 0 and "PASS" in res.output, res.output


def test_a_fused_latent_projection_fault_is_caught(make_ckpt, tmp_path):
    ck = make_ckpt(arch="deepseek_v3")
    out = tmp_path / "o"
    repack_vllm_tp2(ck, out)
    key = _MLA + "fused_qkv_a_proj.weight"
    # kv_a rows first, q_a rows second: the right shape, the wrong order
    bad = _tamper(out, tmp_path / "bad", lambda t: t.__setitem__(key, torch.cat([t[key][128:], t[key][:128]]).contiguous()))
    res = invoke("verify", ck, bad)
    assert res.exit_code == 1 and f"{key}: rank 1: the {_MLA}q_a_proj.weight rows differ" in " ".join(res.output.split())


def test_asymmetric_experts_carry_zero_points(make_ckpt, tmp_path):
    ck = make_ckpt(symmetric=False)
    out = tmp_path / "asym"
    repack_vllm_tp2(ck, out)
    keys = _keys(out / "model-rank-0-part-0.safetensors")
    assert keys[_EXP + "w13_weight_zero_point"] == ((8, 256 // 8, 2), torch.int32)
    assert keys[_EXP + "w2_weight_zero_point"] == ((8, 256 // 8, 1), torch.int32)
    assert invoke("verify", ck, out).exit_code == 0


@pytest.mark.parametrize("args,expect", [
    (("--vllm", "0.29.0", "--env", "VLLM_NOT_A_SWITCH=1"), "VLLM_NOT_A_SWITCH"),
    (("--resume",), "--resume"),
])
def test_refusals_are_one_line(make_ckpt, tmp_path, args, expect):
    res = CliRunner().invoke(cli, ["repack", str(make_ckpt()), "--tp", "2", "--layout", "vllm",
                                                   "-o", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    assert one_line(res.stderr) and expect in res.stderr, res.stderr


@pytest.mark.parametrize("release,backend,k_first", [("0.29.0", None, True), ("0.27.0", None, True),
                                                     ("0.30.0", "humming", False), ("0.31.0", None, False)])
def test_expert_buffers_follow_the_planned_backend_before_0_31(make_ckpt, tmp_path, release, backend, k_first):
    """0.27-0.30 create the expert buffers K-first (the loader transposes) unless the backend reads the
    checkpoint's N-first form; 0.27-0.29 also create the act-order index buffers.  Each written state
    round-trips, and the chosen backend is named."""
    ck = make_ckpt()
    out = tmp_path / "o"
    extra = ["--moe-backend", backend] if backend else []
    res = invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", release, "-o", out, *extra)
    assert res.exit_code == 0, res.output
    keys = _keys(out / "model-rank-1-part-0.safetensors")
    want13 = (8, 256 // 8, 256) if k_first else (8, 256, 256 // 8)  # H/8 words x 2*I/2 rows, or the reverse
    assert keys[_EXP + "w13_weight_packed"] == (want13, torch.int32)
    assert keys[_EXP + "w2_weight_scale"] == (((8, 1, 256) if k_first else (8, 256, 1)), torch.bfloat16)
    assert (_EXP + "w13_weight_g_idx" in keys) == (release in ("0.27.0", "0.29.0"))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["experts"]["orientation"] == ("k_first" if k_first else "n_first")
    if release != "0.31.0":
        assert manifest["experts"]["backends"]["0"] == (backend or "marlin")
        assert f"planned {backend or 'marlin'} on sm90" in " ".join(res.output.split())
    else:
        assert not manifest["experts"]["backend_decides"]
    res = invoke("verify", ck, out)
    assert res.exit_code == 0 and "PASS" in res.output, res.output


def test_k_first_zero_points_round_trip_and_a_transposed_fault_is_caught(make_ckpt, tmp_path):
    ck = make_ckpt(symmetric=False)
    out = tmp_path / "o"
    assert invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--vllm", "0.28.0", "-o", out, "-q").exit_code == 0
    exp = "model.layers.1.mlp.experts.routed_experts."
    keys = _keys(out / "model-rank-0-part-0.safetensors")
    assert keys[exp + "w13_weight_zero_point"] == ((8, 2, 256 // 8), torch.int32)  # [groups, 2*I/2 / 8]
    assert keys[exp + "w2_weight_zero_point"] == ((8, 1, 256 // 8), torch.int32)
    assert invoke("verify", ck, out).exit_code == 0
    # the right shape, wrong orientation: square per-rank scale blocks would pass a shape check alone
    bad = _tamper(out, tmp_path / "bad", lambda t: t.__setitem__(
        exp + "w2_weight_packed", t[exp + "w2_weight_packed"].flip(2).contiguous()))
    res = invoke("verify", ck, bad)
    assert res.exit_code == 1 and f"{exp}w2_weight_packed: expert 0: differs from" in " ".join(res.output.split())


def test_mixtral_before_0_32_is_refused_where_vllm_would_not_quantize_its_experts(make_ckpt, tmp_path):
    """Before 0.32.0 vLLM looks up expert 0's scheme as gate_proj/up_proj/down_proj; the demo's
    config targets Mixtral's w1/w3/w2 by name, so vLLM would build unquantized experts."""
    res = CliRunner().invoke(cli, ["repack", str(make_ckpt(arch="mixtral")), "--tp", "2", "--layout", "vllm",
                                   "--vllm", "0.31.0", "-o", str(tmp_path / "o")])
    assert res.exit_code == 1 and one_line(res.stderr), res.output
    assert "vLLM 0.31.0 looks up expert 0's scheme under gate_proj/up_proj/down_proj" in res.stderr


def test_mla_on_a_release_outside_the_contract_is_refused_naming_both(make_ckpt, tmp_path):
    res = CliRunner().invoke(cli, ["repack", str(make_ckpt(arch="kimi_k2")), "--tp", "2", "--layout", "vllm",
                                   "--vllm", "0.27.1", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and one_line(res.stderr), res.output
    assert "vLLM 0.27.1 with architecture kimi_k2 has no known sharded_state contract" in res.stderr


def test_act_order_group_is_refused_in_one_line(make_ckpt, tmp_path):
    ck = make_ckpt(actorder="group")
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", "0.29.0",
                                   "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and one_line(res.stderr), res.output
    assert "actorder 'group'" in res.stderr and "--layout marlin" in res.stderr
    assert "_w2_scale_sharding" in res.stderr


def _refusal(ck, tmp_path, *args):
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", "0.32.0",
                                   "-o", str(tmp_path / "o"), *args])
    assert res.exit_code == 2 and one_line(res.stderr), res.output
    assert not (tmp_path / "o").exists()
    return res.stderr


def test_kv_cache_scheme_refusal_names_the_attention_scales_vllm_adds(make_ckpt, tmp_path):
    import json
    import shutil

    ck = tmp_path / "kv"
    shutil.copytree(make_ckpt(), ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "dynamic": False, "symmetric": True}
    (ck / "config.json").write_text(json.dumps(cfg))
    err = _refusal(ck, tmp_path)
    assert "k_scale, v_scale" in err and "BaseKVCacheMethod.create_weights" in err


def test_mixed_precision_experts_refusal_names_expert_0s_scheme(make_ckpt, tmp_path):
    err = _refusal(make_ckpt(mixed="expert", num_bits=4), tmp_path)
    assert "expert 0's scheme" in err and "get_moe_method" in err


def test_mtp_layers_refusal_names_the_draft_models_load(make_ckpt):
    import dataclasses

    from wna16ctl.errors import UsageError
    from wna16ctl.planning.vllm_state import check_supported
    from wna16ctl.sources import open_checkpoint

    ck = open_checkpoint(make_ckpt())
    with_mtp = dataclasses.replace(ck, mtp_layers=list(ck.layers))
    with pytest.raises(UsageError) as e:
        check_supported(with_mtp, "0.32.0")
    assert "\n" not in str(e.value) and "ShardedStateLoader.load_weights" in str(e.value)


def test_unknown_architecture_is_refused_naming_release_and_architecture(make_ckpt, tmp_path, monkeypatch):
    from wna16ctl.planning import rules

    # a pair outside the contract (the table is edited here so the test does not depend on which
    # pairs the conformance has confirmed)
    monkeypatch.setitem(rules.VLLM_STATE_SUPPORT, "deepseek_v3", ("0.32.0",))
    res = CliRunner().invoke(cli, ["repack", str(make_ckpt(arch="deepseek_v3")), "--tp", "2",
                                                   "--layout", "vllm", "--vllm", "0.33.0", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and one_line(res.stderr)
    assert "vLLM 0.33.0 with architecture deepseek_v3 has no known sharded_state contract" in res.stderr


def test_python_api_writes_and_verifies_the_vllm_layout(make_ckpt, tmp_path):
    import wna16ctl

    ck = make_ckpt()
    plan = wna16ctl.repack(ck, None, 2, layout="vllm", vllm="0.33.0", dry_run=True)
    assert len(plan.keys[0]) == 49
    result = wna16ctl.repack(ck, tmp_path / "o", 2, layout="vllm", vllm="0.33.0")
    assert isinstance(result, wna16ctl.RepackResult)  # one result type, whatever the layout
    assert result.manifest["serve"].endswith("--load-format sharded_state --tensor-parallel-size 2")
    assert [s.serve for s in result.next_steps] == [result.manifest["serve"]]
    assert result.to_json()["next_steps"][0]["layout"] == "vllm" and result.files_written == 2
    report = wna16ctl.verify(ck, tmp_path / "o")
    assert report.passed and report.layout_state.tensors_round_tripped == 98
    assert report.to_json()["passed"] and [s.serve for s in report.next_steps] == [result.manifest["serve"]]


@pytest.mark.parametrize("what,change,failed,not_run", [
    ("missing key", lambda t: t.pop(_EXP + "w2_weight_scale"), "manifest", "round_trip"),
    ("wrong value", lambda t: t[_EXP + "w13_weight_packed"].__setitem__((3, 0, 0), 12345), "round_trip", None),
])
def test_verify_gives_one_report_type_whatever_the_layout(q3_tp2, tmp_path, what, change, failed, not_run):
    """`wna16ctl.verify` of a --layout vllm output is a VerifyReport like every layout's: the contract
    is its manifest check, the tensors its round trip, the numerics not run (not required)."""
    import wna16ctl

    ck, out, _ = q3_tp2
    good = wna16ctl.verify(ck, out)
    assert isinstance(good, wna16ctl.VerifyReport)
    assert good.passed and not good.partial and good.next_steps  # the documented `assert report.passed`
    assert [(c.name, c.status, c.required) for c in good.checks] == [
        ("manifest", "pass", True), ("round_trip", "pass", True), ("numerics", "not run", False)]
    bad = wna16ctl.verify(ck, _tamper(out, tmp_path / "bad", change))
    assert isinstance(bad, wna16ctl.VerifyReport) and not bad.passed and bad.next_steps == []
    assert bad.check(failed).status == "FAIL" and {f.check for f in bad.findings} == {failed}
    if not_run:
        assert bad.check(not_run).status == "not run"
    cli = invoke("verify", ck, tmp_path / "bad", "--json")
    assert cli.exit_code == 1 and json.loads(cli.stdout) == bad.to_json()  # to_json() is `verify --json`
    for flag in ("--layers", "--experts"):
        refused = invoke("verify", ck, out, flag, "0")
        assert refused.exit_code == 2 and f"{flag} does not apply to a --layout vllm output" in refused.output


def test_inspect_says_how_to_serve_pre_sharded(make_ckpt):
    ck = make_ckpt()
    res = invoke("inspect", ck, "--tp", "1,2", "--vllm", "0.32.0", "--json")
    step = json.loads(res.stdout)["next_steps"][1]
    out = ck.parent / f"{ck.name}-vllm-tp2"  # a sibling of the checkpoint
    assert step["repack"] == f"wna16ctl repack {ck} --tp 2 --layout vllm --vllm 0.32.0 --gpu sm90 -o {out}"
    assert step["serve"] == f"vllm serve {out} --load-format sharded_state --tensor-parallel-size 2"
    # the commands are broken with a trailing backslash at the console's width: joined again here
    older = " ".join(invoke("inspect", ck, "--tp", "1", "--vllm", "0.29.0").output.split()).replace(" \\ ", " ")
    assert "--layout vllm --vllm 0.29.0" in older  # every release has a contract for Qwen3-MoE
    # at TP 2 0.29.0's Marlin processing permutes the w13 scales wrongly: no serving advice then
    hazard = " ".join(invoke("inspect", ck, "--tp", "2", "--vllm", "0.29.0").output.split())
    assert "outputs would be wrong" in hazard and "--layout vllm" not in hazard


def test_vllm_layout_json_keys_are_documented(make_ckpt, tmp_path):
    from tests.test_json_docs import documented

    ck = make_ckpt()
    doc = documented("repack-json.md")
    run = json.loads(invoke("repack", ck, "--tp", 2, "--layout", "vllm", "-o", tmp_path / "o", "--json").stdout)
    dry = json.loads(invoke("repack", ck, "--tp", 2, "--layout", "vllm", "--dry-run", "--json").stdout)
    for obj in (run, run["ranks"][0], dry, dry["ranks"][0]):
        assert set(obj) <= doc, set(obj) - doc
    report = json.loads(invoke("verify", ck, tmp_path / "o", "--json").stdout)
    assert set(report) <= documented("verify-json.md")
