"""vLLM's own Marlin preparation of one rank's experts of a GPTQ or AWQ checkpoint, from the
stored tensors (never through wna16ctl's readers).  Run in the engine venv:

    python _vllm_marlin_reference.py CKPT FORMAT LAYER_PREFIX EXPERTS TP RANK OUT

FORMAT: gptq (qweight packed along K, act-order g_idx) or awq (qweight and qzeros packed along N
in AWQ's interleaved order).  The rank's slices are those vLLM's MoE weight loader takes (gate and
up: the rank's output columns; down: the rank's input rows; act-order down scales: every group),
then vLLM's reference functions (vllm 0.32's marlin_utils) (marlin_utils_test.marlin_weights, which gptq_marlin_repack and
awq_marlin_repack are tested against, marlin_permute_scales, awq_to_marlin_zero_points) and the
act-order sort GPTQ's Marlin MoE method does (argsort of g_idx).  Writes OUT (safetensors) named
as wna16ctl's marlin layout names one expert's slices, prefixed `E.`.
"""

from __future__ import annotations

import sys

import numpy
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    awq_to_marlin_zero_points, marlin_permute_scales,
)
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights
from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

BITS = 4


def _unpack_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """GPTQ qweight [K/8, N] packed along K -> codes [K, N] (vLLM's unpack_cols on the transpose)."""
    return unpack_cols(packed.t().contiguous(), BITS, packed.shape[1], k).t().contiguous()


def _unpack_awq(packed: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """AWQ [K, N/8] interleaved -> codes [K, N]: unpack_cols, then awq_to_marlin_zero_points'
    own undo of the interleave."""
    undo = numpy.argsort(numpy.array([0, 2, 4, 6, 1, 3, 5, 7]))
    q = unpack_cols(packed, BITS, k, n)
    return q.reshape((-1, len(undo)))[:, undo].reshape(k, n).contiguous()


def main(ckpt: str, fmt: str, prefix: str, experts: int, tp: int, rank: int, out: str) -> None:
    perm = get_weight_perm(BITS)
    result: dict[str, torch.Tensor] = {}
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        def t(e: int, role: str, what: str) -> torch.Tensor:
            return f.get_tensor(f"{prefix}.{e}.{role}_proj.{what}")

        for e in range(experts):
            qw = {r: t(e, r, "qweight") for r in ("gate", "up", "down")}
            h = qw["gate"].shape[0] * (8 if fmt == "gptq" else 1)  # the hidden size: gate's K
            if fmt == "gptq":
                full_i = qw["gate"].shape[1]
                codes = {r: _unpack_rows(qw[r], h if r != "down" else full_i) for r in qw}
            else:
                full_i = qw["gate"].shape[1] * 8
                codes = {r: _unpack_awq(qw[r], h if r != "down" else full_i, full_i if r != "down" else h) for r in qw}
            i_p = full_i // tp
            cols = slice(rank * i_p, (rank + 1) * i_p)
            w13 = torch.cat([codes["gate"][:, cols], codes["up"][:, cols]], dim=1)
            w2 = codes["down"][cols, :]
            s13 = torch.cat([t(e, "gate", "scales")[:, cols], t(e, "up", "scales")[:, cols]], dim=1)
            s2 = t(e, "down", "scales")
            gs = h // s13.shape[0]
            if fmt == "gptq":
                g13 = t(e, "gate", "g_idx")
                g2 = t(e, "down", "g_idx")[cols]
                # vLLM's method sorts with torch.argsort, whose order among equal group ids is not
                # fixed (any such order computes the same); the stable order is the one wna16ctl writes
                p13, p2 = (torch.argsort(g, stable=True).to(torch.int32) for g in (g13, g2))
                result[f"{e}.w13_weight_g_idx"], result[f"{e}.w13_g_idx_sort_indices"] = g13[p13.long()], p13
                result[f"{e}.w2_weight_g_idx"], result[f"{e}.w2_g_idx_sort_indices"] = g2[p2.long()], p2
                w13, w2 = w13[p13.long()], w2[p2.long()]
            else:
                s2 = s2[rank * i_p // gs:(rank + 1) * i_p // gs]
                z13 = torch.cat([_unpack_awq(t(e, r, "qzeros"), h // gs, full_i)[:, cols] for r in ("gate", "up")], 1)
                z2 = _unpack_awq(t(e, "down", "qzeros"), full_i // gs, h)[rank * i_p // gs:(rank + 1) * i_p // gs]
                # back into AWQ's packing, for vLLM's own awq_to_marlin_zero_points
                interleave = numpy.array([0, 2, 4, 6, 1, 3, 5, 7])
                for name, z, n in (("w13_weight_zero_point", z13, 2 * i_p), ("w2_weight_zero_point", z2, h)):
                    zi = z.reshape(-1, 8)[:, interleave].reshape(z.shape)
                    packed = torch.zeros((z.shape[0], n // 8), dtype=torch.int64)
                    for j in range(8):
                        packed |= zi[:, j::8].to(torch.int64) << (4 * j)
                    packed = packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.to(torch.int32)
                    result[f"{e}.{name}"] = awq_to_marlin_zero_points(packed, z.shape[0], n, BITS)
            result[f"{e}.w13_weight_packed"] = marlin_weights(w13, h, 2 * i_p, BITS, perm)
            result[f"{e}.w2_weight_packed"] = marlin_weights(w2, i_p, h, BITS, perm)
            result[f"{e}.w13_weight_scale"] = marlin_permute_scales(s13, h, 2 * i_p, gs)
            result[f"{e}.w2_weight_scale"] = marlin_permute_scales(s2, i_p, h, gs)
    save_file({k: v.contiguous() for k, v in result.items()}, out)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), a[6])
