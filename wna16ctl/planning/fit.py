"""Will it fit: per TP size, one rank's weights and KV cache against a GPU's memory.

vLLM gives the KV cache what is left of `gpu_memory_utilization` x the GPU's memory once the
weights are loaded and its profiling run has measured the rest of a start (the activation peak of
a `--max-num-batched-tokens` pass, what the profiling run keeps, CUDA graphs).  The weights
(planning.memory) and the KV bytes per token (planning.kvcache) are exact; the rest of a start is
an estimate (planning.startup: computed from the deployment's sizes, with a bracket for what the
code gives no rule for), and every figure derived from it is a range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wna16ctl.dtypes import ST_SIZES
from wna16ctl.errors import UsageError

if TYPE_CHECKING:  # the command line reads GPU_MEMORY at start-up: the planners load on use
    from wna16ctl.planning.kvcache import KVCache
    from wna16ctl.planning.memory import WeightsMemory
    from wna16ctl.planning.startup import RestOfStart

GIB = 1 << 30
# GPU names that carry their memory: (architecture, bytes as the device reports it, GiB-rounded,
# streaming multiprocessors: Marlin's workspaces are sized by them)
GPU_MEMORY: dict[str, tuple[str, int, int]] = {
    "a100-40": ("sm80", 40 * GIB, 108), "a100-80": ("sm80", 80 * GIB, 108), "a100": ("sm80", 80 * GIB, 108),
    "a10": ("sm86", 24 * GIB, 72), "a10g": ("sm86", 24 * GIB, 80), "l4": ("sm89", 24 * GIB, 58),
    "l40s": ("sm89", 48 * GIB, 142), "h100": ("sm90", 80 * GIB, 132), "h100-94": ("sm90", 94 * GIB, 132),
    "h200": ("sm90", 141 * GIB, 132), "h20": ("sm90", 96 * GIB, 78), "b200": ("sm100", 180 * GIB, 148),
    "gb200": ("sm100", 186 * GIB, 148),
}
# where only the architecture is known (--gpu sm90 --gpu-mem 80GiB): its data-centre part's SM count
ARCH_SMS = {"sm75": 40, "sm80": 108, "sm86": 84, "sm89": 142, "sm90": 132, "sm100": 148, "sm120": 170}
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default


def gpu_memory(name: str) -> int:
    """The memory of a GPU named by `name` (one line naming the known ones otherwise)."""
    try:
        return GPU_MEMORY[name.lower()][1]
    except KeyError:
        raise UsageError(f"--gpu {name}: no known memory size for this GPU; one of {', '.join(GPU_MEMORY)}, "
                         "or give --gpu-mem (e.g. 80GiB)") from None


@dataclass(frozen=True)
class Fit:
    tp: int
    weights: WeightsMemory
    kv: KVCache
    gpu_mem: int
    utilization: float
    max_model_len: int
    max_num_seqs: int
    rest: RestOfStart  # the rest of a start on the rank (an estimate: its low and high ends)
    positions: int | None = None  # the model's max_position_embeddings (vLLM refuses a longer --max-model-len)
    batched_tokens_given: bool = False  # --max-num-batched-tokens was asked for (a serve line carries it)

    @property
    def not_judged(self) -> str | None:
        """Why the fit is not judged (the KV cache's size is not known from the config), or None."""
        return self.kv.unknown

    def budget(self, rest: int) -> int:
        """vLLM's available KV cache memory when the rest of a start takes `rest` bytes
        (`request_memory`: ceil(total x utilization))."""
        return math.ceil(self.gpu_mem * self.utilization) - self.weights.loaded_bytes - rest

    def kv_tokens(self, rest: int) -> int:
        """Tokens of full-attention cache the budget holds (vLLM's "GPU KV cache size"), in whole blocks."""
        return self.kv.tokens_in(self.budget(rest) - self.kv.state_bytes() * self.max_num_seqs)

    def concurrency(self, rest: int) -> int:
        """Sequences of max_model_len tokens the budget holds at once (capped at max_num_seqs)."""
        need = self.kv.sequence_bytes(self.max_model_len)
        return max(0, min(self.max_num_seqs, self.budget(rest) // need)) if need else self.max_num_seqs

    def largest_len(self, rest: int) -> int:
        """The largest max_model_len one sequence fits in (vLLM refuses to start past it)."""
        budget, lo, hi = self.budget(rest), 0, self.positions or 1 << 24
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.sequence_bytes(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def to_json(self) -> dict[str, Any]:
        lo, hi = self.rest.low, self.rest.high

        def exact(v: int, unit: str = "bytes") -> dict[str, Any]:
            return {"value": v, "unit": unit, "exact": True}

        def est(f, unit: str) -> dict[str, Any]:
            value = None if self.not_judged else [f(hi), f(lo)]
            return {"value": value, "unit": unit, "exact": False, "range_from": "rest_of_start"}

        return {
            "tp": self.tp, "gpu_memory": exact(self.gpu_mem), "gpu_memory_utilization": self.utilization,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "weights": {**exact(self.weights.loaded_bytes), "exact": self.weights_exact(), "stage": "after_processing"},
            "weights_as_built": {**exact(self.weights.built_bytes), "stage": "as_built"},
            "weights_processing": {**exact(self.weights.loaded_bytes - self.weights.built_bytes),
                                   "exact": self.weights_exact(), "by_cause": self.weights.processing_by_cause(),
                                   "not_modelled": list(self.weights.processing_not_modelled)},
            "kv_bytes_per_token": exact(self.kv.bytes_per_token()),
            "kv_state_bytes_per_sequence": exact(self.kv.state_bytes()),
            "max_num_batched_tokens": self.rest.batched_tokens, "rest_of_start": self.rest.to_json(),
            "kv_budget": est(self.budget, "bytes"), "kv_tokens": est(self.kv_tokens, "tokens"),
            "max_concurrency": est(self.concurrency, "sequences"),
            "largest_max_model_len": est(self.largest_len, "tokens"),
            "fits": self.fits(), "not_judged": self.not_judged,
            "short_by": {"value": None if self.not_judged else self.short_by(), "unit": "bytes", "exact": False},
        }

    def per_rank_json(self) -> dict[str, Any]:
        """What one rank holds whatever the GPU: the weights and the KV cache per token and sequence."""
        j = self.to_json()
        return {k: j[k] for k in ("tp", "weights", "weights_as_built", "weights_processing", "kv_bytes_per_token",
                                  "kv_state_bytes_per_sequence")}

    def weights_exact(self) -> bool:
        """The weights after processing are exact where every module's processing is modelled."""
        return not self.weights.processing_not_modelled

    def gpu_memory_utilization_text(self) -> str:
        return f"{self.utilization:g}"

    def short_by(self) -> int:
        """Bytes missing for one sequence of max_model_len even at the estimate's low end (0: none)."""
        return max(0, self.kv.sequence_bytes(self.max_model_len) - self.budget(self.rest.low))

    def fits(self) -> str:
        """"yes" (even at the estimate's high end), "maybe" (only at its low end), "no", or
        "not_judged" (the KV cache's size is not known: `not_judged` says why)."""
        if self.not_judged:
            return "not_judged"
        need = self.kv.sequence_bytes(self.max_model_len)
        lo, hi = self.rest.low, self.rest.high
        return "yes" if self.budget(hi) >= need else "maybe" if self.budget(lo) >= need else "no"


def max_positions(ck: Any) -> int | None:
    """The checkpoint's max_position_embeddings (`ck`: sources.Checkpoint)."""
    raw = ck.config.raw
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    v = text.get("max_position_embeddings")
    return v if isinstance(v, int) and v > 0 else None


def gpu_sms(name: str | None, arch: str) -> int:
    """The SM count of the GPU `name` (a GPU_MEMORY name), else of architecture `arch`'s data-centre part."""
    if name is not None and name.lower() in GPU_MEMORY:
        return GPU_MEMORY[name.lower()][2]
    return ARCH_SMS.get(arch, ARCH_SMS["sm90"])


@dataclass(frozen=True)
class FitSettings:
    """What a fit is judged against: the GPU and vLLM's options (`--max-model-len` resolved)."""

    gpu_mem: int
    utilization: float
    max_model_len: int
    max_num_seqs: int
    kv_dtype_bytes: int
    sms: int
    positions: int | None
    arch: str = "sm90"
    batched_tokens: int | None = None  # --max-num-batched-tokens (None: vllm serve's default for the GPU)
    gpu_name: str | None = None


def fit_settings(insp: Any, gpu_mem: int, utilization: float = DEFAULT_UTILIZATION, max_model_len: int | None = None,
                 max_num_seqs: int = 256, kv_cache_dtype: str = "auto", gpu_name: str | None = None,
                 max_num_batched_tokens: int | None = None) -> FitSettings:
    """The settings for `insp` (planning.inspection.Inspection); `gpu_name`, a GPU_MEMORY name,
    gives the SM count Marlin's workspaces are sized by."""
    return settings_for(insp.checkpoint, insp.gpu, gpu_mem, utilization, max_model_len, max_num_seqs, kv_cache_dtype,
                        gpu_name, max_num_batched_tokens)


def settings_for(ck: Any, arch: str, gpu_mem: int, utilization: float = DEFAULT_UTILIZATION,
                 max_model_len: int | None = None, max_num_seqs: int = 256, kv_cache_dtype: str = "auto",
                 gpu_name: str | None = None, max_num_batched_tokens: int | None = None) -> FitSettings:
    """The settings for the checkpoint `ck` on a GPU of architecture `arch` (see fit_settings);
    `max_num_batched_tokens` None: vllm serve's default for that GPU and release."""
    from wna16ctl.planning.kvcache import kv_dtype_bytes
    from wna16ctl.planning.memory import model_st_dtype

    if not 0 < utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization {utilization}: a fraction in (0, 1]")
    positions = max_positions(ck)
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise UsageError(f"--max-model-len {max_model_len}: beyond the model's {positions} positions "
                         "(config.json max_position_embeddings)")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens {max_num_batched_tokens}: a positive number of tokens")
    return FitSettings(gpu_mem, utilization, max_model_len or positions or 4096, max_num_seqs,
                       kv_dtype_bytes(kv_cache_dtype, model_st_dtype(ck)), gpu_sms(gpu_name, arch), positions,
                       arch, max_num_batched_tokens, gpu_name)


def fit_at(ck: Any, tp: int, ep: bool, vllm: str, moe_plans: dict[str, Any], linear_plans: dict[str, Any],
           settings: FitSettings) -> Fit:
    """One deployment's fit: the checkpoint `ck` (sources.Checkpoint) planned at `tp` (prefix /
    layer name -> plan at that size)."""
    from wna16ctl.planning.kvcache import kv_cache
    from wna16ctl.planning.memory import model_st_dtype, weights_per_rank
    from wna16ctl.planning.startup import default_batched_tokens, rest_of_start, shape

    model_bytes = ST_SIZES[model_st_dtype(ck)]
    mem = weights_per_rank(ck, tp, ep, vllm, moe_plans, linear_plans, sms=settings.sms)
    kv = kv_cache(ck, tp, settings.kv_dtype_bytes, model_bytes)
    tokens = settings.batched_tokens or default_batched_tokens(vllm, settings.gpu_mem, settings.gpu_name)
    rest = rest_of_start(shape(ck, tp, moe_plans, model_bytes), vllm, settings.arch, settings.max_num_seqs, tokens)
    return Fit(tp, mem, kv, settings.gpu_mem, settings.utilization, settings.max_model_len, settings.max_num_seqs,
               rest, settings.positions, settings.batched_tokens is not None)


def fits(insp: Any, settings: FitSettings) -> list[Fit]:
    """One `Fit` per TP size of `insp` that loads (planning.inspection.Inspection)."""
    ck = insp.checkpoint
    out = []
    for i, tp in enumerate(insp.tps):
        moe = {k: v[i] for k, v in insp.plans.items()}
        lin = {k: v[i] for k, v in insp.linear_plans.items()}
        if not all(moe[lay.prefix].loadable for lay in ck.quantized_layers) or not all(p.loadable for p in lin.values()):
            continue
        out.append(fit_at(ck, tp, insp.ep, insp.engine.version, moe, lin, settings))
    return out


def memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """For people: a `Fit.to_json` (or `Fit.per_rank_json`) as `repack --dry-run` and `pad` print it."""
    from wna16ctl.sink import human_bytes

    if not memory:
        return []
    weights = memory["weights"]
    exact = "exact" if weights["exact"] else "as built where processing is not modelled"
    line = (f"memory per rank at TP {memory['tp']}: weights {human_bytes(weights['value'])} ({exact}), KV "
            f"{human_bytes(memory['kv_bytes_per_token']['value'])}/token (exact)")
    if "fits" not in memory:
        return [line + " (--gpu-mem or a --gpu name with its memory judges the fit)"]
    if memory["not_judged"]:
        return [line, f"  on {human_bytes(memory['gpu_memory']['value'])}: not judged ({memory['not_judged']})"]
    tokens, seqs, longest = (memory[k]["value"] for k in ("kv_tokens", "max_concurrency", "largest_max_model_len"))
    verdict = {"yes": "fits", "maybe": "fits only if the rest of a start stays small",
               "no": f"does not fit (short by at least {human_bytes(memory['short_by']['value'] or 0)})"}[memory["fits"]]
    rest = memory["rest_of_start"]["value"]
    return [line, f"  on {human_bytes(memory['gpu_memory']['value'])} x {memory['gpu_memory_utilization']:g}, "
                  f"--max-num-batched-tokens {memory['max_num_batched_tokens']}: rest of a start "
                  f"{human_bytes(rest[0])}-{human_bytes(rest[1])} (estimate); KV tokens "
                  f"{tokens[0]}-{tokens[1]}, {seqs[0]}-{seqs[1]} concurrent {memory['max_model_len']}-token requests, "
                  f"largest --max-model-len {longest[0]}-{longest[1]}: {verdict}"]
