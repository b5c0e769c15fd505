"""`wna16ctl inspect` end to end on checkpoints written by compressed-tensors (and hand-built ones
for shapes the library refuses): the spec's acceptance tables through the JSON output."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import ACT_ORDER_RELEASE
from tests.rawckpt import write_raw_checkpoint
from tests.planning.test_moe import PAD_TABLE, W2_TABLE
from wna16ctl.cli import cli

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def inspect_json(path: Path, *args: str) -> tuple[int, dict]:
    release = [] if "--vllm" in args else ["--vllm", ACT_ORDER_RELEASE]  # the rules these tables were written for
    res = CliRunner().invoke(cli, ["inspect", str(path), "--json", *release, *args])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def plan_at(doc: dict, tp: int, layer: int = 0) -> dict:
    return next(p for p in doc["layers"][layer]["plans"] if p["tp"] == tp)


@pytest.mark.parametrize("actorder,gs,i_p,i,expected", [r for r in W2_TABLE if r[1] != -1])
def test_w2_table_through_inspect(make_ckpt, actorder, gs, i_p, i, expected):
    ck = make_ckpt(hidden_size=256, intermediate_size=i, group_size=gs, actorder=actorder, **SMALL)
    _, doc = inspect_json(ck, "--tp", str(i // i_p))
    w2 = plan_at(doc, i // i_p)["w2_scale_sharding"]
    assert (w2["load_full_w2"], w2["w2_scales_size"], w2["is_k_full"]) == expected
    assert doc["layers"][0]["scheme"]["actorder"] == actorder


def test_w2_table_channel_with_group_actorder(make_ckpt, tmp_path):
    # Row 3 (actorder group, channel-wise): compressed-tensors cannot write it; edit a channel config.
    src = make_ckpt(hidden_size=256, intermediate_size=128, group_size=-1, **SMALL)
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    cfg = json.loads((ck / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    (ck / "config.json").write_text(json.dumps(cfg))
    # the function's table row holds (tests/planning/test_moe.py), but no release gets that far: the
    # compressed-tensors 0.17.0 they pin refuses act-order on a channel scheme while the config is parsed
    code, doc = inspect_json(ck, "--tp", "2")
    p = plan_at(doc, 2)
    assert code == 1 and p["failure_stage"] == "config" and "group activation ordering" in p["errors"][0]


PAD_CASES = [(i, gs) for i, row in PAD_TABLE.items() for gs, v in row.items() if v is not None]


@pytest.mark.parametrize("i,gs", PAD_CASES)
def test_padded_intermediate_through_inspect(make_ckpt, i, gs):
    ck = make_ckpt(hidden_size=128, intermediate_size=i, group_size=gs, **SMALL)
    _, doc = inspect_json(ck, "--tp", "1")
    p = plan_at(doc, 1)
    assert p["backend"] == "marlin"
    assert p["padded_intermediate"] == PAD_TABLE[i][gs]
    if PAD_TABLE[i][gs] != i:
        assert any("tile padding" in h for h in p["hazards"])


@pytest.mark.parametrize("i,gs", [(96, 64), (100, 32), (176, 128), (64, 128)])
def test_padded_intermediate_skip_cells_are_rejected(tmp_path, i, gs):
    # "skip" cells: the group size does not divide I; the library cannot write them.
    ck = write_raw_checkpoint(tmp_path / "ck", hidden=256, intermediate=i, group_size=gs)
    code, doc = inspect_json(ck, "--tp", "1")
    p = plan_at(doc, 1)
    assert code == 1 and not doc["loadable"]
    assert "marlin" in p["rejected"] and p["padded_intermediate"] is None
    assert any("divisible by group_size" in e for e in p["errors"])


# spec §9.6 gate cases: (H, I, gs, allow_tile_padding) -> Marlin supported.  allow_tile_padding is
# `not act-order`, so pad=False cases are act-order checkpoints.
@pytest.mark.parametrize("h,i,gs,pad,ok", [
    (2560, 640, 128, False, True), (2560, 640, 128, True, True),
    (2560, 32, 32, True, True), (2560, 32, 32, False, False),
    (2560, 640, -1, True, True),
])
def test_marlin_gate_through_inspect(make_ckpt, h, i, gs, pad, ok):
    ck = make_ckpt(hidden_size=h, intermediate_size=i, group_size=gs,
                   actorder=None if pad else "group", **SMALL)
    _, doc = inspect_json(ck, "--tp", "1")
    p = plan_at(doc, 1)
    assert (p["backend"] == "marlin") == ok, p
    if not ok:
        assert p["rejected"]["marlin"].startswith("Marlin not supported for this layer")


@pytest.mark.parametrize("h,i,gs,pad", [(2560, 640, 96, False), (2570, 640, 128, True), (2560, 640, -1, False),
                                        (2560, 320, 128, False), (2560, 320, 128, True)])
def test_marlin_gate_hand_built(tmp_path, h, i, gs, pad):
    ck = write_raw_checkpoint(tmp_path / "ck", hidden=h, intermediate=i, group_size=gs,
                              actorder=None if pad else "group")
    _, doc = inspect_json(ck, "--tp", "1")
    p = plan_at(doc, 1)
    if gs == -1 and not pad:  # act-order on a channel scheme: compressed-tensors refuses it at config parse
        assert p["failure_stage"] == "config", p
        return
    expected_ok = (h, i, gs) == (2560, 640, -1)
    assert (p["backend"] == "marlin") == expected_ok, p


def test_demo_json_schema_and_exit_codes(make_ckpt):
    ck = make_ckpt()
    code, doc = inspect_json(ck, "--tp", "1,2,4")
    assert code == 1  # I=256, g128: TP 4 gives I_p 64, which splits groups
    assert doc["loadable"] is False
    layer = doc["layers"][0]
    assert layer["name"].endswith("mlp.experts") and layer["num_experts"] == 8
    assert layer["scheme"] == {"num_bits": 4, "group_size": 128, "symmetric": True, "strategy": "group",
                               "actorder": None, "format": "pack-quantized"}
    keys = {"tp", "ep", "intermediate_size_per_partition", "padded_intermediate", "backend", "rejected",
            "w2_scale_sharding", "errors", "hazards", "loadable"}
    for p in layer["plans"]:
        assert keys <= set(p)
    assert [p["loadable"] for p in layer["plans"]] == [True, True, False]
    tp4 = plan_at(doc, 4)
    assert any("Scale groups would otherwise cross TP shard boundaries" in e for e in tp4["errors"])
    code, doc = inspect_json(ck, "--tp", "1,2")
    # both load, but at TP 2 (I_p 128 <= group 128) this release permutes the w13 scales as
    # channel-wise (vllm PR #50196): a correctness hazard, so not ok and exit 1
    assert code == 1 and doc["loadable"] and not doc["ok"] and doc["summary"]["wrong_outputs"] == [2]
    code, doc = inspect_json(ck, "--tp", "1")
    assert code == 0 and doc["loadable"] and doc["ok"]


def test_expert_parallel_keeps_full_intermediate(make_ckpt):
    _, doc = inspect_json(make_ckpt(), "--tp", "4", "--ep")
    p = plan_at(doc, 4)
    assert p["ep"] and p["intermediate_size_per_partition"] == 256 and p["loadable"]
    assert p["local_experts"] == [2, 2, 2, 2]


def test_hazards(make_ckpt, tmp_path):
    # grouped int8 (PR #52002): refused by 0.27.0-0.28.0, which the hazards of a later release name
    ck = make_ckpt(num_bits=8, group_size=64, actorder="static", **SMALL)
    _, doc = inspect_json(ck, "--tp", "2")
    assert plan_at(doc, 2)["loadable"]
    assert any("0.27.0–0.28.0" in h and "52002" in h for h in plan_at(doc, 2)["hazards"])
    code, doc = inspect_json(ck, "--tp", "2", "--vllm", "0.27.1")
    assert code == 1 and plan_at(doc, 2)["failure_rule"] == "int8 grouped"
    # w13 scale permutation quirk when I_p == group_size (PR #50196), where vLLM runs Marlin
    _, doc = inspect_json(make_ckpt(hidden_size=256, intermediate_size=256, group_size=128, **SMALL), "--tp", "2")
    assert any("50196" in h for h in plan_at(doc, 2)["hazards"])
    # channel-wise with group_size null (PR #53163): a TypeError until 0.30.0
    code, doc = inspect_json(make_ckpt(group_size=-1, channel_group_size_null=True, **SMALL), "--tp", "1")
    p = plan_at(doc, 1)
    assert code == 1 and p["failure_stage"] == "oracle" and "53163" in p["errors"][0]
    code, doc = inspect_json(make_ckpt(group_size=-1, channel_group_size_null=True, **SMALL), "--tp", "1",
                             "--vllm", "0.30.0")
    assert code == 0 and plan_at(doc, 1)["backend"] == "marlin"


def test_mixed_precision(make_ckpt):
    code, doc = inspect_json(make_ckpt(mixed="expert", num_layers=1), "--tp", "1")
    p = plan_at(doc, 1)
    assert code == 1 and any("per-expert mixed precision" in e for e in p["errors"])
    assert any("expert 0" in h for h in p["hazards"])
    code, doc = inspect_json(make_ckpt(mixed="layer", num_layers=2), "--tp", "1")
    assert code == 0
    assert [lay["scheme"]["num_bits"] for lay in doc["layers"]] == [4, 8]


def test_asymmetric_int8_has_no_backend(make_ckpt):
    code, doc = inspect_json(make_ckpt(num_bits=8, group_size=-1, symmetric=False, **SMALL), "--tp", "1")
    p = plan_at(doc, 1)
    assert code == 1 and p["backend"] is None
    assert p["failure_rule"] == "no backend"
    for backend in ("marlin", "triton", "humming"):
        assert "uint8 generic group with zero points" in p["rejected"][backend]


def test_human_table(make_ckpt):
    res = CliRunner().invoke(cli, ["inspect", str(make_ckpt()), "--tp", "1,2,4"])
    assert res.exit_code == 1
    assert "marlin" in res.stdout and "layers 0-1" in res.stdout and "does not load" in res.stdout


# ---- bad input: one line on stderr, exit 2, no traceback -------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True, timeout=120)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shards(ck: Path) -> list[Path]:
    return sorted(ck.glob("*.safetensors"))


def _expect_bad(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error:"), res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def test_bad_missing_shard(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    victim = _shards(ck)[-1]
    victim.unlink()
    _expect_bad(_run_cli("inspect", str(ck)), victim.name, "missing")


def test_bad_truncated_header(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    victim = _shards(ck)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:100])
    _expect_bad(_run_cli("inspect", str(ck)), victim.name, "truncated")


def test_bad_corrupt_header_json(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    victim = _shards(ck)[0]
    data = bytearray(victim.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n // 2] = ord("{")
    victim.write_bytes(bytes(data))
    _expect_bad(_run_cli("inspect", str(ck)), victim.name)


def test_bad_truncated_data(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    victim = _shards(ck)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    _expect_bad(_run_cli("inspect", str(ck)), victim.name, "truncated")


def test_bad_index_outside_checkpoint(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    idx = ck / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "../elsewhere.safetensors"
    idx.write_text(json.dumps(doc))
    _expect_bad(_run_cli("inspect", str(ck)), "outside the checkpoint directory")


def test_bad_missing_tensor(make_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    ck = _copy(make_ckpt(), tmp_path / "ck")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    name = next(n for n in idx["weight_map"] if n.endswith("experts.3.down_proj.weight_scale"))
    shard = ck / idx["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    del idx["weight_map"][name]
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    _expect_bad(_run_cli("inspect", str(ck)), name)


def test_bad_shape_contradicts_config(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["moe_intermediate_size"] = 512
    (ck / "config.json").write_text(json.dumps(cfg))
    _expect_bad(_run_cli("inspect", str(ck)), "config.json", "512")


def test_bad_group_size_contradicts_tensors(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"]["group_size"] = 64
    (ck / "config.json").write_text(json.dumps(cfg))
    _expect_bad(_run_cli("inspect", str(ck)), "weight_scale", "contradict")


def test_bad_unknown_format(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["format"] = "frobnicated"
    for g in cfg["quantization_config"]["config_groups"].values():
        g["format"] = "frobnicated"
    (ck / "config.json").write_text(json.dumps(cfg))
    _expect_bad(_run_cli("inspect", str(ck)), "frobnicated")


def test_bad_not_compressed_tensors(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (ck / "config.json").write_text(json.dumps(cfg))
    _expect_bad(_run_cli("inspect", str(ck)), "gptq")


def test_bad_not_a_checkpoint(tmp_path):
    _expect_bad(_run_cli("inspect", str(tmp_path / "nope")), "nope")


def test_usage_error_exit_2(make_ckpt):
    res = _run_cli("inspect", str(make_ckpt()), "--tp", "two")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_debug_shows_traceback(tmp_path):
    res = _run_cli("--debug", "inspect", str(tmp_path / "nope"))
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_hugging_face_cache_snapshot_with_symlinked_shards(make_ckpt, tmp_path):
    # hub layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    src = make_ckpt()
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"h{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"h{i}")
    code, doc = inspect_json(snap, "--tp", "1")
    assert code == 0 and doc["layers"][0]["num_experts"] == 8


def test_non_expert_extent_contradicting_its_shape_is_bad_input(make_ckpt, tmp_path):
    ck = _copy(make_ckpt(), tmp_path / "ck")
    for shard in _shards(ck):
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        name = "model.layers.0.input_layernorm.weight"
        if name in header:
            header[name]["shape"] = [header[name]["shape"][0] // 2]
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            shard.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
    _expect_bad(_run_cli("inspect", str(ck)), "input_layernorm", "corrupt")


@pytest.mark.parametrize("arch, key", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts"),
                                       ("deepseek_v3", "n_routed_experts"), ("qwen3_moe", "num_hidden_layers"),
                                       ("qwen3_moe", "num_attention_heads")])
def test_a_missing_shape_key_is_refused_not_read_from_the_tensors(make_ckpt, tmp_path, arch, key):
    """vLLM builds the model config.json describes, with transformers' defaults for what it leaves
    out (128 experts for Qwen3-MoE): a missing key of the model's shape is bad input naming the
    key (under the family's own name), for inspect and repack alike, as a missing hidden_size is."""
    src = make_ckpt(arch=arch, **{**SMALL, "num_layers": 2 if arch == "deepseek_v3" else 1})
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    config = json.loads((ck / "config.json").read_text())
    held = config.pop(key)
    (ck / "config.json").write_text(json.dumps(config))
    for args in (["inspect", str(ck), "--tp", "1"], ["repack", str(ck), "--tp", "1", "-o", str(tmp_path / "o")]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        (line,) = res.stderr.splitlines()
        assert line.startswith(f"error: {ck / 'config.json'}: {key} is missing"), line
        if "experts" in key:
            assert f'add "{key}": {held}' in line, line
    assert not (tmp_path / "o").exists()


def _qwen3_30b_headers(root: Path) -> Path:
    """A header-only Qwen3-30B-A3B W4A16 (48 layers, the published sizes and positions)."""
    from tests import modelckpt as m

    config = dict(m.qwen3_30b_a3b(layers=48), max_position_embeddings=40960, norm_topk_prob=True)
    return m.write(root / "Qwen3-30B-A3B-W4A16", config, m.qwen3_moe(config, config["quantization_config"]))


def test_will_it_fit_on_an_a100_40(tmp_path):
    """Per TP size that loads: exact weights and KV bytes per token, and how many concurrent 32k
    requests the KV budget holds once the estimated rest of a start is taken (a range)."""
    ck = _qwen3_30b_headers(tmp_path)
    args = ["--tp", "1,2,4", "--gpu", "a100-40", "--max-model-len", "32768", "--vllm", "0.33.0"]
    code, doc = inspect_json(ck, *args)
    fits = {f["tp"]: f for f in doc["memory"]}
    assert sorted(fits) == [1, 2]  # TP 4: 192 intermediate rows per rank do not hold whole groups of 128
    for tp, f in fits.items():
        # 48 layers x K and V x 4 KV heads / TP x 128 x bf16
        assert f["kv_bytes_per_token"] == {"value": 48 * 2 * (4 // tp) * 128 * 2, "unit": "bytes", "exact": True}
        assert f["gpu_memory"]["value"] == 40 << 30 and f["weights_as_built"]["exact"] and f["fits"] == "yes"
        rest = f["rest_of_start"]["value"]
        assert rest[0] < rest[1] and f["rest_of_start"]["exact"] is False
        budgets = [math.ceil((40 << 30) * 0.9) - f["weights"]["value"] - r for r in reversed(rest)]
        assert f["kv_budget"]["value"] == budgets and f["kv_budget"]["exact"] is False
        per_seq = 32768 * f["kv_bytes_per_token"]["value"]
        assert f["max_concurrency"]["value"] == [b // per_seq for b in budgets]
    assert fits[1]["max_concurrency"]["value"][0] >= 1 and fits[2]["max_concurrency"]["value"][0] > 2 * fits[1]["max_concurrency"]["value"][0]
    # the table wraps its notes at the terminal width after the checkpoint's path: words, not lines
    text = " ".join(_run_cli("inspect", str(ck), *args).stdout.split())
    assert "concurrent 32768-token requests" in text and "TP 2: weights" in text


def test_will_it_fit_bad_input(tmp_path):
    ck = _qwen3_30b_headers(tmp_path)
    res = _run_cli("inspect", str(ck), "--tp", "1", "--gpu-mem", "lots")
    _expect_bad(res, "--gpu-mem", "not a size")
    assert len(res.stderr.strip().splitlines()) == 1
    res = _run_cli("inspect", str(ck), "--tp", "1", "--gpu", "h100", "--max-model-len", "99999")
    _expect_bad(res, "--max-model-len 99999", "40960 positions")
    assert len(res.stderr.strip().splitlines()) == 1
    res = _run_cli("inspect", str(ck), "--tp", "1", "--gpu", "a100-41")
    assert res.returncode == 2 and "a100-40" in res.stderr and "h200" in res.stderr and "Traceback" not in res.stderr


def test_will_it_fit_is_not_judged_where_the_kv_cache_size_is_not_known(tmp_path):
    """A DeepSeek-V3-architecture config without the MLA sizes (the bench's synthetic Kimi-K2
    headers): the KV bytes per token cannot be computed, so the fit is reported as not judged with
    the reason, never as fitting."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import synthetic_headers

    ck = synthetic_headers.write(tmp_path / "kimi", layers=3, experts=16, shards=2)
    code, doc = inspect_json(ck, "--tp", "8", "--gpu", "h200")
    (f,) = doc["memory"]
    assert f["fits"] == "not_judged" and "kv_lora_rank" in f["not_judged"], f
    assert f["kv_tokens"]["value"] is None and f["max_concurrency"]["value"] is None and f["weights"]["value"] > 0
    text = _run_cli("inspect", str(ck), "--tp", "8", "--gpu", "h200").stdout
    assert "not judged" in text and ": fits" not in text


def test_will_it_fit_largest_max_model_len_is_capped_at_the_positions(tmp_path):
    """On a GPU with room for far more than the model's 40960 positions, the largest --max-model-len
    is the positions, not what the KV budget would hold."""
    ck = _qwen3_30b_headers(tmp_path)
    code, doc = inspect_json(ck, "--tp", "2", "--gpu", "b200", "--max-model-len", "1024", "--vllm", "0.33.0")
    (f,) = doc["memory"]
    assert f["kv_tokens"]["value"][0] > 40960 and f["largest_max_model_len"]["value"] == [40960, 40960]


def test_will_it_fit_weights_after_processing(tmp_path):
    """At 0.27.1 on an A100 (108 SMs) Marlin's processing frees each layer's four int32 g_idx tensors
    (E x (H + I/TP)) and keeps one workspace per layer (108 x 4 int32); at 0.33.0 neither, and
    group-32 experts at TP 8 are tile-padded from 96 to 128 rows."""
    from tests import modelckpt as m

    ck = _qwen3_30b_headers(tmp_path)
    code, doc = inspect_json(ck, "--tp", "2", "--gpu", "a100-40", "--vllm", "0.27.1")
    (f,) = doc["memory"]
    causes = f["weights_processing"]["by_cause"]
    assert causes == {"g_idx_freed": -48 * 128 * 2 * 4 * (2048 + 384), "workspace": 48 * 108 * 4 * 4}
    assert f["weights"]["value"] == f["weights_as_built"]["value"] + sum(causes.values())
    assert f["weights"]["stage"] == "after_processing" and f["weights_as_built"]["stage"] == "as_built"
    config = dict(m.qwen3_30b_a3b(layers=2, group_size=32), max_position_embeddings=40960)
    g32 = m.write(tmp_path / "g32", config, m.qwen3_moe(config, config["quantization_config"]))
    code, doc = inspect_json(g32, "--tp", "8", "--gpu", "sm80", "--gpu-mem", "80GiB", "--vllm", "0.33.0")
    (f,) = doc["memory"]
    # per expert: w13 2 x 32 rows x 2048/8 words, w2 2048 x 32/8 words (int32), w13 scales 2 x 32 x 64 groups,
    # w2 scales 2048 x 1 group (bf16); 128 experts, 2 layers
    per = 4 * 2 * 32 * 256 + 4 * 2048 * 4 + 2 * 2 * 32 * 64 + 2 * 2048 * 1
    assert f["weights_processing"]["by_cause"] == {"tile_padding": 2 * 128 * per}


@pytest.mark.parametrize("command", [["inspect"], ["pad", "--tp", "4", "--dry-run"]])
def test_an_unknown_gpu_name_is_one_line_listing_the_known_ones(tmp_path, command):
    ck = _qwen3_30b_headers(tmp_path)
    res = _run_cli(command[0], str(ck), *command[1:], "--gpu", "a100-41")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--gpu a100-41" in res.stderr and "a100-40" in res.stderr and "sm90" in res.stderr and "h200" in res.stderr


def test_suggest_ranks_ep_against_pad_by_memory_on_an_a100_40(tmp_path):
    """Qwen3-30B-A3B W4A16 at TP 4 does not load (192 rows per rank, groups of 128); with an A100-40
    and 32k requests --suggest judges EP, pad and the other TP sizes by their memory: EP keeps the
    checkpoint's bytes, so its ranks hold more KV tokens than the padded checkpoint's and it ranks
    first; each figure is the one inspect gives that deployment."""
    ck = _qwen3_30b_headers(tmp_path)
    args = ["--gpu", "a100-40", "--max-model-len", "32768", "--vllm", "0.33.0"]
    code, doc = inspect_json(ck, "--tp", "4", "--suggest", *args)
    judged = [s for s in doc["suggestions"] if s["memory"] is not None]
    kinds = [(s["kind"], s["tp"]) for s in judged]
    assert kinds[:2] == [("ep", 4), ("pad", 4)] and {k for k, _ in kinds} == {"ep", "pad", "tp"}, kinds
    ep, pad = judged[0]["memory"], judged[1]["memory"]
    assert ep["fits"] == pad["fits"] == "yes"
    assert ep["kv_tokens"]["value"][0] > pad["kv_tokens"]["value"][0] and ep["weights"]["value"] < pad["weights"]["value"]
    assert "concurrent 32768-token requests" in judged[0]["change"]
    _, doc_ep = inspect_json(ck, "--tp", "4", "--ep", *args)
    (f,) = doc_ep["memory"]
    assert ep["kv_tokens"] == f["kv_tokens"] and ep["weights"] == f["weights"]
    # ranked by KV capacity among themselves: fewer ranks hold fewer tokens each
    tokens = [s["memory"]["kv_tokens"]["value"][0] for s in judged]
    assert tokens == sorted(tokens, reverse=True)


def test_serve_lines_carry_the_memory_options_that_fit(tmp_path):
    """A serve line that would fail on memory carries the --gpu-memory-utilization or
    --max-model-len under which the start fits (at the high end of the rest-of-a-start estimate),
    or says that nothing fits on that GPU."""
    ck = _qwen3_30b_headers(tmp_path)
    gib = 1 << 30

    def step(*args: str) -> tuple[dict, dict]:
        _, doc = inspect_json(ck, "--tp", "1", "--vllm", "0.33.0", *args)
        return doc["memory"][0], doc["next_steps"][0]

    fit, s = step("--gpu", "h100")  # fits as asked: vLLM's defaults, nothing added
    assert fit["fits"] == "yes" and "--max-model-len" not in s["serve"] and "memory" not in s["why"]
    fit, s = step("--gpu-mem", "23GiB")  # 40960 tokens fit once the share is raised
    weights, per_token = fit["weights"]["value"], fit["kv_bytes_per_token"]["value"]
    high = fit["rest_of_start"]["value"][1]
    util = -(-(weights + high + 40960 * per_token) * 100 // (23 * gib)) / 100
    assert fit["fits"] != "yes" and util <= 0.95
    assert s["serve"].endswith(f"--gpu-memory-utilization {util:g}") and "--max-model-len" not in s["serve"]
    assert math.ceil(23 * gib * util) - weights - high >= 40960 * per_token
    fit, s = step("--gpu-mem", "22GiB")  # even 0.95 of 22 GiB does not hold 40960 tokens: a shorter length
    length = int(s["serve"].split("--max-model-len ")[1])
    assert 0 < length < 40960 and length % 16 == 0 and "--gpu-memory-utilization" not in s["serve"]
    high = fit["rest_of_start"]["value"][1]
    assert math.ceil(22 * gib * 0.9) - weights - high >= length * per_token
    assert math.ceil(22 * gib * 0.9) - weights - high < (length + 16) * per_token
    assert f"--max-model-len {length} does" in s["why"]
    fit, s = step("--gpu-mem", "16GiB")  # the weights alone do not fit
    assert "nothing fits on this GPU at TP 1" in s["why"] and "--max-model-len" not in s["serve"]
    text = _run_cli("inspect", str(ck), "--tp", "1", "--vllm", "0.33.0", "--gpu-mem", "22GiB").stdout
    assert f"--max-model-len {length}" in text
