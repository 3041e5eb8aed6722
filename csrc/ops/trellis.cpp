// Trellis codebook op family: argument checks, routing and plan (prepare_trellis_gemm,
// prepare_trellis_dequant, prepare_trellis_moe). Schemas: csrc/ops/library.cpp; each backend binds
// the ops in its binding unit.
//
//   gemm_trellis(A, packed_indices, scales, grid, su, sv, K, N, bits, group_size) -> C [M, N]
//   dequant_trellis(packed_indices, scales, grid, su, sv, K, N, bits, group_size) -> W f32 [K, N]
//   moe_trellis(x, gate_*, up_*, down_* (5 tensors each), expert_ids, expert_probs,
//               intermediate_size, bits, group_size) -> y [T, hidden]
//
// Format: docs/formats.md ("Trellis"). Fake kernels live in torch_marlin/ops.py.
// TORCH_MARLIN_DEBUG=1 logs every dispatch (kernel, grid, input stats) to stderr.
#include <ATen/ATen.h>

#include <array>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "ops/trellis.h"
#include "ops/vector_aligned.h"
#include "plan/plan_cache.h"

namespace torch_marlin {
namespace {

bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TORCH_MARLIN_DEBUG");
    return v != nullptr && v[0] != '\0' && std::string(v) != "0";
  }();
  return on;
}

void log_tensor(std::ostringstream& os, const char* name, const at::Tensor& t) {
  os << "  " << name << ": shape=" << t.sizes() << " dtype=" << t.scalar_type();
  if (t.numel() > 0 && at::isFloatingType(t.scalar_type())) {
    const at::Tensor f = t.detach().to(at::kFloat);
    os << " min=" << f.min().item<float>() << " max=" << f.max().item<float>()
       << " has_nan=" << (f.isnan().any().item<bool>() ? "True" : "False");
  }
  os << "\n";
}

void log_launch(std::ostringstream& os, LaunchRole role, const KernelLaunch& l) {
  os << "  " << launch_role_name(role) << ": kernel=" << l.kernel << " grid=(" << l.grid[0] << "," << l.grid[1] << ","
     << l.grid[2] << ") threads=(" << l.threads[0] << "," << l.threads[1] << "," << l.threads[2] << ")\n";
}

void log_dispatch(const char* op, const TrellisPlan& plan, std::initializer_list<std::pair<const char*, at::Tensor>> ts) {
  std::ostringstream os;
  os << "[torch_marlin] " << op << " family=" << family_name(plan.family) << " M=" << plan.params.M
     << " K=" << plan.params.K << " N=" << plan.params.N << " bits=" << plan.params.bits
     << " group_size=" << plan.params.group_size << "\n";
  for (const auto& [role, launch] : plan.launches) log_launch(os, role, launch);
  for (const auto& kv : ts) log_tensor(os, kv.first, kv.second);
  std::cerr << os.str() << std::flush;
}

void check_device(const at::Tensor& t, const at::Device& dev, const char* op, const std::string& name,
                  const char* ref) {
  TORCH_CHECK_VALUE(t.device() == dev, op, ": ", name, " is on ", t.device(), " but ", ref, " is on ", dev,
                    "; all tensors must be on one device");
}

void check_activation(const at::Tensor& A, const char* op, const char* name) {
  const auto s = A.scalar_type();
  TORCH_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, ": ", name,
                   " must be float16, bfloat16 or float32, got ", s);
  TORCH_CHECK_VALUE(A.dim() == 2, op, ": ", name, " must be 2-D, got ", A.dim(), "-D");
}

void check_params(int64_t K, int64_t N, int64_t bits, int64_t group_size, const char* op) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 3 || bits == 4, op, ": bits must be 2, 3 or 4, got ", bits);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % TM_TRELLIS_TILE == 0, op,
                    ": group_size must be a positive multiple of 16 (a 16x16 tile never straddles groups), got ",
                    group_size);
  TORCH_CHECK_VALUE(K > 0 && N > 0, op, ": K and N must be positive, got K=", K, ", N=", N);
  TORCH_CHECK_VALUE(K < (int64_t(1) << 30) && N < (int64_t(1) << 30), op, ": K and N must be < 2^30");
}

