// Tile constants and the shared-memory plan of the v3 MoE GEMM (moe_gemm_v3.cu), plain C++ so
// host tools (bench/kernel_static.py, bench/roofline.py) can read the sizes without a CUDA build.
#pragma once

namespace wna16v3 {

constexpr int kWarpsK = 4;       // warps over K: warp (kw, nw) computes k-tile kw of a stage
constexpr int kWarpsN = 2;       // warps over N: ... for the n-half nw of the block's columns
constexpr int kThreads = 32 * kWarpsK * kWarpsN;  // 8 warps
constexpr int kStages = 4;       // cp.async pipeline depth
static_assert((kStages & (kStages - 1)) == 0, "a power of two: the ring slot is ks & (kStages - 1)");
constexpr int kStageK = 64;      // K rows per pipeline stage (kWarpsK k-tiles of 16)
constexpr int kBlocksPerSm = 2;  // grid = SMs * this (registers and shared memory allow it)
constexpr int kRedPad = 8;       // fp32 row padding of the reduction buffer (bank spread)
constexpr int kScaleThreads = 64;  // threads that copy a scale or zero-point chunk (at most)

// Shared-memory plan of one kernel instance (fast mode: one scale group per stage at most, so a
// stage carries at most one scale / zero-point row). The tile prefix over the experts follows
// the fixed part, (E + 1) words (smem_bytes()).
template <int NB, int MT, int NT>
struct Plan {
  static constexpr int PF = 32 / NB;
  static constexpr int WPT = 1024 / PF;              // words per 16 x 64 Marlin tile
  static constexpr int BM = 16 * MT, BN = 64 * NT;
  static constexpr int A_BYTES = BM * kStageK * 2;   // activations [BM][64], swizzled chunks
  static constexpr int B_BYTES = kWarpsK * NT * WPT * 4;  // weights [k-tile][n-tile][WPT]
  static constexpr int S_BYTES = BN * 2;             // the scale row of the stage's group
  static constexpr int Z_BYTES = (BN / PF) * 4;      // its zero-point row
  static constexpr int A_OFF = 0, B_OFF = A_BYTES, S_OFF = B_OFF + B_BYTES,
                       Z_OFF = S_OFF + S_BYTES;
  static constexpr int STAGE = ((Z_OFF + Z_BYTES) + 15) / 16 * 16;
  static constexpr int PIPE = kStages * STAGE;
  static constexpr int RED_LD = BN + kRedPad;
  static constexpr int RED = kWarpsK * BM * RED_LD * 4;  // per k-warp fp32 tiles, alias the pipeline
  static constexpr int MAIN = PIPE > RED ? PIPE : RED;
  static constexpr int SLOT_OFF = MAIN;              // sorted slot of each tile row
  static constexpr int AOFF_OFF = SLOT_OFF + BM * 4; // its activation row offset (elements), -1: none
  static constexpr int FLAG_OFF = AOFF_OFF + BM * 8; // election flag, then the warp totals of the prefix
  static constexpr int U_OFF = FLAG_OFF + 16 + 4 * kWarpsK * kWarpsN;  // the block's two unit positions
  static constexpr int SPTR_OFF = U_OFF + 16;       // the scale-copying threads' source pointers
  static constexpr int PREFIX_OFF = SPTR_OFF + 8 * kScaleThreads;
  static constexpr int FIXED = PREFIX_OFF;
  static_assert(STAGE % 16 == 0 && MAIN % 16 == 0 && PREFIX_OFF % 16 == 0, "16-byte aligned regions");
};

// Dynamic shared memory of an instance for E experts (the plan and the tile prefix).
template <int NB, int MT, int NT>
constexpr long long smem_bytes(long long experts) {
  return Plan<NB, MT, NT>::FIXED + (4 * (experts + 1) + 15) / 16 * 16;
}

}  // namespace wna16v3
