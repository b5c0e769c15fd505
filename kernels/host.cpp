// Host build of layout.cuh: the native CPU Marlin repack (the repack command's fast path) and the
// index queries the tests compare with the Python layout code. Pure permutations of bits, so the
// results equal the torch path exactly; the work is memory-bound and split over std::threads.
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define WNA16_HAVE_X86 1
#endif

#include "capi.h"
#include "checks.h"
#include "host_simd.h"
#include "layout.cuh"

namespace {

// ---- reads of mapped files that survive the file shrinking -------------------------------------
// repack maps the checkpoint's shards instead of copying them out with pread; a shard truncated
// while it runs would kill the process with SIGBUS on the next read of a lost page. A guarded
// entry point sets a per-thread jump buffer; the SIGBUS handler jumps back to it, and the entry
// point returns WNA16_EFAULT. Faults outside a guard go to whichever handler was there before
// (Python's faulthandler, or the default). The jump skips the frames between (nothing in them
// owns more than a scratch vector, which then leaks: the run is ending with an error anyway).
thread_local sigjmp_buf* tls_guard = nullptr;
struct sigaction previous_bus;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  if (tls_guard != nullptr) siglongjmp(*tls_guard, 1);
  // not a guarded read: hand the fault to the previous handler (the instruction faults again)
  sigaction(SIGBUS, &previous_bus, nullptr);
  (void)sig, (void)info, (void)ctx;
}

