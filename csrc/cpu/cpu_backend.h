// The CPU backend's kernel entry points, one per op, and its device caps; csrc/cpu/register_cpu.cpp
// binds them to the dispatch key CPU. Each runs the plan it is given on arguments the op checked.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// torch's intra-op threads; avx2 / avx512 where this build has those kernels and the CPU runs them.
DeviceCaps cpu_device_caps();

// ---- FP4 / INT4 / affine INT4 (quant_gemm.cpp runs the family the plan names: decode.cpp, dequant_blas.cpp) ----
void quant_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C);
void quant_dequant_cpu(const QuantGemmArgs& args, at::Tensor& W);

// ---- trellis (trellis.cpp; the decode family in trellis_decode.cpp) ----
void trellis_gemm_cpu(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
void trellis_dequant_cpu(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
void trellis_moe_cpu(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);

// ---- rANS (rans_codec.cpp, rans_gemm.cpp) ----
// The encoder: B_packed int32 [K/8, N] (contiguous, CPU) -> (words, word_offsets, states, freqs),
// bit for bit torch_marlin/formats/rans.py `encode`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode_cpu(const at::Tensor& B_packed,
                                                                         int64_t channels_per_tile);
// Decodes every tile into B_packed; raises ValueError naming the first tile whose stream is
// corrupted (read past its end, a final state other than L, leftover words that are not padding).
void rans_decode_cpu(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);
void rans_gemm_cpu(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);

}  // namespace torch_marlin
