// The fast MoE GEMM over Marlin-layout WNA16 weights (W4A16 / W8A16, fp16 or bf16 activations,
// zero points, act-order), the kernel behind wna16_cuda_moe_gemm_v2. Same contract as
// wna16_cuda_moe_gemm (capi.h), whose simple kernel (moe_gemm.cu) stays the reference in tests.
//
// How it spends the memory bandwidth (the weights dominate the traffic at decode sizes):
//   * raw int32 weight words go to shared memory through a kStages-deep cp.async pipeline of
//     16-byte copies, together with the activation rows (swizzled 16-byte chunks, read with
//     ldmatrix), the scale / zero-point rows of the stage's groups and, for g_idx, its groups;
//   * each warp takes one 16-row k-tile of a stage and all the block's n-tiles: a lane reads its
//     words with one 16-byte shared load per n-tile (the Marlin layout puts a lane's four words
//     side by side) and dequantises them in registers (dequant.cuh) into the mma B fragments;
//     the four warps' partial sums meet in shared memory at the end of a tile;
//   * stream-K: the K steps of all tiles form one sequence cut into equal contiguous ranges,
//     one per block, so any M (M = 1 included) fills every SM; a tile cut between blocks is
//     summed by the last block to finish it, in block order (deterministic), from fp32
//     partials in the workspace;
//   * the tile height adapts per expert: a tile covers up to 16 * MT sorted rows and computes only
//     the 16-row slices it has rows for; MT and the tile width come from tokens per expert;
//   * the expert tile offsets come from a block-wide parallel prefix (v2_tile_prefix);
//   * outputs leave as 16-byte stores of eight 16-bit values.
// Only the wna16_* intrinsics (intrinsics.cuh), so the host build executes this source as is.
#include "capi.h"
#include "checks.h"
#include "dequant.cuh"
#include "intrinsics.cuh"
#include "layout.cuh"
#include "moe_gemm_v2.cuh"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace wna16v2 {

struct alignas(16) U4 {
  uint32_t x, y, z, w;
};

struct Args {
  const void* a;
  const uint32_t* b;
  const uint16_t* scales;
  const uint32_t* zp;
  const int32_t* g_idx;
  const int32_t* perm;
  const int32_t* sorted_ids;
  const int32_t* offsets;
  const float* topk_weights;
  void* c;
  const int32_t* tile_prefix;  // [E + 1]: m-tiles of the experts before e; [E] = all of them
  int32_t* counters;           // per tile: blocks that finished their part (zeroed per call)
  int32_t* ready;              // per partial slot: 1 once its partial tile is written (zeroed)
  float* partials;             // [2 * grid][BM * BN] fp32 partial tiles
  int64_t num_slots, num_sorted, num_experts, size_n, size_k, num_groups;
  int top_k;
  int gidx_mode;   // act-order with !is_k_full: the group of Marlin row k is g_idx[e][k]
  int group_rows;  // otherwise rows per group (K / G), a multiple of 16
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

// ----------------------------------------------------------------------------------------------
// Tile prefix: tile_prefix[e] = sum over experts before e of ceil(rows_e / tile_rows). Each
// thread sums a contiguous run of experts, a warp scan and a scan of the warp totals combine
// them (one block; E is at most a few thousand).
__global__ void __launch_bounds__(kPrefixThreads)
    v2_tile_prefix(const int32_t* offsets, int64_t num_sorted, int64_t num_experts,
                   int tile_rows, int32_t* tile_prefix) {
  WNA16_SHARED_MEMORY(int32_t, warp_total);
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t per = (num_experts + kPrefixThreads - 1) / kPrefixThreads;
  const int64_t e0 = min64(num_experts, (int64_t)tid * per), e1 = min64(num_experts, e0 + per);
  int32_t local = 0;
  for (int64_t e = e0; e < e1; ++e) {
    int64_t lo, hi;
    expert_range(offsets, num_sorted, e, &lo, &hi);
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
    tile_prefix[e] = run;
    int64_t lo, hi;
    expert_range(offsets, num_sorted, e, &lo, &hi);
    run += (int32_t)((hi - lo + tile_rows - 1) / tile_rows);
  }
  if (tid == kPrefixThreads - 1) tile_prefix[num_experts] = run;
}

// The block that owns unit x of the stream-K sequence (units [start(b), start(b + 1)) with
// start(b) = floor(b * U / G)).
WNA16_KDEV int64_t unit_owner(int64_t x, int64_t units, int64_t blocks) {
  return ((x + 1) * blocks - 1) / units;
}
WNA16_KDEV int64_t unit_start(int64_t b, int64_t units, int64_t blocks) {
  return b * units / blocks;
}

// Kernel modes, separate instances so the fast one carries no code or registers of the others:
//   kFast    no act-order, scale groups of whole stages (group_rows % 64 == 0): the lane table
//            is refilled once per run of stages of one group, the inner loop only streams;
//   kGeneral act-order on a full K (activation columns gathered through perm) or groups of 16 /
//            32 rows: the group is checked per k-tile;
//   kGidx    act-order with !is_k_full: a group per row, read through g_idx.
constexpr int kFast = 0, kGeneral = 1, kGidx = 2;

template <int DT, int NB, int MT, int NT, int MODE>
struct Gemm {
  static constexpr bool GIDX = MODE == kGidx;
  using P = Plan<NB, MT, NT, MODE == kGidx>;
  using Q = Quant<DT, NB>;
  static constexpr int PF = P::PF, WPT = P::WPT, BM = P::BM, BN = P::BN;

