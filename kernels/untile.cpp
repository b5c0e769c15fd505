// The inverse of the Marlin tile order on the host: verify's round trip undoes every rank's
// weights with it.
//
// It is written from the bit-field description of the layout that `wna16ctl/layout/marlin.py`
// gives (2x2 transposes of nibble, byte and half-word fields between words), not from layout.cuh's
// index math nor from the rank builder's vector loops, so a round trip through it still checks the
// native forward that wrote the output: the two share no code. The tests compare it with the torch
// inverse on arbitrary words, where every bit position counts.
//
// Words are treated as unsigned so that right shifts bring in zeros; the masks of each transpose
// keep the fields apart either way.
#include <cstdint>
#include <cstring>

#include "capi.h"
#include "checks.h"

namespace {

// Eight words side by side: one per column of an 8-column group (tq), in one vector register
// pair or one AVX register; GCC lowers it to whatever the target has.
typedef uint32_t Lanes __attribute__((vector_size(32)));

// The 2x2 transpose of each `bits`-wide field pair of p and q: afterwards p holds the low fields
// of both (p_lo, q_lo), q the high ones (p_hi, q_hi). A delta swap exchanges p_hi with q_lo.
template <int bits>
inline void transpose_fields(Lanes& p, Lanes& q) {
  constexpr uint32_t even = bits == 4 ? 0x0F0F0F0Fu : bits == 8 ? 0x00FF00FFu : 0x0000FFFFu;
  const Lanes delta = ((p >> bits) ^ q) & even;
  q ^= delta;
  p ^= delta << bits;
}

// (filled through a reference: a 32-byte vector returned by value changes the ABI with AVX)
inline void gather8(Lanes& v, const uint32_t* first, int64_t stride) {
  for (int i = 0; i < 8; ++i) v[i] = first[i * stride];
}

inline void store8(uint32_t* dst, const Lanes& v) { memcpy(dst, &v, sizeof v); }

// 4-bit. A tile (16 rows of k, 64 columns) is 128 Marlin words, word tq·16 + tr·4 + w. Its
// K-first words are rows 2kt + a, columns 64nt + 16w + 8blk + tq. Per (w, tq): a half-word
// transpose over tr ∈ {0,2} and {1,3}, a byte transpose over the results, a nibble transpose over b.
void untile4(const uint32_t* marlin, uint32_t* out, int64_t size_k, int64_t size_n) {
  const int64_t m_cols = 2 * size_n;
  for (int64_t kt = 0; kt < size_k / 16; ++kt) {
    uint32_t* row0 = out + (2 * kt) * size_n;
    uint32_t* row1 = row0 + size_n;
    for (int64_t nt = 0; nt < size_n / 64; ++nt) {
      const uint32_t* tile = marlin + kt * m_cols + nt * 128;
      for (int w = 0; w < 4; ++w) {
        Lanes c00, c10, c01, c11;
        gather8(c00, tile + 0 * 4 + w, 16);
        gather8(c10, tile + 2 * 4 + w, 16);
        gather8(c01, tile + 1 * 4 + w, 16);
        gather8(c11, tile + 3 * 4 + w, 16);
        transpose_fields<16>(c00, c10);
        transpose_fields<16>(c01, c11);
        transpose_fields<8>(c00, c01);  // c00: b = 0, blk 0; c01: b = 0, blk 1
        transpose_fields<8>(c10, c11);  // c10: b = 1, blk 0; c11: b = 1, blk 1
        transpose_fields<4>(c00, c10);  // c00: a = 0, blk 0; c10: a = 1, blk 0
        transpose_fields<4>(c01, c11);
        const int64_t col = nt * 64 + w * 16;
        store8(row0 + col, c00);
        store8(row1 + col, c10);
        store8(row0 + col + 8, c01);
        store8(row1 + col + 8, c11);
      }
    }
  }
}

// 8-bit. A tile is 256 Marlin words, word tq·32 + trh·16 + trl·8 + w·2 + blk. Its K-first words
// are rows 4kt + 2a + trh, columns 64nt + 16w + 8blk + tq. Per (trh, w, blk, tq): a half-word
// transpose over trl, then a byte transpose over the results.
void untile8(const uint32_t* marlin, uint32_t* out, int64_t size_k, int64_t size_n) {
  const int64_t m_cols = 4 * size_n;
  for (int64_t kt = 0; kt < size_k / 16; ++kt) {
    for (int64_t nt = 0; nt < size_n / 64; ++nt) {
      const uint32_t* tile = marlin + kt * m_cols + nt * 256;
      for (int trh = 0; trh < 2; ++trh) {
        uint32_t* a0 = out + (4 * kt + trh) * size_n + nt * 64;
        uint32_t* a1 = a0 + 2 * size_n;
        for (int w = 0; w < 4; ++w)
          for (int blk = 0; blk < 2; ++blk) {
            const uint32_t* first = tile + trh * 16 + w * 2 + blk;
            Lanes lo, hi;
            gather8(lo, first, 32);
            gather8(hi, first + 8, 32);
            transpose_fields<16>(lo, hi);
            transpose_fields<8>(lo, hi);  // lo: a = 0, hi: a = 1
            store8(a0 + w * 16 + blk * 8, lo);
            store8(a1 + w * 16 + blk * 8, hi);
          }
      }
    }
  }
}

}  // namespace

extern "C" {

WNA16_API int wna16_marlin_untile_host(const int32_t* marlin, int32_t* out, int64_t num_experts,
                                       int64_t size_k, int64_t size_n, int num_bits) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  const int64_t words = size_k * size_n / (32 / num_bits);  // per expert, both sides
  for (int64_t ex = 0; ex < num_experts; ++ex) {
    const uint32_t* m = (const uint32_t*)marlin + ex * words;
    uint32_t* o = (uint32_t*)out + ex * words;
    if (num_bits == 4)
      untile4(m, o, size_k, size_n);
    else
      untile8(m, o, size_k, size_n);
  }
  return WNA16_OK;
}

}  // extern "C"
