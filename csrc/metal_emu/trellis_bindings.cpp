// Metal-on-CPU harness of the trellis kernels (metal/trellis_gemm.metal, metal/trellis_moe.metal).
// Plans exactly as the MPS backend does (plan_trellis_* with Backend::Metal), routes the MoE with
// the op's own trellis_route, binds the tensors to the same dispatch description
// (csrc/plan/metal_dispatch.h) the MPS encoder encodes, and runs that list on the CPU executor.
// Test-time only: built JIT by tests/trellis_metal_emu.py.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <limits>
#include <stdexcept>

#include "emu_common.h"
#include "ops/trellis.h"
#include "ops/vector_aligned.h"
#include "plan/plan_py.h"
#include "runtime.h"

namespace {

using namespace torch_marlin;


TrellisWeights weights(const std::vector<at::Tensor>& t) {
  TORCH_CHECK_VALUE(t.size() == 5, "trellis weights are (packed_indices, scales, grid, su, sv)");
  for (const auto& x : t) TORCH_CHECK_VALUE(x.device().is_cpu(), "metal_emu: tensors must be on the CPU");
  // As the op prepares them (csrc/ops/trellis.cpp).
  return TrellisWeights{contiguous_aligned(t[0]), t[1].contiguous(), t[2].contiguous(), contiguous_aligned(t[3]),
                        t[4].contiguous()};
}

TrellisWeightBuffers<void*> weight_buffers(const TrellisWeights& w) {
  return TrellisWeightBuffers<void*>{w.packed.data_ptr(), w.scales.data_ptr(), w.grid.data_ptr(), w.su.data_ptr(),
                                     w.sv.data_ptr()};
}

// The weight tensors by the names the descriptions use (prefix g_ / u_ / d_ for the MoE's sets).
void note_weights(const std::string& prefix, const TrellisWeights& w) {
  const std::string n[5] = {prefix + "packed", prefix + "scales", prefix + "grid", prefix + "su", prefix + "sv"};
  note_buffers({{n[0].c_str(), &w.packed}, {n[1].c_str(), &w.scales}, {n[2].c_str(), &w.grid}, {n[3].c_str(), &w.su},
                {n[4].c_str(), &w.sv}});
}

TrellisWeightBuffers<std::string> weight_names(const std::string& prefix) {
  return TrellisWeightBuffers<std::string>{prefix + "packed", prefix + "scales", prefix + "grid", prefix + "su",
                                           prefix + "sv"};
}

TrellisPlan plan_gemm(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, DType dtype,
                      const std::string& family) {
  const KernelFamily force = parse_family(family);
  return described([&] { return plan_trellis_gemm(M, K, N, bits, group_size, dtype, default_metal_caps(), force); });
}

// C = A @ W through gemm_trellis_packed(_decode). Output starts as NaN: an unwritten element fails.
std::tuple<at::Tensor, py::dict> gemm(const at::Tensor& A_in, const std::vector<at::Tensor>& w_in, int64_t K,
                                      int64_t N, int64_t bits, int64_t group_size, const std::string& family,
                                      const std::string& schedule, uint64_t seed, int workers,
                                      const std::string& prefix) {
  TORCH_CHECK_VALUE(A_in.device().is_cpu() && A_in.dim() == 2 && A_in.size(1) == K, "metal_emu: A must be CPU [M, K]");
  const at::Tensor A = contiguous_aligned(A_in);
  const TrellisWeights w = weights(w_in);
  const TrellisPlan plan = plan_gemm(A.size(0), K, N, bits, group_size, dtype_of(A), family);
  at::Tensor C = at::full({A.size(0), N}, std::numeric_limits<float>::quiet_NaN(), A.options());
  note_weights("", w);
  note_buffers({{"A", &A}, {"C", &C}});
  const TrellisGemmBuffers<void*> b{A.data_ptr(), weight_buffers(w), C.data_ptr()};
  run_dispatches(described([&] { return trellis_gemm_dispatches(plan, b); }), RunOpts{schedule, seed, workers, prefix});
  return {C, trellis_plan_to_dict(plan)};
}

at::Tensor dequant(const std::vector<at::Tensor>& w_in, int64_t K, int64_t N, int64_t bits, int64_t group_size,
                   const std::string& schedule, uint64_t seed, int workers) {
  const TrellisWeights w = weights(w_in);
  const TrellisPlan plan = described([&] { return plan_trellis_dequant(K, N, bits, group_size, default_metal_caps()); });
  at::Tensor W = at::full({K, N}, std::numeric_limits<float>::quiet_NaN(), w.scales.options());
  note_weights("", w);
  note_buffers({{"W", &W}});
  const TrellisDequantBuffers<void*> b{weight_buffers(w), W.data_ptr()};
  run_dispatches(described([&] { return trellis_dequant_dispatches(plan, b); }), RunOpts{schedule, seed, workers, ""});
  return W;
}

std::tuple<at::Tensor, py::dict> moe(const at::Tensor& x_in, const std::vector<at::Tensor>& gate_in,
                                     const std::vector<at::Tensor>& up_in, const std::vector<at::Tensor>& down_in,
                                     const at::Tensor& expert_ids, const at::Tensor& expert_probs, int64_t intermediate,
                                     int64_t bits, int64_t group_size, const std::string& schedule, uint64_t seed,
                                     int workers, const std::string& prefix) {
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && x_in.dim() == 2, "metal_emu: x must be CPU [T, H]");
  TrellisMoeArgs a;
  a.x = contiguous_aligned(x_in);
  a.gate = weights(gate_in);
  a.up = weights(up_in);
  a.down = weights(down_in);
  a.T = a.x.size(0);
  a.hidden = a.x.size(1);
  a.intermediate = intermediate;
  a.E = a.gate.packed.size(0);
  a.top_k = expert_ids.size(1);
  a.probs = expert_probs.to(at::kFloat).contiguous();
  trellis_route(expert_ids, a.E, a);
  const TrellisPlan plan = described([&] {
    return plan_trellis_moe(a.T, a.hidden, intermediate, a.E, a.top_k, bits, group_size, dtype_of(a.x),
                            default_metal_caps());
  });
  const int64_t R = a.T * a.top_k;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor rows_h = at::full({R, intermediate}, nan, a.x.options().dtype(at::kFloat));
  at::Tensor rows_y = at::full({R, a.hidden}, nan, a.x.options().dtype(at::kFloat));
  at::Tensor y = at::full({a.T, a.hidden}, nan, a.x.options());
  TrellisMoeBuffers<void*> b;
  b.x = a.x.data_ptr();
  b.sorted_token = a.sorted_token.data_ptr();
  b.expert_offsets = a.expert_offsets.data_ptr();
  b.slot_row = a.slot_row.data_ptr();
  b.probs = a.probs.data_ptr();
  b.gate = weight_buffers(a.gate);
  b.up = weight_buffers(a.up);
  b.down = weight_buffers(a.down);
  b.rows_h = rows_h.data_ptr();
  b.rows_y = rows_y.data_ptr();
  b.y = y.data_ptr();
  note_weights("g_", a.gate);
  note_weights("u_", a.up);
  note_weights("d_", a.down);
  note_buffers({{"x", &a.x}, {"sorted_token", &a.sorted_token}, {"expert_offsets", &a.expert_offsets},
                {"slot_row", &a.slot_row}, {"probs", &a.probs}, {"rows_h", &rows_h}, {"rows_y", &rows_y}, {"y", &y}});
  run_dispatches(described([&] { return trellis_moe_dispatches(plan, b); }), RunOpts{schedule, seed, workers, prefix});
  return {y, trellis_plan_to_dict(plan)};
}

