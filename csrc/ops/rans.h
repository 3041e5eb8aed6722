// rANS op family: validated arguments, the op entry points and the per-backend kernels the
// registration unit (rans.cpp) calls. Backends implement the kernels; they never re-check
// arguments.
//
// Backends other than the CPU add themselves from their own unit, with no link-time dependency
// in either direction:
//   static const bool registered = (set_rans_kernels(Backend::CUDA, {&my_gemm, &my_decode}), true);
//   TORCH_LIBRARY_IMPL(marlin, CUDA, m) { m.impl("gemm_rans", &gemm_rans); m.impl("rans_decode", &rans_decode); }
// gemm_rans / rans_decode (below) check the arguments, plan with the device's caps and call the
// kernels set for the plan's backend.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

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

// The op entry points (schemas in rans.cpp), for every backend's TORCH_LIBRARY_IMPL.
at::Tensor gemm_rans(const at::Tensor& A, const at::Tensor& words, const at::Tensor& word_offsets,
                     const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                     c10::string_view format, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                     const c10::optional<at::Tensor>& bias);
at::Tensor rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                       const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile);

// gemm_rans / rans_decode on the CPU planned with `caps` instead of the device's: the same checks,
// plan and kernels (caps.avx2 = 0 runs the portable lane decoder on any machine; 1 is refused where
// the build or the CPU lacks AVX2). Bound as torch_marlin._C.*_cpu_with_caps for tests.
at::Tensor gemm_rans_cpu_with_caps(const DeviceCaps& caps, const at::Tensor& A, const at::Tensor& words,
                                   const at::Tensor& word_offsets, const at::Tensor& states, const at::Tensor& freqs,
                                   const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                                   const c10::optional<at::Tensor>& offsets, c10::string_view format, int64_t K,
                                   int64_t N, int64_t group_size, int64_t channels_per_tile,
                                   const c10::optional<at::Tensor>& bias);
at::Tensor rans_decode_cpu_with_caps(const DeviceCaps& caps, const at::Tensor& words, const at::Tensor& word_offsets,
                                     const at::Tensor& states, const at::Tensor& freqs, int64_t K, int64_t N,
                                     int64_t channels_per_tile);

// A backend's kernels. gemm: C [M, N] (A's dtype, allocated) from the plan of plan_rans_gemm;
// the staged family's dense GEMM (plan.gemm) is the backend's quant GEMM on the decoded B_packed.
// decode: B_packed int32 [K/8, N] (allocated). Kernels never read outside a tile's stream.
struct RansKernels {
  void (*gemm)(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C) = nullptr;
  void (*decode)(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed) = nullptr;
};
void set_rans_kernels(Backend backend, RansKernels kernels);

// ---- CPU (csrc/cpu/rans_codec.cpp, csrc/cpu/rans_gemm.cpp) ----
// The encoder: B_packed int32 [K/8, N] (contiguous, CPU) -> (words, word_offsets, states, freqs),
// bit for bit torch_marlin/formats/rans.py `encode`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode_cpu(const at::Tensor& B_packed,
                                                                         int64_t channels_per_tile);
// Decodes every tile into B_packed; raises ValueError naming the first tile whose stream is
// corrupted (read past its end, a final state other than L, leftover words that are not padding).
void rans_decode_cpu(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed);
void rans_gemm_cpu(const RansPlan& plan, const RansGemmArgs& args, at::Tensor& C);

}  // namespace torch_marlin
