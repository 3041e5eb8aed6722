// rANS op family: validated arguments and prepare_rans_encode / prepare_rans_decode /
// prepare_rans_gemm, the backend-free half of every op (checks, output, plan). Each backend's
// binding unit (csrc/ops/op_entries.h) runs its kernels on what these return; kernels never re-check
// arguments.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ops/prepared_call.h"
#include "ops/quant_gemm.h"
#include "plan/rans_plan.h"

namespace torch_marlin {

// A coded layer (docs/formats.md, "rANS-coded 4-bit codes"): every tensor contiguous, on the op's
// device. words int16 [W], word_offsets int32 [T+1], states int32 [T, 32], freqs int16 [T, 16].
// On the CPU the tables were checked (offsets, frequency sums, states); elsewhere only shapes.
struct RansCodes {
  at::Tensor words, word_offsets, states, freqs;
  int64_t K = 0, N = 0, channels_per_tile = 0, tiles = 0;
};

struct RansGemmArgs {
  QuantFormat format = QuantFormat::FP4;
  int64_t M = 0, K = 0, N = 0, group_size = 0;
  DType dtype = DType::F32;  // of A, scales, offsets, bias and C
  at::Tensor A;              // [M, K]
  at::Tensor scales;         // [K/group_size, N]
  at::Tensor zeros;          // uint8 [K/group_size, N]: U4 only
  at::Tensor offsets;        // [K/group_size, N]: Affine only
  at::Tensor bias;           // [N] or undefined
  RansCodes codes;
};

// The staged path's dense GEMM operands: a's, with B_packed the decoded codes (int32 [K/8, N]).
inline QuantGemmArgs staged_gemm_args(const RansGemmArgs& a, const at::Tensor& B_packed) {
  QuantGemmArgs q;
  q.format = a.format;
  q.M = a.M;
  q.K = a.K;
  q.N = a.N;
  q.group_size = a.group_size;
  q.dtype = a.dtype;
  q.A = a.A;
  q.B = B_packed;
  q.scales = a.scales;
  q.zeros = a.zeros;
  q.offsets = a.offsets;
  q.bias = a.bias;
  return q;
}

using RansGemmCall = PreparedCall<RansGemmArgs, RansPlan>;  // out: C [M, N]
using RansDecodeCall = PreparedCall<RansCodes, RansPlan>;    // out: B_packed int32 [K/8, N]

// The op's tensors of one coded layer, in schema order.
struct RansCodeTensors {
  at::Tensor words, word_offsets, states, freqs;
};

// rans_encode runs on the host only: checks B_packed, resolves channels_per_tile (<= 0: the default)
// and returns B_packed contiguous.
at::Tensor prepare_rans_encode(const at::Tensor& B_packed, int64_t& channels_per_tile);
// `caps`: the caps of the op's device (the backend's query).
RansDecodeCall prepare_rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                                   const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile,
                                   const DeviceCaps& caps);
RansGemmCall prepare_rans_gemm(const at::Tensor& A, const RansCodeTensors& codes, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                               c10::string_view format, int64_t K, int64_t N, int64_t group_size,
                               int64_t channels_per_tile, const c10::optional<at::Tensor>& bias,
                               const DeviceCaps& caps);

}  // namespace torch_marlin
