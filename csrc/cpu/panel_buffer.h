// Reusable per-thread fp32 buffer of the CPU prefill paths (dequantized weight chunks).
#pragma once

#include <cstddef>
#include <memory>

namespace torch_marlin {

// Kept per calling thread and only grows: first-touch page faults of a fresh multi-MB allocation
// cost more than the dequant itself on small VMs.
inline float* panel_buffer(size_t floats) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local size_t cap = 0;
  if (floats > cap) {
    buf.reset(new float[floats]);
    cap = floats;
  }
  return buf.get();
}

}  // namespace torch_marlin
