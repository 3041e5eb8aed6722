// The CPU backend's interface: CpuBackend (csrc/cpu/register_cpu.cpp binds its entries to the
// dispatch key CPU). Every entry runs on arguments the op checked.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// The CPU backend, the interface of the op entries (csrc/ops/op_entries.h): its caps and one kernel
// entry per op, defined by the files named below. Each runs the plan it is given.
struct CpuBackend {
  // torch's intra-op threads; avx2 / avx512 where this build has those kernels and the CPU runs them
  // (register_cpu.cpp).
  static DeviceCaps caps(const at::Device& device);
  // FP4 / INT4 / affine INT4 (quant_gemm.cpp runs the family the plan names: decode.cpp,
  // dequant_blas.cpp). The CPU families keep their panels in per-thread buffers: no workspace.
  static void quant_gemm(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace);
  static void quant_dequant(const QuantGemmArgs& args, at::Tensor& W);
  // Trellis (trellis.cpp; the decode family in trellis_decode.cpp).
  static void trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C);
  static void trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& W);
  static void trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y);
  // rANS (rans_gemm.cpp; rans_codec.cpp: the decode raises ValueError naming the first tile whose
  // stream is corrupted: a read past its end, a final state other than L, leftover words that are
  // not padding).
  static void rans_gemm(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);
  static void rans_decode(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);
};

// rans_encode, a CPU-only op (rans_codec.cpp): B_packed int32 [K/8, N] (contiguous) -> (words,
// word_offsets, states, freqs), bit for bit torch_marlin/formats/rans.py `encode`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode_cpu(const at::Tensor& B_packed,
                                                                         int64_t channels_per_tile);

}  // namespace torch_marlin
