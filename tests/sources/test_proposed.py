"""A proposed quantization of an unquantized base (`--scheme`, `--recipe`): the presets come from
compressed-tensors' own table, the synthesized headers are those of the quantized checkpoint
(tests/modelckpt.py writes that one with its own writer), and a recipe equals its flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import modelckpt as m
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.sources import open_checkpoint
from wna16ctl.sources.proposed import DEFAULT_IGNORE, open_proposed, preset_weights, proposal_from_flags
from wna16ctl.sources.recipe import make_proposal, read_recipe

IGNORE = list(m.RECIPE_IGNORE)


def unquantized(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "quantization_config"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("proposed")
    q = m.qwen3_30b_a3b(layers=2)
    q["num_experts"] = 8
    asym = dict(q, quantization_config=m.w4a16(IGNORE, symmetric=False))
    channel8 = dict(q, quantization_config=m.w4a16(IGNORE, group_size=-1, num_bits=8))
    base = unquantized(q)
    return {
        "base": m.write(root / "base", base, m.qwen3_moe(base, None), shards=2),
        "w4a16": m.write(root / "w4a16", q, m.qwen3_moe(q, q["quantization_config"]), shards=2),
        "asym": m.write(root / "asym", asym, m.qwen3_moe(asym, asym["quantization_config"]), shards=2),
        "channel8": m.write(root / "channel8", channel8, m.qwen3_moe(channel8, channel8["quantization_config"])),
    }


def _tensors(ck) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (ck.files.raw(n)["dtype"], tuple(ck.files.raw(n)["shape"])) for n in ck.files.names()}


def test_presets_are_compressed_tensors_own():
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for name in ("W4A16", "W4A16_ASYM", "W8A16"):
        lib = PRESET_SCHEMES[name]["weights"]
        ours = preset_weights(name)
        assert (ours["num_bits"], ours["symmetric"], ours["group_size"], ours["strategy"]) == (
            lib.num_bits, lib.symmetric, lib.group_size, str(getattr(lib.strategy, "value", lib.strategy)))
    with pytest.raises(UsageError, match="W4A16"):
        preset_weights("W8A8")


@pytest.mark.parametrize("name, flags", [("w4a16", dict(scheme="W4A16")),
                                         ("asym", dict(scheme="W4A16_ASYM")),
                                         ("channel8", dict(scheme="W8A16", group_size=-1))])
def test_headers_are_those_of_the_quantized_checkpoint(models, name, flags):
    proposed = open_proposed(models["base"], proposal_from_flags(ignore=IGNORE, **flags))
    real = open_checkpoint(models[name])
    assert _tensors(proposed) == _tensors(real)
    # (channel-wise: the fixture writes group_size null, --group-size -1 writes -1; the schemes agree otherwise)
    assert [lay.scheme.to_json() for lay in proposed.layers] == [lay.scheme.to_json() for lay in real.layers]
    assert [(lay.name, [s.scheme.to_json() for s in lay.shards]) for lay in proposed.linear_layers] == \
        [(lay.name, [s.scheme.to_json() for s in lay.shards]) for lay in real.linear_layers]
    assert proposed.config.quant.scheme_for("model.layers.0.mlp.gate") is None  # the router stays bf16


def test_default_ignore_is_the_usual_moe_list(models):
    ck = open_proposed(models["base"], proposal_from_flags("W4A16"))
    assert "lm_head" in DEFAULT_IGNORE and "lm_head.weight" in ck.files  # lm_head is not quantized
    assert "model.layers.0.mlp.gate.weight" in ck.files
    assert "model.layers.0.mlp.experts.7.down_proj.weight_packed" in ck.files
    assert "model.embed_tokens.weight" in ck.files  # an embedding is not a Linear


def test_actorder_group_stores_g_idx(models):
    ck = open_proposed(models["base"], proposal_from_flags("W4A16", actorder="group", ignore=IGNORE))
    e = ck.files.raw("model.layers.0.mlp.experts.0.down_proj.weight_g_idx")
    assert e is not None and e["shape"] == [768] and e["dtype"] == "I32"
    assert ck.layers[0].scheme.act_order and ck.layers[0].g_idx_form == "present"
    assert any("no longer writes it" in w for w in ck.warnings)


def test_a_quantized_base_is_refused(models):
    with pytest.raises(BadInput, match="already has a quantization_config"):
        open_proposed(models["w4a16"], proposal_from_flags("W4A16"))
    res = CliRunner().invoke(cli, ["inspect", str(models["w4a16"]), "--scheme", "W4A16"])
    assert res.exit_code == 2 and "already has a quantization_config" in res.output


RECIPE = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      targets: [Linear]
      scheme: W4A16
      ignore: ["lm_head", "re:.*mlp\\\\.gate$", "re:.*shared_expert_gate$", "re:.*block_sparse_moe\\\\.gate$"]
"""


def _verdicts(j: dict) -> list:
    return [j["layers"], j["linear_layers"], j["model_checks"], j["loadable"]]


