// Helpers shared by the harness bindings of the op families (bindings.cpp, trellis_bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <string>

#include "plan/plan.h"
#include "runtime.h"

namespace torch_marlin {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat: return DType::F32;
    default: TORCH_CHECK_TYPE(false, "activations must be float16, bfloat16 or float32, got ", t.scalar_type());
  }
}

inline metal_emu::Schedule parse_schedule(const std::string& s) {
  if (s == "forward") return metal_emu::Schedule::Forward;
  if (s == "reverse") return metal_emu::Schedule::Reverse;
  if (s == "random") return metal_emu::Schedule::Random;
  if (s == "simd_ahead") return metal_emu::Schedule::SimdAhead;
  if (s == "simd_ahead_reverse") return metal_emu::Schedule::SimdAheadReverse;
  TORCH_CHECK_VALUE(false, "schedule must be forward/reverse/random/simd_ahead/simd_ahead_reverse, got '", s, "'");
}

// Counters of the last dispatch (tests use them to check a kernel really synchronized).
inline py::dict last_stats() {
  const auto s = metal_emu::last_dispatch_stats();
  py::dict d;
  d["threadgroups"] = s.threadgroups;
  d["barrier_rounds"] = s.barrier_rounds;
  d["simd_rounds"] = s.simd_rounds;
  d["max_threadgroup_bytes"] = s.max_threadgroup_bytes;
  return d;
}

}  // namespace torch_marlin
