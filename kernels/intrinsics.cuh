// Every device intrinsic the kernels use, behind one set of names.
//
// Device build (nvcc): each function is the inline PTX instruction named
// in its comment. Host build (g++): the same names come from emu/intrinsics_host.h, an emulation
// written from the PTX ISA's semantics and fragment tables, run by the host runtime (emu/) that
// executes a launch's blocks and threads on the CPU. The kernels, their launchers and the grid
// math are one source for both builds; only this file differs.
//
// Conventions: 16-bit values travel packed two to a uint32_t (low half = element 0), as mma and
// ldmatrix fragments do. Shared-memory addresses are generic pointers into shared memory.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__)  // nvcc, both its host and device passes

#define WNA16_DEV __device__ __forceinline__

// d += a * b, one m16n8k16 tile, fp32 accumulate.
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
WNA16_DEV void wna16_mma_f16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
WNA16_DEV void wna16_mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

WNA16_DEV uint32_t wna16_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l/8, row l%8.
// ldmatrix.sync.aligned.m8n8.x4.shared.b16
WNA16_DEV void wna16_ldmatrix_x4(uint32_t r[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(wna16_smem_addr(smem_row)));
}

// Two 8x8 b16 matrices (lanes 0-15 supply the row addresses).
// ldmatrix.sync.aligned.m8n8.x2.shared.b16
WNA16_DEV void wna16_ldmatrix_x2(uint32_t r[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(wna16_smem_addr(smem_row)));
}

// The transposed form of ldmatrix_x4.
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
WNA16_DEV void wna16_ldmatrix_x4_trans(uint32_t r[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(wna16_smem_addr(smem_row)));
}

// 16 bytes global -> shared, asynchronously, bypassing L1; pred false writes 16 zero bytes and
// reads nothing (src-size 0), so a tile edge needs no branch.
// cp.async.cg.shared.global [dst], [src], 16, src_size
WNA16_DEV void wna16_cp_async16(void* smem, const void* gmem, bool pred = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(wna16_smem_addr(smem)), "l"(gmem), "r"(pred ? 16 : 0));
}

// An L2 cache policy that marks the lines it is attached to for eviction first: data read once
// (a weight stream) then leaves the L2 to data that is read again (activations, partials).
// createpolicy.fractional.L2::evict_first.b64 policy, 1.0
// Not volatile: a pure function of nothing, so the compiler makes it once outside a loop (in
// uniform registers) instead of once per call.
WNA16_DEV uint64_t wna16_l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// wna16_cp_async16 with an L2 cache policy (wna16_l2_evict_first_policy) on the global read.
// cp.async.cg.shared.global.L2::cache_hint [dst], [src], 16, src_size, policy
WNA16_DEV void wna16_cp_async16_hint(void* smem, const void* gmem, bool pred, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               :: "r"(wna16_smem_addr(smem)), "l"(gmem), "r"(pred ? 16 : 0), "l"(policy));
}

// cp.async.commit_group
WNA16_DEV void wna16_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N of this thread's committed groups are pending. The memory clobber keeps
// the compiler from hoisting shared-memory reads of the landed data above the wait.
// cp.async.wait_group N
template <int N>
WNA16_DEV void wna16_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Any three-input bitwise function: LUT is the truth table over (0xF0, 0xCC, 0xAA) = (a, b, c).
// lop3.b32
template <int LUT>
WNA16_DEV uint32_t wna16_lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}

