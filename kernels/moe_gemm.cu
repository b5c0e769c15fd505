// Launcher of the MoE GEMM over Marlin-layout WNA16 weights (W4A16 / W8A16, fp16 or bf16
// activations, fp32 accumulation, tokens grouped per expert). The tile algorithm lives in
// moe_gemm.cuh. Every device intrinsic comes from intrinsics.cuh, so this same file is built by
// nvcc for the GPU and by g++ against the CPU emulation (kernels/emu/) that the tests run.
//
// Correctness first: not vLLM's Marlin kernel and no attempt at its speed -- no cp.async
// pipeline, no split-K, every weight code decoded through layout.cuh's generic map. The product
// runs on tensor cores (mma.sync m16n8k16, sm80+) or, as a cross-check of the mma fragment
// mapping, as a plain fp32 FMA loop over the same shared tiles (variant argument). It stays as
// the simple reference the faster kernels are tested against.
#include <type_traits>

#include "capi.h"
#include "checks.h"
#include "intrinsics.cuh"
#include "moe_gemm.cuh"

namespace wna16 {

// 16-bit activation storage; the arithmetic goes through intrinsics.cuh's conversions
// (fp32 -> 16 bit rounds to nearest even).
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

template <>
struct Num<F16> {
  static WNA16_DEV float to_float(F16 x) { return wna16_f16x2_to_float2(x.bits).x; }
  static WNA16_DEV F16 from_float(float x) {
    return F16{(uint16_t)(wna16_float2_to_f16x2(x, 0.f) & 0xffffu)};
  }
};
template <>
struct Num<BF16> {
  static WNA16_DEV float to_float(BF16 x) { return wna16_bf16x2_to_float2(x.bits).x; }
  static WNA16_DEV BF16 from_float(float x) {
    return BF16{(uint16_t)(wna16_float2_to_bf16x2(x, 0.f) & 0xffffu)};
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
WNA16_DEV void mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)d, (void)a, (void)b;
  __trap();  // the launcher never selects mma below sm80
#else
  if constexpr (std::is_same<T, F16>::value) wna16_mma_f16(d, a, b);
  else wna16_mma_bf16(d, a, b);
#endif
}

__global__ void tile_prefix_kernel(const GemmArgs p, int32_t* ws, int bm) {
  if (blockIdx.x == 0 && threadIdx.x == 0) tile_prefix(p, ws, bm);
}

template <typename T, int NB, int BM, bool MMA>
__global__ void __launch_bounds__(kThreads) moe_wna16_kernel(const GemmArgs p) {
  using Tile = MoeTile<T, NB, BM, MMA>;
  WNA16_SHARED_MEMORY(uint4, smem);
  typename Tile::Shared& sh = *reinterpret_cast<typename Tile::Shared*>(smem);
  const int tid = threadIdx.x;
  const int64_t total = work_count(p);

  for (int64_t work = blockIdx.x; work < total; work += gridDim.x) {
    const WorkItem w = locate<BM>(p, work);
    wna16_syncthreads();  // the previous work item is done with the shared tiles
    Tile::load_slots(p, w, sh, tid);
    float acc[Tile::ACC];
WNA16_UNROLL
    for (int i = 0; i < Tile::ACC; ++i) acc[i] = 0.f;

    for (int64_t k0 = 0; k0 < p.size_k; k0 += kBK) {
      const int kb = (int)(p.size_k - k0 < kBK ? p.size_k - k0 : kBK);  // multiple of 16
      wna16_syncthreads();  // previous step consumed; slots visible
      if (p.perm) {
        Tile::load_kperm(p, w, sh, tid, k0, kb);
        wna16_syncthreads();
      }
      Tile::load_a(p, w, sh, tid, k0, kb);
      Tile::decode_b(p, w, sh, tid, k0, kb);
      wna16_syncthreads();
      if constexpr (MMA) {
        for (int ks = 0; ks < kb; ks += 16) {
          uint32_t af[Tile::MI][4];
          Tile::frag_a(sh, tid, ks, af);
WNA16_UNROLL
          for (int ni = 0; ni < Tile::NI; ++ni) {
            uint32_t bf[2];
            if (!Tile::frag_b(sh, tid, ks, ni, w.ncols, bf)) continue;  // warp-uniform
WNA16_UNROLL
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
template <typename T, int NB, int BM, bool MMA>
void launch_tile(const GemmArgs& p, int grid, cudaStream_t s) {
  constexpr size_t smem = sizeof(typename MoeTile<T, NB, BM, MMA>::Shared);
  static_assert(smem <= 48 * 1024, "the tiles fit the default dynamic shared memory");
  WNA16_LAUNCH(grid, kThreads, smem, s, (moe_wna16_kernel<T, NB, BM, MMA>), p);
}

template <typename T, int NB>
void launch_typed(const GemmArgs& p, int bm, bool mma, int grid, cudaStream_t s) {
  if (!mma) launch_tile<T, NB, 16, false>(p, grid, s);
  else if (bm == 16) launch_tile<T, NB, 16, true>(p, grid, s);
  else launch_tile<T, NB, 64, true>(p, grid, s);
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
  WNA16_LAUNCH(1, 32, 0, s, tile_prefix_kernel, p, workspace, bm);
  if ((err = cudaGetLastError()) != cudaSuccess) return cuda_fail(err, "tile_prefix_kernel");

  // Upper bound of the work items (the exact count lives on the device); extra blocks exit.
  const int64_t work = ((num_sorted + bm - 1) / bm + num_experts) * n_tiles(p);
  const int64_t cap = (int64_t)sms * 8;
  const int grid = (int)(work < cap ? work : cap);
  if (dtype == WNA16_DTYPE_F16) {
    if (num_bits == 4) launch_typed<F16, 4>(p, bm, mma, grid, s);
    else launch_typed<F16, 8>(p, bm, mma, grid, s);
  } else {
    if (num_bits == 4) launch_typed<BF16, 4>(p, bm, mma, grid, s);
    else launch_typed<BF16, 8>(p, bm, mma, grid, s);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return cuda_fail(err, "moe_wna16_kernel");
  return WNA16_OK;
}
