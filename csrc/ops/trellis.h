// Trellis op family: validated arguments and prepare_trellis_gemm / prepare_trellis_dequant /
// prepare_trellis_moe, the backend-free half of every op (checks, output, routing, plan). Each
// backend's binding unit (csrc/ops/op_entries.h) runs its kernels on what these return; kernels never
// re-check arguments.
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "ops/prepared_call.h"
#include "ops/quant_gemm.h"
#include "plan/trellis_plan.h"

namespace torch_marlin {

// One trellis-quantized matrix W[K, N] (docs/formats.md): every tensor contiguous, on the op's
// device. packed uint8 [ceil(K/16), ceil(N/16), 32*bits]; scales f32 [ceil(K/group_size), N];
// grid f32 [2^bits]; su f32 [K]; sv f32 [N]. For the MoE each tensor has a leading expert dim.
// A dense matrix's packed indices may instead be in the CUDA lane layout (TM_TRELLIS_LANE_CHUNK_TILES):
// uint8 [ceil(ceil(K/16)/8), ceil(N/16), 256*bits], on CUDA only.
struct TrellisWeights {
  at::Tensor packed, scales, grid, su, sv;
  TrellisIndexLayout layout = TrellisIndexLayout::Tiles;
};

struct TrellisGemmArgs {
  int64_t M = 0, K = 0, N = 0, bits = 0, group_size = 0;
  DType dtype = DType::F32;  // of A and C
  at::Tensor A;              // [M, K]
  TrellisWeights w;
};

// Routed MoE: rows are (token, slot) pairs sorted by expert. `expert_offsets` int32 [E + 1]:
// expert e owns sorted rows [offsets[e], offsets[e+1]); `sorted_token` int32 [T*top_k]: the token
// of each sorted row; `slot_row` int32 [T*top_k]: sorted row of (token t, slot j) at t*top_k + j.
struct TrellisMoeArgs {
  int64_t T = 0, hidden = 0, intermediate = 0, E = 0, top_k = 0, bits = 0, group_size = 0;
  DType dtype = DType::F32;  // of x and y
  at::Tensor x;              // [T, hidden]
  TrellisWeights gate, up;   // [E, ...] of W[hidden, intermediate]
  TrellisWeights down;       // [E, ...] of W[intermediate, hidden]
  at::Tensor probs;          // f32 [T, top_k]
  at::Tensor expert_offsets, sorted_token, slot_row;
  at::Tensor expert_ids;     // [T, top_k] int64 / int32 when the plan has a route launch (the
                             // backend fills the three above itself) or row slots (the kernels
                             // read it directly), else undefined
};

// Routing with device-generic ATen ops (the same on CPU, MPS and in the Metal-on-CPU harness):
// a stable sort of the flattened (token, slot) pairs by expert groups each expert's rows
// contiguously. Ids outside [0, E) are the caller's to reject; here they only shift offsets
// (counts of clamped ids), so kernels never index out of bounds.
inline void trellis_route(const at::Tensor& expert_ids, int64_t E, TrellisMoeArgs& a) {
  const int64_t top_k = expert_ids.size(1);
  const at::Tensor flat = expert_ids.reshape({-1}).to(at::kLong);
  const at::Tensor order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  // scatter_add rather than bincount: it exists on every backend (MPS included).
  const at::Tensor counts =
      at::zeros({E}, flat.options()).scatter_add_(0, flat.clamp(0, E - 1), at::ones_like(flat));
  a.expert_offsets = at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)}).to(at::kInt).contiguous();
  a.sorted_token = at::div(order, top_k, "floor").to(at::kInt).contiguous();
  a.slot_row = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()))
                   .to(at::kInt).contiguous();
}

using TrellisGemmCall = PreparedCall<TrellisGemmArgs, TrellisPlan>;  // out: C [M, N] or W f32 [K, N]
using TrellisMoeCall = PreparedCall<TrellisMoeArgs, TrellisPlan>;    // out: y [T, hidden]

// The op's tensors of one MoE projection, in schema order: packed_indices, scales, grid, su, sv.
struct TrellisMoeWeights {
  std::array<at::Tensor, 5> gate, up, down;
};

// `caps`: the caps of the op's device (the backend's query).
TrellisGemmCall prepare_trellis_gemm(const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
                                     const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K,
                                     int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps);
TrellisGemmCall prepare_trellis_dequant(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& grid,
                                        const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N, int64_t bits,
                                        int64_t group_size, const DeviceCaps& caps);
TrellisMoeCall prepare_trellis_moe(const at::Tensor& x, const TrellisMoeWeights& w, const at::Tensor& expert_ids,
                                   const at::Tensor& expert_probs, int64_t intermediate, int64_t bits,
                                   int64_t group_size, const DeviceCaps& caps);

}  // namespace torch_marlin
