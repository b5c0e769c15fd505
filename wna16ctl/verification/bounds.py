"""The interval every correct MoE layer output must lie in, element by element.

The candidate (a rank's repacked tensors through the MoE GEMM kernel) and this reference get the
SAME activations in the model dtype and the SAME dequantised weights (dtype(q − z)·s, one rounding:
the kernel's contract, which its magic-number dequantisation meets bit for bit). What may still
differ between two correct implementations is only the order of the fp32 accumulations (tiles,
mma internals, stream-K partial sums) and fp32's silu. So the reference computes every stage in
float64 with an interval around it and rounds the interval's ends to the model dtype as the
candidate rounds its values (round to nearest even, which is monotone):

1. w13 GEMM: e = a·W in float64; any fp32 accumulation of the K exact products lies within
   e ± 2γ_K·(|a|·|W|), γ_K = K·u32/(1 − K·u32) (the factor 2: margin for the hardware's
   accumulation inside an mma); the rounded value lies in [RN(lo), RN(hi)].
2. h = silu(gate)·up in fp32, then rounded: the exact range of silu(x)·y over the box of the gate
   and up intervals (silu has one minimum, at x₀ ≈ −1.2785), widened by 2⁻²⁰ relative for fp32's
   silu and product, then rounded.
3. w2 GEMM on the h interval: centre·W ± (radius·|W| + 2γ_K·max|h|·|W|), times the router weight
   (fp32: 2⁻²³ relative), rounded.
4. the k slots of a token summed in fp32 (k·u32 relative), the rank partial rounded; the ranks'
   partials summed in fp32 and rounded (the all-reduce).

Where both ends round to the same value the interval is a single point and the candidate must
equal it exactly; elsewhere it is at most a few units in the last place of the model dtype wide.
A wrong code, scale, zero point or layout moves an output by far more than that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wna16ctl.verification.budget import (  # noqa: F401 - JUDGE_ROWS and SLAB_BYTES re-exported for the numerics
    JUDGE_ROWS, LAYER_BYTES_PER_ELEMENT, NUMERICS_MEMORY, RANK_BYTES_PER_ELEMENT, SLAB_BYTES)
import torch.nn.functional as F

U32 = 2.0**-24
SILU_MIN_X = -1.2784645427610738  # argmin of x·sigmoid(x)
SILU_REL = 2.0**-20  # fp32 silu (a few ulps) and the fp32 product
ACC_MARGIN = 2.0  # the accumulation bound doubled: mma internals on real hardware


def _gamma(k: int) -> float:
    return ACC_MARGIN * k * U32 / (1 - k * U32)


# (significant bits, exponent of the smallest subnormal's quantum) of the 16-bit model dtypes
_PRECISION = {torch.bfloat16: (8, -133), torch.float16: (11, -24)}


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 `x` to the nearest value of `dtype`, ties to even, exactly (no detour through
    fp32, whose double rounding could land one step off); float64 out. Scaling by a power of two
    is exact in float64, so x / quantum is rounded once."""
    bits, q_min = _PRECISION[dtype]
    _, e = torch.frexp(x)  # x = m · 2^e, 0.5 ≤ |m| < 1
    q = torch.clamp(e - bits, min=q_min)  # the dtype's quantum at x: 2^q
    return torch.ldexp(torch.round(torch.ldexp(x, -q)), q)


