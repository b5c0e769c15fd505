// CPU replay of the CUDA MoE GEMM (moe_gemm.cuh): every block's phases run thread by thread in
// barrier order, and mma.sync is replaced by a software m16n8k16 that follows the PTX fragment
// layout. It exists so that the kernel's tiling, routing, act-order, zero-point and Marlin index
// logic is executed -- and compared with the torch reference -- on machines without a GPU. It is
// deliberately literal and slow; it is not a CPU GEMM for production use.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <memory>
#include <vector>

#include "capi.h"
#include "checks.h"
#include "moe_gemm.cuh"

namespace {

// 16-bit float storage types with the device conversion semantics (round to nearest even).
struct HostF16 {
  uint16_t bits;
};
struct HostBF16 {
  uint16_t bits;
};

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  x &= 0x7fffffff;
  if (x >= 0x7f800000) return sign | (x > 0x7f800000 ? 0x7e00 : 0x7c00);  // NaN / inf
  if (x >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to inf
  if (x < 0x38800000) {
    // below 2^-14: a subnormal step is 2^-24; scaling by 2^24 is exact and nearbyint rounds to
    // nearest even (default mode). 1024 lands on the smallest normal's encoding.
    return sign | (uint16_t)nearbyintf(bits_f32(x) * 16777216.0f);
  }
  x += 0xfff + ((x >> 13) & 1);  // round the 13 dropped mantissa bits to nearest even
  x -= (uint32_t)(127 - 15) << 23;
  return sign | (uint16_t)(x >> 13);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    const float v = (float)m * (1.0f / 16777216.0f);  // exact
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000 | (m << 13));
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

}  // namespace

namespace wna16 {

template <>
struct Num<HostF16> {
  static float to_float(HostF16 x) { return f16_to_f32(x.bits); }
  static HostF16 from_float(float x) { return HostF16{f32_to_f16(x)}; }
};
template <>
struct Num<HostBF16> {
  static float to_float(HostBF16 x) { return bits_f32((uint32_t)x.bits << 16); }
  static HostBF16 from_float(float x) { return HostBF16{f32_to_bf16(x)}; }
};

}  // namespace wna16

namespace {

using namespace wna16;

// Software mma.sync.m16n8k16 (fp32 accumulate) for one warp: rebuild A (16x16) and B (16x8) from
// the 32 lanes' fragment registers per the PTX layout, multiply, add into the lanes' d[0..3].
template <typename T, int MI>
void warp_mma(const uint32_t (*af)[MI][4], int mi, const uint32_t (*bf)[2], float* const* d) {
  auto half = [](uint32_t reg, int hi) {
    return Num<T>::to_float(T{(uint16_t)(hi ? reg >> 16 : reg & 0xffff)});
  };
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, tig = lane & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * tig + h] = half(af[lane][mi][0], h);
      A[g + 8][2 * tig + h] = half(af[lane][mi][1], h);
      A[g][2 * tig + 8 + h] = half(af[lane][mi][2], h);
      A[g + 8][2 * tig + 8 + h] = half(af[lane][mi][3], h);
      B[2 * tig + h][g] = half(bf[lane][0], h);
      B[2 * tig + 8 + h][g] = half(bf[lane][1], h);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, tig = lane & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r >> 1) * 8, col = 2 * tig + (r & 1);
      float s = 0.f;
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
      d[lane][r] += s;
    }
  }
}

template <typename T, int NB, int BM, bool MMA>
int replay(GemmArgs p, int32_t* ws) {
  using Tile = MoeTile<T, NB, BM, MMA>;
  tile_prefix(p, ws, BM);
  p.ws = ws;
  std::unique_ptr<typename Tile::Shared> shp(new typename Tile::Shared());
  typename Tile::Shared& sh = *shp;
  std::vector<float> acc((size_t)kThreads * Tile::ACC);
  const int64_t total = work_count(p);
  for (int64_t work = 0; work < total; ++work) {
    const WorkItem w = locate<BM>(p, work);
    for (int tid = 0; tid < kThreads; ++tid) Tile::load_slots(p, w, sh, tid);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < p.size_k; k0 += kBK) {
      const int kb = (int)(p.size_k - k0 < kBK ? p.size_k - k0 : kBK);
      if (p.perm)
        for (int tid = 0; tid < kThreads; ++tid) Tile::load_kperm(p, w, sh, tid, k0, kb);
      for (int tid = 0; tid < kThreads; ++tid) Tile::load_a(p, w, sh, tid, k0, kb);
      for (int tid = 0; tid < kThreads; ++tid) Tile::decode_b(p, w, sh, tid, k0, kb);
      if (!MMA) {
        for (int tid = 0; tid < kThreads; ++tid)
          Tile::fma_step(sh, &acc[(size_t)tid * Tile::ACC], tid, w.ncols, kb);
        continue;
      }
      for (int ks = 0; ks < kb; ks += 16)
        for (int warp = 0; warp < kThreads / 32; ++warp) {
          uint32_t af[32][Tile::MI][4];
          for (int lane = 0; lane < 32; ++lane) Tile::frag_a(sh, warp * 32 + lane, ks, af[lane]);
          for (int ni = 0; ni < Tile::NI; ++ni) {
            uint32_t bf[32][2];
            int live = 0;
            for (int lane = 0; lane < 32; ++lane)
              live += Tile::frag_b(sh, warp * 32 + lane, ks, ni, w.ncols, bf[lane]);
            if (live != 0 && live != 32)
              return wna16_fail(WNA16_EINVAL, "internal: frag_b is not warp-uniform");
            if (!live) continue;
            for (int mi = 0; mi < Tile::MI; ++mi) {
              float* d[32];
              for (int lane = 0; lane < 32; ++lane)
                d[lane] = &acc[(size_t)(warp * 32 + lane) * Tile::ACC + (mi * Tile::NI + ni) * 4];
              warp_mma<T, Tile::MI>(af, mi, bf, d);
            }
          }
        }
    }
    for (int tid = 0; tid < kThreads; ++tid)
      Tile::store(p, w, sh, &acc[(size_t)tid * Tile::ACC], tid);
  }
  return WNA16_OK;
}

