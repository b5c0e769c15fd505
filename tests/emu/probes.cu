// Small kernels that exercise one intrinsic each, written only against intrinsics.cuh so that
// they build with nvcc as with g++. The tests run them on the CPU emulation and compare with
// references computed independently in Python (the PTX ISA's fragment tables, torch rounding);
// some are deliberately broken (a missing barrier or wait, an off-by-one read, a divergent
// barrier) to show that the emulation and the sanitizers catch the mistake.
#include <stdint.h>

#include "intrinsics.cuh"

namespace {

__global__ void mma_kernel(int bf16, const uint32_t* a, const uint32_t* b, const float* c,
                           float* d) {
  const int l = threadIdx.x;
  uint32_t ar[4], br[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) ar[i] = a[4 * l + i], acc[i] = c[4 * l + i];
  br[0] = b[2 * l], br[1] = b[2 * l + 1];
  if (bf16) wna16_mma_bf16(acc, ar, br);
  else wna16_mma_f16(acc, ar, br);
  for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
}

// variant 0: x4, 1: x2, 2: x4.trans; offsets: each lane's row address (bytes into shared memory)
__global__ void ldmatrix_kernel(int variant, const uint16_t* src, int n, const int* offsets,
                                uint32_t* out) {
  WNA16_SHARED_MEMORY(uint16_t, sm16);  // names differ: nvcc wants one type per name
  for (int i = threadIdx.x; i < n; i += blockDim.x) sm16[i] = src[i];
  wna16_syncthreads();
  const void* row = reinterpret_cast<const unsigned char*>(sm16) + offsets[threadIdx.x];
  uint32_t r[4] = {0, 0, 0, 0};
  if (variant == 0) wna16_ldmatrix_x4(r, row);
  else if (variant == 1) wna16_ldmatrix_x2(r, row);
  else wna16_ldmatrix_x4_trans(r, row);
  for (int i = 0; i < 4; ++i) out[4 * threadIdx.x + i] = r[i];
}

// out[l] = {shfl(v, arg), shfl_xor(v, arg & 31), ballot(v & 1)}
__global__ void warp_kernel(const uint32_t* v, const int* arg, uint32_t* out) {
  const int l = threadIdx.x;
  out[3 * l] = wna16_shfl(v[l], arg[l]);
  out[3 * l + 1] = wna16_shfl_xor(v[l], arg[0] & 31);
  out[3 * l + 2] = wna16_ballot(v[l] & 1);
}

// lop3 with a run-time LUT: a binary search over the 256 compile-time instances.
// mode 0: lanes below 16 shuffle while the others take a ballot (different collectives);
// 1: lane 3 leaves before the shuffle.
__global__ void bad_warp_kernel(int mode, uint32_t* out) {
  const int l = threadIdx.x;
  if (mode == 1 && l == 3) return;
  out[l] = (mode == 0 && l >= 16) ? wna16_ballot(true) : wna16_shfl((uint32_t)l, 0);
}

template <int LO, int HI>
WNA16_DEV uint32_t lop3_any(int lut, uint32_t a, uint32_t b, uint32_t c) {
  if constexpr (HI - LO == 1) {
    (void)lut;
    return wna16_lop3<LO>(a, b, c);
  } else {
    constexpr int MID = (LO + HI) / 2;
    return lut < MID ? lop3_any<LO, MID>(lut, a, b, c) : lop3_any<MID, HI>(lut, a, b, c);
  }
}

// out[i] = {prmt(a, b, sel), lop3<lut>(a, b, c)} with lut = sel & 255
__global__ void bits_kernel(int n, const uint32_t* a, const uint32_t* b, const uint32_t* c,
                            const uint32_t* sel, uint32_t* out) {
  for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x) {
    out[2 * i] = wna16_prmt(a[i], b[i], sel[i]);
    out[2 * i + 1] = lop3_any<0, 256>((int)(sel[i] & 255), a[i], b[i], c[i]);
  }
}

// Packed 16-bit arithmetic: out[i] = {fma, sub, mul} of (a, b, c), fp16 (bf16 = 0) or bf16.
__global__ void half2_kernel(int bf16, int n, const uint32_t* a, const uint32_t* b,
                             const uint32_t* c, uint32_t* out) {
  for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x) {
    if (bf16) {
      out[3 * i] = wna16_fma_bf16x2(a[i], b[i], c[i]);
      out[3 * i + 1] = wna16_sub_bf16x2(a[i], b[i]);
      out[3 * i + 2] = wna16_mul_bf16x2(a[i], b[i]);
    } else {
      out[3 * i] = wna16_fma_f16x2(a[i], b[i], c[i]);
      out[3 * i + 1] = wna16_sub_f16x2(a[i], b[i]);
      out[3 * i + 2] = wna16_mul_f16x2(a[i], b[i]);
    }
  }
}