void ensure_sigbus_handler() {
  struct sigaction cur;
  if (sigaction(SIGBUS, nullptr, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &previous_bus);  // whoever was there (re-installed, e.g. faulthandler) is the fallback
}

struct BusGuard {  // clears the thread's guard however the entry point returns
  explicit BusGuard(sigjmp_buf* buf) { tls_guard = buf; }
  ~BusGuard() { tls_guard = nullptr; }
};

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

// ---------------------------------------------------------------------------------------------
// The repack command's native data path: one rank's Marlin tensors for a chunk of experts, read
// straight from the checkpoint's N-first words (symmetric, no act-order, no tile padding).

// Marlin rows of k-tile `kt` for the 64 columns [n0, n0 + 64), 4-bit, from an N-first source
// (column n's packed K words at src + n * ld): for each c < 8 the 16 output words 16c .. 16c+15
// take their codes from exactly the columns c, c+8, .., c+56, words 2kt and 2kt+1 (one qword each),
// so a gather of 8 qwords and two byte permutations over their nibbles make one 64-byte store.
// Equal to repack_ktile over staged rows (wna16_marlin_word4), which the tests check.
#if WNA16_HAVE_X86
// Byte p = 4 * (4 tl + w) + b of 16 output words takes its low nibble from table index
// kNibbleIndex[p] (the table being [low nibbles of 64 gathered bytes, high nibbles]) and its high
// nibble from kNibbleIndex[p] + 4; shared by both 4-bit tile loops below.
alignas(64) const uint8_t kNibbleIndex[64] = {
#define WNA16_A(tl, w) (uint8_t)(16 * (w) + (tl)), (uint8_t)(16 * (w) + 8 + (tl)), \
                       (uint8_t)(64 + 16 * (w) + (tl)), (uint8_t)(64 + 16 * (w) + 8 + (tl))
    WNA16_A(0, 0), WNA16_A(0, 1), WNA16_A(0, 2), WNA16_A(0, 3), WNA16_A(1, 0), WNA16_A(1, 1),
    WNA16_A(1, 2), WNA16_A(1, 3), WNA16_A(2, 0), WNA16_A(2, 1), WNA16_A(2, 2), WNA16_A(2, 3),
    WNA16_A(3, 0), WNA16_A(3, 1), WNA16_A(3, 2), WNA16_A(3, 3)
#undef WNA16_A
};

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void ntile4_avx512(const uint32_t* src, int64_t ld,
                                                                            int64_t kt, int64_t n0,
                                                                            uint32_t* dst) {
  // qword j = 2w + h of the gather holds x, y (h = 0) or x', y' (h = 1) of wna16_marlin_word4
  const __m512i idx_a = _mm512_load_si512((const void*)kNibbleIndex);
  const __m512i idx_b = _mm512_add_epi8(idx_a, _mm512_set1_epi8(4));  // y is 4 bytes after x
  const __m512i lo_mask = _mm512_set1_epi8(0x0f);
  const __m512i cols = _mm512_set_epi64(56 * ld, 48 * ld, 40 * ld, 32 * ld, 24 * ld, 16 * ld, 8 * ld, 0);
  for (int c = 0; c < 8; ++c) {
    // dword offsets of word 2kt of the columns n0 + c + 8j
    const __m512i off = _mm512_add_epi64(cols, _mm512_set1_epi64((n0 + c) * ld + 2 * kt));
    const __m512i v = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xff, off, (const void*)src, 4);
    const __m512i lo = _mm512_and_si512(v, lo_mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
    const __m512i a = _mm512_permutex2var_epi8(lo, idx_a, hi);
    const __m512i b = _mm512_permutex2var_epi8(lo, idx_b, hi);
    _mm512_storeu_si512((void*)(dst + 16 * c), _mm512_or_si512(a, _mm512_slli_epi16(b, 4)));
  }
}

// The same words for 8 k-tiles at once: the 8 columns' 64-byte runs of words 2kt0 .. 2kt0+15 are
// loaded whole and transposed (8x8 qwords), so every source cache line is read once, in order.
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void marlin4_nfirst_avx512(
    const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst, int64_t out_ld) {
  const __m512i idx_a = _mm512_load_si512((const void*)kNibbleIndex);
  const __m512i idx_b = _mm512_add_epi8(idx_a, _mm512_set1_epi8(4));
  const __m512i lo_mask = _mm512_set1_epi8(0x0f);
  const int64_t ktiles = size_k / 16, kt_main = ktiles - ktiles % 8;
  // two-source qword permutations (permutex2var: GCC 12's unpack / shuffle_i64x2 intrinsics trip
  // -Wmaybe-uninitialized): unpack lo / hi, then 128-bit lanes (0, 2) / (1, 3) of both sources
  const __m512i unpack_lo = _mm512_set_epi64(14, 6, 12, 4, 10, 2, 8, 0);
  const __m512i unpack_hi = _mm512_set_epi64(15, 7, 13, 5, 11, 3, 9, 1);
  const __m512i lanes_02 = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i lanes_13 = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
  for (int64_t n0 = 0; n0 < size_n; n0 += 64)
    for (int c = 0; c < 8; ++c) {
      const uint32_t* col = src + (n0 + c) * ld;
      uint32_t* out = dst + 2 * n0 + 16 * c;
      for (int64_t kt0 = 0; kt0 < kt_main; kt0 += 8) {
        __m512i r[8], a[8], b[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm512_loadu_si512((const void*)(col + 8 * j * ld + 2 * kt0));
        for (int j = 0; j < 4; ++j) {  // a[2j]: k = 0, 2, 4, 6 of rows 2j, 2j+1; a[2j+1]: k odd
          a[2 * j] = _mm512_permutex2var_epi64(r[2 * j], unpack_lo, r[2 * j + 1]);
          a[2 * j + 1] = _mm512_permutex2var_epi64(r[2 * j], unpack_hi, r[2 * j + 1]);
        }
        // b[4h + 2p + q]: rows 4h .. 4h+3 at k = q + 2p and q + 2p + 4
        for (int h = 0; h < 2; ++h)
          for (int q = 0; q < 2; ++q) {
            b[4 * h + q] = _mm512_permutex2var_epi64(a[4 * h + q], lanes_02, a[4 * h + 2 + q]);
            b[4 * h + 2 + q] = _mm512_permutex2var_epi64(a[4 * h + q], lanes_13, a[4 * h + 2 + q]);
          }
        for (int k = 0; k < 8; ++k) {
          const int q = k & 1, p = (k >> 1) & 1;
          const __m512i v = _mm512_permutex2var_epi64(b[2 * p + q], (k >> 2) ? lanes_13 : lanes_02, b[4 + 2 * p + q]);
          const __m512i lo = _mm512_and_si512(v, lo_mask);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
          const __m512i x = _mm512_permutex2var_epi8(lo, idx_a, hi);
          const __m512i y = _mm512_permutex2var_epi8(lo, idx_b, hi);
          _mm512_storeu_si512((void*)(out + (kt0 + k) * out_ld), _mm512_or_si512(x, _mm512_slli_epi16(y, 4)));
        }
      }
    }
  for (int64_t kt = kt_main; kt < ktiles; ++kt)
    for (int64_t n0 = 0; n0 < size_n; n0 += 64) ntile4_avx512(src, ld, kt, n0, dst + kt * out_ld + 2 * n0);
}

bool have_avx512vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi");
  return yes;
}
#else
bool have_avx512vbmi() { return false; }
#endif

bool simd_supported(int level) {
  switch (level) {
    case WNA16_SIMD_SCALAR: return true;
    case WNA16_SIMD_AVX2: return wna16_cpu_has_avx2();
    case WNA16_SIMD_AVX512: return have_avx512vbmi();
    case WNA16_SIMD_NEON: return wna16_cpu_has_neon();
    default: return false;
  }
}

int best_simd() {
  if (have_avx512vbmi()) return WNA16_SIMD_AVX512;
  if (wna16_cpu_has_avx2()) return WNA16_SIMD_AVX2;
  if (wna16_cpu_has_neon()) return WNA16_SIMD_NEON;
  return WNA16_SIMD_SCALAR;
}

// One projection's Marlin weight (K = size_k, N = size_n) from the N-first words at `src`
// (column n at src + n * ld, the K words from word 0): rows of `dst` are out_ld words apart.
// `level` is a WNA16_SIMD_* level the CPU has (the AVX-512 level runs 8-bit tiles with AVX2).
void marlin_from_nfirst(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, int num_bits,
                        uint32_t* dst, int64_t out_ld, int level, std::vector<uint32_t>& tmp) {
  const int pf = wna16_pack_factor(num_bits);
  const int64_t ktiles = size_k / 16;
#if WNA16_HAVE_X86
  if (level == WNA16_SIMD_AVX512 && num_bits == 4) {
    marlin4_nfirst_avx512(src, ld, size_k, size_n, dst, out_ld);
    return;
  }
#endif
#if WNA16_HAVE_AVX2_TILES
  if ((level == WNA16_SIMD_AVX2 || level == WNA16_SIMD_AVX512) && (num_bits == 8 || size_k % 64 == 0)) {
    (num_bits == 4 ? wna16_marlin4_nfirst_avx2 : wna16_marlin8_nfirst_avx2)(src, ld, size_k, size_n, dst, out_ld);
    return;
  }
#endif
#if WNA16_HAVE_NEON_TILES
  if (level == WNA16_SIMD_NEON) {
    (num_bits == 4 ? wna16_marlin4_nfirst_neon : wna16_marlin8_nfirst_neon)(src, ld, size_k, size_n, dst, out_ld);
    return;
  }
#endif
  tmp.resize((size_t)(16 / pf * size_n));
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    stage_ktile_strided(src, 1, ld, kt, size_n, num_bits, tmp.data());
    repack_ktile(tmp.data(), size_n, dst + kt * out_ld, size_n, num_bits);
  }
}

