/* C ABI of the wna16ctl kernel libraries, bound from Python with ctypes (wna16ctl/native/ops.py).
 *
 * Two shared libraries are built from kernels/:
 *   libwna16_host  (g++:  host.cpp, error.cpp)                -- CPU Marlin repack, index queries
 *   libwna16_cuda  (nvcc: repack.cu, moe_gemm.cu, moe_gemm_v2.cu, moe_gemm_v3.cu, error.cpp)  -- CUDA kernels
 * The tests also build the CUDA sources with g++ against the CPU emulation of intrinsics.cuh
 * (kernels/emu/), where the wna16_cuda_* functions below run on host memory.
 *
 * Conventions: raw pointers to contiguous row-major buffers, sizes as int64_t, streams as void*
 * (a cudaStream_t; NULL = legacy default stream). Every function returns WNA16_OK or an error code
 * and leaves a one-line message for wna16_last_error() (per thread, per library). No function
 * allocates device memory or synchronises the stream, so launchers are safe inside CUDA graphs.
 *
 * Tensor shapes (E = experts, K = size_k, N = size_n, pf = 32 / num_bits, G = scale groups):
 *   packed   int32 [E, K/pf, N]         K-first ("GPTQ") packed codes, LSB-first along K
 *   perm     int32 [E, K] or NULL       act-order sort indices: Marlin row k is source row perm[k]
 *   marlin   int32 [E, K/16, N*16/pf]   Marlin tile layout (spec §6.4)
 *   scales   2- or 4-byte [E, G, N]     grouped (64-chunk) or channel (32-chunk) perm (§6.5)
 *   zp       int32 [E, G, N/pf]         zero-point codes, Marlin order (§6.6)
 */
#ifndef WNA16_CAPI_H
#define WNA16_CAPI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define WNA16_API __declspec(dllexport)
#else
#define WNA16_API __attribute__((visibility("default")))
#endif

#define WNA16_ABI_VERSION 1

#define WNA16_OK 0
#define WNA16_EINVAL 1  /* bad shape / argument; nothing was launched or written */
#define WNA16_ECUDA 2   /* CUDA runtime error (launch, driver too old, no device) */
#define WNA16_ENOTSUP 3 /* valid request this build does not implement */
#define WNA16_EFAULT 4  /* (host) memory read was gone: a file mapped with wna16_map_file shrank */

#define WNA16_DTYPE_F16 0
#define WNA16_DTYPE_BF16 1

#define WNA16_GEMM_AUTO 0 /* mma.sync on sm80+, else FMA */
#define WNA16_GEMM_FMA 1
#define WNA16_GEMM_MMA 2

WNA16_API int wna16_abi_version(void);
WNA16_API const char* wna16_last_error(void);

/* ---------------------------------------------------------------- host library (CPU) ------ */

/* packed -> marlin for E experts, `num_threads` <= 0 means hardware concurrency. */
WNA16_API int wna16_marlin_repack_host(const int32_t* packed, const int32_t* perm, int32_t* out,
                                       int64_t num_experts, int64_t size_k, int64_t size_n,
                                       int num_bits, int num_threads);
/* The same with explicit strides (in int32 words): source element (e, kw, n) of the K-first
 * view at packed[e*src_stride_e + kw*src_stride_kw + n*src_stride_n] (so the checkpoint's N-first
 * words are read in place), output row (e, kt) at out + e*out_stride_e + kt*out_stride_row.
 * simd: a WNA16_SIMD_* level as for wna16_marlin_rank_host (its vector tile loops serve N-first
 * sources, src_stride_kw == 1, without perm; everything else runs the scalar tiles). */
WNA16_API int wna16_marlin_repack_host_strided(const int32_t* packed, const int32_t* perm, int32_t* out,
                                               int64_t num_experts, int64_t size_k, int64_t size_n,
                                               int num_bits, int64_t src_stride_e, int64_t src_stride_kw,
                                               int64_t src_stride_n, int64_t out_stride_e,
                                               int64_t out_stride_row, int simd, int num_threads);
/* marlin -> packed; with perm, source row perm[k] receives Marlin row k (undoes the gather). */
/* One rank's Marlin tensors for num_experts experts from the checkpoint's N-first tensors, symmetric,
 * no act-order, no tile padding. src holds 6 pointers per expert: gate, up, down weight_packed
 * ([I, H/pf], [I, H/pf], [H, I/pf] int32), then their weight_scale ([I, G13], [I, G13], [H, G2])
 * of scale_bytes each. Outputs are [E, ...] as the repack writes them. simd: a WNA16_SIMD_* level
 * (AUTO: the best this CPU has; a level it lacks: WNA16_ENOTSUP, nothing written). Every level
 * writes the same bytes (the tests compare them). */
WNA16_API int wna16_marlin_rank_host(const void* const* src, int64_t num_experts, int64_t hidden,
                                     int64_t intermediate, int tp, int rank, int num_bits,
                                     int64_t group_size, int load_full_w2, int scale_bytes, int w13_grouped,
                                     int w2_grouped, void* w13, void* w2, void* w13_scale, void* w2_scale,
                                     int simd, int num_threads);
