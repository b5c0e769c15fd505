// Host build of layout.cuh: the native CPU Marlin repack (the repack command's fast path) and the
// index queries the tests compare with the Python layout code. Pure permutations of bits, so the
// results equal the torch path exactly; the work is memory-bound and split over std::threads.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "capi.h"
#include "checks.h"
#include "layout.cuh"

namespace {

// Runs fn(begin, end) over [0, total) in contiguous chunks on up to num_threads threads.
template <typename Fn>
void parallel_rows(int64_t total, int num_threads, Fn fn) {
  if (num_threads <= 0) num_threads = (int)std::max(1u, std::thread::hardware_concurrency());
  // Below ~64 rows thread start-up costs more than it saves.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(num_threads, total / 64));
  if (nt <= 1) {
    fn((int64_t)0, total);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve((size_t)nt);
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t b = total * i / nt, e = total * (i + 1) / nt;
    pool.emplace_back([=] { fn(b, e); });
  }
  for (auto& t : pool) t.join();
}

int check_perm(const int32_t* perm, int64_t num_experts, int64_t size_k) {
  if (!perm) return WNA16_OK;
  for (int64_t i = 0; i < num_experts * size_k; ++i)
    if (perm[i] < 0 || perm[i] >= size_k)
      return wna16_fail(WNA16_EINVAL, "perm[%lld, %lld] = %d is outside [0, size_k = %lld)",
                        (long long)(i / size_k), (long long)(i % size_k), perm[i],
                        (long long)size_k);
  return WNA16_OK;
}

// One k-tile row of Marlin words. `rows` points at the 16/pf packed rows of the k-tile (stride
// ld). Loops over (w, c) so that each source word is loaded once for the four lanes it feeds
// (wna16_marlin_word4/8 do the bit placement); that ordering is worth ~4x on a CPU.
void repack_ktile(const uint32_t* rows, int64_t ld, uint32_t* dst, int64_t size_n, int num_bits) {
  if (num_bits == 4) {
    for (int64_t n0 = 0; n0 < size_n; n0 += 64, dst += 128)
      for (int w = 0; w < 4; ++w)
        for (int c = 0; c < 8; ++c) {
          const int64_t n = n0 + 16 * w + c;
          const uint32_t x = rows[n], y = rows[ld + n], xp = rows[n + 8], yp = rows[ld + n + 8];
          for (int tl = 0; tl < 4; ++tl)
            dst[4 * (4 * c + tl) + w] = wna16_marlin_word4(x, y, xp, yp, tl);
        }
    return;
  }
  for (int64_t n0 = 0; n0 < size_n; n0 += 64, dst += 256)
    for (int w = 0; w < 4; ++w)
      for (int c = 0; c < 8; ++c)
        for (int h = 0; h < 2; ++h) {
          const int64_t n = n0 + 16 * w + c + 8 * h;
          const uint32_t lo0 = rows[n], lo1 = rows[ld + n], hi0 = rows[2 * ld + n],
                         hi1 = rows[3 * ld + n];
          for (int tl = 0; tl < 4; ++tl)
            dst[8 * (4 * c + tl) + 2 * w + h] =
                wna16_marlin_word8(tl < 2 ? lo0 : lo1, tl < 2 ? hi0 : hi1, tl);
        }
}

// Act-order: gathers the 16 source rows perm[16kt .. 16kt+15] into a packed block of 16/pf rows,
// so the fast tile code applies unchanged (equivalent to repacking the row-sorted matrix).
void gather_ktile(const uint32_t* src, int64_t ld, const int32_t* perm, int64_t kt, int num_bits,
                  uint32_t* tmp) {
  const int pf = wna16_pack_factor(num_bits);
  const uint32_t mask = (1u << num_bits) - 1u;
  memset(tmp, 0, sizeof(uint32_t) * (size_t)(16 / pf * ld));
  for (int k = 0; k < 16; ++k) {
    const int64_t s = perm[16 * kt + k];
    const uint32_t* row = src + (s / pf) * ld;
    const int sh = num_bits * (int)(s % pf), dsh = num_bits * (k % pf);
    uint32_t* out = tmp + (k / pf) * ld;
    for (int64_t n = 0; n < ld; ++n) out[n] |= ((row[n] >> sh) & mask) << dsh;
  }
}

// Copies the 16/pf K-first packed rows of k-tile kt from a strided source (element (kw, n) at
// src[kw * s_kw + n * s_n]) into `tmp` (16/pf rows of size_n). Reading the checkpoint's N-first
// words (s_n = K/pf, s_kw = 1) here saves a full transposed copy in the caller.
void stage_ktile_strided(const uint32_t* src, int64_t s_kw, int64_t s_n, int64_t kt, int64_t size_n,
                         int num_bits, uint32_t* tmp) {
  const int rows = 16 / wna16_pack_factor(num_bits);
  for (int64_t n = 0; n < size_n; ++n) {
    const uint32_t* col = src + n * s_n + kt * rows * s_kw;
    for (int r = 0; r < rows; ++r) tmp[r * size_n + n] = col[r * s_kw];
  }
}

// Act-order on a strided source: rows perm[16kt .. 16kt+15] gathered into a packed block.
void gather_ktile_strided(const uint32_t* src, int64_t s_kw, int64_t s_n, const int32_t* perm, int64_t kt,
                          int64_t size_n, int num_bits, uint32_t* tmp) {
  const int pf = wna16_pack_factor(num_bits);
  const uint32_t mask = (1u << num_bits) - 1u;
  memset(tmp, 0, sizeof(uint32_t) * (size_t)(16 / pf * size_n));
  for (int k = 0; k < 16; ++k) {
    const int64_t s = perm[16 * kt + k];
    const uint32_t* row = src + (s / pf) * s_kw;
    const int sh = num_bits * (int)(s % pf), dsh = num_bits * (k % pf);
    uint32_t* out = tmp + (k / pf) * size_n;
    for (int64_t n = 0; n < size_n; ++n) out[n] |= ((row[n * s_n] >> sh) & mask) << dsh;
  }
}

}  // namespace

