// Metal-on-CPU harness: the torch side. Plans exactly as the MPS backend does
// (plan_quant_gemm with Backend::Metal) and encodes the same dispatches, in the same buffer order
// as csrc/mps/quant_gemm_mps.mm, into the CPU executor (runtime.cpp). Test-time only: built JIT
// by tests/metal_emu.py, never part of torch_marlin._C.
#include <torch/extension.h>

#include <limits>
#include <stdexcept>

#include "plan/plan_py.h"
#include "emu_common.h"
#include "runtime.h"

namespace {

using namespace torch_marlin;

void run(const std::string& kernel, const uint32_t grid[3], uint32_t threads, std::vector<void*> buffers,
         const std::string& schedule, uint64_t seed, int workers) {
  metal_emu::DispatchDesc d;
  d.kernel = kernel;
  for (int i = 0; i < 3; ++i) d.grid[i] = grid[i];
  d.threads = threads;
  d.buffers = std::move(buffers);
  d.schedule = parse_schedule(schedule);
  d.seed = seed;
  d.workers = workers;
  try {
    metal_emu::dispatch(d);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "metal_emu: ", name, " must be a CPU tensor");
}

// C = A @ dequant(B) (+ bias) through the Metal kernels. Returns (C, plan). Output and workspace
// start as NaN so an element a kernel forgets to write cannot pass.
std::tuple<at::Tensor, py::dict> gemm(const std::string& format, const at::Tensor& A_in, const at::Tensor& B_in,
                                      const at::Tensor& scales_in, const c10::optional<at::Tensor>& zeros_in,
                                      const c10::optional<at::Tensor>& bias_in, int64_t group_size,
                                      const std::string& variant, int compute_units, const std::string& schedule,
                                      uint64_t seed, int workers, const std::string& prefix) {
  const QuantFormat f = parse_format(format);
  check_cpu(A_in, "A");
  TORCH_CHECK_VALUE(A_in.dim() == 2 && B_in.dim() == 2, "metal_emu: A and B_packed must be 2-D");
  TORCH_CHECK_VALUE(f == QuantFormat::FP4 || zeros_in.has_value(), "metal_emu: u4 needs zeros");
  const at::Tensor A = A_in.contiguous(), B = B_in.contiguous(), scales = scales_in.contiguous();
  const int64_t M = A.size(0), K = A.size(1), N = B.size(1);
  DeviceCaps caps = default_metal_caps();
  if (compute_units > 0) caps.compute_units = compute_units;
  GemmPlan plan;
  try {
    plan = plan_quant_gemm(f, M, K, N, group_size, dtype_of(A), bias_in.has_value(), caps, parse_family(variant));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  at::Tensor C = at::full({M, N}, std::numeric_limits<float>::quiet_NaN(), A.options());
  at::Tensor zeros = zeros_in.has_value() ? zeros_in->contiguous() : at::Tensor();
  at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  at::Tensor ws;
  if (plan.workspace_bytes > 0) {
    ws = at::full({int64_t(plan.workspace_bytes / sizeof(float))}, std::numeric_limits<float>::quiet_NaN(),
                  A.options().dtype(at::kFloat));
  }
  // Unused slots get a harmless buffer, as on Metal (every declared buffer must be bound).
  void* zeros_ptr = zeros.defined() ? zeros.data_ptr() : scales.data_ptr();
  void* bias_ptr = bias.defined() ? bias.data_ptr() : C.data_ptr();
  void* ws_ptr = ws.defined() ? ws.data_ptr() : C.data_ptr();
  QuantGemmParams params = plan.params;
  run(prefix + plan.kernel, plan.grid, plan.threads[0],
      {A.data_ptr(), B.data_ptr(), scales.data_ptr(), zeros_ptr, bias_ptr, C.data_ptr(), ws_ptr, &params}, schedule,
      seed, workers);
  if (!plan.reduce_kernel.empty()) {
    QuantReduceParams rp{params.M, params.N, params.k_parallel, params.has_bias};
    run(prefix + plan.reduce_kernel, plan.reduce_grid, plan.reduce_threads[0], {ws_ptr, bias_ptr, C.data_ptr(), &rp}, schedule,
        seed, workers);
  }
  return {C, plan_to_dict(plan)};
}

at::Tensor dequant(const std::string& format, const at::Tensor& B_in, const at::Tensor& scales_in,
                   const c10::optional<at::Tensor>& zeros_in, int64_t group_size, const std::string& schedule,
                   uint64_t seed, int workers) {
  const QuantFormat f = parse_format(format);
  check_cpu(B_in, "B_packed");
  TORCH_CHECK_VALUE(f == QuantFormat::FP4 || zeros_in.has_value(), "metal_emu: u4 needs zeros");
  const at::Tensor B = B_in.contiguous(), scales = scales_in.contiguous();
  const int64_t K = B.size(0) * 8, N = B.size(1);
  GemmPlan plan;
  try {
    plan = plan_quant_dequant_metal(f, K, N, group_size, dtype_of(scales));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  at::Tensor W = at::full({K, N}, std::numeric_limits<float>::quiet_NaN(), scales.options());
  at::Tensor zeros = zeros_in.has_value() ? zeros_in->contiguous() : at::Tensor();
  QuantGemmParams params = plan.params;
  run(plan.kernel, plan.grid, plan.threads[0],
      {B.data_ptr(), scales.data_ptr(), zeros.defined() ? zeros.data_ptr() : scales.data_ptr(), W.data_ptr(), &params},
      schedule, seed, workers);
  return W;
}

// Any registered kernel on raw tensors (buffers in order; the harness self-tests use it).
void dispatch_raw(const std::string& kernel, std::vector<int64_t> grid, int64_t threads,
                  const std::vector<at::Tensor>& buffers, const std::string& schedule, uint64_t seed, int workers) {
  TORCH_CHECK_VALUE(grid.size() == 3, "grid must have 3 entries");
  const uint32_t g[3] = {uint32_t(grid[0]), uint32_t(grid[1]), uint32_t(grid[2])};
  std::vector<void*> ptrs;
  for (const auto& t : buffers) {
    check_cpu(t, "buffer");
    TORCH_CHECK_VALUE(t.is_contiguous(), "buffers must be contiguous");
    ptrs.push_back(t.data_ptr());
  }
  run(kernel, g, uint32_t(threads), ptrs, schedule, seed, workers);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Metal-on-CPU harness for metal/quant_gemm.metal (test-time only)";
  m.def("gemm", &gemm, py::arg("format"), py::arg("A"), py::arg("B_packed"), py::arg("scales"), py::arg("zeros"),
        py::arg("bias"), py::arg("group_size"), py::arg("variant") = "auto", py::arg("compute_units") = 0,
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("dequant", &dequant, py::arg("format"), py::arg("B_packed"), py::arg("scales"), py::arg("zeros"),
        py::arg("group_size"), py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0);
  m.def("dispatch_raw", &dispatch_raw, py::arg("kernel"), py::arg("grid"), py::arg("threads"), py::arg("buffers"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0);
  m.def("kernel_names", &metal_emu::kernel_names);
  m.def("set_dropped_barrier", &metal_emu::set_dropped_barrier, py::arg("name"));
  m.def("last_stats", &last_stats);
}
