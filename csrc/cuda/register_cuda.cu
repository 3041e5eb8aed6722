// The CUDA backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key CUDA through the op entry points (csrc/ops/op_entries.h).
#include <torch/library.h>

#include "cuda/cuda_backend.h"
#include "ops/op_entries.h"

namespace torch_marlin {

TORCH_LIBRARY_IMPL(marlin, CUDA, m) { register_backend_ops<CudaBackend>(m); }

}  // namespace torch_marlin
