"""An independent reference of the rank layouts, written from the format notes (wna16-spec §5,
§6.2–6.6, §7.1–7.2, Appendix A) with numpy and plain Python. It shares no code with
`wna16ctl.layout`; tests compare the two.

Arrays are numpy: packed words as int32, codes as int64.
"""

from __future__ import annotations

import hashlib
import json
from math import lcm

import numpy as np

# Appendix A checksums of json.dumps(perm).
WEIGHT_PERM_SHA256 = {
    4: "44c7fd18f01f0b9dae75ab2b31cffdfbc3458736db94735857616fcaa2e5c57d",
    8: "ed60ada12550fadfd48297668a1916d42b77383e296a5241d2b0c983fce12528",
}

# §6.6 composite per-64-chunk source indices, copied from the text.
ZERO_POINT_INDEX = {
    4: [0, 16, 32, 48, 8, 24, 40, 56, 1, 17, 33, 49, 9, 25, 41, 57, 2, 18, 34, 50, 10, 26, 42, 58,
        3, 19, 35, 51, 11, 27, 43, 59, 4, 20, 36, 52, 12, 28, 44, 60, 5, 21, 37, 53, 13, 29, 45, 61,
        6, 22, 38, 54, 14, 30, 46, 62, 7, 23, 39, 55, 15, 31, 47, 63],
    8: [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25, 33, 49, 41, 57, 2, 18, 10, 26, 34, 50, 42, 58,
        3, 19, 11, 27, 35, 51, 43, 59, 4, 20, 12, 28, 36, 52, 44, 60, 5, 21, 13, 29, 37, 53, 45, 61,
        6, 22, 14, 30, 38, 54, 46, 62, 7, 23, 15, 31, 39, 55, 47, 63],
}

# §6.5 lists as written out in the text.
SCALE_PERM_TEXT = [0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57]  # first 16 entries
SCALE_PERM_SINGLE_TEXT = [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                          4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31]

INTERLEAVE = {4: [0, 2, 4, 6, 1, 3, 5, 7], 8: [0, 2, 1, 3]}


# ----------------------------------------------------------------------------------------------
# §1 packing