template <typename T, int NB>
int replay_bm(const GemmArgs& p, int32_t* ws, int bm, bool mma) {
  if (!mma) return bm == 16 ? replay<T, NB, 16, false>(p, ws) : replay<T, NB, 64, false>(p, ws);
  return bm == 16 ? replay<T, NB, 16, true>(p, ws) : replay<T, NB, 64, true>(p, ws);
}

}  // namespace

extern "C" {

// Same contract as wna16_cuda_moe_gemm (capi.h) on host memory. variant: WNA16_GEMM_FMA or
// WNA16_GEMM_MMA (AUTO = MMA); tile_rows: 0 = the launcher's choice, or 16 / 64 to force one.
WNA16_API int wna16_moe_gemm_replay(const void* a, const int32_t* b, const void* scales,
                                    const int32_t* zp, const int32_t* g_idx, const int32_t* perm,
                                    const int32_t* sorted_ids, const int32_t* offsets,
                                    const float* topk_weights, void* c, int32_t* workspace,
                                    int64_t num_slots, int64_t num_sorted, int64_t num_experts,
                                    int64_t size_n, int64_t size_k, int64_t num_groups, int top_k,
                                    int num_bits, int dtype, int is_k_full, int variant,
                                    int tile_rows) {
  int rc = wna16_check_gemm(a, b, scales, g_idx, perm, sorted_ids, offsets, c, workspace,
                            num_slots, num_experts, size_n, size_k, num_groups, top_k, num_bits,
                            dtype, is_k_full);
  if (rc) return rc;
  if (variant != WNA16_GEMM_AUTO && variant != WNA16_GEMM_FMA && variant != WNA16_GEMM_MMA)
    return wna16_fail(WNA16_EINVAL, "unknown GEMM variant %d", variant);
  if (tile_rows != 0 && tile_rows != 16 && tile_rows != 64)
    return wna16_fail(WNA16_EINVAL, "tile_rows = %d (expected 0, 16 or 64)", tile_rows);
  if (num_experts == 0 || num_sorted == 0 || size_n == 0 || size_k == 0) return WNA16_OK;
  const bool mma = variant != WNA16_GEMM_FMA;
  const int bm = tile_rows ? tile_rows : wna16_gemm_tile_rows(num_sorted, num_experts, mma);
  const GemmArgs p{a, (const uint32_t*)b, scales, (const uint32_t*)zp, g_idx, perm, sorted_ids,
                   offsets, topk_weights, c, workspace, num_slots, num_sorted, num_experts,
                   size_n, size_k, num_groups, top_k, (perm && !is_k_full) ? 1 : 0};
  if (dtype == WNA16_DTYPE_F16)
    return num_bits == 4 ? replay_bm<HostF16, 4>(p, workspace, bm, mma)
                         : replay_bm<HostF16, 8>(p, workspace, bm, mma);
  return num_bits == 4 ? replay_bm<HostBF16, 4>(p, workspace, bm, mma)
                       : replay_bm<HostBF16, 8>(p, workspace, bm, mma);
}

// The replay's float -> fp16/bf16 rounding, exposed so the tests can compare it with torch.
WNA16_API int wna16_round_16bit(const float* in, uint16_t* out, int64_t n, int dtype) {
  if (dtype != WNA16_DTYPE_F16 && dtype != WNA16_DTYPE_BF16)
    return wna16_fail(WNA16_EINVAL, "dtype code %d is not fp16 (0) or bf16 (1)", dtype);
  for (int64_t i = 0; i < n; ++i)
    out[i] = dtype == WNA16_DTYPE_F16 ? f32_to_f16(in[i]) : f32_to_bf16(in[i]);
  return WNA16_OK;
}

WNA16_API int wna16_widen_16bit(const uint16_t* in, float* out, int64_t n, int dtype) {
  if (dtype != WNA16_DTYPE_F16 && dtype != WNA16_DTYPE_BF16)
    return wna16_fail(WNA16_EINVAL, "dtype code %d is not fp16 (0) or bf16 (1)", dtype);
  for (int64_t i = 0; i < n; ++i)
    out[i] = dtype == WNA16_DTYPE_F16 ? f16_to_f32(in[i]) : bits_f32((uint32_t)in[i] << 16);
  return WNA16_OK;
}

}  // extern "C"
