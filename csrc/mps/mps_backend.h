// The MPS backend's interface: MpsBackend (csrc/mps/register_mps.mm binds its entries to the
// dispatch key MPS). Each entry binds the op's tensors to the Metal dispatch description
// (csrc/plan/metal_dispatch.h, the one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm).
#pragma once

#ifdef TM_WITH_MPS

#include <ATen/ATen.h>

#include "ops/backend_interface.h"
#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// GPU cores of the device (mps_encoder.mm).
DeviceCaps mps_device_caps();

// The MPS backend: TM_BACKEND_INTERFACE (csrc/ops/backend_interface.h). caps: mps_device_caps
// (register_mps.mm); FP4 / INT4 / affine INT4 in quant_gemm_mps.mm, trellis in trellis_mps.mm, rANS in
// rans_mps.mm.
struct MpsBackend {
  TM_BACKEND_INTERFACE;
};

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