def half_spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype`'s values in the binade of each float64 `x` (at a power of two
    the spacing above it, the larger of its two gaps; at zero the smallest subnormal's): the most
    that rounding a value to nearest can have moved it, when the result is `x`."""
    bits, q_min = _PRECISION[dtype]
    _, e = torch.frexp(x)
    q = torch.where(x == 0, torch.full_like(e, q_min), torch.clamp(e - bits, min=q_min))
    return torch.ldexp(torch.full_like(x, 0.5), q)


def gemm_bound_used(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, dtype: torch.dtype,
                    weight: torch.Tensor | None = None) -> float:
    """How much of its derived error bound one GEMM's output uses: a [S, K] and w [K, N] the exact
    inputs the GEMM was given (model dtype), out [S, N] its output rounded to `dtype`, weight [S]
    the fp32 router weight it applied. Per element: |out − e| less half a spacing of `dtype` at
    out (what the output's own rounding explains), over the bound of any fp32 accumulation
    order, 2γ_K·(|a|·|w|) (times the weight, plus the fp32 product's 2⁻²³), e = a·w (·weight) in
    float64; the largest over the elements. A correct GEMM reads at most 1 (its fp32 sum lies
    within half that bound; its rounding within the half spacing), in practice far below: the
    bound is the worst case of the accumulation order. A wrong code, scale, zero point or tile
    moves an element by many spacings: many bounds."""
    if not out.numel():
        return 0.0
    a64 = a.to(dtype).double()
    wt = None if weight is None else weight.double().unsqueeze(1)
    used = 0.0
    for cols in column_slabs(*w.shape):  # float64 copies of a slab of w's columns at a time
        w64 = w[:, cols].to(dtype).double()
        e = a64 @ w64
        bound = _gamma(w.shape[0]) * (a64.abs() @ w64.abs())
        if wt is not None:
            e, bound = e * wt, bound * wt.abs()
            bound = bound + 2.0**-23 * e.abs()
        c = out[:, cols].double()
        beyond = ((c - e).abs() - half_spacing(c, dtype)).clamp_min(0)
        ratio = torch.where(bound > 0, beyond / bound.clamp_min(1e-300), torch.where(beyond > 0, torch.inf, 0.0))
        used = max(used, float(torch.where(torch.isnan(c), torch.inf, ratio).max()))
    return used


def column_slabs(k: int, n: int, itemsize: int = 8) -> list[slice]:
    """The columns of a [K, N] weight in slabs whose copy at `itemsize` bytes an element (float64 by
    default) is at most SLAB_BYTES, at least one column each: the wider copies a GEMM's reference
    takes of an expert's weights are made a slab at a time, so their memory is a constant whatever
    the expert's size.  Each output column depends on its weight column alone, so the slabs give
    the values the whole weight gives (up to the order of a float64 sum, which the bounds carry)."""
    cols = max(1, SLAB_BYTES // (itemsize * max(1, k)))
    return [slice(c, c + cols) for c in range(0, n, cols)]


def upcast_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (fp32 [S, K]) @ w ([K, N], model dtype) in fp32, w upcast a slab of columns at a time
    (`column_slabs`): an engine's fp32 GEMM without an fp32 copy of the whole weight."""
    return torch.cat([x @ w[:, cols].float() for cols in column_slabs(w.shape[0], w.shape[1], itemsize=4)], 1)


@dataclass
class Interval:
    lo: torch.Tensor  # float64
    hi: torch.Tensor
    centre: torch.Tensor  # the float64 value before the last rounding (what |error| is measured from)

    def rounded(self, dtype: torch.dtype) -> "Interval":
        # round to nearest is monotone: a value inside [lo, hi] rounds inside [RN(lo), RN(hi)]
        return Interval(round_to(self.lo, dtype), round_to(self.hi, dtype), self.centre)


def gemm_interval(a_lo: torch.Tensor, a_hi: torch.Tensor, w: torch.Tensor) -> Interval:
    """a·W for any a in [a_lo, a_hi] (float64 [M, K]) and W [K, N], fp32 accumulation in any order;
    W upcast to float64 a slab of columns at a time (`column_slabs`)."""
    point = a_lo is a_hi  # a point: no radius to carry (rad · |W| would be an exact zero)
    mid, rad = (a_lo, None) if point else ((a_lo + a_hi) / 2, (a_hi - a_lo) / 2)
    a_mag = a_lo.abs() if point else torch.maximum(a_lo.abs(), a_hi.abs())
    gamma = _gamma(w.shape[0])
    e = torch.empty(a_lo.shape[0], w.shape[1], dtype=torch.float64)
    r = torch.empty_like(e)
    for cols in column_slabs(*w.shape):
        w64 = w[:, cols].double()
        w_abs = w64.abs()
        e[:, cols] = mid @ w64
        mag = a_mag @ w_abs
        r[:, cols] = gamma * mag + 2.0**-50 * mag if rad is None else rad @ w_abs + gamma * mag + 2.0**-50 * mag
    return Interval(e - r, e + r, e)


def silu_product_interval(g: Interval, u: Interval) -> Interval:
    """silu(x)·y over x ∈ [g.lo, g.hi], y ∈ [u.lo, u.hi], widened for fp32's silu and product."""
    s_lo = F.silu(torch.clamp(torch.full_like(g.lo, SILU_MIN_X), g.lo, g.hi))
    s_hi = torch.maximum(F.silu(g.lo), F.silu(g.hi))
    corners = torch.stack([s_lo * u.lo, s_lo * u.hi, s_hi * u.lo, s_hi * u.hi])
    lo, hi = corners.amin(0), corners.amax(0)
    pad = SILU_REL * torch.maximum(lo.abs(), hi.abs())
    return Interval(lo - pad, hi + pad, F.silu(g.centre) * u.centre)


def expert_interval(a: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weight: torch.Tensor,
                    dtype: torch.dtype) -> Interval:
    """One expert's per-slot output [S, H] in `dtype`: a [S, H] (in dtype), w13 [H, 2I] and w2 [I, H]
    (dequantised in dtype), weight [S] the router weights (fp32). See the module doc, steps 1-3."""
    a64 = a.to(dtype).double()
    g13 = gemm_interval(a64, a64, w13).rounded(dtype)
    i = w2.shape[0]
    half = lambda iv, s: Interval(iv.lo[:, s], iv.hi[:, s], iv.centre[:, s])  # noqa: E731 - columns s of an interval, for the line below
    h = silu_product_interval(half(g13, slice(0, i)), half(g13, slice(i, None))).rounded(dtype)
    y = gemm_interval(h.lo, h.hi, w2)
    wt = weight.double().unsqueeze(1)
    lo, hi = y.lo * wt, y.hi * wt
    pad = 2.0**-23 * torch.maximum(lo.abs(), hi.abs())
    return Interval(lo - pad, hi + pad, y.centre * wt).rounded(dtype)


def sum_interval(iv: Interval, dim: int, dtype: torch.dtype) -> Interval:
    """An fp32 sum along `dim` of values in the interval (any order), rounded to dtype."""
    n = iv.lo.shape[dim]
    mag = torch.maximum(iv.lo.abs(), iv.hi.abs()).sum(dim)
    pad = n * U32 * mag * 1.0001
    return Interval(iv.lo.sum(dim) - pad, iv.hi.sum(dim) + pad, iv.centre.sum(dim)).rounded(dtype)


RankWeights = tuple[range, dict[int, tuple[torch.Tensor, torch.Tensor]]]  # experts, {e: (w13 [H, 2I_p], w2 [I_p, H])}


class IntervalSum:
    """`sum_interval` built one term at a time: the running sums of lo, hi, centre and max(|lo|, |hi|)
    over the terms added so far, [T, H] each, so that a block's interval is computed expert by
    expert (or rank by rank) in memory of the output's size, whatever the number of experts.  Every
    quantity `sum_interval` takes from its terms is such a sum; float64 sums in another order
    differ from it by far less than the 1.0001 the pad carries."""

    def __init__(self, tokens: int, hidden: int):
        z = torch.zeros(tokens, hidden, dtype=torch.float64)
        self.lo, self.hi, self.centre, self.mag = z, z.clone(), z.clone(), z.clone()

    def add(self, iv: Interval, rows: torch.Tensor | None = None) -> None:
        """Add the terms `iv` ([S, H]) to output rows `rows` ([S]; None: every row, iv [T, H])."""
        mag = torch.maximum(iv.lo.abs(), iv.hi.abs())
        for acc, term in ((self.lo, iv.lo), (self.hi, iv.hi), (self.centre, iv.centre), (self.mag, mag)):
            if rows is None:
                acc += term
            else:
                acc.index_add_(0, rows, term)

    def rows(self, rows: slice | torch.Tensor) -> "IntervalSum":
        """Output rows `rows` of the sums (a slice: views, adding to them adds to these; an index
        tensor: copies, to read)."""
        out = IntervalSum.__new__(IntervalSum)
        out.lo, out.hi, out.centre, out.mag = self.lo[rows], self.hi[rows], self.centre[rows], self.mag[rows]
        return out

    def rounded(self, terms: int, dtype: torch.dtype) -> Interval:
        """The fp32 sum of `terms` values per element (any order), rounded to dtype: `sum_interval`."""
        pad = terms * U32 * self.mag * 1.0001
        return Interval(self.lo - pad, self.hi + pad, self.centre).rounded(dtype)


def add_expert_interval(acc: IntervalSum, a: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        e: int, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> None:
    """Expert `e`'s slots ([T, k] routing) of a rank's partial, added to the rank's `acc`."""
    slots = expert_slots_interval(a, topk_ids, topk_weights, e, w13, w2, dtype)
    if slots is not None:
        acc.add(*slots)


def expert_slots_interval(a: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, e: int,
                          w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[Interval, torch.Tensor] | None:
    """(the interval of expert `e`'s slots on a rank, their output rows), None where no slot is its:
    what `add_expert_interval` adds, for a caller that computes it apart and adds it in order."""
    k = topk_ids.shape[1]
    slots = (topk_ids.reshape(-1).cpu() == e).nonzero().squeeze(1)
    if not slots.numel():
        return None
    wf = topk_weights.reshape(-1).float().cpu()
    rows = slots // k
    return expert_interval(a.cpu()[rows], w13.cpu(), w2.cpu(), wf[slots], dtype), rows


def block_interval(ranks: list[RankWeights], a: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   dtype: torch.dtype) -> Interval:
    """A MoE block's output [T, H] over every rank (steps 1-4 of the module doc): a [T, H] in dtype,
    topk_ids / topk_weights [T, k]; per rank its experts' dequantised weights (model dtype)."""
    T, k = topk_ids.shape
    partials = []
    for rng, weights in ranks:
        if not len(rng):
            continue
        acc = IntervalSum(T, a.shape[1])
        for e, (w13, w2) in weights.items():
            add_expert_interval(acc, a, topk_ids, topk_weights, e, w13, w2, dtype)
        partials.append(acc)
    return all_reduced(partials, k, dtype)


def all_reduced(partials: list[IntervalSum], k: int, dtype: torch.dtype) -> Interval:
    """The block output's interval from each rank's accumulated slots (k per token): each rank's
    partial rounded, the partials summed in fp32 and rounded (step 4: the all-reduce)."""
    total = AllReduced(*partials[0].lo.shape)
    for acc in partials:
        total.add_rank(acc, k, dtype)
    return total.interval(dtype)


class AllReduced:
    """`all_reduced` built rank by rank: each rank's accumulated slots are rounded and added as soon
    as the rank is done, then let go, so that the ranks' partials are never all in memory."""

    def __init__(self, tokens: int, hidden: int):
        self.total = IntervalSum(tokens, hidden)
        self.ranks = 0

    def add_rank(self, acc: IntervalSum, k: int, dtype: torch.dtype) -> None:
        for start in range(0, acc.lo.shape[0], JUDGE_ROWS):  # rounding's temporaries: a few rows at a time
            rows = slice(start, start + JUDGE_ROWS)
            self.total.rows(rows).add(acc.rows(rows).rounded(k, dtype))
        self.ranks += 1

    def interval(self, dtype: torch.dtype, rows: slice | torch.Tensor = slice(None)) -> Interval:
        """The all-reduced interval of output rows `rows` (every row by default)."""
        return self.total.rows(rows).rounded(self.ranks, dtype)


# ---- the numerics' memory: a constant, whatever the layer's size and number of experts ------------

def numerics_tokens(hidden: int, blocks: int = 1) -> int:
    """The most tokens a layer's numerics run on at this hidden size: `blocks` layers' state (two
    for the padding proof: the original's and the padded one's) and one rank at a time fit in
    NUMERICS_MEMORY."""
    return max(1, NUMERICS_MEMORY // ((blocks * LAYER_BYTES_PER_ELEMENT + RANK_BYTES_PER_ELEMENT) * hidden))


def rank_groups(ranks: list[int], tokens: int, hidden: int, blocks: int = 1) -> list[list[int]]:
    """`ranks` in consecutive groups whose partials fit in NUMERICS_MEMORY with `blocks` layers'
    own state at `tokens` × `hidden`: all at once where they fit, one at a time at the token cap.
    Each group reads the layer's experts once more."""
    per = max(1, tokens * hidden)
    fit = (NUMERICS_MEMORY // per - blocks * LAYER_BYTES_PER_ELEMENT) // RANK_BYTES_PER_ELEMENT
    size = max(1, min(len(ranks), fit))
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


@dataclass
class Verdict:
    """A candidate output against its interval."""

    violations: int  # elements outside [lo, hi]
    elements: int
    exact_elements: int  # elements whose interval is one value (the candidate must equal it)
    max_ratio: float  # max |candidate − centre| / max(|lo − centre|, |hi − centre|): ≤ 1 when inside
    max_abs_error: float  # max |candidate − centre|
    # over the elements whose interval is wider than one value: the largest distance of the candidate
    # from the interval's midpoint as a fraction of its half-width (≤ 1 inside; None: every element exact).
    # Exact elements are left out: they sit at 0 by construction and say nothing about the margin.
    max_offset: float | None = None

    def merged(self, other: "Verdict") -> "Verdict":
        """Both judgements as one (the elements of each counted)."""
        offsets = [o for o in (self.max_offset, other.max_offset) if o is not None]
        return Verdict(self.violations + other.violations, self.elements + other.elements,
                       self.exact_elements + other.exact_elements, max(self.max_ratio, other.max_ratio),
                       max(self.max_abs_error, other.max_abs_error), max(offsets) if offsets else None)

    def to_json(self) -> dict[str, float | int | None]:
        return {"violations": self.violations, "elements": self.elements, "exact_elements": self.exact_elements,
                "max_error_over_bound": self.max_ratio, "max_abs_error": self.max_abs_error,
                "max_offset": self.max_offset}


def judge(candidate: torch.Tensor, iv: Interval) -> Verdict:
    c = candidate.double()
    outside = (c < iv.lo) | (c > iv.hi) | torch.isnan(c)
    err = torch.where(torch.isnan(c), torch.inf, (c - iv.centre).abs())
    allowed = torch.maximum((iv.lo - iv.centre).abs(), (iv.hi - iv.centre).abs()).clamp_min(1e-300)
    exact = iv.lo == iv.hi
    spread = ~exact
    max_offset = None
    if bool(spread.any()):
        mid, half = (iv.lo[spread] + iv.hi[spread]) / 2, (iv.hi[spread] - iv.lo[spread]) / 2
        cs = c[spread]
        max_offset = float(torch.where(torch.isnan(cs), torch.inf, (cs - mid).abs() / half).max())
    return Verdict(
        violations=int(outside.sum()), elements=c.numel(), exact_elements=int(exact.sum()),
        max_ratio=float((err / allowed).max()) if c.numel() else 0.0,
        max_abs_error=float(err.max()) if c.numel() else 0.0, max_offset=max_offset)


def nothing_to_compare(reference: torch.Tensor) -> str | None:
    """Why a layer's numerics judge nothing (so are not run), else None: a reference output that is
    all zero (all-zero weights, as a zero-filled shard gives, all-zero activations, or no token
    routed to an expert) is met by any output that is zero too, and a pass would prove nothing.
    Every numerics check (repack's verify, the padding proof) asks this one function."""
    if bool(reference.any()):
        return None
    return ("the reference output is all zero (all-zero weights or activations, or no token reached an expert): "
            "nothing to compare")
