// The CPU backend's interface: CpuBackend (csrc/cpu/register_cpu.cpp binds its entries to the
// dispatch key CPU). Every entry runs on arguments the op checked.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ops/backend_interface.h"
#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// The CPU backend: TM_BACKEND_INTERFACE (csrc/ops/backend_interface.h). caps (register_cpu.cpp):
// torch's intra-op threads; avx2 / avx512 where this build has those kernels and the CPU runs them.
// quant_gemm / quant_dequant (quant_gemm.cpp) run the family the plan names (decode.cpp,
// dequant_blas.cpp), whose panels live in per-thread buffers: no workspace. Trellis: trellis.cpp (the
// decode family in trellis_decode.cpp). rANS: rans_gemm.cpp; rans_codec.cpp's decode raises ValueError
// naming the first tile whose stream is corrupted (a read past its end, a final state other than L,
// leftover words that are not padding).
struct CpuBackend {
  TM_BACKEND_INTERFACE;
};

// rans_encode, a CPU-only op (rans_codec.cpp): B_packed int32 [K/8, N] (contiguous) -> (words,
// word_offsets, states, freqs), bit for bit torch_marlin/formats/rans.py `encode`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode_cpu(const at::Tensor& B_packed,
                                                                         int64_t channels_per_tile);

}  // namespace torch_marlin
