// MPS backend of the FP4 / INT4 / affine INT4 op family: binds the op's tensors to the dispatch description
// (csrc/plan/metal_dispatch.h, the same one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm).
#ifdef TM_WITH_MPS

#include <ATen/ATen.h>

#include <stdexcept>

#include "mps/mps_backend.h"
#include "mps/mps_encoder.h"

namespace torch_marlin {

void MpsBackend::quant_gemm(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& workspace) {
  QuantGemmBuffers<MpsBuffer> b;
  b.A = mps_buffer(a.A);
  b.B = mps_buffer(a.B);
  b.scales = mps_buffer(a.scales);
  if (a.zeros.defined()) b.zeros_or_offsets = mps_buffer(a.zeros);
  if (a.offsets.defined()) b.zeros_or_offsets = mps_buffer(a.offsets);
  if (a.bias.defined()) b.bias = mps_buffer(a.bias);
  b.C = mps_buffer(C);
  if (workspace.defined()) b.workspace = mps_buffer(workspace);
  mps_encode(mps_describe([&] { return quant_gemm_dispatches(plan, b); }));
}

void MpsBackend::quant_dequant(const QuantGemmArgs& a, at::Tensor& W) {
  GemmPlan plan;
  try {
    plan = plan_quant_dequant_metal(a.format, a.K, a.N, a.group_size, a.dtype);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  QuantDequantBuffers<MpsBuffer> b;
  b.B = mps_buffer(a.B);
  b.scales = mps_buffer(a.scales);
  if (a.zeros.defined()) b.zeros_or_offsets = mps_buffer(a.zeros);
  if (a.offsets.defined()) b.zeros_or_offsets = mps_buffer(a.offsets);
  b.W = mps_buffer(W);
  mps_encode(mps_describe([&] { return quant_dequant_dispatches(plan, b); }));
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
