// Metal plans of the rANS op family (gemm_rans, rans_decode; metal/rans.metal). Same contract as
// plan_quant_gemm: portable C++17, no torch; the MPS encoder and the Metal-on-CPU harness execute
// the plan and never re-decide.
#pragma once

#include <cstdint>
#include <string>

#include "plan/plan.h"
#include "torch_marlin/rans_params.h"

namespace torch_marlin {

// One kernel launch: name, grid (threadgroups) and threads per threadgroup.
struct RansLaunch {
  std::string kernel;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threads[3] = {1, 1, 1};
};

struct RansMetalPlan {
  // Decode (M <= kDecodeMaxM): rans_gemv_m<R>_<fmt>_<dtype>, the decode fused with the GEMV.
  // Otherwise the family of `gemm`: rans_decode_packed into a temporary B_packed [K/8, N]
  // (decoded_bytes), then the FP4 / INT4 prefill GEMM planned by plan_quant_gemm on it.
  KernelFamily family = KernelFamily::Decode;
  uint32_t rows = 0;       // Decode: R, the power of two >= M the kernel keeps accumulators for
  RansLaunch decode;       // rans_gemv_* or rans_decode_packed: one simdgroup per tile
  GemmPlan gemm;           // the prefill GEMM on the decoded codes (family != Decode)
  size_t decoded_bytes = 0;
  RansParams params{};
};

// Launch parameters of a coded layer; throws std::invalid_argument naming the argument (K a
// positive multiple of 32, group_size a multiple of 32 dividing K, channels_per_tile positive,
// 32-bit Metal indices). n_words = len(words).
RansParams rans_metal_params(int64_t M, int64_t K, int64_t N, int64_t group_size, QuantFormat format,
                             int64_t channels_per_tile, bool has_bias, int64_t n_words);

// C[M,N] = A[M,K] @ dequant(decode(words))[K,N] (+ bias). `force` Decode or a Metal prefill family
// overrides the policy (Decode with M > kDecodeMaxM is rejected).
RansMetalPlan plan_rans_gemm_metal(int64_t M, int64_t K, int64_t N, int64_t group_size, QuantFormat format,
                                   DType dtype, int64_t channels_per_tile, bool has_bias, int64_t n_words,
                                   const DeviceCaps& caps, KernelFamily force = KernelFamily::Auto);

// B_packed[K/8, N] = decode(words): rans_decode_packed.
RansMetalPlan plan_rans_decode_metal(int64_t K, int64_t N, int64_t channels_per_tile, int64_t n_words);

}  // namespace torch_marlin
