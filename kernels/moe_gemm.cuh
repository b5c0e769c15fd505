// The MoE GEMM tile algorithm, written as barrier-separated phases of per-thread work; the
// kernel in moe_gemm.cu runs one block of kThreads threads per work item, wna16_syncthreads()
// between phases, mma.sync for the tensor-core product. The same source runs on the GPU (nvcc)
// and on the CPU emulation of intrinsics.cuh (g++), which is how the tests execute it.
// Plain C++ under g++ (layout.cuh's WNA16_HD); the includer supplies Num<T> for its types.
//
// Work decomposition: work item = (m-tile, n-tile); m-tiles enumerate BM-slot chunks of every
// expert's slice of sorted_ids (prefix counts in ws[], built by tile_prefix), n-tiles are kBN
// output columns. Per K step (kBK rows): stage activations As[BM][k] (rows gathered by slot,
// columns gathered by perm for act-order) and dequantised weights Bs[n][k], then multiply.
#pragma once

#include <stdint.h>
#include <string.h>

#include "layout.cuh"

namespace wna16 {

constexpr int kThreads = 128;  // 4 warps
constexpr int kBN = 128;       // output columns per tile (two Marlin n-tiles)
constexpr int kBK = 64;        // K rows per shared-memory step (four Marlin k-tiles)
constexpr int kPad = 8;        // row padding (elements): conflict-free mma fragment loads
constexpr int kLds = kBK + kPad;

template <typename T>
struct Num;  // to_float(T), from_float(float) (round to nearest even), supplied by the includer

struct GemmArgs {
  const void* a;
  const uint32_t* b;
  const void* scales;
  const uint32_t* zp;
  const int32_t* g_idx;
  const int32_t* perm;
  const int32_t* sorted_ids;
  const int32_t* offsets;
  const float* topk_weights;
  void* c;
  const int32_t* ws;  // tile prefix, num_experts + 1 entries
  int64_t num_slots, num_sorted, num_experts, size_n, size_k, num_groups;
  int top_k;
  int gidx_mode;  // act-order with !is_k_full: scale row = g_idx[k]
};

WNA16_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Expert slice [begin, end) of sorted_ids, with offsets clamped so bad input cannot read past.
WNA16_HD void expert_range(const GemmArgs& p, int64_t e, int64_t* begin, int64_t* end) {
  *begin = clamp64(p.offsets[e], 0, p.num_sorted);
  *end = clamp64(p.offsets[e + 1], *begin, p.num_sorted);
}

// ws[e] = BM-slot tiles of the experts before e; ws[E] = total. Serial: E is small.
WNA16_HD void tile_prefix(const GemmArgs& p, int32_t* ws, int bm) {
  int64_t acc = 0;
  for (int64_t e = 0; e < p.num_experts; ++e) {
    ws[e] = (int32_t)acc;
    int64_t lo, hi;
    expert_range(p, e, &lo, &hi);
    acc += (hi - lo + bm - 1) / bm;
  }
  ws[p.num_experts] = (int32_t)acc;
}

struct WorkItem {
  int64_t e, m0, m_end, n0;
  int ncols;  // valid output columns of this tile, a multiple of 64
};

WNA16_HD int64_t n_tiles(const GemmArgs& p) { return (p.size_n + kBN - 1) / kBN; }

WNA16_HD int64_t work_count(const GemmArgs& p) { return (int64_t)p.ws[p.num_experts] * n_tiles(p); }

template <int BM>
WNA16_HD WorkItem locate(const GemmArgs& p, int64_t work) {
  const int64_t nt = n_tiles(p);
  const int64_t mt = work / nt;
  // owner of m-tile mt: the last e with ws[e] <= mt (empty experts repeat the previous value)
  int64_t lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.ws[mid] <= mt) lo = mid;
    else hi = mid - 1;
  }
  WorkItem w;
  int64_t begin;
  w.e = lo;
  expert_range(p, lo, &begin, &w.m_end);
  w.m0 = begin + (mt - p.ws[lo]) * BM;
  w.n0 = (work % nt) * kBN;
  w.ncols = (int)(p.size_n - w.n0 < kBN ? p.size_n - w.n0 : kBN);
  return w;
}

// Two consecutive 16-bit elements as one 32-bit fragment register (low half = lower index).
template <typename T>
WNA16_HD uint32_t load_pair(const T* x) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(x);  // callers pass even, 4-byte aligned indices
#else
  uint16_t h[2];
  memcpy(h, x, sizeof(h));
  return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
#endif
}

