// The CUDA backend's interface: CudaBackend (csrc/cuda/register_cuda.cu binds its entries to the
// dispatch key CUDA). Every entry runs on arguments the op checked.
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

// The CUDA backend, the interface of the op entries (csrc/ops/op_entries.h): its caps and one kernel
// entry per op, defined by the files named below. Each runs the plan it is given.
struct CudaBackend {
  // SMs, shared memory, thread-block clusters and wgmma of the device (launch.cu).
  static DeviceCaps caps(const at::Device& device);
  // FP4 / INT4 / affine INT4 (launch.cu runs the family the plan names).
  static void quant_gemm(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
  static void quant_dequant(const QuantGemmArgs& args, at::Tensor& W);
  // Trellis (trellis_launch.cu).
  static void trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
  static void trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
  static void trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);
  // rANS (rans.cu).
  static void rans_gemm(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);
  static void rans_decode(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);
};

}  // namespace torch_marlin