  // Where one tile lies.
  struct Tile {
    int64_t e, m0, n0;
    int rows;    // sorted rows of this tile (1 .. BM)
    int mcount;  // 16-row slices with rows
    int nvalid;  // 64-column n-tiles inside N
  };

  static WNA16_KDEV Tile locate(const Args& p, int64_t tile) {
    const int64_t nblk = (p.size_n + BN - 1) / BN;
    const int64_t mt = tile / nblk;
    int64_t lo = 0, hi = p.num_experts - 1;  // owner: the last e with prefix[e] <= mt
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.tile_prefix[mid] <= mt) lo = mid;
      else hi = mid - 1;
    }
    Tile t;
    int64_t begin, end;
    expert_range(p.offsets, p.num_sorted, lo, &begin, &end);
    t.e = lo;
    t.m0 = begin + (mt - p.tile_prefix[lo]) * BM;
    t.rows = (int)min64(BM, end - t.m0);
    t.mcount = (t.rows + 15) / 16;
    t.n0 = (tile % nblk) * BN;
    t.nvalid = (int)min64(NT, (p.size_n - t.n0) / 64);
    return t;
  }

  // First and last scale group of stage ks (non-g_idx modes).
  static WNA16_KDEV void stage_groups(const Args& p, int ks, int64_t* g0, int64_t* g1) {
    const int64_t k0 = (int64_t)ks * kStageK;
    *g0 = k0 / p.group_rows;
    *g1 = (min64(p.size_k, k0 + kStageK) - 1) / p.group_rows;
  }

  // Whether stage ks must bring scale rows: the first stage of a range always, then whenever a
  // warp's k-tile may have entered a new group.
  static WNA16_KDEV bool stage_needs_scales(const Args& p, int ks, int ks_first) {
    if (ks == ks_first || p.group_rows % kStageK) return true;
    return ((int64_t)ks * kStageK) / p.group_rows != ((int64_t)(ks - 1) * kStageK) / p.group_rows;
  }

  // Issue the copies of stage ks into its buffer (one commit group per call, by the caller).
  // GATHER: act-order, activation columns gathered through perm.
  template <bool GATHER>
  static WNA16_KDEV void load_stage(const Args& p, const Tile& t, unsigned char* smem,
                                    const int32_t* sh_slot, int ks, int ks_first, int tid) {
    unsigned char* st = smem + (ks % kStages) * P::STAGE;
    const int64_t K = p.size_k, N = p.size_n;
    const int64_t k0 = (int64_t)ks * kStageK;
    const int ktiles = (int)(K / 16);

    // activations: row i, 16-byte chunk ch (k0 + 8ch .. +8) at chunk ch ^ (i % 8)
    const uint16_t* a = static_cast<const uint16_t*>(p.a);
    for (int c = tid; c < t.mcount * 16 * 8; c += kThreads) {
      const int row = c >> 3, ch = c & 7;
      const int64_t kk = k0 + 8 * ch;
      const int32_t s = sh_slot[row];
      const bool ok = s >= 0 && kk < K;
      unsigned char* dst = st + P::A_OFF + row * 128 + ((ch ^ (row & 7)) << 4);
      const int64_t arow = ok ? (int64_t)(s / p.top_k) * K : 0;
      if (!GATHER) {
        wna16_cp_async16(dst, ok ? (const void*)(a + arow + kk) : p.a, ok);
      } else {  // act-order: columns gathered through perm (plain loads)
        uint32_t v[4] = {0u, 0u, 0u, 0u};
        if (ok) {
          const int32_t* pr = p.perm + t.e * K + kk;
          WNA16_UNROLL
          for (int i = 0; i < 4; ++i) {
            const int64_t c0 = clamp64(pr[2 * i], 0, K - 1), c1 = clamp64(pr[2 * i + 1], 0, K - 1);
            v[i] = (uint32_t)a[arow + c0] | ((uint32_t)a[arow + c1] << 16);
          }
        }
        U4 u;
        u.x = v[0], u.y = v[1], u.z = v[2], u.w = v[3];
        *reinterpret_cast<U4*>(dst) = u;
      }
    }

    // weights: k-tile rows are contiguous runs of NT * WPT words in global memory
    const int64_t bcols = N * 16 / PF;
    const uint32_t* bexp = p.b + t.e * (int64_t)ktiles * bcols + (t.n0 / 64) * WPT;
    constexpr int CHUNKS_PER_TILE = WPT / 4;
    for (int c = tid; c < 4 * NT * CHUNKS_PER_TILE; c += kThreads) {
      const int ktl = c / (NT * CHUNKS_PER_TILE), rest = c % (NT * CHUNKS_PER_TILE);
      const int kt = ks * 4 + ktl;
      const bool ok = kt < ktiles && rest / CHUNKS_PER_TILE < t.nvalid;
      const uint32_t* src = ok ? bexp + (int64_t)kt * bcols + rest * 4 : p.b;
      wna16_cp_async16(st + P::B_OFF + (ktl * NT * WPT + rest * 4) * 4, src, ok);
    }

    if (GIDX) {  // the stage's row groups
      const int32_t* gsrc = p.g_idx + t.e * K + k0;
      for (int c = tid; c < kStageK / 4; c += kThreads) {
        const bool ok = k0 + 4 * c < K;
        wna16_cp_async16(st + P::G_OFF + 16 * c, ok ? (const void*)(gsrc + 4 * c) : p.g_idx, ok);
      }
      return;
    }
    if (!stage_needs_scales(p, ks, ks_first)) return;
    int64_t g0, g1;
    stage_groups(p, ks, &g0, &g1);
    copy_scale_rows(p, t, st, g0, (int)(g1 - g0 + 1), tid);
  }

  // Scale (and zero-point) rows g0 .. g0 + nrows - 1 of the block's columns into a stage.
  static WNA16_KDEV void copy_scale_rows(const Args& p, const Tile& t, unsigned char* st,
                                         int64_t g0, int nrows, int tid) {
    const int64_t N = p.size_n, G = p.num_groups;
    constexpr int S_CHUNKS = BN / 8;  // 16-bit scales
    for (int c = tid; c < nrows * S_CHUNKS; c += kThreads) {
      const int r = c / S_CHUNKS, ch = c % S_CHUNKS;
      const bool ok = ch * 8 < t.nvalid * 64;
      const uint16_t* src = p.scales + ((t.e * G + g0 + r) * N + t.n0 + 8 * ch);
      wna16_cp_async16(st + P::S_OFF + (r * BN + 8 * ch) * 2, ok ? (const void*)src : p.scales, ok);
    }
    if (p.zp) {
      constexpr int ZW = BN / PF, Z_CHUNKS = ZW / 4;
      for (int c = tid; c < nrows * Z_CHUNKS; c += kThreads) {
        const int r = c / Z_CHUNKS, ch = c % Z_CHUNKS;
        const bool ok = ch * 4 * PF < t.nvalid * 64;
        const uint32_t* src = p.zp + ((t.e * G + g0 + r) * (N / PF) + t.n0 / PF + 4 * ch);
        wna16_cp_async16(st + P::Z_OFF + (r * ZW + 4 * ch) * 4, ok ? (const void*)src : p.zp, ok);
      }
    }
  }

  // The fast mode's copies, with the per-thread part of the addresses fixed per tile and
  // advanced by pointer steps: thread tid copies activation chunk tid % 8 of rows tid / 8 + 16 i,
  // weight chunks tid + 128 i, and at a group's first stage scale / zero-point chunk tid.
  struct FastLoader {
    static constexpr int CPT = WPT / 4;                    // 16-byte chunks per 16 x 64 tile
    static constexpr int ROW_CHUNKS = NT * CPT;            // chunks of one k-tile row of the block
    static constexpr int B_PER_THREAD = 4 * ROW_CHUNKS / kThreads;
    static constexpr int S_CHUNKS = BN / 8, Z_CHUNKS = BN / PF / 4;
    static_assert((4 * ROW_CHUNKS) % kThreads == 0, "chunk split");
    static_assert(S_CHUNKS + Z_CHUNKS <= kThreads, "one scale chunk per thread");
    const uint16_t* a;       // activations + this thread's column chunk
    const uint32_t* b;       // the block's weights at k-tile 0 of the next stage
    const void* s;           // its scale (or zero-point) chunk of the next group, or null
    int64_t bcols, b_step, s_step;  // per k-tile, per stage, per group
    int a_ch, a_row0, tid, nvalid, s_dst, ktiles, spg, left;

    WNA16_KDEV FastLoader(const Args& p, const Tile& t, int tid_, int ks_next) {
      ktiles = (int)(p.size_k / 16);
      bcols = p.size_n * 16 / PF;
      tid = tid_, nvalid = t.nvalid;
      a_ch = tid & 7, a_row0 = tid >> 3;
      a = static_cast<const uint16_t*>(p.a) + 8 * a_ch;
      b_step = 4 * bcols;
      b = p.b + t.e * (int64_t)ktiles * bcols + (t.n0 / 64) * WPT + (int64_t)ks_next * b_step;
      spg = p.group_rows / kStageK;
      const int64_t g = (int64_t)ks_next / spg;
      left = ks_next % spg;  // stages of the group before ks_next (0: ks_next starts it)
      s = nullptr, s_step = 0, s_dst = 0;
      if (tid < S_CHUNKS) {
        if (8 * tid < t.nvalid * 64) {
          s = p.scales + ((t.e * p.num_groups + g) * p.size_n + t.n0 + 8 * tid);
          s_step = p.size_n * 2;
        }
        s_dst = P::S_OFF + 16 * tid;
      } else if (p.zp && tid < S_CHUNKS + Z_CHUNKS) {
        const int ch = tid - S_CHUNKS;
        if (ch * 4 * PF < t.nvalid * 64) {
          s = p.zp + ((t.e * p.num_groups + g) * (p.size_n / PF) + t.n0 / PF + 4 * ch);
          s_step = p.size_n / PF * 4;
        }
        s_dst = P::Z_OFF + 16 * ch;
      }
      if (left) s = s ? static_cast<const unsigned char*>(s) + s_step : nullptr;  // next group
      if (left) left = spg - left;
    }

    // Copies of stage ks (the stage after the previous call's).
    WNA16_KDEV void load(const Args& p, const Tile& t, unsigned char* smem,
                         const int64_t* sh_aoff, int ks) {
      unsigned char* st = smem + (ks % kStages) * P::STAGE;
      const int64_t kk = (int64_t)ks * kStageK + 8 * a_ch;
      WNA16_UNROLL
      for (int i = 0; i < MT; ++i) {
        if (i < t.mcount) {
          const int row = a_row0 + 16 * i;
          const int64_t off = sh_aoff[row];
          const bool ok = off >= 0 && kk < p.size_k;
          wna16_cp_async16(st + P::A_OFF + row * 128 + ((a_ch ^ (row & 7)) << 4),
                           ok ? (const void*)(a + off + (int64_t)ks * kStageK) : p.a, ok);
        }
      }
      WNA16_UNROLL
      for (int i = 0; i < B_PER_THREAD; ++i) {  // chunk tid + 128 i: k-tile row, chunk in row
        const int c = tid + kThreads * i, ktl = c / ROW_CHUNKS, rest = c % ROW_CHUNKS;
        const bool ok = rest / CPT < nvalid && ks * 4 + ktl < ktiles;
        wna16_cp_async16(st + P::B_OFF + (ktl * NT * WPT + rest * 4) * 4,
                         ok ? (const void*)(b + ktl * bcols + rest * 4) : p.b, ok);
      }
      b += b_step;
      if (left == 0) {  // the first stage of a group brings its scale / zero-point row
        if (s_dst) {
          wna16_cp_async16(st + s_dst, s ? s : p.scales, s != nullptr);
          if (s) s = static_cast<const unsigned char*>(s) + s_step;
        }
        left = spg;
      }
      --left;
    }
  };

  // This lane's entry of sub-tile `sub` of n-tile j in the lane table: {scale pair of column c,
  // of c + 8, zero pair of c, of c + 8} when the pairs are per column; in g_idx mode the row
  // pairs (r, r+1), (r+8, r+9) differ, and the entry is {s[0..3]} then {z[0..3]} (two entries).
  static WNA16_KDEV U4* lane_entry(unsigned char* smem, int warp, int j, int sub, int lane) {
    return reinterpret_cast<U4*>(smem + P::LANE_OFF) + ((warp * NT + j) * 4 + sub) * 32 + lane;
  }

  // Fill the lane table from the stage's scale row `row` (per-column pairs).
  static WNA16_KDEV void lane_scales(const Args& p, unsigned char* smem, const unsigned char* st,
                                     int row, int warp, int lane) {
    const int grouped = p.num_groups > 1;
    const uint16_t* srow = reinterpret_cast<const uint16_t*>(st + P::S_OFF) + row * BN;
    const uint32_t* zrow = reinterpret_cast<const uint32_t*>(st + P::Z_OFF) + row * (BN / PF);
    for (int j = 0; j < NT; ++j) {
      for (int sub = 0; sub < 4; ++sub) {
        uint32_t sp[2], zp[2];
        for (int h = 0; h < 2; ++h) {
          const int col = 64 * j + 16 * sub + (lane >> 2) + 8 * h;
          const uint32_t sv = srow[wna16_scale_pos(grouped, col)];
          sp[h] = sv | (sv << 16);
          const int z = p.zp ? (int)wna16_zp_code(zrow, NB, col) : (1 << (NB - 1));
          zp[h] = Q::zero_pair(z, z);
        }
        U4 u;
        u.x = sp[0], u.y = sp[1], u.z = zp[0], u.w = zp[1];
        *lane_entry(smem, warp, j, sub, lane) = u;
      }
    }
  }

  // g_idx mode: the pairs of this lane's rows r, r+1, r+8, r+9 (groups grp[]) from global memory.
  static WNA16_KDEV void row_scales(const Args& p, const Tile& t, unsigned char* smem,
                                    const int32_t grp[4], int warp, int lane) {
    const int grouped = p.num_groups > 1;
    const int64_t N = p.size_n;
    for (int j = 0; j < NT; ++j) {
      if (j >= t.nvalid) continue;
      for (int sub = 0; sub < 4; ++sub) {
        uint32_t s[4], z[4];
        for (int h = 0; h < 2; ++h) {  // column c, then c + 8
          const int64_t n = t.n0 + 64 * j + 16 * sub + (lane >> 2) + 8 * h;
          const int64_t pos = wna16_scale_pos(grouped, n);
          uint32_t sv[4];
          int zv[4];
          for (int r = 0; r < 4; ++r) {
            const int64_t row = t.e * p.num_groups + grp[r];
            sv[r] = p.scales[row * N + pos];
            zv[r] = p.zp ? (int)wna16_zp_code(p.zp + row * (N / PF), NB, n) : (1 << (NB - 1));
          }
          s[2 * h] = sv[0] | (sv[1] << 16);  // rows (r, r+1)
          s[2 * h + 1] = sv[2] | (sv[3] << 16);  // rows (r+8, r+9)
          z[2 * h] = Q::zero_pair(zv[0], zv[1]);
          z[2 * h + 1] = Q::zero_pair(zv[2], zv[3]);
        }
        U4 us, uz;
        us.x = s[0], us.y = s[1], us.z = s[2], us.w = s[3];
        uz.x = z[0], uz.y = z[1], uz.z = z[2], uz.w = z[3];
        lane_entry(smem, warp, j, sub, lane)[0] = us;
        lane_entry(smem, warp, j, sub, lane)[4 * NT * 4 * 32] = uz;  // second table half
      }
    }
  }

  // One stage of one warp: its k-tile against all n-tiles and 16-row slices. REFILL: check the
  // k-tile's group and refill the lane table (the fast loop does that once per group run).
  template <bool REFILL>
  static WNA16_KDEV void compute_stage(const Args& p, const Tile& t, unsigned char* smem,
                                       const unsigned char* st, int ks, int warp, int lane,
                                       int64_t* cur_group, float acc[MT][NT][8][4]) {
    const int64_t kt = (int64_t)ks * 4 + warp;
    if (kt >= p.size_k / 16) return;  // warp-uniform: past K in the last stage
    if (!REFILL) {
    } else if (GIDX) {
      const int32_t* g = reinterpret_cast<const int32_t*>(st + P::G_OFF) + 16 * warp;
      const int r = 2 * (lane & 3);
      int32_t grp[4];
      grp[0] = g[r], grp[1] = g[r + 1], grp[2] = g[r + 8], grp[3] = g[r + 9];
      for (int i = 0; i < 4; ++i) grp[i] = (int32_t)clamp64(grp[i], 0, p.num_groups - 1);
      row_scales(p, t, smem, grp, warp, lane);
    } else {
      const int64_t g = kt * 16 / p.group_rows;
      if (g != *cur_group) {  // warp-uniform
        int64_t g0, g1;
        stage_groups(p, ks, &g0, &g1);
        lane_scales(p, smem, st, (int)(g - g0), warp, lane);
        *cur_group = g;
      }
    }

    uint32_t af[MT][4];
    WNA16_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
      if (mi == 0 || mi < t.mcount) {  // slice 0 always has rows
        const int row = 16 * mi + (lane & 15), ch = 2 * warp + (lane >> 4);
        wna16_ldmatrix_x4(af[mi], st + P::A_OFF + row * 128 + ((ch ^ (row & 7)) << 4));
      }
    }
        WNA16_UNROLL
    for (int j = 0; j < NT; ++j) {
      if (j > 0 && j >= t.nvalid) continue;  // warp-uniform; n-tile 0 is always inside N
      const uint32_t* wp =
          reinterpret_cast<const uint32_t*>(st + P::B_OFF) + (warp * NT + j) * WPT + lane * 4 * Q::WORDS;
      uint32_t words[4 * Q::WORDS];
      WNA16_UNROLL
      for (int v = 0; v < Q::WORDS; ++v) {
        const U4 u = reinterpret_cast<const U4*>(wp)[v];
        words[4 * v] = u.x, words[4 * v + 1] = u.y, words[4 * v + 2] = u.z, words[4 * v + 3] = u.w;
      }
      WNA16_UNROLL
      for (int sub = 0; sub < 4; ++sub) {
        const U4* ent = lane_entry(smem, warp, j, sub, lane);
        const U4 e0 = ent[0];
        uint32_t z[4], s[4], bf[4];
        if (GIDX) {
          const U4 e1 = ent[4 * NT * 4 * 32];
          s[0] = e0.x, s[1] = e0.y, s[2] = e0.z, s[3] = e0.w;
          z[0] = e1.x, z[1] = e1.y, z[2] = e1.z, z[3] = e1.w;
        } else {
          s[0] = s[1] = e0.x, s[2] = s[3] = e0.y;
          z[0] = z[1] = e0.z, z[2] = z[3] = e0.w;
        }
        Q::dequant(words + sub * Q::WORDS, z, s, bf);
        WNA16_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
          if (mi == 0 || mi < t.mcount) {  // slice 0 always has rows
            Ops<DT>::mma(acc[mi][j][2 * sub], af[mi], bf);
            Ops<DT>::mma(acc[mi][j][2 * sub + 1], af[mi], bf + 2);
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

  // Stages [ks0, ks1) of tile `tile`, then its output (whole tile) or its partial (cut tile).
  static WNA16_KDEV void run_tile(const Args& p, unsigned char* smem, int64_t tile, int ks0,
                                  int ks1, int kstages, int64_t units, int64_t blocks,
                                  int64_t self) {
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int32_t* sh_slot = reinterpret_cast<int32_t*>(smem + P::SLOT_OFF);
    int32_t* sh_flag = reinterpret_cast<int32_t*>(smem + P::FLAG_OFF);
    int64_t* sh_aoff = reinterpret_cast<int64_t*>(smem + P::AOFF_OFF);
    const Tile t = locate(p, tile);

    wna16_syncthreads();  // the previous tile is done with shared memory
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

    float acc[MT][NT][8][4];
    WNA16_UNROLL
    for (int mi = 0; mi < MT; ++mi)
      WNA16_UNROLL
      for (int j = 0; j < NT; ++j)
        WNA16_UNROLL
        for (int n8 = 0; n8 < 8; ++n8)
          WNA16_UNROLL
          for (int r = 0; r < 4; ++r) acc[mi][j][n8][r] = 0.f;
    int64_t cur_group = -1;

    // prologue: kStages - 1 stages in flight (empty groups keep the wait arithmetic uniform)
    WNA16_UNROLL
    for (int i = 0; i < kStages - 1; ++i) {
      if (ks0 + i < ks1) {
        if (p.perm) load_stage<true>(p, t, smem, sh_slot, ks0 + i, ks0, tid);
        else load_stage<false>(p, t, smem, sh_slot, ks0 + i, ks0, tid);
      }
      wna16_cp_async_commit();
    }
    if (MODE == kFast) {
      // one scale group per stage: the lane table changes only between runs of stages of one
      // group, and the inner loop carries no refill, gather or index arithmetic
      FastLoader ld(p, t, tid, ks0 + kStages - 1);
      const int spg = p.group_rows / kStageK;  // stages per group
      for (int ks = ks0; ks < ks1;) {
        const int run_end = (int)min64(ks1, (int64_t)(ks / spg + 1) * spg);
        wna16_cp_async_wait<kStages - 2>();
        wna16_syncthreads();
        if (ks + kStages - 1 < ks1) ld.load(p, t, smem, sh_aoff, ks + kStages - 1);
        wna16_cp_async_commit();
        compute_stage<true>(p, t, smem, smem + (ks % kStages) * P::STAGE, ks, warp, lane,
                            &cur_group, acc);
        for (++ks; ks < run_end; ++ks) {
          wna16_cp_async_wait<kStages - 2>();
          wna16_syncthreads();
          if (ks + kStages - 1 < ks1) ld.load(p, t, smem, sh_aoff, ks + kStages - 1);
          wna16_cp_async_commit();
          compute_stage<false>(p, t, smem, smem + (ks % kStages) * P::STAGE, ks, warp, lane,
                               &cur_group, acc);
        }
      }
    } else {
      for (int ks = ks0; ks < ks1; ++ks) {
        wna16_cp_async_wait<kStages - 2>();  // this thread's copies of stage ks have landed
        wna16_syncthreads();                 // everyone's have; stage ks - 1 is consumed
        if (ks + kStages - 1 < ks1) {
          if (p.perm) load_stage<true>(p, t, smem, sh_slot, ks + kStages - 1, ks0, tid);
          else load_stage<false>(p, t, smem, sh_slot, ks + kStages - 1, ks0, tid);
        }
        wna16_cp_async_commit();
        compute_stage<true>(p, t, smem, smem + (ks % kStages) * P::STAGE, ks, warp, lane,
                            &cur_group, acc);
      }
    }
    wna16_cp_async_wait<0>();
    wna16_syncthreads();  // the pipeline buffers become the reduction buffer

    // the four warps' partial sums, row-major per warp
    float* red = reinterpret_cast<float*>(smem);
    {
      float* mine = red + warp * BM * P::RED_LD;
      const int g = lane >> 2, tig = lane & 3;
      WNA16_UNROLL
      for (int mi = 0; mi < MT; ++mi) {
        if (mi >= t.mcount) continue;
        WNA16_UNROLL
        for (int j = 0; j < NT; ++j)
          WNA16_UNROLL
          for (int n8 = 0; n8 < 8; ++n8) {
            const int col = 64 * j + 8 * n8 + 2 * tig, row = 16 * mi + g;
            mine[row * P::RED_LD + col] = acc[mi][j][n8][0];
            mine[row * P::RED_LD + col + 1] = acc[mi][j][n8][1];
            mine[(row + 8) * P::RED_LD + col] = acc[mi][j][n8][2];
            mine[(row + 8) * P::RED_LD + col + 1] = acc[mi][j][n8][3];
          }
      }
    }
    wna16_syncthreads();

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
        if (col >= t.nvalid * 64 || row >= t.rows) continue;
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
                       // each block raises its flag before it counts itself in)
        for (int64_t b = b_lo; b <= b_hi; ++b)
          if (b != self)
            while (wna16_load_acquire(p.ready + slot_of(b)) == 0) {
            }
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

template <int DT, int NB, int MT, int NT, int MODE>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) moe_gemm_v2_kernel(const Args p) {
  WNA16_SHARED_MEMORY(U4, smem_raw);
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw);
  using G = Gemm<DT, NB, MT, NT, MODE>;
  const int64_t nblk = (p.size_n + G::BN - 1) / G::BN;
  const int kstages = (int)((p.size_k + kStageK - 1) / kStageK);
  const int64_t units = (int64_t)p.tile_prefix[p.num_experts] * nblk * kstages;
  const int64_t blocks = min64(p.grid, units);
  const int64_t self = blockIdx.x;
  if (self >= blocks) return;
  int64_t u = unit_start(self, units, blocks);
  const int64_t u_end = unit_start(self + 1, units, blocks);
  while (u < u_end) {
    const int64_t tile = u / kstages;
    const int ks0 = (int)(u % kstages);
    const int ks1 = (int)min64(kstages, ks0 + (u_end - u));
    G::run_tile(p, smem, tile, ks0, ks1, kstages, units, blocks, self);
    u += ks1 - ks0;
  }
}

// ----------------------------------------------------------------------------------------------
// Launch configuration: tile rows from the sorted rows per expert, 128 columns when N allows.
struct Config {
  int mt, nt, grid, smem;
  int64_t max_tiles;  // upper bound of tiles (counters)
  int64_t ws_words;   // workspace int32 words
};

template <int NB>
int tile_smem_bits(int mode, int mt) {
  if (mode == kGidx) return Plan<NB, 1, 2, true>::SMEM;
  if (mode == kGeneral) return Plan<NB, 1, 2>::SMEM;
  if (mt == 1) return Plan<NB, 1, 4>::SMEM;
  if (mt == 2) return Plan<NB, 2, 2>::SMEM;
  return Plan<NB, 4, 1>::SMEM;
}
int tile_smem(int num_bits, int mode, int mt) {
  return num_bits == 4 ? tile_smem_bits<4>(mode, mt) : tile_smem_bits<8>(mode, mt);
}

// variant: WNA16_GEMM_AUTO / WNA16_GEMM_MMA, or 16 / 32 / 64 to force the tile rows.
int make_config(int64_t num_sorted, int64_t num_experts, int64_t size_n, int num_bits,
                int mode, int variant, int sms, Config* cfg) {
  const bool fast = mode == kFast;
  int rows;
  if (variant == WNA16_GEMM_AUTO || variant == WNA16_GEMM_MMA) {
    const int64_t per_expert = num_experts ? (num_sorted + num_experts - 1) / num_experts : 0;
    rows = per_expert <= 16 ? 16 : (per_expert <= 32 ? 32 : 64);
  } else if (variant == 16 || variant == 32 || variant == 64) {
    rows = variant;
  } else if (variant == WNA16_GEMM_FMA) {
    return wna16_fail(WNA16_ENOTSUP, "the v2 GEMM has no FMA variant (use the v1 kernel)");
  } else {
    return wna16_fail(WNA16_EINVAL, "unknown GEMM variant %d", variant);
  }
  if (!fast) rows = 16;  // the general and g_idx instances have the 16-row tile only
  cfg->mt = rows / 16;
  // 128 accumulators per thread in every fast tile: 16 x 256, 32 x 128, 64 x 64; the general
  // and g_idx instances (more code, more registers) take 16 x 128
  cfg->nt = !fast ? 2 : (cfg->mt == 1 ? 4 : (cfg->mt == 2 ? 2 : 1));
  cfg->smem = tile_smem(num_bits, mode, cfg->mt);
  const int64_t bn = 64 * cfg->nt, bm = rows;
  cfg->max_tiles = ((num_sorted + bm - 1) / bm + num_experts) * ((size_n + bn - 1) / bn);
  cfg->grid = sms * kBlocksPerSm;
  const int64_t header = (num_experts + 1 + 3) / 4 * 4;
  const int64_t counters = (cfg->max_tiles + 2 * (int64_t)cfg->grid + 3) / 4 * 4;  // + ready flags
  cfg->ws_words = header + counters + 2 * (int64_t)cfg->grid * bm * bn;
  return WNA16_OK;
}

template <int DT, int NB, int MT, int NT, int MODE>
int launch_typed(const Args& p, int smem, int smem_optin, void* stream) {
  auto* kernel = moe_gemm_v2_kernel<DT, NB, MT, NT, MODE>;
  if (smem > smem_optin)
    return wna16_fail(WNA16_ENOTSUP, "the v2 GEMM tile needs %d bytes of shared memory, the "
                      "device allows %d", smem, smem_optin);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "moe_gemm_v2 shared memory: %s", cudaGetErrorString(err));
  WNA16_LAUNCH(p.grid, kThreads, smem, (cudaStream_t)stream, (moe_gemm_v2_kernel<DT, NB, MT, NT, MODE>), p);
  return WNA16_OK;
}

bool fast_mode(const Args& p) { return !p.perm && p.group_rows % kStageK == 0; }

template <int DT, int NB>
int launch_bits(const Args& p, const Config& cfg, int smem_optin, void* stream) {
  if (p.gidx_mode) return launch_typed<DT, NB, 1, 2, kGidx>(p, cfg.smem, smem_optin, stream);
  if (!fast_mode(p)) return launch_typed<DT, NB, 1, 2, kGeneral>(p, cfg.smem, smem_optin, stream);
  if (cfg.mt == 1) return launch_typed<DT, NB, 1, 4, kFast>(p, cfg.smem, smem_optin, stream);
  if (cfg.mt == 2) return launch_typed<DT, NB, 2, 2, kFast>(p, cfg.smem, smem_optin, stream);
  return launch_typed<DT, NB, 4, 1, kFast>(p, cfg.smem, smem_optin, stream);
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

}  // namespace wna16v2

// The kernel mode: fast iff no act-order and scale groups of whole 64-row stages.
static int wna16v2_mode(int64_t size_k, int64_t num_groups, int has_perm, int gidx_mode) {
  const int64_t group_rows = num_groups > 1 ? size_k / num_groups : size_k;
  if (gidx_mode) return wna16v2::kGidx;
  return !has_perm && group_rows % wna16v2::kStageK == 0 ? wna16v2::kFast : wna16v2::kGeneral;
}

extern "C" WNA16_API int wna16_cuda_moe_gemm_v2_workspace(int64_t num_sorted, int64_t num_experts,
                                                         int64_t size_n, int64_t size_k,
                                                         int64_t num_groups, int num_bits,
                                                         int has_perm, int variant,
                                                         int64_t* words) {
  using namespace wna16v2;
  int sms = 0, major = 0, optin = 0;
  int rc = wna16_check_bits(num_bits);
  if (rc) return rc;
  if (num_groups < 1) return wna16_fail(WNA16_EINVAL, "num_groups must be >= 1");
  if ((rc = device_sms(&sms, &major, &optin))) return rc;
  Config cfg;
  if ((rc = make_config(num_sorted, num_experts, size_n, num_bits,
                        wna16v2_mode(size_k, num_groups, has_perm, 0), variant, sms, &cfg)))
    return rc;
  *words = cfg.ws_words;
  return WNA16_OK;
}

extern "C" WNA16_API int wna16_cuda_moe_gemm_v2(
    const void* a, const int32_t* b, const void* scales, const int32_t* zp, const int32_t* g_idx,
    const int32_t* perm, const int32_t* sorted_ids, const int32_t* offsets,
    const float* topk_weights, void* c, int32_t* workspace, int64_t num_slots,
    int64_t num_sorted, int64_t num_experts, int64_t size_n, int64_t size_k, int64_t num_groups,
    int top_k, int num_bits, int dtype, int is_k_full, int variant, void* stream) {
  using namespace wna16v2;
  int rc = wna16_check_gemm(a, b, scales, g_idx, perm, sorted_ids, offsets, c, workspace,
                            num_slots, num_experts, size_n, size_k, num_groups, top_k, num_bits,
                            dtype, is_k_full);
  if (rc) return rc;
  const int gidx_mode = perm && !is_k_full;
  const int64_t group_rows = num_groups > 1 ? size_k / num_groups : size_k;
  if (!gidx_mode && size_k && group_rows % 16)
    return wna16_fail(WNA16_ENOTSUP, "the v2 GEMM needs scale groups of a multiple of 16 rows "
                      "(size_k %lld / %lld groups); use the v1 kernel",
                      (long long)size_k, (long long)num_groups);
  if (!aligned16(a) || !aligned16(b) || !aligned16(scales) || !aligned16(c) ||
      (zp && !aligned16(zp)) || (g_idx && !aligned16(g_idx)) || !aligned16(workspace))
    return wna16_fail(WNA16_EINVAL, "the v2 GEMM needs 16-byte aligned a, b_q, scales, zero "
                      "points, g_idx, output and workspace (pass contiguous tensors)");
  if (num_experts == 0 || num_sorted == 0 || size_n == 0 || size_k == 0) return WNA16_OK;

  int sms = 0, major = 0, optin = 0;
  if ((rc = device_sms(&sms, &major, &optin))) return rc;
  if (major < 8)
    return wna16_fail(WNA16_ENOTSUP, "the v2 GEMM needs sm80+ (mma.sync), device is sm%d0", major);
  Config cfg;
  if ((rc = make_config(num_sorted, num_experts, size_n, num_bits,
                        wna16v2_mode(size_k, num_groups, perm != 0, gidx_mode), variant, sms,
                        &cfg)))
    return rc;

  const int64_t header = (num_experts + 1 + 3) / 4 * 4;
  const int64_t counters = (cfg.max_tiles + 2 * (int64_t)cfg.grid + 3) / 4 * 4;
  Args p;
  p.a = a, p.b = (const uint32_t*)b, p.scales = (const uint16_t*)scales, p.zp = (const uint32_t*)zp;
  p.g_idx = g_idx, p.perm = perm, p.sorted_ids = sorted_ids, p.offsets = offsets;
  p.topk_weights = topk_weights, p.c = c;
  p.tile_prefix = workspace;
  p.counters = workspace + header;
  p.ready = p.counters + cfg.max_tiles;
  p.partials = reinterpret_cast<float*>(workspace + header + counters);
  p.num_slots = num_slots, p.num_sorted = num_sorted, p.num_experts = num_experts;
  p.size_n = size_n, p.size_k = size_k, p.num_groups = num_groups, p.top_k = top_k;
  p.gidx_mode = gidx_mode, p.group_rows = (int)group_rows, p.grid = cfg.grid;

  const cudaStream_t s = (cudaStream_t)stream;
  cudaError_t err = cudaMemsetAsync(p.counters, 0, (size_t)counters * sizeof(int32_t), s);
  if (err != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "moe_gemm_v2 workspace reset: %s", cudaGetErrorString(err));
  WNA16_LAUNCH(1, kPrefixThreads, (kPrefixThreads / 32) * (int)sizeof(int32_t), s, v2_tile_prefix,
               offsets, num_sorted, num_experts, 16 * cfg.mt, workspace);
  if ((err = cudaGetLastError()) != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "v2_tile_prefix: %s", cudaGetErrorString(err));

  if (dtype == WNA16_DTYPE_F16) {
    rc = num_bits == 4 ? launch_bits<kF16, 4>(p, cfg, optin, stream)
                       : launch_bits<kF16, 8>(p, cfg, optin, stream);
  } else {
    rc = num_bits == 4 ? launch_bits<kBF16, 4>(p, cfg, optin, stream)
                       : launch_bits<kBF16, 8>(p, cfg, optin, stream);
  }
  if (rc) return rc;
  if ((err = cudaGetLastError()) != cudaSuccess)
    return wna16_fail(WNA16_ECUDA, "moe_gemm_v2_kernel: %s", cudaGetErrorString(err));
  return WNA16_OK;
}
