// The v3 MoE GEMM over Marlin-layout WNA16 weights (W4A16 / W8A16, fp16 or bf16 activations,
// zero points), the kernel behind wna16_cuda_moe_gemm_v3. Same contract as wna16_cuda_moe_gemm
// (capi.h) except the workspace: its counter words must be zero before the first call, and every
// call leaves them zero again.
//
// It runs the fast mode of v2 (moe_gemm_v2.cu: no act-order, scale groups of whole 64-row
// stages) and declines the rest (WNA16_ENOTSUP; the caller falls back to v2 or v1). What changes
// against v2, each for a cost that v2's roofline names (bench/roofline.py):
//   * eight warps, four over K (warp kw computes k-tile kw of every stage, as v2's four warps do)
//     times two over N (warp nw the n-half nw of the block's columns): 64 fp32 accumulators per
//     thread instead of 128, so two blocks of 256 threads fit an SM's registers -- four warps per
//     scheduler where v2 has two;
//   * the scale / zero-point pairs of a lane's columns live in registers, refilled from the
//     stage's scale row once per group, instead of a per-lane table in shared memory re-read
//     every stage;
//   * a lane's weight words of the next n-tile are loaded from shared memory while the current
//     one is dequantised and multiplied (two register buffers);
//   * the weight stream is copied with an L2 evict-first policy: each weight is read once per
//     call, the activations and the stream-K partials stay in the L2 instead;
//   * one launch: every block builds the expert tile prefix in its own shared memory (no prefix
//     kernel), and the stream-K counters and ready flags are returned to zero by the block that
//     consumes them (no workspace reset);
//   * no lane table and one scale row per stage: the 8-bit 16 x 256 tile needs ~77 KB of shared
//     memory, so two blocks fit an SM (v2: 120 KB, one).
// The arithmetic is v2's: the same k-tiles meet the same fragments in the same order per
// accumulator, and the four k-warps' partial sums and the stream-K parts are added in v2's order,
// so the output equals v2's bit for bit (the emulated tests compare them).
// Only the wna16_* intrinsics (intrinsics.cuh), so the host build executes this source as is.
#include "capi.h"
#include "checks.h"
#include "dequant.cuh"
#include "intrinsics.cuh"
#include "layout.cuh"
#include "moe_gemm_v3.cuh"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace wna16v3 {

using wna16v2::kBF16;
using wna16v2::kF16;
using wna16v2::Ops;
using wna16v2::Quant;

struct alignas(16) U4 {
  uint32_t x, y, z, w;
};
struct alignas(8) U2 {
  uint32_t x, y;
};

struct Args {
  const void* a;
  const uint32_t* b;
  const uint16_t* scales;
  const uint32_t* zp;
  const int32_t* sorted_ids;
  const int32_t* offsets;
  const float* topk_weights;
  void* c;
  int32_t* counters;  // per tile: blocks that finished their part (zero between calls)
  int32_t* ready;     // per partial slot: 1 once its partial tile is written (zero between calls)
  float* partials;    // [2 * grid][BM * BN] fp32 partial tiles
  int64_t num_slots, num_sorted, num_experts, size_n, size_k, num_groups;
  int top_k;
  int group_rows;  // rows per scale group, a multiple of kStageK
  int grid;        // blocks launched
};

WNA16_KDEV int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
WNA16_KDEV int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Slice [begin, end) of sorted_ids that expert e owns; offsets clamped so bad input cannot read
// past the array.
WNA16_KDEV void expert_range(const int32_t* offsets, int64_t num_sorted, int64_t e,
                             int64_t* begin, int64_t* end) {
  *begin = clamp64(offsets[e], 0, num_sorted);
  *end = clamp64(offsets[e + 1], *begin, num_sorted);
}

// The block that owns unit x of the stream-K sequence (units [start(b), start(b + 1)) with
// start(b) = floor(b * U / G)); v2's partition, so the two kernels cut the same tiles.
WNA16_KDEV int64_t unit_owner(int64_t x, int64_t units, int64_t blocks) {
  return ((x + 1) * blocks - 1) / units;
}
WNA16_KDEV int64_t unit_start(int64_t b, int64_t units, int64_t blocks) {
  return b * units / blocks;
}

// prefix[e] = m-tiles of the experts before e, prefix[E] = all of them, in the block's shared
// memory. Each thread sums a contiguous run of experts; a warp scan and a scan of the warp totals
// combine them. E words of offsets per block: far less than one stage of weights.
WNA16_KDEV void block_tile_prefix(const Args& p, int tile_rows, int32_t* prefix,
                                  int32_t* warp_total, int tid) {
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t E = p.num_experts;
  const int64_t per = (E + kThreads - 1) / kThreads;
  const int64_t e0 = min64(E, (int64_t)tid * per), e1 = min64(E, e0 + per);
  int32_t local = 0;
  for (int64_t e = e0; e < e1; ++e) {
    int64_t lo, hi;
    expert_range(p.offsets, p.num_sorted, e, &lo, &hi);
    local += (int32_t)((hi - lo + tile_rows - 1) / tile_rows);
  }
  int32_t incl = local;
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t up = (int32_t)wna16_shfl((uint32_t)incl, lane >= d ? lane - d : lane);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_total[warp] = incl;
  wna16_syncthreads();
  int32_t run = incl - local;
  for (int w = 0; w < warp; ++w) run += warp_total[w];
  for (int64_t e = e0; e < e1; ++e) {
    prefix[e] = run;
    int64_t lo, hi;
    expert_range(p.offsets, p.num_sorted, e, &lo, &hi);
    run += (int32_t)((hi - lo + tile_rows - 1) / tile_rows);
  }
  if (tid == kThreads - 1) prefix[E] = run;
  wna16_syncthreads();
}

