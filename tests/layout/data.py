"""Random checkpoint-form experts for the layout tests, and numpy views of them for the reference."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from wna16ctl.layout import ExpertTensors, ProjectionTensors, pack_codes


def random_codes(shape: tuple[int, ...], num_bits: int, generator: torch.Generator) -> Tensor:
    return torch.randint(0, 1 << num_bits, shape, generator=generator, dtype=torch.int32)


def random_g_idx(size: int, group_size: int, generator: torch.Generator) -> Tensor:
    """Act-order group ids: every group id appears exactly group_size times, in random order."""
    groups = torch.arange(size, dtype=torch.int32) // group_size
    return groups[torch.randperm(size, generator=generator)]


def random_projection(
    n: int,
    k: int,
    *,
    num_bits: int,
    group_size: int,
    symmetric: bool,
    g_idx: Tensor | None,
    scale_dtype: torch.dtype,
    generator: torch.Generator,
) -> ProjectionTensors:
    groups = 1 if group_size == -1 else k // group_size
    tensors: ProjectionTensors = {
        "weight_packed": pack_codes(random_codes((n, k), num_bits, generator), num_bits, dim=1),
        # Distinct, nonzero values so any misplaced scale shows.
        "weight_scale": (torch.rand((n, groups), generator=generator) + 0.01).to(scale_dtype),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_codes(random_codes((n, groups), num_bits, generator), num_bits, dim=0)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx.clone()
    return tensors


def random_expert(
    hidden: int,
    intermediate: int,
    *,
    num_bits: int,
    group_size: int,
    symmetric: bool = True,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> ExpertTensors:
    generator = torch.Generator().manual_seed(seed)
    w13_g_idx = random_g_idx(hidden, group_size, generator) if act_order else None
    w2_g_idx = random_g_idx(intermediate, group_size, generator) if act_order else None
    common = dict(num_bits=num_bits, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype,
                  generator=generator)
    return {
        "gate": random_projection(intermediate, hidden, g_idx=w13_g_idx, **common),
        "up": random_projection(intermediate, hidden, g_idx=w13_g_idx, **common),
        "down": random_projection(hidden, intermediate, g_idx=w2_g_idx, **common),
    }


def to_numpy(t: Tensor) -> np.ndarray:
    """numpy copy; 16-bit floats become their int16 bit patterns (numpy has no bfloat16)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.contiguous().numpy().copy()


def expert_to_numpy(expert: ExpertTensors) -> dict[str, dict[str, np.ndarray]]:
    return {p: {k: to_numpy(v) for k, v in tensors.items()} for p, tensors in expert.items()}


def assert_tensors_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Same names, shapes, dtypes and bits."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert a.shape == e.shape, (name, tuple(a.shape), tuple(e.shape))
        assert np.array_equal(to_numpy(a), to_numpy(e)), name


def assert_experts_equal(actual: ExpertTensors, expected: ExpertTensors) -> None:
    assert sorted(actual) == sorted(expected)
    for projection in expected:
        assert_tensors_equal(actual[projection], expected[projection])