// fp32 pairs -> packed 16-bit (rounded) and the packed value widened back.
__global__ void convert_kernel(int bf16, int n, const float* x, uint32_t* packed, float* wide) {
  for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x) {
    const uint32_t p = bf16 ? wna16_float2_to_bf16x2(x[2 * i], x[2 * i + 1])
                            : wna16_float2_to_f16x2(x[2 * i], x[2 * i + 1]);
    const float2 w = bf16 ? wna16_bf16x2_to_float2(p) : wna16_f16x2_to_float2(p);
    packed[i] = p;
    wide[2 * i] = w.x, wide[2 * i + 1] = w.y;
  }
}

// Each thread stages 16-byte chunk tid with cp.async (odd chunks with pred false when zfill),
// then reads its neighbour's chunk. mode 0: wait before the barrier (correct); 1: the wait comes
// only after the reads (broken: the neighbour's data is not there yet); 2: the thread changes
// its source between the issue and the wait (broken: a write races with the copy in flight).
// Modes 3 and 4 reuse the buffer: a plain store and a barrier, the neighbour's chunk read, then
// a cp.async into the chunk just read -- 4 with a barrier between the reads and the copy
// (correct), 3 without (broken: the copy may land while the neighbour still reads).
__global__ void cp_async_kernel(int mode, int zfill, const uint4* src, uint4* out) {
  WNA16_SHARED_MEMORY(uint4, sm_chunks);
  const int t = threadIdx.x, n = blockDim.x;
  if (mode >= 3) {
    sm_chunks[t] = src[t];
    wna16_syncthreads();
    out[t] = sm_chunks[(t + 1) % n];
    if (mode == 4) wna16_syncthreads();
    wna16_cp_async16(&sm_chunks[t], &src[(t + 1) % n]);
    wna16_cp_async_commit();
    wna16_cp_async_wait<0>();
    return;
  }
  wna16_cp_async16(&sm_chunks[t], &src[t], !(zfill && (t & 1)));
  wna16_cp_async_commit();
  if (mode == 2) const_cast<uint4*>(src)[t].x += 1;
  if (mode == 0 || mode == 2) wna16_cp_async_wait<0>();
  wna16_syncthreads();
  out[t] = sm_chunks[(t + 1) % n];
  if (mode == 1) wna16_cp_async_wait<0>();
}

// Two blocks of one thread: block 1 writes data[0..n) and raises *flag, block 0 waits for the
// flag and copies data to out. mode 0: st.release / ld.acquire (correct); 1: a relaxed atomicAdd
// on both sides (broken: nothing orders the data); 2: a fence before the relaxed raise and after
// the relaxed wait (correct).
__global__ void flag_kernel(int mode, int n, int* data, int* flag, int* out) {
  if (blockIdx.x == 1) {
    for (int i = 0; i < n; ++i) data[i] = 1000 + i;
    if (mode == 0) wna16_store_release(flag, 1);
    if (mode == 2) wna16_threadfence();
    if (mode != 0) wna16_atomic_add(flag, 1);
    return;
  }
  if (mode == 0) {
    while (wna16_load_acquire(flag) == 0) {
    }
  } else {
    while (wna16_atomic_add(flag, 0) == 0) {
    }
  }
  if (mode == 2) wna16_threadfence();
  for (int i = 0; i < n; ++i) out[i] = data[i];
}

// The order in which the blocks of a launch start: out[k] = the k-th block to start.
__global__ void order_kernel(int* counter, int* out) {
  if (threadIdx.x == 0) out[wna16_atomic_add(counter, 1)] = (int)blockIdx.x;
}

// mode 0: shared write, barrier, neighbour read; 1: the barrier removed (a data race);
// 2: no write at all (the read sees the poison pattern); 3: thread 0 returns before the barrier.
__global__ void smem_kernel(int mode, const uint32_t* src, uint32_t* out) {
  WNA16_SHARED_MEMORY(uint32_t, sm);
  const int t = threadIdx.x, n = blockDim.x;
  if (mode == 3 && t == 0) return;
  if (mode != 2) sm[t] = src[t];
  if (mode != 1) wna16_syncthreads();
  out[t] = sm[(t + 1) % n];
}

