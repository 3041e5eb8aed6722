// CPU geometry of the rANS family (csrc/cpu/rans_codec.cpp, rans_gemm.cpp): one task per tile; the
// AVX2 lane decoder where caps.avx2, else the portable one.
#include "plan/rans_plan_backends.h"

namespace torch_marlin {

void plan_rans_gemm_cpu(RansPlan& p, const DeviceCaps& caps) {
  p.cpu_avx2 = caps.avx2 != 0;
  const std::string kernel = std::string(p.family == RansFamily::Fused ? "cpu_rans_gemm" : "cpu_rans_decode") +
                             (p.cpu_avx2 ? "_avx2" : "");
  p.launches[LaunchRole::Decode] = rans_tile_launch(kernel, p.params, Backend::CPU);
}

void plan_rans_decode_cpu(RansPlan& p, const DeviceCaps& caps) {
  p.cpu_avx2 = caps.avx2 != 0;
  p.launches[LaunchRole::Decode] =
      rans_tile_launch(p.cpu_avx2 ? "cpu_rans_decode_avx2" : "cpu_rans_decode", p.params, Backend::CPU);
}

}  // namespace torch_marlin
