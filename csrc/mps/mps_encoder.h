// The MPS side of the Metal dispatch description (csrc/plan/metal_dispatch.h): tensors as buffer
// handles and one encoder for a whole dispatch list. Objective-C++ only (csrc/mps/*.mm).
#pragma once

#ifdef TM_WITH_MPS

#import <Metal/Metal.h>

#include <ATen/ATen.h>

#include <stdexcept>

#include "plan/metal_dispatch.h"

namespace torch_marlin {

// A tensor's storage as Metal sees it: the MTLBuffer and the byte offset of the tensor's data.
struct MpsBuffer {
  id<MTLBuffer> buffer;
  NSUInteger offset;
};

MpsBuffer mps_buffer(const at::Tensor& t);

// Encodes the dispatches, in order, on the current MPS stream's compute encoder (one serial
// encoder: each dispatch sees the previous ones' writes). Every pipeline is looked up before
// anything is encoded, so a missing kernel leaves the stream untouched.
void mps_encode(const MetalDispatches<MpsBuffer>& dispatches);

// Runs a dispatch-description function; a plan that disagrees with its buffers (a bug) becomes
// a torch error.
template <class F>
MetalDispatches<MpsBuffer> mps_describe(F&& describe) {
  try {
    return describe();
  } catch (const std::logic_error& e) {
    TORCH_CHECK(false, "torch_marlin: ", e.what());
    throw;
  }
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
