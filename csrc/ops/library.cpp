// The `marlin` op namespace and the Python module torch_marlin._C.
//
// Op families add themselves with TORCH_LIBRARY_FRAGMENT(marlin, ...) in their own unit. The
// Python module exposes the planner and the caps the ops plan with (device_caps), so
// torch_marlin.planner asks the very code the kernels run through.
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <stdexcept>

#include "ops/planned.h"
#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"
#include "plan/plan_cache.h"
#include "plan/plan_py.h"
#include "plan/rans_plan.h"
#include "plan/trellis_plan.h"

TORCH_LIBRARY(marlin, m) {}

using namespace torch_marlin;


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_marlin native module: ops are registered under torch.ops.marlin";
  m.def(
      "device_caps", [](const std::string& device) { return caps_to_dict(device_caps(at::Device(device))); },
      py::arg("device"),
      "The caps the ops plan with for a device of this build (cpu: torch's thread count; cuda: SMs, "
      "clusters, wgmma; mps: GPU cores).");
  m.def(
      "default_caps", [](const std::string& backend) { return caps_to_dict(default_caps(parse_backend(backend))); },
      py::arg("backend"), "The caps a backend is assumed to have where none are given.");
  m.def(
      "plan_quant_gemm",
      [](const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, bool has_bias, const std::string& family) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        const QuantFormat f = parse_format(format);
        const DType d = parse_dtype(dtype);
        const KernelFamily force = parse_family(family);
        return plan_to_dict(planned([&] { return plan_quant_gemm(f, M, K, N, group_size, d, has_bias, c, force); }));
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
        return trellis_plan_to_dict(planned([&] {
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
        return trellis_plan_to_dict(planned([&] {
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
        return std::string(index_layout_name(planned([&] { return trellis_index_layout(K, N, bits, c); })));
      },
      py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("backend"), py::arg("caps"),
      "The index layout a trellis matrix is kept in on a device with these caps ('lanes' or 'tiles').");
  m.def(
      "gemm_trellis_cpu_with_caps",
      [](const py::dict& caps, const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
         const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N, int64_t bits,
         int64_t group_size) {
        const DeviceCaps c = caps_from_dict(Backend::CPU, caps);
        return gemm_trellis_cpu_with_caps(c, A, packed, scales, grid, su, sv, K, N, bits, group_size);
      },
      py::arg("caps"), py::arg("A"), py::arg("packed_indices"), py::arg("scales"), py::arg("grid"), py::arg("su"),
      py::arg("sv"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"),
      "gemm_trellis on the CPU planned with these caps (keys as default_caps): avx2=False and avx512=False "
      "run the portable kernels on any machine.");
  m.def(
      "cached_plan_quant_gemm",
      [](const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& dtype,
         const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return plan_to_dict(*planned([&] {
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
        return trellis_plan_to_dict(*planned([&] {
          return cached_plan_trellis_gemm(M, K, N, bits, group_size, parse_dtype(dtype), c, parse_index_layout(layout));
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"), py::arg("dtype"),
      py::arg("backend"), py::arg("caps"), py::arg("layout") = "tiles");
  m.def(
      "plan_rans_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& format, int64_t channels_per_tile,
         const std::string& dtype, const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return rans_plan_to_dict(planned([&] {
          return plan_rans_gemm(M, K, N, group_size, channels_per_tile, parse_format(format), parse_dtype(dtype),
                                has_bias, c);
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("format"),
      py::arg("channels_per_tile"), py::arg("dtype"), py::arg("backend"), py::arg("caps"),
      py::arg("has_bias") = false);
  m.def(
      "cached_plan_rans_gemm",
      [](int64_t M, int64_t K, int64_t N, int64_t group_size, const std::string& format, int64_t channels_per_tile,
         const std::string& dtype, const std::string& backend, const py::dict& caps, bool has_bias) {
        const DeviceCaps c = caps_from_dict(parse_backend(backend), caps);
        return rans_plan_to_dict(*planned([&] {
          return cached_plan_rans_gemm(M, K, N, group_size, channels_per_tile, parse_format(format),
                                       parse_dtype(dtype), has_bias, c);
        }));
      },
      py::arg("M"), py::arg("K"), py::arg("N"), py::arg("group_size"), py::arg("format"),
      py::arg("channels_per_tile"), py::arg("dtype"), py::arg("backend"), py::arg("caps"),
      py::arg("has_bias") = false);
  m.def(
      "gemm_rans_cpu_with_caps",
      [](const py::dict& caps, const at::Tensor& A, const at::Tensor& words, const at::Tensor& word_offsets,
         const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
         const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets, const std::string& format,
         int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile, const c10::optional<at::Tensor>& bias) {
        return gemm_rans_cpu_with_caps(caps_from_dict(Backend::CPU, caps), A, words, word_offsets, states, freqs,
                                       scales, zeros, offsets, format, K, N, group_size, channels_per_tile, bias);
      },
      py::arg("caps"), py::arg("A"), py::arg("words"), py::arg("word_offsets"), py::arg("states"), py::arg("freqs"),
      py::arg("scales"), py::arg("zeros"), py::arg("offsets"), py::arg("format"), py::arg("K"), py::arg("N"),
      py::arg("group_size"), py::arg("channels_per_tile"), py::arg("bias") = py::none(),
      "gemm_rans on the CPU planned with these caps: avx2=False runs the portable lane decoder.");
  m.def(
      "rans_decode_cpu_with_caps",
      [](const py::dict& caps, const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
         const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile) {
        return rans_decode_cpu_with_caps(caps_from_dict(Backend::CPU, caps), words, word_offsets, states, freqs, K, N,
                                         channels_per_tile);
      },
      py::arg("caps"), py::arg("words"), py::arg("word_offsets"), py::arg("states"), py::arg("freqs"), py::arg("K"),
      py::arg("N"), py::arg("channels_per_tile"),
      "rans_decode on the CPU planned with these caps: avx2=False runs the portable lane decoder.");
  m.def("plan_cache_size", &plan_cache_size, "Plans the ops' plan cache holds (every op family).");
  m.def("clear_plan_cache", &clear_plan_cache, "Empties the ops' plan cache.");
}
