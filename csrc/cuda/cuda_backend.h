// The CUDA backend's interface: CudaBackend (csrc/cuda/register_cuda.cu binds its entries to the
// dispatch key CUDA). Every entry runs on arguments the op checked.
#pragma once

// The Tensor class only (the kernel files include this through kernels.h; all of ATen would cost
// each of them seconds of parsing): the trellis and rANS argument structs are declared, not defined.
#include <ATen/core/Tensor.h>

#include "ops/backend_interface.h"
#include "ops/quant_gemm.h"

namespace torch_marlin {

// The CUDA backend: TM_BACKEND_INTERFACE (csrc/ops/backend_interface.h). caps (launch.cu): SMs, shared
// memory, thread-block clusters and wgmma of the device; FP4 / INT4 / affine INT4 in launch.cu (the
// family the plan names), trellis in trellis_launch.cu, rANS in rans.cu.
struct CudaBackend {
  TM_BACKEND_INTERFACE;
};

}  // namespace torch_marlin
