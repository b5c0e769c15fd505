"""The space of MoE layer cases the conformance sweep draws from (one table, two samplers).

`strategy()` is the hypothesis strategy of the property test; `sample(rng)` draws from the same
tables with a `random.Random`, for the sweep script that classifies disagreements.
"""

from __future__ import annotations

import random
from typing import Any

COMMON_HIDDEN = [512, 1024, 2048, 2880, 4096, 5120, 7168]
COMMON_INTERMEDIATE = [128, 192, 256, 320, 384, 512, 640, 768, 1024, 1408, 1536, 2048, 2560, 2816]
MARLIN_GROUPS = [32, 64, 128]
ODD_GROUPS = [16, 96, 256, 100, 8]
EXPERTS = [1, 2, 3, 8, 16, 60, 64, 128]
TP_SIZES = [1, 2, 3, 4, 8, 16]
ACTORDERS = [None, "weight", "static", "group", "dynamic"]
STRATEGIES = ["group", "group", "group", "channel"]  # group-wise is the common export
# bit widths: the common 4 and 8 most, and every other width vLLM's WNA16 schemes name (2-7)
BITS = [4, 4, 8, 8, 2, 3, 5, 6, 7]
# how the packed int32 words are filled: "dense" (compressed-tensors >= 0.20: num_bits-bit codes
# back to back, a code may straddle two words) or "word" (compressed-tensors <= 0.19: 32 // num_bits
# whole codes per word); the same words for 2, 4 and 8 bits
PACKINGS = ["dense", "word"]
# expert projection names (Mixtral's w1/w3/w2 or gate/up/down) and how group_0 targets them: the
# class Linear, or a pattern naming the checkpoint's own projections only
NAMES = ["gate_up_down", "gate_up_down", "w1_w3_w2"]
TARGETS = ["Linear", "Linear", "names"]
# lm_head: unquantized and ignored (the usual export), packed with nothing naming it, or packed and
# named by a target
LM_HEADS = [None, None, "packed", "packed+target"]
# every --gpu the CLI accepts, H100/H200 drawn most (Humming's priority differs by capability)
GPUS = ["sm90", "sm90", "sm75", "sm80", "sm86", "sm89", "sm100", "sm100", "sm120"]
# --moe-backend: mostly the release's own choice, else each name the engine maps for WNA16 MoE
MOE_BACKENDS = ["auto"] * 6 + ["marlin", "triton", "humming", "flashinfer_trtllm", "emulation", "rdna3"]
# the engine's environment: defaults, or FlashInfer's int4 MoE switched on
ENVS: list[dict[str, str]] = [{}, {}, {"VLLM_USE_FLASHINFER_MOE_INT4": "1"}]


def _group(targets: list[str], **weights) -> dict:
    base = {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": None, "symmetric": True,
            "group_size_null": False}
    return {"targets": targets, "weights": {**base, **weights}}


_VISUAL, _ATTENTION, _EXPERTS = r"re:.*visual.*", r"re:.*self_attn.*", r"re:.*mlp\.experts.*"
# config groups besides group_0 (targets Linear): most cases have none
EXTRA_GROUPS: list[list[dict]] = [[]] * 8 + [
    [_group([_VISUAL], actorder="group")],  # act-order for modules the model does not have
    [_group([_VISUAL], actorder="dynamic")],
    [_group([_ATTENTION], actorder="group")],  # act-order in attention only
    [_group([_VISUAL], num_bits=8, strategy="channel", group_size=-1)],  # harmless second group
    [_group([_EXPERTS], num_bits=8, strategy="channel", group_size=-1)],  # the experts get another scheme
    [_group([_EXPERTS], group_size=64, actorder="static")],
    [_group([_EXPERTS], group_size=32, symmetric=False)],
    [_group([_EXPERTS], group_size=128, actorder="group")],
]