// Checks one trellis matrix W[K, N] (with a leading expert dim when experts > 0).
TrellisWeights check_weights(const char* op, const std::string& prefix, const at::Tensor& packed,
                             const at::Tensor& scales, const at::Tensor& grid, const at::Tensor& su,
                             const at::Tensor& sv, int64_t K, int64_t N, int64_t bits, int64_t group_size,
                             int64_t experts, const at::Device& dev, const char* ref) {
  std::vector<int64_t> lead;
  if (experts > 0) lead.push_back(experts);
  auto shape = [&](std::initializer_list<int64_t> s) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), s.begin(), s.end());
    return v;
  };
  const std::vector<int64_t> want_packed = shape({(K + 15) / 16, (N + 15) / 16, 32 * bits});
  const std::vector<int64_t> want_scales = shape({(K + group_size - 1) / group_size, N});
  const std::vector<int64_t> want_grid = shape({int64_t(1) << bits});
  const std::vector<int64_t> want_su = shape({K});
  const std::vector<int64_t> want_sv = shape({N});
  const std::string dims = experts > 0 ? "[E, " : "[";
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, op, ": ", prefix, "packed_indices must be uint8, got ",
                   packed.scalar_type());
  // A dense matrix may come in the CUDA lane layout (the modules make it at load time on CUDA).
  const int64_t chunk = TM_TRELLIS_LANE_CHUNK_TILES;
  const std::vector<int64_t> want_lanes = {((K + 15) / 16 + chunk - 1) / chunk, (N + 15) / 16, 256 * bits};
  const bool lanes = experts == 0 && packed.sizes() == at::IntArrayRef(want_lanes);
  if (!lanes && packed.sizes() != at::IntArrayRef(want_packed)) {
    std::ostringstream msg;
    msg << op << ": " << prefix << "packed_indices must have shape " << at::IntArrayRef(want_packed) << " (" << dims
        << "ceil(K/16), ceil(N/16), 32*bits] for K=" << K << ", N=" << N << ", bits=" << bits << ")";
    if (experts == 0) msg << " or, in the CUDA lane layout, " << at::IntArrayRef(want_lanes);
    msg << ", got " << packed.sizes();
    TORCH_CHECK_VALUE(false, msg.str());
  }
  TORCH_CHECK_VALUE(!lanes || dev.is_cuda(), op, ": ", prefix,
                    "packed_indices is in the CUDA lane layout, which only the CUDA kernels read (tensors on ", dev,
                    "); torch_marlin.formats.trellis.lanes_to_tiles gives the canonical layout");
  struct F { const at::Tensor* t; const char* name; const std::vector<int64_t>* want; const char* what; };
  const F fs[] = {{&scales, "scales", &want_scales, "ceil(K/group_size), N]"},
                  {&grid, "grid", &want_grid, "2^bits]"},
                  {&su, "su", &want_su, "K]"},
                  {&sv, "sv", &want_sv, "N]"}};
  for (const F& f : fs) {
    TORCH_CHECK_TYPE(f.t->scalar_type() == at::kFloat, op, ": ", prefix, f.name, " must be float32, got ",
                     f.t->scalar_type());
    TORCH_CHECK_VALUE(f.t->sizes() == at::IntArrayRef(*f.want), op, ": ", prefix, f.name, " must have shape ",
                      at::IntArrayRef(*f.want), " (", dims, f.what, "), got ", f.t->sizes());
  }
  check_device(packed, dev, op, prefix + "packed_indices", ref);
  for (const F& f : fs) check_device(*f.t, dev, op, prefix + f.name, ref);
  return TrellisWeights{contiguous_aligned(packed), scales.contiguous(), grid.contiguous(), contiguous_aligned(su),
                        sv.contiguous(), lanes ? TrellisIndexLayout::Lanes : TrellisIndexLayout::Tiles};
}

}  // namespace

TrellisGemmCall prepare_trellis_gemm(const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
                                     const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K,
                                     int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps) {
  const char* op = "gemm_trellis";
  check_activation(A, op, "A");
  check_params(K, N, bits, group_size, op);
  TORCH_CHECK_VALUE(A.size(1) == K, op, ": A must have K = ", K, " columns, got shape ", A.sizes());
  TrellisGemmCall c;
  TrellisGemmArgs& a = c.args;
  a.M = A.size(0);
  a.K = K;
  a.N = N;
  a.bits = bits;
  a.group_size = group_size;
  a.dtype = to_dtype(A.scalar_type());
  a.w = check_weights(op, "", packed, scales, grid, su, sv, K, N, bits, group_size, 0, A.device(), "A");
  a.A = contiguous_aligned(A);
  c.out = at::empty({a.M, N}, A.options());
  c.empty = a.M == 0;
  if (c.empty) return c;
  c.plan = cached_plan_trellis_gemm(a.M, K, N, bits, group_size, a.dtype, caps, a.w.layout);
  if (debug_enabled()) {
    log_dispatch(op, *c.plan, {{"A", a.A}, {"scales", a.w.scales}, {"grid", a.w.grid}, {"su", a.w.su}, {"sv", a.w.sv}});
  }
  return c;
}

TrellisGemmCall prepare_trellis_dequant(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& grid,
                                        const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N, int64_t bits,
                                        int64_t group_size, const DeviceCaps& caps) {
  const char* op = "dequant_trellis";
  check_params(K, N, bits, group_size, op);
  TrellisGemmCall c;
  TrellisGemmArgs& a = c.args;
  a.K = K;
  a.N = N;
  a.bits = bits;
  a.group_size = group_size;
  a.w = check_weights(op, "", packed, scales, grid, su, sv, K, N, bits, group_size, 0, packed.device(),
                      "packed_indices");
  c.out = at::empty({K, N}, scales.options());
  c.plan = std::make_shared<const TrellisPlan>(plan_trellis_dequant(K, N, bits, group_size, caps, a.w.layout));
  if (debug_enabled()) {
    log_dispatch(op, *c.plan, {{"scales", a.w.scales}, {"grid", a.w.grid}, {"su", a.w.su}, {"sv", a.w.sv}});
  }
  return c;
}