// ZP: the instance for zero points (without them the zero is the constant midpoint code, and the
// scale pairs are held ready for the dequantisation: no byte permutes in the loop).
template <int DT, int NB, int MT, int NT, bool ZP>
struct Gemm {
  using P = Plan<NB, MT, NT>;
  using Q = Quant<DT, NB>;
  static constexpr int PF = P::PF, WPT = P::WPT, BM = P::BM, BN = P::BN;
  // a warp's columns: NSUB 16-column sub-tiles, in PIECES runs of SUBS sub-tiles that lie side
  // by side in a lane's words (one n-tile holds four)
  static constexpr int NSUB = 4 * NT / kWarpsN;
  static constexpr int SUBS = NSUB < 4 ? NSUB : 4;
  static constexpr int PIECES = NSUB / SUBS;
  static constexpr int PIECE_WORDS = SUBS * Q::WORDS;
  static_assert(NSUB * kWarpsN == 4 * NT && NSUB % SUBS == 0, "n split");
  static_assert(PIECE_WORDS % 2 == 0, "8-byte or 16-byte weight loads");

  struct Tile {
    int64_t e, m0, n0;
    int rows;    // sorted rows of this tile (1 .. BM)
    int mcount;  // 16-row slices with rows
    int nvalid;  // 64-column n-tiles inside N
  };