extern "C" {

WNA16_API int wna16_marlin_repack_host_strided(const int32_t* packed, const int32_t* perm, int32_t* out,
                                               int64_t num_experts, int64_t size_k, int64_t size_n,
                                               int num_bits, int64_t src_stride_e, int64_t src_stride_kw,
                                               int64_t src_stride_n, int64_t out_stride_e,
                                               int64_t out_stride_row, int num_threads) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  if ((rc = check_perm(perm, num_experts, size_k))) return rc;
  const int pf = wna16_pack_factor(num_bits);
  const int64_t ktiles = size_k / 16;
  const bool dense = src_stride_n == 1 && src_stride_kw == size_n;
  parallel_rows(num_experts * ktiles, num_threads, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> tmp(perm || !dense ? (size_t)(16 / pf * size_n) : 0);
    for (int64_t row = b; row < e; ++row) {
      const int64_t ex = row / ktiles, kt = row % ktiles;
      const uint32_t* src = (const uint32_t*)packed + ex * src_stride_e;
      uint32_t* dst = (uint32_t*)out + ex * out_stride_e + kt * out_stride_row;
      const uint32_t* rows = src + kt * (16 / pf) * src_stride_kw;
      if (perm) {
        gather_ktile_strided(src, src_stride_kw, src_stride_n, perm + ex * size_k, kt, size_n, num_bits, tmp.data());
        rows = tmp.data();
      } else if (!dense) {
        stage_ktile_strided(src, src_stride_kw, src_stride_n, kt, size_n, num_bits, tmp.data());
        rows = tmp.data();
      }
      repack_ktile(rows, size_n, dst, size_n, num_bits);
    }
  });
  return WNA16_OK;
}

WNA16_API int wna16_marlin_repack_host(const int32_t* packed, const int32_t* perm, int32_t* out,
                                       int64_t num_experts, int64_t size_k, int64_t size_n,
                                       int num_bits, int num_threads) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  if ((rc = check_perm(perm, num_experts, size_k))) return rc;
  const int pf = wna16_pack_factor(num_bits);
  const int64_t ktiles = size_k / 16, in_rows = size_k / pf, out_cols = size_n * 16 / pf;
  parallel_rows(num_experts * ktiles, num_threads, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> tmp(perm ? (size_t)(16 / pf * size_n) : 0);
    for (int64_t row = b; row < e; ++row) {
      const int64_t ex = row / ktiles, kt = row % ktiles;
      const uint32_t* src = (const uint32_t*)packed + ex * in_rows * size_n;
      uint32_t* dst = (uint32_t*)out + row * out_cols;
      const uint32_t* rows = src + kt * (16 / pf) * size_n;
      if (perm) {
        gather_ktile(src, size_n, perm + ex * size_k, kt, num_bits, tmp.data());
        rows = tmp.data();
      }
      repack_ktile(rows, size_n, dst, size_n, num_bits);
    }
  });
  return WNA16_OK;
}

