// The CUDA repack's per-block work as barrier-separated phases (the kernel is in repack.cu; the
// tests run it on the CPU emulation of intrinsics.cuh), like moe_gemm.cuh for the GEMM.
//
// Task = (expert, k-tile, chunk of kRepackCols columns). Phase 1 stages the k-tile's 16/pf
// packed rows in shared memory with coalesced loads, gathering rows through the act-order perm
// (equivalent to repacking the row-sorted matrix); phase 2 writes the chunk's Marlin words,
// consecutive threads to consecutive words. That path serves act-order, whose row gather needs
// the staged rows; without act-order lane_tile below reads the packed rows directly.
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

  // Without act-order: eight lanes per 16x64 tile, lane c (0..7) owning the tile's columns
  // c + 8m (m = 0..7). Those columns feed exactly the Marlin words of threads t = 4c + tl (the
  // wna16_marlin_word_base table), which lie contiguously in the output: words
  // [LANE_WORDS * c, LANE_WORDS * (c + 1)) of the tile. So a lane loads its columns once, builds
  // its words with byte permutes and shifts (no per-word index arithmetic) and writes them as
  // 16-byte stores. `src` = the tile's first packed row at the tile's column 0 (row stride ld),
  // `dst` = the lane's first word (16-byte aligned). Same words as wna16_marlin_tile_word.
  static constexpr int LANES = 8;
  static constexpr int LANE_WORDS = WPT / LANES;  // 16 (4-bit) or 32 (8-bit)

  static WNA16_DEV void lane_tile(const uint32_t* __restrict__ src, int64_t ld,
                                  uint32_t* __restrict__ dst, int c) {
    uint32_t words[LANE_WORDS];
    if (NB == 4) {
      // word 4 * tl + w of the lane = wna16_marlin_word4 of columns n = 16w + c and n + 8, byte tl
WNA16_UNROLL
      for (int w = 0; w < 4; ++w) {
        const int n = 16 * w + c;
        const uint32_t x = src[n], y = src[ld + n], xp = src[n + 8], yp = src[ld + n + 8];
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
      for (int w = 0; w < 4; ++w)
WNA16_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int n = 16 * w + c + 8 * h;
          const uint32_t r0 = src[n], r1 = src[ld + n], r2 = src[2 * ld + n], r3 = src[3 * ld + n];
          words[0 + 2 * w + h] = wna16_prmt(r0, r2, 0x5140);
          words[8 + 2 * w + h] = wna16_prmt(r0, r2, 0x7362);
          words[16 + 2 * w + h] = wna16_prmt(r1, r3, 0x5140);
          words[24 + 2 * w + h] = wna16_prmt(r1, r3, 0x7362);
        }
    }
    uint4* out = reinterpret_cast<uint4*>(dst);
WNA16_UNROLL
    for (int v = 0; v < LANE_WORDS / 4; ++v)
      out[v] = uint4{words[4 * v], words[4 * v + 1], words[4 * v + 2], words[4 * v + 3]};
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
