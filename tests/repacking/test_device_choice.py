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


def test_cuda_repack_moves_transposed_sources_as_they_lie(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda: a K-first source that is a transposed view of N-first words reaches the GPU
    without a transposing copy on the host; the result is the CPU path's. Here the "GPU" is the
    CPU (`.cuda()` records what it is given and returns the tensor itself)."""
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    moved: list[bool] = []

    def record(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        moved.append(t.is_contiguous())
        return t
    monkeypatch.setattr(torch.Tensor, "cuda", record)
    q = torch.randint(0, 16, (256, 128), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    n_first = pack_codes(q, 4, dim=0).transpose(0, 1).contiguous()  # as the checkpoint stores it
    k_first = n_first.transpose(0, 1)
    out = torch.zeros(2, 256 // 16, 2 * 128 * 16 // 8, dtype=torch.int32)  # room for two N = 128 blocks
    pipeline.marlin_repacker("cuda")(k_first, 4, out=out[1, :, 256:])  # a column block of a wider output
    assert moved == [True]
    assert torch.equal(out[1, :, 256:], marlin_repack(k_first.contiguous(), 4)) and not out[0].any() and not out[1, :, :256].any()
