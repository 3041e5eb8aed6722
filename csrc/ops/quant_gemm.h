// FP4 / INT4 / affine INT4 op family: validated arguments and the per-backend entry points the registration
// unit (quant_gemm.cpp) calls. Backends implement these; they never re-check arguments.
#pragma once

// The Tensor class only: the CUDA kernel files include this through cuda/kernels.h, and all of ATen
// costs each of them seconds of parsing. Files that call ATen ops include <ATen/ATen.h> themselves.
#include <ATen/core/Tensor.h>

#include "plan/plan.h"

namespace torch_marlin {

// Arguments after validation: every tensor contiguous and on A's device (or the weights' device
// for dequant), dtypes as documented in docs/formats.md.
struct QuantGemmArgs {
  QuantFormat format = QuantFormat::FP4;
  int64_t M = 0, K = 0, N = 0, group_size = 0;
  DType dtype = DType::F16;  // activation dtype (gemm) or scales dtype (dequant)
  at::Tensor A;              // [M, K] fp16/bf16/fp32 (undefined for dequant)
  at::Tensor B;              // int32 [K/8, N]
  at::Tensor scales;         // [K/group_size, N], dtype of A
  at::Tensor zeros;          // uint8 [K/group_size, N] for U4; undefined otherwise
  at::Tensor offsets;        // [K/group_size, N], dtype of scales, for Affine; undefined otherwise
  at::Tensor bias;           // [N], dtype of A; undefined when absent
};

DType to_dtype(at::ScalarType t);

// Caps of the device the tensors live on (planner input): CPU threads, Metal cores, CUDA SMs.
// The one source of caps: every op and torch_marlin.planner (through _C.device_caps) read it.
DeviceCaps device_caps(const at::Device& dev);

// ---- CPU (csrc/cpu/quant_gemm.cpp: one family per file, decode.cpp, dequant_blas.cpp) ----
void quant_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C);
void quant_dequant_cpu(const QuantGemmArgs& args, at::Tensor& W);

#ifdef TM_WITH_MPS
// ---- MPS (csrc/mps/quant_gemm_mps.mm) ----
DeviceCaps mps_device_caps();
void quant_gemm_mps(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
void quant_dequant_mps(const QuantGemmArgs& args, at::Tensor& W);
#endif

#ifdef TM_WITH_CUDA
// ---- CUDA (csrc/cuda/) ----
DeviceCaps cuda_device_caps(int device_index);
void quant_gemm_cuda(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
void quant_dequant_cuda(const QuantGemmArgs& args, at::Tensor& W);
#endif

}  // namespace torch_marlin
