"""The AWQ reader (`sources/formats/awq.py`): GEMM configs as published, modules_to_not_convert,
the interleaved stored form checked against vLLM's `awq_pack`, exact round trips, bad inputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import modelckpt
from tests.sources import vllm_reference
from tests.sources.qweight_ckpt import header_only, random_projection, store, tiny
from tests.sources.test_format_gptq import _expect_bad, _inspect, _module_canonical
from wna16ctl.errors import BadInput
from wna16ctl.sources import formats
from wna16ctl.sources.config import parse_quantization_config
from wna16ctl.sources.formats import CODES, SCALES, ZERO_POINTS
from wna16ctl.sources.formats.bits import unpack_bits

P = Path("config.json")
# AutoAWQ's block, as Qwen3-30B-A3B and Mixtral AWQ checkpoints publish it in config.json
QWEN3_MOE_AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
                 "version": "gemm", "zero_point": True}
MIXTRAL_AWQ = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "gemm",
               "modules_to_not_convert": ["gate"]}


def test_published_awq_configs_parse():
    q = parse_quantization_config(copy.deepcopy(QWEN3_MOE_AWQ), P)
    s = q.scheme_for("model.layers.0.mlp.experts.3.down_proj")
    assert (q.quant_method, s.num_bits, s.group_size, s.symmetric, s.actorder, s.format) == \
        ("awq", 4, 128, False, None, "awq")
    q = parse_quantization_config(copy.deepcopy(MIXTRAL_AWQ), P)
    assert q.scheme_for("model.layers.0.block_sparse_moe.gate") is None  # "gate" is a substring
    assert q.scheme_for("model.layers.0.block_sparse_moe.experts.0.w1") is not None
    assert q.scheme_for("lm_head") is None


@pytest.mark.parametrize("mutate,needle", [
    (dict(version="gemv"), "quantization_config.version = 'gemv'"),
    (dict(version="exllama"), "quantization_config.version = 'exllama'"),
    (dict(bits=8), "quantization_config.bits = 8"),
    (dict(zero_point="no"), "quantization_config.zero_point"),
])
def test_bad_awq_config_names_the_key(mutate, needle):
    with pytest.raises(BadInput) as e:
        parse_quantization_config(dict(QWEN3_MOE_AWQ, **mutate), P)
    assert needle in e.value.message


def test_awq_stored_form_is_vllms_packing():
    ref = vllm_reference.helpers()
    n, k, group = 64, 128, 32
    p = random_projection(n, k, 4, group, symmetric=False, act_order=False, seed=3)
    qweight = ref.awq_pack(p["codes"].t().contiguous(), 4, k, n)
    qzeros = ref.awq_pack(p["zeros"].t().contiguous(), 4, k // group, n)
    scheme = parse_quantization_config(dict(QWEN3_MOE_AWQ, group_size=group), P).scheme_for("x.experts.0.up_proj")
    fmt = formats.FORMATS["awq"]
    canon = fmt.canonical({CODES: qweight, SCALES: p["scales"].t().contiguous(), ZERO_POINTS: qzeros}, scheme)
    assert torch.equal(unpack_bits(canon[CODES], 4, dim=1, size=k), p["codes"])
    assert torch.equal(unpack_bits(canon[ZERO_POINTS], 4, dim=0, size=n), p["zeros"])
    back = fmt.stored_form(canon, scheme)
    assert torch.equal(back[CODES], qweight) and torch.equal(back[ZERO_POINTS], qzeros)


@pytest.mark.parametrize("zero_point", [True, False])
def test_round_trip_exact(zero_point):
    n, k, group = 64, 96, 32
    p = random_projection(n, k, 4, group, symmetric=not zero_point, act_order=False, seed=9)
    scheme = parse_quantization_config(dict(QWEN3_MOE_AWQ, group_size=group, zero_point=zero_point),
                                       P).scheme_for("x.experts.0.up_proj")
    stored = {{"qweight": CODES, "scales": SCALES, "qzeros": ZERO_POINTS}[s]: t for s, t in store(p, "awq", 4).items()}
    fmt = formats.FORMATS["awq"]
    canon = fmt.canonical(stored, scheme)
    assert (ZERO_POINTS in canon) == zero_point
    back = fmt.stored_form(canon, scheme)
    assert all(torch.equal(back[r], stored[r]) for r in stored)


def test_reader_gives_the_canonical_form(tmp_path):
    path, logical = tiny(tmp_path / "ck", dict(QWEN3_MOE_AWQ, group_size=32), form="awq", symmetric=False)
    canon = _module_canonical(path, (0, "gate"))
    p = logical["model.layers.0.mlp.experts.0.gate_proj"]
    assert torch.equal(unpack_bits(canon[CODES], 4, dim=1, size=64), p["codes"])
    assert torch.equal(unpack_bits(canon[ZERO_POINTS], 4, dim=0, size=96), p["zeros"])


def test_header_only_awq_inspects(tmp_path):
    ck = header_only(tmp_path / "ck", modelckpt.qwen3_30b_a3b(), QWEN3_MOE_AWQ, form="awq")
    res = _inspect(ck)
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
    assert "format awq" in res.stdout and "int4 g128 asym" in res.stdout


def test_gemv_refused_via_cli(tmp_path):
    ck = header_only(tmp_path / "ck", modelckpt.qwen3_30b_a3b(layers=1), dict(QWEN3_MOE_AWQ, version="GEMV"), form="awq")
    _expect_bad(ck, "quantization_config.version = 'GEMV'")


@pytest.mark.parametrize("suffix", ["qweight", "qzeros", "scales"])
def test_shape_disagreeing_with_config(tmp_path, suffix):
    path, _ = tiny(tmp_path / "ck", dict(QWEN3_MOE_AWQ, group_size=32), form="awq", symmetric=False)
    shard = path / "model.safetensors"
    tensors = load_file(str(shard))
    victim = f"model.layers.0.mlp.experts.0.down_proj.{suffix}"
    tensors[victim] = tensors[victim][:, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _expect_bad(path, f"tensor {victim} is")
