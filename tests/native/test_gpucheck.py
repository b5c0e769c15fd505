"""gpu_check's logic that needs no GPU: the report on disk after every step (a kill or the time
limit keeps what was measured), the not-run report, the goal verdicts, the case grid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from wna16ctl.native import gpucheck

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, pred, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            data = json.loads(path.read_text())
            if pred(data):
                return data
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached the expected state")


# a run whose build step hangs after recording its result (stands in for a hung kernel)
_HANGING_RUN = """
import sys, time
from pathlib import Path
from wna16ctl.native import gpucheck
gpucheck.step_env = lambda report: None
def hang(report):
    report["build"] = {"ok": True, "measured": 42}
    report.save()
    time.sleep(120)
gpucheck.step_build = hang
sys.exit(gpucheck.run(Path(sys.argv[1]), 270.0, 1, False, False))
"""


def _start(script: str, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_time_limit_keeps_the_partial_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _start(_HANGING_RUN, out)
    try:
        _wait_for(out, lambda d: d.get("build", {}).get("measured") == 42)
        proc.send_signal(signal.SIGTERM)  # what `timeout` in gpu_check.sh sends
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    data = json.loads(out.read_text())
    assert data["status"] == "stopped" and "during build" in data["reason"]
    assert data["build"]["measured"] == 42 and data["steps_done"] == ["env"]
    assert "stopped" in stdout


def test_a_kill_leaves_the_last_saved_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _start(_HANGING_RUN, out)
    try:
        _wait_for(out, lambda d: d.get("build", {}).get("measured") == 42)
        proc.send_signal(signal.SIGKILL)  # no handler runs: what is on disk must still parse
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    data = json.loads(out.read_text())
    assert data["status"] == "running" and data["step"] == "build" and data["build"]["measured"] == 42
    assert not (tmp_path / "gpu_check.json.tmp").exists()


def test_without_a_gpu_the_report_says_not_run(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would run")
    out = tmp_path / "gpu_check.json"
    assert gpucheck.main(["--out", str(out), "--no-pytest", "--no-sanitizer"]) == 2
    data = json.loads(out.read_text())
    assert data["status"] == "not-run" and "no CUDA device" in data["reason"]
    assert "bench_gemm" not in data and "goals" not in data
    # every GPU step says it did not run, and why
    assert list(data["steps"]) == list(gpucheck.STEPS)
    assert {s["state"] for s in data["steps"].values()} == {"not run"}
    assert all(s["reason"].startswith("no GPU: torch sees no CUDA device") for s in data["steps"].values())
    # and each step's own file says so
    for name in gpucheck.STEPS:
        own = json.loads(gpucheck.step_file(out, name).read_text())
        assert own["state"] == "not run" and own["reason"] == data["steps"][name]["reason"]


def test_goal_verdicts() -> None:
    report = gpucheck.Report(Path("unused.json"))
    assert all(g["met"] is None for g in gpucheck.goals(report).values())  # nothing measured
    report["bench_repack"] = {"plain": {"pct_of_peak": 81.0}, "act_order": {"pct_of_peak": 64.0}}
    report["bench_gemm"] = {"rows": [
        {"m": 1, "v2": {"pct_of_peak": 55.0}, "v2_over_bf16": 0.3},
        {"m": 16, "v2": {"pct_of_peak": 51.0}, "v2_over_bf16": 0.5},
        {"m": 64, "v2": {"pct_of_peak": 40.0}, "v2_over_bf16": 1.2},
        {"m": 512, "v2": {"pct_of_peak": 20.0}, "v2_over_bf16": 1.7},
    ]}
    g = gpucheck.goals(report)
    assert g["repack_pct_of_peak"]["met"] is False  # act-order below 70 %
    assert g["gemm_pct_of_peak_m_le_16"] == {"goal": ">= 50.0", "kernel": "v2", "worst": 51.0, "met": True}
    assert g["gemm_vs_bf16_m_ge_64"]["worst"] == 1.7 and g["gemm_vs_bf16_m_ge_64"]["met"] is False
    # with v3 measured, each row is judged on what auto runs there: v3, v2 for the 64-row tile (m = 512)
    for row, (pct, ratio, auto) in zip(report["bench_gemm"]["rows"], ((48.0, 0.3, "v3"), (60.0, 0.4, "v3"),
                                                                      (62.0, 1.1, "v3"), (30.0, 1.9, "v2"))):
        row["v3"], row["v3_over_bf16"], row["auto_kernel"] = {"pct_of_peak": pct}, ratio, auto
    g = gpucheck.goals(report)
    assert g["gemm_pct_of_peak_m_le_16"] == {"goal": ">= 50.0", "kernel": "v3", "worst": 48.0, "met": False}
    assert g["gemm_vs_bf16_m_ge_64"] == {"goal": "<= 1.5x", "kernel": "v3/v2", "worst": 1.7, "met": False}


def test_v3_runs_only_its_fast_mode() -> None:
    case = dict(m=1, n=128, k=256, e=8, topk=2, bits=4, gs=128, zp=False, act=False, k_full=True)
    assert gpucheck.v3_runs(case) and gpucheck.v3_runs({**case, "gs": -1})
    assert not gpucheck.v3_runs({**case, "gs": 32})  # groups of fewer rows than a stage
    assert not gpucheck.v3_runs({**case, "act": True})
    assert list(gpucheck.KERNELS) == ["v3", "v2", "v1"]
    assert [k for k, _ in gpucheck.SANITIZER_CASES].count("v3") == 1


def test_gemm_case_grid_spans_m_1_to_512_and_every_feature() -> None:
    cases = gpucheck.gemm_cases(seed=1234, count=24)
    assert len(cases) == 24
    assert {c["m"] for c in cases} == {1, 7, 16, 64, 123, 512}
    assert {c["bits"] for c in cases} == {4, 8} and {c["zp"] for c in cases} == {False, True}
    assert any(c["act"] and not c["k_full"] for c in cases)
    assert {c["dtype"] for c in cases} == {torch.float16, torch.bfloat16}


def test_compute_sanitizer_absent_is_recorded_as_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpucheck, "find_compute_sanitizer", lambda: None)
    report = gpucheck.Report(Path("unused.json"))
    assert gpucheck.step_sanitizer(report, gpucheck.Budget(100)) is None
    assert "compute-sanitizer not found" in report["sanitizer"]["skipped"]


def _fake_sanitizer(tmp_path: Path, text: str, code: int) -> str:
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(f"#!/bin/sh\ncat <<'END'\n{text}\nEND\nexit {code}\n")
    tool.chmod(0o755)
    return str(tool)


def test_compute_sanitizer_refusing_the_device_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lent machine's runtime that compute-sanitizer does not support: the tool never looked at
    the kernels, so the check is "not run" with the tool's reason, not a failure."""
    refusal = "========= COMPUTE-SANITIZER\n========= Error: Device not supported. Please refer to the " \
              "\"Supported Devices\" section of the sanitizer documentation"
    monkeypatch.setattr(gpucheck, "find_compute_sanitizer", lambda: _fake_sanitizer(tmp_path, refusal, 1))
    report = gpucheck.Report(tmp_path / "r.json")
    report["status"] = "passed"
    assert gpucheck.step_sanitizer(report, gpucheck.Budget(600)) is None
    san = report["sanitizer"]
    assert all("Device not supported" in san[t]["not_run"] for t in gpucheck.SANITIZER_TOOLS)
    assert "Device not supported" in san["not_run"]
    assert "compute-sanitizer: not run (compute-sanitizer refused the device" in gpucheck.summary(report)


