// Register dequantisation of Marlin weight words straight into mma.m16n8k16 B fragments.
//
// Why magic numbers: a 16-bit float whose exponent puts the unit in the last mantissa bit turns
// an integer OR-ed into its low mantissa bits into "magic + code" exactly, with no conversion
// instruction. fp16: 0x6400 = 1024 (ulp 1 up to 2047); bf16: 0x4300 = 128 (ulp 1 up to 255).
// Subtracting "magic + zero" (exact) gives code - zero in the activation dtype, and one packed
// multiply by the scale rounds once -- the same value as dtype(code - zero) * scale, the
// contract of the GEMM (capi.h), bit for bit. bf16 has too few mantissa bits for an 8-bit code
// on a 128 magic, so 8-bit bf16 goes through fp32's 2^23 magic (0x4B000000) and a packing
// conversion instead (exact: codes and zeros are integers below 256).
//
// Fragment order (layout.cuh): one 4-bit word of lane t holds, nibble by nibble, the values
// v0..v7 = (r,c) (r+8,c) (r,c+8) (r+8,c+8) (r+1,c) (r+9,c) (r+1,c+8) (r+9,c+8), r = 2(t%4).
// Nibble i and nibble i+4 sit at the same place of the two 16-bit halves, so one mask gives the
// pair (v_i, v_i+4): out[0] = rows (r, r+1) of column c = b[0] of the n8 tile of c, out[1] =
// rows (r+8, r+9) = its b[1], out[2], out[3] the same for column c+8. An 8-bit lane has two
// words (column c, then c+8) whose bytes are rows r, r+8, r+1, r+9.
//
// Uses only the wna16_* intrinsics, so the host build runs this same code in the emulation.
#pragma once

#include <stdint.h>
#include <string.h>

#include "intrinsics.cuh"
#include "layout.cuh"

#if defined(__CUDACC__)
#define WNA16_KDEV __device__ __forceinline__
#else
#define WNA16_KDEV inline
#endif

