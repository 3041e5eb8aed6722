// The interface every backend implements, written once: TM_BACKEND_INTERFACE declares the members of
// a backend's struct (CpuBackend in csrc/cpu/cpu_backend.h, MpsBackend in csrc/mps/mps_backend.h,
// CudaBackend in csrc/cuda/cuda_backend.h), whose kernel files define them. The op entry points
// (csrc/ops/op_entries.h) call them, and register_backend_ops<Backend> binds those entries to the
// backend's dispatch key.
//
//   caps             the planner's view of the device
//   quant_gemm       FP4 / INT4 / affine INT4 GEMM (workspace: the plan's, undefined when it needs none)
//   quant_dequant    their dequant
//   trellis_gemm, trellis_dequant, trellis_moe
//   rans_gemm, rans_decode
//
// Every entry runs the plan it is given on arguments the op checked. Light on purpose (the CUDA kernel
// files include it through cuda_backend.h): the argument structs are declared, not defined.
#pragma once

#include <ATen/core/Tensor.h>

#include "plan/plan.h"

namespace torch_marlin {

struct QuantGemmArgs;
struct TrellisPlan;
struct TrellisGemmArgs;
struct TrellisMoeArgs;
struct RansPlan;
struct RansGemmArgs;
struct RansCodes;

}  // namespace torch_marlin

#define TM_BACKEND_INTERFACE                                                                                     \
  static DeviceCaps caps(const at::Device& device);                                                              \
  static void quant_gemm(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace); \
  static void quant_dequant(const QuantGemmArgs& args, at::Tensor& W);                                           \
  static void trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);                 \
  static void trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);              \
  static void trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);                   \
  static void rans_gemm(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);                          \
  static void rans_decode(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed)
