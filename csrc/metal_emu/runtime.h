// Metal-on-CPU executor: public API used by the harness bindings (bindings.cpp). No MSL macros
// here; the shim (metal_stdlib) is only for the kernel translation unit and runtime.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace metal_emu {

// Order in which the runnable threads of a threadgroup run between two synchronization points.
// A correct kernel gives the same result under every order; a missing barrier usually does not.
//  Forward / Reverse / Random: every runnable thread runs (in that order) until it blocks; then
//    barriers whose participants all arrived are released. Simdgroups move in lockstep.
//  SimdAhead / SimdAheadReverse: a simdgroup's barriers are released as soon as its 32 lanes
//    arrive, so simdgroup 0 (or the last one) runs as far as it can before the others start:
//    exposes a missing threadgroup barrier between simdgroups that lockstep hides.
enum class Schedule : int { Forward = 0, Reverse = 1, Random = 2, SimdAhead = 3, SimdAheadReverse = 4 };

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

// Barrier-switch build only: drop the barrier tagged `name` ("" = drop none). Not thread-safe
// against a running dispatch; set it between dispatches.
void set_dropped_barrier(const std::string& name);

// Stats of the last dispatch on this process (for tests of the executor itself).
struct DispatchStats {
  uint64_t threadgroups = 0;
  uint64_t barrier_rounds = 0;     // threadgroup_barrier releases
  uint64_t simd_rounds = 0;        // simdgroup barrier / collective releases
  uint64_t max_threadgroup_bytes = 0;
};
DispatchStats last_dispatch_stats();

// Load tracing (the traced harness build, load_trace.cpp). While hooks are set, dispatches run on
// one OS thread: `run` decides per threadgroup (linear id, tgid) whether it runs at all (sampling),
// `done` is called after each threadgroup that ran.
struct ThreadgroupHooks {
  bool (*run)(uint64_t linear, const uint32_t tgid[3]) = nullptr;
  void (*done)(unsigned threads) = nullptr;
};
void set_threadgroup_hooks(const ThreadgroupHooks& hooks);
// lid of the Metal thread running on this OS thread; -1 outside a dispatch.
int current_thread_index();

}  // namespace metal_emu
