"""`pad` of GPTQ, AWQ and AutoRound checkpoints, written in their own stored form, and its proof.

The checkpoints are those AutoRound and GPTQModel write themselves (tests/quantizers/conftest.py:
hidden 128, moe_intermediate 96, group 32, 4 experts, attention quantized too), the hand-built
tiny ones of tests/sources/qweight_ckpt.py (experts only, so that the whole model plans at TP 2),
and a header-only Qwen3-30B-A3B-GPTQ-Int4-shaped one (I 768, group 128).  Every padding is read
back by the tool's own dequantizer (reference.py, in the quantizer venv) as the original's weights
plus zeros, proved by `verify`, and its bytes equal the tensor statement (`pad_projection`).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import modelckpt
from tests.conftest import QUESTIONS
from tests.quantizers.conftest import Quantized, copy_checkpoint, quantized  # noqa: F401 - the fixture, used here
from tests.sources import qweight_ckpt
from tests.sources.test_format_gptq import QWEN3_30B_A3B_GPTQ_INT4

# variant -> (vLLM release, the TP size its MoE layers are refused at and load at once padded,
# the native MoE method of its format there; None: the planner does not model vLLM's method yet)
REAL = {
    "autoround-gptq-sym4": ("0.33.0", 2, "AutoGPTQMoEMethod"),
    "autoround-awq-asym4": ("0.33.0", 2, "AutoAWQMoEMethod"),
    "gptqmodel-gptq-actorder-sym4": ("0.27.1", 2, "AutoGPTQMoEMethod"),  # act-order: refused from 0.30.0
    "autoround-own-sym4": ("0.33.0", 2, None),
}
PADDED = 128  # 96 -> 128: whole groups of 32 per rank at TP 2


def _wna16(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True)
    if check is not None:
        assert r.returncode == check, r.stdout + r.stderr
    return r


def _moe_plans(path: Path, tp: int, vllm: str) -> list[dict]:
    """The MoE layers' plans as `inspect --json` gives them."""
    import wna16ctl

    j = wna16ctl.inspect(path, tp, vllm=vllm).to_json()
    return [p for lay in j["layers"] for p in lay["plans"]]


def _readable_copy(quantized: Quantized, variant: str, dest: Path) -> Path:
    """The tool's checkpoint with `num_experts`: transformers 5 writes the Qwen3-MoE expert count as
    `num_local_experts` only, and wna16ctl refuses a config vLLM would build with 128 experts."""
    ck = copy_checkpoint(quantized, variant, dest)
    config = json.loads((ck / "config.json").read_text())
    config["num_experts"] = config["num_local_experts"]
    (ck / "config.json").write_text(json.dumps(config, indent=2))
    return ck


