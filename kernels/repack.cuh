// The CUDA repack's per-block work as barrier-separated phases (the kernel is in repack.cu; the
// tests run it on the CPU emulation of intrinsics.cuh), like moe_gemm.cuh for the GEMM.
//
// Task = (expert, k-tile, chunk of kRepackCols columns). Phase 1 stages the k-tile's 16/pf
// packed rows in shared memory with coalesced loads, gathering rows through the act-order perm
// (equivalent to repacking the row-sorted matrix); phase 2 writes the chunk's Marlin words,
// consecutive threads to consecutive words. The tile kernel's lane_tile / lane_tile_gather below
// read the packed rows directly instead and write 16-byte stores; the staged path serves outputs
// not aligned to 16 bytes.
#pragma once

#include <stdint.h>

#include "layout.cuh"

namespace wna16 {

constexpr int kRepackThreads = 256;
constexpr int kRepackCols = 256;  // 4 n-tiles

struct RepackTask {
  int64_t ex, kt, n0;
  int cols;  // multiple of 64
};

WNA16_HD int64_t repack_tasks(int64_t num_experts, int64_t size_k, int64_t size_n) {
  return num_experts * (size_k / 16) * ((size_n + kRepackCols - 1) / kRepackCols);
}

WNA16_HD RepackTask repack_task(int64_t task, int64_t size_k, int64_t size_n) {
  const int64_t chunks = (size_n + kRepackCols - 1) / kRepackCols, ktiles = size_k / 16;
  RepackTask t;
  t.n0 = (task % chunks) * kRepackCols;
  t.kt = (task / chunks) % ktiles;
  t.ex = task / (chunks * ktiles);
  t.cols = (int)(size_n - t.n0 < kRepackCols ? size_n - t.n0 : kRepackCols);
  return t;
}

template <int NB>
struct RepackTile {
  static constexpr int PF = 32 / NB;
  static constexpr int ROWS = 16 / PF;
  static constexpr int WPT = 1024 / PF;
  struct Shared {
    uint32_t rows[ROWS][kRepackCols];
    int32_t rperm[16];
  };

  // Phase 0 (act-order only): the 16 source rows of the k-tile; invalid entries read as code 0.
  static WNA16_HD void load_perm(const int32_t* perm, const RepackTask& t, int64_t size_k, Shared& sh,
                                 int tid) {
    if (tid < 16) {
      const int32_t p = perm[t.ex * size_k + t.kt * 16 + tid];
      sh.rperm[tid] = (p >= 0 && p < size_k) ? p : -1;
    }
  }

  // Phase 1: packed rows of the k-tile -> shared memory.
  static WNA16_HD void stage(const uint32_t* packed, bool gather, const RepackTask& t, int64_t size_k,
                             int64_t size_n, Shared& sh, int tid, int nthreads) {
    const uint32_t* src = packed + t.ex * (size_k / PF) * size_n;
    if (!gather) {
      for (int idx = tid; idx < ROWS * t.cols; idx += nthreads) {
        const int r = idx / t.cols, n = idx % t.cols;
        sh.rows[r][n] = src[(t.kt * ROWS + r) * size_n + t.n0 + n];
      }
      return;
    }
    for (int n = tid; n < t.cols; n += nthreads)
      for (int r = 0; r < ROWS; ++r) {
        uint32_t word = 0;
        for (int i = 0; i < PF; ++i) {
          const int32_t s = sh.rperm[r * PF + i];
          if (s >= 0) word |= wna16_code(src[(s / PF) * size_n + t.n0 + n], s % PF, NB) << (NB * i);
        }
        sh.rows[r][n] = word;
      }
  }

  // The tile path: eight lanes per 16x64 tile, lane c (0..7) owning the tile's columns
  // c + 8m (m = 0..7). Those columns feed exactly the Marlin words of threads t = 4c + tl (the
  // wna16_marlin_word_base table), which lie contiguously in the output: words
  // [LANE_WORDS * c, LANE_WORDS * (c + 1)) of the tile. So a lane loads its columns once, builds
  // its words with byte permutes and shifts (no per-word index arithmetic) and writes them as
  // 16-byte stores. `src` = the tile's first packed row at the tile's column 0 (row stride ld),
  // `dst` = the lane's first word (16-byte aligned). Same words as wna16_marlin_tile_word.
  static constexpr int LANES = 8;
  static constexpr int LANE_WORDS = WPT / LANES;  // 16 (4-bit) or 32 (8-bit)

  // Column of the lane's m-th load (m = 0..7) inside the tile.
  static WNA16_DEV int lane_col(int c, int m) { return 16 * (m >> 1) + c + 8 * (m & 1); }

  static WNA16_DEV void lane_tile(const uint32_t* __restrict__ src, int64_t ld,
                                  uint32_t* __restrict__ dst, int c) {
    uint32_t v[ROWS][8];
WNA16_UNROLL
    for (int r = 0; r < ROWS; ++r)
WNA16_UNROLL
      for (int m = 0; m < 8; ++m) v[r][m] = src[r * ld + lane_col(c, m)];
    lane_store(v, dst);
  }