template <typename T, int NB, int BM, bool MMA>
struct MoeTile {
  static constexpr int PF = 32 / NB;
  static constexpr int WPT = 1024 / PF;          // Marlin words per (k-tile, n-tile)
  static constexpr int WM = BM == 16 ? 1 : 2;    // warps along M
  static constexpr int WN = 4 / WM;              // warps along N
  static constexpr int MI = BM / WM / 16;        // m16 tiles per warp
  static constexpr int NI = kBN / WN / 8;        // n8 tiles per warp
  static constexpr int ACC = MMA ? MI * NI * 4 : BM;  // fp32 accumulators per thread
  static_assert(kBN == kThreads, "the FMA path maps one output column per thread");
  static_assert(BM == 16 || BM == 64, "tile rows");

  struct Shared {
    T As[BM][kLds];  // activations: [slot row][k]
    T Bs[kBN][kLds]; // dequantised weights: [n][k] (k contiguous, as the B fragments want)
    int32_t slot[BM];
    int32_t kperm[kBK];
  };

  // Phase 0 (once per work item): slot of every tile row, -1 for padding.
  static WNA16_HD void load_slots(const GemmArgs& p, const WorkItem& w, Shared& sh, int tid) {
    for (int i = tid; i < BM; i += kThreads) {
      int32_t s = -1;
      if (w.m0 + i < w.m_end) {
        s = p.sorted_ids[w.m0 + i];
        if (s < 0 || s >= p.num_slots) s = -1;  // sentinel entries
      }
      sh.slot[i] = s;
    }
  }

  // Phase 1 (per K step, act-order only): the source columns of this step.
  static WNA16_HD void load_kperm(const GemmArgs& p, const WorkItem& w, Shared& sh, int tid,
                                  int64_t k0, int kb) {
    for (int i = tid; i < kb; i += kThreads) {
      const int32_t s = p.perm[w.e * p.size_k + k0 + i];
      sh.kperm[i] = (s >= 0 && s < p.size_k) ? s : -1;  // invalid columns read as zero
    }
  }

  // Phase 2a: activations. Row i reads a[slot / top_k], columns k0.. (or perm[k0..]).
  static WNA16_HD void load_a(const GemmArgs& p, const WorkItem& w, Shared& sh, int tid,
                              int64_t k0, int kb) {
    (void)w;
    const T* a = static_cast<const T*>(p.a);
    for (int idx = tid; idx < BM * kBK; idx += kThreads) {
      const int i = idx / kBK, kk = idx % kBK;
      const int32_t s = sh.slot[i];
      T v = Num<T>::from_float(0.f);
      if (s >= 0 && kk < kb) {
        const int64_t col = p.perm ? (int64_t)sh.kperm[kk] : k0 + kk;
        if (col >= 0) v = a[(int64_t)(s / p.top_k) * p.size_k + col];
      }
      sh.As[i][kk] = v;
    }
  }

  // Phase 2b: weights. The Marlin words of k-tiles [k0/16, (k0+kb)/16) x this tile's n-tiles
  // form one contiguous run per k-tile row (coalesced); every code goes to the (k, n) that
  // layout.cuh says it holds, dequantised as dtype(float(code - zero) * scale).
  static WNA16_HD void decode_b(const GemmArgs& p, const WorkItem& w, Shared& sh, int tid,
                                int64_t k0, int kb) {
    const int64_t K = p.size_k, N = p.size_n, G = p.num_groups;
    const int64_t bcols = N * 16 / PF;
    const uint32_t* bexp = p.b + w.e * (K / 16) * bcols;
    const T* sexp = static_cast<const T*>(p.scales) + w.e * G * N;
    const uint32_t* zexp = p.zp ? p.zp + w.e * G * (N / PF) : nullptr;
    const int32_t* gexp = p.gidx_mode ? p.g_idx + w.e * K : nullptr;
    const int64_t group_rows = G > 1 ? K / G : K;  // rows per scale group (non-g_idx modes)
    const int grouped = G > 1;  // the scale layout the kernel expects (spec §6.5, §6.8)
    const int row_words = (w.ncols / 64) * WPT;
    const int words = (kb / 16) * row_words;
    for (int idx = tid; idx < words; idx += kThreads) {
      const int kt_local = idx / row_words, w_local = idx % row_words;
      const uint32_t word = bexp[(k0 / 16 + kt_local) * bcols + (w.n0 / 64) * WPT + w_local];
      int k_off, n_off;
      wna16_marlin_word_base(NB, w_local % WPT, &k_off, &n_off);
      k_off += 16 * kt_local;
      n_off += 64 * (w_local / WPT);
      WNA16_UNROLL
      for (int slot = 0; slot < PF; ++slot) {
        int dk, dn;
        wna16_marlin_slot_delta(NB, slot, &dk, &dn);
        const int kl = k_off + dk, nl = n_off + dn;  // inside the shared tile
        const int64_t k = k0 + kl, n = w.n0 + nl;
        const int64_t grp = clamp64(gexp ? (int64_t)gexp[k] : k / group_rows, 0, G - 1);
        const float s = Num<T>::to_float(sexp[grp * N + wna16_scale_pos(grouped, n)]);
        const int zero =
            zexp ? (int)wna16_zp_code(zexp + grp * (N / PF), NB, n) : (1 << (NB - 1));
        const int code = (int)wna16_code(word, slot, NB);
        sh.Bs[nl][kl] = Num<T>::from_float((float)(code - zero) * s);
      }
    }
  }

