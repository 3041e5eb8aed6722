// MPS backend of the trellis op family: binds the op's tensors to the dispatch description
// (csrc/plan/metal_dispatch.h, the same one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm).
#ifdef TM_WITH_MPS

#include "mps/mps_backend.h"
#include "mps/mps_encoder.h"

namespace torch_marlin {
namespace {

TrellisWeightBuffers<MpsBuffer> weight_buffers(const TrellisWeights& w) {
  return TrellisWeightBuffers<MpsBuffer>{mps_buffer(w.packed), mps_buffer(w.scales), mps_buffer(w.grid),
                                         mps_buffer(w.su), mps_buffer(w.sv)};
}

}  // namespace

void MpsBackend::trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& C) {
  const TrellisGemmBuffers<MpsBuffer> b{mps_buffer(a.A), weight_buffers(a.w), mps_buffer(C)};
  mps_encode(mps_describe([&] { return trellis_gemm_dispatches(plan, b); }));
}

void MpsBackend::trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& W) {
  const TrellisDequantBuffers<MpsBuffer> b{weight_buffers(a.w), mps_buffer(W)};
  mps_encode(mps_describe([&] { return trellis_dequant_dispatches(plan, b); }));
}

// The routed rows' f32 scratch lives for this call only: h [T*top_k, intermediate] (the SwiGLU of
// gate and up), y [T*top_k, hidden] (the down projection before the combine).
void MpsBackend::trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& a, at::Tensor& y) {
  at::Tensor rows_h = at::empty({a.T * a.top_k, a.intermediate}, a.x.options().dtype(at::kFloat));
  at::Tensor rows_y = at::empty({a.T * a.top_k, a.hidden}, a.x.options().dtype(at::kFloat));
  TrellisMoeBuffers<MpsBuffer> b;
  b.x = mps_buffer(a.x);
  b.sorted_token = mps_buffer(a.sorted_token);
  b.expert_offsets = mps_buffer(a.expert_offsets);
  b.slot_row = mps_buffer(a.slot_row);
  b.probs = mps_buffer(a.probs);
  b.gate = weight_buffers(a.gate);
  b.up = weight_buffers(a.up);
  b.down = weight_buffers(a.down);
  b.rows_h = mps_buffer(rows_h);
  b.rows_y = mps_buffer(rows_y);
  b.y = mps_buffer(y);
  mps_encode(mps_describe([&] { return trellis_moe_dispatches(plan, b); }));
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
