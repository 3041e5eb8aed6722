// FP4 / INT4 / affine INT4 op family: validated arguments and prepare_quant_gemm / prepare_quant_dequant,
// the backend-free half of every op (checks, output, plan, workspace). Each backend's binding unit
// (csrc/ops/op_entries.h) runs its kernels on what these return; kernels never re-check arguments.
#pragma once

// The Tensor class only: the CUDA kernel files include this through cuda/kernels.h, and all of ATen
// costs each of them seconds of parsing. Files that call ATen ops include <ATen/ATen.h> themselves.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "ops/prepared_call.h"
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

// A call ready for a backend: out is C [M, N] for a gemm, W [K, N] for a dequant; the workspace
// holds the K-slice partials, CUDA tile arrival counters or dequantized panels the plan asks for.
using QuantGemmCall = PreparedCall<QuantGemmArgs, GemmPlan>;

DType to_dtype(at::ScalarType t);

// gemm_fp4 / gemm_u4 / gemm_affine: `aux` is zeros (U4) or offsets (Affine), `caps` the caps of A's
// device (the backend's query), `op` the op's name for messages.
QuantGemmCall prepare_quant_gemm(QuantFormat format, const at::Tensor& A, const at::Tensor& B,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& aux, int64_t group_size,
                                 const c10::optional<at::Tensor>& bias, const DeviceCaps& caps, const char* op);

// dequant_fp4 / dequant_u4 / dequant_affine.
QuantGemmCall prepare_quant_dequant(QuantFormat format, const at::Tensor& B, const at::Tensor& scales,
                                    const c10::optional<at::Tensor>& aux, int64_t group_size, const char* op);

}  // namespace torch_marlin
