"""Checkpoints the planner once had no answer for, or a wrong one: bit widths 2-8 in both packings,
a packed lm_head, Mixtral experts targeted by their own names.  Each checkpoint is written header
only (tests/conformance/ckptcase.py) and read through the CLI's reader; the verdicts are those
the releases' own code gives (make conformance compares them case by case)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conformance.ckptcase import write_case
from wna16ctl.cli import cli
from wna16ctl.planning.linear import plan_linear
from wna16ctl.planning.moe import plan_layer
from wna16ctl.sources import open_checkpoint

BASE = {"hidden_size": 1024, "intermediate_size": 512, "num_experts": 4, "num_bits": 4, "group_size": 128,
        "group_size_null": False, "symmetric": True, "actorder": None, "strategy": "group", "tp": 1, "ep": False}


def _open(tmp_path: Path, **over):
    return open_checkpoint(write_case({**BASE, **over}, tmp_path / "ckpt"))


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7])
@pytest.mark.parametrize("symmetric", [True, False])
def test_every_width_reads_and_plans_as_the_releases_do(tmp_path, bits, symmetric):
    ck = _open(tmp_path, num_bits=bits, symmetric=symmetric, packing="dense")
    (layer,) = ck.layers
    # 0.27/0.28: int4 and int8 only (asymmetric widths fail earlier, on the zero-point type table)
    old = plan_layer(layer, 1, engine="0.27.1", gpu="sm90")
    assert old.failure_stage == "method" and not old.loadable
    assert ("KeyError" in old.errors[0]) == (not symmetric), old.errors
    # 0.29-0.30 build symmetric widths on Humming; the zero-point table names every width from 0.31
    p29 = plan_layer(layer, 1, engine="0.29.0", gpu="sm90")
    assert p29.loadable == symmetric, p29.errors
    new = plan_layer(layer, 2, engine="0.33.0", gpu="sm90")
    assert new.loadable and new.backend.value == "humming", new.errors
    assert new.quant_type == (f"uint{bits}b{1 << (bits - 1)}" if symmetric else f"uint{bits}")
    assert layer.packing == ("same" if bits == 2 else "dense")


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_whole_word_packing_is_read_and_refused_at_load(tmp_path, bits):
    ck = _open(tmp_path, num_bits=bits, packing="word")
    (layer,) = ck.layers
    p = plan_layer(layer, 1, engine="0.33.0", gpu="sm90")
    assert p.failure_stage == "load" and p.failure_rule == "word packing", p.errors
    assert layer.packing == "word"
    assert "compressed-tensors 0.20" in p.errors[0]


def test_inspect_answers_for_a_three_bit_checkpoint(tmp_path):
    ck = write_case({**BASE, "num_bits": 3}, tmp_path / "ckpt")
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "1,2", "--vllm", "0.33.0", "--gpu", "sm90", "--json"])
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.output)
    assert "internal error" not in res.output
    assert json.dumps(doc).count("humming") >= 2


def test_mixtral_names_targeted_by_name_before_and_after_0_32(tmp_path):
    ck = _open(tmp_path, names="w1_w3_w2", targets="names")
    (layer,) = ck.layers
    for version in ("0.27.1", "0.31.0"):
        p = plan_layer(layer, 1, engine=version, gpu="sm80")
        assert p.failure_stage == "load" and p.failure_rule == "unquantized method", (version, p.errors)
        assert "w13_weight_packed" in p.errors[0]
    assert plan_layer(layer, 1, engine="0.32.0", gpu="sm80").loadable
    # the class target Linear reaches the gate_proj names too: every release loads it
    (linear_targeted,) = _open(tmp_path / "b", names="w1_w3_w2").layers
    assert plan_layer(linear_targeted, 1, engine="0.27.1", gpu="sm80").loadable


def test_packed_lm_head_needs_a_target_that_names_it(tmp_path):
    ck = _open(tmp_path, lm_head="packed")
    (head,) = [lay for lay in ck.linear_layers if lay.kind == "lm_head"]
    for version in ("0.27.1", "0.33.0"):
        p = plan_linear(head, 1, version, "sm90", "bfloat16")
        assert not p.loadable and p.failure_rule == "built unquantized", p
        assert "There is no module or parameter named 'lm_head.weight_packed'" in p.errors[0]
    named = _open(tmp_path / "b", lm_head="packed+target")
    (head,) = [lay for lay in named.linear_layers if lay.kind == "lm_head"]
    assert plan_linear(head, 1, "0.33.0", "sm90", "bfloat16").loadable


def test_demo_bits_writes_what_the_reader_plans(make_ckpt):
    """`demo --bits 5 --asym`: compressed-tensors packs the codes densely; the reader takes that
    packing and the newest release plans the layers on Humming."""
    ck = open_checkpoint(make_ckpt(hidden_size=128, intermediate_size=128, num_experts=4, vocab_size=320, num_bits=5,
                                   symmetric=False))
    for layer in ck.layers:
        assert layer.packing == "dense" and layer.scheme.num_bits == 5
        assert plan_layer(layer, 1, engine="0.33.0", gpu="sm90").backend.value == "humming"


def test_vllm_layout_refuses_widths_whose_words_straddle_ranks(make_ckpt, tmp_path):
    ck = make_ckpt(hidden_size=128, intermediate_size=128, num_experts=4, vocab_size=320, num_bits=3, group_size=32)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", "0.33.0", "-o", str(out)])
    assert res.exit_code == 2 and "3-bit experts" in res.output and not out.exists(), res.output
    shown = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "2", "--vllm", "0.33.0", "--gpu", "sm90"])
    assert shown.exit_code == 0 and "humming" in shown.output and "--layout vllm" not in shown.output, shown.output


def test_actorder_dynamic_linear_layers_load_without_a_hazard(tmp_path):
    """vLLM 0.27-0.29 treat 'dynamic' as act-order in the linear scheme: o_proj (K split at TP 2) goes
    to Marlin, and nothing about the checkpoint is wrong (exit 0)."""
    import tests.modelckpt as m

    config = m.qwen3_30b_a3b(layers=1)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "dynamic"
    ck = m.write(tmp_path / "ckpt", config, m.qwen3_moe(config, config["quantization_config"]))
    for version in ("0.27.1", "0.29.0"):
        res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "2", "--ep", "--vllm", version, "--gpu", "sm90",
                                       "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        (o_proj,) = [lay for lay in doc["linear_layers"] if lay["name"].endswith("self_attn.o_proj")]
        assert o_proj["plans"][0]["kernel"] == "MarlinLinearKernel", o_proj["plans"][0]
