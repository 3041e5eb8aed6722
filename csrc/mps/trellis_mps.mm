// MPS backend of the trellis op family: encodes the planner's dispatches (plan_trellis_* with
// Backend::Metal) of metal/trellis_gemm.metal and metal/trellis_moe.metal on PyTorch's current MPS
// stream. Thin on purpose: binding tensors (with storage offsets), the pipeline cache, the
// embedded library and the stream/encoder rules live in csrc/mps/quant_gemm_mps.mm, reached
// through mps_encode_tensors (declared in ops/trellis.h).
//
// Buffer order = the kernels' [[buffer(i)]] order = csrc/metal_emu/trellis_bindings.cpp, so the
// Metal-on-CPU harness tests exercise this binding too. The three MoE dispatches go on the same
// serial compute encoder: each sees the previous one's writes.
#ifdef TM_WITH_MPS

#include "ops/trellis.h"

namespace torch_marlin {

void trellis_gemm_mps(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& C) {
  mps_encode_tensors(plan.main.kernel, plan.main.grid, plan.main.threads[0],
                     {a.A, a.w.packed, a.w.scales, a.w.grid, a.w.su, a.w.sv, C}, plan.params);
}

void trellis_dequant_mps(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& W) {
  mps_encode_tensors(plan.main.kernel, plan.main.grid, plan.main.threads[0],
                     {a.w.packed, a.w.scales, a.w.grid, a.w.su, a.w.sv, W}, plan.params);
}

void trellis_moe_mps(const TrellisPlan& plan, const TrellisMoeArgs& a, at::Tensor& rows_h, at::Tensor& rows_y,
                     at::Tensor& y) {
  mps_encode_tensors(plan.main.kernel, plan.main.grid, plan.main.threads[0],
                     {a.x, a.sorted_token, a.expert_offsets, a.gate.packed, a.gate.scales, a.gate.grid, a.gate.su,
                      a.gate.sv, a.up.packed, a.up.scales, a.up.grid, a.up.su, a.up.sv, rows_h},
                     plan.params);
  auto tiled = [&](const TrellisLaunch& l, const at::Tensor& X, const TrellisWeights& w, const at::Tensor& out) {
    if (l.kernel.empty()) return;
    mps_encode_tensors(l.kernel, l.grid, l.threads[0],
                       {X, a.sorted_token, a.expert_offsets, w.packed, w.scales, w.grid, w.su, w.sv, out},
                       plan.params);
  };
  tiled(plan.tiled_gate, a.x, a.gate, rows_h);
  tiled(plan.tiled_up, a.x, a.up, rows_h);
  mps_encode_tensors(plan.down.kernel, plan.down.grid, plan.down.threads[0],
                     {rows_h, a.expert_offsets, a.down.packed, a.down.scales, a.down.grid, a.down.su, a.down.sv,
                      rows_y},
                     plan.params);
  tiled(plan.tiled_down, rows_h, a.down, rows_y);
  mps_encode_tensors(plan.combine.kernel, plan.combine.grid, plan.combine.threads[0],
                     {rows_y, a.slot_row, a.probs, y}, plan.params);
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
