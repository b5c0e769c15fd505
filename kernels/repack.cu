// CUDA Marlin repack, scale permutation and zero-point conversion for many experts per launch.
// The index math is layout.cuh's and the repack's block work is repack.cuh's; these kernels only
// schedule it (the tile kernel writes the same words through RepackTile::lane_tile and
// lane_tile_gather), so the output is bit-identical to the host library and to the torch path. Built by
// nvcc for the GPU and by g++ against the CPU emulation (intrinsics.cuh, kernels/emu/).
#include "capi.h"
#include "checks.h"
#include "intrinsics.cuh"
#include "repack.cuh"

namespace {

using namespace wna16;

int cuda_fail(cudaError_t err, const char* what) {
  return wna16_fail(WNA16_ECUDA, "%s: %s (%s)", what, cudaGetErrorName(err),
                    cudaGetErrorString(err));
}

int launch_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? WNA16_OK : cuda_fail(err, what);
}

// Grids are grid-stride loops; a few waves of blocks per SM are plenty for a copy-like kernel.
int grid_for(int64_t tasks, int per_sm) {
  int dev = 0, sms = 108;
  if (cudaGetDevice(&dev) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t cap = (int64_t)sms * per_sm;
  return (int)(tasks < 1 ? 1 : (tasks < cap ? tasks : cap));
}

template <int NB>
__global__ void __launch_bounds__(kRepackThreads)
    marlin_repack_kernel(const uint32_t* __restrict__ packed, const int32_t* __restrict__ perm,
                         uint32_t* __restrict__ out, int64_t num_experts, int64_t size_k,
                         int64_t size_n) {
  using Tile = RepackTile<NB>;
  WNA16_SHARED_MEMORY(uint4, smem);
  typename Tile::Shared& sh = *reinterpret_cast<typename Tile::Shared*>(smem);
  const int64_t tasks = repack_tasks(num_experts, size_k, size_n);
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const RepackTask t = repack_task(task, size_k, size_n);
    if (perm) {
      Tile::load_perm(perm, t, size_k, sh, threadIdx.x);
      wna16_syncthreads();
    }
    Tile::stage(packed, perm != nullptr, t, size_k, size_n, sh, threadIdx.x, blockDim.x);
    wna16_syncthreads();
    Tile::emit(out, t, size_k, size_n, sh, threadIdx.x, blockDim.x);
    wna16_syncthreads();  // shared rows are rewritten by the next task
  }
}

// One 16x64 tile per group of eight lanes (RepackTile::lane_tile, or lane_tile_gather with
// act-order), tiles taken in output order (tile = row * ntiles + nt, row = expert * K/16 +
// k-tile), grid-stride. The tile's (row, nt) is found by one division before the loop and then
// advanced by the stride's quotient and remainder, so the loop without act-order carries no
// division; the source pointer moves with it: a tile's packed rows start at
// row * ROWS * size_n + 64 * nt. With act-order a tile's perm entries are perm[16 * row ..] and
// its source rows are the expert's (one division per tile for the expert); GATHER = act-order,
// a template argument so that each loop holds one path.
template <int NB, bool GATHER>
__global__ void __launch_bounds__(kRepackThreads)
    marlin_repack_tiles_kernel(const uint32_t* __restrict__ packed,
                               const int32_t* __restrict__ perm, uint32_t* __restrict__ out,
                               int64_t rows, int64_t size_k, int64_t size_n) {
  using Tile = RepackTile<NB>;
  const int64_t ntiles = size_n / 64, tiles = rows * ntiles, ktiles = size_k / 16;
  const int64_t lanes = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int c = (int)(first % Tile::LANES);
  int64_t tile = first / Tile::LANES;
  const int64_t step = lanes / Tile::LANES;  // blockDim.x is a multiple of LANES
  if (tile >= tiles) return;
  const int64_t step_rows = step / ntiles, step_nt = step % ntiles;
  int64_t row = tile / ntiles, nt = tile % ntiles;
  const int64_t row_words = Tile::ROWS * size_n;           // source words per tile row
  const int64_t wrap = row_words - ntiles * 64;            // column ntiles -> next row's 0
  const uint32_t* src = packed + row * row_words + 64 * nt;
  uint32_t* dst = out + tile * Tile::WPT + c * Tile::LANE_WORDS;
  const int64_t src_step = step_rows * row_words + 64 * step_nt, dst_step = step * Tile::WPT;
  for (; tile < tiles; tile += step) {
    if (GATHER) {
      const int64_t ex = row / ktiles;
      Tile::lane_tile_gather(packed + ex * ktiles * row_words + 64 * nt, size_n, perm + 16 * row,
                             size_k, dst, c);
    } else {
      Tile::lane_tile(src, size_n, dst, c);
    }
    dst += dst_step;
    src += src_step;
    row += step_rows;
    nt += step_nt;
    if (nt >= ntiles) nt -= ntiles, src += wrap, ++row;
  }
}

template <typename T>
__global__ void permute_scales_kernel(const T* __restrict__ in, T* __restrict__ out,
                                      int64_t total, int grouped) {
  const int ch = wna16_scale_chunk(grouped);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[(i / ch) * ch + wna16_scale_src(grouped, (int)(i % ch))];
}