  // With act-order: the same words from the row-sorted matrix, whose row i of the tile is source
  // row perm[i] (as the staged path gathers them): packed row r of the sorted tile collects the
  // codes of source rows perm[r * PF + j], j = 0..PF-1. `src` = the expert's first packed row at
  // the tile's column 0 (row stride ld), `perm` = the tile's 16 entries; an entry outside
  // [0, size_k) reads as code 0.
  static WNA16_DEV void lane_tile_gather(const uint32_t* __restrict__ src, int64_t ld,
                                         const int32_t* __restrict__ perm, int64_t size_k,
                                         uint32_t* __restrict__ dst, int c) {
    uint32_t v[ROWS][8];
WNA16_UNROLL
    for (int r = 0; r < ROWS; ++r) {
WNA16_UNROLL
      for (int m = 0; m < 8; ++m) v[r][m] = 0;
WNA16_UNROLL
      for (int j = 0; j < PF; ++j) {
        const int32_t p = perm[r * PF + j];
        if (p < 0 || p >= size_k) continue;
        const uint32_t* row = src + (int64_t)(p / PF) * ld;
        const int from = p % PF;
WNA16_UNROLL
        for (int m = 0; m < 8; ++m)
          v[r][m] |= wna16_code(row[lane_col(c, m)], from, NB) << (NB * j);
      }
    }
    lane_store(v, dst);
  }

  // v[r][m] = packed row r of the (sorted) tile at column lane_col(c, m).
  static WNA16_DEV void lane_store(const uint32_t (&v)[ROWS][8], uint32_t* __restrict__ dst) {
    uint32_t words[LANE_WORDS];
    if (NB == 4) {
      // word 4 * tl + w of the lane = wna16_marlin_word4 of columns n = 16w + c and n + 8, byte tl
WNA16_UNROLL
      for (int w = 0; w < 4; ++w) {
        const uint32_t x = v[0][2 * w], y = v[ROWS - 1][2 * w], xp = v[0][2 * w + 1],
                       yp = v[ROWS - 1][2 * w + 1];
        // per byte: low nibbles of (x, y) and of (xp, yp), high nibbles of the same
        const uint32_t lo = (x & 0x0f0f0f0fu) | ((y << 4) & 0xf0f0f0f0u);
        const uint32_t lop = (xp & 0x0f0f0f0fu) | ((yp << 4) & 0xf0f0f0f0u);
        const uint32_t hi = ((x >> 4) & 0x0f0f0f0fu) | (y & 0xf0f0f0f0u);
        const uint32_t hip = ((xp >> 4) & 0x0f0f0f0fu) | (yp & 0xf0f0f0f0u);
        // word of byte tl = {lo.tl, lop.tl, hi.tl, hip.tl}: a 4x4 byte transpose
        const uint32_t l01 = wna16_prmt(lo, lop, 0x5140), l23 = wna16_prmt(lo, lop, 0x7362);
        const uint32_t h01 = wna16_prmt(hi, hip, 0x5140), h23 = wna16_prmt(hi, hip, 0x7362);
        words[0 + w] = wna16_prmt(l01, h01, 0x5410);
        words[4 + w] = wna16_prmt(l01, h01, 0x7632);
        words[8 + w] = wna16_prmt(l23, h23, 0x5410);
        words[12 + w] = wna16_prmt(l23, h23, 0x7632);
      }
    } else {
      // word 8 * tl + 2w + h = wna16_marlin_word8 of column n = 16w + c + 8h: packed rows
      // tl / 2 and 2 + tl / 2, half tl % 2
WNA16_UNROLL
      for (int m = 0; m < 8; ++m) {  // m = 2w + h
        const uint32_t r0 = v[0][m], r1 = v[1 % ROWS][m], r2 = v[2 % ROWS][m], r3 = v[3 % ROWS][m];
        words[0 + m] = wna16_prmt(r0, r2, 0x5140);
        words[8 + m] = wna16_prmt(r0, r2, 0x7362);
        words[16 + m] = wna16_prmt(r1, r3, 0x5140);
        words[24 + m] = wna16_prmt(r1, r3, 0x7362);
      }
    }
    uint4* out = reinterpret_cast<uint4*>(dst);
WNA16_UNROLL
    for (int q = 0; q < LANE_WORDS / 4; ++q)
      out[q] = uint4{words[4 * q], words[4 * q + 1], words[4 * q + 2], words[4 * q + 3]};
  }

  // Phase 2: Marlin words of the chunk.
  static WNA16_HD void emit(uint32_t* out, const RepackTask& t, int64_t size_k, int64_t size_n,
                            const Shared& sh, int tid, int nthreads) {
    const int64_t out_cols = size_n * 16 / PF;
    uint32_t* dst = out + (t.ex * (size_k / 16) + t.kt) * out_cols + t.n0 * 16 / PF;
    const int words = t.cols * 16 / PF;
    for (int j = tid; j < words; j += nthreads)
      dst[j] = wna16_marlin_tile_word(&sh.rows[0][0], kRepackCols, NB, (j / WPT) * 64, j % WPT);
  }
};

}  // namespace wna16