  // The tile's expert and columns, from the block's tile prefix alone (shared memory): what its
  // weight copies need, known before any global read.
  static WNA16_KDEV Tile locate_weights(const Args& p, const int32_t* prefix, int64_t tile) {
    const int64_t nblk = (p.size_n + BN - 1) / BN;
    const int64_t mt = tile / nblk;
    int64_t lo = 0, hi = p.num_experts - 1;  // owner: the last e with prefix[e] <= mt
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= mt) lo = mid;
      else hi = mid - 1;
    }
    Tile t;
    t.e = lo;
    t.m0 = mt - prefix[lo];  // the expert's m-tile, until locate_rows
    t.rows = t.mcount = 0;
    t.n0 = (tile % nblk) * BN;
    t.nvalid = (int)min64(NT, (p.size_n - t.n0) / 64);
    return t;
  }

  // ... and its rows, from the expert's slice of sorted_ids (a global read of the offsets).
  static WNA16_KDEV void locate_rows(const Args& p, Tile* t) {
    int64_t begin, end;
    expert_range(p.offsets, p.num_sorted, t->e, &begin, &end);
    t->m0 = begin + t->m0 * BM;
    t->rows = (int)min64(BM, end - t->m0);
    t->mcount = (t->rows + 15) / 16;
  }

  static WNA16_KDEV Tile locate(const Args& p, const int32_t* prefix, int64_t tile) {
    Tile t = locate_weights(p, prefix, tile);
    locate_rows(p, &t);
    return t;
  }

  // The copies of one stage. Few registers live across the main loop (the accumulators and scale
  // pairs take most of the 128 a thread has): the weight and scale pointers and a stage count;
  // the rest is recomputed per stage from the kernel parameters (constant bank) and threadIdx.
  // Thread tid copies activation chunk tid % 8 of rows tid / 8 + 32 i, weight chunks tid + 256 i
  // (evict-first: read once per call), and at the range's first stage and each group's first
  // stage scale / zero-point chunk tid.
  struct Loader {
    static constexpr int CPT = WPT / 4;            // 16-byte chunks per 16 x 64 tile
    static constexpr int ROW_CHUNKS = NT * CPT;    // chunks of one k-tile row of the block
    static constexpr int B_CHUNKS = kWarpsK * ROW_CHUNKS;
    static constexpr int B_PER_THREAD = (B_CHUNKS + kThreads - 1) / kThreads;
    static constexpr int KT_STEP = kThreads / ROW_CHUNKS;  // k-tile rows between a thread's chunks
    static_assert(kThreads % ROW_CHUNKS == 0, "a k-tile row's chunks divide the block's threads");
    static constexpr int A_ROWS_PER_PASS = kThreads / 8;
    static constexpr int A_PASSES = (BM + A_ROWS_PER_PASS - 1) / A_ROWS_PER_PASS;
    static constexpr int S_CHUNKS = BN / 8, Z_CHUNKS = BN / PF / 4;
    static_assert(S_CHUNKS + Z_CHUNKS <= kScaleThreads, "one scale chunk per thread");
    const uint32_t* b;       // the block's weights at k-tile 0 of the next stage
    // (this thread's scale or zero-point chunk of the next group, or null, waits in its own
    // shared-memory slot: used once per group, it need not hold two registers through the loop)
    int left;                // stages before the next group's first
    int first_run;           // stages of the range's first group run (no division in the loop)

    static WNA16_KDEV int bcols(const Args& p) { return (int)(p.size_n * 16 / PF); }

    static WNA16_KDEV const unsigned char** scale_slot(unsigned char* smem, int tid) {
      return reinterpret_cast<const unsigned char**>(smem + P::SPTR_OFF) + tid;
    }

    WNA16_KDEV Loader(const Args& p, unsigned char* smem, int64_t e, int64_t n0, int nvalid,
                      int ks_first) {
      const int tid = (int)threadIdx.x;
      b = p.b + e * (p.size_k / 16) * bcols(p) + (n0 / 64) * WPT +
          (int64_t)ks_first * kWarpsK * bcols(p);
      const int64_t g = (int64_t)ks_first / (p.group_rows / kStageK);
      const unsigned char* s = nullptr;
      if (tid < S_CHUNKS) {
        if (8 * tid < nvalid * 64)
          s = reinterpret_cast<const unsigned char*>(
              p.scales + ((e * p.num_groups + g) * p.size_n + n0 + 8 * tid));
      } else if (ZP && tid < S_CHUNKS + Z_CHUNKS) {
        const int ch = tid - S_CHUNKS;
        if (ch * 4 * PF < nvalid * 64)
          s = reinterpret_cast<const unsigned char*>(
              p.zp + ((e * p.num_groups + g) * (p.size_n / PF) + n0 / PF + 4 * ch));
      }
      if (tid < kScaleThreads) *scale_slot(smem, tid) = s;
      left = 0;  // the range's first stage brings its group's row, wherever the group starts
      first_run = p.group_rows / kStageK - ks_first % (p.group_rows / kStageK);
    }

    // Copies of stage ks (the stage after the previous call's): activations, then weights and
    // (at a group's first stage) its scale row.
    WNA16_KDEV void load(const Args& p, int mcount, int nvalid, unsigned char* smem,
                         const int64_t* sh_aoff, int ks) {
      load_a(p, mcount, smem, sh_aoff, ks);
      load_b(p, nvalid, smem, ks);
    }

    // The activation rows of stage ks (the tile's row offsets in sh_aoff).
    static WNA16_KDEV void load_a(const Args& p, int mcount, unsigned char* smem, const int64_t* sh_aoff,
                                  int ks) {
      // opaque: the thread's chunk offsets are recomputed per stage (a few integer ops) instead
      // of hoisted out of the main loop, where their B_PER_THREAD 64-bit source offsets,
      // destinations and predicates would take registers the accumulators need (or spill)
      // (unsigned: the chunk and row divisions are shifts and masks)
      const uint32_t tid = wna16_opaque(threadIdx.x);
      unsigned char* st = smem + (ks & (kStages - 1)) * P::STAGE;
      const int a_ch = (int)(tid & 7), a_row0 = (int)(tid >> 3);
      const int64_t kk = (int64_t)ks * kStageK + 8 * a_ch;
      const uint16_t* a = static_cast<const uint16_t*>(p.a) + kk;
      WNA16_UNROLL
      for (int i = 0; i < A_PASSES; ++i) {
        const int row = a_row0 + A_ROWS_PER_PASS * i;
        if (row < mcount * 16) {
          const int64_t off = sh_aoff[row];
          const bool ok = off >= 0;  // every stage lies inside K (K % kStageK == 0)
          wna16_cp_async16(st + P::A_OFF + row * 128 + ((a_ch ^ (row & 7)) << 4),
                           ok ? (const void*)(a + off) : p.a, ok);
        }
      }
    }

    // The weights of stage ks, and its group's scale / zero-point row at a group's first stage
    // (the range's first stage included). Stages in order: each call advances to the next.
    WNA16_KDEV void load_b(const Args& p, int nvalid, unsigned char* smem, int ks) {
      const uint32_t tid = wna16_opaque(threadIdx.x);  // as in load_a
      unsigned char* st = smem + (ks & (kStages - 1)) * P::STAGE;
      const uint64_t policy = wna16_l2_evict_first_policy();  // made once, in a uniform register pair
      // chunk tid + 256 i: k-tile row ktl0 + KT_STEP i, the same chunk `rest` of every row it
      // copies (a row's chunks divide the block's threads), so one predicate, one source and one
      // destination address, stepped by constant strides
      const int ktl0 = (int)(tid / ROW_CHUNKS), rest = (int)(tid % ROW_CHUNKS);
      const bool ok = rest / CPT < nvalid;  // n-tile inside N (every k-tile is inside K)
      const uint32_t* src = b + ktl0 * bcols(p) + rest * 4;
      unsigned char* dst = st + P::B_OFF + (ktl0 * NT * WPT + rest * 4) * 4;
      WNA16_UNROLL
      for (int i = 0; i < B_PER_THREAD; ++i) {
        if (B_CHUNKS % kThreads == 0 || ktl0 + KT_STEP * i < kWarpsK)
          wna16_cp_async16_hint(dst + KT_STEP * i * NT * WPT * 4,
                                ok ? (const void*)(src + KT_STEP * i * bcols(p)) : p.b, ok, policy);
      }
      b += kWarpsK * bcols(p);
      if (left == 0) {  // the group's row: at the range's first stage and each group's first
        const int spg = p.group_rows / kStageK;
        const int t = (int)tid;
        const bool scale = t < S_CHUNKS, zero = !scale && ZP && t < S_CHUNKS + Z_CHUNKS;
        if (scale || zero) {
          const int dst = scale ? P::S_OFF + 16 * t : P::Z_OFF + 16 * (t - S_CHUNKS);
          const unsigned char* s = *scale_slot(smem, t);
          wna16_cp_async16(st + dst, s ? (const void*)s : p.scales, s != nullptr);
          if (s) *scale_slot(smem, t) = s + (scale ? p.size_n * 2 : p.size_n / PF * 4);
        }
        left = first_run ? first_run : spg;
        first_run = 0;
      }
      --left;
    }
  };

  // wna16_scale_pos (layout.cuh) for a column of the block, 0 <= col < 2^31: its chunk split
  // with a mask instead of an int64 division by a run-time chunk width (a call to the division
  // routine per column).
  static WNA16_KDEV int scale_pos(int grouped, int col) {
    const int ch = wna16_scale_chunk(grouped);  // 32 or 64
    return (col & ~(ch - 1)) + wna16_scale_dst(grouped, col & (ch - 1));
  }

  // The stored positions of a lane's columns col0 + 8 j (j = 2 s + h, the warp's 2 * NSUB column
  // groups) lie at constant offsets from col0's: wna16_scale_dst keeps a column's group index in
  // its low bits (grouped: (J & 7) + 8 (J & ~7) for column group J, ungrouped: 2 (J & 3) +
  // 8 (J & ~3)), and a warp's first group J0 = col0 / 8 is a multiple of 8 -- of 4 where a warp
  // has only 4 groups -- so adding j carries nothing. One position per refill, then loads at
  // immediate offsets.
  static_assert(NSUB % 4 == 0 || NSUB == 2, "the warp's column groups start at a multiple of 8 (or 4 for 4 groups)");
  template <bool GROUPED>
  static WNA16_KDEV void load_scales(const uint16_t* s0, uint32_t sv[NSUB][2]) {
    WNA16_UNROLL
    for (int s = 0; s < NSUB; ++s)
      WNA16_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * s + h;
        sv[s][h] = s0[GROUPED ? (j & 7) + 8 * (j & ~7) : 2 * (j & 3) + 8 * (j & ~3)];
      }
  }

  // The warp's scales and zero points, from the stage's scale row, two registers per sub-tile (16
  // for the 16 x 256 tile), c = this lane's column. Without zero points: the scale pairs of c and
  // of c + 8 (one value in both halves, as the dequantisation takes them). With zero points: the
  // scales of c (low half) and c + 8 (high half), then the zero pair of c and c + 8 in the same
  // order; the pairs are one byte permute each at use.
  static WNA16_KDEV void refill(const Args& p, const unsigned char* st, int nw, int lane,
                                uint32_t sz[NSUB][2]) {
    const int grouped = p.num_groups > 1;
    const uint16_t* srow = reinterpret_cast<const uint16_t*>(st + P::S_OFF);
    const uint32_t* zrow = reinterpret_cast<const uint32_t*>(st + P::Z_OFF);
    // the lane's columns, recomputed per refill: hoisted, their 2 * NSUB positions would be held
    // in registers (or spilled) through the whole loop
    const int col0 = (int)wna16_opaque((uint32_t)(16 * nw * NSUB + (lane >> 2)));
    uint32_t sv[NSUB][2];
    if (grouped) load_scales<true>(srow + scale_pos(1, col0), sv);
    else load_scales<false>(srow + scale_pos(0, col0), sv);
    // zero points likewise (wna16_zp_code): the packed position of column col0 + 8 j is col0's
    // plus that of column 8 j -- word and code index add without carry for the same reason --,
    // so one run-time position and the rest constants
    const int zq0 = (col0 >> 6) * 64 + wna16_zp_dst(NB, col0 & 63);
    const uint32_t* zw = zrow + zq0 / PF;
    const int zi0 = zq0 % PF;
    WNA16_UNROLL
    for (int s = 0; s < NSUB; ++s) {
      if (ZP) {
        int z[2];
        WNA16_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int c = 16 * s + 8 * h, q = (c >> 6) * 64 + wna16_zp_dst(NB, c & 63);
          z[h] = (int)wna16_code(zw[q / PF], zi0 + q % PF, NB);
        }
        sz[s][0] = sv[s][0] | (sv[s][1] << 16);
        sz[s][1] = Q::zero_pair(z[0], z[1]);
      } else {
        sz[s][0] = sv[s][0] | (sv[s][0] << 16);
        sz[s][1] = sv[s][1] | (sv[s][1] << 16);
      }
    }
  }

  // This lane's words of piece `pc` of the warp's columns in the stage.
  static WNA16_KDEV void load_piece(const unsigned char* st, int kw, int nw, int pc, int lane,
                                    uint32_t w[PIECE_WORDS]) {
    const int sub0 = nw * NSUB + pc * SUBS;  // first sub-tile of the piece in the block
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(st + P::B_OFF) +
                         (kw * NT + sub0 / 4) * WPT + lane * 4 * Q::WORDS + (sub0 % 4) * Q::WORDS;
    if (PIECE_WORDS % 4 == 0) {
      WNA16_UNROLL
      for (int v = 0; v < PIECE_WORDS / 4; ++v) {
        const U4 u = reinterpret_cast<const U4*>(wp)[v];
        w[4 * v] = u.x, w[4 * v + 1] = u.y, w[4 * v + 2] = u.z, w[4 * v + 3] = u.w;
      }
    } else {
      WNA16_UNROLL
      for (int v = 0; v < PIECE_WORDS / 2; ++v) {
        const U2 u = reinterpret_cast<const U2*>(wp)[v];
        w[2 * v] = u.x, w[2 * v + 1] = u.y;
      }
    }
  }

  // One stage of one warp: its k-tile against its columns and the tile's 16-row slices.
  static WNA16_KDEV void compute_stage(int mcount, int nvalid, const unsigned char* st, int kw, int nw,
                                       int lane,
                                       const uint32_t sz[NSUB][2], float acc[MT][NSUB][2][4]) {
    uint32_t af[MT][4];
    WNA16_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
      if (mi == 0 || mi < mcount) {  // slice 0 always has rows
        const int row = 16 * mi + (lane & 15), ch = 2 * kw + (lane >> 4);
        wna16_ldmatrix_x4(af[mi], st + P::A_OFF + row * 128 + ((ch ^ (row & 7)) << 4));
      }
    }
    uint32_t words[2][PIECE_WORDS];  // the piece being dequantised and the next one
    load_piece(st, kw, nw, 0, lane, words[0]);
    WNA16_UNROLL
    for (int pc = 0; pc < PIECES; ++pc) {
      if (pc + 1 < PIECES) load_piece(st, kw, nw, pc + 1, lane, words[(pc + 1) & 1]);
      // warp-uniform, once per piece (a piece lies in one n-tile): an n-tile past N
      if (NT > 1 && (nw * NSUB + pc * SUBS) / 4 >= nvalid) continue;
      WNA16_UNROLL
      for (int i = 0; i < SUBS; ++i) {
        const int s = pc * SUBS + i;
        uint32_t z[4], sc[4], bf[4];
        if (ZP) {
          sc[0] = sc[1] = wna16_prmt(sz[s][0], 0u, 0x1010u);  // column c in both halves
          sc[2] = sc[3] = wna16_prmt(sz[s][0], 0u, 0x3232u);  // column c + 8
          z[0] = z[1] = wna16_prmt(sz[s][1], 0u, 0x1010u);
          z[2] = z[3] = wna16_prmt(sz[s][1], 0u, 0x3232u);
        } else {
          sc[0] = sc[1] = sz[s][0], sc[2] = sc[3] = sz[s][1];
          z[0] = z[1] = z[2] = z[3] = Q::zero_pair(1 << (NB - 1), 1 << (NB - 1));
        }
        Q::dequant(words[pc & 1] + i * Q::WORDS, z, sc, bf);
        WNA16_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
          if (mi == 0 || mi < mcount) {
            Ops<DT>::mma(acc[mi][s][0], af[mi], bf);
            Ops<DT>::mma(acc[mi][s][1], af[mi], bf + 2);
          }
        }
      }
    }
  }

  // Eight output columns of one row to c (router weight in fp32, one rounding, 16-byte store).
  static WNA16_KDEV void store8(const Args& p, int32_t slot, int64_t n, float v[8]) {
    if (p.topk_weights) {
      const float w = p.topk_weights[slot];
      WNA16_UNROLL
      for (int i = 0; i < 8; ++i) v[i] *= w;
    }
    U4 u;
    u.x = Ops<DT>::pack(v[0], v[1]), u.y = Ops<DT>::pack(v[2], v[3]);
    u.z = Ops<DT>::pack(v[4], v[5]), u.w = Ops<DT>::pack(v[6], v[7]);
    uint16_t* c = static_cast<uint16_t*>(p.c);
    *reinterpret_cast<U4*>(c + (int64_t)slot * p.size_n + n) = u;
  }

  // Stages [ks0, ks1) of tile `tile` into the reduction buffer (the k-warps' partial sums); the
  // epilogue then writes the output (whole tile) or the block's partial (cut tile). Only the
  // accumulators, the scale pairs and the loader's pointers live across the loop: the tile's
  // place is looked up again after it.
  static WNA16_KDEV void run_tile(const Args& p, unsigned char* smem, const int32_t* prefix,
                                  int64_t tile, int ks0, int ks1, int64_t u, int64_t u_next,
                                  int64_t* sh_u) {
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kw = warp % kWarpsK, nw = warp / kWarpsK;
    int32_t* sh_slot = reinterpret_cast<int32_t*>(smem + P::SLOT_OFF);
    int64_t* sh_aoff = reinterpret_cast<int64_t*>(smem + P::AOFF_OFF);
    Tile t = locate_weights(p, prefix, tile);

    wna16_syncthreads();  // the previous tile is done with shared memory (and with sh_u)
    // prologue, weights first: kStages - 1 stages of weights (and the first group's scale row)
    // are requested before the tile's rows are looked up, so the two dependent global reads that
    // find them (the expert's offsets, its sorted ids) wait behind the weights' memory latency
    // instead of ahead of it; the activation copies follow, each stage's in its own group (the
    // first group then holds every prologue weight copy: the first wait is for all of them)
    Loader ld(p, smem, t.e, t.n0, t.nvalid, ks0);
    WNA16_UNROLL
    for (int i = 0; i < kStages - 1; ++i)
      if (ks0 + i < ks1) ld.load_b(p, t.nvalid, smem, ks0 + i);
    locate_rows(p, &t);
    if (tid == 0) sh_u[0] = u, sh_u[1] = u_next;
    for (int i = tid; i < BM; i += kThreads) {
      int32_t s = -1;
      if (i < t.rows) {
        s = p.sorted_ids[t.m0 + i];
        if (s < 0 || s >= p.num_slots) s = -1;  // sentinel padding
      }
      sh_slot[i] = s;
      sh_aoff[i] = s < 0 ? -1 : (int64_t)(s / p.top_k) * p.size_k;
    }
    wna16_syncthreads();

    float acc[MT][NSUB][2][4];
    WNA16_UNROLL
    for (int mi = 0; mi < MT; ++mi)
      WNA16_UNROLL
      for (int s = 0; s < NSUB; ++s)
        WNA16_UNROLL
        for (int h = 0; h < 2; ++h)
          WNA16_UNROLL
          for (int r = 0; r < 4; ++r) acc[mi][s][h][r] = 0.f;
    uint32_t sz[NSUB][2];
    const int mcount = t.mcount, nvalid = t.nvalid;

    // the prologue's activations: kStages - 1 groups in flight (empty groups keep the wait
    // arithmetic uniform)
    WNA16_UNROLL
    for (int i = 0; i < kStages - 1; ++i) {
      if (ks0 + i < ks1) Loader::load_a(p, mcount, smem, sh_aoff, ks0 + i);
      wna16_cp_async_commit();
    }
    const int spg = p.group_rows / kStageK;  // stages per group
    for (int ks = ks0; ks < ks1;) {
      // a run of stages of one group: the pairs come from its first stage's scale row
      const int run_end = (int)min64(ks1, (int64_t)(ks / spg + 1) * spg);
      wna16_cp_async_wait<kStages - 2>();
      wna16_syncthreads();
      if (ks + kStages - 1 < ks1) ld.load(p, mcount, nvalid, smem, sh_aoff, ks + kStages - 1);
      wna16_cp_async_commit();
      const unsigned char* st = smem + (ks & (kStages - 1)) * P::STAGE;
      refill(p, st, nw, lane, sz);
      compute_stage(mcount, nvalid, st, kw, nw, lane, sz, acc);
      for (++ks; ks < run_end; ++ks) {
        wna16_cp_async_wait<kStages - 2>();  // this thread's copies of stage ks have landed
        wna16_syncthreads();                 // everyone's have; stage ks - 1 is consumed
        if (ks + kStages - 1 < ks1) ld.load(p, mcount, nvalid, smem, sh_aoff, ks + kStages - 1);
        wna16_cp_async_commit();
        compute_stage(mcount, nvalid, smem + (ks & (kStages - 1)) * P::STAGE, kw, nw, lane, sz, acc);
      }
    }
    wna16_cp_async_wait<0>();
    wna16_syncthreads();  // the pipeline buffers become the reduction buffer

    // the four k-warps' partial sums, row-major per k-warp (each n-warp writes its columns), of
    // the rows that have a slot: the epilogue reads no other (a decode tile holds one or a few
    // rows of its 16, and the stores of the empty ones would be most of the epilogue's
    // shared-memory traffic)
    float* red = reinterpret_cast<float*>(smem);
    {
      float* mine = red + kw * BM * P::RED_LD;
      const int g = lane >> 2, tig = lane & 3;
      WNA16_UNROLL
      for (int mi = 0; mi < MT; ++mi) {
        if (mi >= mcount) continue;
        const int row = 16 * mi + g;
        const bool lo = sh_slot[row] >= 0, hi = sh_slot[row + 8] >= 0;
        WNA16_UNROLL
        for (int s = 0; s < NSUB; ++s)
          WNA16_UNROLL
          for (int h = 0; h < 2; ++h) {
            const int col = 16 * (nw * NSUB + s) + 8 * h + 2 * tig;
            if (lo) {
              mine[row * P::RED_LD + col] = acc[mi][s][h][0];
              mine[row * P::RED_LD + col + 1] = acc[mi][s][h][1];
            }
            if (hi) {
              mine[(row + 8) * P::RED_LD + col] = acc[mi][s][h][2];
              mine[(row + 8) * P::RED_LD + col + 1] = acc[mi][s][h][3];
            }
          }
      }
    }
    wna16_syncthreads();
  }

  // The tile's output from the reduction buffer: the whole tile's, or (cut between blocks) this
  // block's partial, and the last block of the tile sums every part in block order.
  static WNA16_KDEV void epilogue(const Args& p, unsigned char* smem, const int32_t* prefix,
                                  int64_t tile, int kstages, int64_t units, int64_t blocks,
                                  int64_t self) {
    const int tid = (int)threadIdx.x;
    const int32_t* sh_slot = reinterpret_cast<const int32_t*>(smem + P::SLOT_OFF);
    int32_t* sh_flag = reinterpret_cast<int32_t*>(smem + P::FLAG_OFF);
    const float* red = reinterpret_cast<const float*>(smem);
    const Tile t = locate(p, prefix, tile);
    const int64_t first = tile * kstages;
    const int64_t b_lo = unit_owner(first, units, blocks);
    const int64_t b_hi = unit_owner(first + kstages - 1, units, blocks);
    const bool whole = b_lo == b_hi;  // this block did every stage of the tile
    constexpr int CH = BN / 8;        // 8-column chunks per row
    const int nchunks = t.mcount * 16 * CH;
    const int64_t tile_floats = (int64_t)BM * BN;
    auto slot_of = [&](int64_t b) {  // partial slot of block b's part of this tile
      return 2 * b + (unit_start(b, units, blocks) < first ? 1 : 0);
    };

    if (!whole) {  // publish this block's part, then see whether it is the last
      float* part = p.partials + slot_of(self) * tile_floats;
      for (int c = tid; c < nchunks; c += kThreads) {
        const int row = c / CH, col = 8 * (c % CH);
        // rows without a slot (past the tile's rows, or sentinel padding): not reduced, not read
        if (col >= t.nvalid * 64 || sh_slot[row] < 0) continue;
        WNA16_UNROLL
        for (int i = 0; i < 8; ++i) {
          const int o = row * P::RED_LD + col + i;
          part[row * BN + col + i] =
              ((red[o] + red[o + BM * P::RED_LD]) + red[o + 2 * BM * P::RED_LD]) +
              red[o + 3 * BM * P::RED_LD];
        }
      }
      // publish: the barrier orders the block's partial stores before thread 0's release of its
      // ready flag (release is cumulative); the relaxed counter only elects the last block
      wna16_syncthreads();
      if (tid == 0) {
        wna16_store_release(p.ready + slot_of(self), 1);
        const int done = wna16_atomic_add(p.counters + tile, 1);
        sh_flag[0] = done == (int)(b_hi - b_lo);
      }
      wna16_syncthreads();
      if (!sh_flag[0]) return;
      if (tid == 0) {  // consume: acquire every other part's flag (all are set or about to be:
                       // each block raises its flag before it counts itself in) ...
        for (int64_t b = b_lo; b <= b_hi; ++b)
          if (b != self)
            while (wna16_load_acquire(p.ready + slot_of(b)) == 0) {
            }
        // ... and return the tile's counter and flags to zero for the next call: every part has
        // counted itself in and raised its flag, nobody else touches them in this launch
        for (int64_t b = b_lo; b <= b_hi; ++b) wna16_store_release(p.ready + slot_of(b), 0);
        wna16_atomic_add(p.counters + tile, -(int)(b_hi - b_lo + 1));
      }
      wna16_syncthreads();  // ... and the barrier passes the acquisition on to the block
    }

    for (int c = tid; c < nchunks; c += kThreads) {
      const int row = c / CH, col = 8 * (c % CH);
      const int32_t slot = sh_slot[row];
      if (col >= t.nvalid * 64 || slot < 0) continue;
      float v[8];
      if (whole) {
        WNA16_UNROLL
        for (int i = 0; i < 8; ++i) {
          const int o = row * P::RED_LD + col + i;
          v[i] = ((red[o] + red[o + BM * P::RED_LD]) + red[o + 2 * BM * P::RED_LD]) +
                 red[o + 3 * BM * P::RED_LD];
        }
      } else {  // every part of the tile, in block (= K) order
        WNA16_UNROLL
        for (int i = 0; i < 8; ++i) v[i] = 0.f;
        for (int64_t b = b_lo; b <= b_hi; ++b) {
          const float* part = p.partials + slot_of(b) * tile_floats + row * BN + col;
          WNA16_UNROLL
          for (int i = 0; i < 8; ++i) v[i] += part[i];
        }
      }
      store8(p, slot, t.n0 + col, v);
    }
  }
};