// out[g][j] = logical[g][chunk(j) + src(j)], logical[g][n] = column n's scale of group g + g0
// in an N-first [*, ld] scale tensor (gate/up: two sources, the second for n >= split).
template <typename T>
void marlin_scales_from_nfirst(const T* first, const T* second, int64_t split, int64_t ld, int64_t g0,
                               int64_t groups, int64_t size_n, int grouped, T* out) {
  const int ch = wna16_scale_chunk(grouped);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j = 0; j < size_n; ++j) {
      const int64_t n = (j / ch) * ch + wna16_scale_src(grouped, (int)(j % ch));
      const T* col = n < split ? first + n * ld : second + (n - split) * ld;
      out[g * size_n + j] = col[g0 + g];
    }
}

template <typename T>
void expert_scales(const void* const* e, int64_t h, int64_t i, int64_t i_p, int rank, int64_t g13, int64_t g2_full,
                   int64_t g2, int64_t g2_first, int w13_grouped, int w2_grouped, T* w13s, T* w2s) {
  const T* gate = (const T*)e[3] + rank * i_p * g13;
  const T* up = (const T*)e[4] + rank * i_p * g13;
  marlin_scales_from_nfirst<T>(gate, up, i_p, g13, 0, g13, 2 * i_p, w13_grouped, w13s);
  marlin_scales_from_nfirst<T>((const T*)e[5], nullptr, h, g2_full, g2_first, g2, h, w2_grouped, w2s);
  (void)i;
}

