"""The engine's environment switches, `--moe-backend`, and checkpoint-level config-parse verdicts,
on header-only checkpoints (tests/modelckpt.py) through the CLI and the API."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import modelckpt as m
from wna16ctl.cli import cli
from wna16ctl.errors import UsageError
from wna16ctl.planning.engine_env import SWITCHES, make_switches, wna16_moe_backends
from wna16ctl.planning.inspection import inspect_checkpoint
from wna16ctl.planning.linear import BATCH_INVARIANT, MACHETE, MARLIN
from wna16ctl.planning import rules


def _kimi(c, q):
    return m.deepseek_v3(c["text_config"], q, "language_model.model", "language_model.lm_head")


def _actorder_group(targets: list[str], name: str = "group_1") -> dict:
    return {"targets": targets, "format": "pack-quantized", "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                        "dynamic": False, "actorder": "group"}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("env")
    kimi = m.kimi_k25()
    qwen = m.qwen3_30b_a3b(layers=1)
    # a second group with act-order that targets a module the model does not have
    unmatched = copy.deepcopy(qwen)
    unmatched["quantization_config"]["config_groups"]["group_1"] = _actorder_group([r"re:.*visual.*"])
    # act-order only in attention: the experts' own group is plain
    attention = copy.deepcopy(qwen)
    attention["quantization_config"]["config_groups"]["group_1"] = _actorder_group([r"re:.*self_attn.*"])
    out = {"kimi": m.write(root / "kimi", kimi, _kimi(kimi, kimi["quantization_config"])),
           "qwen": m.write(root / "qwen", qwen, m.qwen3_moe(qwen, qwen["quantization_config"]))}
    # the tensors follow group_0 (the header writer reads only group_0): the verdict is the config's
    out["unmatched"] = m.write(root / "unmatched", unmatched, m.qwen3_moe(qwen, qwen["quantization_config"]))
    out["attention"] = m.write(root / "attention", attention, m.qwen3_moe(qwen, qwen["quantization_config"]))
    return out


def _moe_backends(insp) -> set[str | None]:
    return {p.backend.value if p.backend else None for plans in insp.plans.values() for p in plans}


def test_kimi_on_blackwell_runs_marlin_unless_flashinfer_int4_is_switched_on(ckpts: dict[str, Path]) -> None:
    default = inspect_checkpoint(ckpts["kimi"], (8,), vllm="0.33.0", gpu="sm100")
    assert default.loadable and _moe_backends(default) == {"marlin"}
    why = next(iter(default.plans.values()))[0].rejected["flashinfer_trtllm"]
    assert "VLLM_USE_FLASHINFER_MOE_INT4" in why
    on = inspect_checkpoint(ckpts["kimi"], (8,), vllm="0.33.0", gpu="sm100",
                            env=["VLLM_USE_FLASHINFER_MOE_INT4=1"])
    assert on.loadable and _moe_backends(on) == {"flashinfer_trtllm"}
    doc = on.to_json()["engine"]
    assert doc["env"]["VLLM_USE_FLASHINFER_MOE_INT4"] == {"value": "1", "default": "0", "source": "--env",
                                                           "gates": "moe"}
    assert doc["moe_backend"] == "auto"
    # the same through the command line
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["kimi"]), "--tp", "8", "--gpu", "sm100", "--vllm", "0.33.0",
                                   "--env", "VLLM_USE_FLASHINFER_MOE_INT4=1", "--json"])
    assert res.exit_code == 0, res.output
    layers = json.loads(res.stdout)["layers"]
    assert {p["backend"] for lay in layers for p in lay["plans"]} == {"flashinfer_trtllm"}


@pytest.mark.parametrize("version", ["0.27.0", "0.28.0", "0.29.0"])
def test_act_order_on_blackwell_is_not_refused_before_030(version: str, tmp_path: Path) -> None:
    # the FlashInfer backend asserted actorder != group; by default it is off, so Marlin takes the layer
    config = m.qwen3_30b_a3b(layers=1)
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32, actorder="group")
    ck = m.write(tmp_path / "g32", config, m.qwen3_moe(config, config["quantization_config"]))
    insp = inspect_checkpoint(ck, (1, 2), vllm=version, gpu="sm100")
    assert _moe_backends(insp) == {"marlin"} and all(p.loadable for ps in insp.plans.values() for p in ps)
    on = inspect_checkpoint(ck, (1,), vllm=version, gpu="sm100", env={"VLLM_USE_FLASHINFER_MOE_INT4": "1"})
    assert not on.loadable and "act-order" in next(iter(on.plans.values()))[0].errors[0]


def test_moe_backend_forces_one_backend(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # channel-wise experts on sm90: Humming heads the list from 0.32.0 and asserts group strategy;
    # forcing Marlin passes its gate
    config = m.qwen3_30b_a3b(layers=1, group_size=-1)
    ck = m.write(tmp_path / "channel", config, m.qwen3_moe(config, config["quantization_config"]))
    auto = inspect_checkpoint(ck, (2,), vllm="0.33.0", gpu="sm90")
    plan = next(iter(auto.plans.values()))[0]
    assert not plan.loadable and plan.failure_rule == "channel assert"
    forced = inspect_checkpoint(ck, (2,), vllm="0.33.0", gpu="sm90", moe_backend="marlin")
    plan = next(iter(forced.plans.values()))[0]
    assert plan.loadable and plan.backend.value == "marlin"
    assert forced.to_json()["engine"]["moe_backend"] == "marlin"
    # a backend that does not fit is an error at backend selection, not a fall-back
    tri = next(iter(inspect_checkpoint(ck, (2,), vllm="0.33.0", moe_backend="flashinfer_trtllm").plans.values()))[0]
    assert tri.failure_stage == "oracle" and "'FLASHINFER_TRTLLM' does not support" in tri.errors[0]
    # a name the release does not map for WNA16 MoE
    old = next(iter(inspect_checkpoint(ck, (1,), vllm="0.27.0", moe_backend="rdna3").plans.values()))[0]
    assert old.failure_stage == "oracle" and "moe_backend='rdna3' is not supported" in old.errors[0]
    assert "rdna3" not in wna16_moe_backends("0.29.0") and "rdna3" in wna16_moe_backends("0.30.0")


def test_env_is_checked(ckpts: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="VLLM_NOT_A_SWITCH"):
        inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.33.0", env=["VLLM_NOT_A_SWITCH=1"])
    with pytest.raises(UsageError, match="integer"):
        inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.33.0", env=["VLLM_USE_FLASHINFER_MOE_INT4=yes"])
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["qwen"]), "--env", "NOEQUALS", "--json"])
    assert res.exit_code == 2 and "NAME=VALUE" in res.output
    assert {s.name for s in SWITCHES} >= {"VLLM_USE_FLASHINFER_MOE_INT4", "VLLM_DISABLED_KERNELS"}


def test_disabled_linear_kernels_and_batch_invariance(ckpts: dict[str, Path]) -> None:
    def kernels(insp) -> set[str | None]:
        return {p.kernel for plans in insp.linear_plans.values() for p in plans}

    base = inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.33.0", gpu="sm90")
    assert MACHETE in kernels(base) or "HummingLinearKernel" in kernels(base)
    off = inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.27.0", gpu="sm90",
                             env=["VLLM_DISABLED_KERNELS=MacheteLinearKernel"])
    assert MACHETE not in kernels(off) and MARLIN in kernels(off)
    some = next(p for plans in off.linear_plans.values() for p in plans)
    assert "disabled by environment variable" in some.rejected[MACHETE]
    bi = inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.33.0", env=["VLLM_BATCH_INVARIANT=1"])
    assert kernels(bi) == {BATCH_INVARIANT}
    # a release that does not read the switch ignores it
    old = inspect_checkpoint(ckpts["qwen"], (1,), vllm="0.27.0", env=["VLLM_BATCH_INVARIANT=1"])
    assert BATCH_INVARIANT not in kernels(old)
    assert old.to_json()["engine"]["env"]["VLLM_BATCH_INVARIANT"]["source"] == "not read by this release"


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0", "0.33.0"])
def test_unmatched_act_order_group_refuses_the_checkpoint_at_config_parse(ckpts: dict[str, Path], version: str) -> None:
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["unmatched"]), "--tp", "1,2", "--vllm", version, "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["loadable"] is False and doc["failure_stage"] == "config"
    assert doc["config_refusal"]["group"] == "group_1" and "no longer supported" in doc["config_refusal"]["error"]
    for lay in doc["layers"] + doc["linear_layers"]:
        for p in lay["plans"]:
            assert p["failure_stage"] == "config" and p["errors"][0].startswith(
                "not reached (checkpoint refused at config parse)")
    for p in (p for lay in doc["layers"] for p in lay["plans"]):
        assert p["backend"] is None and p["w2_scale_sharding"] is None and p["padded_intermediate"] is None
        assert p["rank_bytes"] is None


def test_unmatched_act_order_group_loads_before_030(ckpts: dict[str, Path]) -> None:
    res = CliRunner().invoke(cli, ["inspect", str(ckpts["unmatched"]), "--tp", "1,2", "--vllm", "0.29.0", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["failure_stage"] is None and doc["config_refusal"] is None
    every = inspect_checkpoint(ckpts["unmatched"], (1,), vllm="all").to_json()["versions"]
    # refused at config parse from 0.30.0 on
    assert {v["vllm"]: v["loadable"] for v in every} == {
        v: rules.version_key(v) < rules.version_key("0.30.0") for v in rules.RELEASES}
    assert all(v["failure_stage"] == ("config" if not v["loadable"] else None) for v in every)


def test_attention_only_act_order_refuses_the_experts_too(ckpts: dict[str, Path]) -> None:
    insp = inspect_checkpoint(ckpts["attention"], (1,), vllm="0.33.0")
    assert not insp.loadable and insp.config_refusal is not None
    assert all(p.backend is None for plans in insp.plans.values() for p in plans)  # no "humming ok"


def test_refused_layers_carry_null_sharding(ckpts: dict[str, Path]) -> None:
    # I_p = 768/16 = 48 is not a multiple of the group size: refused in create_weights, so the
    # w2 sharding is the release's; a layer refused before (I % TP) has none
    insp = inspect_checkpoint(ckpts["qwen"], (5,), vllm="0.33.0")
    p = next(iter(insp.plans.values()))[0]
    assert p.failure_stage == "method" and p.to_json()["w2_scale_sharding"] is None
    assert p.to_json()["padded_intermediate"] is None and p.to_json()["rank_bytes"] is None


def test_repack_plans_with_the_switches(ckpts: dict[str, Path]) -> None:
    from wna16ctl.errors import NotLoadable
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack

    settings = RepackSettings(tp=8, vllm="0.33.0", gpu="sm100", env=make_switches(["VLLM_USE_FLASHINFER_MOE_INT4=1"]).env)
    plan = plan_repack(ckpts["kimi"], settings)
    # FlashInfer converts the checkpoint itself; repack still writes Marlin's layout, and says so
    assert {j.plan.backend.value for j in plan.jobs} == {"flashinfer_trtllm"} and {j.layout for j in plan.jobs} == {"marlin"}
    assert settings.to_json()["env"] == {"VLLM_USE_FLASHINFER_MOE_INT4": "1"}
    assert "env" not in RepackSettings(tp=1).to_json()  # older outputs still --resume
    with pytest.raises(NotLoadable, match="config parse"):
        plan_repack(ckpts["unmatched"], RepackSettings(tp=1, vllm="0.33.0"))


def test_new_inspect_keys_are_documented(ckpts: dict[str, Path]) -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "inspect-json.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", text)) | set(re.findall(r'"([a-z_0-9]+)":', text))
    doc = inspect_checkpoint(ckpts["unmatched"], (1,), vllm="all").to_json()
    assert set(doc) <= documented, set(doc) - documented
    assert set(doc["engine"]) | set(doc["engine"]["env"]["VLLM_USE_FLASHINFER_MOE_INT4"]) <= documented
    assert set(doc["config_refusal"]) <= documented and set(doc["versions"][0]) <= documented
    assert all(f"| `{name}` |" in text for name in doc["engine"]["env"])  # every switch has a row
