"""One rank's repacked experts, read back and run through the MoE GEMM.

Shared by the layer numerics of `checks` and the end-to-end run of `e2e`, which both compare a
rank's output with the dequantized checkpoint under the same rounding model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from wna16ctl.errors import LayoutMismatch
from wna16ctl.sources.headers import CheckpointFiles, read_checkpoint_files
from wna16ctl.sources.tensors import TensorReader, as_tensor

if TYPE_CHECKING:
    from wna16ctl.repacking.pipeline import LayerJob

# Roundings to the model dtype on the candidate's path: x, W13, the w13 output, h, W2, the w2
# output, the rank partial, the all-reduced sum.  Each contributes a relative error of RMS at most
# u/sqrt(3) (round-to-nearest), so an unbiased output's relative L2 error stays below
# sqrt(ROUNDINGS)·u; a systematic fault (wrong scale, swapped halves) exceeds it.
ROUNDINGS = 8
GEMM_DTYPES = (torch.float16, torch.bfloat16)  # what the Marlin MoE GEMM (ours and vLLM's) runs
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


class RankFiles:
    """One rank directory's tensors; reads one expert's slice of a stacked tensor at a time."""

    def __init__(self, root: Path):
        self.files: CheckpointFiles = read_checkpoint_files(root)
        self.reader = TensorReader(self.files)
        self.reader.mapped = True  # a slice at a time, mostly in the page cache: mapped, not copied

    def expert_slice(self, name: str, local: int) -> torch.Tensor:
        info = self.files.info(name)
        if not info.shape or local >= info.shape[0]:
            raise LayoutMismatch(f"{name}: has shape {list(info.shape)}, no expert slot {local}")
        per = info.nbytes // info.shape[0]
        sub = type(info)(info.name, info.dtype, info.shape[1:], info.file, info.start + local * per, info.start + (local + 1) * per)
        return as_tensor(self.reader.read_bytes(sub), info.dtype, sub.shape)

    def expert_slab(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Expert slots start..stop-1 of a stacked tensor, in one read."""
        info = self.files.info(name)
        if not info.shape or stop > info.shape[0] or start >= stop:
            raise LayoutMismatch(f"{name}: has shape {list(info.shape)}, no expert slots {start}-{stop - 1}")
        per = info.nbytes // info.shape[0]
        shape = (stop - start, *info.shape[1:])
        sub = type(info)(info.name, info.dtype, shape, info.file, info.start + start * per, info.start + stop * per)
        return as_tensor(self.reader.read_bytes(sub), info.dtype, sub.shape)


def rank_moe_output(job: LayerJob, r: int, t: dict[str, torch.Tensor], a: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, dtype: torch.dtype, device: torch.device,
                    gemm: Callable[..., torch.Tensor] | None = None,
                    keep: dict[str, torch.Tensor] | None = None, experts: range | None = None) -> torch.Tensor:
    """Rank r's layer output through the MoE GEMM over its repacked tensors `t` (Marlin layout):
    w13 GEMM, SiLU·mul, w2 GEMM with the router weights; per-slot outputs in the model dtype,
    summed over the top-k slots in fp32. Returns [T, H] fp32 on the CPU. `gemm` (the signature of
    `ops.moe_wna16_gemm`) defaults to the torch op; `EmulatedGemm` runs the real kernel source.
    `keep`, when given, receives each GEMM's per-slot output (slot s = token * k + j, zero where
    the slot is not this rank's): "w13" [T·k, 2P], "h" [T·k, P] (the w2 GEMM's input), "w2"
    [T·k, H] (router weight applied), all in the model dtype.  `experts`: the global ids of the
    experts `t` holds, a run of the rank's (a slab read at a time); by default all of the rank's."""
    from wna16ctl.native.ops import moe_wna16_gemm

    if gemm is None:
        gemm = moe_wna16_gemm

    spec = job.specs[r]
    rng = job.expert_ranges[r] if experts is None else experts
    assert job.plan.w2 is not None, "a layer job is made for a plan that loads, which has its w2 sharding"
    T, k = topk_ids.shape
    topk_ids = topk_ids.cpu()
    ids = topk_ids.reshape(-1)  # slot s = token * k + j
    slots = ((ids >= rng.start) & (ids < rng.stop)).nonzero().squeeze(1)
    local = ids[slots] - rng.start
    order = torch.argsort(local, stable=True)
    sorted_ids = slots[order].to(torch.int32).to(device)
    counts = torch.bincount(local, minlength=len(rng))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(device)
    act = spec.act_order
    g13 = gemm(
        a.to(device), t["w13_weight_packed"], t["w13_weight_scale"], sorted_ids, offsets, top_k=k,
        num_bits=spec.num_bits, zero_points=t.get("w13_weight_zero_point"),
        g_idx=t["w13_weight_g_idx"] if act else None, perm=t["w13_g_idx_sort_indices"] if act else None,
        is_k_full=True)
    P = spec.padded_intermediate
    h = (F.silu(g13[:, :P].float()) * g13[:, P:].float()).to(dtype)
    y = gemm(
        h, t["w2_weight_packed"], t["w2_weight_scale"], sorted_ids, offsets, top_k=1,
        num_bits=spec.num_bits, zero_points=t.get("w2_weight_zero_point"),
        g_idx=t["w2_weight_g_idx"] if act else None, perm=t["w2_g_idx_sort_indices"] if act else None,
        topk_weights=topk_weights.reshape(-1).float().to(device), is_k_full=job.plan.w2.is_k_full)
    if keep is not None:
        keep.update(w13=g13.cpu(), h=h.cpu(), w2=y.cpu())
    return y.float().cpu().view(T, k, -1).sum(1)


class EmulatedGemm:
    """The MoE GEMM through the real CUDA kernel source on the CPU emulation
    (`wna16ctl.native.emulated`), counting launches per kernel and their time."""

    def __init__(self) -> None:
        import threading

        self.launches: dict[str, int] = {}
        self.seconds = 0.0  # summed over the launches, which may overlap
        # Launches from several threads run side by side, as on streams: a small launch (a slab
        # of few tokens is a grid of one or two blocks) leaves cores idle that another rank's
        # launch can use. The counts are kept under the lock.
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        import time

        from wna16ctl.native.emulated import emulated_moe_gemm

        t0 = time.perf_counter()
        out, kernel = emulated_moe_gemm(*args, **kwargs)
        took = time.perf_counter() - t0
        with self._lock:
            self.seconds += took
            self.launches[kernel] = self.launches.get(kernel, 0) + 1
        return out
