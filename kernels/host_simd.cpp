// AVX2 and NEON tile loops of the native rank builder (declared in host_simd.h).
//
// Both instruction sets formulate the same three steps, so they are described once here.
//
// 4-bit. For one k-tile kt and one n-tile (64 columns from n0), the Marlin words
// 16c .. 16c+15 (c < 8) take their codes from the 8 columns n0 + c + 8j (j < 8), words 2kt and
// 2kt+1 of each: one qword per column, x (rows 0-7) in its low half, y (rows 8-15) in its high half.
//  1. Per qword, nibble regrouping with shifts and masks: the low half becomes A (byte b = low
//     nibble of x's byte b | low nibble of y's byte b << 4), the high half B (the high nibbles).
//  2. Columns j = 2w and 2w + 1 share a 16-byte lane; one byte shuffle turns the lane into the
//     four dwords T_w[tl] = [A_2w[tl], A_2w+1[tl], B_2w[tl], B_2w+1[tl]]: word (tl, w) of
//     wna16_marlin_word4.
//  3. Output word 4 tl + w is T_w[tl]: a 4x4 transpose of dwords across the four lanes.
//
// 8-bit. The Marlin words 32c .. 32c+31 take codes from the same 8 columns, words 4kt .. 4kt+3
// (16 codes, one byte each). One byte shuffle per column gives its four words S_j[tl] = codes
// [2tl, 8+2tl, 2tl+1, 9+2tl] (wna16_marlin_word8), and output word 8 tl + j is S_j[tl]: an 8x4
// transpose of dwords.
//
// Loop order: for each (n0, c) every k-tile, so each of the 8 columns is read front to back. The
// AVX2 4-bit loop loads 32 bytes (4 k-tiles) of each column at once and pairs the columns per
// k-tile with qword unpacks and 128-bit lane moves, which more than halves its instructions.
#include "host_simd.h"

#include <algorithm>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// Byte shuffles, the same for both instruction sets (per 16-byte lane).
// 4-bit, step 2: T_w[tl] byte b from the lane [A_2w, B_2w, A_2w+1, B_2w+1] (4 bytes each).
alignas(16) static const uint8_t kSpread4[16] = {0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15};
// 8-bit: S_j[tl] byte b from the column's 16 codes.
alignas(16) static const uint8_t kSpread8[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

#if defined(__x86_64__) && defined(__GNUC__)
bool wna16_cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}


namespace {
// Step 1 on four qwords: x's high nibbles and y's low nibbles trade places (a delta swap).
__attribute__((target("avx2"))) inline __m256i regroup4(__m256i v, __m256i field) {
  const __m256i t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi64(v, 28), v), field);
  return _mm256_xor_si256(v, _mm256_xor_si256(t, _mm256_slli_epi64(t, 28)));
}

// Steps 2 and 3 for one k-tile: v02 holds the lanes w = 0 | 2, v13 the lanes w = 1 | 3.
__attribute__((target("avx2"))) inline void store_tile4(__m256i v02, __m256i v13, __m256i spread, __m256i order,
                                                       uint32_t* o) {
  const __m256i t02 = _mm256_shuffle_epi8(v02, spread), t13 = _mm256_shuffle_epi8(v13, spread);
  // lo: [T0[0], T1[0], T0[1], T1[1] | T2[0], T3[0], T2[1], T3[1]], hi: the same for tl = 2, 3
  const __m256i lo = _mm256_unpacklo_epi32(t02, t13), hi = _mm256_unpackhi_epi32(t02, t13);
  _mm256_storeu_si256((__m256i*)o, _mm256_permutevar8x32_epi32(lo, order));
  _mm256_storeu_si256((__m256i*)(o + 8), _mm256_permutevar8x32_epi32(hi, order));
}
}  // namespace