namespace {

void check_routing(const at::Tensor& expert_ids, const at::Tensor& expert_probs, int64_t T, int64_t E,
                   const at::Device& dev, const char* op) {
  TORCH_CHECK_VALUE(expert_ids.dim() == 2 && expert_ids.size(0) == T && expert_ids.size(1) > 0, op,
                    ": expert_ids must have shape [T, top_k] with T = ", T, " (x.size(0)), got ", expert_ids.sizes());
  const int64_t top_k = expert_ids.size(1);
  TORCH_CHECK_VALUE(top_k <= E, op, ": top_k (expert_ids.size(1) = ", top_k, ") must not exceed the ", E, " experts");
  TORCH_CHECK_TYPE(expert_ids.scalar_type() == at::kLong || expert_ids.scalar_type() == at::kInt, op,
                   ": expert_ids must be int64 or int32, got ", expert_ids.scalar_type());
  TORCH_CHECK_VALUE(expert_probs.sizes() == expert_ids.sizes(), op, ": expert_probs must have expert_ids' shape ",
                    expert_ids.sizes(), ", got ", expert_probs.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(expert_probs.scalar_type()), op, ": expert_probs must be floating point, got ",
                   expert_probs.scalar_type());
  check_device(expert_ids, dev, op, "expert_ids", "x");
  check_device(expert_probs, dev, op, "expert_probs", "x");
  if (dev.is_cpu() && T > 0) {
    // Cheap on the host; on a GPU (MPS, CUDA) the routing clamps bad ids instead of syncing here.
    const at::Tensor flat = expert_ids.reshape({-1});
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < E, op, ": expert_ids must be in [0, ", E, "), got values in [", lo, ", ", hi,
                      "]");
  }
}

}  // namespace

TrellisMoeCall prepare_trellis_moe(const at::Tensor& x, const TrellisMoeWeights& w, const at::Tensor& expert_ids,
                                   const at::Tensor& expert_probs, int64_t intermediate, int64_t bits,
                                   int64_t group_size, const DeviceCaps& caps) {
  const char* op = "moe_trellis";
  check_activation(x, op, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_params(H, intermediate, bits, group_size, op);
  const at::Tensor& gate_packed = w.gate[0];
  TORCH_CHECK_VALUE(gate_packed.dim() == 4, op, ": gate_packed_indices must be 4-D [E, ceil(K/16), ceil(N/16), ",
                    "32*bits], got ", gate_packed.dim(), "-D");
  const int64_t E = gate_packed.size(0);
  TORCH_CHECK_VALUE(E > 0, op, ": the number of experts (gate_packed_indices.size(0)) must be positive");
  const at::Device dev = x.device();
  TrellisMoeCall c;
  TrellisMoeArgs& a = c.args;
  auto weights = [&](const char* prefix, const std::array<at::Tensor, 5>& t, int64_t K, int64_t N) {
    return check_weights(op, prefix, t[0], t[1], t[2], t[3], t[4], K, N, bits, group_size, E, dev, "x");
  };
  a.gate = weights("gate_", w.gate, H, intermediate);
  a.up = weights("up_", w.up, H, intermediate);
  a.down = weights("down_", w.down, intermediate, H);
  check_routing(expert_ids, expert_probs, T, E, dev, op);
  c.out = at::empty({T, H}, x.options());
  c.empty = T == 0;
  if (c.empty) return c;
  const int64_t top_k = expert_ids.size(1);
  a.T = T;
  a.hidden = H;
  a.intermediate = intermediate;
  a.E = E;
  a.top_k = top_k;
  a.bits = bits;
  a.group_size = group_size;
  a.dtype = to_dtype(x.scalar_type());
  a.x = contiguous_aligned(x);
  a.probs = expert_probs.to(at::kFloat).contiguous();
  c.plan = std::make_shared<const TrellisPlan>(
      plan_trellis_moe(T, H, intermediate, E, top_k, bits, group_size, a.dtype, caps));
  if (c.plan->launches.find(LaunchRole::Route) == nullptr && !c.plan->moe_row_slots) trellis_route(expert_ids, E, a);
  else a.expert_ids = expert_ids.contiguous();  // the backend routes (one launch) or needs no routing
  if (debug_enabled()) {
    log_dispatch(op, *c.plan, {{"x", a.x}, {"gate_scales", a.gate.scales}, {"gate_grid", a.gate.grid},
                               {"gate_su", a.gate.su}, {"gate_sv", a.gate.sv}, {"up_scales", a.up.scales},
                               {"down_scales", a.down.scales}, {"expert_probs", a.probs}});
  }
  return c;
}

}  // namespace torch_marlin
