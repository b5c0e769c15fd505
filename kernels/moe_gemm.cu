// CUDA launcher of the MoE GEMM over Marlin-layout WNA16 weights (W4A16 / W8A16, fp16 or bf16
// activations, fp32 accumulation, tokens grouped per expert). The tile algorithm lives in
// moe_gemm.cuh, shared with the CPU replay in host_gemm.cpp that the tests run.
//
// Correctness first: not vLLM's Marlin kernel and no attempt at its speed -- no cp.async
// pipeline, no split-K, every weight code decoded through layout.cuh's generic map. The product
// runs on tensor cores (mma.sync m16n8k16, sm80+) or, as a cross-check of the mma fragment
// mapping, as a plain fp32 FMA loop over the same shared tiles (variant argument).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "capi.h"
#include "checks.h"
#include "moe_gemm.cuh"

namespace wna16 {

template <>
struct Num<half> {
  static __device__ __forceinline__ float to_float(half x) { return __half2float(x); }
  static __device__ __forceinline__ half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

}  // namespace wna16

namespace {

using namespace wna16;

int cuda_fail(cudaError_t err, const char* what) {
  return wna16_fail(WNA16_ECUDA, "%s: %s (%s)", what, cudaGetErrorName(err),
                    cudaGetErrorString(err));
}

// d += a * b on one m16n8k16 tile (fragment layout: see MoeTile::frag_a).
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b);

template <>
__device__ __forceinline__ void mma_16816<half>(float* d, const uint32_t* a, const uint32_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // the launcher never selects mma below sm80
#endif
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a,
                                                         const uint32_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

__global__ void tile_prefix_kernel(const GemmArgs p, int32_t* ws, int bm) {
  if (blockIdx.x == 0 && threadIdx.x == 0) tile_prefix(p, ws, bm);
}

template <typename T, int NB, int BM, bool MMA>
__global__ void __launch_bounds__(kThreads) moe_wna16_kernel(const GemmArgs p) {
  using Tile = MoeTile<T, NB, BM, MMA>;
  __shared__ __align__(16) typename Tile::Shared sh;
  const int tid = threadIdx.x;
  const int64_t total = work_count(p);

  for (int64_t work = blockIdx.x; work < total; work += gridDim.x) {
    const WorkItem w = locate<BM>(p, work);
    __syncthreads();  // the previous work item is done with the shared tiles
    Tile::load_slots(p, w, sh, tid);
    float acc[Tile::ACC];
#pragma unroll
    for (int i = 0; i < Tile::ACC; ++i) acc[i] = 0.f;

    for (int64_t k0 = 0; k0 < p.size_k; k0 += kBK) {
      const int kb = (int)(p.size_k - k0 < kBK ? p.size_k - k0 : kBK);  // multiple of 16
      __syncthreads();  // previous step consumed; slots visible
      if (p.perm) {
        Tile::load_kperm(p, w, sh, tid, k0, kb);
        __syncthreads();
      }
      Tile::load_a(p, w, sh, tid, k0, kb);
      Tile::decode_b(p, w, sh, tid, k0, kb);
      __syncthreads();
      if constexpr (MMA) {
        for (int ks = 0; ks < kb; ks += 16) {
          uint32_t af[Tile::MI][4];
          Tile::frag_a(sh, tid, ks, af);
#pragma unroll
          for (int ni = 0; ni < Tile::NI; ++ni) {
            uint32_t bf[2];
            if (!Tile::frag_b(sh, tid, ks, ni, w.ncols, bf)) continue;  // warp-uniform
#pragma unroll
            for (int mi = 0; mi < Tile::MI; ++mi)
              mma_16816<T>(&acc[(mi * Tile::NI + ni) * 4], af[mi], bf);
          }
        }
      } else {
        Tile::fma_step(sh, acc, tid, w.ncols, kb);
      }
    }
    Tile::store(p, w, sh, acc, tid);
  }
}

// The FMA variant exists to cross-check the mma path, so it gets one tile shape (fewer
// instantiations keep the build at a few seconds).
template <typename T, int NB>
void launch_typed(const GemmArgs& p, int bm, bool mma, int grid, cudaStream_t s) {
  if (!mma)
    moe_wna16_kernel<T, NB, 16, false><<<grid, kThreads, 0, s>>>(p);
  else if (bm == 16)
    moe_wna16_kernel<T, NB, 16, true><<<grid, kThreads, 0, s>>>(p);
  else
    moe_wna16_kernel<T, NB, 64, true><<<grid, kThreads, 0, s>>>(p);
}

}  // namespace

extern "C" WNA16_API int wna16_cuda_moe_gemm(
    const void* a, const int32_t* b, const void* scales, const int32_t* zp, const int32_t* g_idx,
    const int32_t* perm, const int32_t* sorted_ids, const int32_t* offsets,
    const float* topk_weights, void* c, int32_t* workspace, int64_t num_slots,
    int64_t num_sorted, int64_t num_experts, int64_t size_n, int64_t size_k, int64_t num_groups,
    int top_k, int num_bits, int dtype, int is_k_full, int variant, void* stream) {
  int rc = wna16_check_gemm(a, b, scales, g_idx, perm, sorted_ids, offsets, c, workspace,
                            num_slots, num_experts, size_n, size_k, num_groups, top_k, num_bits,
                            dtype, is_k_full);
  if (rc) return rc;
  if (num_experts == 0 || num_sorted == 0 || size_n == 0 || size_k == 0) return WNA16_OK;

  int dev = 0, major = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return cuda_fail(err, "device query");
  bool mma;
  switch (variant) {
    case WNA16_GEMM_AUTO: mma = major >= 8; break;
    case WNA16_GEMM_FMA: mma = false; break;
    case WNA16_GEMM_MMA:
      if (major < 8)
        return wna16_fail(WNA16_ENOTSUP, "the mma variant needs sm80+, device is sm%d0", major);
      mma = true;
      break;
    default: return wna16_fail(WNA16_EINVAL, "unknown GEMM variant %d", variant);
  }
  if (dtype == WNA16_DTYPE_BF16 && major < 8)
    return wna16_fail(WNA16_ENOTSUP, "bf16 activations need sm80+, device is sm%d0", major);

  const int bm = wna16_gemm_tile_rows(num_sorted, num_experts, mma);
  const cudaStream_t s = (cudaStream_t)stream;
  const GemmArgs p{a, (const uint32_t*)b, scales, (const uint32_t*)zp, g_idx, perm, sorted_ids,
                   offsets, topk_weights, c, workspace, num_slots, num_sorted, num_experts,
                   size_n, size_k, num_groups, top_k, (perm && !is_k_full) ? 1 : 0};
  tile_prefix_kernel<<<1, 32, 0, s>>>(p, workspace, bm);
  if ((err = cudaGetLastError()) != cudaSuccess) return cuda_fail(err, "tile_prefix_kernel");

  // Upper bound of the work items (the exact count lives on the device); extra blocks exit.
  const int64_t work = ((num_sorted + bm - 1) / bm + num_experts) * n_tiles(p);
  const int64_t cap = (int64_t)sms * 8;
  const int grid = (int)(work < cap ? work : cap);
  if (dtype == WNA16_DTYPE_F16) {
    if (num_bits == 4) launch_typed<half, 4>(p, bm, mma, grid, s);
    else launch_typed<half, 8>(p, bm, mma, grid, s);
  } else {
    if (num_bits == 4) launch_typed<__nv_bfloat16, 4>(p, bm, mma, grid, s);
    else launch_typed<__nv_bfloat16, 8>(p, bm, mma, grid, s);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return cuda_fail(err, "moe_wna16_kernel");
  return WNA16_OK;
}