// The stream-K sequence of a call: kstages per tile, units = tiles * kstages, blocks that take
// part. Read again (prefix[E] from shared memory) wherever it is needed instead of kept in
// registers across the main loop.
struct Schedule {
  int kstages;
  int64_t units, blocks;
};

template <int BN>
WNA16_KDEV Schedule schedule(const Args& p, const int32_t* prefix) {
  Schedule s;
  const int64_t nblk = (p.size_n + BN - 1) / BN;
  s.kstages = (int)((p.size_k + kStageK - 1) / kStageK);
  s.units = (int64_t)prefix[p.num_experts] * nblk * s.kstages;
  s.blocks = min64(p.grid, s.units);
  return s;
}

template <int DT, int NB, int MT, int NT, bool ZP>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) moe_gemm_v3_kernel(const Args p) {
  WNA16_SHARED_MEMORY(U4, smem_raw);
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw);
  using G = Gemm<DT, NB, MT, NT, ZP>;
  using P = typename G::P;
  int32_t* prefix = reinterpret_cast<int32_t*>(smem + P::PREFIX_OFF);
  block_tile_prefix(p, G::BM, prefix, reinterpret_cast<int32_t*>(smem + P::FLAG_OFF + 16),
                    (int)threadIdx.x);
  Schedule s = schedule<G::BN>(p, prefix);
  if ((int64_t)blockIdx.x >= s.blocks) return;  // block-uniform
  // the block's place in its unit range lives in shared memory, not in registers held through
  // the main loop: sh_u[1] where the next tile's units start, sh_u[0] where the current one's
  // did (run_tile writes both after its first barrier; the barriers order them)
  int64_t* sh_u = reinterpret_cast<int64_t*>(smem + P::U_OFF);
  if (threadIdx.x == 0) sh_u[1] = unit_start(blockIdx.x, s.units, s.blocks);
  for (;;) {
    wna16_syncthreads();  // publishes sh_u[1]
    s = schedule<G::BN>(p, prefix);
    const int64_t u = sh_u[1], u_end = unit_start(blockIdx.x + 1, s.units, s.blocks);
    if (u >= u_end) break;  // block-uniform
    const int64_t tile = u / s.kstages;
    const int ks0 = (int)(u % s.kstages);
    const int ks1 = (int)min64(s.kstages, ks0 + (u_end - u));
    G::run_tile(p, smem, prefix, tile, ks0, ks1, u, u + (ks1 - ks0), sh_u);
    s = schedule<G::BN>(p, prefix);
    G::epilogue(p, smem, prefix, sh_u[0] / s.kstages, s.kstages, s.units, s.blocks, blockIdx.x);
  }
}

