// Metal-on-CPU executor: public API used by the harness bindings (bindings.cpp). No MSL macros
// here; the shim (metal_stdlib) is only for the kernel translation unit and runtime.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace metal_emu {

// Order in which the runnable threads of a threadgroup run between two synchronization points.
// A correct kernel gives the same result under every order; a missing barrier usually does not.
enum class Schedule : int { Forward = 0, Reverse = 1, Random = 2 };

struct DispatchDesc {
  std::string kernel;                  // registered name (the host_name of the instantiation)
  uint32_t grid[3] = {1, 1, 1};        // threadgroups per grid (dispatchThreadgroups)
  uint32_t threads = 1;                // threads per threadgroup (1-D)
  std::vector<void*> buffers;          // [[buffer(i)]] in order (offsets already applied)
  Schedule schedule = Schedule::Forward;
  uint64_t seed = 0;                   // for Schedule::Random
  int workers = 0;                     // OS threads running threadgroups; 0 = hardware threads
};

// Runs every threadgroup of the grid; throws std::runtime_error on an unknown kernel, a wrong
// buffer count, barrier divergence / deadlock, or threadgroup memory over 32 KiB.
void dispatch(const DispatchDesc& d);

std::vector<std::string> kernel_names();

// Stats of the last dispatch on this process (for tests of the executor itself).
struct DispatchStats {
  uint64_t threadgroups = 0;
  uint64_t barrier_rounds = 0;     // threadgroup_barrier releases
  uint64_t simd_rounds = 0;        // simdgroup barrier / collective releases
  uint64_t max_threadgroup_bytes = 0;
};
DispatchStats last_dispatch_stats();

}  // namespace metal_emu
