// Host entry points of the CUDA rANS kernels (csrc/cuda/rans.cu), called by the rANS op family's
// registration unit with validated, contiguous tensors on one CUDA device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "torch_marlin/rans_params.h"

namespace torch_marlin {

// gemm_rans's tensors: A [M, K] and the coded layer (docs/formats.md); zeros (U4) or offsets
// (affine) and bias undefined when absent.
struct RansTensors {
  at::Tensor A, words, word_offsets, states, freqs, scales, zeros, offsets, bias;
};

// The fused decode GEMV into C [M, N]; `rows` (1, 2, 4, 8 or 16, at least M) picks the kernel.
void gemm_rans_cuda_fused(const RansParams& p, uint32_t rows, const RansTensors& t, at::Tensor& C);

// The codes into B [K/8, N] int32 (B_packed).
void rans_decode_cuda(const RansParams& p, const at::Tensor& words, const at::Tensor& word_offsets,
                      const at::Tensor& states, const at::Tensor& freqs, at::Tensor& B);

}  // namespace torch_marlin