// Four k-tiles at a time: each column's 32 bytes of words 2kt0 .. 2kt0+7 are loaded whole, then
// qword unpacks and 128-bit lane moves pair the columns 2w, 2w+1 of each k-tile.
__attribute__((target("avx2"))) void wna16_marlin4_nfirst_avx2(const uint32_t* src, int64_t ld, int64_t size_k,
                                                               int64_t size_n, uint32_t* dst, int64_t out_ld) {
  const int64_t ktiles = size_k / 16;  // a multiple of 4 (host_simd.h)
  const __m256i field = _mm256_set1_epi64x((long long)0x00000000f0f0f0f0ULL);  // x's high nibbles
  const __m256i spread = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kSpread4));
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t n0 = 0; n0 < size_n; n0 += 64)
    for (int c = 0; c < 8; ++c) {
      const uint32_t* col = src + (n0 + c) * ld;  // column j at col + 8 j ld
      uint32_t* out = dst + 2 * n0 + 16 * c;
      for (int64_t kt = 0; kt < ktiles; kt += 4) {
        __m256i r[8];  // r[j]: column j, k-tiles kt .. kt+3
        for (int j = 0; j < 8; ++j) r[j] = regroup4(_mm256_loadu_si256((const __m256i*)(col + 8 * j * ld + 2 * kt)), field);
        // u[j/2] = [r_j[0], r_j+1[0] | r_j[2], r_j+1[2]], v[j/2] the same for k-tiles 1, 3
        __m256i u[4], v[4];
        for (int p = 0; p < 4; ++p) {
          u[p] = _mm256_unpacklo_epi64(r[2 * p], r[2 * p + 1]);
          v[p] = _mm256_unpackhi_epi64(r[2 * p], r[2 * p + 1]);
        }
        uint32_t* o = out + kt * out_ld;
        store_tile4(_mm256_permute2x128_si256(u[0], u[2], 0x20), _mm256_permute2x128_si256(u[1], u[3], 0x20), spread,
                    order, o);
        store_tile4(_mm256_permute2x128_si256(v[0], v[2], 0x20), _mm256_permute2x128_si256(v[1], v[3], 0x20), spread,
                    order, o + out_ld);
        store_tile4(_mm256_permute2x128_si256(u[0], u[2], 0x31), _mm256_permute2x128_si256(u[1], u[3], 0x31), spread,
                    order, o + 2 * out_ld);
        store_tile4(_mm256_permute2x128_si256(v[0], v[2], 0x31), _mm256_permute2x128_si256(v[1], v[3], 0x31), spread,
                    order, o + 3 * out_ld);
      }
    }
}

__attribute__((target("avx2"))) void wna16_marlin8_nfirst_avx2(const uint32_t* src, int64_t ld, int64_t size_k,
                                                               int64_t size_n, uint32_t* dst, int64_t out_ld) {
  const int64_t ktiles = size_k / 16;
  const __m256i spread = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kSpread8));
  for (int64_t n0 = 0; n0 < size_n; n0 += 64)
    for (int c = 0; c < 8; ++c) {
      const uint32_t* col = src + (n0 + c) * ld;
      uint32_t* out = dst + 4 * n0 + 32 * c;
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        const uint32_t* p = col + 4 * kt;
        __m256i s[4];  // s[i] = [S_i | S_i+4]
        for (int i = 0; i < 4; ++i) {
          const __m128i a = _mm_loadu_si128((const __m128i*)(p + 8 * i * ld));
          const __m128i b = _mm_loadu_si128((const __m128i*)(p + 8 * (i + 4) * ld));
          s[i] = _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1), spread);
        }
        const __m256i t0 = _mm256_unpacklo_epi32(s[0], s[1]), t1 = _mm256_unpackhi_epi32(s[0], s[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(s[2], s[3]), t3 = _mm256_unpackhi_epi32(s[2], s[3]);
        uint32_t* o = out + kt * out_ld;
        _mm256_storeu_si256((__m256i*)o, _mm256_unpacklo_epi64(t0, t2));
        _mm256_storeu_si256((__m256i*)(o + 8), _mm256_unpackhi_epi64(t0, t2));
        _mm256_storeu_si256((__m256i*)(o + 16), _mm256_unpacklo_epi64(t1, t3));
        _mm256_storeu_si256((__m256i*)(o + 24), _mm256_unpackhi_epi64(t1, t3));
      }
    }
}
#else
bool wna16_cpu_has_avx2() { return false; }
#endif

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
// dst rows 0-7 (ds words apart) = the columns of the 8 x 8 words at src (rows ss words apart).
__attribute__((target("avx2"))) inline void transpose8x8(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(src + i * ss)));
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved: [a0 b0 a1 b1 | a4 b4 a5 b5], [a2 b2 a3 b3 | ...]
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // quads: [a0 b0 c0 d0 | a4 b4 c4 d4], [a1 ...], [a2 ...], [a3 ...]
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {  // the low 128-bit lanes of both quads give column j, the high ones column j + 4
    _mm256_storeu_si256((__m256i*)(dst + j * ds), _mm256_castps_si256(_mm256_permute2f128_ps(r[j], r[j + 4], 0x20)));
    _mm256_storeu_si256((__m256i*)(dst + (j + 4) * ds),
                        _mm256_castps_si256(_mm256_permute2f128_ps(r[j], r[j + 4], 0x31)));
  }
}
}  // namespace

