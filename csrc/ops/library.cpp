// The `marlin` op namespace and the Python module torch_marlin._C.
//
// Op families add themselves with TORCH_LIBRARY_FRAGMENT(marlin, ...) in their own unit. The
// Python module exposes only the planner, so torch_marlin.dispatch (the policy tests call) asks
// the very code the kernels run through.
#include <torch/extension.h>
#include <torch/library.h>

#include "plan/plan_py.h"
#include "plan/trellis_plan.h"
#ifdef TM_WITH_CUDA
#include "ops/quant_gemm.h"
#endif

TORCH_LIBRARY(marlin, m) {}

using namespace torch_marlin;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_marlin native module: ops are registered under torch.ops.marlin";
  m.def(
      "plan_quant_gemm",
      [](const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& dtype,
         const std::string& backend, int compute_units, bool has_bias, const std::string& force,
         bool thread_block_clusters, bool wgmma) {
        DeviceCaps caps = parse_backend(backend) == Backend::Metal ? default_metal_caps() : DeviceCaps{};
        caps.backend = parse_backend(backend);
        if (compute_units > 0) caps.compute_units = compute_units;
        caps.thread_block_clusters = thread_block_clusters ? 1 : 0;
        caps.wgmma = wgmma ? 1 : 0;
        const QuantFormat f = parse_format(format);
        try {
          return plan_to_dict(
              plan_quant_gemm(f, M, K, N, group_size, parse_dtype(dtype), has_bias, caps, parse_variant(force)));
        } catch (const std::invalid_argument& e) {
          TORCH_CHECK_VALUE(false, e.what());
        }
      },
      py::arg("format"), py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("compute_units") = 0, py::arg("has_bias") = false, py::arg("force") = "auto",
      py::arg("thread_block_clusters") = false, py::arg("wgmma") = false);
#ifdef TM_WITH_CUDA
  // What the op's planner sees for a CUDA device (plan_gemm passes it on, so the plan it returns
  // is the one the op runs).
  m.def(
      "cuda_thread_block_clusters",
      [](int device_index) { return cuda_device_caps(device_index).thread_block_clusters != 0; },
      py::arg("device_index"));
  m.def(
      "cuda_wgmma", [](int device_index) { return cuda_device_caps(device_index).wgmma != 0; },
      py::arg("device_index"));
#endif
  m.def(
      "plan_trellis_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, const std::string& dtype,
         const std::string& backend, const std::string& force) {
        DeviceCaps caps = parse_backend(backend) == Backend::Metal ? default_metal_caps() : DeviceCaps{};
        caps.backend = parse_backend(backend);
        try {
          const TrellisPlan p = plan_trellis_gemm(M, K, N, bits, group_size, parse_dtype(dtype), caps, parse_variant(force));
          py::dict d;
          d["variant"] = variant_name(p.variant);
          d["kernel"] = p.main.kernel;
          d["grid"] = py::make_tuple(p.main.grid[0], p.main.grid[1], p.main.grid[2]);
          d["threads"] = py::make_tuple(p.main.threads[0], p.main.threads[1], p.main.threads[2]);
          d["tile_m"] = p.params.tile_m;
          d["tile_n"] = p.params.tile_n;
          d["m_tiles"] = p.params.m_tiles;
          d["n_tiles"] = p.params.n_tiles;
          d["k_chunk"] = p.k_chunk;
          return d;
        } catch (const std::invalid_argument& e) {
          TORCH_CHECK_VALUE(false, e.what());
        }
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("force") = "auto");
}
