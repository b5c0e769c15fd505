// Argument checks shared by the host and CUDA launchers, so both reject the same inputs with the
// same words (the messages name the rule from the vLLM Marlin kernels they mirror).
#pragma once

#include "error.h"

static inline int wna16_check_bits(int num_bits) {
  if (num_bits != 4 && num_bits != 8)
    return wna16_fail(WNA16_EINVAL, "num_bits = %d is not supported (expected 4 or 8)", num_bits);
  return WNA16_OK;
}

// Marlin tiles are 16 (k) x 64 (n).
static inline int wna16_check_marlin_shape(int64_t num_experts, int64_t size_k, int64_t size_n,
                                           int num_bits) {
  int rc = wna16_check_bits(num_bits);
  if (rc) return rc;
  if (num_experts < 0 || size_k < 0 || size_n < 0)
    return wna16_fail(WNA16_EINVAL, "negative size (experts %lld, size_k %lld, size_n %lld)",
                      (long long)num_experts, (long long)size_k, (long long)size_n);
  if (size_k % 16)
    return wna16_fail(WNA16_EINVAL, "size_k = %lld is not divisible by tile_k_size = 16",
                      (long long)size_k);
  if (size_n % 64)
    return wna16_fail(WNA16_EINVAL, "size_n = %lld is not divisible by tile_n_size = 64",
                      (long long)size_n);
  return WNA16_OK;
}

static inline int wna16_check_scales(int64_t size_n, int elem_bytes, int grouped) {
  if (elem_bytes != 2 && elem_bytes != 4)
    return wna16_fail(WNA16_EINVAL, "scale element size %d is not supported (2 or 4 bytes)",
                      elem_bytes);
  const int chunk = grouped ? 64 : 32;
  if (size_n % chunk)
    return wna16_fail(WNA16_EINVAL, "size_n = %lld is not divisible by the scale chunk %d",
                      (long long)size_n, chunk);
  return WNA16_OK;
}

static inline int wna16_check_zp(int64_t size_n, int num_bits) {
  int rc = wna16_check_bits(num_bits);
  if (rc) return rc;
  if (size_n % 64)
    return wna16_fail(WNA16_EINVAL, "size_n = %lld is not divisible by 64 (zero-point chunk)",
                      (long long)size_n);
  return WNA16_OK;
}

// The GEMM launcher's checks. Mirrors the Marlin MoE kernel's rules
// (spec §6.8): act-order with a full K needs several groups; otherwise groups must tile K.
static inline int wna16_check_gemm(const void* a, const int32_t* b, const void* scales,
                                   const int32_t* g_idx, const int32_t* perm,
                                   const int32_t* sorted_ids, const int32_t* offsets,
                                   const void* c, const int32_t* workspace, int64_t num_slots,
                                   int64_t num_experts, int64_t size_n, int64_t size_k,
                                   int64_t num_groups, int top_k, int num_bits, int dtype,
                                   int is_k_full) {
  int rc = wna16_check_marlin_shape(num_experts, size_k, size_n, num_bits);
  if (rc) return rc;
  if (dtype != WNA16_DTYPE_F16 && dtype != WNA16_DTYPE_BF16)
    return wna16_fail(WNA16_EINVAL, "dtype code %d is not fp16 (0) or bf16 (1)", dtype);
  if (top_k < 1) return wna16_fail(WNA16_EINVAL, "top_k = %d must be >= 1", top_k);
  if (num_slots % top_k)
    return wna16_fail(WNA16_EINVAL, "num_slots = %lld is not a multiple of top_k = %d",
                      (long long)num_slots, top_k);
  if (num_groups < 1) return wna16_fail(WNA16_EINVAL, "num_groups must be >= 1");
  if (!a || !b || !scales || !sorted_ids || !offsets || !c || !workspace)
    return wna16_fail(WNA16_EINVAL, "a required pointer is NULL");
  if ((perm != 0) != (g_idx != 0))
    return wna16_fail(WNA16_EINVAL, "act-order needs both g_idx and perm (or neither)");
  const int gidx_mode = perm && !is_k_full;
  if (perm && is_k_full && num_groups <= 1)
    return wna16_fail(WNA16_EINVAL, "For act_order, num_groups must be > 1");
  if (!gidx_mode && size_k % num_groups)
    return wna16_fail(WNA16_EINVAL, "size_k = %lld, is not divisible by b_scales.size(1) = %lld",
                      (long long)size_k, (long long)num_groups);
  return WNA16_OK;
}

// Few slots per expert (decode): 16-row tiles waste less; prefill-sized groups: 64-row tiles
// reuse each dequantised weight tile four times as often. Only the mma variant has both.
static inline int wna16_gemm_tile_rows(int64_t num_sorted, int64_t num_experts, int mma) {
  return (mma && num_sorted >= 48 * num_experts) ? 64 : 16;
}
