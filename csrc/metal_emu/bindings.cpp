// Metal-on-CPU harness of the FP4 / INT4 / affine INT4 kernels (and, through rans_bindings.cpp, the rANS
// kernels): the torch side. Plans exactly as the MPS
// backend does (plan_quant_gemm with Backend::Metal), binds the tensors to the same dispatch
// description (csrc/plan/metal_dispatch.h) the MPS encoder encodes, and runs that list on the CPU
// executor (runtime.cpp). Test-time only: built JIT by tests/metal_emu.py, never part of
// torch_marlin._C.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <limits>
#include <stdexcept>

#include "emu_common.h"
#include "ops/vector_aligned.h"
#include "plan/plan_py.h"
#include "runtime.h"

namespace torch_marlin {
void def_rans_functions(py::module_& m);  // rans_bindings.cpp
}  // namespace torch_marlin

namespace {

using namespace torch_marlin;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "metal_emu: ", name, " must be a CPU tensor");
}

GemmPlan plan_gemm(QuantFormat f, int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype, bool has_bias,
                   const std::string& family, int compute_units) {
  DeviceCaps caps = default_metal_caps();
  if (compute_units > 0) caps.compute_units = compute_units;
  const KernelFamily force = parse_family(family);
  return described([&] { return plan_quant_gemm(f, M, K, N, group_size, dtype, has_bias, caps, force); });
}

// C = A @ dequant(B) (+ bias) through the Metal kernels. Returns (C, plan). Output and workspace
// start as NaN so an element a kernel forgets to write cannot pass.
std::tuple<at::Tensor, py::dict> gemm(const std::string& format, const at::Tensor& A_in, const at::Tensor& B_in,
                                      const at::Tensor& scales_in, const c10::optional<at::Tensor>& zeros_or_offsets_in,
                                      const c10::optional<at::Tensor>& bias_in, int64_t group_size,
                                      const std::string& family, int compute_units, const std::string& schedule,
                                      uint64_t seed, int workers, const std::string& prefix,
                                      const std::vector<int64_t>& swap_buffers) {
  const QuantFormat f = parse_format(format);
  check_cpu(A_in, "A");
  TORCH_CHECK_VALUE(A_in.dim() == 2 && B_in.dim() == 2, "metal_emu: A and B_packed must be 2-D");
  TORCH_CHECK_VALUE(f == QuantFormat::FP4 || zeros_or_offsets_in.has_value(),
                    "metal_emu: u4 needs zeros, affine offsets");
  // As the op prepares them (csrc/ops/quant_gemm.cpp).
  const at::Tensor A = contiguous_aligned(A_in), B = contiguous_aligned(B_in), scales = contiguous_aligned(scales_in);
  const int64_t M = A.size(0), K = A.size(1), N = B.size(1);
  const GemmPlan plan = plan_gemm(f, M, K, N, group_size, dtype_of(A), bias_in.has_value(), family, compute_units);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor C = at::full({M, N}, nan, A.options());
  at::Tensor zeros_or_offsets =
      zeros_or_offsets_in.has_value() ? contiguous_aligned(*zeros_or_offsets_in) : at::Tensor();
  at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  at::Tensor ws;
  if (plan.workspace_bytes > 0) {
    ws = at::full({int64_t(plan.workspace_bytes / sizeof(float))}, nan, A.options().dtype(at::kFloat));
  }
  QuantGemmBuffers<void*> b;
  b.A = A.data_ptr();
  b.B = B.data_ptr();
  b.scales = scales.data_ptr();
  if (zeros_or_offsets.defined()) b.zeros_or_offsets = zeros_or_offsets.data_ptr();
  if (bias.defined()) b.bias = bias.data_ptr();
  b.C = C.data_ptr();
  if (ws.defined()) b.workspace = ws.data_ptr();
  note_buffers({{"A", &A}, {"B", &B}, {"scales", &scales}, {"zeros_or_offsets", &zeros_or_offsets}, {"bias", &bias}, {"C", &C},
                {"workspace", &ws}});
  MetalDispatches<void*> list = described([&] { return quant_gemm_dispatches(plan, b); });
  swap_first_dispatch_buffers(list, swap_buffers);
  run_dispatches(list, RunOpts{schedule, seed, workers, prefix});
  return {C, plan_to_dict(plan)};
}

at::Tensor dequant(const std::string& format, const at::Tensor& B_in, const at::Tensor& scales_in,
                   const c10::optional<at::Tensor>& zeros_or_offsets_in, int64_t group_size, const std::string& schedule,
                   uint64_t seed, int workers) {
  const QuantFormat f = parse_format(format);
  check_cpu(B_in, "B_packed");
  TORCH_CHECK_VALUE(f == QuantFormat::FP4 || zeros_or_offsets_in.has_value(),
                    "metal_emu: u4 needs zeros, affine offsets");
  const at::Tensor B = contiguous_aligned(B_in), scales = contiguous_aligned(scales_in);
  const int64_t K = B.size(0) * 8, N = B.size(1);
  const GemmPlan plan = described([&] { return plan_quant_dequant_metal(f, K, N, group_size, dtype_of(scales)); });
  at::Tensor W = at::full({K, N}, std::numeric_limits<float>::quiet_NaN(), scales.options());
  at::Tensor zeros_or_offsets =
      zeros_or_offsets_in.has_value() ? contiguous_aligned(*zeros_or_offsets_in) : at::Tensor();
  QuantDequantBuffers<void*> b;
  b.B = B.data_ptr();
  b.scales = scales.data_ptr();
  if (zeros_or_offsets.defined()) b.zeros_or_offsets = zeros_or_offsets.data_ptr();
  b.W = W.data_ptr();
  note_buffers({{"B", &B}, {"scales", &scales}, {"zeros_or_offsets", &zeros_or_offsets}, {"W", &W}});
  run_dispatches(described([&] { return quant_dequant_dispatches(plan, b); }), RunOpts{schedule, seed, workers, ""});
  return W;
}

