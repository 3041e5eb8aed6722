// Metal geometry of the rANS family (metal/rans.metal): one simdgroup per tile. The fused GEMV keeps
// R fp32 accumulators per lane, R the power of two >= M (1, 2, 4, 8, 16), as the FP4 / INT4 decode
// kernels do: a fixed count stays in registers, and M = 1 does not pay for 16.
#include "plan/rans_plan_backends.h"

namespace torch_marlin {
namespace {

// The Metal kernels index A, C, B_packed and the scales with 32-bit unsigned arithmetic.
void check_indices(int64_t M, int64_t K, int64_t N) {
  check_metal_indices({uint64_t(M) * uint64_t(K), uint64_t(M) * uint64_t(N), uint64_t(K / 8) * uint64_t(N)},
                      "plan_rans_gemm");
}

}  // namespace

void plan_rans_gemm_metal(RansPlan& p, int64_t M, int64_t K, int64_t N, QuantFormat format, DType dtype) {
  check_indices(M, K, N);
  if (p.family == RansFamily::Fused) {
    p.tile_m = rans_fused_rows(M);
    const std::string kernel =
        "rans_gemv_m" + std::to_string(p.tile_m) + "_" + format_name(format) + "_" + dtype_name(dtype);
    p.launches[LaunchRole::Decode] = rans_tile_launch(kernel, p.params, Backend::Metal);
  } else {
    p.launches[LaunchRole::Decode] = rans_tile_launch("rans_decode_packed", p.params, Backend::Metal);
  }
}

void plan_rans_decode_metal(RansPlan& p, int64_t K, int64_t N) {
  check_indices(0, K, N);
  p.launches[LaunchRole::Decode] = rans_tile_launch("rans_decode_packed", p.params, Backend::Metal);
}

}  // namespace torch_marlin
