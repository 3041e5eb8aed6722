// The MPS backend's kernel entry points, one per op, and its device caps; csrc/mps/register_mps.mm
// binds them to the dispatch key MPS. Each binds the op's tensors to the Metal dispatch description
// (csrc/plan/metal_dispatch.h, the one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm).
#pragma once

#ifdef TM_WITH_MPS

#include <ATen/ATen.h>

#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// GPU cores of the device (mps_encoder.mm).
DeviceCaps mps_device_caps();

// ---- FP4 / INT4 / affine INT4 (quant_gemm_mps.mm) ----
void quant_gemm_mps(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
void quant_dequant_mps(const QuantGemmArgs& args, at::Tensor& W);

// ---- trellis (trellis_mps.mm) ----
void trellis_gemm_mps(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
void trellis_dequant_mps(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
void trellis_moe_mps(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);

// ---- rANS (rans_mps.mm) ----
void rans_gemm_mps(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);
void rans_decode_mps(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
