// Tile constants and the shared-memory plan of the v2 MoE GEMM (moe_gemm_v2.cu), plain C++ so
// host tools (bench/kernel_static.py) can read the shared-memory sizes without a CUDA build.
#pragma once

namespace wna16v2 {

constexpr int kThreads = 128;    // 4 warps
constexpr int kStages = 4;       // cp.async pipeline depth
constexpr int kStageK = 64;      // K rows per pipeline stage: warp w computes k-tile w
constexpr int kBlocksPerSm = 2;  // grid = SMs * this (the shared memory below allows it)
constexpr int kPrefixThreads = 256;
constexpr int kRedPad = 8;       // fp32 row padding of the reduction buffer (bank spread)

// Shared-memory plan of one kernel instance (PER_ROW: the g_idx instance's per-row pairs).
template <int NB, int MT, int NT, bool PER_ROW = false>
struct Plan {
  static constexpr int PF = 32 / NB;
  static constexpr int WPT = 1024 / PF;              // words per 16 x 64 Marlin tile
  static constexpr int BM = 16 * MT, BN = 64 * NT;
  static constexpr int A_BYTES = BM * kStageK * 2;   // activations [BM][64], swizzled chunks
  static constexpr int B_BYTES = 4 * NT * WPT * 4;   // weights [k-tile][n-tile][WPT]
  static constexpr int S_BYTES = 4 * BN * 2;         // up to 4 scale rows of the stage
  static constexpr int Z_BYTES = 4 * (BN / PF) * 4;  // up to 4 zero-point rows
  static constexpr int G_BYTES = kStageK * 4;        // g_idx of the stage's rows
  static constexpr int A_OFF = 0, B_OFF = A_BYTES, S_OFF = B_OFF + B_BYTES,
                       Z_OFF = S_OFF + S_BYTES, G_OFF = Z_OFF + Z_BYTES;
  static constexpr int STAGE = G_OFF + G_BYTES;
  static constexpr int PIPE = kStages * STAGE;
  static constexpr int RED_LD = BN + kRedPad;
  static constexpr int RED = 4 * BM * RED_LD * 4;    // per-warp fp32 tiles, aliases the pipeline
  static constexpr int MAIN = PIPE > RED ? PIPE : RED;
  // per-lane scale / zero pairs, [warp][n-tile][sub-tile][lane] x 16 bytes: thread-private, so
  // the main loop holds them in shared memory instead of 16 * NT registers
  static constexpr int LANE_OFF = MAIN;
  static constexpr int LANE = (PER_ROW ? 2 : 1) * 4 * NT * 4 * 32 * 16;  // g_idx: two halves
  static constexpr int SLOT_OFF = LANE_OFF + LANE;   // sorted slot of each tile row
  static constexpr int AOFF_OFF = SLOT_OFF + BM * 4; // its activation row offset (elements), -1: none
  static constexpr int FLAG_OFF = AOFF_OFF + BM * 8;
  static constexpr int SMEM = FLAG_OFF + 16;
  static_assert(STAGE % 16 == 0 && MAIN % 16 == 0, "16-byte aligned regions");
};

}  // namespace wna16v2
