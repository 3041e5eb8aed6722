// Metal-on-CPU harness for the trellis kernels (metal/trellis_gemm.metal, metal/trellis_moe.metal).
// Plans exactly as the MPS backend does (plan_trellis_* with Backend::Metal), routes the MoE with
// the op's own trellis_route, and encodes the same dispatches in the same buffer order as
// csrc/mps/trellis_mps.mm. Test-time only: built JIT by tests/trellis_metal_emu.py.
#include <torch/extension.h>

#include <limits>
#include <stdexcept>

#include "ops/trellis.h"
#include "emu_common.h"
#include "runtime.h"

namespace {

using namespace torch_marlin;

KernelFamily parse_family(const std::string& s) {
  if (s == "auto") return KernelFamily::Auto;
  if (s == "decode") return KernelFamily::Decode;
  if (s == "staged_tiles") return KernelFamily::StagedTiles;
  TORCH_CHECK_VALUE(false, "family must be auto/decode/staged_tiles, got '", s, "'");
}

struct RunOpts {
  std::string schedule, prefix;
  uint64_t seed;
  int workers;
};

void run(const TrellisLaunch& l, std::vector<void*> buffers, const RunOpts& o) {
  metal_emu::DispatchDesc d;
  d.kernel = o.prefix + l.kernel;
  for (int i = 0; i < 3; ++i) d.grid[i] = l.grid[i];
  d.threads = l.threads[0];
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

py::dict launch_dict(const TrellisLaunch& l) {
  py::dict d;
  d["kernel"] = l.kernel;
  d["grid"] = py::make_tuple(l.grid[0], l.grid[1], l.grid[2]);
  d["threads"] = py::make_tuple(l.threads[0], l.threads[1], l.threads[2]);
  return d;
}

py::dict plan_dict(const TrellisPlan& p) {
  py::dict d = launch_dict(p.main);
  d["family"] = family_name(p.family);
  d["tile_m"] = p.params.tile_m;
  d["tile_n"] = p.params.tile_n;
  if (!p.down.kernel.empty()) {
    d["down"] = launch_dict(p.down);
    d["combine"] = launch_dict(p.combine);
    if (!p.tiled_gate.kernel.empty()) {
      d["tiled_gate"] = launch_dict(p.tiled_gate);
      d["tiled_up"] = launch_dict(p.tiled_up);
      d["tiled_down"] = launch_dict(p.tiled_down);
    }
  }
  return d;
}

template <class F>
auto planned(F f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

TrellisWeights weights(const std::vector<at::Tensor>& t) {
  TORCH_CHECK_VALUE(t.size() == 5, "trellis weights are (packed_indices, scales, grid, su, sv)");
  for (const auto& x : t) TORCH_CHECK_VALUE(x.device().is_cpu(), "metal_emu: tensors must be on the CPU");
  return TrellisWeights{t[0].contiguous(), t[1].contiguous(), t[2].contiguous(), t[3].contiguous(), t[4].contiguous()};
}

// C = A @ W through gemm_trellis_packed(_decode). Output starts as NaN: an unwritten element fails.
std::tuple<at::Tensor, py::dict> gemm(const at::Tensor& A_in, const std::vector<at::Tensor>& w_in, int64_t K,
                                      int64_t N, int64_t bits, int64_t group_size, const std::string& variant,
                                      const std::string& schedule, uint64_t seed, int workers,
                                      const std::string& prefix) {
  TORCH_CHECK_VALUE(A_in.device().is_cpu() && A_in.dim() == 2 && A_in.size(1) == K, "metal_emu: A must be CPU [M, K]");
  const at::Tensor A = A_in.contiguous();
  const TrellisWeights w = weights(w_in);
  const TrellisPlan plan = planned([&] {
    return plan_trellis_gemm(A.size(0), K, N, bits, group_size, dtype_of(A), default_metal_caps(),
                             parse_family(variant));
  });
  at::Tensor C = at::full({A.size(0), N}, std::numeric_limits<float>::quiet_NaN(), A.options());
  TrellisParams p = plan.params;
  run(plan.main,
      {A.data_ptr(), w.packed.data_ptr(), w.scales.data_ptr(), w.grid.data_ptr(), w.su.data_ptr(), w.sv.data_ptr(),
       C.data_ptr(), &p},
      RunOpts{schedule, prefix, seed, workers});
  return {C, plan_dict(plan)};
}

at::Tensor dequant(const std::vector<at::Tensor>& w_in, int64_t K, int64_t N, int64_t bits, int64_t group_size,
                   const std::string& schedule, uint64_t seed, int workers) {
  const TrellisWeights w = weights(w_in);
  const TrellisPlan plan = planned([&] { return plan_trellis_dequant(K, N, bits, group_size, default_metal_caps()); });
  at::Tensor W = at::full({K, N}, std::numeric_limits<float>::quiet_NaN(), w.scales.options());
  TrellisParams p = plan.params;
  run(plan.main,
      {w.packed.data_ptr(), w.scales.data_ptr(), w.grid.data_ptr(), w.su.data_ptr(), w.sv.data_ptr(), W.data_ptr(),
       &p},
      RunOpts{schedule, "", seed, workers});
  return W;
}

std::tuple<at::Tensor, py::dict> moe(const at::Tensor& x_in, const std::vector<at::Tensor>& gate_in,
                                     const std::vector<at::Tensor>& up_in, const std::vector<at::Tensor>& down_in,
                                     const at::Tensor& expert_ids, const at::Tensor& expert_probs, int64_t intermediate,
                                     int64_t bits, int64_t group_size, const std::string& schedule, uint64_t seed,
                                     int workers, const std::string& prefix) {
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && x_in.dim() == 2, "metal_emu: x must be CPU [T, H]");
  TrellisMoeArgs a;
  a.x = x_in.contiguous();
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
  const TrellisPlan plan = planned([&] {
    return plan_trellis_moe(a.T, a.hidden, intermediate, a.E, a.top_k, bits, group_size, dtype_of(a.x),
                            default_metal_caps());
  });
  const int64_t R = a.T * a.top_k;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor rows_h = at::full({R, intermediate}, nan, a.x.options().dtype(at::kFloat));
  at::Tensor rows_y = at::full({R, a.hidden}, nan, a.x.options().dtype(at::kFloat));
  at::Tensor y = at::full({a.T, a.hidden}, nan, a.x.options());
  TrellisParams p = plan.params;
  const RunOpts o{schedule, prefix, seed, workers};
  run(plan.main,
      {a.x.data_ptr(), a.sorted_token.data_ptr(), a.expert_offsets.data_ptr(), a.gate.packed.data_ptr(),
       a.gate.scales.data_ptr(), a.gate.grid.data_ptr(), a.gate.su.data_ptr(), a.gate.sv.data_ptr(),
       a.up.packed.data_ptr(), a.up.scales.data_ptr(), a.up.grid.data_ptr(), a.up.su.data_ptr(), a.up.sv.data_ptr(),
       rows_h.data_ptr(), &p},
      o);
  auto tiled = [&](const TrellisLaunch& l, void* X, const TrellisWeights& w, void* out) {
    if (l.kernel.empty()) return;
    run(l,
        {X, a.sorted_token.data_ptr(), a.expert_offsets.data_ptr(), w.packed.data_ptr(), w.scales.data_ptr(),
         w.grid.data_ptr(), w.su.data_ptr(), w.sv.data_ptr(), out, &p},
        o);
  };
  tiled(plan.tiled_gate, a.x.data_ptr(), a.gate, rows_h.data_ptr());
  tiled(plan.tiled_up, a.x.data_ptr(), a.up, rows_h.data_ptr());
  run(plan.down,
      {rows_h.data_ptr(), a.expert_offsets.data_ptr(), a.down.packed.data_ptr(), a.down.scales.data_ptr(),
       a.down.grid.data_ptr(), a.down.su.data_ptr(), a.down.sv.data_ptr(), rows_y.data_ptr(), &p},
      o);
  tiled(plan.tiled_down, rows_h.data_ptr(), a.down, rows_y.data_ptr());
  run(plan.combine, {rows_y.data_ptr(), a.slot_row.data_ptr(), a.probs.data_ptr(), y.data_ptr(), &p}, o);
  return {y, plan_dict(plan)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Metal-on-CPU harness for the trellis kernels (test-time only)";
  m.def("gemm", &gemm, py::arg("A"), py::arg("weights"), py::arg("K"), py::arg("N"), py::arg("bits"),
        py::arg("group_size"), py::arg("variant") = "auto", py::arg("schedule") = "forward", py::arg("seed") = 0,
        py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("dequant", &dequant, py::arg("weights"), py::arg("K"), py::arg("N"), py::arg("bits"), py::arg("group_size"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0);
  m.def("moe", &moe, py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("expert_ids"),
        py::arg("expert_probs"), py::arg("intermediate_size"), py::arg("bits"), py::arg("group_size"),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("kernel_names", &metal_emu::kernel_names);
  m.def("set_dropped_barrier", &metal_emu::set_dropped_barrier, py::arg("name"));
  m.def("last_stats", &last_stats);
}
