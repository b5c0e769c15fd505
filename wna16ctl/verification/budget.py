"""The memory `verify` holds besides its reads, as figures: the numerics' budget (what
`verification.bounds.numerics_tokens` and `rank_groups` keep to) and what `--e2e` holds. A module
without torch, so that --help can state them."""

from __future__ import annotations

# What a layer's numerics may hold at once, besides one expert's weights and one slab of a rank's
# tensors: the tokens per layer are capped so that this holds (`bounds.numerics_tokens`), and the
# ranks are taken in groups that fit in it (`bounds.rank_groups`).
NUMERICS_MEMORY = 272 << 20
# bytes per token and hidden element: for the layer (the all-reduced interval, 4 float64; the
# candidate's sum and the activations, fp32; the reference's sum, float64), and for each rank of a group
# (its interval, 4 float64; its candidate partial and its kernel rows, fp32)
LAYER_BYTES_PER_ELEMENT = 60
RANK_BYTES_PER_ELEMENT = 40
JUDGE_ROWS = 256  # output rows judged (and rounded) at a time: the float64 temporaries stay small
SLAB_BYTES = 4 << 20  # a rank's expert tensors read and run through the GEMM at a time
# Whether the next slab's candidates (the ranks' GEMMs) run ahead of the references being built
# (1) or after them (0), where there are cores to run them side by side: ahead holds one more
# slab's tensors and GEMM outputs.
SLABS_AHEAD = 1
# The experts whose references the numerics build side by side (one per core) hold at most this
# much of dequantised weights in the model dtype together; larger experts are built one at a time.
EXPERTS_SIDE_BY_SIDE_BYTES = 64 << 20


def budget_help() -> str:
    """verify's --help sentence on the numerics' memory."""
    per = LAYER_BYTES_PER_ELEMENT + RANK_BYTES_PER_ELEMENT
    return (f"The numerics hold at most {NUMERICS_MEMORY >> 20} MiB per MoE layer (besides one expert and "
            f"{SLAB_BYTES >> 20} MiB of a rank's tensors; experts whose weights fit in "
            f"{EXPERTS_SIDE_BY_SIDE_BYTES >> 20} MiB together are built one per core): at most {NUMERICS_MEMORY >> 20} MiB / ({per} B × hidden "
            f"size) tokens per layer, e.g. {NUMERICS_MEMORY // (per * 2048)} at hidden 2048 and "
            f"{NUMERICS_MEMORY // (per * 7168)} at 7168 (the samples' first tokens, and tokens forced onto "
            "experts none reaches, so that every expert is exercised); the ranks a group at a time, each group "
            "reading the layer's experts again. The report says the tokens left out.")


E2E_HELP = ("--e2e holds every MoE layer's experts dequantised in the model dtype, their packed tensors and the "
            "model's other weights in fp32; it is refused up front, with the figure, where the machine's available "
            "memory cannot hold that.")