def test_recipe_equals_its_flags(models, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    p = read_recipe(recipe)
    assert p.scheme == "W4A16" and p.modifier == "GPTQModifier" and list(p.ignore) == IGNORE
    # GPTQModifier's default ordering is static, written into every group
    assert p.groups["group_0"]["weights"]["actorder"] == "static"
    by_recipe = CliRunner().invoke(cli, ["inspect", str(models["base"]), "--recipe", str(recipe), "--json"])
    ign = [a for pat in IGNORE for a in ("--ignore", pat)]
    by_flags = CliRunner().invoke(cli, ["inspect", str(models["base"]), "--scheme", "W4A16", "--actorder", "static",
                                        *ign, "--json"])
    assert by_recipe.exit_code == by_flags.exit_code == 1
    a, b = json.loads(by_recipe.stdout), json.loads(by_flags.stdout)
    assert _verdicts(a) == _verdicts(b)
    assert a["proposed"] is True and a["proposal"]["recipe"] == str(recipe)
    assert b["proposal"]["scheme"] == "W4A16"
    # static ordering is format-identical to none: the quantized fixture (actorder null) plans the same
    real = json.loads(CliRunner().invoke(cli, ["inspect", str(models["w4a16"]), "--json"]).stdout)
    assert _verdicts(real) == _verdicts(json.loads(CliRunner().invoke(
        cli, ["inspect", str(models["base"]), "--scheme", "W4A16", *ign, "--json"]).stdout))
    assert real["proposed"] is False


def test_recipe_config_groups_and_preset_mapping(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("""
stage:
  mods:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: ["re:.*experts.*"]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64}
""")
    p = read_recipe(r)
    assert p.modifier == "QuantizationModifier" and p.scheme is None
    assert p.groups["group_0"]["weights"]["group_size"] == 64 and p.groups["group_0"]["weights"].get("actorder") is None
    r.write_text("s:\n  m:\n    GPTQModifier:\n      scheme: {W8A16: [Linear]}\n      actorder: weight\n")
    p = read_recipe(r)
    assert p.scheme == "W8A16" and p.groups["group_0"]["weights"]["actorder"] == "weight"
    assert make_proposal(None, r, group_size=-1).groups["group_0"]["weights"]["strategy"] == "channel"


@pytest.mark.parametrize("text, message", [
    ("a: [", "not valid YAML"),
    ("a: {b: 1}", "no GPTQModifier or QuantizationModifier"),
    ("GPTQModifier: {scheme: W4A16, config_groups: {g: {targets: [Linear], weights: {num_bits: 4}}}}",
     "both scheme and config_groups"),
    ("QuantizationModifier: {scheme: FP8}", "weight-only integer presets"),
    ("QuantizationModifier: {config_groups: {g: {targets: [Linear], weights: {num_bits: 8}, "
     "input_activations: {num_bits: 8}}}}", "quantizes activations"),
    ("GPTQModifier: {actorder: weight, config_groups: {g: {targets: [Linear], weights: {num_bits: 4, "
     "strategy: group, group_size: 128, actorder: static}}}}", "differ"),
])
def test_bad_recipes_are_one_line_errors(tmp_path, text, message, models):
    r = tmp_path / "bad.yaml"
    r.write_text(text)
    res = CliRunner().invoke(cli, ["inspect", str(models["base"]), "--recipe", str(r)])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert str(r) in res.output


@pytest.mark.parametrize("args, message", [
    (["--group-size", "64"], "add --scheme or --recipe"),
    (["--scheme", "W4A16", "--recipe", "x.yaml"], "exclude each other"),
    (["--scheme", "W4A16", "--group-size", "0"], "--group-size 0"),
])
def test_option_misuse_is_a_usage_error(models, args, message):
    res = CliRunner().invoke(cli, ["inspect", str(models["base"]), *args])
    assert res.exit_code == 2 and message in res.output


def test_a_hub_base_is_planned_from_its_headers(models, tmp_path):
    from tests.hubserver import FakeHub
    from tests.sources.test_hub import wna16ctl as run

    hub = FakeHub()
    try:
        hub.add("acme/base", models["base"])
        args = ["--scheme", "W4A16", "--tp", "1,2,4", "--json"]
        remote = run(hub, tmp_path / "hf", "inspect", "acme/base", *args)
        local = CliRunner().invoke(cli, ["inspect", str(models["base"]), *args])
        assert remote.returncode == local.exit_code == 1, remote.stderr
        a, b = json.loads(remote.stdout), json.loads(local.stdout)
        assert [a["layers"], a["linear_layers"], a["model_checks"]] == [b["layers"], b["linear_layers"], b["model_checks"]]
        assert a["source"]["repo_id"] == "acme/base" and a["proposed"] is True
        gets = hub.range_gets()
        assert gets and all(r[2] is not None for r in gets)  # shard headers by range request, never a whole shard
    finally:
        hub.close()


def test_layers_llm_compressor_refuses_are_named(tmp_path):
    c = unquantized(m.qwen3_30b_a3b(layers=1))
    c.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1410)  # down_proj input 1410 is not a multiple of 128
    base = m.write(tmp_path / "b", c, m.qwen3_moe(c, None))
    ck = open_proposed(base, proposal_from_flags("W4A16"))
    w = [x for x in ck.warnings if "refuses to quantize" in x]
    assert len(w) == 1 and "model.layers.0.mlp.experts.0.down_proj (1410 columns)" in w[0] and "and 1 more" in w[0]
    # the scales of such a layer hold a partial last group, as older writers stored them
    assert ck.files.raw("model.layers.0.mlp.experts.0.down_proj.weight_scale")["shape"] == [2048, 12]
