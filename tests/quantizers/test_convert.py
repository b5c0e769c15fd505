"""`wna16ctl convert` of the checkpoints AutoRound and GPTQModel write (tests/quantizers/conftest.py)
to compressed-tensors pack-quantized, and `verify ORIGINAL CONVERTED`.

The converted checkpoint is judged against the tool's own dequantization (reference.py, computed by
AutoRound's / GPTQModel's code in the quantizer venv): compressed-tensors' decompression of every
converted projection is that reference rounded once to the scale dtype, with no warning from the
library.  The refusals are one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.quantizers.write_checkpoints import VARIANTS

ACT_ORDER = "gptqmodel-gptq-actorder-sym4"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": os.getcwd()})


def _library_decompress(out, module: str, config: dict) -> torch.Tensor:
    """compressed-tensors' own decompression of one module (its pack-quantized compressor, the one
    ModelCompressor runs per module); act-order (which compressed-tensors >= 0.19 no longer parses)
    through its unpack_from_int32 and the g_idx."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        local = {k.rpartition(".")[2]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == module}
    (group,) = config["config_groups"].values()
    if group["weights"]["actorder"] == "group":
        s, g = local["weight_scale"], local["weight_g_idx"].long()
        q = unpack_from_int32(local["weight_packed"], 4, torch.Size(local["weight_shape"].tolist()))
        return (q.to(s.dtype) - torch.zeros_like(s)[:, g]) * s[:, g]
    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    return BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_tool_checkpoint_converts_exactly_and_verifies(quantized, tmp_path, variant):
    import wna16ctl

    src = quantized.checkpoint(variant)
    out = tmp_path / "ct"
    r = _cli("convert", str(src), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "next: wna16ctl verify" in r.stdout
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(config["ignore"])
    assert not (out / "quantize_config.json").exists() and (out / "tokenizer.json").is_file()
    reference = load_file(str(quantized.reference(variant)))
    src_scales = load_file(str(src / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the library decompresses without a warning
        for module, want in reference.items():
            module = module.removesuffix(".weight")
            got = _library_decompress(out, module, config)
            dtype = src_scales[module + ".scales"].dtype  # the scales are kept in their dtype
            assert got.dtype == dtype, module
            assert torch.equal(got, want.to(dtype)), f"{variant}: {module}"
    proof = wna16ctl.verify(src, out)
    assert proof.passed and proof.projections_checked == len(reference), proof.lines()
    assert (ACT_ORDER == variant) == any("actorder group" in n for n in proof.notes)
    r = _cli("verify", str(src), str(out))
    assert r.returncode == 0 and "PASS" in r.stdout.splitlines()[-1], r.stdout + r.stderr


def test_convert_keeps_act_order_and_the_zero_points(quantized, tmp_path):
    """The act-order g_idx is carried as weight_g_idx (actorder group); an asymmetric checkpoint's
    zero points are carried, packed along N (v2 stores the zero itself: nothing to undo)."""
    import wna16ctl

    wna16ctl.convert(quantized.checkpoint(ACT_ORDER), tmp_path / "a")
    src = load_file(str(quantized.checkpoint(ACT_ORDER) / "model.safetensors"))
    out = load_file(str(tmp_path / "a" / "model.safetensors"))
    module = "model.layers.1.mlp.experts.2.down_proj"
    assert torch.equal(out[module + ".weight_g_idx"], src[module + ".g_idx"])
    assert module + ".weight_zero_point" not in out and out[module + ".weight_shape"].tolist() == [128, 96]
    wna16ctl.convert(quantized.checkpoint("gptqmodel-gptqv2-asym8"), tmp_path / "b")
    out = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert out[module + ".weight_zero_point"].shape == (128 // 4, 96 // 32)
    assert module + ".weight_g_idx" not in out


def test_resume_reuses_what_an_earlier_run_finished(quantized, tmp_path):
    import wna16ctl

    src = quantized.checkpoint("autoround-awq-asym4")
    first = wna16ctl.convert(src, tmp_path / "o")
    again = wna16ctl.convert(src, tmp_path / "o", resume=True)
    assert first["files_reused"] == [] and again["files_reused"] == ["model.safetensors"]
    assert again["files"] == first["files"]


def _broken(quantized, tmp_path, variant: str, **qc_changes) -> str:
    dest = shutil.copytree(quantized.checkpoint(variant), tmp_path / "src")
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"].update(qc_changes)
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "quantize_config.json").unlink(missing_ok=True)
    return str(dest)


@pytest.mark.parametrize("variant, change, named", [
    ("autoround-awq-asym4", {"version": "gemv"}, "quantization_config.version"),
    ("gptqmodel-gptqv2-asym8", {"bits": 5}, "quantization_config.bits"),
    ("gptqmodel-gptqv2-asym8", {"dynamic": {r"+:.*down_proj": {"pack_dtype": "int16"}}}, "pack_dtype"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(quantized, tmp_path, variant, change, named):
    src = _broken(quantized, tmp_path, variant, **change)
    out = tmp_path / "out"
    r = _cli("convert", src, "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no OUT, no staging directory


def _multi_shard_gptq(tmp_path) -> Path:
    """A small GPTQ checkpoint of several shards (bench/synthetic_checkpoint.py --gptq)."""
    script = Path(__file__).resolve().parents[2] / "bench" / "synthetic_checkpoint.py"
    src = tmp_path / "src"
    r = subprocess.run([sys.executable, str(script), str(src), "--gptq", "--layers", "1", "--experts", "4",
                        "--experts-per-shard", "2", "--hidden", "256", "--intermediate", "128", "--vocab", "256"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return src


def _change_in_place(shard, suffix: str, new: bytes | None = None) -> None:
    """Flip the first word of the first tensor named `*suffix` of `shard` (or write `new` there)
    without changing the file's size or its times (as `--resume` may meet a file rewritten by a
    tool that keeps them)."""
    from wna16ctl.sources.headers import read_shard_header

    header = read_shard_header(shard)
    start = header.data_start + next(e for n, e in header.entries.items() if n.endswith(suffix))["data_offsets"][0]
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(start)
        word = f.read(4)
        f.seek(start)
        f.write(new if new is not None else bytes(b ^ 0x5A for b in word))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resume_redoes_the_files_of_a_changed_source_and_records_no_source_digest(tmp_path, monkeypatch):
    """An interrupted convert, then one shard's data changed in place (same size, same times):
    `--resume` keeps the other files and writes that one again, with the bytes a fresh run gives.
    No digest of the source is kept while writing (resume converts the staged files' sources again).
    Where several files are converted at once, a refusal in one stops the others: one line, exit 2,
    nothing written."""
    import wna16ctl
    from wna16ctl.conversion import write

    src = _multi_shard_gptq(tmp_path)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) >= 3
    real = write._write_side_files

    def interrupted(plan, staged):
        staged.collect_hashes()  # the streams finish in the background: wait until every shard is journaled
        raise KeyboardInterrupt  # after every shard is written and journaled

    monkeypatch.setattr(write, "_write_side_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        wna16ctl.convert(src, tmp_path / "out")
    monkeypatch.setattr(write, "_write_side_files", real)
    _change_in_place(src / shards[1], ".qweight")
    manifest = wna16ctl.convert(src, tmp_path / "out", resume=True)
    assert manifest["files_reused"] == [s for s in shards if s != shards[1]]
    fresh = wna16ctl.convert(src, tmp_path / "fresh")
    assert manifest["files"] == fresh["files"]
    for name in shards:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    assert all(set(meta) == {"blake3", "bytes"} for meta in manifest["files"].values()), manifest["files"]
    again = wna16ctl.convert(src, tmp_path / "out", resume=True)  # a committed output: every file reused
    assert again["files_reused"] == shards
    _change_in_place(src / shards[-1], ".scales", b"\x00\x7c")  # a float16 scale made infinite
    before = sorted(os.listdir(tmp_path))
    r = _cli("convert", str(src), "-o", str(tmp_path / "refused"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not finite" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before