namespace wna16v2 {

constexpr int kF16 = 0;   // WNA16_DTYPE_F16
constexpr int kBF16 = 1;  // WNA16_DTYPE_BF16

WNA16_KDEV float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Packed arithmetic and mma of one activation dtype.
template <int DT>
struct Ops;

template <>
struct Ops<kF16> {
  static WNA16_KDEV uint32_t sub(uint32_t a, uint32_t b) { return wna16_sub_f16x2(a, b); }
  static WNA16_KDEV uint32_t mul(uint32_t a, uint32_t b) { return wna16_mul_f16x2(a, b); }
  static WNA16_KDEV void mma(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    wna16_mma_f16(d, a, b);
  }
  static WNA16_KDEV uint32_t pack(float lo, float hi) { return wna16_float2_to_f16x2(lo, hi); }
};

template <>
struct Ops<kBF16> {
  static WNA16_KDEV uint32_t sub(uint32_t a, uint32_t b) { return wna16_sub_bf16x2(a, b); }
  static WNA16_KDEV uint32_t mul(uint32_t a, uint32_t b) { return wna16_mul_bf16x2(a, b); }
  static WNA16_KDEV void mma(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    wna16_mma_bf16(d, a, b);
  }
  static WNA16_KDEV uint32_t pack(float lo, float hi) { return wna16_float2_to_bf16x2(lo, hi); }
};

// (x & mask) | magic in one lop3.
WNA16_KDEV uint32_t mask_or(uint32_t x, uint32_t mask, uint32_t magic) {
  return wna16_lop3<(0xF0 & 0xCC) | 0xAA>(x, mask, magic);
}

// Quant<DT, NB>: WORDS = words per lane per 16x16 sub-tile, zero_pair(zlo, zhi) = the packed
// value subtracted from the magic pairs for zero points zlo (low half) and zhi, dequant(w, z, s,
// out) = four B-fragment registers from WORDS words, zero pairs z[4] and scale pairs s[4].
template <int DT, int NB>
struct Quant;

// 4-bit: nibble i of both halves, OR-ed into the magic, minus (magic + zero), times the scale.
template <int DT>
struct Quant4 {
  static constexpr int WORDS = 1;
  static constexpr uint32_t kMagic = DT == kF16 ? 0x6400u : 0x4300u;
  static WNA16_KDEV uint32_t zero_pair(int zlo, int zhi) {
    return (kMagic + (uint32_t)zlo) | ((kMagic + (uint32_t)zhi) << 16);
  }
  static WNA16_KDEV void dequant(const uint32_t* w, const uint32_t z[4], const uint32_t s[4],
                                 uint32_t out[4]) {
    const uint32_t magic2 = kMagic | (kMagic << 16);
    const uint32_t x = w[0];
    out[0] = mask_or(x, 0x000F000Fu, magic2);
    out[1] = mask_or(x >> 4, 0x000F000Fu, magic2);
    out[2] = mask_or(x >> 8, 0x000F000Fu, magic2);
    out[3] = mask_or(x >> 12, 0x000F000Fu, magic2);
    WNA16_UNROLL
    for (int i = 0; i < 4; ++i) out[i] = Ops<DT>::mul(Ops<DT>::sub(out[i], z[i]), s[i]);
  }
};

template <>
struct Quant<kF16, 4> : Quant4<kF16> {};
template <>
struct Quant<kBF16, 4> : Quant4<kBF16> {};

// 8-bit fp16: prmt places bytes (0, 2) / (1, 3) under the 0x64 high bytes: 1024 + code.
template <>
struct Quant<kF16, 8> {
  static constexpr int WORDS = 2;
  static WNA16_KDEV uint32_t zero_pair(int zlo, int zhi) {
    return (0x6400u + (uint32_t)zlo) | ((0x6400u + (uint32_t)zhi) << 16);
  }
  static WNA16_KDEV void dequant(const uint32_t* w, const uint32_t z[4], const uint32_t s[4],
                                 uint32_t out[4]) {
    WNA16_UNROLL
    for (int h = 0; h < 2; ++h) {
      out[2 * h] = wna16_prmt(w[h], 0x64646464u, 0x4240u);      // bytes 0, 2: rows r, r+1
      out[2 * h + 1] = wna16_prmt(w[h], 0x64646464u, 0x4341u);  // bytes 1, 3: rows r+8, r+9
    }
    WNA16_UNROLL
    for (int i = 0; i < 4; ++i) out[i] = Ops<kF16>::mul(Ops<kF16>::sub(out[i], z[i]), s[i]);
  }
};

// 8-bit bf16: each byte under fp32's 0x4B000000 (2^23 + code), minus 2^23 (exact), packed to
// bf16 pairs (exact), minus the zero points as bf16 (exact), times the scale.
template <>
struct Quant<kBF16, 8> {
  static constexpr int WORDS = 2;
  static WNA16_KDEV uint32_t zero_pair(int zlo, int zhi) {
    return wna16_float2_to_bf16x2((float)zlo, (float)zhi);
  }
  static WNA16_KDEV void dequant(const uint32_t* w, const uint32_t z[4], const uint32_t s[4],
                                 uint32_t out[4]) {
    WNA16_UNROLL
    for (int h = 0; h < 2; ++h) {
      float f[4];
      WNA16_UNROLL
      for (int i = 0; i < 4; ++i)
        f[i] = bits_to_float(wna16_prmt(w[h], 0x4B000000u, 0x7540u + (uint32_t)i)) - 8388608.0f;
      out[2 * h] = wna16_float2_to_bf16x2(f[0], f[2]);
      out[2 * h + 1] = wna16_float2_to_bf16x2(f[1], f[3]);
    }
    WNA16_UNROLL
    for (int i = 0; i < 4; ++i) out[i] = Ops<kBF16>::mul(Ops<kBF16>::sub(out[i], z[i]), s[i]);
  }
};

}  // namespace wna16v2
