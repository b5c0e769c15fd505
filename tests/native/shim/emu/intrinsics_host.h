// Test-only stand-in for the host emulation of intrinsics.cuh, enough for dequant.cuh's ALU
// instructions (lop3, prmt, packed 16-bit arithmetic, conversions), written from the PTX ISA
// definitions. Used by tests/native/dequant_test.cpp when the kernel directory has no emulation
// of its own; the mma entry points exist only so dequant.cuh compiles and abort if called.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

inline float wna16_shim_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline uint32_t wna16_shim_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// fp16 <-> float (float -> fp16 rounds to nearest even: GCC's _Float16 conversion)
inline float wna16_shim_h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline uint16_t wna16_shim_f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
// bf16 <-> float (round to nearest even; inputs here are finite)
inline float wna16_shim_b2f(uint16_t b) { return wna16_shim_f32((uint32_t)b << 16); }
inline uint16_t wna16_shim_f2b(float f) {
  const uint32_t u = wna16_shim_bits(f);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <int LUT>
inline uint32_t wna16_lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
  for (int i = 0; i < 32; ++i) {
    const int idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1);
    d |= (uint32_t)((LUT >> idx) & 1) << i;
  }
  return d;
}

inline uint32_t wna16_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t x = ((uint64_t)b << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) d |= (uint32_t)((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return d;
}

// Products of two 16-bit floats and sums of the small integers used here are exact in fp32, so
// one rounding of the fp32 result is the correctly rounded 16-bit result.
#define WNA16_SHIM_PAIR(name, to_f, from_f, expr)                          \
  inline uint32_t name(uint32_t a, uint32_t b) {                           \
    uint32_t d = 0;                                                        \
    for (int i = 0; i < 2; ++i) {                                          \
      const float x = to_f((uint16_t)(a >> (16 * i)));                    \
      const float y = to_f((uint16_t)(b >> (16 * i)));                     \
      d |= (uint32_t)from_f(expr) << (16 * i);                             \
    }                                                                      \
    return d;                                                              \
  }
WNA16_SHIM_PAIR(wna16_sub_f16x2, wna16_shim_h2f, wna16_shim_f2h, x - y)
WNA16_SHIM_PAIR(wna16_mul_f16x2, wna16_shim_h2f, wna16_shim_f2h, x * y)
WNA16_SHIM_PAIR(wna16_sub_bf16x2, wna16_shim_b2f, wna16_shim_f2b, x - y)
WNA16_SHIM_PAIR(wna16_mul_bf16x2, wna16_shim_b2f, wna16_shim_f2b, x * y)
#undef WNA16_SHIM_PAIR

inline uint32_t wna16_float2_to_f16x2(float lo, float hi) {
  return (uint32_t)wna16_shim_f2h(lo) | ((uint32_t)wna16_shim_f2h(hi) << 16);
}
inline uint32_t wna16_float2_to_bf16x2(float lo, float hi) {
  return (uint32_t)wna16_shim_f2b(lo) | ((uint32_t)wna16_shim_f2b(hi) << 16);
}

inline void wna16_mma_f16(float*, const uint32_t*, const uint32_t*) { abort(); }
inline void wna16_mma_bf16(float*, const uint32_t*, const uint32_t*) { abort(); }