// Strips of 16 source rows, left to right in 8 x 8 tiles: the 16 rows are read front to back (the
// hardware prefetcher follows them out of the page cache of a mapped shard) and every destination
// row gets one whole 64-byte line per strip (blocks of 64 x 64 measured 15-40 % more CPU on mapped
// codes).
__attribute__((target("avx2"))) void wna16_transpose32_avx2(const uint32_t* src, int64_t ld, int64_t rows,
                                                            int64_t cols, uint32_t* dst) {
  const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (int64_t r0 = 0; r0 < r8; r0 += 16) {
    const int64_t r1 = std::min(r0 + 16, r8);
    for (int64_t c = 0; c < c8; c += 8)
      for (int64_t r = r0; r < r1; r += 8) transpose8x8(src + r * ld + c, ld, dst + c * rows + r, rows);
  }
  for (int64_t r = 0; r < rows; ++r)  // the edges: columns from c8 of the tiled rows, every column of the rest
    for (int64_t c = r < r8 ? c8 : 0; c < cols; ++c) dst[c * rows + r] = src[r * ld + c];
}
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
bool wna16_cpu_has_neon() { return true; }  // Advanced SIMD is part of every AArch64 CPU

namespace {
// Four dwords each of a, b, c, d -> rows r[i] = [a[i], b[i], c[i], d[i]].
inline void transpose4(uint32x4_t a, uint32x4_t b, uint32x4_t c, uint32x4_t d, uint32x4_t r[4]) {
  const uint32x4x2_t ab = vtrnq_u32(a, b), cd = vtrnq_u32(c, d);  // [a0 b0 a2 b2], [a1 b1 a3 b3]
  const uint64x2_t ab0 = vreinterpretq_u64_u32(ab.val[0]), ab1 = vreinterpretq_u64_u32(ab.val[1]);
  const uint64x2_t cd0 = vreinterpretq_u64_u32(cd.val[0]), cd1 = vreinterpretq_u64_u32(cd.val[1]);
  r[0] = vreinterpretq_u32_u64(vzip1q_u64(ab0, cd0));
  r[1] = vreinterpretq_u32_u64(vzip1q_u64(ab1, cd1));
  r[2] = vreinterpretq_u32_u64(vzip2q_u64(ab0, cd0));
  r[3] = vreinterpretq_u32_u64(vzip2q_u64(ab1, cd1));
}
}  // namespace

void wna16_marlin4_nfirst_neon(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld) {
  const int64_t ktiles = size_k / 16;
  const uint64x2_t keep = vdupq_n_u64(0xf0f0f0f00f0f0f0fULL), down = vdupq_n_u64(0x00000000f0f0f0f0ULL),
                   up = vdupq_n_u64(0x0f0f0f0f00000000ULL);
  const uint8x16_t spread = vld1q_u8(kSpread4);
  for (int64_t n0 = 0; n0 < size_n; n0 += 64)
    for (int c = 0; c < 8; ++c) {
      const uint32_t* col = src + (n0 + c) * ld;
      uint32_t* out = dst + 2 * n0 + 16 * c;
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        const uint32_t* p = col + 2 * kt;
        uint32x4_t t[4];
        for (int w = 0; w < 4; ++w) {
          const uint64x2_t v = vcombine_u64(vld1_u64((const uint64_t*)(p + 16 * w * ld)),
                                            vld1_u64((const uint64_t*)(p + (16 * w + 8) * ld)));
          const uint64x2_t cv = vorrq_u64(vandq_u64(v, keep), vorrq_u64(vandq_u64(vshrq_n_u64(v, 28), down),
                                                                        vandq_u64(vshlq_n_u64(v, 28), up)));
          t[w] = vreinterpretq_u32_u8(vqtbl1q_u8(vreinterpretq_u8_u64(cv), spread));
        }
        uint32x4_t r[4];
        transpose4(t[0], t[1], t[2], t[3], r);
        uint32_t* o = out + kt * out_ld;
        for (int tl = 0; tl < 4; ++tl) vst1q_u32(o + 4 * tl, r[tl]);
      }
    }
}

void wna16_marlin8_nfirst_neon(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld) {
  const int64_t ktiles = size_k / 16;
  const uint8x16_t spread = vld1q_u8(kSpread8);
  for (int64_t n0 = 0; n0 < size_n; n0 += 64)
    for (int c = 0; c < 8; ++c) {
      const uint32_t* col = src + (n0 + c) * ld;
      uint32_t* out = dst + 4 * n0 + 32 * c;
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        const uint32_t* p = col + 4 * kt;
        uint32x4_t s[8];
        for (int j = 0; j < 8; ++j)
          s[j] = vreinterpretq_u32_u8(vqtbl1q_u8(vld1q_u8((const uint8_t*)(p + 8 * j * ld)), spread));
        uint32x4_t lo[4], hi[4];  // columns 0-3 and 4-7 of each output row
        transpose4(s[0], s[1], s[2], s[3], lo);
        transpose4(s[4], s[5], s[6], s[7], hi);
        uint32_t* o = out + kt * out_ld;
        for (int tl = 0; tl < 4; ++tl) {
          vst1q_u32(o + 8 * tl, lo[tl]);
          vst1q_u32(o + 8 * tl + 4, hi[tl]);
        }
      }
    }
}
#else
bool wna16_cpu_has_neon() { return false; }
#endif