// The description over buffer names: what gemm() would run for this problem.
py::list describe_gemm(const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                       const std::string& dtype, bool has_bias, bool has_zeros_or_offsets, const std::string& family,
                       int compute_units) {
  const GemmPlan plan = plan_gemm(parse_format(format), M, K, N, group_size, parse_dtype(dtype), has_bias, family,
                                  compute_units);
  QuantGemmBuffers<std::string> b;
  b.A = "A";
  b.B = "B";
  b.scales = "scales";
  if (has_zeros_or_offsets) b.zeros_or_offsets = "zeros_or_offsets";
  if (has_bias) b.bias = "bias";
  b.C = "C";
  if (plan.workspace_bytes > 0) b.workspace = "workspace";
  return dispatches_to_py(described([&] { return quant_gemm_dispatches(plan, b); }));
}

py::list describe_dequant(const std::string& format, int64_t K, int64_t N, int64_t group_size,
                          const std::string& dtype, bool has_zeros_or_offsets) {
  const GemmPlan plan = described(
      [&] { return plan_quant_dequant_metal(parse_format(format), K, N, group_size, parse_dtype(dtype)); });
  QuantDequantBuffers<std::string> b;
  b.B = "B";
  b.scales = "scales";
  if (has_zeros_or_offsets) b.zeros_or_offsets = "zeros_or_offsets";
  b.W = "W";
  return dispatches_to_py(described([&] { return quant_dequant_dispatches(plan, b); }));
}

// Any registered kernel on raw tensors (buffers in order; the harness self-tests use it). The
// traced build names the buffers `names[i]` (default "buffer<i>") and traces every slot as a
// device buffer: a raw dispatch has no params struct.
void dispatch_raw(const std::string& kernel, std::vector<int64_t> grid, int64_t threads,
                  const std::vector<at::Tensor>& buffers, const std::string& schedule, uint64_t seed, int workers,
                  const std::vector<std::string>& names) {
  TORCH_CHECK_VALUE(grid.size() == 3, "grid must have 3 entries");
  TORCH_CHECK_VALUE(names.empty() || names.size() == buffers.size(), "names: one per buffer");
  const uint32_t g[3] = {uint32_t(grid[0]), uint32_t(grid[1]), uint32_t(grid[2])};
  std::vector<void*> ptrs;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& t = buffers[i];
    check_cpu(t, "buffer");
    TORCH_CHECK_VALUE(t.is_contiguous(), "buffers must be contiguous");
    ptrs.push_back(t.data_ptr());
    const std::string name = names.empty() ? "buffer" + std::to_string(i) : names[i];
    note_buffers({{name.c_str(), &t}});
  }
#if defined(TM_EMU_TRACE)
  if (metal_emu::load_trace::active()) {
    // No params struct: an empty stand-in takes the params slot, every real slot is a buffer.
    ptrs.push_back(nullptr);
    metal_emu::load_trace::dispatch_begin(kernel, g, uint32_t(threads), ptrs, 0);
    ptrs.pop_back();
    try {
      run_dispatch(kernel, g, uint32_t(threads), ptrs, RunOpts{schedule, seed, workers, ""});
    } catch (...) {
      metal_emu::load_trace::dispatch_end();
      throw;
    }
    metal_emu::load_trace::dispatch_end();
    return;
  }
#endif
  run_dispatch(kernel, g, uint32_t(threads), ptrs, RunOpts{schedule, seed, workers, ""});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Metal-on-CPU harness for the FP4 / INT4 kernels (test-time only)";
  m.def("gemm", &gemm, py::arg("format"), py::arg("A"), py::arg("B_packed"), py::arg("scales"), py::arg("zeros_or_offsets"),
        py::arg("bias"), py::arg("group_size"), py::arg("family") = "auto", py::arg("compute_units") = 0,
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0, py::arg("prefix") = "",
        py::arg("swap_buffers") = std::vector<int64_t>{});
  m.def("dequant", &dequant, py::arg("format"), py::arg("B_packed"), py::arg("scales"), py::arg("zeros_or_offsets"),
        py::arg("group_size"), py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0);
  m.def("describe_gemm", &describe_gemm, py::arg("format"), py::arg("M"), py::arg("K"), py::arg("N"),
        py::arg("group_size"), py::arg("dtype") = "float16", py::arg("has_bias") = true, py::arg("has_zeros_or_offsets") = true,
        py::arg("family") = "auto", py::arg("compute_units") = 0);
  m.def("describe_dequant", &describe_dequant, py::arg("format"), py::arg("K"), py::arg("N"), py::arg("group_size"),
        py::arg("dtype") = "float16", py::arg("has_zeros_or_offsets") = true);
  m.def("dispatch_raw", &dispatch_raw, py::arg("kernel"), py::arg("grid"), py::arg("threads"), py::arg("buffers"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0,
        py::arg("names") = std::vector<std::string>{});
  def_rans_functions(m);
  m.def("kernel_names", &metal_emu::kernel_names);
  m.def("set_dropped_barrier", &metal_emu::set_dropped_barrier, py::arg("name"));
  m.def("last_stats", &last_stats);
#if defined(TM_EMU_TRACE)
  def_trace_functions(m);
#endif
}