def _case(strategy: str, group_size: int, group_size_null: bool, hidden: int, inter: int, experts: int,
          bits: int, symmetric: bool, actorder: str | None, tp: int, ep: bool, gpu: str,
          env: dict[str, str] | None = None, moe_backend: str = "auto",
          extra_groups: list[dict] | None = None, packing: str = "dense", names: str = "gate_up_down",
          targets: str = "Linear", lm_head: str | None = None) -> dict[str, Any]:
    if targets != "Linear":
        # two patterns that both match the experts: which wins is a question of target order,
        # not what these cases are for
        extra_groups = [g for g in extra_groups or [] if not any("experts" in t for t in g["targets"])]
    return {
        "hidden_size": hidden, "intermediate_size": inter, "num_experts": experts, "num_bits": bits,
        "group_size": group_size, "group_size_null": group_size_null, "symmetric": symmetric,
        "actorder": actorder, "strategy": strategy, "tp": tp, "ep": ep, "gpu": gpu,
        "env": dict(env or {}), "moe_backend": moe_backend, "extra_groups": list(extra_groups or []), "packing": packing,
        "names": names, "targets": targets, "lm_head": lm_head,
    }


def strategy():
    from hypothesis import strategies as st

    hidden = st.one_of(st.sampled_from(COMMON_HIDDEN), st.integers(1, 96).map(lambda k: 32 * k), st.integers(16, 4096))
    inter = st.one_of(st.sampled_from(COMMON_INTERMEDIATE), st.integers(1, 128).map(lambda k: 32 * k),
                      st.integers(8, 4096))

    @st.composite
    def cases(draw) -> dict[str, Any]:
        strat = draw(st.sampled_from(STRATEGIES))
        if strat == "group":
            gs = draw(st.one_of(st.sampled_from(MARLIN_GROUPS), st.sampled_from(ODD_GROUPS)))
            null = False
        else:
            gs, null = -1, draw(st.booleans())
        return _case(strat, gs, null, draw(hidden), draw(inter), draw(st.sampled_from(EXPERTS)),
                     draw(st.sampled_from(BITS)), draw(st.booleans()), draw(st.sampled_from(ACTORDERS)),
                     draw(st.sampled_from(TP_SIZES)), draw(st.booleans()), draw(st.sampled_from(GPUS)),
                     draw(st.sampled_from(ENVS)), draw(st.sampled_from(MOE_BACKENDS)),
                     draw(st.sampled_from(EXTRA_GROUPS)), draw(st.sampled_from(PACKINGS)),
                     draw(st.sampled_from(NAMES)), draw(st.sampled_from(TARGETS)), draw(st.sampled_from(LM_HEADS)))

    return cases()


def sample(rng: random.Random, gpus: list[str] | None = None) -> dict[str, Any]:
    def one_of(*choices):
        return rng.choice(choices)()

    strat = rng.choice(STRATEGIES)
    if strat == "group":
        gs = one_of(lambda: rng.choice(MARLIN_GROUPS), lambda: rng.choice(ODD_GROUPS))
        null = False
    else:
        gs, null = -1, rng.random() < 0.5
    hidden = one_of(lambda: rng.choice(COMMON_HIDDEN), lambda: 32 * rng.randint(1, 96), lambda: rng.randint(16, 4096))
    inter = one_of(lambda: rng.choice(COMMON_INTERMEDIATE), lambda: 32 * rng.randint(1, 128), lambda: rng.randint(8, 4096))
    return _case(strat, gs, null, hidden, inter, rng.choice(EXPERTS), rng.choice(BITS), rng.random() < 0.5,
                 rng.choice(ACTORDERS), rng.choice(TP_SIZES), rng.random() < 0.5, rng.choice(gpus or GPUS),
                 rng.choice(ENVS), rng.choice(MOE_BACKENDS), rng.choice(EXTRA_GROUPS), rng.choice(PACKINGS),
                 rng.choice(NAMES), rng.choice(TARGETS), rng.choice(LM_HEADS))