@pytest.fixture(scope="module")
def real_pads(tmp_path_factory):
    """variant -> (its readable copy, padded to PADDED by the CLI), each made once."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(quantized: Quantized, variant: str) -> tuple[Path, Path]:
        if variant not in made:
            root = tmp_path_factory.mktemp(variant)
            src = _readable_copy(quantized, variant, root)
            _wna16("pad", str(src), "--to", str(PADDED), "-o", str(root / "padded"), "-q")
            made[variant] = src, root / "padded"
        return made[variant]

    return get


@pytest.fixture(params=list(REAL))
def real_padding(request, real_pads):
    quantized = request.getfixturevalue("quantized")
    return (quantized, request.param, *real_pads(quantized, request.param))


def _stored(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _bytes_agree_with_the_tensor_statement(src: Path, out: Path) -> int:
    """Every padded projection's stored tensors equal `pad_projection` of the original's; returns
    how many projections were compared."""
    from wna16ctl.padding.tensors import pad_projection
    from wna16ctl.planning.padding import PaddedModule
    from wna16ctl.sources import formats, open_checkpoint

    ck = open_checkpoint(src)
    fmt = formats.of(ck.config.quant)
    before, after = _stored(src), _stored(out)
    compared = 0
    for layer in ck.layers:
        for e in range(layer.num_experts):
            for role in ("gate", "up", "down"):
                module = layer.tensor_name(e, role, "weight").removesuffix(".weight")
                m = PaddedModule(module, role, "routed", layer.intermediate_size, PADDED, layer.scheme, fmt,
                                 layer.hidden_size)
                stored = {fmt.names.role_of(n.rpartition(".")[2]): t for n, t in before.items()
                          if n.rpartition(".")[0] == module}
                want = pad_projection(m, stored)
                for r, t in want.items():
                    assert torch.equal(after[fmt.names.tensor(module, r)], t), (module, r)
                compared += 1
    return compared


def test_a_real_tool_checkpoint_is_padded_in_its_own_format_and_loads_on_its_native_method(real_padding):
    _, variant, src, out = real_padding
    vllm, tp, method = REAL[variant]
    original, padded = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert padded["moe_intermediate_size"] == PADDED and padded["quantization_config"] == original["quantization_config"]
    if (src / "quantize_config.json").exists():  # GPTQModel's side file is carried over as it is
        assert (out / "quantize_config.json").read_bytes() == (src / "quantize_config.json").read_bytes()
    before, after = _stored(src), _stored(out)
    assert before.keys() == after.keys() and all(before[n].dtype == after[n].dtype for n in before)
    q = "model.layers.1.mlp.experts.3"
    grown = {n.rpartition(".")[2]: (tuple(before[n].shape), tuple(after[n].shape)) for n in before
             if n.startswith(q) and before[n].shape != after[n].shape}
    # GPTQ packs the codes along K (qweight [K/8, N]), AWQ along N (qweight [K, N/8])
    if variant == "autoround-awq-asym4":
        assert grown["qweight"] == ((96, 16), (128, 16)) or grown["qweight"] == ((128, 12), (128, 16))
    else:
        assert grown["qweight"] in (((12, 128), (16, 128)), ((16, 96), (16, 128)))
    assert _bytes_agree_with_the_tensor_statement(src, out) == 2 * 4 * 3
    if method is not None:
        assert not any(p["loadable"] for p in _moe_plans(src, tp, vllm))
        plans = _moe_plans(out, tp, vllm)
        assert plans and all(p["loadable"] and p["method"]["class"] == method for p in plans), plans
    r = _wna16("verify", str(src), str(out), "--json", "--samples", str(QUESTIONS), "--num-samples", "8", check=None)
    proof = json.loads(r.stdout)
    assert r.returncode == 0 and proof["passed"], proof["problems"]
    # qweight, qzeros and scales of every projection, and (GPTQ) the down projection's g_idx
    assert proof["tensors_padded"] == 2 * 4 * (3 * 3 + ("g_idx" in grown))
    assert [lay["status"] for lay in proof["numerics"]] == ["pass", "pass"]


def test_the_tools_own_dequantizer_reads_the_padding_as_the_original_plus_zeros(real_padding):
    """reference.py (the tool's code, in the quantizer venv) on the padded checkpoint: every
    original weight where it was, the added rows and columns exact zeros."""
    from tests.quantizers.conftest import REFERENCE, _run, _venv_python

    quantized, variant, _, out = real_padding
    got = out.parent / "padded.reference.safetensors"
    r = _run([_venv_python(), str(REFERENCE), str(out), str(got)], timeout=1800, cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    want, padded = load_file(str(quantized.reference(variant))), load_file(str(got))
    assert want.keys() == padded.keys()
    grown = 0
    for name, w in want.items():
        p = padded[name]
        if p.shape == w.shape:
            assert torch.equal(p, w), name
            continue
        dim = 0 if p.shape[0] != w.shape[0] else 1
        assert p.shape[dim] == PADDED and torch.equal(p.narrow(dim, 0, w.shape[dim]), w), name
        assert torch.count_nonzero(p.narrow(dim, w.shape[dim], PADDED - w.shape[dim])) == 0, name
        grown += 1
    assert grown == 2 * 4 * 3


def _set_word(t: torch.Tensor, index: tuple, value: int) -> None:
    t[index] = value - (1 << 32) if value >= 1 << 31 else value


# (variant, damage, the problem verify names); every damaged word lies in the added part
FAULTS = [
    ("autoround-gptq-sym4", "down_proj.qweight", (-1, 0), "down_proj.qweight: an added code is not the zero code"),
    ("autoround-gptq-sym4", "gate_proj.qzeros", (0, -1), "gate_proj.qzeros: stores"),
    ("autoround-gptq-sym4", "down_proj.g_idx", (-1,), "down_proj.g_idx: is not the gptq stored form"),
    ("autoround-gptq-sym4", "up_proj.scales", "original", "up_proj.scales: an original scale changed"),
    ("autoround-awq-asym4", "gate_proj.qweight", (0, -1), "gate_proj.qweight: an added code is not the zero code"),
    ("autoround-awq-asym4", "up_proj.qzeros", (0, -1), "up_proj.qzeros: an added zero point is not the zero code"),
    ("autoround-awq-asym4", "down_proj.scales", "inf", "down_proj.scales: an added scale is not finite"),
]


@pytest.mark.parametrize("variant,tensor,where,expected", FAULTS, ids=[f"{v.split('-')[1]}-{t}" for v, t, *_ in FAULTS])
def test_verify_finds_a_fault_planted_in_a_gptq_or_awq_padding(request, real_pads, tmp_path, variant, tensor, where,
                                                                expected):
    src, out = real_pads(request.getfixturevalue("quantized"), variant)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    name = f"model.layers.0.mlp.experts.2.{tensor}"
    if where == "original":
        t[name][0, 0] *= 2
    elif where == "inf":
        t[name][-1, 0] = float("inf")
    else:
        _set_word(t[name], where, int(t[name][where]) ^ 1)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    import wna16ctl

    proof = wna16ctl.verify(src, bad, samples=QUESTIONS)
    assert not proof.passed
    assert any(expected in p for p in proof.problems), proof.problems


# -- hand-built checkpoints of the experts alone: the whole model plans at TP 2 ----------------------

TINY = {
    "gptq": ({"bits": 4, "group_size": 32, "desc_act": False, "sym": True, "quant_method": "gptq",
              "checkpoint_format": "gptq"}, dict(form="gptq"), "AutoGPTQMoEMethod"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            dict(form="awq", symmetric=False), "AutoAWQMoEMethod"),
}


@pytest.mark.parametrize("vllm", ["0.27.1", "0.33.0"])
@pytest.mark.parametrize("form", list(TINY))
def test_pad_at_tp_2_of_a_gptq_or_awq_checkpoint_loads_there_on_its_native_method(tmp_path, form, vllm):
    qc, kwargs, method = TINY[form]
    src, _ = qweight_ckpt.tiny(tmp_path / "src", copy.deepcopy(qc), hidden=128, **kwargs)
    out = tmp_path / "padded"
    r = _wna16("pad", str(src), "--tp", "2", "--vllm", vllm, "-o", str(out))
    assert "moe_intermediate_size: 96 -> 128" in r.stdout and "original refused" in r.stdout
    assert not any(p["loadable"] for p in _moe_plans(src, 2, vllm))
    plans = _moe_plans(out, 2, vllm)
    assert plans and all(p["loadable"] and p["method"]["class"] == method for p in plans), plans
    import wna16ctl

    proof = wna16ctl.verify(src, out, samples=QUESTIONS, num_samples=8).to_json()
    assert proof["passed"] and [(lay["tp"], lay["status"]) for lay in proof["numerics"]] == [(2, "pass")]


def test_pad_refuses_a_gptq_scheme_vllm_refuses_in_one_line_and_writes_nothing(tmp_path):
    # GPTQ v2 asymmetric 8-bit: vLLM's GPTQ config takes symmetric 4- and 8-bit codes only; the same
    # checkpoint padded with --to is exact all the same
    qc = {"bits": 8, "group_size": 32, "desc_act": False, "sym": False, "quant_method": "gptq",
          "checkpoint_format": "gptq_v2"}
    src, _ = qweight_ckpt.tiny(tmp_path / "src", qc, form="gptq_v2", bits=8, symmetric=False, hidden=128)
    r = _wna16("pad", str(src), "--tp", "2", "-o", str(tmp_path / "no"), check=1)
    assert len(r.stderr.strip().splitlines()) == 1 and "bits/sym" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "no").exists()
    import wna16ctl

    wna16ctl.pad(src, tmp_path / "padded", to=128)
    proof = wna16ctl.verify(src, tmp_path / "padded", samples=QUESTIONS, num_samples=8)
    assert proof.passed, proof.problems


# -- Qwen3-30B-A3B-GPTQ-Int4's shapes at TP 4 ---------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_30b_gptq(tmp_path_factory):
    root = tmp_path_factory.mktemp("q30")
    # the published expert shapes (H 2048, I 768, group 128); 8 experts and a small vocabulary keep
    # the written bytes small: neither decides the MoE plan at TP 4
    config = {**modelckpt.qwen3_30b_a3b(layers=1), "num_experts": 8, "vocab_size": 1024}
    src = qweight_ckpt.header_only(root / "src", config, copy.deepcopy(QWEN3_30B_A3B_GPTQ_INT4),
                                   family=modelckpt.qwen3_moe)
    qweight_ckpt.fill_symmetric_zero_points(src)
    out = root / "padded"
    _wna16("pad", str(src), "--to", "1024", "-o", str(out), "-q")
    return src, out


@pytest.mark.parametrize("vllm,fallback_kernel,native_kernel", [("0.27.1", "triton", "marlin"),
                                                                ("0.33.0", "humming", "humming")])
def test_qwen3_30b_a3b_gptq_at_tp4_loads_on_moe_wna16_before_the_pad_and_gptq_marlin_after(
        qwen3_30b_gptq, vllm, fallback_kernel, native_kernel):
    src, out = qwen3_30b_gptq
    before = _moe_plans(src, 4, vllm)
    assert before and all(p["loadable"] and p["method"]["class"] == "MoeWNA16Method"
                          and p["backend"] == fallback_kernel and p["intermediate_size_per_partition"] == 192
                          and "192 is not a multiple of group_size 128" in p["method"]["fallback_reason"]
                          for p in before), before
    after = _moe_plans(out, 4, vllm)
    assert after and all(p["loadable"] and p["method"] == {"class": "AutoGPTQMoEMethod", "name": "gptq_marlin",
                                                           "fallback_reason": None}
                         and p["backend"] == native_kernel and p["intermediate_size_per_partition"] == 256
                         for p in after), after
    text = _wna16("inspect", str(out), "--tp", "4", "--vllm", vllm, check=None).stdout
    assert f"gptq_marlin: {native_kernel}" in text


# -- pad --tp 2 of the tools' checkpoints, attention quantized too: the linear layers are planned -----

# variant -> (release, the padded checkpoint's MoE method; None: the planner's reason pad gives instead)
TP2 = {
    "autoround-gptq-sym4": ("0.33.0", "AutoGPTQMoEMethod"),
    "autoround-awq-asym4": ("0.33.0", "AutoAWQMoEMethod"),
    # o_proj: K 128 -> 64 per rank, under Marlin's 128, and act-order rules out every other kernel
    "gptqmodel-gptq-actorder-sym4": ("0.27.1", None),
}


@pytest.mark.parametrize("variant", list(TP2))
def test_pad_tp_2_of_a_tool_checkpoint_with_quantized_attention(quantized, tmp_path, variant):
    vllm, method = TP2[variant]
    src = _readable_copy(quantized, variant, tmp_path)
    out = tmp_path / "padded"
    r = _wna16("pad", str(src), "--tp", "2", "--vllm", vllm, "-o", str(out), check=None)
    if method is None:
        assert r.returncode == 1 and not out.exists(), r.stdout + r.stderr
        assert r.stderr.strip() == (f"error: {src}: padded, it still does not load at TP 2: model.layers.0.self_attn."
                                    "o_proj: no kernel; padding the intermediate sizes cannot fix this rule"), r.stderr
        return
    assert r.returncode == 0 and "moe_intermediate_size: 96 -> 128" in r.stdout and "original refused" in r.stdout, r
    import wna16ctl

    j = wna16ctl.inspect(out, 2, vllm=vllm).to_json()
    assert j["loadable"] and all(p["loadable"] and p["method"]["class"] == method
                                 for lay in j["layers"] for p in lay["plans"]), j["layers"]
    attention = {lin["name"].removeprefix("model.layers."): p for lin in j["linear_layers"] for p in lin["plans"]}
    assert sorted(attention) == ["0.self_attn.o_proj", "0.self_attn.qkv_proj", "1.self_attn.o_proj",
                                 "1.self_attn.qkv_proj"] and all(p["loadable"] for p in attention.values()), attention
    assert attention["0.self_attn.o_proj"]["k"] == 64  # the row-parallel split the act-order checkpoint cannot take
    proof = wna16ctl.verify(src, out, samples=QUESTIONS, num_samples=8).to_json()
    assert proof["passed"] and [(lay["tp"], lay["status"]) for lay in proof["numerics"]] == [(2, "pass")] * 2, proof
