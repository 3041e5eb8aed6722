// What every op's backend-free half (prepare_<family> in csrc/ops/) hands a backend: the checked
// arguments, the allocated output, the plan and the plan's workspace. A backend's binding unit
// (csrc/ops/op_entries.h) runs its kernels on it and decides nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace torch_marlin {

template <class Args, class Plan>
struct PreparedCall {
  Args args;
  at::Tensor out;
  // Null where the family plans nothing for the call (the FP4 / INT4 dequant) or nothing runs.
  std::shared_ptr<const Plan> plan;
  // For this call only, from the caching allocator: under CUDA-graph capture it comes from the
  // graph's pool and is captured with the kernels, so nothing allocated here outlives the call.
  at::Tensor workspace;
  bool empty = false;  // the output has no elements: nothing to run
};

}  // namespace torch_marlin