bool finite16(uint16_t v, int kind) {  // kind 0 = fp16, 1 = bf16
  return kind == 0 ? (v & 0x7c00u) != 0x7c00u : (v & 0x7f80u) != 0x7f80u;
}

// dst [cols, rows] = src [rows, cols]^T in blocks of 64 x 64 elements (both sides in L1).
template <typename T>
void transpose_blocked(const T* src, int64_t ld, int64_t rows, int64_t cols, T* dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += 64)
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t r1 = std::min(r0 + 64, rows), c1 = std::min(c0 + 64, cols);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * ld + c];
    }
}

}  // namespace

extern "C" {

WNA16_API int wna16_marlin_rank_host(const void* const* src, int64_t num_experts, int64_t hidden,
                                     int64_t intermediate, int tp, int rank, int num_bits,
                                     int64_t group_size, int load_full_w2, int scale_bytes, int w13_grouped,
                                     int w2_grouped, void* w13, void* w2, void* w13_scale, void* w2_scale,
                                     int simd, int num_threads) {
  ensure_sigbus_handler();
  sigjmp_buf jump;
  if (sigsetjmp(jump, 1)) {
    tls_guard = nullptr;
    return wna16_fail(WNA16_EFAULT, "a page of the source was gone (the mapped file shrank while it was read)");
  }
  BusGuard guard(&jump);
  const int64_t h = hidden;
  if (tp <= 0 || rank < 0 || rank >= tp || intermediate % tp)
    return wna16_fail(WNA16_EINVAL, "rank %d of tp %d does not divide intermediate %lld", rank, tp,
                      (long long)intermediate);
  const int64_t i_p = intermediate / tp;
  int rc = wna16_check_marlin_shape(1, h, i_p, num_bits);
  if (!rc) rc = wna16_check_marlin_shape(1, i_p, h, num_bits);
  if (rc) return rc;
  if (scale_bytes != 2 && scale_bytes != 4)
    return wna16_fail(WNA16_EINVAL, "scale_bytes = %d is not 2 or 4", scale_bytes);
  const bool channel = group_size == -1;
  if (!channel && (group_size <= 0 || h % group_size || intermediate % group_size || (!load_full_w2 && i_p % group_size)))
    return wna16_fail(WNA16_EINVAL, "group_size %lld does not divide the projections' K", (long long)group_size);
  const int pf = wna16_pack_factor(num_bits);
  const int64_t g13 = channel ? 1 : h / group_size, g2_full = channel ? 1 : intermediate / group_size;
  const int64_t g2 = (channel || load_full_w2) ? g2_full : i_p / group_size;
  const int64_t g2_first = (channel || load_full_w2) ? 0 : rank * (i_p / group_size);
  const int64_t w13_row = 2 * i_p * 16 / pf, w2_row = h * 16 / pf;  // Marlin row lengths (words)
  const int64_t w13_e = (h / 16) * w13_row, w2_e = (i_p / 16) * w2_row;
  if (simd == WNA16_SIMD_AUTO) simd = best_simd();
  if (!simd_supported(simd))
    return wna16_fail(WNA16_ENOTSUP, "SIMD level %d is not supported by this CPU or build", simd);
  // tasks per expert: gate, up, down, scales
  parallel_rows(num_experts * 4, num_threads, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> tmp;
    for (int64_t task = b; task < e; ++task) {
      const int64_t ex = task / 4;
      const int part = (int)(task % 4);
      const void* const* s = src + 6 * ex;
      if (part < 2) {  // gate / up: rows [rank I_p, (rank+1) I_p) of [I, H/pf]; K = H, N = I_p
        const uint32_t* p = (const uint32_t*)s[part] + rank * i_p * (h / pf);
        marlin_from_nfirst(p, h / pf, h, i_p, num_bits, (uint32_t*)w13 + ex * w13_e + part * (w13_row / 2),
                           w13_row, simd, tmp);
      } else if (part == 2) {  // down: words [rank I_p/pf, ..) of each row of [H, I/pf]; K = I_p, N = H
        const uint32_t* p = (const uint32_t*)s[2] + rank * (i_p / pf);
        marlin_from_nfirst(p, intermediate / pf, i_p, h, num_bits, (uint32_t*)w2 + ex * w2_e, w2_row, simd, tmp);
      } else if (scale_bytes == 2) {
        expert_scales<uint16_t>(s, h, intermediate, i_p, rank, g13, g2_full, g2, g2_first, w13_grouped, w2_grouped,
                                (uint16_t*)w13_scale + ex * g13 * 2 * i_p, (uint16_t*)w2_scale + ex * g2 * h);
      } else {
        expert_scales<uint32_t>(s, h, intermediate, i_p, rank, g13, g2_full, g2, g2_first, w13_grouped, w2_grouped,
                                (uint32_t*)w13_scale + ex * g13 * 2 * i_p, (uint32_t*)w2_scale + ex * g2 * h);
      }
    }
  });
  return WNA16_OK;
}