// ----------------------------------------------------------------------------------------------
// Launch configuration: v2's tile choice (tile rows from the sorted rows per expert; 64 x 16 * MT
// accumulators per thread in every tile: 16 x 256, 32 x 128, 64 x 64).
struct Config {
  int mt, nt, grid;
  long long smem;
  int64_t max_tiles;   // upper bound of tiles (counters)
  int64_t flag_words;  // counters + ready flags: zero between calls
  int64_t ws_words;    // workspace int32 words
};

template <int NB>
long long smem_for(int mt, int64_t experts) {
  if (mt == 1) return smem_bytes<NB, 1, 4>(experts);
  if (mt == 2) return smem_bytes<NB, 2, 2>(experts);
  return smem_bytes<NB, 4, 1>(experts);
}

// variant: WNA16_GEMM_AUTO / WNA16_GEMM_MMA, or 16 / 32 / 64 to force the tile rows.
int make_config(int64_t num_sorted, int64_t num_experts, int64_t size_n, int num_bits, int variant,
                int sms, Config* cfg) {
  int rows;
  if (variant == WNA16_GEMM_AUTO || variant == WNA16_GEMM_MMA) {
    const int64_t per_expert = num_experts ? (num_sorted + num_experts - 1) / num_experts : 0;
    rows = per_expert <= 16 ? 16 : (per_expert <= 32 ? 32 : 64);
  } else if (variant == 16 || variant == 32 || variant == 64) {
    rows = variant;
  } else if (variant == WNA16_GEMM_FMA) {
    return wna16_fail(WNA16_ENOTSUP, "the v3 GEMM has no FMA variant (use the v1 kernel)");
  } else {
    return wna16_fail(WNA16_EINVAL, "unknown GEMM variant %d", variant);
  }
  cfg->mt = rows / 16;
  cfg->nt = cfg->mt == 1 ? 4 : (cfg->mt == 2 ? 2 : 1);
  cfg->smem = num_bits == 4 ? smem_for<4>(cfg->mt, num_experts) : smem_for<8>(cfg->mt, num_experts);
  const int64_t bn = 64 * cfg->nt, bm = rows;
  cfg->max_tiles = ((num_sorted + bm - 1) / bm + num_experts) * ((size_n + bn - 1) / bn);
  cfg->grid = sms * kBlocksPerSm;
  cfg->flag_words = (cfg->max_tiles + 2 * (int64_t)cfg->grid + 3) / 4 * 4;
  cfg->ws_words = cfg->flag_words + 2 * (int64_t)cfg->grid * bm * bn;
  return WNA16_OK;
}

