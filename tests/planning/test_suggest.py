"""Planning before quantizing, and `--suggest`: the Qwen3-30B-A3B base planned under W4A16 g128
gives the real checkpoint's verdicts; every suggestion is re-checked here by inspecting the
configuration it names from scratch (the full inspect path, headers synthesized again)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import modelckpt as m
import wna16ctl
from wna16ctl.cli import cli
from wna16ctl.planning import rules

IGNORE = list(m.RECIPE_IGNORE)
RECIPE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: W4A16
      ignore: ["lm_head", "re:.*mlp\\\\.gate$", "re:.*shared_expert_gate$", "re:.*block_sparse_moe\\\\.gate$"]
"""


def _base(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "quantization_config"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-30B-A3B-Instruct-2507 at its published sizes (48 layers, 128 experts, hidden 2048,
    moe_intermediate 768, 32 query / 4 KV heads of 128), headers only: the base and the W4A16
    checkpoint llm-compressor's usual recipe writes from it."""
    root = tmp_path_factory.mktemp("qwen3")
    q = m.qwen3_30b_a3b(layers=48)
    base = _base(q)
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    return {"base": m.write(root / "base", base, m.qwen3_moe(base, None), shards=16),
            "w4a16": m.write(root / "w4a16", q, m.qwen3_moe(q, q["quantization_config"]), shards=16),
            "recipe": recipe}


def _inspect(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, ["inspect", *args, "--json", "--vllm", "0.33.0"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def _per_tp(j: dict) -> list[bool]:
    return [all(lay["plans"][i]["loadable"] for lay in j["layers"])
            and all(lay["plans"][i]["loadable"] for lay in j["linear_layers"])
            and all(c["ok"] for c in j["model_checks"] if c["tp"] == tp and c["fatal"])
            for i, tp in enumerate(j["tp"])]


def _verdicts(j: dict) -> list:
    return [j["layers"], j["linear_layers"], j["model_checks"], j["loadable"]]


def test_base_with_w4a16_g128_gives_the_real_checkpoints_verdicts(qwen3):
    code, proposed = _inspect(str(qwen3["base"]), "--scheme", "W4A16", "--group-size", "128", "--tp", "1,2,4,8")
    assert code == 1 and _per_tp(proposed) == [True, True, False, False]
    assert {lay["plans"][2]["failure_rule"] for lay in proposed["layers"]} == {"I_p % group"}
    assert len(proposed["layers"]) == 48 and proposed["layers"][0]["num_experts"] == 128
    real_code, real = _inspect(str(qwen3["w4a16"]), "--tp", "1,2,4,8")
    assert real_code == code and _verdicts(real) == _verdicts(proposed)
    assert proposed["proposed"] is True and proposed["proposal"]["scheme"] == "W4A16"
    # the recipe gives the same
    rcode, by_recipe = _inspect(str(qwen3["base"]), "--recipe", str(qwen3["recipe"]), "--tp", "1,2,4,8")
    assert rcode == 1 and _verdicts(by_recipe) == _verdicts(real)


def _recheck(path: Path, s: dict, base_args: list[str]) -> bool:
    """Inspect the configuration a suggestion names, from scratch: its TP/EP, release, GPU and, for
    a proposal, the flags it gives (which replace the proposal's own)."""
    if s["kind"] == "pad":  # `wna16ctl pad CKPT --tp N ... -o OUT`: the padding planner, from scratch
        flags = shlex.split(s["flags"])
        assert flags[:3] == ["wna16ctl", "pad", "CKPT"] and flags[-2:] == ["-o", "OUT"], flags
        kw = {k: v for k, v in _api([f for f in flags[3:-2] if f != "--ep"]).items() if k not in ("tp", "vllm", "gpu")}
        plan = wna16ctl.pad(path, None, tp=s["tp"], ep=s["ep"], vllm=s["vllm"], gpu=s["gpu"], dry_run=True, **kw)
        return plan.verdict["loads"] and plan.to_json()["fields"] == s["pad"]["fields"]
    if s["kind"] == "convert":  # the headers `wna16ctl convert` plans, written out and inspected as any checkpoint
        path = _converted_headers(path, shlex.split(s["flags"]))
    args = [str(path), "--tp", str(s["tp"]), "--vllm", s["vllm"], "--gpu", s["gpu"]] + (["--ep"] if s["ep"] else [])
    flags = shlex.split(s["flags"])
    if "--moe-backend" in flags:  # the backend it tells the engine to use
        i = flags.index("--moe-backend")
        args += flags[i:i + 2]
        flags = flags[:i] + flags[i + 2:]
    if "--scheme" in flags or "--recipe" in flags:  # the proposal it names, in full
        args += flags
    else:
        args += base_args
    res = CliRunner().invoke(cli, ["inspect", *args, "--json"])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)["loadable"]


def _converted_headers(path: Path, flags: list[str]) -> Path:
    assert flags[:3] == ["wna16ctl", "convert", "CKPT"] and flags[-2:] == ["-o", "OUT"], flags
    to = flags[flags.index("--to") + 1] if "--to" in flags else None
    plan = wna16ctl.convert(path, None, dry_run=True, to=to)
    config = json.loads((path / "config.json").read_text()) | {"quantization_config": plan.config}
    tensors = [(t.name, t.dtype, list(t.shape)) for _, f in plan.files for t in f.tensors]
    return m.write(path.with_name(path.name + "-converted"), config, iter(tensors))


def test_suggest_at_tp4_names_ep_and_group_size_64_and_each_loads(qwen3):
    args = ["--scheme", "W4A16", "--group-size", "128"]
    code, j = _inspect(str(qwen3["base"]), *args, "--tp", "4", "--suggest")
    assert code == 1
    s = j["suggestions"]
    kinds = [x["kind"] for x in s]
    assert kinds[0] == "ep" and s[0]["vllm_flags"] == "--tensor-parallel-size 4 --enable-expert-parallel"
    g64 = next(x for x in s if x["kind"] == "group_size")
    assert g64["flags"] == "--scheme W4A16 --group-size 64" and g64["recipe"] == "group_size: 64"
    assert all(x["loads"] and x["for_tp"] == 4 and x["refused"] == ["I_p % group"] for x in s)
    for x in s:
        assert _recheck(qwen3["base"], x, args), x
    # the table shows the first two under the verdict, and padding in its place wherever it ranks
    assert "pad" in kinds[2:]
    res = CliRunner().invoke(cli, ["inspect", str(qwen3["base"]), *args, "--tp", "4", "--suggest", "--vllm", "0.33.0"])
    tail = res.output[res.output.index("verdict:"):]
    assert "--enable-expert-parallel" in tail and "--group-size 64" in tail and "re-planned, loads" in tail
    shown = [ln for ln in tail.splitlines() if "suggest " in ln]
    assert len(shown) == 3 and "zero-pad" in shown[2] and f"{len(s) - 3} more suggestions in --json" in tail


def test_suggest_on_the_quantized_checkpoint_names_ep_and_tp2(qwen3):
    code, j = _inspect(str(qwen3["w4a16"]), "--tp", "4", "--suggest")
    assert code == 1
    s = j["suggestions"]
    # the exact conversion to GPTQ (vLLM's GPTQ MoE method falls back to MoeWNA16 at TP 4) ranks with
    # the serving changes that keep TP 4
    assert [(x["kind"], x["tp"], x["ep"]) for x in s[:3]] == [("ep", 4, True), ("convert", 4, False), ("tp", 2, False)]
    assert s[2]["vllm_flags"] == "--tensor-parallel-size 2"
    requant = [x for x in s if x["requantize"]]
    assert requant and requant[0]["flags"] == "group_size: 64" and requant[0]["kind"] == "group_size"
    assert [x["kind"] for x in s].index("group_size") > [x["kind"] for x in s].index("tp")  # serving changes first
    for x in s:
        if not x["requantize"]:
            assert _recheck(qwen3["w4a16"], x, []), x
    # nothing is suggested where everything loads
    assert _inspect(str(qwen3["w4a16"]), "--tp", "1,2", "--suggest")[1]["suggestions"] == []


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Qwen3-30B-A3B layer with 8 experts, and a variant with expert width 1416 (a multiple of
    8 whose quarter, 354, is not a multiple of 4: the asymmetric pack-factor case)."""
    root = tmp_path_factory.mktemp("small")
    out = {}
    for name, width in (("b768", 768), ("b1416", 1416), ("b1410", 1410)):
        c = _base(m.qwen3_30b_a3b(layers=1))
        c.update(num_experts=8, moe_intermediate_size=width)
        out[name] = m.write(root / name, c, m.qwen3_moe(c, None))
    return out


# refusal kind -> (base, inspect options, the rule that refuses, suggestion kinds expected, a text of the refusal)
REFUSALS = {
    "group straddles a shard": ("b768", ["--scheme", "W4A16", "--tp", "4"], "I_p % group", {"ep", "tp", "group_size", "pad"},
                                "would otherwise cross TP shard boundaries"),
    "Marlin tile (act-order)": ("b768", ["--scheme", "W4A16", "--group-size", "32", "--actorder", "group", "--tp", "8",
                                         "--vllm", "0.29.0"], "actorder assert", {"ep", "tp", "actorder"},
                                "not a multiple of 64 (act-order disables tile padding)"),
    "act-order refused (release)": ("b768", ["--scheme", "W4A16", "--actorder", "group", "--tp", "2", "--vllm",
                                             "0.33.0"], "actorder refused", {"actorder", "vllm"},
                                    "no longer supported"),
    "channel-wise on sm90 with 0.33": ("b768", ["--scheme", "W4A16", "--group-size", "-1", "--tp", "2", "--vllm",
                                                "0.33.0", "--gpu", "sm90"], "channel assert",
                                       {"vllm", "gpu", "group_size", "moe_backend"}, "only Marlin does"),
    "grouped int8 at 0.27": ("b768", ["--scheme", "W8A16", "--tp", "2", "--vllm", "0.27.0"], "int8 grouped",
                             {"vllm", "group_size"}, "grouped int8 experts are refused"),
    "asym pack factor": ("b1416", ["--scheme", "W4A16_ASYM", "--group-size", "-1", "--tp", "4", "--vllm", "0.33.0",
                                   "--gpu", "sm80"], "2·I_p % pf", {"ep", "tp"}, "must be divisible by packed_factor"),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_suggestions_per_refusal_kind_each_replanned_and_loading(small, kind):
    base, args, rule, expected, text = REFUSALS[kind]
    insp = wna16ctl.inspect(small[base], **_api(args), suggest=True)
    j = insp.to_json()
    plan = j["layers"][0]["plans"][0]
    assert not j["loadable"]
    if j["failure_stage"] == "config":  # the release refuses quantization_config before any layer
        assert j["config_refusal"]["rule"] == rule and text in j["config_refusal"]["error"]
        rule = f"config: {rule}"
    else:
        assert plan["failure_rule"] == rule
        assert text in " ".join(plan["errors"] + list(plan["rejected"].values()))
    s = j["suggestions"]
    assert expected <= {x["kind"] for x in s}, [x["kind"] for x in s]
    proposal_args = [a for a in args if a not in ("--tp", "--vllm", "--gpu") and a not in _values(args)]
    for x in s:
        assert x["loads"] and rule in x["refused"]
        assert _recheck(small[base], x, proposal_args), x
    if kind == "grouped int8 at 0.27":
        v = next(x for x in s if x["kind"] == "vllm")
        assert v["vllm"] == rules.NEWEST and v["flags"] == f"--vllm {rules.NEWEST}"  # the newest that loads
    if kind == "channel-wise on sm90 with 0.33":
        g = next(x for x in s if x["kind"] == "gpu")
        assert g["gpu"] == "sm89"  # the nearest architecture whose backend order puts Marlin first
        assert next(x for x in s if x["kind"] == "vllm")["vllm"] == "0.31.0"
        b = next(x for x in s if x["kind"] == "moe_backend")  # Marlin passes its gate when it is asked for
        assert b["flags"] == "--moe-backend marlin" and b["vllm_flags"] == "--moe-backend marlin"
    if kind == "Marlin tile (act-order)":
        assert next(x for x in s if x["kind"] == "actorder")["flags"].endswith("--actorder static")


def _values(args: list[str]) -> set[str]:
    return {args[i + 1] for i, a in enumerate(args) if a in ("--tp", "--vllm", "--gpu")}


def _api(args: list[str]) -> dict:
    """CLI options as `wna16ctl.inspect` keyword arguments."""
    kw: dict = {}
    it = iter(args)
    for a in it:
        key = a.removeprefix("--").replace("-", "_")
        value = next(it)
        kw[key] = int(value) if key == "group_size" else value
    return kw


def test_symmetric_weights_load_a_whole_partition_that_is_no_whole_word(small):
    # width 1410 is no whole number of int32 words: asymmetric zero points (packed along the
    # width) cannot load at any TP, while from 0.29.0 the engine loads symmetric weights of a whole
    # partition (TP 1) all the same, so "symmetric" is the one change that loads
    args = ["inspect", str(small["b1410"]), "--tp", "1", "--scheme", "W4A16_ASYM", "--group-size", "-1",
            "--gpu", "sm80", "--vllm", "0.33.0", "--suggest"]
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 1
    s = json.loads(res.stdout)["suggestions"]
    assert [x["kind"] for x in s] == ["symmetric"] and s[0]["flags"] == "--scheme W4A16 --group-size -1"
    assert _recheck(small["b1410"], s[0], [])


def test_the_table_says_when_no_change_loads(small):
    from rich.console import Console

    from wna16ctl.render import render_suggestions

    insp = wna16ctl.inspect(small["b1410"], tp=1, scheme="W4A16_ASYM", group_size=-1, gpu="sm80", vllm="0.33.0")
    insp.suggestions = []  # a search that found nothing
    console = Console(record=True, width=200)
    render_suggestions(console, insp)
    text = console.export_text()
    assert "TP 1: no change (or pair of changes) that was tried loads" in text
    # the line names every kind of change the search tries, padding and vLLM's --moe-backend among them
    from wna16ctl.planning import suggest

    assert "padding (wna16ctl pad)" in text and "--moe-backend" in text
    assert set(suggest.KINDS_TRIED) >= set(suggest.LIMITS) | {"pad"}


def test_pairs_of_changes_when_no_single_one_loads(small):
    # act-order group (refused from 0.30.0) and 192 columns per rank (straddling groups of 128) at TP 4:
    # one change fixes one refusal; the pairs are listed, each re-inspected from scratch
    args = ["--scheme", "W4A16", "--actorder", "group"]
    insp = wna16ctl.inspect(small["b768"], tp=4, scheme="W4A16", actorder="group", vllm="0.33.0", suggest=True)
    s = [x.to_json() for x in insp.suggestions]
    assert s and all("+" in x["kind"] for x in s)
    assert s[0]["kind"] == "ep+actorder" and s[0]["flags"] == "--tp 4 --ep --scheme W4A16 --actorder static"
    assert s[0]["vllm_flags"] == "--tensor-parallel-size 4 --enable-expert-parallel"
    assert "config: actorder refused" in s[0]["refused"]  # the engine stops there; the straddle comes after
    assert not _recheck(small["b768"], {**s[0], "ep": False, "flags": "--scheme W4A16 --actorder static"}, args)
    for x in s:
        assert _recheck(small["b768"], x, args), x


def test_new_json_keys_are_documented(small, tmp_path):
    from tests.test_json_docs import documented

    doc = documented("inspect-json.md")
    j = wna16ctl.inspect(small["b768"], tp=4, scheme="W4A16", suggest=True).to_json()
    assert {"proposed", "proposal", "suggestions"} <= set(j) and {"proposed", "proposal", "suggestions"} <= doc
    assert set(j["proposal"]) <= doc, set(j["proposal"]) - doc
    assert j["suggestions"] and set(j["suggestions"][0]) <= doc, set(j["suggestions"][0]) - doc


def test_pairs_on_a_quantized_checkpoint_serving_first(tmp_path):
    c = m.qwen3_30b_a3b(layers=1)
    c["num_experts"] = 8
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    ck = m.write(tmp_path / "ag", c, m.qwen3_moe(c, c["quantization_config"]))
    s = [x.to_json() for x in wna16ctl.inspect(ck, tp=4, vllm="0.33.0", suggest=True).suggestions]
    assert [x["kind"] for x in s] == ["ep+vllm", "tp+vllm", "ep+actorder", "tp+actorder"]
    assert s[0]["flags"] == "--tp 4 --ep --vllm 0.29.0" and not s[0]["requantize"]
    assert s[2]["flags"] == "--tp 4 --ep; actorder: static" and s[2]["requantize"]
    for x in s[:2]:
        assert _recheck(ck, x, []), x
