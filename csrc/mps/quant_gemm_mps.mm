// MPS backend of the FP4 / INT4 op family: binds the op's tensors to the dispatch description
// (csrc/mps/metal_dispatch.h, the same one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm).
#ifdef TM_WITH_MPS

#include <stdexcept>

#include "mps/mps_encoder.h"
#include "ops/quant_gemm.h"

namespace torch_marlin {

namespace {
// The decode kernels with vector_loads read A, B_packed, scales and zeros with 4-element vector
// loads, which Metal wants aligned to the vector: a view whose data starts off a 16-byte boundary
// (a slice of a larger buffer) is copied first.
at::Tensor aligned_for(const GemmPlan& plan, const at::Tensor& t) {
  if (!plan.desc.vector_loads || (t.storage_offset() * t.element_size()) % 16 == 0) return t;
  return t.clone();
}
}  // namespace

void quant_gemm_mps(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& workspace) {
  // A starts 16-byte aligned for every kernel that reads it in vectors (metal_dispatch.h); the
  // decode kernels with vector_loads read B_packed, scales and zeros in vectors too.
  const bool aligned = uint64_t(a.A.storage_offset() * a.A.element_size()) % kMetalActivationAlignment == 0;
  const at::Tensor A = aligned ? a.A : a.A.clone();
  const at::Tensor B = aligned_for(plan, a.B), scales = aligned_for(plan, a.scales);
  QuantGemmBuffers<MpsBuffer> b;
  b.A = mps_buffer(A);
  b.B = mps_buffer(B);
  b.scales = mps_buffer(scales);
  at::Tensor zeros;
  if (a.zeros.defined()) {
    zeros = aligned_for(plan, a.zeros);
    b.zeros = mps_buffer(zeros);
  }
  if (a.bias.defined()) b.bias = mps_buffer(a.bias);
  b.C = mps_buffer(C);
  if (workspace.defined()) b.workspace = mps_buffer(workspace);
  mps_encode(mps_describe([&] { return quant_gemm_dispatches(plan, b); }));
}

void quant_dequant_mps(const QuantGemmArgs& a, at::Tensor& W) {
  GemmPlan plan;
  try {
    plan = plan_quant_dequant_metal(a.format, a.K, a.N, a.group_size, a.dtype);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  QuantDequantBuffers<MpsBuffer> b;
  b.B = mps_buffer(a.B);
  b.scales = mps_buffer(a.scales);
  if (a.zeros.defined()) b.zeros = mps_buffer(a.zeros);
  b.W = mps_buffer(W);
  mps_encode(mps_describe([&] { return quant_dequant_dispatches(plan, b); }));
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
