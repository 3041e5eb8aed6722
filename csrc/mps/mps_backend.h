// The MPS backend's interface: MpsBackend (csrc/mps/register_mps.mm binds its entries to the
// dispatch key MPS). Each entry binds the op's tensors to the Metal dispatch description
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

// The MPS backend, the interface of the op entries (csrc/ops/op_entries.h): its caps and one kernel
// entry per op, defined by the files named below. Each runs the plan it is given.
struct MpsBackend {
  static DeviceCaps caps(const at::Device& device);  // mps_device_caps (register_mps.mm)
  // FP4 / INT4 / affine INT4 (quant_gemm_mps.mm).
  static void quant_gemm(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
  static void quant_dequant(const QuantGemmArgs& args, at::Tensor& W);
  // Trellis (trellis_mps.mm).
  static void trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
  static void trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
  static void trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);
  // rANS (rans_mps.mm).
  static void rans_gemm(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);
  static void rans_decode(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);
};

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