// The descriptions over buffer names (the MoE's weight sets are named g_, u_ and d_ as in
// moe_trellis_gate_up / moe_trellis_down).
py::list describe_gemm(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, const std::string& dtype,
                       const std::string& family) {
  const TrellisPlan plan = plan_gemm(M, K, N, bits, group_size, parse_dtype(dtype), family);
  const TrellisGemmBuffers<std::string> b{"A", weight_names(""), "C"};
  return dispatches_to_py(described([&] { return trellis_gemm_dispatches(plan, b); }));
}

py::list describe_dequant(int64_t K, int64_t N, int64_t bits, int64_t group_size) {
  const TrellisPlan plan = described([&] { return plan_trellis_dequant(K, N, bits, group_size, default_metal_caps()); });
  const TrellisDequantBuffers<std::string> b{weight_names(""), "W"};
  return dispatches_to_py(described([&] { return trellis_dequant_dispatches(plan, b); }));
}

py::list describe_moe(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                      int64_t bits, int64_t group_size, const std::string& dtype) {
  const TrellisPlan plan = described([&] {
    return plan_trellis_moe(tokens, hidden, intermediate, num_experts, top_k, bits, group_size, parse_dtype(dtype),
                            default_metal_caps());
  });
  TrellisMoeBuffers<std::string> b;
  b.x = "x";
  b.sorted_token = "sorted_token";
  b.expert_offsets = "expert_offsets";
  b.slot_row = "slot_row";
  b.probs = "probs";
  b.gate = weight_names("g_");
  b.up = weight_names("u_");
  b.down = weight_names("d_");
  b.rows_h = "rows_h";
  b.rows_y = "rows_y";
  b.y = "y";
  return dispatches_to_py(described([&] { return trellis_moe_dispatches(plan, b); }));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Metal-on-CPU harness for the trellis kernels (test-time only)";
  m.def("gemm", &gemm, py::arg("A"), py::arg("weights"), py::arg("K"), py::arg("N"), py::arg("bits"),
        py::arg("group_size"), py::arg("family") = "auto", py::arg("schedule") = "forward", py::arg("seed") = 0,
        py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("dequant", &dequant, py::arg("weights"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0);
  m.def("moe", &moe, py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("expert_ids"),
        py::arg("expert_probs"), py::arg("intermediate_size"), py::arg("bits"), py::arg("group_size"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("describe_gemm", &describe_gemm, py::arg("M"), py::arg("K"), py::arg("N"), py::arg("bits"),
        py::arg("group_size"), py::arg("dtype") = "float16", py::arg("family") = "auto");
  m.def("describe_dequant", &describe_dequant, py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"));
  m.def("describe_moe", &describe_moe, py::arg("tokens"), py::arg("hidden"), py::arg("intermediate_size"),
        py::arg("num_experts"), py::arg("top_k"), py::arg("bits"), py::arg("group_size"),
        py::arg("dtype") = "float16");
  m.def("kernel_names", &metal_emu::kernel_names);
  m.def("set_dropped_barrier", &metal_emu::set_dropped_barrier, py::arg("name"));
  m.def("last_stats", &last_stats);
#if defined(TM_EMU_TRACE)
  def_trace_functions(m);
#endif
}
