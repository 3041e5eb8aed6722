// Trellis codebook op family: schema, argument checks, routing, plan, backend call, registration.
//
//   gemm_trellis(A, packed_indices, scales, grid, su, sv, K, N, bits, group_size) -> C [M, N]
//   dequant_trellis(packed_indices, scales, grid, su, sv, K, N, bits, group_size) -> W f32 [K, N]
//   moe_trellis(x, gate_*, up_*, down_* (5 tensors each), expert_ids, expert_probs,
//               intermediate_size, bits, group_size) -> y [T, hidden]
//
// Format: docs/formats.md ("Trellis"). Fake kernels live in torch_marlin/ops.py.
// TORCH_MARLIN_DEBUG=1 logs every dispatch (kernel, grid, input stats) to stderr.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "ops/quant_gemm.h"
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

void log_launch(std::ostringstream& os, const TrellisLaunch& l) {
  if (l.kernel.empty()) return;
  os << "  kernel=" << l.kernel << " grid=(" << l.grid[0] << "," << l.grid[1] << "," << l.grid[2] << ") threads=("
     << l.threads[0] << "," << l.threads[1] << "," << l.threads[2] << ")\n";
}

void log_dispatch(const char* op, const TrellisPlan& plan, std::initializer_list<std::pair<const char*, at::Tensor>> ts) {
  std::ostringstream os;
  os << "[torch_marlin] " << op << " family=" << family_name(plan.family) << " M=" << plan.params.M
     << " K=" << plan.params.K << " N=" << plan.params.N << " bits=" << plan.params.bits
     << " group_size=" << plan.params.group_size << "\n";
  log_launch(os, plan.main);
  log_launch(os, plan.down);
  log_launch(os, plan.combine);
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

at::Tensor gemm_trellis_planned(const DeviceCaps* caps_given, const at::Tensor& A, const at::Tensor& packed,
                                const at::Tensor& scales, const at::Tensor& grid, const at::Tensor& su,
                                const at::Tensor& sv, int64_t K, int64_t N, int64_t bits, int64_t group_size) {
  // No autograd below the op (its Autograd kernel falls through): the ATen calls of the kernels
  // (BLAS on dequantized panels) would raise for an input that requires grad.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const char* op = "gemm_trellis";
  check_activation(A, op, "A");
  check_params(K, N, bits, group_size, op);
  TORCH_CHECK_VALUE(A.size(1) == K, op, ": A must have K = ", K, " columns, got shape ", A.sizes());
  TrellisGemmArgs a;
  a.M = A.size(0);
  a.K = K;
  a.N = N;
  a.bits = bits;
  a.group_size = group_size;
  a.dtype = to_dtype(A.scalar_type());
  a.w = check_weights(op, "", packed, scales, grid, su, sv, K, N, bits, group_size, 0, A.device(), "A");
  a.A = contiguous_aligned(A);
  at::Tensor C = at::empty({a.M, N}, A.options());
  if (a.M == 0) return C;
  const DeviceCaps caps = caps_given != nullptr ? *caps_given : device_caps(A.device());
  const std::shared_ptr<const TrellisPlan> planned =
      cached_plan_trellis_gemm(a.M, K, N, bits, group_size, a.dtype, caps, a.w.layout);
  const TrellisPlan& plan = *planned;
  if (debug_enabled()) {
    log_dispatch(op, plan, {{"A", a.A}, {"scales", a.w.scales}, {"grid", a.w.grid}, {"su", a.w.su}, {"sv", a.w.sv}});
  }
  switch (caps.backend) {
    case Backend::CPU: trellis_gemm_cpu(plan, a, C); break;
#ifdef TM_WITH_CUDA
    case Backend::CUDA: trellis_gemm_cuda(plan, a, C); break;
#endif
#ifdef TM_WITH_MPS
    case Backend::Metal: trellis_gemm_mps(plan, a, C); break;
#endif
    default: TORCH_CHECK(false, "torch_marlin: trellis backend not built");
  }
  return C;
}

at::Tensor gemm_trellis(const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N,
                        int64_t bits, int64_t group_size) {
  return gemm_trellis_planned(nullptr, A, packed, scales, grid, su, sv, K, N, bits, group_size);
}

at::Tensor dequant_trellis(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& grid,
                           const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N, int64_t bits,
                           int64_t group_size) {
  // No autograd below the op (its Autograd kernel falls through): the ATen calls of the kernels
  // (BLAS on dequantized panels) would raise for an input that requires grad.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const char* op = "dequant_trellis";
  check_params(K, N, bits, group_size, op);
  TrellisGemmArgs a;
  a.K = K;
  a.N = N;
  a.bits = bits;
  a.group_size = group_size;
  a.w = check_weights(op, "", packed, scales, grid, su, sv, K, N, bits, group_size, 0, packed.device(),
                      "packed_indices");
  at::Tensor W = at::empty({K, N}, scales.options());
  const DeviceCaps caps = device_caps(packed.device());
  const TrellisPlan plan = plan_trellis_dequant(K, N, bits, group_size, caps, a.w.layout);
  if (debug_enabled()) {
    log_dispatch(op, plan, {{"scales", a.w.scales}, {"grid", a.w.grid}, {"su", a.w.su}, {"sv", a.w.sv}});
  }
  switch (caps.backend) {
    case Backend::CPU: trellis_dequant_cpu(plan, a, W); break;
#ifdef TM_WITH_CUDA
    case Backend::CUDA: trellis_dequant_cuda(plan, a, W); break;
#endif
#ifdef TM_WITH_MPS
    case Backend::Metal: trellis_dequant_mps(plan, a, W); break;
#endif
    default: TORCH_CHECK(false, "torch_marlin: trellis backend not built");
  }
  return W;
}

at::Tensor moe_trellis(const at::Tensor& x, const at::Tensor& gate_packed, const at::Tensor& gate_scales,
                       const at::Tensor& gate_grid, const at::Tensor& gate_su, const at::Tensor& gate_sv,
                       const at::Tensor& up_packed, const at::Tensor& up_scales, const at::Tensor& up_grid,
                       const at::Tensor& up_su, const at::Tensor& up_sv, const at::Tensor& down_packed,
                       const at::Tensor& down_scales, const at::Tensor& down_grid, const at::Tensor& down_su,
                       const at::Tensor& down_sv, const at::Tensor& expert_ids, const at::Tensor& expert_probs,
                       int64_t intermediate, int64_t bits, int64_t group_size) {
  // No autograd below the op (its Autograd kernel falls through): the ATen calls of the kernels
  // (BLAS on dequantized panels) would raise for an input that requires grad.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const char* op = "moe_trellis";
  check_activation(x, op, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_params(H, intermediate, bits, group_size, op);
  TORCH_CHECK_VALUE(gate_packed.dim() == 4, op, ": gate_packed_indices must be 4-D [E, ceil(K/16), ceil(N/16), ",
                    "32*bits], got ", gate_packed.dim(), "-D");
  const int64_t E = gate_packed.size(0);
  TORCH_CHECK_VALUE(E > 0, op, ": the number of experts (gate_packed_indices.size(0)) must be positive");
  const at::Device dev = x.device();
  TrellisMoeArgs a;
  a.gate = check_weights(op, "gate_", gate_packed, gate_scales, gate_grid, gate_su, gate_sv, H, intermediate, bits,
                         group_size, E, dev, "x");
  a.up = check_weights(op, "up_", up_packed, up_scales, up_grid, up_su, up_sv, H, intermediate, bits, group_size,
                       E, dev, "x");
  a.down = check_weights(op, "down_", down_packed, down_scales, down_grid, down_su, down_sv, intermediate, H, bits,
                         group_size, E, dev, "x");
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
  at::Tensor y = at::empty({T, H}, x.options());
  if (T == 0) return y;
  if (dev.is_cpu()) {
    // Cheap on the host; on a GPU (MPS, CUDA) the routing clamps bad ids instead of syncing here.
    const at::Tensor flat = expert_ids.reshape({-1});
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0 && hi < E, op, ": expert_ids must be in [0, ", E, "), got values in [", lo, ", ", hi,
                      "]");
  }
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
  const DeviceCaps caps = device_caps(dev);
  const TrellisPlan plan = plan_trellis_moe(T, H, intermediate, E, top_k, bits, group_size, a.dtype, caps);
  if (plan.route.kernel.empty() && !plan.moe_row_slots) trellis_route(expert_ids, E, a);
  else a.expert_ids = expert_ids.contiguous();  // the backend routes (one launch) or needs no routing
  if (debug_enabled()) {
    log_dispatch(op, plan, {{"x", a.x}, {"gate_scales", a.gate.scales}, {"gate_grid", a.gate.grid},
                            {"gate_su", a.gate.su}, {"gate_sv", a.gate.sv}, {"up_scales", a.up.scales},
                            {"down_scales", a.down.scales}, {"expert_probs", a.probs}});
  }
  switch (caps.backend) {
    case Backend::CPU: trellis_moe_cpu(plan, a, y); break;
#ifdef TM_WITH_CUDA
    case Backend::CUDA: trellis_moe_cuda(plan, a, y); break;
#endif
#ifdef TM_WITH_MPS
    case Backend::Metal: {
      at::Tensor rows_h = at::empty({T * top_k, intermediate}, x.options().dtype(at::kFloat));
      at::Tensor rows_y = at::empty({T * top_k, H}, x.options().dtype(at::kFloat));
      trellis_moe_mps(plan, a, rows_h, rows_y, y);
      break;
    }
#endif
    default: TORCH_CHECK(false, "torch_marlin: trellis backend not built");
  }
  return y;
}

}  // namespace