template <int NB>
__global__ void zero_points_kernel(const uint32_t* __restrict__ in, uint32_t* __restrict__ out,
                                   int64_t rows, int64_t size_n) {
  constexpr int PF = 32 / NB;
  const int64_t words = size_n / PF, total = rows * words;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t* row = in + (i / words) * words;
    const int64_t w = i % words;
    uint32_t word = 0;
WNA16_UNROLL
    for (int s = 0; s < PF; ++s) {
      const int64_t q = w * PF + s;
      const int64_t from = (q / 64) * 64 + wna16_zp_src(NB, (int)(q % 64));
      word |= wna16_code(row[from / PF], (int)(from % PF), NB) << (NB * s);
    }
    out[i] = word;
  }
}

}  // namespace

extern "C" {

WNA16_API int wna16_cuda_device_info(int device, int32_t* info) {
  static const cudaDeviceAttr attrs[] = {
      cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
      cudaDevAttrMultiProcessorCount,    cudaDevAttrMemoryClockRate,
      cudaDevAttrGlobalMemoryBusWidth,   cudaDevAttrL2CacheSize};
  for (int i = 0; i < 6; ++i) {
    int v = 0;
    const cudaError_t err = cudaDeviceGetAttribute(&v, attrs[i], device);
    if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute");
    info[i] = v;
  }
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  info[6] = rt;
  info[7] = drv;
  return WNA16_OK;
}

WNA16_API int wna16_cuda_marlin_repack(const int32_t* packed, const int32_t* perm, int32_t* out,
                                       int64_t num_experts, int64_t size_k, int64_t size_n,
                                       int num_bits, void* stream) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  const int64_t tasks = repack_tasks(num_experts, size_k, size_n);
  if (tasks == 0) return WNA16_OK;
  const cudaStream_t s = (cudaStream_t)stream;
  // the tile kernel's 16-byte stores need a 16-byte aligned output
  if (((uintptr_t)out & 15) == 0) {
    const int64_t rows = num_experts * (size_k / 16);
    const int64_t blocks = (rows * (size_n / 64) * RepackTile<4>::LANES + kRepackThreads - 1) /
                           kRepackThreads;
    const int grid = grid_for(blocks, 8);
    if (num_bits == 4)
      WNA16_LAUNCH(grid, kRepackThreads, 0, s, (perm ? marlin_repack_tiles_kernel<4, true>
                                                     : marlin_repack_tiles_kernel<4, false>),
                   (const uint32_t*)packed, perm, (uint32_t*)out, rows, size_k, size_n);
    else
      WNA16_LAUNCH(grid, kRepackThreads, 0, s, (perm ? marlin_repack_tiles_kernel<8, true>
                                                     : marlin_repack_tiles_kernel<8, false>),
                   (const uint32_t*)packed, perm, (uint32_t*)out, rows, size_k, size_n);
    return launch_status("marlin_repack_tiles_kernel");
  }
  const int grid = grid_for(tasks, 8);
  if (num_bits == 4)
    WNA16_LAUNCH(grid, kRepackThreads, sizeof(RepackTile<4>::Shared), s, marlin_repack_kernel<4>,
                 (const uint32_t*)packed, perm, (uint32_t*)out, num_experts, size_k, size_n);
  else
    WNA16_LAUNCH(grid, kRepackThreads, sizeof(RepackTile<8>::Shared), s, marlin_repack_kernel<8>,
                 (const uint32_t*)packed, perm, (uint32_t*)out, num_experts, size_k, size_n);
  return launch_status("marlin_repack_kernel");
}

WNA16_API int wna16_cuda_permute_scales(const void* in, void* out, int64_t rows, int64_t size_n,
                                        int elem_bytes, int grouped, void* stream) {
  int rc = wna16_check_scales(size_n, elem_bytes, grouped);
  if (rc) return rc;
  const int64_t total = rows * size_n;
  if (total == 0) return WNA16_OK;
  const cudaStream_t s = (cudaStream_t)stream;
  const int grid = grid_for((total + 255) / 256, 16);
  if (elem_bytes == 2)
    WNA16_LAUNCH(grid, 256, 0, s, permute_scales_kernel<uint16_t>, (const uint16_t*)in,
                 (uint16_t*)out, total, grouped);
  else
    WNA16_LAUNCH(grid, 256, 0, s, permute_scales_kernel<uint32_t>, (const uint32_t*)in,
                 (uint32_t*)out, total, grouped);
  return launch_status("permute_scales_kernel");
}

WNA16_API int wna16_cuda_zero_points(const int32_t* in, int32_t* out, int64_t rows,
                                     int64_t size_n, int num_bits, void* stream) {
  int rc = wna16_check_zp(size_n, num_bits);
  if (rc) return rc;
  const int64_t total = rows * size_n / (32 / num_bits);
  if (total == 0) return WNA16_OK;
  const cudaStream_t s = (cudaStream_t)stream;
  const int grid = grid_for((total + 255) / 256, 16);
  if (num_bits == 4)
    WNA16_LAUNCH(grid, 256, 0, s, zero_points_kernel<4>, (const uint32_t*)in, (uint32_t*)out, rows,
                 size_n);
  else
    WNA16_LAUNCH(grid, 256, 0, s, zero_points_kernel<8>, (const uint32_t*)in, (uint32_t*)out, rows,
                 size_n);
  return launch_status("zero_points_kernel");
}

}  // extern "C"
