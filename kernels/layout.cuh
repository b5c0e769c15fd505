// Marlin index math for 16-bit-activation WNA16 weights: the one definition shared by the CUDA
// kernels (repack.cu, moe_gemm.cu) and the host library (host.cpp). The host build is what the
// test-suite checks against the Python layout code, so the GPU runs math that CI has executed.
//
// Notation follows docs "wna16-spec" §6.4-§6.6: K = size_k (input dim), N = size_n (output dim),
// nb = bits per code (4 or 8), pf = 32 / nb codes per int32 word, codes packed LSB-first.
// A Marlin weight has shape [K/16, N*16/pf]: one row per 16-row k-tile, and inside that row one
// block of W = 1024/pf words per 64-column n-tile.
//
// Plain C++ when not compiled by nvcc, so g++ builds the same functions for the host.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define WNA16_HD __host__ __device__ __forceinline__
#else
#define WNA16_HD inline
#endif

// Full unrolling where a loop indexes register arrays (accumulators, fragments) on the device;
// nothing for host compilers, which would warn about the unknown pragma.
#if defined(__CUDA_ARCH__)
#define WNA16_UNROLL _Pragma("unroll")
#else
#define WNA16_UNROLL
#endif

// Codes per int32 word.
WNA16_HD int wna16_pack_factor(int num_bits) { return 32 / num_bits; }

// Words per (k-tile, n-tile) block: 64*16 codes / pf.
WNA16_HD int wna16_words_per_tile(int num_bits) { return 1024 / wna16_pack_factor(num_bits); }

// --------------------------------------------------------------------------------------------
// Weights (§6.4). Forward map: output word `col` of k-tile row `kt`, code slot `slot` (bits
// [nb*slot, nb*slot+nb)) holds the code of logical (row-sorted) element (k, n).
//
// Inside a 16x64 tile, lane t (0..31) and warp w (0..3) own the 8 values
//   v0=(r,c) v1=(r+8,c) v2=(r,c+8) v3=(r+8,c+8) v4=(r+1,c) v5=(r+9,c) v6=(r+1,c+8) v7=(r+9,c+8)
// with r = 2(t%4), c = 16w + t/4 -- exactly the B fragments of two m16n8k16 mma.sync tiles,
// which is why the layout exists. 4-bit: one word per (t,w), slot i = v_i. 8-bit: two words per
// (t,w): word h=0 holds v0,v1,v4,v5 and h=1 holds v2,v3,v6,v7.
// --------------------------------------------------------------------------------------------
// Word j (0 .. 1024/pf) of an n-tile: offsets (inside the 16x64 tile) of its slot-0 value.
WNA16_HD void wna16_marlin_word_base(int num_bits, int j, int* k_off, int* n_off) {
  int t, w, h;
  if (num_bits == 4) {
    t = j >> 2, w = j & 3, h = 0;
  } else {
    t = j >> 3, w = (j >> 1) & 3, h = j & 1;  // word h = 1 takes the columns c + 8
  }
  *k_off = 2 * (t & 3);                 // r
  *n_off = 16 * w + (t >> 2) + 8 * h;   // c (+ 8)
}

// Offset of code `slot` from the slot-0 value of its word.
WNA16_HD void wna16_marlin_slot_delta(int num_bits, int slot, int* dk, int* dn) {
  if (num_bits == 4) {
    *dk = ((slot & 1) << 3) | ((slot >> 2) & 1);  // v_i: bit0 -> +8 rows, bit2 -> +1 row
    *dn = ((slot >> 1) & 1) << 3;                 //      bit1 -> +8 columns
  } else {
    *dk = ((slot & 1) << 3) | (slot >> 1);  // bytes of a word: rows r, r+8, r+1, r+9
    *dn = 0;
  }
}

WNA16_HD void wna16_marlin_src(int num_bits, int64_t kt, int64_t col, int slot, int64_t* k,
                               int64_t* n) {
  const int wpt = wna16_words_per_tile(num_bits);
  int k_off, n_off, dk, dn;
  wna16_marlin_word_base(num_bits, (int)(col % wpt), &k_off, &n_off);
  wna16_marlin_slot_delta(num_bits, slot, &dk, &dn);
  *k = 16 * kt + k_off + dk;
  *n = 64 * (col / wpt) + n_off + dn;
}

// Inverse of wna16_marlin_src: where logical element (k, n) lands.
WNA16_HD void wna16_marlin_dst(int num_bits, int64_t k, int64_t n, int64_t* kt, int64_t* col,
                               int* slot) {
  const int kk = (int)(k & 15);
  const int nn = (int)(n & 63);
  const int w = nn >> 4;
  const int cc = nn & 15;
  const int hi_n = cc >> 3;         // column c+8 ?
  const int hi_k = kk >> 3;         // row r+8 ?
  const int odd_k = kk & 1;         // row r+1 ?
  const int t = ((cc & 7) << 2) | ((kk & 7) >> 1);
  const int64_t nt = n >> 6;
  *kt = k >> 4;
  if (num_bits == 4) {
    *col = nt * 128 + 4 * t + w;
    *slot = hi_k | (hi_n << 1) | (odd_k << 2);
  } else {
    *col = nt * 256 + 8 * t + 2 * w + hi_n;
    *slot = hi_k | (odd_k << 1);
  }
}

// Extract code `i` (LSB-first) of a packed word.
WNA16_HD uint32_t wna16_code(uint32_t word, int i, int num_bits) {
  return (word >> (num_bits * i)) & ((1u << num_bits) - 1u);
}

