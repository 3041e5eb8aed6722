// Planner entries of the rANS op family (gemm_rans, rans_decode; docs/formats.md, "rANS-coded
// 4-bit codes"). Same contract as plan_quant_gemm: portable C++17, no torch; every backend
// executes the plan it is given and never re-decides.
#pragma once

#include <cstdint>
#include <string>

#include "plan/plan.h"
#include "torch_marlin/rans_params.h"

namespace torch_marlin {

// Fused: each tile's codes are decoded and multiplied in one pass (M <= TM_RANS_FUSED_MAX_M).
// Staged: the layer is decoded to B_packed, then multiplied by the dense GEMM of its format.
enum class RansFamily : int { Fused = 0, Staged = 1 };
const char* rans_family_name(RansFamily f);  // "decode" (fused), "staged"

struct RansPlan {
  RansFamily family = RansFamily::Fused;
  DeviceCaps caps;  // what the plan was made for
  LaunchList launches;  // Decode: the fused GEMM, or the decode to B_packed (staged, rans_decode)
  bool cpu_avx2 = false;  // CPU: the AVX2 lane kernel (caps.avx2), else the portable one
  // Staged gemm_rans: the dense GEMM on the decoded B_packed, which runs its own launches after
  // Decode (no launches otherwise).
  GemmPlan gemm;
  RansParams params{};
  uint32_t tile_m = 0;  // CUDA fused: rows of A per kernel (1, 2, 4, 8, 16; M rounded up)
};

// C = channels_per_tile <= 0: the format's default, ceil(32 * 1024 / K).
int64_t rans_default_channels_per_tile(int64_t K);

// C[M,N] = A[M,K] @ dequant(decode(codes))[K,N] (+ bias). Throws std::invalid_argument naming the
// argument for K, N, group_size or channels_per_tile out of the format's range.
RansPlan plan_rans_gemm(int64_t M, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                        QuantFormat format, DType dtype, bool has_bias, const DeviceCaps& caps);

// B_packed[K/8, N] from the codes (rans_decode).
RansPlan plan_rans_decode(int64_t K, int64_t N, int64_t channels_per_tile, const DeviceCaps& caps);

}  // namespace torch_marlin
