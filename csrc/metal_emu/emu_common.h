// Helpers shared by the harness bindings of the op families (bindings.cpp, trellis_bindings.cpp):
// running a Metal dispatch description (csrc/plan/metal_dispatch.h, the list the MPS backend
// encodes) on the CPU executor, and the Python-facing conversions.
#pragma once

// ATen and torch's pybind11 casters, not <torch/extension.h> (all of libtorch's C++ API): half the
// compile time of the Metal-on-CPU harness modules, which the tests build on first use.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/metal_dispatch.h"
#include "plan/plan.h"
#include "runtime.h"
#if defined(TM_EMU_TRACE)
#include "load_trace.h"
#endif

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

// How the executor runs a dispatch list: thread order, its seed, OS threads, and a prefix for the
// kernel names (the barrier-switch copies are registered as "barrier_switch:<name>").
struct RunOpts {
  std::string schedule = "forward";
  uint64_t seed = 0;
  int workers = 0;
  std::string prefix;
};

inline void run_dispatch(const std::string& kernel, const uint32_t grid[3], uint32_t threads,
                         std::vector<void*> buffers, const RunOpts& o) {
  metal_emu::DispatchDesc d;
  d.kernel = o.prefix + kernel;
  for (int i = 0; i < 3; ++i) d.grid[i] = grid[i];
  d.threads = threads;
  d.buffers = std::move(buffers);
  d.schedule = parse_schedule(o.schedule);
  d.seed = o.seed;
  d.workers = o.workers;
  try {
    metal_emu::dispatch(d);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The tensors a call binds, by name: the traced build attributes every load to one of them
// (load_trace.h); elsewhere a no-op.
inline void note_buffers(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
#if defined(TM_EMU_TRACE)
  for (const auto& t : tensors)
    if (t.second != nullptr && t.second->defined())
      metal_emu::load_trace::note_buffer(t.second->data_ptr(), size_t(t.second->nbytes()), t.first);
#else
  (void)tensors;
#endif
}

// Runs the described dispatches in order, as the MPS encoder encodes them: buffers in slot order,
// the params bytes in the last slot.
inline void run_dispatches(const MetalDispatches<void*>& list, const RunOpts& o) {
  for (const MetalDispatch<void*>& d : list) {
    TORCH_CHECK(d.threads[1] == 1 && d.threads[2] == 1, "metal_emu: kernel '", d.kernel,
                "': the executor runs 1-D threadgroups only");
    std::vector<void*> buffers = d.buffers;
    buffers.push_back(const_cast<unsigned char*>(d.params.data()));
#if defined(TM_EMU_TRACE)
    if (metal_emu::load_trace::active()) {
      metal_emu::load_trace::dispatch_begin(d.kernel, d.grid, d.threads[0], buffers, d.params.size());
      try {
        run_dispatch(d.kernel, d.grid, d.threads[0], buffers, o);
      } catch (...) {
        metal_emu::load_trace::dispatch_end();
        throw;
      }
      metal_emu::load_trace::dispatch_end();
      continue;
    }
#endif
    run_dispatch(d.kernel, d.grid, d.threads[0], std::move(buffers), o);
  }
}

// Turns a plan-vs-buffers mismatch or a planner rejection into the Python exception the op raises.
template <class F>
auto described(F f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::logic_error& e) {
    TORCH_CHECK(false, e.what());
  }
  throw std::logic_error("unreachable");
}

// A description over buffer names (tests compare it with the kernels' [[buffer(i)]] declarations).
inline py::list dispatches_to_py(const MetalDispatches<std::string>& list) {
  py::list out;
  for (const MetalDispatch<std::string>& d : list) {
    py::dict x;
    x["kernel"] = d.kernel;
    x["grid"] = py::make_tuple(d.grid[0], d.grid[1], d.grid[2]);
    x["threads"] = py::make_tuple(d.threads[0], d.threads[1], d.threads[2]);
    x["buffers"] = d.buffers;
    x["params_type"] = std::string(d.params_type);
    x["params_bytes"] = d.params.size();
    out.append(x);
  }
  return out;
}

// Test hook: swaps two buffer slots of the first dispatch, to show that a wrong buffer order in
// the description fails the harness tests.
template <class Buffer>
void swap_first_dispatch_buffers(MetalDispatches<Buffer>& list, const std::vector<int64_t>& slots) {
  if (slots.empty()) return;
  TORCH_CHECK_VALUE(slots.size() == 2 && !list.empty(), "swap_buffers takes two slot indices");
  auto& b = list.front().buffers;
  TORCH_CHECK_VALUE(slots[0] >= 0 && slots[1] >= 0 && size_t(slots[0]) < b.size() && size_t(slots[1]) < b.size(),
                    "swap_buffers: slot out of range");
  std::swap(b[size_t(slots[0])], b[size_t(slots[1])]);
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

#if defined(TM_EMU_TRACE)
// trace_start(max_threadgroups) / trace_stop() -> [per dispatch: kernel, grid, threads,
// threadgroups, traced, buffers {name: stats}, sites [stats], module_path, module_base].
inline void def_trace_functions(py::module_& m) {
  m.def("trace_start", &metal_emu::load_trace::start, py::arg("max_threadgroups") = 0);
  m.def("trace_stop", [] {
    py::list out;
    for (const auto& t : metal_emu::load_trace::stop()) {
      py::dict d;
      d["kernel"] = t.kernel;
      d["grid"] = py::make_tuple(t.grid[0], t.grid[1], t.grid[2]);
      d["threads"] = t.threads;
      d["threadgroups"] = t.threadgroups;
      d["traced"] = t.traced;
      py::dict bufs;
      for (const auto& b : t.buffers) {
        py::dict x;
        x["slot"] = b.slot;
        x["bytes"] = b.bytes;
        x["lane_loads"] = b.lane_loads;
        x["bytes_fetched"] = b.bytes_fetched;
        x["unique_bytes"] = b.unique_bytes;
        x["max_fetches"] = b.max_fetches;
        x["refetched_bytes"] = b.refetched_bytes;
        bufs[py::str(b.name)] = x;
      }
      d["buffers"] = bufs;
      py::list sites;
      for (const auto& s : t.sites) {
        py::dict x;
        x["site"] = s.site;
        x["buffer"] = s.buffer;
        py::list widths;
        for (int w = 0; w < 32; ++w)
          if (s.width_mask & (1u << w)) widths.append(w);
        x["widths"] = widths;
        x["lane_loads"] = s.lane_loads;
        x["simd_loads"] = s.simd_loads;
        x["active_lanes"] = s.active_lanes;
        x["used_bytes"] = s.used_bytes;
        x["segments"] = s.segments;
        x["bytes_fetched"] = s.bytes_fetched;
        sites.append(x);
      }
      d["sites"] = sites;
      d["module_path"] = t.module_path;
      d["module_base"] = t.module_base;
      out.append(d);
    }
    return out;
  });
}
#endif

}  // namespace torch_marlin
