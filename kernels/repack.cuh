// The CUDA repack's per-block work as barrier-separated phases (the kernel is in repack.cu; the
// tests run it on the CPU emulation of intrinsics.cuh), like moe_gemm.cuh for the GEMM.
//
// Task = (expert, k-tile, chunk of kRepackCols columns). Phase 1 stages the k-tile's 16/pf
// packed rows in shared memory with coalesced loads, gathering rows through the act-order perm
// (equivalent to repacking the row-sorted matrix); phase 2 writes the chunk's Marlin words,
// consecutive threads to consecutive words.
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