at::Tensor gemm_trellis_cpu_with_caps(const DeviceCaps& caps, const at::Tensor& A, const at::Tensor& packed,
                                      const at::Tensor& scales, const at::Tensor& grid, const at::Tensor& su,
                                      const at::Tensor& sv, int64_t K, int64_t N, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(A.device().is_cpu(), "gemm_trellis_cpu_with_caps: A must be on the CPU, got ", A.device());
  TORCH_CHECK_VALUE(caps.backend == Backend::CPU, "gemm_trellis_cpu_with_caps: caps must be CPU caps");
  TORCH_CHECK_VALUE(caps.avx2 == 0 || device_caps(A.device()).avx2 != 0,
                    "gemm_trellis_cpu_with_caps: caps['avx2'] is set but this build or CPU has no AVX2 kernels");
  TORCH_CHECK_VALUE(caps.avx512 == 0 || device_caps(A.device()).avx512 != 0,
                    "gemm_trellis_cpu_with_caps: caps['avx512'] is set but this build or CPU has no AVX-512 "
                    "kernels");
  return gemm_trellis_planned(&caps, A, packed, scales, grid, su, sv, K, N, bits, group_size);
}

TORCH_LIBRARY_FRAGMENT(marlin, m) {
  m.def("gemm_trellis(Tensor A, Tensor packed_indices, Tensor scales, Tensor grid, Tensor su, Tensor sv, "
        "int K, int N, int bits, int group_size) -> Tensor");
  m.def("dequant_trellis(Tensor packed_indices, Tensor scales, Tensor grid, Tensor su, Tensor sv, "
        "int K, int N, int bits, int group_size) -> Tensor");
  m.def("moe_trellis(Tensor x, "
        "Tensor gate_packed_indices, Tensor gate_scales, Tensor gate_grid, Tensor gate_su, Tensor gate_sv, "
        "Tensor up_packed_indices, Tensor up_scales, Tensor up_grid, Tensor up_su, Tensor up_sv, "
        "Tensor down_packed_indices, Tensor down_scales, Tensor down_grid, Tensor down_su, Tensor down_sv, "
        "Tensor expert_ids, Tensor expert_probs, int intermediate_size, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("gemm_trellis", &gemm_trellis);
  m.impl("dequant_trellis", &dequant_trellis);
  m.impl("moe_trellis", &moe_trellis);
}

#ifdef TM_WITH_CUDA
TORCH_LIBRARY_IMPL(marlin, CUDA, m) {
  m.impl("gemm_trellis", &gemm_trellis);
  m.impl("dequant_trellis", &dequant_trellis);
  m.impl("moe_trellis", &moe_trellis);
}
#endif

#ifdef TM_WITH_MPS
TORCH_LIBRARY_IMPL(marlin, MPS, m) {
  m.impl("gemm_trellis", &gemm_trellis);
  m.impl("dequant_trellis", &dequant_trellis);
  m.impl("moe_trellis", &moe_trellis);
}
#endif

}  // namespace torch_marlin
