"""`convert`'s torch-free data path (`conversion/words.py`, `sources/formats/word_forms.py`) against
the torch path it stands in for: the same bytes in every output file for the checkpoints the real
quantizers write and for synthetic ones of the schemes they do not (2/3/8 bits, v1 asymmetric,
channel-wise, act-order, AWQ symmetric, bfloat16 and float32 scales); `verify` passes; torch is
never imported; a projection whose data is wrong is refused in one line, nothing written.
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

from tests.quantizers.write_checkpoints import VARIANTS

TEMPLATE = "gptqmodel-gptqv2-asym8"  # the real checkpoint whose modules the synthetic ones take


def _both_paths(src: Path, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """OUT of the word path and OUT of the torch path (the reference), both written in-process."""
    import wna16ctl
    from wna16ctl.conversion import plan, words

    assert words.takes(plan.plan_conversion(src))
    fast, ref = tmp_path / "words", tmp_path / "torch"

    def no_fallback(p, *args):
        raise AssertionError(f"{p.module}: the word path handed the projection to the torch path")

    monkeypatch.setattr(words, "_reference", no_fallback)  # every projection converted word by word
    wna16ctl.convert(src, fast)
    monkeypatch.setattr(words, "takes", lambda p: False)
    wna16ctl.convert(src, ref)
    monkeypatch.undo()
    return fast, ref


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_word_path_writes_the_torch_paths_bytes_for_each_tool_checkpoint(quantized, tmp_path, monkeypatch, variant):
    import wna16ctl

    fast, ref = _both_paths(quantized.checkpoint(variant), tmp_path, monkeypatch)
    _same_files(fast, ref)
    assert wna16ctl.verify(quantized.checkpoint(variant), fast).passed


# (quant_method, quantization_config, scale dtype): schemes the tools above do not write
SCHEMES = {
    "gptq-v1-asym3-bf16": ("gptq", {"bits": 3, "group_size": 32, "desc_act": False, "sym": False,
                                    "checkpoint_format": "gptq"}, torch.bfloat16),
    "gptq-v2-asym2-channel-f32": ("gptq", {"bits": 2, "group_size": -1, "desc_act": False, "sym": False,
                                           "checkpoint_format": "gptq_v2"}, torch.float32),
    "gptq-v1-sym8-actorder": ("gptq", {"bits": 8, "group_size": 32, "desc_act": True, "sym": True,
                                       "checkpoint_format": "gptq"}, torch.float16),
    "gptq-v2-sym3-actorder-bf16": ("gptq", {"bits": 3, "group_size": 32, "desc_act": True, "sym": True,
                                            "checkpoint_format": "gptq_v2"}, torch.bfloat16),
    "gptq-v1-sym2": ("gptq", {"bits": 2, "group_size": 32, "desc_act": False, "sym": True,
                              "checkpoint_format": "gptq"}, torch.float16),
    "awq-sym4-bf16": ("awq", {"bits": 4, "group_size": 32, "zero_point": False, "version": "gemm"}, torch.bfloat16),
    "awq-asym4-channel": ("awq", {"bits": 4, "group_size": -1, "zero_point": True, "version": "gemm"}, torch.float16),
}


def _synthetic(quantized, tmp_path: Path, case: str, seed: int = 0) -> Path:
    """The template's modules with random canonical codes, scales, zero points and act-order g_idx
    of scheme `case`, put in the stored form by the format's own `stored_form`."""
    from wna16ctl.sources.config import parse_quantization_config
    from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS, FORMATS
    from wna16ctl.sources.formats.bits import pack_bits

    method, qc, dtype = SCHEMES[case]
    qc = {"quant_method": method, **qc}
    dest = shutil.copytree(quantized.checkpoint(TEMPLATE), tmp_path / case)
    (dest / "quantize_config.json").unlink(missing_ok=True)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(config))
    fmt, parsed = FORMATS[method], parse_quantization_config(qc, dest / "config.json")
    tensors = load_file(str(dest / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if fmt.names.split(n) and fmt.names.split(n)[1] == CODES]:
        module = fmt.names.split(name)[0]
        scheme = parsed.schemes_for([module])[0]
        old = {r: tensors.pop(fmt.names.tensor(module, r), None) for r in (CODES, SCALES, ZERO_POINTS, G_IDX)}
        n, k = old[SCALES].shape[1], old[G_IDX].numel()  # the template stores a g_idx of K entries
        b, groups = scheme.num_bits, (-(-k // scheme.group_size) if scheme.group_size > 0 else 1)
        canon = {CODES: pack_bits(torch.randint(0, 1 << b, (n, k), generator=g), b, dim=1),
                 SCALES: (torch.rand(n, groups, generator=g) + 0.01).to(dtype)}
        if not scheme.symmetric:  # zeros from 1: GPTQ v1 cannot store 0
            canon[ZERO_POINTS] = pack_bits(torch.randint(1, 1 << b, (n, groups), generator=g), b, dim=0)
        if scheme.act_order:
            canon[G_IDX] = torch.randperm(groups, generator=g).repeat_interleave(scheme.group_size)[:k].to(torch.int32)
            canon[G_IDX] = canon[G_IDX][torch.randperm(k, generator=g)]
        tensors |= {fmt.names.tensor(module, r): t.contiguous() for r, t in fmt.stored_form(canon, scheme).items()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("case", list(SCHEMES))
def test_word_path_writes_the_torch_paths_bytes_for_every_scheme(quantized, tmp_path, monkeypatch, case):
    import wna16ctl

    src = _synthetic(quantized, tmp_path, case)
    fast, ref = _both_paths(src, tmp_path, monkeypatch)
    _same_files(fast, ref)
    assert wna16ctl.verify(src, fast).passed


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "wna16ctl", *args], capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": os.getcwd()})


def test_convert_never_imports_torch(quantized, tmp_path):
    for src in (quantized.checkpoint("gptqmodel-gptq-actorder-sym4"), quantized.checkpoint("autoround-awq-asym4")):
        out = tmp_path / src.name
        r = _cli("convert", str(src), "-o", str(out), "-q")
        assert r.returncode == 0, r.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time")}
        assert "numpy" in imported and "torch" not in imported
        assert (out / "model.safetensors").is_file()


def _corrupt(src: Path, module_role: str, value: float | int) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith(module_role) and ".experts.1." in n)
    t = tensors[name].clone()
    t.view(-1)[t.numel() // 2] = value
    tensors[name] = t
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case, suffix, value, named", [
    ("gptq-v1-asym3-bf16", ".qzeros", -1, "GPTQ v1 stores zero - 1"),
    ("gptq-v1-sym2", ".scales", float("inf"), "is not finite"),
    ("gptq-v1-sym2", ".qzeros", 0, "not the symmetric midpoint"),
    ("gptq-v1-sym8-actorder", ".g_idx", 99, "outside [0, 3)"),
])
def test_word_path_refuses_wrong_data_in_one_line_and_writes_nothing(quantized, tmp_path, case, suffix, value, named):
    from wna16ctl.conversion import plan, words

    src = _synthetic(quantized, tmp_path / "src", case)
    _corrupt(src, suffix, value)
    assert words.takes(plan.plan_conversion(src))  # refused on the word path
    r = _cli("convert", str(src), "-o", str(tmp_path / "out"))
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time")]
    assert r.returncode == 2 and len(errors) == 1 and named in errors[0], r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_native_transposes_write_numpys_bytes(host, quantized, tmp_path, monkeypatch):
    """The native host library's transposes (at each tile level this CPU has) write what numpy's
    tiled copies write: 32-bit codes and 16-bit scales, edges that fill no tile, rows further apart
    than the columns taken (a projection written in pieces); and a whole checkpoint converted
    without the library (WNA16CTL_NO_NATIVE=1: numpy's copies) is the same files."""
    import numpy as np

    import wna16ctl
    from wna16ctl.conversion import words
    from wna16ctl.native import simd

    rng = np.random.default_rng(0)
    for level in ("scalar", "avx2"):
        if level not in simd.available(host):
            continue
        monkeypatch.setenv(simd.ENV, level)
        native = words.transposer()
        assert native is not words._numpy_transpose
        for dtype in ("<u4", "<u2"):
            for rows, cols, ld in [(256, 768, 768), (96, 2048, 2048), (13, 37, 37), (8, 8, 8), (1, 1, 1),
                                   (17, 9, 20), (64, 130, 200), (3, 0, 5)]:
                block = rng.integers(0, 1 << 16, size=(rows, ld)).astype(dtype)
                view = block[:, :cols].T  # the canonical view: [cols, rows], rows `ld` apart in the source
                got, want = (np.full(view.shape, 0xA5, dtype=dtype) for _ in range(2))
                native(got.ctypes.data, view)
                words._numpy_transpose(want.ctypes.data, view)
                assert np.array_equal(want, view) and np.array_equal(got, want), (level, dtype, rows, cols, ld)
    monkeypatch.delenv(simd.ENV)
    src = quantized.checkpoint("gptqmodel-gptq-actorder-sym4")
    wna16ctl.convert(src, tmp_path / "native")
    monkeypatch.setenv("WNA16CTL_NO_NATIVE", "1")
    assert words.transposer() is words._numpy_transpose
    wna16ctl.convert(src, tmp_path / "numpy")
    _same_files(tmp_path / "native", tmp_path / "numpy")


def test_a_shard_cut_short_while_its_codes_are_mapped_is_one_line_and_nothing_written(host, quantized, tmp_path,
                                                                                     monkeypatch):
    """The native path reads a projection's codes straight from a mapping of the shard: a shard
    truncated meanwhile is refused naming the file (the guarded read returns, no SIGBUS), nothing
    written."""
    import wna16ctl
    from wna16ctl.conversion import words
    from wna16ctl.errors import BadInput

    src = Path(shutil.copytree(quantized.checkpoint("gptqmodel-gptq-actorder-sym4"), tmp_path / "src"))
    shard = src / "model.safetensors"
    real = words.transposer
    calls = []

    def transposer():
        native = real()
        assert native is not words._numpy_transpose

        def truncate_then_transpose(address, view):
            calls.append(1)
            if len(calls) == 3:  # the third projection's codes, mapped already, are cut off
                os.truncate(shard, 4096)
            return native(address, view)

        return truncate_then_transpose

    monkeypatch.setattr(words, "transposer", transposer)
    with pytest.raises(BadInput, match=r"model\.safetensors: ends before tensor .*qweight does"):
        wna16ctl.convert(src, tmp_path / "out")
    assert len(calls) == 3 and sorted(os.listdir(tmp_path)) == ["src"]
