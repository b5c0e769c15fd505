"""`bounds.gemm_bound_used`, verify's margin figure: a correct GEMM's output (any fp32 accumulation
order, rounded to the model dtype) reads below 1 with room, an output moved by a wrong scale or
by a few units in the last place reads above 1."""

from __future__ import annotations

import pytest
import torch

from wna16ctl.verification.bounds import gemm_bound_used, half_spacing


def _gemm(dtype: torch.dtype, k: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, k, generator=g).to(dtype)
    w = (torch.randn(k, 96, generator=g) * 0.05).to(dtype)
    weight = torch.rand(64, generator=g)
    return a, w, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_correct_outputs_read_far_below_one(dtype):
    a, w, weight = _gemm(dtype)
    # fp32 accumulation in two orders (forward and in 16-wide chunks, as tiles do), then rounded
    forward = (a.float() @ w.float()).to(dtype)
    chunks = sum(a[:, i:i + 16].float() @ w[i:i + 16].float() for i in range(0, a.shape[1], 16)).to(dtype)
    weighted = ((a.float() @ w.float()) * weight.unsqueeze(1)).to(dtype)
    for out, wt in ((forward, None), (chunks, None), (weighted, weight)):
        used = gemm_bound_used(a, w, out, dtype, weight=wt)
        assert 0 <= used < 0.25, used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_planted_errors_read_above_one(dtype):
    a, w, _ = _gemm(dtype)
    out = (a.float() @ w.float()).to(dtype)
    # one element 32 units in the last place off (fp16's bound at K = 512 is about one unit wide:
    # a few units can be a correct accumulation order there)
    bumped = out.clone()
    x = bumped[3, 5].double()
    bumped[3, 5] = (x + 64 * half_spacing(x.reshape(1), dtype)[0]).to(dtype)
    assert gemm_bound_used(a, w, bumped, dtype) > 1
    # a wrong scale of one output column (5 %), as a mis-permuted scale gives
    scaled = out.clone()
    scaled[:, 7] = (scaled[:, 7].float() * 1.05).to(dtype)
    assert gemm_bound_used(a, w, scaled, dtype) > 1
    # a NaN is never inside
    nan = out.clone()
    nan[0, 0] = float("nan")
    assert gemm_bound_used(a, w, nan, dtype) == float("inf")


def test_half_spacing_is_the_larger_gap():
    x = torch.tensor([1.0, 1.5, 0.0, -2.0], dtype=torch.float64)
    assert half_spacing(x, torch.bfloat16).tolist() == [2.0**-8, 2.0**-8, 2.0**-134, 2.0**-7]
    assert half_spacing(x, torch.float16).tolist() == [2.0**-11, 2.0**-11, 2.0**-25, 2.0**-10]
