"""The AutoRound reader (`sources/formats/auto_round.py`): packing_format to stored form,
extra_config and block_name_to_quantize as vLLM's INC parser resolves them, bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.sources.qweight_ckpt import tiny
from tests.sources.test_format_gptq import _expect_bad, _module_canonical
from wna16ctl.errors import BadInput
from wna16ctl.sources.config import parse_quantization_config
from wna16ctl.sources.formats import CODES, ZERO_POINTS
from wna16ctl.sources.formats.bits import unpack_bits

P = Path("config.json")
# auto-round 0.16's block for an int4 export in its own format
AUTO_ROUND = {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "autoround_version": "0.16.1",
              "block_name_to_quantize": "model.layers", "quant_method": "auto-round",
              "packing_format": "auto_round:auto_gptq"}


@pytest.mark.parametrize("packing,form", [("auto_round:auto_gptq", "gptq"), (None, "gptq"),
                                          ("auto_round:auto_awq", "awq"), ("auto_round", "gptq_v2"),
                                          ("auto_round:gptqmodel", "gptq_v2")])
def test_packing_format_names_the_stored_form(packing, form):
    qc = dict(AUTO_ROUND, packing_format=packing)
    q = parse_quantization_config(qc, P)
    assert q.quant_method == "auto-round" and q.scheme_for("model.layers.0.mlp.experts.0.up_proj").format == form


def test_intel_alias_and_extra_config():
    qc = dict(AUTO_ROUND, quant_method="intel/auto-round", block_name_to_quantize=["model.layers"],
              extra_config={"model.layers.0.mlp.experts.1.down_proj": {"bits": 8, "group_size": 32},
                            "mlp.gate": {"bits": 16}, r".*layers\.2\..*": {"sym": False}})
    q = parse_quantization_config(qc, P)
    assert q.quant_method == "auto-round"
    s = q.scheme_for("model.layers.0.mlp.experts.1.down_proj")
    assert (s.num_bits, s.group_size, s.symmetric) == (8, 32, True)
    assert q.scheme_for("model.layers.3.mlp.gate") is None  # dotted suffix, 16 bits
    assert not q.scheme_for("model.layers.2.mlp.experts.0.gate_proj").symmetric  # regex key
    assert q.scheme_for("model.layers.4.mlp.experts.0.gate_proj").num_bits == 4
    assert q.scheme_for("lm_head") is None and q.scheme_for("mtp.layers.0.mlp.experts.0.up_proj") is None


@pytest.mark.parametrize("mutate,needle", [
    (dict(packing_format="auto_round:fp8"), "quantization_config.packing_format = 'auto_round:fp8'"),
    (dict(data_type="mx_fp"), "quantization_config.data_type = 'mx_fp'"),
    (dict(bits=6), "quantization_config.bits = 6"),
    (dict(packing_format="auto_round:auto_awq", bits=2), "quantization_config.bits = 2"),
    (dict(extra_config={"x": {"bits": 5}}), "extra_config['x'].bits = 5"),
])
def test_bad_auto_round_config_names_the_key(mutate, needle):
    with pytest.raises(BadInput) as e:
        parse_quantization_config(dict(AUTO_ROUND, **mutate), P)
    assert needle in e.value.message


def test_reader_follows_the_packing_format(tmp_path):
    qc = dict(AUTO_ROUND, group_size=32, sym=False, packing_format="auto_round:auto_awq")
    path, logical = tiny(tmp_path / "ck", qc, form="awq", symmetric=False)
    canon = _module_canonical(path, (1, "up"))
    p = logical["model.layers.0.mlp.experts.1.up_proj"]
    assert torch.equal(unpack_bits(canon[CODES], 4, dim=1, size=64), p["codes"])
    assert torch.equal(unpack_bits(canon[ZERO_POINTS], 4, dim=0, size=96), p["zeros"])


def test_unknown_packing_format_via_cli(tmp_path):
    path, _ = tiny(tmp_path / "ck", dict(AUTO_ROUND, group_size=32, packing_format="auto_round:mlx"), form="gptq")
    _expect_bad(path, "quantization_config.packing_format = 'auto_round:mlx'")
