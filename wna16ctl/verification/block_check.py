"""One MoE block of the e2e model: the candidate (the repacked per-rank tensors through the MoE GEMM
kernel) checked, call by call, against the interval of `bounds` computed from the source
checkpoint's dequantised experts on the same input; per-layer expert coverage; and the
forced-routing pass that runs every expert no prompt routed to.

`BlockChecker` is a drop-in for transformers' experts module computation (called with the block's
input in the model dtype, the top-k ids and weights) and returns the candidate's output, so the
model runs on the candidate's own values while every block output it used is judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from wna16ctl.verification.bounds import RankWeights, Verdict, block_interval, judge

KEPT_ROWS = 64  # block inputs kept per layer for the forced-routing pass


@dataclass
class LayerCheck:
    """One layer's block outputs judged against their intervals, over every call of a run."""

    layer: str
    num_experts: int
    calls: int = 0
    elements: int = 0
    exact_elements: int = 0
    violations: int = 0
    max_ratio: float = 0.0
    max_abs_error: float = 0.0
    first_violation: str | None = None  # where: "prompt P, call C" or "forced routing"
    routed: set[int] = field(default_factory=set)  # experts some token was routed to
    forced: list[int] = field(default_factory=list)  # experts run on the forced-routing pass
    forced_violations: int = 0
    kernels: dict[str, int] = field(default_factory=dict)  # launches per kernel (v2 / v1 / cuda)

    @property
    def exercised(self) -> int:
        return len(self.routed | set(self.forced))

    def add(self, v: Verdict, where: str) -> None:
        self.calls += 1
        self.elements += v.elements
        self.exact_elements += v.exact_elements
        self.violations += v.violations
        self.max_ratio = max(self.max_ratio, v.max_ratio)
        self.max_abs_error = max(self.max_abs_error, v.max_abs_error)
        if v.violations and self.first_violation is None:
            self.first_violation = where

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer, "calls": self.calls, "elements": self.elements,
            "exact_elements": self.exact_elements, "violations": self.violations,
            "max_error_over_bound": self.max_ratio, "max_abs_error": self.max_abs_error,
            "first_violation": self.first_violation, "num_experts": self.num_experts,
            "experts_routed": len(self.routed), "experts_forced": list(self.forced),
            "experts_exercised": self.exercised, "forced_violations": self.forced_violations,
            "kernel_launches": dict(self.kernels),
        }


class BlockChecker:
    """Candidate output of one MoE block, judged against the reference interval on every call."""

    def __init__(self, job: Any, rank_tensors: list[dict[str, torch.Tensor]], reference: list[RankWeights],
                 dtype: torch.dtype, device: torch.device, gemm: Callable | None, check: LayerCheck):
        self.job, self.tensors, self.reference = job, rank_tensors, reference
        self.dtype, self.device, self.gemm, self.check = dtype, device, gemm, check
        self.where = ""  # set by the caller before each run: "prompt P"
        self.kept: list[torch.Tensor] = []  # block inputs (model dtype) for the forced pass
        self.kept_rows = 0

    def candidate(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from wna16ctl.verification.rank_gemm import rank_moe_output

        total = torch.zeros(a.shape[0], a.shape[1])
        for r, t in enumerate(self.tensors):
            if not len(self.job.expert_ranges[r]):  # EP with more ranks than experts: nothing written
                continue
            partial = rank_moe_output(self.job, r, t, a, ids, w, self.dtype, self.device, gemm=self.gemm)
            total += partial.to(self.dtype).float()
        return total.to(self.dtype)

    def __call__(self, a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = a.to(self.dtype)
        y = self.candidate(a, ids, w)
        iv = block_interval(self.reference, a, ids, w, self.dtype)
        self.check.add(judge(y, iv), f"{self.where}, call {self.check.calls}")
        self.check.routed.update(int(e) for e in ids.reshape(-1).unique())
        if self.kept_rows < KEPT_ROWS:
            rows = a[: KEPT_ROWS - self.kept_rows].cpu()
            self.kept.append(rows)
            self.kept_rows += rows.shape[0]
        return y.to(a.device)

    def forced_pass(self) -> None:
        """Every expert no token was routed to, on the kept block inputs: each row sent to all of
        them at once (top-k = their number, router weight 1), judged like any call."""
        missing = [e for e in range(self.check.num_experts) if e not in self.check.routed]
        if not missing or not self.kept:
            return
        a = torch.cat(self.kept).to(self.dtype)
        ids = torch.tensor(missing, dtype=torch.int64).expand(a.shape[0], -1).contiguous()
        w = torch.ones(ids.shape, dtype=torch.float32)
        before = self.check.violations
        y = self.candidate(a.to(self.device), ids.to(self.device), w.to(self.device))
        self.check.add(judge(y.cpu(), block_interval(self.reference, a, ids, w, self.dtype)),
                       "forced routing")
        self.check.forced = missing
        self.check.forced_violations = self.check.violations - before
