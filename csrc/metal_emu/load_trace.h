// Device-memory load tracer of the traced harness build (tests/metal_emu.py, load_traced()).
//
// The kernel translation units of that build are compiled by clang with
// -fsanitize-coverage=inline-8bit-counters,trace-loads: every load instruction calls
// __sanitizer_cov_load<N>(addr) first (load_trace.cpp), and the caller's return address names the
// load site. A load is kept when its address lies in one of the buffers the harness bound for the
// running dispatch (note_buffer: every tensor the bindings hand to a kernel, by name), so stack,
// threadgroup memory and the executor's own data never count. Per threadgroup the tracer logs
// (site, address, width) per Metal thread, and when the threadgroup ends it folds the log into
// per-dispatch totals: per buffer (loads, bytes fetched, how often each byte was fetched) and per
// load site (simdgroup-wide loads: the n-th execution of the site by the 32 lanes of a simdgroup,
// the 64-byte segments they touch and the distinct bytes they use). Memory is bounded by one
// threadgroup's log plus one byte counter per traced buffer byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace metal_emu {
namespace load_trace {

// A tensor the bindings bind to a kernel slot; loads are attributed to it by address.
void note_buffer(const void* data, size_t bytes, const std::string& name);

// Tracing on for the following dispatches (until stop()); at most `max_threadgroups` threadgroups
// of each dispatch run (evenly spread over the grid; 0 = all of them).
void start(uint64_t max_threadgroups);
bool active();

// Called by run_dispatches around each dispatch while tracing: its kernel, grid, threads per
// threadgroup and slot pointers (the params bytes last, traced as "params").
void dispatch_begin(const std::string& kernel, const uint32_t grid[3], uint32_t threads,
                    const std::vector<void*>& slots, size_t params_bytes);
void dispatch_end();

struct SiteStats {
  uint64_t site = 0;           // return address of the load's callback (the load site)
  std::string buffer;          // buffer of its first traced load
  uint32_t width_mask = 0;     // bit w set: some load at this site had width w bytes
  uint64_t lane_loads = 0;     // loads executed by single threads
  uint64_t simd_loads = 0;     // simdgroup-wide loads (n-th execution by the lanes of a simdgroup)
  uint64_t active_lanes = 0;   // sum over simdgroup-wide loads of the lanes taking part
  uint64_t used_bytes = 0;     // sum over simdgroup-wide loads of the distinct bytes read
  uint64_t segments = 0;       // sum over simdgroup-wide loads of the 64-byte segments touched
  uint64_t bytes_fetched = 0;  // sum of the widths of the lane loads
};

struct BufferStats {
  std::string name;
  int slot = -1;               // first kernel slot bound to it (-1: reached only by address)
  uint64_t bytes = 0;          // size of the tensor
  uint64_t lane_loads = 0;
  uint64_t bytes_fetched = 0;
  uint64_t unique_bytes = 0;   // bytes fetched at least once
  uint32_t max_fetches = 0;    // most fetches of one byte (saturates at 255)
  uint64_t refetched_bytes = 0;  // bytes fetched more than once
};

struct DispatchTrace {
  std::string kernel;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threads = 0;
  uint64_t threadgroups = 0;   // in the grid
  uint64_t traced = 0;         // run and traced (sampling: fewer than threadgroups)
  std::vector<BufferStats> buffers;
  std::vector<SiteStats> sites;
  std::string module_path;     // shared object of the load sites (to symbolize them)
  uint64_t module_base = 0;    // its load address: site - module_base is the file offset
};

// Stops tracing and returns one record per dispatch since start().
std::vector<DispatchTrace> stop();

}  // namespace load_trace
}  // namespace metal_emu
