"""The repack layouts, one registry: each layout registered by name with its forward, its inverse,
the shapes one rank holds and how vLLM serves the output (the way compressed-tensors registers
each compressor by name, with its decompression beside it).

Everything outside `wna16ctl/layout/` asks this registry, never a layout by its literal name:
the command line's `--layout` choices, repack's layout check, the serve command of the next
steps.  Adding a layout is therefore a change in this folder: its name in `spec.py`, its tensor
math (a module with the forward and the inverse), its shapes, and one `register` call here.
Torch-free: the math is imported on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from wna16ctl.layout.spec import (
    MARLIN, TRANSPOSED, VLLM, RankLayout, StShape, marlin_expert_shapes, transposed_expert_shapes, vllm_rank_shapes,
)

PLUGIN_LOAD_FORMAT = "wna16ctl"  # the load format the `wna16ctl[vllm]` plugin registers (it reads marlin)
EXPERTS = "experts"  # a layout of one rank's MoE tensors (a `RankLayout`); the rest is copied as it is
MODEL = "model"  # a layout of every parameter of a rank


@dataclass(frozen=True)
class ServeHint:
    """How `vllm serve` reads an output of the layout."""

    load_format: str | None  # `--load-format` (None: no load format of vLLM reads it; the checkpoint is served)
    moe_backend: str | None  # the `--moe-backend` the loader pins (None: the engine's own choice)


class Forward(Protocol):
    """Expert layouts: `(expert, spec: RankLayout, out, expert_id, repack)` fills `out` (one expert's
    slices, shaped as `rank_shapes`).  The vllm layout: `(plan, reader, key, rank)` returns the key's
    tensor on `rank`."""

    def __call__(self, *args: Any) -> Any: ...


class Inverse(Protocol):
    """Expert layouts: `(tensors, spec: RankLayout, label)` returns the loader's K-first tensors of
    one expert (raises LayoutMismatch on what the forward cannot have written).  The vllm layout:
    `(plan, reader, key, parts)` returns None when the ranks' parts are the checkpoint's tensors bit
    for bit, else what differs."""

    def __call__(self, *args: Any) -> Any: ...


@dataclass(frozen=True)
class Layout:
    name: str
    scope: str  # EXPERTS or MODEL
    serve: ServeHint
    # Expert layouts: (spec: RankLayout, scale safetensors dtype) -> one expert's {name: (shape, dtype)};
    # the vllm layout: (plan, rank) -> the rank's {key: (shape, dtype)}.  Torch-free.
    rank_shapes: Callable[..., dict[str, StShape]]
    forward_at: str  # "module:function" of the forward, imported on first use
    inverse_at: str  # "module:function" of the inverse

    @property
    def forward(self) -> Forward:
        return _resolve(self.forward_at)

    @property
    def inverse(self) -> Inverse:
        return _resolve(self.inverse_at)


def _resolve(where: str) -> Any:
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


_REGISTRY: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.name in _REGISTRY:
        raise ValueError(f"layout {layout.name!r} is registered twice")
    _REGISTRY[layout.name] = layout
    return layout


def layout_of(name: str) -> Layout:
    """The registered layout of that name (ValueError for another name)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no layout {name!r}; the layouts are {', '.join(_REGISTRY)}") from None


def names(scope: str | None = None) -> tuple[str, ...]:
    """The registered layouts' names (of one scope), in registration order."""
    return tuple(n for n, lay in _REGISTRY.items() if scope is None or lay.scope == scope)


def expert_shapes(spec: RankLayout, scale_dtype: str) -> dict[str, StShape]:
    """name -> (shape, safetensors dtype) of one expert's slice of the rank tensors, in file order."""
    return layout_of(spec.layout).rank_shapes(spec, scale_dtype)


register(Layout(MARLIN, EXPERTS, ServeHint(PLUGIN_LOAD_FORMAT, "marlin"), marlin_expert_shapes,  # the backend it pins
                "wna16ctl.layout.marlin:forward", "wna16ctl.layout.marlin:inverse"))
register(Layout(TRANSPOSED, EXPERTS, ServeHint(None, None), transposed_expert_shapes,
                "wna16ctl.layout.transposed:forward", "wna16ctl.layout.transposed:inverse"))
register(Layout(VLLM, MODEL, ServeHint("sharded_state", None), vllm_rank_shapes,
                "wna16ctl.layout.vllm_state:build_tensor", "wna16ctl.layout.vllm_state:invert_key"))
