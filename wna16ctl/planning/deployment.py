"""The memory of a deployment that no inspection planned: repack's plan (its own MoE plans), a
padded checkpoint at its padded widths, a suggestion's other TP size or EP.  Above the inspection
(it plans with its planners) and below the commands that report it."""

from __future__ import annotations

from typing import Any

from wna16ctl.planning.fit import DEFAULT_UTILIZATION, GPU_MEMORY, Fit, FitSettings, fit_at, gpu_memory, settings_for
from wna16ctl.planning.inspection import _params_dtype, plan_all, plan_all_linear


def deployment_fit(ck: Any, tp: int, ep: bool, vllm: str, gpu: str, switches: Any, settings: FitSettings,
                   moe_plans: dict[str, Any] | None = None, problems: dict[str, Any] | None = None) -> Fit:
    """The fit of a deployment that is not an inspection's: the checkpoint `ck` with its layers as
    they will be held (a padded checkpoint's padded widths) planned at `tp` by the release's
    planners; `moe_plans`, where the caller planned the MoE layers already (repack's own plans)."""
    if moe_plans is None:
        moe = plan_all(ck.layers, (tp,), ep, vllm, gpu, problems or {}, with_differences=False, switches=switches)
        moe_plans = {k: v[0] for k, v in moe.items()}
    lin = plan_all_linear(ck.linear_layers, (tp,), vllm, gpu, _params_dtype(ck.config.torch_dtype),
                          with_differences=False, switches=switches)
    return fit_at(ck, tp, ep, vllm, moe_plans, {k: v[0] for k, v in lin.items()}, settings)


def planned_memory(ck: Any, tp: int, ep: bool, vllm: str, gpu: str, switches: Any,
                   moe_plans: dict[str, Any] | None = None, *, gpu_mem: int | str | None = None,
                   gpu_memory_utilization: float = DEFAULT_UTILIZATION, max_model_len: int | None = None,
                   max_num_seqs: int = 256, kv_cache_dtype: str = "auto",
                   max_num_batched_tokens: int | None = None) -> dict[str, Any]:
    """`repack --dry-run` and `pad`: the per-rank memory of what they would write (deployment_fit);
    with a GPU's memory (bytes, or a GPU_MEMORY name) the whole fit (`Fit.to_json`), else what one
    rank holds (`Fit.per_rank_json`)."""
    name = gpu_mem.lower() if isinstance(gpu_mem, str) and gpu_mem.lower() in GPU_MEMORY else None
    size = gpu_memory(name) if name else (gpu_mem if isinstance(gpu_mem, int) else 0)
    settings = settings_for(ck, gpu, size, gpu_memory_utilization, max_model_len, max_num_seqs, kv_cache_dtype, name,
                            max_num_batched_tokens)
    f = deployment_fit(ck, tp, ep, vllm, gpu, switches, settings, moe_plans)
    return f.to_json() if size else f.per_rank_json()