// mode 0: out[t] = src[t]; 1: src[t + 1], one element past the end for the last thread.
__global__ void offbyone_kernel(int mode, const uint32_t* src, uint32_t* out) {
  const int t = threadIdx.x;
  out[t] = src[t + (mode == 1 ? 1 : 0)];
}

// Every thread of a 3-D grid of 3-D blocks records its indices and the dimensions it sees.
__global__ void dims_kernel(int* out) {
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int* o = out + 12 * (b * (int)(blockDim.x * blockDim.y * blockDim.z) + t);
  const int v[12] = {(int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z, (int)blockIdx.x,
                     (int)blockIdx.y,  (int)blockIdx.z,  (int)blockDim.x,  (int)blockDim.y,
                     (int)blockDim.z,  (int)gridDim.x,   (int)gridDim.y,   (int)gridDim.z};
  for (int i = 0; i < 12; ++i) o[i] = v[i];
}

int status() { return (int)cudaGetLastError(); }

}  // namespace

extern "C" {

int wna16_probe_mma(int bf16, const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  WNA16_LAUNCH(1, 32, 0, nullptr, mma_kernel, bf16, a, b, c, d);
  return status();
}
int wna16_probe_ldmatrix(int variant, const uint16_t* src, int n, const int* offsets,
                         uint32_t* out) {
  WNA16_LAUNCH(1, 32, n * 2, nullptr, ldmatrix_kernel, variant, src, n, offsets, out);
  return status();
}
int wna16_probe_warp(const uint32_t* v, const int* arg, uint32_t* out) {
  WNA16_LAUNCH(1, 32, 0, nullptr, warp_kernel, v, arg, out);
  return status();
}
int wna16_probe_bits(int n, const uint32_t* a, const uint32_t* b, const uint32_t* c,
                     const uint32_t* sel, uint32_t* out) {
  WNA16_LAUNCH(4, 128, 0, nullptr, bits_kernel, n, a, b, c, sel, out);
  return status();
}
int wna16_probe_half2(int bf16, int n, const uint32_t* a, const uint32_t* b, const uint32_t* c,
                      uint32_t* out) {
  WNA16_LAUNCH(4, 128, 0, nullptr, half2_kernel, bf16, n, a, b, c, out);
  return status();
}
int wna16_probe_convert(int bf16, int n, const float* x, uint32_t* packed, float* wide) {
  WNA16_LAUNCH(4, 128, 0, nullptr, convert_kernel, bf16, n, x, packed, wide);
  return status();
}
int wna16_probe_cp_async(int mode, int zfill, int n, const void* src, void* out) {
  WNA16_LAUNCH(1, n, n * 16, nullptr, cp_async_kernel, mode, zfill, (const uint4*)src, (uint4*)out);
  return status();
}
int wna16_probe_flag(int mode, int n, int* data, int* flag, int* out) {
  WNA16_LAUNCH(2, 1, 0, nullptr, flag_kernel, mode, n, data, flag, out);
  return status();
}
int wna16_probe_order(int blocks, int* counter, int* out) {
  WNA16_LAUNCH(blocks, 32, 0, nullptr, order_kernel, counter, out);
  return status();
}
int wna16_probe_smem(int mode, int n, const uint32_t* src, uint32_t* out) {
  WNA16_LAUNCH(1, n, n * 4, nullptr, smem_kernel, mode, src, out);
  return status();
}
// The smem kernel (mode 0) on n threads with `bytes` of dynamic shared memory, after raising the
// kernel's limit to `optin` bytes when optin > 0: what the launch and the attribute call answer.
int wna16_probe_smem_limit(int n, int bytes, int optin, const uint32_t* src, uint32_t* out) {
  if (optin > 0) {
    const cudaError_t err =
        cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    if (err != cudaSuccess) return 1000 + (int)err;
  }
  WNA16_LAUNCH(1, n, bytes, nullptr, smem_kernel, 0, src, out);
  return status();
}
int wna16_probe_bad_warp(int mode, uint32_t* out) {
  WNA16_LAUNCH(1, 32, 0, nullptr, bad_warp_kernel, mode, out);
  return status();
}
int wna16_probe_dims(int* out) {
  WNA16_LAUNCH(dim3(2, 3, 2), dim3(4, 2, 3), 0, nullptr, dims_kernel, out);
  return status();
}
int wna16_probe_offbyone(int mode, int n, const uint32_t* src, uint32_t* out) {
  WNA16_LAUNCH(1, n, 0, nullptr, offbyone_kernel, mode, src, out);
  return status();
}

}  // extern "C"
