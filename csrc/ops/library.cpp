// The `marlin` op namespace (every op's schema) and the Python module torch_marlin._C.
//
// Each backend binds the ops for its dispatch key in its binding unit (csrc/cpu/register_cpu.cpp,
// csrc/cuda/register_cuda.cu, csrc/mps/register_mps.mm) through the entry points of
// csrc/ops/op_entries.h. The Python module exposes the planner and the caps the ops plan with
// (device_caps), so torch_marlin.planner asks the very code the kernels run through.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <stdexcept>

#include "ops/op_entries.h"
#include "ops/plan_or_value_error.h"
#include "plan/plan_cache.h"
#include "plan/plan_py.h"
#include "plan/rans_plan.h"
#include "plan/trellis_plan.h"

TORCH_LIBRARY(marlin, m) {
  // FP4 / INT4 / affine INT4 (csrc/ops/quant_gemm.cpp).
  m.def("gemm_fp4(Tensor A, Tensor B_packed, Tensor scales, int group_size, Tensor? bias=None) -> Tensor");
  m.def("gemm_u4(Tensor A, Tensor B_packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias=None) -> Tensor");
  m.def("dequant_fp4(Tensor B_packed, Tensor scales, int group_size) -> Tensor");
  m.def("dequant_u4(Tensor B_packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("gemm_affine(Tensor A, Tensor B_packed, Tensor scales, Tensor offsets, int group_size, Tensor? bias=None) -> Tensor");
  m.def("dequant_affine(Tensor B_packed, Tensor scales, Tensor offsets, int group_size) -> Tensor");
  // Trellis (csrc/ops/trellis.cpp).
  m.def("gemm_trellis(Tensor A, Tensor packed_indices, Tensor scales, Tensor grid, Tensor su, Tensor sv, "
        "int K, int N, int bits, int group_size) -> Tensor");
  m.def("dequant_trellis(Tensor packed_indices, Tensor scales, Tensor grid, Tensor su, Tensor sv, "
        "int K, int N, int bits, int group_size) -> Tensor");
  m.def("moe_trellis(Tensor x, "
        "Tensor gate_packed_indices, Tensor gate_scales, Tensor gate_grid, Tensor gate_su, Tensor gate_sv, "
        "Tensor up_packed_indices, Tensor up_scales, Tensor up_grid, Tensor up_su, Tensor up_sv, "
        "Tensor down_packed_indices, Tensor down_scales, Tensor down_grid, Tensor down_su, Tensor down_sv, "
        "Tensor expert_ids, Tensor expert_probs, int intermediate_size, int bits, int group_size) -> Tensor");
  // rANS-coded 4-bit codes (csrc/ops/rans.cpp).
  m.def("rans_encode(Tensor B_packed, int channels_per_tile) -> (Tensor words, Tensor word_offsets, Tensor states, "
        "Tensor freqs)");
  m.def("rans_decode(Tensor words, Tensor word_offsets, Tensor states, Tensor freqs, int K, int N, "
        "int channels_per_tile) -> Tensor");
  m.def("gemm_rans(Tensor A, Tensor words, Tensor word_offsets, Tensor states, Tensor freqs, Tensor scales, "
        "Tensor? zeros, Tensor? offsets, str format, int K, int N, int group_size, int channels_per_tile, "
        "Tensor? bias=None) -> Tensor");
  // The caps the ops of `like`'s device plan with (torch_marlin._C.device_caps; caps_to_ints).
  m.def("_device_caps(Tensor like) -> int[]");
}

namespace torch_marlin {

std::vector<int64_t> caps_to_ints(const DeviceCaps& c) {
  return {int64_t(c.backend), c.compute_units, c.max_shared_memory, c.thread_block_clusters, c.wgmma, c.avx2,
          c.avx512};
}

DeviceCaps caps_from_ints(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 7, "torch_marlin: _device_caps returned ", v.size(), " values, expected 7");
  DeviceCaps c;
  c.backend = Backend(v[0]);
  c.compute_units = int(v[1]);
  c.max_shared_memory = int(v[2]);
  c.thread_block_clusters = int(v[3]);
  c.wgmma = int(v[4]);
  c.avx2 = int(v[5]);
  c.avx512 = int(v[6]);
  return c;
}

namespace {

// The caps a device's ops plan with, from the backend bound to its dispatch key.
DeviceCaps device_caps(const at::Device& dev) {
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("marlin::_device_caps", "")
                              .typed<std::vector<int64_t>(const at::Tensor&)>();
  const c10::DispatchKey key = c10::computeDispatchKey(c10::nullopt, c10::nullopt, dev);
  TORCH_CHECK_VALUE(op.hasKernelForDispatchKey(key), "torch_marlin: this build has no kernels for device ", dev);
  return caps_from_ints(op.call(at::empty({0}, at::TensorOptions().device(dev))));
}

}  // namespace
}  // namespace torch_marlin

