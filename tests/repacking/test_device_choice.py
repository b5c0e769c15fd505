"""`repack --device auto` runs on the CPU even where a GPU and the CUDA library are usable: the
GPU path measured slower (docs/performance.md, "GPU harness"), so only `--device cuda` picks it."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from wna16ctl.cli import cli
from wna16ctl.layout.marlin import marlin_repack
from wna16ctl.layout.packing import pack_codes
from wna16ctl.native import ops as kernels
from wna16ctl.repacking import pipeline


def test_auto_repacks_on_the_cpu_where_a_gpu_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)  # as on a machine with a GPU

    def no_gpu(*args, **kwargs):
        raise AssertionError("the GPU path was taken")
    monkeypatch.setattr(torch.Tensor, "cuda", no_gpu)
    assert pipeline.repack_device("auto") == "cpu" and pipeline.repack_device("cuda") == "cuda"
    q = torch.randint(0, 16, (2, 128, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = pack_codes(q, 4, dim=-2)
    out = torch.empty(2, 128 // 16, 64 * 16 // 8, dtype=torch.int32)
    pipeline.marlin_repacker("auto")(packed, 4, out=out)
    assert torch.equal(out, marlin_repack(packed, 4))


def test_help_says_auto_never_picks_the_gpu() -> None:
    text = " ".join(CliRunner().invoke(cli, ["repack", "--help"]).output.split())
    assert "auto = the CPU" in text and "never picks the GPU" in text
