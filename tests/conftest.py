"""Shared fixtures: demo checkpoints written by compressed-tensors, and the shared data files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from wna16ctl.demo import DemoSpec, write_demo_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


def _shared_dir() -> Path:
    # $WNA16CTL_SHARED when set (an override, as in the package), else shared/ beside the repository
    if "WNA16CTL_SHARED" in os.environ:
        return Path(os.environ["WNA16CTL_SHARED"])
    return REPO_ROOT.parent / "shared"


SHARED_DIR = _shared_dir()
GSM8K_TEST = SHARED_DIR / "data" / "gsm8k" / "test.jsonl"
GSM8K_TRAIN = SHARED_DIR / "data" / "gsm8k" / "train.jsonl"

MakeCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """`make_ckpt(**DemoSpec fields) -> Path`: a demo checkpoint, written once per spec per session.

    Checkpoints are shared between tests: treat them as read-only, copy one
    (shutil.copytree) before changing it.
    """
    written: dict[DemoSpec, Path] = {}

    def make(**spec_fields: object) -> Path:
        spec = DemoSpec(**spec_fields)  # type: ignore[arg-type]
        if spec not in written:
            written[spec] = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), spec)
        return written[spec]

    return make


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


@pytest.fixture(scope="session")
def host():  # -> wna16ctl.native.build.NativeLib
    """The native host library (built on first use); the test is skipped where it cannot be had."""
    from wna16ctl.native import build as native

    lib = native.host_lib()
    if lib is None:
        pytest.skip("native host library unavailable (no g++ or WNA16CTL_NO_NATIVE set)")
    return lib