def pack(codes: np.ndarray, num_bits: int, axis: int) -> np.ndarray:
    """Pack codes along `axis`, pf per word, element i at bits [nb·i, nb·i + nb)."""
    pf = 32 // num_bits
    moved = np.moveaxis(np.asarray(codes, dtype=np.uint64), axis, -1)
    size = moved.shape[-1]
    words = -(-size // pf)
    padded = np.zeros(moved.shape[:-1] + (words * pf,), dtype=np.uint64)
    padded[..., :size] = moved & ((1 << num_bits) - 1)
    grouped = padded.reshape(moved.shape[:-1] + (words, pf))
    shifts = np.arange(pf, dtype=np.uint64) * np.uint64(num_bits)
    packed = (grouped << shifts).sum(axis=-1).astype(np.uint32).view(np.int32)
    return np.moveaxis(packed, -1, axis)


def unpack(words: np.ndarray, num_bits: int, axis: int, size: int) -> np.ndarray:
    pf = 32 // num_bits
    moved = np.moveaxis(np.asarray(words).astype(np.int32).view(np.uint32).astype(np.int64), axis, -1)
    shifts = np.arange(pf, dtype=np.int64) * num_bits
    codes = (moved[..., None] >> shifts) & ((1 << num_bits) - 1)
    codes = codes.reshape(moved.shape[:-1] + (moved.shape[-1] * pf,))[..., :size]
    return np.moveaxis(codes, -1, axis)


# ----------------------------------------------------------------------------------------------
# §6.4 closed form


def marlin_closed_form_loops(q: list[list[int]], num_bits: int) -> list[list[int]]:
    """The closed form with scalar loops over every k-tile, n-tile, lane and warp (tiny shapes)."""
    size_k, size_n = len(q), len(q[0])
    words_per_tile = 128 if num_bits == 4 else 256
    out = [[0] * (size_n // 64 * words_per_tile) for _ in range(size_k // 16)]
    for kt in range(size_k // 16):
        for nt in range(size_n // 64):
            for t in range(32):
                for w in range(4):
                    r, c, k0, n0 = 2 * (t % 4), 16 * w + t // 4, 16 * kt, 64 * nt
                    v = [
                        q[k0 + r][n0 + c], q[k0 + r + 8][n0 + c], q[k0 + r][n0 + c + 8], q[k0 + r + 8][n0 + c + 8],
                        q[k0 + r + 1][n0 + c], q[k0 + r + 9][n0 + c], q[k0 + r + 1][n0 + c + 8],
                        q[k0 + r + 9][n0 + c + 8],
                    ]
                    if num_bits == 4:
                        out[kt][nt * 128 + 4 * t + w] = sum(v[i] << (4 * i) for i in range(8))
                    else:
                        out[kt][nt * 256 + 8 * t + 2 * w] = v[0] | v[1] << 8 | v[4] << 16 | v[5] << 24
                        out[kt][nt * 256 + 8 * t + 2 * w + 1] = v[2] | v[3] << 8 | v[6] << 16 | v[7] << 24
    return out


def marlin_closed_form(q: np.ndarray, num_bits: int) -> np.ndarray:
    """The closed form with loops over lane t and warp w, every tile at once. Returns int32."""
    size_k, size_n = q.shape
    kt, nt = size_k // 16, size_n // 64
    tiles = np.asarray(q, dtype=np.uint64).reshape(kt, 16, nt, 64)
    per_tile = 128 if num_bits == 4 else 256
    out = np.zeros((kt, nt, per_tile), dtype=np.uint64)
    for t in range(32):
        for w in range(4):
            r, c = 2 * (t % 4), 16 * w + t // 4
            v = [
                tiles[:, r, :, c], tiles[:, r + 8, :, c], tiles[:, r, :, c + 8], tiles[:, r + 8, :, c + 8],
                tiles[:, r + 1, :, c], tiles[:, r + 9, :, c], tiles[:, r + 1, :, c + 8], tiles[:, r + 9, :, c + 8],
            ]
            if num_bits == 4:
                out[:, :, 4 * t + w] = sum(v[i] << np.uint64(4 * i) for i in range(8))
            else:
                out[:, :, 8 * t + 2 * w] = v[0] | v[1] << np.uint64(8) | v[4] << np.uint64(16) | v[5] << np.uint64(24)
                out[:, :, 8 * t + 2 * w + 1] = (
                    v[2] | v[3] << np.uint64(8) | v[6] << np.uint64(16) | v[7] << np.uint64(24)
                )
    return out.reshape(kt, nt * per_tile).astype(np.uint32).view(np.int32)


# ----------------------------------------------------------------------------------------------
# §6.4 table form / Appendix A


def weight_perm(num_bits: int) -> list[int]:
    """perm of Appendix A, built as §6.4 describes it."""
    perm: list[int] = []
    for t in range(32):
        r, col = 2 * (t % 4), t // 4
        base = [16 * row + col + 8 * blk for blk in (0, 1) for row in (r, r + 1, r + 8, r + 9)]
        for w in range(4):
            perm.extend(b + 256 * w for b in base)
    interleave = INTERLEAVE[num_bits]
    group = len(interleave)
    return [perm[i - i % group + interleave[i % group]] for i in range(len(perm))]


def weight_perm_sha256(num_bits: int) -> str:
    return hashlib.sha256(json.dumps(weight_perm(num_bits)).encode()).hexdigest()


def marlin_table_form(q: np.ndarray, num_bits: int) -> np.ndarray:
    """Reshape to [K/16, 16, N/16, 16], swap the middle axes, permute chunks of 1024, pack."""
    size_k, size_n = q.shape
    rows = np.asarray(q).reshape(size_k // 16, 16, size_n // 16, 16).transpose(0, 2, 1, 3).reshape(size_k // 16, -1)
    perm = np.array(weight_perm(num_bits))
    permuted = rows.reshape(-1, 1024)[:, perm].reshape(rows.shape)
    return pack(permuted, num_bits, axis=1)


# ----------------------------------------------------------------------------------------------
# §6.5 scales, §6.6 zero points


def scale_perm() -> list[int]:
    return [i + 8 * j for i in range(8) for j in range(8)]


def scale_perm_single() -> list[int]:
    return [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]


def permute_scales(s: np.ndarray, size_k: int, group_size: int) -> np.ndarray:
    perm = scale_perm() if (group_size < size_k and group_size != -1) else scale_perm_single()
    return s.reshape(-1, len(perm))[:, perm].reshape(s.shape)


def zero_point_index_two_step(num_bits: int) -> list[int]:
    """scale_perm, then the in-word interleave within groups of 8 (4-bit) or 4 (8-bit)."""
    perm = scale_perm()
    interleave = INTERLEAVE[num_bits]
    group = len(interleave)
    return [perm[i - i % group + interleave[i % group]] for i in range(64)]


def marlin_zero_points(zp_words: np.ndarray, size_n: int, num_bits: int) -> np.ndarray:
    codes = unpack(zp_words, num_bits, axis=-1, size=size_n)
    index = np.array(ZERO_POINT_INDEX[num_bits])
    chunks = codes.reshape(codes.shape[0], size_n // 64, 64)[:, :, index]
    return pack(chunks.reshape(codes.shape), num_bits, axis=-1)


# ----------------------------------------------------------------------------------------------
# §5 sharding, straight from the table


def shard(expert: dict[str, dict[str, np.ndarray]], tp: int, rank: int, load_full_w2: bool,
          group_size: int, num_bits: int) -> dict[str, np.ndarray]:
    pf = 32 // num_bits
    gate, up, down = expert["gate"], expert["up"], expert["down"]
    i_full = gate["weight_packed"].shape[0]
    i_p = i_full // tp
    c = rank * i_p
    out = {
        "w13_weight_packed": np.concatenate(
            [gate["weight_packed"].T[:, c : c + i_p], up["weight_packed"].T[:, c : c + i_p]], axis=1),
        "w2_weight_packed": down["weight_packed"].T[rank * i_p // pf : (rank + 1) * i_p // pf, :],
        "w13_weight_scale": np.concatenate(
            [gate["weight_scale"].T[:, c : c + i_p], up["weight_scale"].T[:, c : c + i_p]], axis=1),
    }
    if group_size == -1 or load_full_w2:
        out["w2_weight_scale"] = down["weight_scale"].T
    else:
        g2 = i_p // group_size
        out["w2_weight_scale"] = down["weight_scale"].T[rank * g2 : (rank + 1) * g2, :]
    if "weight_zero_point" in gate:
        zc = slice(rank * i_p // pf, (rank + 1) * i_p // pf)
        out["w13_weight_zero_point"] = np.concatenate(
            [gate["weight_zero_point"].T[:, zc], up["weight_zero_point"].T[:, zc]], axis=1)
        if group_size == -1:
            out["w2_weight_zero_point"] = down["weight_zero_point"].T
        else:
            g2 = i_p // group_size
            out["w2_weight_zero_point"] = down["weight_zero_point"].T[rank * g2 : (rank + 1) * g2, :]
    if "weight_g_idx" in gate:
        out["w13_weight_g_idx"] = up["weight_g_idx"]
        out["w2_weight_g_idx"] = down["weight_g_idx"][c : c + i_p]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# whole ranks


def padded_intermediate(i_p: int, group_size: int) -> int:
    multiple = lcm(64, max(group_size, 1))
    return -(-i_p // multiple) * multiple


def marlin_expert(kfirst: dict[str, np.ndarray], hidden: int, padded: int, group_size: int,
                  num_bits: int, act_order: bool, load_full_w2: bool) -> dict[str, np.ndarray]:
    """§6.2–6.6 on one expert's §5 tensors, w13 scales with size_k = H."""
    pf = 32 // num_bits
    i_p = kfirst["w13_weight_packed"].shape[1] // 2

    def pad_halves(x: np.ndarray, size: int, padded_size: int) -> np.ndarray:
        out = np.zeros(x.shape[:-1] + (2 * padded_size,), dtype=x.dtype)
        out[..., :size] = x[..., :size]
        out[..., padded_size : padded_size + size] = x[..., size:]
        return out

    def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
        out = np.zeros((rows,) + x.shape[1:], dtype=x.dtype)
        out[: x.shape[0]] = x
        return out

    w13_codes = unpack(pad_halves(kfirst["w13_weight_packed"], i_p, padded), num_bits, 0, hidden)
    w2_codes = unpack(pad_rows(kfirst["w2_weight_packed"], padded // pf), num_bits, 0, padded)
    out: dict[str, np.ndarray] = {}
    if act_order:
        for prefix in ("w13", "w2"):
            g_idx = kfirst[f"{prefix}_weight_g_idx"]
            order = np.argsort(g_idx, kind="stable")
            out[f"{prefix}_weight_g_idx"] = g_idx[order].astype(np.int32)
            out[f"{prefix}_g_idx_sort_indices"] = order.astype(np.int32)
        w13_codes = w13_codes[out["w13_g_idx_sort_indices"]]
        w2_codes = w2_codes[out["w2_g_idx_sort_indices"]]
    out["w13_weight_packed"] = marlin_table_form(w13_codes, num_bits)
    out["w2_weight_packed"] = marlin_table_form(w2_codes, num_bits)
    out["w13_weight_scale"] = permute_scales(pad_halves(kfirst["w13_weight_scale"], i_p, padded), hidden, group_size)
    w2_scale = kfirst["w2_weight_scale"]
    if group_size != -1 and not load_full_w2:
        w2_scale = pad_rows(w2_scale, padded // group_size)
    size_k = w2_scale.shape[0] * (group_size if group_size != -1 else pf)
    out["w2_weight_scale"] = permute_scales(w2_scale, size_k, group_size)
    if "w13_weight_zero_point" in kfirst:
        w13_zp = pad_halves(kfirst["w13_weight_zero_point"], i_p // pf, padded // pf)
        out["w13_weight_zero_point"] = marlin_zero_points(w13_zp, 2 * padded, num_bits)
        w2_zp = kfirst["w2_weight_zero_point"]
        if group_size != -1:
            w2_zp = pad_rows(w2_zp, padded // group_size)
        out["w2_weight_zero_point"] = marlin_zero_points(w2_zp, hidden, num_bits)
    return out


def transposed_expert(kfirst: dict[str, np.ndarray], num_bits: int) -> dict[str, np.ndarray]:
    """§7.1 via the kernel semantics of §7.2: bytes built from codes, not from a memory view."""
    pf = 32 // num_bits

    def weight_bytes(packed: np.ndarray) -> np.ndarray:
        codes = unpack(packed, num_bits, 0, packed.shape[0] * pf).T  # [N, K]
        if num_bits == 8:
            return codes.astype(np.uint8)
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)

    def zero_point_bytes(zp: np.ndarray) -> np.ndarray:
        codes = unpack(zp, num_bits, 1, zp.shape[1] * pf).T  # [N, G]
        if num_bits == 8:
            return codes.astype(np.uint8)
        return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)

    out = {
        "w13_weight_packed": weight_bytes(kfirst["w13_weight_packed"]),
        "w2_weight_packed": weight_bytes(kfirst["w2_weight_packed"]),
        "w13_weight_scale": np.ascontiguousarray(kfirst["w13_weight_scale"].T),
        "w2_weight_scale": np.ascontiguousarray(kfirst["w2_weight_scale"].T),
    }
    if "w13_weight_zero_point" in kfirst:
        out["w13_weight_zero_point"] = zero_point_bytes(kfirst["w13_weight_zero_point"])
        out["w2_weight_zero_point"] = zero_point_bytes(kfirst["w2_weight_zero_point"])
    return out


def rank_tensors(experts: list[dict[str, dict[str, np.ndarray]]], *, layout: str, tp: int, rank: int,
                 load_full_w2: bool, group_size: int, num_bits: int, act_order: bool) -> dict[str, np.ndarray]:
    per_expert = []
    for expert in experts:
        kfirst = shard(expert, tp, rank, load_full_w2, group_size, num_bits)
        if layout == "marlin":
            hidden = expert["down"]["weight_packed"].shape[0]
            i_p = kfirst["w13_weight_packed"].shape[1] // 2
            padded = i_p if act_order else padded_intermediate(i_p, group_size)
            per_expert.append(marlin_expert(kfirst, hidden, padded, group_size, num_bits, act_order, load_full_w2))
        else:
            per_expert.append(transposed_expert(kfirst, num_bits))
    return {name: np.stack([e[name] for e in per_expert]) for name in per_expert[0]}
