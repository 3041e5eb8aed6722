// The MPS backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key MPS through the op entry points (csrc/ops/op_entries.h).
#ifdef TM_WITH_MPS

#include <torch/library.h>

#include "mps/mps_backend.h"
#include "ops/op_entries.h"

namespace torch_marlin {

DeviceCaps MpsBackend::caps(const at::Device&) { return mps_device_caps(); }

TORCH_LIBRARY_IMPL(marlin, MPS, m) { register_backend_ops<MpsBackend>(m); }

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
