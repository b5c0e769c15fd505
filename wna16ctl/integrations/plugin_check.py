"""The GPU check of the vLLM load format `wna16ctl`: a `repack --layout marlin` output of the demo
checkpoint served with `--load-format wna16ctl`, against vLLM's default load of the checkpoint.

    python -m wna16ctl.integrations.plugin_check [--out FILE] [--budget SECONDS]

Run by `python -m wna16ctl.native.gpucheck` (scripts/gpu_check.sh) as its own process. Both loads
use vLLM's Marlin MoE backend, so the only difference is the load path; with bit-identical expert
tensors (the demo at TP 1 is outside the w13 scale correction) the greedy tokens must be equal
and the logprobs agree. Without a CUDA GPU or vLLM ($WNA16CTL_VLLM_PYTHON, else this python), or
on a release or GPU the plugin does not serve, the result is {"not_run": reason}. Exit 0 passed,
1 failed, 2 not run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from wna16ctl.integrations.marlin_serving import SERVED_RELEASES
from wna16ctl.layout.spec import MARLIN
from wna16ctl.planning import rules

PLUGIN_PROMPTS, PLUGIN_TOKENS, PLUGIN_LOGPROBS = 4, 16, 5
PLUGIN_LOGPROB_TOL = 1e-2  # same weights and kernel: the runs should agree exactly; this only absorbs nondeterminism


def find_vllm_python() -> tuple[Optional[str], str]:
    """(python with vLLM, its version) or (None, why not): $WNA16CTL_VLLM_PYTHON, else this python."""
    python = os.environ.get("WNA16CTL_VLLM_PYTHON") or sys.executable
    try:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                               timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} could not be run ({type(exc).__name__})"
    if probe.returncode:
        return None, (f"vLLM does not import in {python} (pip install 'wna16ctl[vllm]' there, or point "
                      f"WNA16CTL_VLLM_PYTHON at a python that has it)")
    return python, probe.stdout.strip().splitlines()[-1]


def compare_plugin_runs(reference: dict, plugin: dict) -> dict[str, Any]:
    """Greedy tokens and the logprobs of the reference's tokens, default load against the plugin's."""
    same_tokens = reference["tokens"] == plugin["tokens"]
    worst = 0.0
    compared = 0
    for ref_steps, got_steps in zip(reference.get("logprobs", []), plugin.get("logprobs", [])):
        for ref, got in zip(ref_steps, got_steps):
            for token, lp in ref.items():
                if token in got:
                    worst = max(worst, abs(lp - got[token]))
                    compared += 1
    ok = same_tokens and compared > 0 and worst <= PLUGIN_LOGPROB_TOL
    return {"ok": ok, "same_tokens": same_tokens, "logprobs_compared": compared, "max_logprob_diff": worst,
            "tolerance": PLUGIN_LOGPROB_TOL}


def check(budget_s: float, workdir: Path) -> dict[str, Any]:
    """`--load-format wna16ctl` on a `repack --layout marlin` output of the demo checkpoint against
    vLLM's default load of the checkpoint (both on the Marlin backend): the same prompts, greedy
    tokens and logprobs. {"not_run": why} without a GPU, vLLM, or a release/GPU the plugin serves."""
    import torch

    start = time.monotonic()
    res: dict[str, Any] = {}
    if not torch.cuda.is_available():
        res["not_run"] = "no CUDA GPU (torch sees none)"
        return res
    python, version = find_vllm_python()
    if python is None:
        res["not_run"] = version
        return res
    release = version.split("+", 1)[0]
    major, minor = torch.cuda.get_device_capability(0)
    gpu = f"sm{major}{minor}"
    res.update(vllm=version, gpu=gpu, python=python)
    if release not in SERVED_RELEASES or gpu not in rules.GPUS:
        res["not_run"] = (f"the plugin serves vLLM {', '.join(SERVED_RELEASES)} on {', '.join(rules.GPUS)}; "
                          f"here vLLM {version} on {gpu}")
        return res
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else ""))
    ck, out = workdir / "ckpt", workdir / "marlin"
    for cmd in (["demo", str(ck), "--force"],
                ["repack", str(ck), "-o", str(out), "--layout", MARLIN, "--tp", "1", "--vllm", release,
                 "--gpu", gpu, "--force"]):
        proc = subprocess.run([sys.executable, "-m", "wna16ctl", *cmd], capture_output=True, text=True, env=env)
        if proc.returncode:
            res.update(ok=False, error=f"wna16ctl {cmd[0]} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
            return res
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(12)] for _ in range(PLUGIN_PROMPTS)]
    runs = {}
    for name, req in (("default", {"model": str(ck), "moe_backend": "marlin"}),
                      ("wna16ctl", {"model": str(out), "load_format": "wna16ctl", "register_wna16ctl": True})):
        req_path, res_path = workdir / f"{name}.json", workdir / f"{name}.result.json"
        req_path.write_text(json.dumps(req | {"prompts": prompts, "max_tokens": PLUGIN_TOKENS, "dtype": "bfloat16",
                                              "logprobs": PLUGIN_LOGPROBS, "memory_fraction": 0.3}))
        left = budget_s - (time.monotonic() - start)
        t0 = time.monotonic()
        try:
            proc = subprocess.run([python, str(repo / "scripts" / "vllm_greedy.py"), str(req_path), str(res_path)],
                                  capture_output=True, text=True, env=env, timeout=max(30.0, left - 5))
        except subprocess.TimeoutExpired:
            res.update(ok=False, error=f"the {name} load ran out of time")
            return res
        res[f"{name}_seconds"] = round(time.monotonic() - t0, 1)
        if proc.returncode:
            res.update(ok=False, error=f"the {name} load failed (exit {proc.returncode})",
                       tail=(proc.stdout + proc.stderr).strip().splitlines()[-15:])
            return res
        runs[name] = json.loads(res_path.read_text())
    res.update(compare_plugin_runs(runs["default"], runs["wna16ctl"]))
    return res


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wna16ctl.integrations.plugin_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm_plugin_check.json"))
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for both vLLM runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wna16ctl-plugin-") as tmp:
        result = check(args.budget, Path(tmp))
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 2 if result.get("not_run") else (0 if result.get("ok") else 1)


if __name__ == "__main__":
    sys.exit(main())
