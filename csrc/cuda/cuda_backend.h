// The CUDA backend's kernel entry points, one per op, and its device caps; csrc/cuda/register_cuda.cu
// binds them to the dispatch key CUDA. Each runs the plan it is given on arguments the op checked.
#pragma once

// The Tensor class only (the kernel files include this through kernels.h; all of ATen would cost
// each of them seconds of parsing): the trellis and rANS argument structs are declared, not defined.
#include <ATen/core/Tensor.h>

#include "ops/quant_gemm.h"

namespace torch_marlin {

struct TrellisPlan;
struct TrellisGemmArgs;
struct TrellisMoeArgs;
struct RansPlan;
struct RansGemmArgs;
struct RansCodes;

// SMs, shared memory, thread-block clusters and wgmma of the device (current one for index -1).
DeviceCaps cuda_device_caps(int device_index);

// ---- FP4 / INT4 / affine INT4 (launch.cu runs the family the plan names) ----
void quant_gemm_cuda(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
void quant_dequant_cuda(const QuantGemmArgs& args, at::Tensor& W);

// ---- trellis (trellis_launch.cu) ----
void trellis_gemm_cuda(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
void trellis_dequant_cuda(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
void trellis_moe_cuda(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);

// ---- rANS (rans.cu) ----
void rans_gemm_cuda(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);
void rans_decode_cuda(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);

}  // namespace torch_marlin