// Whole words, built from the k-tile's packed rows the way a fast loop wants them: for lane
// t = 4c + tl of warp w the codes of rows r, r+1 (r = 2tl) are adjacent in one packed word, so one
// source word per (row block, column) feeds four lanes. `rows` = the 16/pf packed rows of the
// k-tile (stride ld), n = 64*nt + 16w + c. The same placement as wna16_marlin_src, specialised
// (the tests compare the repacks built on these with the Python layout code).
//   4-bit: x = rows[0][n], y = rows[1][n] (k rows 0-7 / 8-15), xp, yp the same at column n + 8.
WNA16_HD uint32_t wna16_marlin_word4(uint32_t x, uint32_t y, uint32_t xp, uint32_t yp, int tl) {
  const int sh = 8 * tl;
  x = (x >> sh) & 0xff, y = (y >> sh) & 0xff, xp = (xp >> sh) & 0xff, yp = (yp >> sh) & 0xff;
  return (x & 0xf) | (y & 0xf) << 4 | (xp & 0xf) << 8 | (yp & 0xf) << 12 | (x >> 4) << 16 |
         (y >> 4) << 20 | (xp >> 4) << 24 | (yp >> 4) << 28;
}

//   8-bit, word h of the lane: lo = rows[tl / 2][n], hi = rows[2 + tl / 2][n] with n = ... + 8h.
WNA16_HD uint32_t wna16_marlin_word8(uint32_t lo, uint32_t hi, int tl) {
  const int sh = 16 * (tl & 1);
  lo >>= sh, hi >>= sh;
  return (lo & 0xff) | (hi & 0xff) << 8 | ((lo >> 8) & 0xff) << 16 | ((hi >> 8) & 0xff) << 24;
}

// Word j (0 .. 1024/pf) of one n-tile, from the k-tile rows starting at column n0.
WNA16_HD uint32_t wna16_marlin_tile_word(const uint32_t* rows, int64_t ld, int num_bits,
                                         int64_t n0, int j) {
  if (num_bits == 4) {
    const int t = j >> 2, w = j & 3;
    const int64_t n = n0 + 16 * w + (t >> 2);
    return wna16_marlin_word4(rows[n], rows[ld + n], rows[n + 8], rows[ld + n + 8], t & 3);
  }
  const int t = j >> 3, w = (j >> 1) & 3, h = j & 1, tl = t & 3;
  const int64_t n = n0 + 16 * w + (t >> 2) + 8 * h;
  return wna16_marlin_word8(rows[(tl >> 1) * ld + n], rows[(2 + (tl >> 1)) * ld + n], tl);
}

// --------------------------------------------------------------------------------------------
// Scales (§6.5). Stored[j] = logical[src(j)] inside each chunk of 64 (grouped) or 32 (channel).
// grouped = (group_size != -1 && group_size < size_k) on the producer side; the GEMM kernel
// reads the grouped layout iff it has more than one scale row.
// --------------------------------------------------------------------------------------------
WNA16_HD int wna16_scale_chunk(int grouped) { return grouped ? 64 : 32; }

// scale_perm = [i + 8j for i, j]: an 8x8 transpose, hence its own inverse.
// scale_perm_single = for i in 0..3: 2i + {0,1,8,9,16,17,24,25}.
WNA16_HD int wna16_scale_src(int grouped, int j) {
  if (grouped) return ((j & 7) << 3) | (j >> 3);
  const int i = j >> 3, m = j & 7;
  return 2 * i + (m & 1) + 8 * (m >> 1);
}

WNA16_HD int wna16_scale_dst(int grouped, int n) {
  if (grouped) return ((n & 7) << 3) | (n >> 3);
  return 8 * ((n & 7) >> 1) + 2 * (n >> 3) + (n & 1);
}

// Stored position of logical column n (any n, chunks repeat along N).
WNA16_HD int64_t wna16_scale_pos(int grouped, int64_t n) {
  const int ch = wna16_scale_chunk(grouped);
  return (n / ch) * ch + wna16_scale_dst(grouped, (int)(n % ch));
}

// --------------------------------------------------------------------------------------------
// Zero points (§6.6): codes Z[g][n] are permuted per 64-chunk by scale_perm, then interleaved in
// groups of pf ([0,2,4,6,1,3,5,7] for 4-bit, [0,2,1,3] for 8-bit), then packed pf per word.
// Composite: packed slot q (0..63 inside a chunk) holds Z[chunk + wna16_zp_src(q)].
// --------------------------------------------------------------------------------------------
WNA16_HD int wna16_zp_src(int num_bits, int q) {
  const int pf = wna16_pack_factor(num_bits);
  const int i = q % pf;
  // interleave: even lanes first, then odd lanes (for pf = 8: 0,2,4,6,1,3,5,7)
  const int il = (i < pf / 2) ? 2 * i : 2 * (i - pf / 2) + 1;
  return wna16_scale_src(1, (q - i) + il);
}

WNA16_HD int wna16_zp_dst(int num_bits, int n) {
  const int pf = wna16_pack_factor(num_bits);
  const int j = wna16_scale_dst(1, n);  // position after the scale permutation
  const int i = j % pf;
  const int il_inv = (i & 1) ? (pf / 2 + (i >> 1)) : (i >> 1);
  return (j - i) + il_inv;
}

// Code of logical zero point (row-local column n) from one Marlin zero-point row.
WNA16_HD uint32_t wna16_zp_code(const uint32_t* zp_row, int num_bits, int64_t n) {
  const int pf = wna16_pack_factor(num_bits);
  const int64_t q = (n >> 6) * 64 + wna16_zp_dst(num_bits, (int)(n & 63));
  return wna16_code(zp_row[q / pf], (int)(q % pf), num_bits);
}
