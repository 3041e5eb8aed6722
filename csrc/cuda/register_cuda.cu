// The CUDA backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key CUDA through the op entry points (csrc/ops/op_entries.h).
#include <torch/library.h>

#include "cuda/cuda_backend.h"
#include "ops/op_entries.h"

namespace torch_marlin {

TORCH_LIBRARY_IMPL(marlin, CUDA, m) {
  m.impl("_device_caps", &device_caps_entry<CudaBackend>);
  m.impl("gemm_fp4", &gemm_fp4<CudaBackend>);
  m.impl("gemm_u4", &gemm_u4<CudaBackend>);
  m.impl("gemm_affine", &gemm_affine<CudaBackend>);
  m.impl("dequant_fp4", &dequant_fp4<CudaBackend>);
  m.impl("dequant_u4", &dequant_u4<CudaBackend>);
  m.impl("dequant_affine", &dequant_affine<CudaBackend>);
  m.impl("gemm_trellis", &gemm_trellis<CudaBackend>);
  m.impl("dequant_trellis", &dequant_trellis<CudaBackend>);
  m.impl("moe_trellis", &moe_trellis<CudaBackend>);
  m.impl("rans_decode", &rans_decode<CudaBackend>);
  m.impl("gemm_rans", &gemm_rans<CudaBackend>);
}

}  // namespace torch_marlin