  // Phase 3, FMA variant: thread tid owns output column tid of the tile, all BM rows.
  static WNA16_HD void fma_step(const Shared& sh, float* acc, int tid, int ncols, int kb) {
    if (tid >= ncols) return;
    for (int kk = 0; kk < kb; ++kk) {
      const float w = Num<T>::to_float(sh.Bs[tid][kk]);
      WNA16_UNROLL
      for (int i = 0; i < BM; ++i) acc[i] += Num<T>::to_float(sh.As[i][kk]) * w;
    }
  }

  // Phase 3, mma variant: fragments of lane `tid % 32` for the k16 slice at ks. Fragment layout
  // of mma.m16n8k16 (.f16/.bf16), groupID g = lane/4, tig = lane%4:
  //   a[0] = A[g][2tig..+1]  a[1] = A[g+8][2tig..+1]  a[2] = A[g][2tig+8..+9]  a[3] = A[g+8][2tig+8..+9]
  //   b[0] = B[2tig..+1][g]  b[1] = B[2tig+8..+9][g]
  //   d[0..1] = D[g][2tig..+1]  d[2..3] = D[g+8][2tig..+1]
  static WNA16_HD void frag_a(const Shared& sh, int tid, int ks, uint32_t af[MI][4]) {
    const int lane = tid & 31, wm = (tid >> 5) / WN;
    const int g = lane >> 2, tig = lane & 3;
    WNA16_UNROLL
    for (int mi = 0; mi < MI; ++mi) {
      const int r = wm * (BM / WM) + mi * 16 + g;
      af[mi][0] = load_pair(&sh.As[r][ks + 2 * tig]);
      af[mi][1] = load_pair(&sh.As[r + 8][ks + 2 * tig]);
      af[mi][2] = load_pair(&sh.As[r][ks + 2 * tig + 8]);
      af[mi][3] = load_pair(&sh.As[r + 8][ks + 2 * tig + 8]);
    }
  }

  // B fragment of n8 tile ni; false (warp-uniform) when the whole n8 tile lies past ncols.
  static WNA16_HD bool frag_b(const Shared& sh, int tid, int ks, int ni, int ncols,
                              uint32_t bf[2]) {
    const int lane = tid & 31, wn = (tid >> 5) % WN;
    const int nbase = wn * (kBN / WN) + ni * 8;
    if (nbase >= ncols) return false;
    const int nn = nbase + (lane >> 2), tig = lane & 3;
    bf[0] = load_pair(&sh.Bs[nn][ks + 2 * tig]);
    bf[1] = load_pair(&sh.Bs[nn][ks + 2 * tig + 8]);
    return true;
  }

  // Tile row/column of accumulator i of thread tid.
  static WNA16_HD void acc_pos(int tid, int i, int* row, int* col) {
    if (!MMA) {
      *row = i, *col = tid;
      return;
    }
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int r = i & 3, ni = (i >> 2) % NI, mi = (i >> 2) / NI;
    *row = wm * (BM / WM) + mi * 16 + (lane >> 2) + (r >> 1) * 8;
    *col = wn * (kBN / WN) + ni * 8 + 2 * (lane & 3) + (r & 1);
  }

  // Phase 4: router weight in fp32, one rounding to the output dtype; unrouted rows untouched.
  static WNA16_HD void store(const GemmArgs& p, const WorkItem& w, const Shared& sh,
                             const float* acc, int tid) {
    T* c = static_cast<T*>(p.c);
    WNA16_UNROLL
    for (int i = 0; i < ACC; ++i) {
      int row, col;
      acc_pos(tid, i, &row, &col);
      const int32_t s = sh.slot[row];
      if (s < 0 || col >= w.ncols) continue;
      float v = acc[i];
      if (p.topk_weights) v *= p.topk_weights[s];
      c[(int64_t)s * p.size_n + w.n0 + col] = Num<T>::from_float(v);
    }
  }
};

}  // namespace wna16