// Byte permute: byte i of the result is byte sel[4i..4i+2] of the 8-byte {b, a} (default mode).
// prmt.b32
WNA16_DEV uint32_t wna16_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm volatile("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Packed two-lane 16-bit arithmetic (round to nearest even).
// fma.rn.f16x2 / sub.rn.f16x2 / mul.rn.f16x2
WNA16_DEV uint32_t wna16_fma_f16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
WNA16_DEV uint32_t wna16_sub_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm volatile("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
WNA16_DEV uint32_t wna16_mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm volatile("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// fma.rn.bf16x2 / sub.rn.bf16x2 / mul.rn.bf16x2 (sm_90 PTX; fma form on sm_80)
WNA16_DEV uint32_t wna16_fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm volatile("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
WNA16_DEV uint32_t wna16_sub_bf16x2(uint32_t a, uint32_t b) {
  // a - b as fma(b, -1, a): sub.bf16x2 needs sm_90, the fma form runs on sm_80 as well
  return wna16_fma_bf16x2(b, 0xBF80BF80u, a);
}
WNA16_DEV uint32_t wna16_mul_bf16x2(uint32_t a, uint32_t b) {
  // a * b as fma(a, b, -0.0): exact, and -0.0 keeps the sign of a zero product
  return wna16_fma_bf16x2(a, b, 0x80008000u);
}

// Warp collectives over all 32 lanes.
WNA16_DEV uint32_t wna16_shfl_xor(uint32_t v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
WNA16_DEV float wna16_shfl_xor_f32(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
WNA16_DEV uint32_t wna16_shfl(uint32_t v, int src_lane) {
  return __shfl_sync(0xffffffffu, v, src_lane);
}
WNA16_DEV uint32_t wna16_ballot(bool pred) { return __ballot_sync(0xffffffffu, pred); }

// x, as a value the compiler cannot see through: computations from it stay where they are
// written instead of being hoisted out of a loop into registers held across it (a code that runs
// once per scale group must not keep its addresses live through the streaming loop).
WNA16_DEV uint32_t wna16_opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Block and warp barriers.
WNA16_DEV void wna16_syncthreads() { __syncthreads(); }
WNA16_DEV void wna16_syncwarp() { __syncwarp(); }

// Global-memory synchronisation between blocks (split-K / stream-K reductions, locks).
WNA16_DEV int wna16_atomic_add(int* p, int v) { return atomicAdd(p, v); }
WNA16_DEV float wna16_atomic_add_f32(float* p, float v) { return atomicAdd(p, v); }
WNA16_DEV int wna16_atomic_cas(int* p, int expected, int desired) {
  return atomicCAS(p, expected, desired);
}
// ld.acquire.gpu / st.release.gpu of one int: the publish/consume pair of a cross-block lock.
WNA16_DEV int wna16_load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
WNA16_DEV void wna16_store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
WNA16_DEV void wna16_threadfence() { __threadfence(); }

// 16-bit <-> fp32 conversions of packed pairs (low half = first value).
// cvt.f32.f16 x2 / cvt.rn.f16x2.f32
WNA16_DEV float2 wna16_f16x2_to_float2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
WNA16_DEV uint32_t wna16_float2_to_f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // no cvt.f16x2 before sm80: two scalar conversions (same result)
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#else
  uint32_t d;
  asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}
// bf16 -> fp32 is a 16-bit shift; cvt.rn.bf16x2.f32
WNA16_DEV float2 wna16_bf16x2_to_float2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
WNA16_DEV uint32_t wna16_float2_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // no cvt.bf16x2 before sm80: cuda_bf16.h's software rounding (same result)
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#else
  uint32_t d;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}

// Dynamic shared memory of the launch (the launch's smem_bytes), 16-byte aligned.
#define WNA16_SHARED_MEMORY(type, name) extern __shared__ __align__(16) type name[]

// Launch `kernel` (parenthesise a template-id with commas) on grid x block with smem_bytes of
// dynamic shared memory on stream. The host build runs it on the CPU emulation instead.
#define WNA16_LAUNCH(grid, block, smem_bytes, stream, kernel, ...)          \
  do {                                                                       \
    auto* wna16_kernel_ = kernel;                                            \
    wna16_kernel_<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__); \
  } while (0)

#else  // host build (g++): the CPU emulation

#include "emu/intrinsics_host.h"

#endif