/* The tile loops of wna16_marlin_rank_host. AVX512 (VBMI) runs 8-bit tiles with the AVX2 loop. */
#define WNA16_SIMD_SCALAR 0
#define WNA16_SIMD_AUTO 1
#define WNA16_SIMD_AVX2 2
#define WNA16_SIMD_AVX512 3
#define WNA16_SIMD_NEON 4
/* The level `requested` runs at: AUTO -> the best this CPU (and build) has; a level it lacks -> -1. */
WNA16_API int wna16_simd_level(int requested);
/* Index of the first non-finite of n scales (kind 0 fp16, 1 bf16, 2 fp32), -1 when none. */
WNA16_API int64_t wna16_first_nonfinite(const void* data, int64_t n, int kind);
/* The same over n tensors: the index of the first with a non-finite value (-1 when none, -2 when a
 * mapped page was gone), *at = where. */
WNA16_API int64_t wna16_first_nonfinite_many(const void* const* data, const int64_t* counts, int64_t n,
                                             int kind, int64_t* at);
/* Read-only, shared, populated mapping of [offset, offset + length) of fd (offset page-aligned);
 * NULL with *err = errno when it fails. wna16_marlin_rank_host and wna16_first_nonfinite_many read
 * such mappings safely: a page the file lost meanwhile (truncated) makes them return WNA16_EFAULT
 * (-2 for the latter) instead of the process dying of SIGBUS (run them with num_threads 1). */
WNA16_API void* wna16_map_file(int32_t fd, int64_t offset, int64_t length, int32_t* err);
WNA16_API int wna16_unmap_file(void* addr, int64_t length);
/* pread of n ranges into dsts: -1 when all were read, else the failed range (*err = errno, 0 = EOF). */
WNA16_API int64_t wna16_pread_many(const int32_t* fds, const int64_t* offsets, const int64_t* sizes,
                                   void* const* dsts, int64_t n, int32_t* err);
/* dst [cols, rows] (contiguous) = the transpose of src [rows, cols] (its rows ld elements apart) of
 * elem_bytes 2 or 4 (convert's codes and scales): the AVX2 tiles for 4 bytes where `simd` (a
 * WNA16_SIMD_* level the CPU has) is AVX2 or AVX-512, else blocked scalar copies; the same bytes.
 * src may lie in a wna16_map_file mapping: a page the file lost gives WNA16_EFAULT. */
WNA16_API int wna16_transpose_host(const void* src, int64_t ld, int64_t rows, int64_t cols, void* dst,
                                   int elem_bytes, int simd);
WNA16_API int wna16_marlin_unrepack_host(const int32_t* marlin, const int32_t* perm, int32_t* out,
                                         int64_t num_experts, int64_t size_k, int64_t size_n,
                                         int num_bits, int num_threads);
/* marlin -> K-first for E contiguous experts, one thread (kernels/untile.cpp: written apart from
   the forward's index math, so that verify's round trip through it still checks the forward). */
WNA16_API int wna16_marlin_untile_host(const int32_t* marlin, int32_t* out, int64_t num_experts,
                                       int64_t size_k, int64_t size_n, int num_bits);
/* [rows, N] scales, elem_bytes 2 or 4; inverse != 0 restores the logical order. */
WNA16_API int wna16_permute_scales_host(const void* in, void* out, int64_t rows, int64_t size_n,
                                        int elem_bytes, int grouped, int inverse);
/* [rows, N/pf] packed zero points: plain packed codes -> Marlin order (inverse: back). */
WNA16_API int wna16_zero_points_host(const int32_t* in, int32_t* out, int64_t rows,
                                     int64_t size_n, int num_bits, int inverse);

/* Index queries (tests compare them with the Python layout code).
 * For every Marlin output (kt, col, slot), in that row-major order, the source (k, n). */
WNA16_API int wna16_marlin_src_table(int num_bits, int64_t size_k, int64_t size_n,
                                     int64_t* src_k, int64_t* src_n);
/* For every logical (k, n), row-major: the Marlin (kt, col, slot) it lands in. */
WNA16_API int wna16_marlin_dst_table(int num_bits, int64_t size_k, int64_t size_n, int64_t* kt,
                                     int64_t* col, int32_t* slot);
/* Chunk permutations: scales (64 or 32 entries), zero points (64 entries). */
WNA16_API int wna16_scale_perm_table(int grouped, int32_t* out);
WNA16_API int wna16_zp_perm_table(int num_bits, int32_t* out);

/* ---------------------------------------------------------------- CUDA library ------------ */

WNA16_API int wna16_cuda_device_info(int device, int32_t* info /* [8] */);
/* info: cc_major, cc_minor, sm_count, mem_clock_khz, bus_width_bits, l2_bytes,
 *       runtime_version, driver_version */

WNA16_API int wna16_cuda_marlin_repack(const int32_t* packed, const int32_t* perm, int32_t* out,
                                       int64_t num_experts, int64_t size_k, int64_t size_n,
                                       int num_bits, void* stream);
