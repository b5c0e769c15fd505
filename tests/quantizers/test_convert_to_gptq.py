"""`wna16ctl convert CKPT --to gptq`: a compressed-tensors pack-quantized checkpoint written as GPTQ (v1,
as GPTQModel writes it), exactly, and `verify ORIGINAL CONVERTED` both ways.

The strongest evidence is the round trip of the real tools' GPTQ checkpoints (tests/quantizers/
conftest.py): GPTQModel's desc_act one and AutoRound's, converted to compressed-tensors and back, are
the tools' own tensors byte for byte.  Checkpoints compressed-tensors itself writes (the demo) convert
and verify in every scheme GPTQ stores (sym, asym with v1's zero - 1, act-order, channel-wise, 8 bits),
and GPTQModel's own dequantizer (reference.py) of the output equals compressed-tensors' decompression of
the source.  What GPTQ cannot express is refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quantizers.conftest import run_reference


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": os.getcwd()})


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        out |= load_file(str(shard))
    return out


@pytest.mark.parametrize("variant", ["gptqmodel-gptq-actorder-sym4", "autoround-gptq-sym4"])
def test_the_tools_gptq_converted_there_and_back_is_their_own_bytes(quantized, tmp_path, variant):
    src = quantized.checkpoint(variant)
    r = _cli("convert", str(src), "-o", str(tmp_path / "ct"), "-q")
    assert r.returncode == 0, r.stderr
    r = _cli("convert", str(tmp_path / "ct"), "--to", "gptq", "-o", str(tmp_path / "back"), "-q")
    assert r.returncode == 0, r.stderr
    assert "to gptq (checkpoint_format gptq)" in r.stdout
    want, got = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    source = json.loads((src / "config.json").read_text())["quantization_config"]
    for key in ("bits", "group_size", "desc_act", "sym", "quant_method", "checkpoint_format", "lm_head"):
        assert config[key] == (source.get(key) or "gptq" if key == "checkpoint_format" else source[key]), key
    assert json.loads((tmp_path / "back" / "quantize_config.json").read_text()) == config
    r = _cli("verify", str(tmp_path / "ct"), str(tmp_path / "back"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of the source to the output's (q - z)·s as GPTQ reads it" in r.stdout, r.stdout


@pytest.mark.parametrize("spec", [
    {"symmetric": True},
    {"symmetric": False, "actorder": "group"},
    {"symmetric": False, "num_bits": 8, "group_size": -1},
])
def test_library_checkpoints_convert_to_gptq_and_verify(make_ckpt, tmp_path, spec):
    import wna16ctl
    from wna16ctl.sources import open_checkpoint

    src = make_ckpt(**spec)
    out = tmp_path / "gptq"
    wna16ctl.convert(src, out, to="gptq")
    proof = wna16ctl.verify(src, out)
    assert proof.passed and proof.reverse and proof.projections_checked > 0, proof.lines()
    ck = open_checkpoint(out)  # read as any GPTQ checkpoint: the scheme the source states
    s = ck.quantized_layers[0].scheme
    assert (s.num_bits, s.group_size, s.symmetric, s.act_order) == \
        (spec.get("num_bits", 4), spec.get("group_size", 128), spec["symmetric"], spec.get("actorder") == "group")


def test_gptqmodels_dequantizer_of_the_output_is_the_librarys_of_the_source(make_ckpt, quantizer_python, tmp_path):
    """The independent reference: GPTQModel's own safetensors dequantizer (reference.py, in the quantizer
    venv; it undoes v1's zero - 1 and follows g_idx) of the converted checkpoint equals compressed-tensors'
    decompression of the source, for an asymmetric act-order checkpoint."""
    import wna16ctl
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src = make_ckpt(symmetric=False, actorder="group", num_shards=1)
    out = tmp_path / "gptq"
    wna16ctl.convert(src, out, to="gptq")
    ref = tmp_path / "reference.safetensors"
    run_reference(quantizer_python, out, ref)
    reference = load_file(str(ref))
    stored = _tensors(src)
    assert reference
    for name, want in reference.items():
        module = name.removesuffix(".weight")
        t = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}
        s, g = t["weight_scale"].float(), t["weight_g_idx"].long()
        q = unpack_from_int32(t["weight_packed"], 4, torch.Size(t["weight_shape"].tolist()))
        z = unpack_from_int32(t["weight_zero_point"], 4, torch.Size(s.shape), packed_dim=0)
        library = (q.float() - z[:, g].float()) * s[:, g]
        assert torch.equal(want, library), module


def _changed(src: Path, dest: Path, *, qc: dict | None = None, tensor: tuple[str, object] | None = None) -> Path:
    out = Path(shutil.copytree(src, dest))
    if qc is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = qc(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    if tensor is not None:
        name, change = tensor
        shard = next(p for p in out.glob("*.safetensors") if name in load_file(str(p)))
        tensors = load_file(str(shard))
        tensors[name] = change(tensors[name])
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def _with_activations(qc: dict) -> dict:
    for group in qc["config_groups"].values():
        group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}
    return qc


@pytest.mark.parametrize("case, named", [
    ("5 bits", "5-bit weights: GPTQ stores 2, 3, 4, 8 bits"),
    ("mixed schemes", "a GPTQ config states one scheme"),
    ("zero point 0", "cannot be stored in GPTQ v1"),
    ("activations", "input_activations"),
])
def test_what_gptq_cannot_express_is_refused_in_one_line(make_ckpt, tmp_path, case, named):
    if case == "5 bits":
        src = make_ckpt(num_bits=5)
    elif case == "mixed schemes":
        src = make_ckpt(mixed="layer")
    elif case == "activations":
        src = _changed(make_ckpt(), tmp_path / "src", qc=_with_activations)
    else:  # every zero point of one projection 0 (the offset code of the int4 minimum)
        base = make_ckpt(symmetric=False, num_shards=1)
        name = next(k for k in load_file(str(base / "model.safetensors")) if k.endswith("down_proj.weight_zero_point"))
        src = _changed(base, tmp_path / "src", tensor=(name, lambda t: torch.full_like(t, 0)))
    out = tmp_path / "out"
    r = _cli("convert", str(src), "--to", "gptq", "-o", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_gptq_checkpoint_is_not_converted_to_gptq(quantized, tmp_path):
    r = _cli("convert", str(quantized.checkpoint("autoround-gptq-sym4")), "--to", "gptq", "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "already a gptq checkpoint" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
