// The layout every op hands its kernels: contiguous, with the first element on a 16-byte boundary
// of its storage. The Metal kernels read activations, packed weights, scales, zero points, trellis
// indices and su in 16-byte vectors (uint4, half4 / float4), which Metal wants aligned; every
// allocation is, so only a view that starts mid-vector (a slice at an odd offset) is copied. The
// Metal-on-CPU harness bindings prepare their tensors with the same function.
#pragma once

#include <ATen/ATen.h>

namespace torch_marlin {

constexpr int64_t kVectorAlignment = 16;

inline at::Tensor contiguous_aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return (c.storage_offset() * c.element_size()) % kVectorAlignment == 0 ? c : c.clone();
}

}  // namespace torch_marlin