// Whether v3 runs this problem: the fast mode only (no act-order, groups of whole stages).
int check_mode(int64_t size_k, int64_t num_groups, int has_perm) {
  const int64_t group_rows = num_groups > 1 ? size_k / num_groups : size_k;
  if (has_perm)
    return wna16_fail(WNA16_ENOTSUP, "the v3 GEMM has no act-order mode (use the v2 kernel)");
  if (size_k % kStageK || group_rows % kStageK)
    return wna16_fail(WNA16_ENOTSUP, "the v3 GEMM needs scale groups of a multiple of %d rows "
                      "(size_k %lld / %lld groups); use the v2 kernel", kStageK,
                      (long long)size_k, (long long)num_groups);
  return WNA16_OK;
}

template <int DT, int NB, int MT, int NT, bool ZP>
int launch_typed(const Args& p, long long smem, int smem_optin, void* stream) {
  auto* kernel = moe_gemm_v3_kernel<DT, NB, MT, NT, ZP>;
  if (smem > smem_optin)
    return wna16_fail(WNA16_ENOTSUP, "the v3 GEMM tile needs %lld bytes of shared memory for %lld "
                      "experts, the device allows %d (use the v2 kernel)", smem,
                      (long long)p.num_experts, smem_optin);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "moe_gemm_v3 shared memory: %s", cudaGetErrorString(err));
  WNA16_LAUNCH(p.grid, kThreads, (int)smem, (cudaStream_t)stream, (moe_gemm_v3_kernel<DT, NB, MT, NT, ZP>), p);
  return WNA16_OK;
}

