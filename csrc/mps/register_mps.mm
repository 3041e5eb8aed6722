// The MPS backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key MPS through the op entry points (csrc/ops/op_entries.h).
#ifdef TM_WITH_MPS

#include <torch/library.h>

#include "mps/mps_backend.h"
#include "ops/op_entries.h"

namespace torch_marlin {

DeviceCaps MpsBackend::caps(const at::Device&) { return mps_device_caps(); }

TORCH_LIBRARY_IMPL(marlin, MPS, m) {
  m.impl("_device_caps", &device_caps_entry<MpsBackend>);
  m.impl("gemm_fp4", &gemm_fp4<MpsBackend>);
  m.impl("gemm_u4", &gemm_u4<MpsBackend>);
  m.impl("gemm_affine", &gemm_affine<MpsBackend>);
  m.impl("dequant_fp4", &dequant_fp4<MpsBackend>);
  m.impl("dequant_u4", &dequant_u4<MpsBackend>);
  m.impl("dequant_affine", &dequant_affine<MpsBackend>);
  m.impl("gemm_trellis", &gemm_trellis<MpsBackend>);
  m.impl("dequant_trellis", &dequant_trellis<MpsBackend>);
  m.impl("moe_trellis", &moe_trellis<MpsBackend>);
  m.impl("rans_decode", &rans_decode<MpsBackend>);
  m.impl("gemm_rans", &gemm_rans<MpsBackend>);
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