namespace {

using namespace torch_marlin;

// The caps the ops plan with.
void def_caps_functions(py::module_& m) {
  m.def(
      "device_caps", [](const std::string& device) { return caps_to_dict(device_caps(at::Device(device))); },
      py::arg("device"),
      "The caps the ops plan with for a device of this build (cpu: torch's thread count; cuda: SMs, "
      "clusters, wgmma; mps: GPU cores).");
  m.def(
      "default_caps", [](const std::string& backend) { return caps_to_dict(default_caps(parse_backend(backend))); },
      py::arg("backend"), "The caps a backend is assumed to have where none are given.");
}

// The planner entries, for caps a caller names (torch_marlin.planner).
void def_planner_functions(py::module_& m) {
  m.def(
      "plan_quant_gemm",
      [](const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, bool has_bias, const std::string& family) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        const QuantFormat f = parse_format(format);
        const DType d = parse_dtype(dtype);
        const KernelFamily force = parse_family(family);
        return plan_to_dict(plan_or_value_error([&] { return plan_quant_gemm(f, M, K, N, group_size, d, has_bias, c, force); }));
      },
      py::arg("format"), py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("caps"), py::arg("has_bias") = false, py::arg("family") = "auto");
  m.def(
      "plan_trellis_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, const std::string& family, const std::string& layout) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        const DType d = parse_dtype(dtype);
        const KernelFamily force = parse_family(family);
        return trellis_plan_to_dict(plan_or_value_error([&] {
          return plan_trellis_gemm(M, K, N, bits, group_size, d, c, force, parse_index_layout(layout));
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("caps"), py::arg("family") = "auto", py::arg("layout") = "tiles");
  m.def(
      "plan_trellis_moe",
      [](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k, int64_t bits,
         int64_t group_size, const std::string& dtype, const std::string& backend, const py::dict& caps) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return trellis_plan_to_dict(plan_or_value_error([&] {
          return plan_trellis_moe(tokens, hidden, intermediate, num_experts, top_k, bits, group_size,
                                  parse_dtype(dtype), c);
        }));
      },
      py::arg("tokens"), py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("bits"), py::arg("group_size"), py::arg("dtype"), py::arg("backend"), py::arg("caps"));
  m.def(
      "trellis_index_layout",
      [](int64_t K, int64_t N, int64_t bits, const std::string& backend, const py::dict& caps) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return std::string(index_layout_name(plan_or_value_error([&] { return trellis_index_layout(K, N, bits, c); })));
      },
      py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("backend"), py::arg("caps"),
      "The index layout a trellis matrix is kept in on a device with these caps ('lanes' or 'tiles').");
  m.def(
      "plan_rans_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& format, int64_t channels_per_tile,
         const std::string& dtype, const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return rans_plan_to_dict(plan_or_value_error([&] {
          return plan_rans_gemm(M, K, N, group_size, channels_per_tile, parse_format(format), parse_dtype(dtype),
                                has_bias, c);
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("format"),
      py::arg("channels_per_tile"), py::arg("dtype"), py::arg("backend"), py::arg("caps"),
      py::arg("has_bias") = false);
}

// The ops' plan cache: the plans the ops run.
void def_plan_cache_functions(py::module_& m) {
  m.def(
      "cached_plan_quant_gemm",
      [](const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return plan_to_dict(*plan_or_value_error([&] {
          return cached_plan_quant_gemm(parse_format(format), M, K, N, group_size, parse_dtype(dtype), has_bias, c);
        }));
      },
      py::arg("format"), py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("caps"), py::arg("has_bias") = false,
      "The plan the op runs for these arguments, from the plan cache the ops use (planned and stored on a miss).");
  m.def(
      "cached_plan_trellis_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, const std::string& layout) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return trellis_plan_to_dict(*plan_or_value_error([&] {
          return cached_plan_trellis_gemm(M, K, N, bits, group_size, parse_dtype(dtype), c, parse_index_layout(layout));
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("caps"), py::arg("layout") = "tiles");
  m.def(
      "cached_plan_rans_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& format, int64_t channels_per_tile,
         const std::string& dtype, const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return rans_plan_to_dict(*plan_or_value_error([&] {
          return cached_plan_rans_gemm(M, K, N, group_size, channels_per_tile, parse_format(format),
                                       parse_dtype(dtype), has_bias, c);
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("format"),
      py::arg("channels_per_tile"), py::arg("dtype"), py::arg("backend"), py::arg("caps"),
      py::arg("has_bias") = false);
  m.def("plan_cache_size", &plan_cache_size, "Plans the ops' plan cache holds (every op family).");
  m.def("clear_plan_cache", &clear_plan_cache, "Empties the ops' plan cache.");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_marlin native module: ops are registered under torch.ops.marlin";
  def_caps_functions(m);
  def_planner_functions(m);
  def_plan_cache_functions(m);
}