template <int DT, int NB, bool ZP>
int launch_zp(const Args& p, const Config& cfg, int smem_optin, void* stream) {
  if (cfg.mt == 1) return launch_typed<DT, NB, 1, 4, ZP>(p, cfg.smem, smem_optin, stream);
  if (cfg.mt == 2) return launch_typed<DT, NB, 2, 2, ZP>(p, cfg.smem, smem_optin, stream);
  return launch_typed<DT, NB, 4, 1, ZP>(p, cfg.smem, smem_optin, stream);
}

template <int DT, int NB>
int launch_bits(const Args& p, const Config& cfg, int smem_optin, void* stream) {
  return p.zp ? launch_zp<DT, NB, true>(p, cfg, smem_optin, stream)
              : launch_zp<DT, NB, false>(p, cfg, smem_optin, stream);
}

int device_sms(int* sms, int* major, int* smem_optin) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "device query: %s", cudaGetErrorString(err));
  return WNA16_OK;
}

bool aligned16(const void* ptr) { return ((uintptr_t)ptr & 15u) == 0; }

}  // namespace wna16v3

extern "C" WNA16_API int wna16_cuda_moe_gemm_v3_workspace(int64_t num_sorted, int64_t num_experts,
                                                         int64_t size_n, int64_t size_k,
                                                         int64_t num_groups, int num_bits,
                                                         int has_perm, int variant,
                                                         int64_t* words) {
  using namespace wna16v3;
  int sms = 0, major = 0, optin = 0;
  int rc = wna16_check_bits(num_bits);
  if (rc) return rc;
  if (num_groups < 1) return wna16_fail(WNA16_EINVAL, "num_groups must be >= 1");
  if ((rc = check_mode(size_k, num_groups, has_perm))) return rc;
  if ((rc = device_sms(&sms, &major, &optin))) return rc;
  Config cfg;
  if ((rc = make_config(num_sorted, num_experts, size_n, num_bits, variant, sms, &cfg))) return rc;
  *words = cfg.ws_words;
  return WNA16_OK;
}

