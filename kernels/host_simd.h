// Vector tile loops of the native rank builder that do not need AVX-512: AVX2 on x86-64, NEON
// (Advanced SIMD) on aarch64, for 4-bit and 8-bit codes. Each builds one projection's Marlin
// weight from the checkpoint's N-first words (column n of K codes at src + n * ld), rows of dst
// out_ld words apart: the same words as the scalar tiles (wna16_marlin_word4/8 in layout.cuh),
// which the tests compare for every level the CPU has. host.cpp chooses among them at run time.
#pragma once

#include <stdint.h>

// CPU support of each level (WNA16_SIMD_* in capi.h), decided once per process.
bool wna16_cpu_has_avx2();
bool wna16_cpu_has_neon();  // (AVX-512 VBMI: have_avx512vbmi in host.cpp)

// Present (and non-empty) only where the target has the instructions: AVX2 on x86-64, NEON on
// aarch64; callers test WNA16_HAVE_AVX2_TILES / WNA16_HAVE_NEON_TILES. size_n is a multiple of
// 64; for wna16_marlin4_nfirst_avx2 size_k is a multiple of 64 (in the rank builder every K is
// another projection's N), for the others of 16.
#if defined(__x86_64__) && defined(__GNUC__)
#define WNA16_HAVE_AVX2_TILES 1
void wna16_marlin4_nfirst_avx2(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld);
void wna16_marlin8_nfirst_avx2(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld);
// dst [cols, rows] (contiguous) = the transpose of the 32-bit src [rows, cols] (rows ld apart), in
// 8 x 8 register tiles: the whole of it for any rows and cols (the edges one word at a time).
void wna16_transpose32_avx2(const uint32_t* src, int64_t ld, int64_t rows, int64_t cols, uint32_t* dst);
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define WNA16_HAVE_NEON_TILES 1
void wna16_marlin4_nfirst_neon(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld);
void wna16_marlin8_nfirst_neon(const uint32_t* src, int64_t ld, int64_t size_k, int64_t size_n, uint32_t* dst,
                               int64_t out_ld);
#endif