WNA16_API int wna16_transpose_host(const void* src, int64_t ld, int64_t rows, int64_t cols, void* dst,
                                   int elem_bytes, int simd) {
  if (rows < 0 || cols < 0 || ld < cols || (elem_bytes != 2 && elem_bytes != 4))
    return wna16_fail(WNA16_EINVAL, "transpose: bad shape or element size");
  ensure_sigbus_handler();  // src may be a mapping of the checkpoint (wna16_map_file)
  sigjmp_buf jump;
  if (sigsetjmp(jump, 1)) {
    tls_guard = nullptr;
    return wna16_fail(WNA16_EFAULT, "a page of the source was gone (the mapped file shrank while it was read)");
  }
  BusGuard guard(&jump);
  if (elem_bytes == 2) {
    transpose_blocked((const uint16_t*)src, ld, rows, cols, (uint16_t*)dst);
    return WNA16_OK;
  }
#ifdef WNA16_HAVE_AVX2_TILES
  if ((simd == WNA16_SIMD_AVX2 || simd == WNA16_SIMD_AVX512) && wna16_cpu_has_avx2()) {
    wna16_transpose32_avx2((const uint32_t*)src, ld, rows, cols, (uint32_t*)dst);
    return WNA16_OK;
  }
#endif
  (void)simd;
  transpose_blocked((const uint32_t*)src, ld, rows, cols, (uint32_t*)dst);
  return WNA16_OK;
}

WNA16_API int wna16_simd_level(int requested) {
  if (requested == WNA16_SIMD_AUTO) return best_simd();
  return simd_supported(requested) ? requested : -1;
}

WNA16_API void* wna16_map_file(int32_t fd, int64_t offset, int64_t length, int32_t* err) {
  void* p = mmap(nullptr, (size_t)length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, (off_t)offset);
  if (p == MAP_FAILED) {
    *err = errno;
    return nullptr;
  }
  return p;
}

WNA16_API int wna16_unmap_file(void* addr, int64_t length) {
  return munmap(addr, (size_t)length) == 0 ? WNA16_OK : wna16_fail(WNA16_EINVAL, "munmap: %s", strerror(errno));
}

