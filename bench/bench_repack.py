"""Repack throughput against `cp -r` of the same checkpoint, measured in the same run, and peak RSS.

A random-code Qwen3-30B-A3B-shaped checkpoint (H 2048, I 768, 128 experts, int4 g128) with
`--layers` MoE layers (4 ≈ 1.2 GiB of packed experts) is repacked with `--tp 2`; runs alternate
cp / repack so that drift of a shared machine hits both alike.  Peak RSS is also measured at a
second size to show it does not grow with the checkpoint.  A per-tensor micro-benchmark compares
`build_rank_tensors` with a straightforward per-expert reference (unpack, index-gather through
the Appendix-A permutation table, pack).

    python bench/bench_repack.py [--layers 4] [--runs 3] [--dir /tmp/wna16ctl-bench]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_checkpoint  # noqa: E402
from common import med, run_once, wna16ctl  # noqa: E402


def _ckpt(root: Path, layers: int) -> Path:
    path = root / f"q30-{layers}l"
    if not (path / "config.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        synthetic_checkpoint.write(path, layers=layers)
    return path


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def whole_command(root: Path, layers: int, runs: int) -> list[str]:
    ck = _ckpt(root, layers)
    out, copy = root / "out", root / "copy"
    size = _dir_bytes(ck)
    cp_runs, rp_runs = [], []
    for i in range(runs + 1):  # first pair is a warm-up (page cache)
        # both start from a missing destination: deleting the previous output is timed for neither
        shutil.rmtree(copy, ignore_errors=True)
        c = run_once(["cp", "-r", str(ck), str(copy)])
        shutil.rmtree(out, ignore_errors=True)
        r = run_once(wna16ctl("repack", str(ck), "--tp", "2", "-o", str(out), "-q"))
        if i:
            cp_runs.append(c)
            rp_runs.append(r)
    shutil.rmtree(copy, ignore_errors=True)
    ratios = [r.wall / c.wall for r, c in zip(rp_runs, cp_runs)]
    rp, cp = med([r.wall for r in rp_runs]), med([c.wall for c in cp_runs])
    return [
        f"| {layers} layers, {size / 2**30:.2f} GiB, --tp 2 | {cp:.2f} s | {rp:.2f} s | {med(ratios):.2f}× "
        f"({min(ratios):.2f}–{max(ratios):.2f}) | {size / rp / 2**20:.0f} MiB/s | {max(r.max_rss_kib for r in rp_runs) / 1024:.0f} MiB |"
    ]


def per_tensor(repeats: int = 3) -> list[str]:
    import torch

    from wna16ctl.layout.rank import RankLayout, build_rank_tensors

    H, I, E = 2048, 768, 8
    g = torch.Generator().manual_seed(0)

    def proj(n: int, k: int) -> dict[str, torch.Tensor]:
        return {"weight_packed": torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32),
                "weight_scale": torch.rand(n, k // 128, generator=g).to(torch.bfloat16)}

    experts = [{"gate": proj(I, H), "up": proj(I, H), "down": proj(H, I)} for _ in range(E)]
    spec = RankLayout(layout="marlin", num_bits=4, group_size=128, symmetric=True, act_order=False, hidden_size=H,
                      intermediate_size=I, tp=1, rank=0, load_full_w2=False, padded_intermediate=I)
    nbytes = E * 3 * H * I // 2

    def best(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    ours = best(lambda: build_rank_tensors(experts, spec))
    # straightforward per-expert reference: unpack every code, gather through the 1024-entry
    # permutation table, pack again (what the engine's Python test helpers do)
    perm = _weight_perm_4bit()

    def marlin_naive(kfirst: torch.Tensor) -> torch.Tensor:
        K, N = kfirst.shape[0] * 8, kfirst.shape[1]
        q = torch.stack([(kfirst >> (4 * i)) & 15 for i in range(8)], dim=1).reshape(K, N)
        q = q.reshape(K // 16, 16, N // 16, 16).permute(0, 2, 1, 3).reshape(K // 16, N * 16)
        q = q.reshape(-1, 1024)[:, perm].reshape(K // 16, N * 16 // 8, 8)
        out = torch.zeros(q.shape[:2], dtype=torch.int32)
        for i in range(8):
            out |= (q[..., i] << (4 * i)).to(torch.int32)
        return out

    def naive() -> None:
        for ex in experts:
            w13 = torch.cat([ex["gate"]["weight_packed"], ex["up"]["weight_packed"]]).T.contiguous()
            marlin_naive(w13)
            marlin_naive(ex["down"]["weight_packed"].T.contiguous())

    ref = best(naive)
    return [f"| build_rank_tensors, {E} experts of H 2048 × I 768 int4 (Marlin) | {nbytes / ours / 2**20:.0f} MiB/s | "
            f"{nbytes / ref / 2**20:.0f} MiB/s | {ref / ours:.1f}× |"]


def _weight_perm_4bit():  # -> torch.Tensor
    """Appendix A of the spec: 4-bit Marlin permutation of one 16x64 tile (1024 entries)."""
    import torch

    perm = []
    for t in range(32):
        r, col = 2 * (t % 4), t // 4
        base = [16 * row + col + 8 * blk for blk in (0, 1) for row in (r, r + 1, r + 8, r + 9)]
        for w in range(4):
            perm.extend(b + 256 * w for b in base)
    perm_t = torch.tensor(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
    return perm_t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--small-layers", type=int, default=1, help="second size for the RSS comparison")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wna16ctl-bench"))
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    print("| checkpoint | cp -r | repack | repack / cp (min–max) | repack throughput | repack peak RSS |")
    print("|---|---|---|---|---|---|")
    for layers in (a.small_layers, a.layers):
        for row in whole_command(a.dir, layers, a.runs):
            print(row, flush=True)
    print()
    print("| per tensor | wna16ctl | per-expert reference | speed-up |")
    print("|---|---|---|---|")
    for row in per_tensor():
        print(row)


if __name__ == "__main__":
    main()