WNA16_API int wna16_marlin_unrepack_host(const int32_t* marlin, const int32_t* perm, int32_t* out,
                                         int64_t num_experts, int64_t size_k, int64_t size_n,
                                         int num_bits, int num_threads) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  if ((rc = check_perm(perm, num_experts, size_k))) return rc;
  std::vector<int32_t> inv;
  if (perm) {  // the gather is only invertible for a true permutation
    inv.assign((size_t)(num_experts * size_k), -1);
    for (int64_t ex = 0; ex < num_experts; ++ex)
      for (int64_t k = 0; k < size_k; ++k) {
        int32_t& slot = inv[(size_t)(ex * size_k + perm[ex * size_k + k])];
        if (slot >= 0)
          return wna16_fail(WNA16_EINVAL, "perm of expert %lld repeats row %d: not a permutation",
                            (long long)ex, perm[ex * size_k + k]);
        slot = (int32_t)k;
      }
  }
  const int pf = wna16_pack_factor(num_bits);
  const int64_t in_rows = size_k / pf, m_cols = size_n * 16 / pf;
  parallel_rows(num_experts * in_rows, num_threads, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t ex = row / in_rows, kp = row % in_rows;
      const uint32_t* m = (const uint32_t*)marlin + ex * (size_k / 16) * m_cols;
      const int32_t* iv = perm ? inv.data() + ex * size_k : nullptr;
      uint32_t* dst = (uint32_t*)out + row * size_n;
      for (int64_t n = 0; n < size_n; ++n) {
        uint32_t word = 0;
        for (int i = 0; i < pf; ++i) {
          const int64_t k = iv ? iv[kp * pf + i] : kp * pf + i;
          int64_t kt, col;
          int slot;
          wna16_marlin_dst(num_bits, k, n, &kt, &col, &slot);
          word |= wna16_code(m[kt * m_cols + col], slot, num_bits) << (num_bits * i);
        }
        dst[n] = word;
      }
    }
  });
  return WNA16_OK;
}

WNA16_API int wna16_permute_scales_host(const void* in, void* out, int64_t rows, int64_t size_n,
                                        int elem_bytes, int grouped, int inverse) {
  int rc = wna16_check_scales(size_n, elem_bytes, grouped);
  if (rc) return rc;
  const char* s = (const char*)in;
  char* d = (char*)out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < size_n; ++j) {
      const int ch = wna16_scale_chunk(grouped);
      const int64_t base = r * size_n + (j / ch) * ch;
      const int64_t other = base + wna16_scale_src(grouped, (int)(j % ch));
      const int64_t here = r * size_n + j;
      // forward: out[j] = in[src(j)]; inverse: out[src(j)] = in[j]
      if (inverse)
        memcpy(d + other * elem_bytes, s + here * elem_bytes, (size_t)elem_bytes);
      else
        memcpy(d + here * elem_bytes, s + other * elem_bytes, (size_t)elem_bytes);
    }
  return WNA16_OK;
}

WNA16_API int wna16_zero_points_host(const int32_t* in, int32_t* out, int64_t rows,
                                     int64_t size_n, int num_bits, int inverse) {
  int rc = wna16_check_zp(size_n, num_bits);
  if (rc) return rc;
  const int pf = wna16_pack_factor(num_bits);
  const int64_t words = size_n / pf;
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* s = (const uint32_t*)in + r * words;
    uint32_t* d = (uint32_t*)out + r * words;
    for (int64_t w = 0; w < words; ++w) {
      uint32_t word = 0;
      for (int i = 0; i < pf; ++i) {
        const int64_t q = w * pf + i;  // destination code position
        const int64_t base = (q / 64) * 64;
        const int64_t from = base + (inverse ? wna16_zp_dst(num_bits, (int)(q % 64))
                                             : wna16_zp_src(num_bits, (int)(q % 64)));
        word |= wna16_code(s[from / pf], (int)(from % pf), num_bits) << (num_bits * i);
      }
      d[w] = word;
    }
  }
  return WNA16_OK;
}

WNA16_API int wna16_marlin_src_table(int num_bits, int64_t size_k, int64_t size_n,
                                     int64_t* src_k, int64_t* src_n) {
  int rc = wna16_check_marlin_shape(1, size_k, size_n, num_bits);
  if (rc) return rc;
  const int pf = wna16_pack_factor(num_bits);
  const int64_t cols = size_n * 16 / pf;
  int64_t i = 0;
  for (int64_t kt = 0; kt < size_k / 16; ++kt)
    for (int64_t col = 0; col < cols; ++col)
      for (int s = 0; s < pf; ++s, ++i) wna16_marlin_src(num_bits, kt, col, s, &src_k[i], &src_n[i]);
  return WNA16_OK;
}

WNA16_API int wna16_marlin_dst_table(int num_bits, int64_t size_k, int64_t size_n, int64_t* kt,
                                     int64_t* col, int32_t* slot) {
  int rc = wna16_check_marlin_shape(1, size_k, size_n, num_bits);
  if (rc) return rc;
  int64_t i = 0;
  for (int64_t k = 0; k < size_k; ++k)
    for (int64_t n = 0; n < size_n; ++n, ++i) {
      int s;
      wna16_marlin_dst(num_bits, k, n, &kt[i], &col[i], &s);
      slot[i] = s;
    }
  return WNA16_OK;
}

WNA16_API int wna16_scale_perm_table(int grouped, int32_t* out) {
  for (int j = 0; j < wna16_scale_chunk(grouped); ++j) out[j] = wna16_scale_src(grouped, j);
  return WNA16_OK;
}

WNA16_API int wna16_zp_perm_table(int num_bits, int32_t* out) {
  int rc = wna16_check_bits(num_bits);
  if (rc) return rc;
  for (int q = 0; q < 64; ++q) out[q] = wna16_zp_src(num_bits, q);
  return WNA16_OK;
}

}  // extern "C"