// Reads n ranges (fds[i], offsets[i], sizes[i]) into dsts[i]: one call for a chunk's tensors.
// Returns -1 when all were read, else the index of the first range that failed (*err = errno, or
// 0 when the file ended first); the caller reports it.
WNA16_API int64_t wna16_pread_many(const int32_t* fds, const int64_t* offsets, const int64_t* sizes,
                                   void* const* dsts, int64_t n, int32_t* err) {
  for (int64_t i = 0; i < n; ++i) {
    char* dst = (char*)dsts[i];
    int64_t done = 0;
    while (done < sizes[i]) {
      const ssize_t got = pread(fds[i], dst + done, (size_t)(sizes[i] - done), (off_t)(offsets[i] + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        *err = got < 0 ? errno : 0;
        return i;
      }
      done += got;
    }
  }
  return -1;
}

// Index of the first of n scale tensors holding a non-finite value (-1 when none); *at = its
// element index.
WNA16_API int64_t wna16_first_nonfinite_many(const void* const* data, const int64_t* counts, int64_t n,
                                             int kind, int64_t* at) {
  ensure_sigbus_handler();
  sigjmp_buf jump;
  if (sigsetjmp(jump, 1)) {
    tls_guard = nullptr;
    wna16_fail(WNA16_EFAULT, "a page of the source was gone (the mapped file shrank while it was read)");
    return -2;
  }
  BusGuard guard(&jump);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = wna16_first_nonfinite(data[i], counts[i], kind);
    if (j >= 0) {
      *at = j;
      return i;
    }
  }
  return -1;
}

// Index of the first non-finite value of n scales (kind 0 fp16, 1 bf16, 2 fp32), -1 when all are finite.
WNA16_API int64_t wna16_first_nonfinite(const void* data, int64_t n, int kind) {
  if (kind == 2) {
    const uint32_t* p = (const uint32_t*)data;
    for (int64_t i = 0; i < n; ++i)
      if ((p[i] & 0x7f800000u) == 0x7f800000u) return i;
    return -1;
  }
  const uint16_t* p = (const uint16_t*)data;
  const uint16_t mask = kind == 0 ? 0x7c00u : 0x7f80u;  // the exponent: all ones = inf or nan
  for (int64_t b = 0; b < n; b += 1024) {  // a branch-free pass per block (vectorised), then the index
    const int64_t e = std::min<int64_t>(n, b + 1024);
    unsigned bad = 0;
    for (int64_t i = b; i < e; ++i) bad |= (unsigned)((p[i] & mask) == mask);
    if (bad)
      for (int64_t i = b; i < e; ++i)
        if (!finite16(p[i], kind)) return i;
  }
  return -1;
}


WNA16_API int wna16_marlin_repack_host_strided(const int32_t* packed, const int32_t* perm, int32_t* out,
                                               int64_t num_experts, int64_t size_k, int64_t size_n,
                                               int num_bits, int64_t src_stride_e, int64_t src_stride_kw,
                                               int64_t src_stride_n, int64_t out_stride_e,
                                               int64_t out_stride_row, int simd, int num_threads) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  if ((rc = check_perm(perm, num_experts, size_k))) return rc;
  if (simd == WNA16_SIMD_AUTO) simd = best_simd();
  if (!simd_supported(simd))
    return wna16_fail(WNA16_ENOTSUP, "SIMD level %d is not supported by this CPU or build", simd);
  const int pf = wna16_pack_factor(num_bits);
  const int64_t ktiles = size_k / 16;
  if (!perm && src_stride_kw == 1 && simd != WNA16_SIMD_SCALAR) {
    // the checkpoint's N-first words read in place (every layer the torch data path repacks
    // without act-order): the rank builder's vector tile loops, one task per expert and n-tile
    const int64_t ntiles = size_n / 64;
    parallel_rows(num_experts * ntiles, num_threads, [&](int64_t b, int64_t e) {
      std::vector<uint32_t> tmp;
      for (int64_t task = b; task < e; ++task) {
        const int64_t ex = task / ntiles, n0 = 64 * (task % ntiles);
        marlin_from_nfirst((const uint32_t*)packed + ex * src_stride_e + n0 * src_stride_n, src_stride_n, size_k, 64,
                           num_bits, (uint32_t*)out + ex * out_stride_e + n0 * 16 / pf, out_stride_row, simd, tmp);
      }
    });
    return WNA16_OK;
  }
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