def test_compute_sanitizer_finding_an_error_still_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error"
    monkeypatch.setattr(gpucheck, "find_compute_sanitizer", lambda: _fake_sanitizer(tmp_path, found, 66))
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_sanitizer(report, gpucheck.Budget(600)) is False
    assert report["sanitizer"]["memcheck"]["ok"] is False and "not_run" not in report["sanitizer"]


def test_the_budget_starts_after_the_build_and_keeps_the_report_reserve(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    built = []

    def build(report):
        time.sleep(1.5)  # longer than the checks' share below: it must not count against it
        built.append(1)
        report["build"] = {"ok": True, "seconds": 1.5}

    def hang(report, budget):
        report["repack_started_with"] = budget.left()
        time.sleep(30)

    monkeypatch.setattr(gpucheck, "step_env", lambda report: None)
    monkeypatch.setattr(gpucheck, "step_build", build)
    monkeypatch.setattr(gpucheck, "step_repack", hang)
    monkeypatch.setitem(gpucheck.STEP_TIME_S, "repack_checks", (0, 20))  # starts with one second left
    out = tmp_path / "gpu_check.json"
    t0 = time.monotonic()
    # the reserve plus one second of budget: one second for the checks, then the report
    assert gpucheck.run(out, gpucheck.REPORT_RESERVE_S + 1.0, 1, False, False) == 1
    assert time.monotonic() - t0 < 10
    data = json.loads(out.read_text())
    assert data["status"] == "stopped" and "budget" in data["reason"] and "repack_checks" in data["reason"]
    assert 0.5 < data["repack_started_with"] <= 1.0  # the 1.5 s build was not charged
    assert data["budget"] == {"seconds": gpucheck.REPORT_RESERVE_S + 1.0, "report_reserve": gpucheck.REPORT_RESERVE_S,
                              "build_seconds_outside": 1.5}
    # --build-only stops after the build
    assert gpucheck.run(out, 480, 1, False, False, build_only=True) == 0
    assert json.loads(out.read_text())["status"] == "built" and len(built) == 2
    assert gpucheck.DEFAULT_BUDGET_S == 480


def test_gemm_rows_carry_the_model_expectation() -> None:
    report = {"env": {"device": "NVIDIA H200"}, "device": {"sm_count": 132, "peak_gbps": 4800.0}}
    got = gpucheck.model_expectation(report, 1)
    assert got["gpu"] == "H200 SXM" and got["instance"] == "4-bit 16x256"
    assert 20 < got["expected_pct_of_peak"] < 30 and got["limit"].startswith("fixed costs")
    v3 = gpucheck.model_expectation(report, 1, "v3")
    assert v3["instance"] == "v3 4-bit bf16 16x256" and v3["expected_pct_of_peak"] > got["expected_pct_of_peak"]
    other = gpucheck.model_expectation({"env": {"device": "NVIDIA L40S"}, "device": {"sm_count": 142,
                                                                                      "peak_gbps": 864.0}}, 16)
    assert other["gpu"] == "NVIDIA L40S" and other["expected_pct_of_peak"] > 0


def test_summary_states_each_kernel_against_bf16_marlin_and_the_model() -> None:
    row = {"shape": "Qwen3-30B-A3B w13", "m": 1,
           "v3": {"ms": 0.0293, "weight_gbps": 1300.0, "pct_of_peak": 27.1, "pct_of_copy": 33.0},
           "v2": {"ms": 0.031, "weight_gbps": 1080.0, "pct_of_peak": 22.5, "pct_of_copy": 27.0},
           "marlin": {"ms": 0.0135, "weight_gbps": 2800.0, "pct_of_peak": 58.0, "pct_of_copy": 70.0},
           "torch_bf16_bmm": {"ms": 0.05}, "v3_over_bf16": 0.59, "v2_over_bf16": 0.62, "marlin_over_bf16": 0.27,
           "v3_over_marlin": 2.17, "v2_over_marlin": 2.3, "v3_equals_v2": True, "v3_over_model": 0.66,
           "model": {"expected_pct_of_peak": 24.0, "limit": "fixed costs"},
           "model_v3": {"expected_pct_of_peak": 41.1, "limit": "issue"}}
    checks = {"ok": True, "cases": [{"v3": {"rel_err": 1e-3}, "v2": {"rel_err": 1e-3}, "v1": {"rel_err": 2e-3},
                                     "v3_vs_v2": {"v3_ran": True, "bit_equal": True, "ok": True}}]}
    text = gpucheck.summary({"status": "passed", "gemm_checks": checks, "bench_gemm": {"rows": [row]},
                             "steps": {"build": {"state": "passed"},
                                       "vllm_plugin": {"state": "not run", "reason": "no vLLM"}}})
    assert "v3 == v2 bit for bit in 1 of 1, 1 run by v3 itself" in text
    line = next(ln for ln in text.splitlines() if "GEMM Qwen3-30B-A3B w13 m=   1" in ln)
    assert "v3 29.3 us (27.1% of peak, 33.0% of copy, model 41.1% (issue), measured / model 0.66" in line
    assert "v3 / marlin = 2.17" in line and "marlin 13.5 us" in line and "v3 == v2 yes" in line
    assert "steps: build passed; vllm_plugin not run (no vLLM)" in text


def test_every_step_is_passed_failed_or_not_run_with_its_reason() -> None:
    report: dict = {"vllm_marlin_check": {"not_run": "no vLLM installed"}}
    gpucheck.record_step(report, "repack_checks", True)
    gpucheck.record_step(report, "gemm_checks", False)
    gpucheck.record_step(report, "vllm_marlin_check", None)
    gpucheck.record_step(report, "sanitizer", None, "not asked for")
    assert report["steps"] == {"repack_checks": {"state": "passed"}, "gemm_checks": {"state": "failed"},
                               "vllm_marlin_check": {"state": "not run", "reason": "no vLLM installed"},
                               "sanitizer": {"state": "not run", "reason": "not asked for"}}


def test_steps_that_found_no_time_are_not_reported_as_failures() -> None:
    report: dict = {"status": "passed"}
    for name in gpucheck.STEPS[1:]:
        report[name] = {"not_run": "no time left"}
        gpucheck.record_step(report, name, None)
    text = gpucheck.summary(report)
    assert "FAILED" not in text and "ok" not in text.replace("(no time left)", "")
    # once for all steps on the steps line, and on the lines of the sanitizer, vLLM plugin, pytest,
    # Marlin, product, repack timing and engine start-up
    assert f"steps: all {len(gpucheck.STEPS) - 1} not run (no time left)" in text
    assert text.count("not run (no time left)") == 1 + 7


def test_repack_timing_runs_the_cli_on_both_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall-time comparison's mechanics on a tiny checkpoint, --device cpu standing in for cuda
    (without a GPU `repack --device cuda` refuses to start)."""
    monkeypatch.setattr(gpucheck, "TIMING_CHECKPOINT", {"layers": 1, "experts": 8, "hidden": 256,
                                                         "intermediate": 256, "vocab": 256})
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_repack_timing(report, gpucheck.Budget(600), ROOT, device="cpu") is True
    timing = report["repack_timing"]
    assert len(timing["cpu"]) == 4 and all(isinstance(t, float) for t in timing["cpu"])  # both devices' runs
    assert timing["cuda_over_cpu"] == 1.0 and timing["ok"] is True
    assert list(scratch.iterdir()) == []  # the work directory (the system's temporary one) is removed
    assert "repack wall time: synthetic" in gpucheck.summary({**report, "status": "passed"})


def test_a_step_that_raises_is_failed_and_the_next_steps_still_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpucheck, "step_env", lambda report: None)
    monkeypatch.setattr(gpucheck, "step_build", lambda report: report.update(build={"ok": True}))
    monkeypatch.setattr(gpucheck, "_load_marlin", lambda path: (None, "no vLLM"))
    ran: list[str] = []

    def boom(report, budget):
        raise RuntimeError("kernel fault")
    monkeypatch.setattr(gpucheck, "step_repack", boom)
    monkeypatch.setattr(gpucheck, "step_gemm", lambda report, budget, count: ran.append("gemm") or True)
    for name in ("step_repack_timing", "step_product"):
        monkeypatch.setattr(gpucheck, name, lambda report, budget, repo, name=name: ran.append(name) or None)
    for name in ("bench_copy", "bench_repack"):
        monkeypatch.setattr(gpucheck, name, lambda report, name=name: ran.append(name))
    monkeypatch.setattr(gpucheck, "bench_gemm", lambda report, budget, op, key="bench_gemm", **rows: ran.append(key))
    out = tmp_path / "gpu_check.json"
    assert gpucheck.run(out, 600, 1, False, False, with_vllm_plugin=False) == 1
    data = json.loads(out.read_text())
    assert data["status"] == "failed"
    assert data["repack_checks"]["error"] == "RuntimeError: kernel fault"
    assert ran == ["gemm", "step_product", "bench_copy", "bench_repack", "bench_step_sweep", "bench_gemm",
                   "step_repack_timing"]
    steps = data["steps"]
    assert steps["repack_checks"]["state"] == "failed" and steps["gemm_checks"]["state"] == "passed"
    assert steps["gemm_checks"]["budget_s"] == gpucheck.STEP_TIME_S["gemm_checks"][1]
    assert (steps["vllm_marlin_check"]["state"], steps["vllm_marlin_check"]["reason"]) == ("not run", "no vLLM")
    assert steps["sanitizer"]["reason"].startswith("not asked for")


def test_a_cli_that_cannot_start_for_a_missing_module_is_not_run() -> None:
    run = {"ok": False, "tail": ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'click'"]}
    assert gpucheck._missing_dependency(run) == "the CLI cannot start here: ModuleNotFoundError: No module named 'click'"
    assert gpucheck._missing_dependency({"ok": False, "tail": ["error: bad input"]}) is None


# ---- the Marlin check's and the GEMM benchmark's plumbing on the CPU -----------------------------
# vLLM's op stood in for by its documented semantics over our CPU GEMM; the kernels' timing by a
# clock that returns fixed times


class _FakeMarlinOp:
    """moe_wna16_marlin_gemm as its arguments describe it: blocks of `moe_block_size` sorted slots,
    one expert per block, entries >= M * top_k padding; computed by our CPU op."""

    def __init__(self, swap_experts: bool = False):
        from tests.native.test_vllm_marlin import VLLM_0_33_SCHEMA

        self.default = type("Overload", (), {"_schema": torch._C.parse_schema(VLLM_0_33_SCHEMA)})()
        self.swap_experts = swap_experts

    def __call__(self, *values):
        from wna16ctl.native import ops, vllm_marlin  # noqa: F401 - ops registers torch.ops.wna16ctl

        args = dict(zip(vllm_marlin.ARG_NAMES, values))
        block, top_k, m = args["moe_block_size"], args["top_k"], args["size_m"]
        experts = args["b_q_weight"].shape[0]
        post = int(args["num_tokens_past_padded"][0])
        ids, block_experts = args["sorted_token_ids"].tolist()[:post], args["expert_ids"].tolist()[:post // block]
        mine: dict[int, list[int]] = {e: [] for e in range(experts)}
        for b, e in enumerate(block_experts):
            e = experts - 1 - e if self.swap_experts else e
            mine[e] += [s for s in ids[b * block:(b + 1) * block] if s < m * top_k]
        order = [s for e in range(experts) for s in mine[e]]
        offsets = [0]
        for e in range(experts):
            offsets.append(offsets[-1] + len(mine[e]))
        bits = (args["b_type_id"] >> 8) & 0xFF
        out = torch.ops.wna16ctl.moe_wna16_gemm(
            args["a"], args["b_q_weight"], args["b_scales"], torch.tensor(order, dtype=torch.int32),
            torch.tensor(offsets, dtype=torch.int32), top_k, bits, args["b_zeros_or_none"], None, None,
            args["topk_weights"].reshape(-1) if args["mul_topk_weights"] else None, True)
        if args["c_or_none"] is not None:
            return args["c_or_none"].copy_(out)
        return out


def _on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from wna16ctl.native import vllm_marlin

    monkeypatch.setattr(gpucheck, "DEVICE", "cpu")
    monkeypatch.setattr(vllm_marlin, "new_workspace", lambda device: torch.zeros(8, dtype=torch.int32))
    monkeypatch.setattr(gpucheck, "MARLIN_CHECK_SHAPE", dict(n=64, k=128, e=3, topk=2))


def test_the_marlin_check_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _on_the_cpu(monkeypatch)
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_vllm_marlin_check(report, gpucheck.Budget(600), _FakeMarlinOp(), "stand-in") is True
    cases = report["vllm_marlin_check"]["cases"]
    assert len(cases) == 24 and sum("rel_err" in c for c in cases) == 18
    assert {c["not_run"] for c in cases if "not_run" in c} == {"vLLM's Marlin MoE has no 8-bit type with zero points"}
    assert "vLLM Marlin MoE on our layout vs fp32 reference: ok (18 cases" in gpucheck.summary({**report,
                                                                                             "status": "passed"})
    # a kernel that reads the blocks' experts wrongly is caught
    monkeypatch.setattr(gpucheck, "MARLIN_CHECK_CASES", [(4, True, 32)])
    report = gpucheck.Report(tmp_path / "r2.json")
    assert gpucheck.step_vllm_marlin_check(report, gpucheck.Budget(600), _FakeMarlinOp(swap_experts=True), "x") is False
    # a library whose op takes other arguments: not run, with the difference named
    other = _FakeMarlinOp()
    other.default._schema = torch._C.parse_schema("_moe_C::moe_wna16_marlin_gemm(Tensor a, Tensor b) -> Tensor")
    report = gpucheck.Report(tmp_path / "r3.json")
    assert gpucheck.step_vllm_marlin_check(report, gpucheck.Budget(600), other, "x") is None
    assert report["vllm_marlin_check"]["cases"][0]["not_run"].startswith("the library's _moe_C::moe_wna16_marlin_gemm")
    assert gpucheck.step_vllm_marlin_check(report, gpucheck.Budget(600), None, "no vLLM installed") is None
    assert report["vllm_marlin_check"] == {"not_run": "no vLLM installed"}


class _FixedClock:
    def __init__(self) -> None:
        self.calls = 0

    def event(self):
        clock = self

        class Event:
            def record(self) -> None:
                pass

            def elapsed_time(self, other) -> float:
                clock.calls += 1
                return 0.02
        return Event()

    def flush(self) -> None:
        pass

    def busy(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_the_gemm_benchmark_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _on_the_cpu(monkeypatch)
    monkeypatch.setattr(gpucheck, "BENCH_SHAPES", (("tiny w13", 8, 256, 128, 4, 128, (1, 4)),
                                                   ("tiny int8 channel-wise", 8, 256, 128, 8, -1, (4,))))
    clock = _FixedClock()
    monkeypatch.setattr(gpucheck, "_clock", lambda report: clock)

    def cpu_call(kernel, args):
        c = torch.zeros(args[0].shape[0] * args[5], args[2].shape[-1], dtype=args[0].dtype)
        return (lambda: c.copy_(torch.ops.wna16ctl.moe_wna16_gemm(*args))), c
    monkeypatch.setattr(gpucheck, "_gemm_call", cpu_call)
    report = gpucheck.Report(tmp_path / "r.json")
    report.update(env={"device": "NVIDIA H200"}, device={"sm_count": 132, "peak_gbps": 4800.0},
                  copy_ceiling={"gbps": 4000.0})
    gpucheck.bench_gemm(report, gpucheck.Budget(600), _FakeMarlinOp())
    rows = report["bench_gemm"]["rows"]
    assert [(r["shape"], r["m"]) for r in rows] == [("tiny w13", 1), ("tiny w13", 4), ("tiny int8 channel-wise", 4)]
    assert clock.calls == 4 * 15 * 3  # v3, v2, Marlin and bf16, 15 timed calls each, per row
    for r in rows:
        assert r["v3"]["ms"] == r["marlin"]["ms"] == r["torch_bf16_bmm"]["ms"] == 0.02
        assert r["v3_over_marlin"] == 1.0 and r["v3_equals_v2"] is True
        assert r["marlin_vs_v3_rel_err"] < 2 ** -6  # the stand-in computes what v3 computes
        assert r["v3"]["pct_of_copy"] == round(100 * r["v3"]["weight_gbps"] / 4000.0, 1)
    assert "v3_over_model" in rows[0] and "model_v3" not in rows[2]  # the model covers int4 only
    text = gpucheck.summary({**report, "status": "passed"})
    assert "GEMM tiny w13 m=   1: v3 20.0 us" in text and "v3 / marlin = 1.0" in text
    # the M = 1 step sweep's rows as a step of their own; the GEMM step skips them
    sweep = frozenset({("tiny w13", 1)})
    gpucheck.bench_gemm(report, gpucheck.Budget(600), _FakeMarlinOp(), key="bench_step_sweep", only=sweep)
    gpucheck.bench_gemm(report, gpucheck.Budget(600), _FakeMarlinOp(), skip=sweep)
    assert [(r["shape"], r["m"]) for r in report["bench_step_sweep"]["rows"]] == [("tiny w13", 1)]
    assert [(r["shape"], r["m"]) for r in report["bench_gemm"]["rows"]] == [("tiny w13", 4),
                                                                            ("tiny int8 channel-wise", 4)]
    assert [(r["shape"], r["m"]) for r in gpucheck.gemm_rows(report)] == [(s, m) for s, m in (
        ("tiny w13", 1), ("tiny w13", 4), ("tiny int8 channel-wise", 4))]


def test_benchmark_rows_carry_measured_over_the_fitted_model() -> None:
    """On an H200 a row of the fitted model's shapes gets measured / model for v3 and Marlin: a row
    measured at exactly the model's time reads 1.0, a row twice as slow 2.0; elsewhere not run."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import roofline as R
    finally:
        sys.path.pop(0)
    shape = R.H200_SHAPES["qwen3-w13"]
    modelled_ms = {k: R.model_us(k, shape, 16) / 1e3 for k in ("v3", "marlin")}
    row = {"shape": shape.name, "experts": shape.experts, "k": shape.size_k, "n": shape.size_n, "bits": 4,
           "group_size": 128, "m": 16, "v3": {"ms": modelled_ms["v3"]}, "marlin": {"ms": 2 * modelled_ms["marlin"]}}
    assert gpucheck.fitted_model_ratios(row, "NVIDIA H200") == {"v3": 1.0, "marlin": 2.0}
    assert "not_run" in gpucheck.fitted_model_ratios(row, "NVIDIA A100-SXM4-80GB")
    row["measured_over_fitted_model"] = {"v3": 1.0, "marlin": 2.0}
    row.update(torch_bf16_bmm={"ms": 0.1}, v3={"ms": modelled_ms["v3"], "pct_of_peak": 1, "pct_of_copy": 1},
               marlin={"ms": 2 * modelled_ms["marlin"], "pct_of_peak": 1, "pct_of_copy": 1})
    text = gpucheck.summary({"status": "passed", "bench_gemm": {"rows": [row]}})
    assert "measured / fitted model 1.0" in text and "measured / fitted model 2.0" in text


def test_engine_load_without_a_gpu_is_not_run(tmp_path: Path) -> None:
    """The real benchmark, asked for --device cuda on a machine without a GPU or a CUDA vLLM:
    "not run" with its reason, never a pass."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would start vLLM")
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_engine_load(report, gpucheck.Budget(600), ROOT) is None
    assert report["engine_load"]["not_run"]
    assert "engine start-up, default vs sharded_state: not run (" in gpucheck.summary({**report, "status": "x"})


def _fake_bench(tmp_path: Path, result: dict, code: int) -> Path:
    """A checkout whose bench/bench_engine_load.py writes `result` to --json and exits `code`."""
    (tmp_path / "bench").mkdir(parents=True)
    (tmp_path / "bench" / "bench_engine_load.py").write_text(
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        f"open(out, 'w').write(json.dumps({result!r}))\n"
        f"sys.exit({code})\n")
    return tmp_path


@pytest.mark.parametrize("same_token, expected", [(True, True), (False, False)])
def test_engine_load_measured_passes_only_with_the_same_token(tmp_path: Path, same_token: bool,
                                                             expected: bool) -> None:
    run = {"ready_s": 10.0, "first_token_s": 11.0, "engine_s": 8.0, "ranks": {}}
    measured = {"status": "measured", "vllm": "0.33.0", "tp": 1, "ready_ratio": 1.25, "same_first_token": same_token,
                "summary": {"default": {**run, "ready_s": 12.5}, "sharded_state": run}}
    repo = _fake_bench(tmp_path / "repo", measured, 0)
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_engine_load(report, gpucheck.Budget(600), repo) is expected
    line = next(ln for ln in gpucheck.summary({**report, "status": "x"}).splitlines() if "engine start-up" in ln)
    assert ("ok (vLLM 0.33.0" in line) is expected and "1.25x" in line, line


def test_engine_load_that_fails_is_failed(tmp_path: Path) -> None:
    repo = _fake_bench(tmp_path / "repo", {"status": "failed", "reason": "rank 1 died"}, 1)
    report = gpucheck.Report(tmp_path / "r.json")
    assert gpucheck.step_engine_load(report, gpucheck.Budget(600), repo) is False
    assert "FAILED (rank 1 died)" in gpucheck.summary({**report, "status": "x"})


# ---- the run's order, its per-step budgets and each step's JSON file -------------------------------


def test_steps_run_in_the_order_of_value() -> None:
    """Correctness and the product flow first, then the repack kernel against 70 % of HBM, the
    M = 1 step sweep, GEMM v3 and v2 against Marlin, the sanitizer; the rest with the time left."""
    assert [g for g, _ in gpucheck.STEP_GROUPS] == [
        "the build", "correctness and the product flow", "the repack kernel against 70 % of HBM",
        "the M = 1 step sweep", "GEMM v3 and v2 against Marlin", "the sanitizer", "with the time left"]
    assert gpucheck.STEPS[:10] == ("build", "repack_checks", "gemm_checks", "product", "bench_copy", "bench_repack",
                                   "bench_step_sweep", "vllm_marlin_check", "bench_gemm", "sanitizer")
    assert set(gpucheck.STEPS[10:]) == {"repack_timing", "pytest_gpu", "vllm_plugin", "engine_load"}
    plan = gpucheck.plan_steps(gpucheck.Report(Path("unused.json")), ROOT, 1, (None, "no vLLM"), True, True, True)
    assert [name for name, _ in plan] == list(gpucheck.STEPS[1:])
    assert set(gpucheck.STEP_TIME_S) == set(gpucheck.STEPS[1:])
    # the sweep's rows are rows of the benchmark's shapes at M = 1 (the GEMM step skips them)
    bench_rows = {(name, m) for name, *_, ms in gpucheck.BENCH_SHAPES for m in ms}
    assert gpucheck.STEP_SWEEP_ROWS <= bench_rows and {m for _, m in gpucheck.STEP_SWEEP_ROWS} == {1}
    # the first five groups' caps fit the checks' share of 8 minutes with the build cached (the
    # hard stop's 20 s, the report's reserve, half a minute to start python and load the library)
    caps = sum(gpucheck.STEP_TIME_S[name][1] or 0 for name in gpucheck.CORE_STEPS)
    assert caps <= 480 - 20 - gpucheck.REPORT_RESERVE_S - 30


def _fake_steps(monkeypatch: pytest.MonkeyPatch, ran: list[str], slow: dict) -> None:
    """Every step a stand-in that records its name and a figure; the names in `slow` sleep that
    many seconds first."""
    monkeypatch.setattr(gpucheck, "step_env", lambda report: None)
    monkeypatch.setattr(gpucheck, "step_build", lambda report: report.update(build={"ok": True, "seconds": 0.1}))
    monkeypatch.setattr(gpucheck, "_load_marlin", lambda path: (None, "no vLLM"))

    def fake(name: str, result):
        def step(report, *args, **kwargs):
            key = kwargs.get("key", name)
            ran.append(key)
            report[key] = ({"demo": {"ok": True, "seconds": 1.0}} if key == "product"
                           else {"measured": key, "ok": result is not False})
            report.save()
            time.sleep(slow.get(key, 0))
            return result
        return step
    for fn, name, result in (("step_repack", "repack_checks", True), ("step_gemm", "gemm_checks", True),
                             ("step_product", "product", True), ("bench_copy", "bench_copy", None),
                             ("bench_repack", "bench_repack", None), ("bench_gemm", "bench_gemm", None),
                             ("step_vllm_marlin_check", "vllm_marlin_check", True),
                             ("step_sanitizer", "sanitizer", True), ("step_repack_timing", "repack_timing", True)):
        monkeypatch.setattr(gpucheck, fn, fake(name, result))


def test_a_step_past_its_budget_is_cut_and_one_that_would_not_fit_is_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    _fake_steps(monkeypatch, ran, {"product": 30})
    monkeypatch.setitem(gpucheck.STEP_TIME_S, "product", (0, 0.5))
    monkeypatch.setitem(gpucheck.STEP_TIME_S, "bench_gemm", (10 ** 6, None))  # never fits
    monkeypatch.setattr(gpucheck, "STEP_GRACE_S", 0.5)
    out = tmp_path / "gpu_check.json"
    assert gpucheck.run(out, 600, 1, False, True, with_vllm_plugin=False) == 1
    data = json.loads(out.read_text())
    assert data["status"] == "incomplete"
    steps = data["steps"]
    assert steps["product"]["state"] == "cut" and "ran past its 0.5 s budget" in steps["product"]["reason"]
    assert data["product"]["demo"]["ok"] is True  # what it measured before the cut is kept
    assert steps["bench_gemm"] == {"state": "not run", "reason": "no time left"}
    assert data["bench_gemm"] == {"not_run": "no time left"}
    assert ran == ["repack_checks", "gemm_checks", "product", "bench_copy", "bench_repack", "bench_step_sweep",
                   "vllm_marlin_check", "sanitizer", "repack_timing"]  # the steps after the cut still ran
    assert steps["sanitizer"]["state"] == "passed" and steps["bench_step_sweep"]["state"] == "passed"
    for name, entry in steps.items():  # each step's own file holds its state and figures
        own = json.loads(gpucheck.step_file(out, name).read_text())
        assert {k: own[k] for k in entry} == entry and own["step"] == name
        assert own["result"] == data.get(name)
    assert gpucheck.step_file(out, "product").name == "04-product.json"
    assert "product cut (ran past its 0.5 s budget" in gpucheck.summary(data)


def test_a_cut_step_whose_figures_failed_is_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    _fake_steps(monkeypatch, ran, {"gemm_checks": 30})

    def failing_then_slow(report, budget, count):
        report["gemm_checks"] = {"ok": False, "partial": True}
        time.sleep(30)
    monkeypatch.setattr(gpucheck, "step_gemm", failing_then_slow)
    monkeypatch.setitem(gpucheck.STEP_TIME_S, "gemm_checks", (0, 0.5))
    monkeypatch.setattr(gpucheck, "STEP_GRACE_S", 0.5)
    out = tmp_path / "gpu_check.json"
    assert gpucheck.run(out, 600, 1, False, False, with_vllm_plugin=False) == 1
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and data["steps"]["gemm_checks"]["state"] == "failed"


def test_the_deadline_gives_the_checks_what_is_left_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_check.sh passes one deadline for its whole run: with 3 s of it left past the report's
    reserve, only steps that can start in 3 s run; the rest are not run, never passed."""
    ran: list[str] = []
    _fake_steps(monkeypatch, ran, {})
    monkeypatch.setitem(gpucheck.STEP_TIME_S, "repack_checks", (0, 20))
    out = tmp_path / "gpu_check.json"
    code = gpucheck.main(["--out", str(out), "--no-pytest", "--no-vllm-plugin",
                          "--deadline", str(time.time() + gpucheck.REPORT_RESERVE_S + 3)])
    assert code == 1
    data = json.loads(out.read_text())
    assert data["status"] == "incomplete" and ran == ["repack_checks"]
    assert 0 < data["budget"]["seconds"] <= gpucheck.REPORT_RESERVE_S + 3 and "deadline" in data["budget"]
    assert data["steps"]["repack_checks"]["state"] == "passed"
    assert {data["steps"][n]["state"] for n in gpucheck.CORE_STEPS[1:]} == {"not run"}
    assert {data["steps"][n]["reason"] for n in gpucheck.CORE_STEPS[1:]} == {"no time left"}


# the real run, every step a stand-in: the product step hangs after the first steps ended
_CUT_RUN = """
import sys, time
from pathlib import Path
from wna16ctl.native import gpucheck
gpucheck.step_env = lambda report: None
gpucheck.step_build = lambda report: report.update(build={"ok": True, "seconds": 0.1})
gpucheck._load_marlin = lambda path: (None, "no vLLM")
def repack(report, budget):
    report["repack_checks"] = {"ok": True, "cases": [{"bit_exact": True}] * 36}
    return True
def gemm(report, budget, count):
    report["gemm_checks"] = {"ok": True, "cases": [{"v3": {"rel_err": 1e-3, "ok": True}}] * count}
    return True
def product(report, budget, repo):
    report["product"] = {"demo": {"ok": True, "seconds": 4.0}}
    report.save()
    time.sleep(120)
gpucheck.step_repack, gpucheck.step_gemm, gpucheck.step_product = repack, gemm, product
sys.exit(gpucheck.run(Path(sys.argv[1]), 400.0, 24, False, False))
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_cut_in_a_step_keeps_every_earlier_step_file_whole(tmp_path: Path, how: int) -> None:
    """Killed (nothing runs after) or stopped by gpu_check.sh's time limit (SIGTERM) during the
    product flow: the build's, the repack checks' and the GEMM checks' files are on disk, complete."""
    out = tmp_path / "gpu_check.json"
    proc = _start(_CUT_RUN, out)
    try:
        _wait_for(out, lambda d: d.get("product", {}).get("demo", {}).get("ok") is True)
        proc.send_signal(how)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    files = sorted(p.name for p in gpucheck.steps_dir(out).iterdir())
    earlier = ["01-build.json", "02-repack_checks.json", "03-gemm_checks.json"]
    repack = json.loads((gpucheck.steps_dir(out) / earlier[1]).read_text())
    assert repack["state"] == "passed" and repack["group"] == "correctness and the product flow"
    assert len(repack["result"]["cases"]) == 36
    gemm = json.loads((gpucheck.steps_dir(out) / earlier[2]).read_text())
    assert gemm["state"] == "passed" and len(gemm["result"]["cases"]) == 24
    assert json.loads((gpucheck.steps_dir(out) / earlier[0]).read_text())["state"] == "passed"
    if how == signal.SIGKILL:  # nothing after the product step's start was written
        assert files == earlier
        return
    assert files == [gpucheck.step_file(out, name).name for name in gpucheck.STEPS]
    product = json.loads(gpucheck.step_file(out, "product").read_text())
    assert product["state"] == "cut" and product["result"] == {"demo": {"ok": True, "seconds": 4.0}}
    later = [json.loads(gpucheck.step_file(out, name).read_text()) for name in gpucheck.STEPS[4:]]
    assert {f["state"] for f in later} == {"not run"}
    assert all("stopped by signal" in f["reason"] for f in later)


def test_gpu_check_sh_without_a_gpu_reports_every_step_not_run(tmp_path: Path) -> None:
    """The script on a machine without a GPU: exit 2, the report and each step's file not run."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would run")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--no-pytest"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "wna16ctl GPU check: not-run (no GPU" in proc.stdout
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["status"] == "not-run"
    own = [json.loads(gpucheck.step_file(tmp_path / "gpu_check.json", n).read_text()) for n in gpucheck.STEPS]
    assert {f["state"] for f in own} == {"not run"} and all(f["reason"].startswith("no GPU") for f in own)
