// CUDA geometry of the rANS family (csrc/cuda/rans.cu): TM_CUDA_RANS_WARPS warps per block, one
// tile each.
#include "plan/rans_plan_backends.h"

namespace torch_marlin {
namespace {

KernelLaunch cuda_launch(const std::string& kernel, const RansParams& p) {
  KernelLaunch l;
  l.kernel = kernel;
  l.grid[0] = (p.tiles + TM_CUDA_RANS_WARPS - 1u) / TM_CUDA_RANS_WARPS;
  l.threads[0] = TM_CUDA_RANS_WARPS * TM_RANS_LANES;
  return l;
}

}  // namespace

void plan_rans_gemm_cuda(RansPlan& p, int64_t M, QuantFormat format, DType dtype) {
  if (p.family == RansFamily::Fused) {
    p.tile_m = rans_fused_rows(M);
    const std::string kernel = std::string("gemm_rans_") + format_name(format) + "_" + dtype_name(dtype) + "_m" +
                               std::to_string(p.tile_m);
    p.launches[LaunchRole::Decode] = cuda_launch(kernel, p.params);
  } else {
    p.launches[LaunchRole::Decode] = cuda_launch("rans_decode", p.params);
  }
}

void plan_rans_decode_cuda(RansPlan& p) { p.launches[LaunchRole::Decode] = cuda_launch("rans_decode", p.params); }

}  // namespace torch_marlin
