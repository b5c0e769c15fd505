"""`wna16ctl pad`: the padded checkpoint dequantises to the original plus exact zeros, in every
stored form, and computes the same MoE block output; the sizes are the planner's smallest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import wna16ctl
from wna16ctl.demo import library_dequantize
from wna16ctl.errors import NotLoadable, UsageError
from wna16ctl.verification.engine_reference import dequantized_expert_weights

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=2)
WIDER = {**SMALL, "hidden_size": 256}  # 4 attention heads: TP 4 splits them


def _role(name: str) -> str:
    leaf = name.removesuffix(".weight").rsplit(".", 1)[1]
    return {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}[leaf]


def assert_zero_padded(orig: dict[str, torch.Tensor], padded: dict[str, torch.Tensor],
                       widths: dict[str, tuple[int, int]]) -> int:
    """Every padded weight is the original plus exact zeros; returns how many were padded.
    `widths`: a name fragment -> (original, padded intermediate size)."""
    assert set(orig) == set(padded)
    grown = 0
    for name, w in orig.items():
        p = padded[name]
        if p.shape == w.shape:
            assert torch.equal(p, w), name
            continue
        i, i_p = next(v for frag, v in widths.items() if frag in name)
        if _role(name) == "down":
            assert p.shape == (w.shape[0], i_p) and w.shape[1] == i, name
            kept, added = p[:, :i], p[:, i:]
        else:
            assert p.shape == (i_p, w.shape[1]) and w.shape[0] == i, name
            kept, added = p[:i], p[i:]
        assert torch.equal(kept, w), name
        assert torch.count_nonzero(added) == 0, name
        grown += 1
    return grown


def moe_block(weights: dict[str, torch.Tensor], prefix: str, experts: int, x: torch.Tensor, names=("gate_proj", "up_proj", "down_proj")) -> torch.Tensor:
    """Every expert's SwiGLU MLP of the layer on x, summed with fixed weights (float64)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    g, u, d = names
    for e in range(experts):
        w = lambda n: weights[f"{prefix}.{e}.{n}.weight"].double()  # noqa: E731 - one weight of this expert as float64, for the lines below
        h = torch.nn.functional.silu(x @ w(g).T) * (x @ w(u).T)
        out += (e + 1) / experts * (h @ w(d).T)
    return out