extern "C" WNA16_API int wna16_cuda_moe_gemm_v3(
    const void* a, const int32_t* b, const void* scales, const int32_t* zp, const int32_t* g_idx,
    const int32_t* perm, const int32_t* sorted_ids, const int32_t* offsets,
    const float* topk_weights, void* c, int32_t* workspace, int64_t num_slots,
    int64_t num_sorted, int64_t num_experts, int64_t size_n, int64_t size_k, int64_t num_groups,
    int top_k, int num_bits, int dtype, int is_k_full, int variant, void* stream) {
  using namespace wna16v3;
  int rc = wna16_check_gemm(a, b, scales, g_idx, perm, sorted_ids, offsets, c, workspace,
                            num_slots, num_experts, size_n, size_k, num_groups, top_k, num_bits,
                            dtype, is_k_full);
  if (rc) return rc;
  if ((rc = check_mode(size_k, num_groups, perm != nullptr))) return rc;
  if (!aligned16(a) || !aligned16(b) || !aligned16(scales) || !aligned16(c) ||
      (zp && !aligned16(zp)) || !aligned16(workspace))
    return wna16_fail(WNA16_EINVAL, "the v3 GEMM needs 16-byte aligned a, b_q, scales, zero "
                      "points, output and workspace (pass contiguous tensors)");
  if (num_experts == 0 || num_sorted == 0 || size_n == 0 || size_k == 0) return WNA16_OK;

  int sms = 0, major = 0, optin = 0;
  if ((rc = device_sms(&sms, &major, &optin))) return rc;
  if (major < 8)
    return wna16_fail(WNA16_ENOTSUP, "the v3 GEMM needs sm80+ (mma.sync), device is sm%d0", major);
  Config cfg;
  if ((rc = make_config(num_sorted, num_experts, size_n, num_bits, variant, sms, &cfg))) return rc;

  Args p;
  p.a = a, p.b = (const uint32_t*)b, p.scales = (const uint16_t*)scales, p.zp = (const uint32_t*)zp;
  p.sorted_ids = sorted_ids, p.offsets = offsets;
  p.topk_weights = topk_weights, p.c = c;
  p.counters = workspace;
  p.ready = workspace + cfg.max_tiles;
  p.partials = reinterpret_cast<float*>(workspace + cfg.flag_words);
  p.num_slots = num_slots, p.num_sorted = num_sorted, p.num_experts = num_experts;
  p.size_n = size_n, p.size_k = size_k, p.num_groups = num_groups, p.top_k = top_k;
  p.group_rows = (int)(num_groups > 1 ? size_k / num_groups : size_k), p.grid = cfg.grid;

  if (dtype == WNA16_DTYPE_F16) {
    rc = num_bits == 4 ? launch_bits<kF16, 4>(p, cfg, optin, stream)
                       : launch_bits<kF16, 8>(p, cfg, optin, stream);
  } else {
    rc = num_bits == 4 ? launch_bits<kBF16, 4>(p, cfg, optin, stream)
                       : launch_bits<kBF16, 8>(p, cfg, optin, stream);
  }
  if (rc) return rc;
  cudaError_t err;
  if ((err = cudaGetLastError()) != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "moe_gemm_v3_kernel: %s", cudaGetErrorString(err));
  return WNA16_OK;
}
