"""The layouts are one registry: each registered with its forward, inverse, per-rank shapes and
serve hint, and everything outside `wna16ctl/layout/` (the command line's choices, repack's check,
the serve command) reads it."""

from __future__ import annotations

import pytest
import torch

from wna16ctl.layout import registry
from wna16ctl.layout.rank import RankLayout
from wna16ctl.layout.registry import EXPERTS, MODEL, Layout, ServeHint, expert_shapes, layout_of
from wna16ctl.layout.shard import shard_expert
from wna16ctl.layout.spec import AUTO, MARLIN, TRANSPOSED, VLLM


def test_each_layout_is_registered_once_with_its_parts():
    assert registry.names() == (MARLIN, TRANSPOSED, VLLM)
    assert registry.names(EXPERTS) == (MARLIN, TRANSPOSED) and registry.names(MODEL) == (VLLM,)
    for name in registry.names():
        lay = layout_of(name)
        assert callable(lay.forward) and callable(lay.inverse) and callable(lay.rank_shapes)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(layout_of(MARLIN))
    with pytest.raises(ValueError, match="no layout 'nope'"):
        layout_of("nope")


def test_the_command_line_and_repack_take_the_registered_names():
    from wna16ctl.cli import cli
    from wna16ctl.repacking.pipeline import LAYOUTS

    choice = next(p for p in cli.commands["repack"].params if p.name == "layout").type
    assert tuple(choice.choices) == (AUTO, *registry.names())
    assert LAYOUTS == (AUTO, *registry.names(EXPERTS))


@pytest.mark.parametrize("name", [MARLIN, TRANSPOSED])
def test_an_expert_goes_through_its_layouts_forward_and_back(name):
    spec = RankLayout(layout=name, num_bits=4, group_size=64, symmetric=False, act_order=False, hidden_size=128,
                      intermediate_size=256, tp=2, rank=1, load_full_w2=False, padded_intermediate=128)
    gen = torch.Generator().manual_seed(7)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)

    h, i, pf = 128, 256, 8
    expert = {role: {"weight_packed": words(n, k // pf), "weight_scale": torch.rand(n, k // 64, generator=gen,
                                                                                   dtype=torch.float32).to(torch.bfloat16),
                     "weight_zero_point": words(n // pf, k // 64)}
              for role, (n, k) in {"gate": (i, h), "up": (i, h), "down": (h, i)}.items()}
    lay = layout_of(name)
    shapes = expert_shapes(spec, "BF16")
    assert shapes == lay.rank_shapes(spec, "BF16")
    dtypes = {"I32": torch.int32, "U8": torch.uint8, "BF16": torch.bfloat16}
    out = {n: torch.empty(shape, dtype=dtypes[dt]) for n, (shape, dt) in shapes.items()}
    lay.forward(expert, spec, out, 0, None)
    back = lay.inverse(out, spec, "expert 0")
    want = shard_expert(expert, tp=2, rank=1, load_full_w2=False)
    assert set(back) == set(want)
    for n in want:
        assert torch.equal(back[n], want[n].to(back[n].dtype)), n


def test_a_new_layout_is_served_as_its_hint_says(monkeypatch):
    from wna16ctl.planning.next_steps import serve_command

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(Layout("toy", EXPERTS, ServeHint("toy_format", "toy_backend"), lambda spec, dt: {},
                             "wna16ctl.layout.marlin:forward", "wna16ctl.layout.marlin:inverse"))
    assert serve_command("/o", "toy", 2) == ("vllm serve /o --load-format toy_format --tensor-parallel-size 2 "
                                             "--moe-backend toy_backend")
    assert serve_command("/o", TRANSPOSED, 2) == "vllm serve /o --tensor-parallel-size 2"
    assert serve_command("/o", VLLM, 2) == "vllm serve /o --load-format sharded_state --tensor-parallel-size 2"
    assert serve_command("/o", MARLIN, 2).endswith("--load-format wna16ctl --tensor-parallel-size 2 --moe-backend marlin")