WNA16_API int wna16_cuda_permute_scales(const void* in, void* out, int64_t rows, int64_t size_n,
                                        int elem_bytes, int grouped, void* stream);
WNA16_API int wna16_cuda_zero_points(const int32_t* in, int32_t* out, int64_t rows,
                                     int64_t size_n, int num_bits, void* stream);

/* MoE GEMM over Marlin weights:
 *   for every expert e and every slot s in sorted_ids[offsets[e] : offsets[e+1]] with s < num_slots:
 *     c[s, :] = (a[s / top_k, :] (columns gathered by perm[e] if perm) @ dequant(b[e]))
 *               * (topk_weights ? topk_weights[s] : 1)
 *   a [num_slots / top_k, K] (fp16/bf16, `dtype`), c [num_slots, N] same dtype; rows of c that no
 *   slot reaches are not written. fp32 accumulation; dequantisation in the activation dtype:
 *   w = dtype(code - zero) * scale, zero = zp ? zp code : 2^(num_bits-1).
 *   Scale group of Marlin row k: perm && !is_k_full -> g_idx[e][k] (global group id);
 *   otherwise k / (K / G) (G == 1: channel-wise). scales/c dtype == a dtype.
 *   workspace: int32[num_experts + 1], scratch owned by the caller.
 */
WNA16_API int wna16_cuda_moe_gemm(const void* a, const int32_t* b, const void* scales,
                                  const int32_t* zp, const int32_t* g_idx, const int32_t* perm,
                                  const int32_t* sorted_ids, const int32_t* offsets,
                                  const float* topk_weights, void* c, int32_t* workspace,
                                  int64_t num_slots, int64_t num_sorted, int64_t num_experts,
                                  int64_t size_n, int64_t size_k, int64_t num_groups, int top_k,
                                  int num_bits, int dtype, int is_k_full, int variant,
                                  void* stream);

/* The fast MoE GEMM (moe_gemm_v2.cu): the contract of wna16_cuda_moe_gemm, sm80+ only, with a
 * larger workspace (tile prefix, stream-K counters and fp32 partial tiles) whose size in int32
 * words wna16_cuda_moe_gemm_v2_workspace gives for the same sizes and variant. variant: AUTO or
 * MMA (tile height from the sorted rows per expert), or 16 / 32 / 64 to force the tile height;
 * FMA -> WNA16_ENOTSUP. Also WNA16_ENOTSUP (nothing launched) for scale groups that are not a
 * multiple of 16 rows or a tile needing more shared memory than the device allows; EINVAL for
 * pointers that are not 16-byte aligned. */
WNA16_API int wna16_cuda_moe_gemm_v2_workspace(int64_t num_sorted, int64_t num_experts,
                                               int64_t size_n, int64_t size_k, int64_t num_groups,
                                               int num_bits, int has_perm, int variant,
                                               int64_t* words);
WNA16_API int wna16_cuda_moe_gemm_v2(const void* a, const int32_t* b, const void* scales,
                                     const int32_t* zp, const int32_t* g_idx, const int32_t* perm,
                                     const int32_t* sorted_ids, const int32_t* offsets,
                                     const float* topk_weights, void* c, int32_t* workspace,
                                     int64_t num_slots, int64_t num_sorted, int64_t num_experts,
                                     int64_t size_n, int64_t size_k, int64_t num_groups,
                                     int top_k, int num_bits, int dtype, int is_k_full,
                                     int variant, void* stream);

/* The v3 MoE GEMM (moe_gemm_v3.cu): one launch, eight warps split over K and N, scale pairs in
 * registers, an evict-first weight stream; the fast mode only: act-order (perm) or scale groups
 * that are not a multiple of 64 rows -> WNA16_ENOTSUP (nothing launched), as are FMA and a tile
 * whose shared memory (it grows with num_experts: the tile prefix) exceeds the device's. Its
 * output equals wna16_cuda_moe_gemm_v2's bit for bit. The workspace (size in int32 words from
 * wna16_cuda_moe_gemm_v3_workspace) holds stream-K counters that must be ZERO before the first
 * call (allocate it zeroed); every call leaves them zero, so a workspace kept between calls on
 * one stream needs no reset. */
WNA16_API int wna16_cuda_moe_gemm_v3_workspace(int64_t num_sorted, int64_t num_experts,
                                               int64_t size_n, int64_t size_k, int64_t num_groups,
                                               int num_bits, int has_perm, int variant,
                                               int64_t* words);
WNA16_API int wna16_cuda_moe_gemm_v3(const void* a, const int32_t* b, const void* scales,
                                     const int32_t* zp, const int32_t* g_idx, const int32_t* perm,
                                     const int32_t* sorted_ids, const int32_t* offsets,
                                     const float* topk_weights, void* c, int32_t* workspace,
                                     int64_t num_slots, int64_t num_sorted, int64_t num_experts,
                                     int64_t size_n, int64_t size_k, int64_t num_groups,
                                     int top_k, int num_bits, int dtype, int is_k_full,
                                     int variant, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* WNA16_CAPI_H */