FORMS = {
    "int4 sym group": dict(),
    "int4 asym group (zero points)": dict(symmetric=False),
    "int8 sym group": dict(num_bits=8),
    "int8 asym group (zero points)": dict(num_bits=8, symmetric=False),  # no vLLM backend: padded with --to
    "int4 act-order static": dict(actorder="static"),
    "int4 act-order weight": dict(actorder="weight"),
    "int4 act-order group (g_idx)": dict(actorder="group"),
    "int4 asym act-order group": dict(actorder="group", symmetric=False),
    "int8 act-order group": dict(num_bits=8, actorder="group"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_padded_group_forms_are_the_original_plus_zeros(make_ckpt, tmp_path, form):
    src = make_ckpt(**SMALL, **FORMS[form])
    out = tmp_path / "p"
    if form.startswith("int8 asym"):
        with pytest.raises(NotLoadable, match="no backend"):  # what padding cannot fix, in one line
            wna16ctl.pad(src, out, tp=2, vllm="0.32.0")
        manifest = wna16ctl.pad(src, out, to=256)
    elif form == "int4 asym act-order group":  # no release's backends take it at TP 2: the math alone
        with pytest.raises(NotLoadable, match="actorder"):
            wna16ctl.pad(src, out, tp=2, vllm="0.29.0")
        manifest = wna16ctl.pad(src, out, to=256)
    else:  # act-order 'group' loads up to vLLM 0.29 (later releases refuse it at config parse)
        vllm = "0.29.0" if FORMS[form].get("actorder") == "group" else "0.32.0"
        if vllm != "0.32.0":
            with pytest.raises(NotLoadable, match="refuses its quantization_config"):
                wna16ctl.pad(src, out, tp=2, vllm="0.32.0")
        manifest = wna16ctl.pad(src, out, tp=2, vllm=vllm)
        # I = 128, group 128: 64 per rank is refused; the smallest that loads is 256
        assert manifest["padding"]["original"]["loads"] is False and manifest["padding"]["verdict"]["loads"] is True
    assert manifest["padding"]["fields"] == {"moe_intermediate_size": {"from": 128, "to": 256}}
    config = json.loads((out / "config.json").read_text())
    assert config["moe_intermediate_size"] == 256
    assert config["wna16ctl_padding"]["original"] == {"moe_intermediate_size": 128}
    assert config["quantization_config"] == json.loads((Path(src) / "config.json").read_text())["quantization_config"]
    # the library's own decompression of both checkpoints
    assert assert_zero_padded(library_dequantize(src), library_dequantize(out), {"experts": (128, 256)}) == 12
    # and the project's reference dequantisation (the one verify and e2e multiply by)
    orig, padded = dequantized_expert_weights(src), dequantized_expert_weights(out)
    assert_zero_padded(orig, padded, {"experts": (128, 256)})
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    prefix = "model.layers.0.mlp.experts"
    torch.testing.assert_close(moe_block(padded, prefix, 4, x), moe_block(orig, prefix, 4, x), rtol=1e-12, atol=1e-15)
    # the checkpoint is still one the planner reads, at the new size
    insp = wna16ctl.inspect(out, tp=2, vllm="0.29.0" if FORMS[form].get("actorder") == "group" else "0.32.0")
    assert insp.checkpoint.layers[0].intermediate_size == 256
    assert insp.loadable == (form not in ("int8 asym group (zero points)", "int4 asym act-order group"))


def test_padded_tensors_keep_every_original_code_and_add_the_zero_code(make_ckpt, tmp_path):
    from safetensors.torch import load_file

    from wna16ctl.layout.packing import unpack_codes

    src = make_ckpt(**SMALL, symmetric=False, actorder="group")
    wna16ctl.pad(src, tmp_path / "p", to=256)
    read = lambda d: {k: v for f in sorted(Path(d).glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731 - every tensor of a directory, for the lines below
    a, b = read(src), read(tmp_path / "p")
    m = "model.layers.0.mlp.experts.1"
    # gate: rows added, every added code 8 (signed 0), the added zero points the same code
    gate_a, gate_b = a[f"{m}.gate_proj.weight_packed"], b[f"{m}.gate_proj.weight_packed"]
    assert torch.equal(gate_b[:128], gate_a) and torch.all(unpack_codes(gate_b[128:], 4, dim=1) == 8)
    zp_b = unpack_codes(b[f"{m}.gate_proj.weight_zero_point"], 4, dim=0)
    assert torch.equal(zp_b[:128], unpack_codes(a[f"{m}.gate_proj.weight_zero_point"], 4, dim=0))
    assert torch.all(zp_b[128:] == 8)
    assert torch.equal(b[f"{m}.gate_proj.weight_g_idx"], a[f"{m}.gate_proj.weight_g_idx"])
    assert b[f"{m}.gate_proj.weight_shape"].tolist() == [256, 128]
    # down: one whole new group of columns, named by g_idx after the existing one
    d_a, d_b = a[f"{m}.down_proj.weight_packed"], b[f"{m}.down_proj.weight_packed"]
    assert torch.equal(d_b[:, :16], d_a) and torch.all(unpack_codes(d_b[:, 16:], 4, dim=1) == 8)
    assert b[f"{m}.down_proj.weight_scale"].shape == (128, 2)
    assert torch.equal(b[f"{m}.down_proj.weight_scale"][:, :1], a[f"{m}.down_proj.weight_scale"])
    assert torch.isfinite(b[f"{m}.down_proj.weight_scale"]).all()
    assert torch.equal(b[f"{m}.down_proj.weight_g_idx"][:128], a[f"{m}.down_proj.weight_g_idx"])
    assert torch.all(b[f"{m}.down_proj.weight_g_idx"][128:] == 1)
    assert b[f"{m}.down_proj.weight_shape"].tolist() == [128, 256]
    zp_d = b[f"{m}.down_proj.weight_zero_point"]
    assert torch.equal(zp_d[:, :1], a[f"{m}.down_proj.weight_zero_point"])
    assert torch.all(unpack_codes(zp_d[:, 1:], 4, dim=0) == 8)
    # every tensor that is not a padded projection's is copied byte for byte
    for name in a:
        if ".experts." not in name:
            assert torch.equal(a[name], b[name]), name


def test_channel_wise_pads_to_a_given_size(make_ckpt, tmp_path):
    src = make_ckpt(**SMALL, group_size=-1)
    # I = 128 loads at TP 1 as it is: nothing to pad unless a size is given
    with pytest.raises(UsageError, match="nothing to pad"):
        wna16ctl.pad(make_ckpt(**SMALL), tmp_path / "none", tp=1, vllm="0.32.0")
    assert not (tmp_path / "none").exists()
    with pytest.raises(UsageError, match="--to 100"):
        wna16ctl.pad(src, tmp_path / "bad", to=100)
    wna16ctl.pad(src, tmp_path / "p", to=192)
    assert assert_zero_padded(library_dequantize(src), library_dequantize(tmp_path / "p"), {"experts": (128, 192)}) == 12


def test_shared_experts_and_dense_mlp_are_padded_where_needed(make_ckpt, tmp_path):
    # Qwen2-MoE: routed I = 128, shared expert 256 (its own field); at TP 4 both need 512
    src = make_ckpt(arch="qwen2_moe", quantize_mlp=True, **WIDER)
    plan = wna16ctl.pad(src, None, tp=4, vllm="0.32.0", dry_run=True).to_json()
    assert plan["fields"] == {"moe_intermediate_size": {"from": 128, "to": 512},
                              "shared_expert_intermediate_size": {"from": 256, "to": 512}}
    wna16ctl.pad(src, tmp_path / "q", tp=4, vllm="0.32.0")
    n = assert_zero_padded(library_dequantize(src), library_dequantize(tmp_path / "q"),
                           {"shared_expert.": (256, 512), "experts.": (128, 512)})
    assert n == 12 + 3
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (512, 512)


def test_deepseek_shared_experts_follow_the_routed_size_and_dense_stays(make_ckpt, tmp_path):
    # DeepSeek-V3: shared experts are n_shared × moe_intermediate_size wide; the dense MLP (layer 0,
    # intermediate_size 256) splits over 2 ranks into whole groups and is left alone
    src = make_ckpt(arch="deepseek_v3", quantize_mlp=True, **{**WIDER, "num_layers": 2})
    plan = wna16ctl.pad(src, None, tp=2, vllm="0.32.0", dry_run=True).to_json()
    assert plan["fields"] == {"moe_intermediate_size": {"from": 128, "to": 256}}
    assert set(plan["padded"]) == {"routed", "shared"}
    wna16ctl.pad(src, tmp_path / "d", tp=2, vllm="0.32.0")
    n = assert_zero_padded(library_dequantize(src), library_dequantize(tmp_path / "d"),
                           {"shared_experts.": (128, 256), "experts.": (128, 256)})
    assert n == 12 + 3


def test_dense_mlp_is_padded_when_it_does_not_split(make_ckpt, tmp_path):
    # the dense MLP is 2 × 128 = 256 wide: at TP 4, 64 per rank is not a whole group of 128
    src = make_ckpt(arch="deepseek_v3", quantize_mlp=True, **{**WIDER, "num_layers": 2})
    plan = wna16ctl.pad(src, None, tp=4, vllm="0.32.0", dry_run=True).to_json()
    assert plan["fields"]["intermediate_size"] == {"from": 256, "to": 512}
    wna16ctl.pad(src, tmp_path / "d", tp=4, vllm="0.32.0")
    assert_zero_padded(library_dequantize(src), library_dequantize(tmp_path / "d"),
                       {"shared_experts.": (128, 512), "experts.": (128, 512), "layers.0.mlp.": (256, 512)})


def test_unquantized_base_is_padded_for_a_proposed_scheme(make_ckpt, tmp_path):
    from safetensors.torch import load_file

    from wna16ctl.verification.engine_reference import write_dequantized_checkpoint

    base = write_dequantized_checkpoint(make_ckpt(**WIDER), tmp_path / "bf16")
    with pytest.raises(UsageError, match="nothing to pad"):  # bf16 experts split at TP 2 without groups
        wna16ctl.pad(base, tmp_path / "x", tp=2)
    plan = wna16ctl.pad(base, None, tp=2, scheme="W4A16", vllm="0.32.0", dry_run=True).to_json()
    assert plan["fields"] == {"moe_intermediate_size": {"from": 128, "to": 256}}
    wna16ctl.pad(base, tmp_path / "p", tp=2, scheme="W4A16", vllm="0.32.0")
    a, b = load_file(base / "model.safetensors"), load_file(tmp_path / "p" / "model.safetensors")
    n = assert_zero_padded({k: v for k, v in a.items() if ".experts." in k},
                           {k: v for k, v in b.items() if ".experts." in k}, {"experts": (128, 256)})
    assert n == 12
    assert json.loads((tmp_path / "p" / "config.json").read_text())["moe_intermediate_size"] == 256


def test_what_padding_cannot_fix_is_refused_in_one_line(make_ckpt, tmp_path):
    src = make_ckpt(**SMALL)
    heads = json.loads((Path(src) / "config.json").read_text())["num_attention_heads"]
    with pytest.raises(NotLoadable, match="attention heads") as e:
        wna16ctl.pad(src, tmp_path / "p", tp=heads * 2 if heads * 2 <= 128 else 3, vllm="0.32.0")
    assert "\n" not in e.value.message and "padding" in e.value.message
    assert not (tmp_path / "p").exists()


def test_an_interrupted_pad_leaves_nothing_behind(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.padding.write as write

    src = make_ckpt(**SMALL)
    calls = []
    real = write._read_rows_into

    def failing(*args, **kwargs):  # the down projections' reads: the 3rd fails
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(write, "_read_rows_into", failing)
    with pytest.raises(OSError):
        wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    assert 3 <= len(calls) <= 2 + write.producers(2)  # the other producer stops at its next tensor
    assert sorted(os.listdir(tmp_path)) == []  # no OUT, no staging directory


def test_cli_pad_writes_and_refuses_bad_input(make_ckpt, tmp_path):
    import subprocess
    import sys

    src = make_ckpt(**SMALL)
    run = lambda *a: subprocess.run([sys.executable, "-m", "wna16ctl", *a], capture_output=True, text=True)  # noqa: E731 - the CLI in a subprocess, for the lines below
    r = run("pad", str(src), "--tp", "2", "--vllm", "0.32.0", "--dry-run")
    assert r.returncode == 0 and "moe_intermediate_size: 128 -> 256" in r.stdout, r.stderr
    r = run("pad", str(src), "--tp", "2", "--vllm", "0.32.0", "-o", str(tmp_path / "p"), "--json", "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["padding"]["verdict"]["loads"] is True
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "config.json").write_text("{")
    r = run("pad", str(broken), "--tp", "2", "-o", str(tmp_path / "q"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "config.json" in r.stderr
    assert not (tmp_path / "q").exists()
    r = run("pad", str(src), "-o", str(tmp_path / "r"))
    assert r.returncode == 2 and "--tp" in r.stderr


def test_pad_reports_the_memory_of_the_padded_checkpoint(make_ckpt, tmp_path):
    """`pad` (dry run or not) reports the per-rank memory of the checkpoint it writes: the same
    figures `inspect` gives for the written checkpoint at that TP size, in text and --json."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    src = make_ckpt(**SMALL)
    args = ["--tp", "2", "--vllm", "0.32.0", "--gpu", "h100", "--max-model-len", "4096"]
    dry = CliRunner().invoke(cli, ["pad", str(src), *args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.stdout)["memory"]
    run = CliRunner().invoke(cli, ["pad", str(src), *args, "-o", str(tmp_path / "p"), "--json", "-q"])
    assert run.exit_code == 0, run.output
    written = json.loads(run.stdout)["memory"]
    insp = wna16ctl.inspect(tmp_path / "p", "2", vllm="0.32.0", gpu="sm90", gpu_mem="h100", max_model_len=4096)
    assert planned == written == insp.fits[0].to_json()
    assert "memory" not in json.loads((tmp_path / "p" / "wna16ctl.json").read_text())  # the output's manifest is unchanged
    text = CliRunner().invoke(cli, ["pad", str(src), "--tp", "2", "--vllm", "0.32.0", "--dry-run"]).output
    assert "memory per rank at TP 2: weights" in text and "judges the fit" in text
