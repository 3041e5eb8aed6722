// Host-side interface of the CUDA trellis kernels (docs/trellis.md, "CUDA"): one family per file,
// trellis_decode.cu (fp16/bf16 streaming decode GEMM), trellis_wgmma.cu (fp16/bf16 prefill on
// sm_90a), trellis_mma.cu (fp16/bf16 tensor-core GEMM:
// decode where K % 8 != 0, fused tiles, the MoE's expert stages),
// trellis_simt.cu (fp32 activations), trellis_dequant.cu (dense W) and trellis_reduce.cu (the
// ordered sums of K slices and of the MoE's top_k rows). trellis_launch.cu turns a TrellisPlan
// and the op's checked arguments into TrellisKernelArgs and calls the entries below.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "plan/trellis_plan.h"

namespace torch_marlin {
namespace cuda_backend {

// One trellis matrix W[K, N] (docs/formats.md), with a leading expert dim when the strides are
// non-zero: expert e's tensors start at base + e * stride (elements; bytes for packed).
struct TrellisMatrixPtrs {
  const uint8_t* packed;
  const float* scales;
  const float* grid;
  const float* su;
  const float* sv;
  uint64_t packed_stride, scales_stride;
  uint32_t grid_stride, su_stride, sv_stride;
};

// Arguments of the GEMM kernels (trellis_mma.cu, trellis_simt.cu), by value. Dense GEMM: rows
// [0, M) of A, one matrix, grid.z = 1. MoE: grid.z = E (down) or 2E (gate for z < E, up above);
// block z's rows are [offsets[e], offsets[e+1]) of the expert-sorted row space.
struct TrellisKernelArgs {
  TrellisMatrixPtrs w[2];      // w[1]: the MoE's up projection
  const void* A;               // T rows (GEMM, MoE gate/up; fp32 for the simt kernel), or the
                               // MoE gate's fp32 partials (down: A = silu(sum gate) * sum up)
  const float* A2;             // MoE down: the up partials
  uint64_t a_part_stride;      // MoE down: elements between two K slices' partials of gate / up
  uint32_t a_parts;            // MoE down: K slices of gate / up to sum (in slice order)
  uint32_t lda;                // elements between rows of A (and A2)
  const int32_t* row_map;      // MoE gate/up: the token of each sorted row; nullptr: row itself
  const int32_t* offsets;      // MoE: [E + 1] expert row ranges; nullptr: rows [0, M)
  const int32_t* active_experts;  // MoE routed in one launch: expert of each slot (-1: none), else
                                  // nullptr and slot = expert
  const void* row_experts;     // MoE row slots (streaming decode): expert_ids [rows] (int64 when
                               // row_experts_int64, else int32), slot = routed row, or nullptr
  uint32_t row_experts_int64;
  uint32_t num_experts;        // MoE row slots: ids are clamped to [0, num_experts)
  uint32_t top_k;              // MoE row slots: routed row r is token r / top_k
  void* out[2];                // C (T) or fp32 rows; out[1]: the MoE's up rows
  uint64_t out_part_stride;    // fp32 partials: elements between K slices
  uint32_t out_f32;            // 1: out holds fp32 [k_parallel][rows][ldc] (sv applied), 0: T C
  uint32_t ldc;
  uint32_t M, K, N, group_size, tiles_k, tiles_n, n_groups;
  uint32_t k_slice_tiles, k_parallel, m_tiles;
  uint32_t experts;            // expert slots per matrix (grid.z, halved with two matrices): E,
                               // min(E, rows) with active_experts, rows with row_experts, 1 for
                               // the GEMM
  uint32_t stage_groups;       // streaming decode: 1 when scale groups are whole stages (the plan's
                               // cuda_stream_stage_groups)
};

// launch.grid / threads / k_parallel come from the plan; tile_m 16 or 64 selects the decode or
// the fused-tiles instantiation. T is __half or __nv_bfloat16.
template <typename T>
void launch_trellis_mma(const KernelLaunch& launch, uint32_t bits, uint32_t tile_m, bool swiglu,
                        const TrellisKernelArgs& a, cudaStream_t stream);
// The streaming decode GEMM (trellis_decode.cu): tile_m 8 or 16 rows, K % 8 == 0; the indices in
// the canonical tiles or (lanes, dense only) the CUDA lane layout. With offsets set it runs the
// MoE's decode stages (M = tokens * top_k <= tile_m): gate/up, or down when A2 is set.
template <typename T>
void launch_trellis_stream(const KernelLaunch& launch, uint32_t bits, uint32_t tile_m, bool lanes,
                           const TrellisKernelArgs& a, cudaStream_t stream);
// The prefill GEMM on sm_90a (trellis_wgmma.cu; lane layout, tile_m 128 or 256 rows): `act` rewrites
// A into Ap ([M, K padded to whole lane chunks] in T: times su, k-permuted), `main` multiplies.
template <typename T>
void launch_trellis_wgmma(const KernelLaunch& act, const KernelLaunch& main, uint32_t bits, uint32_t tile_m,
                          const TrellisKernelArgs& a, T* Ap, cudaStream_t stream);
void launch_trellis_simt(const KernelLaunch& launch, uint32_t bits, bool swiglu, const TrellisKernelArgs& a,
                         cudaStream_t stream);
// W[K, N] in T (float: the dequant op; __half / __nv_bfloat16: the dequant_blas family's operand).
template <typename T>
void launch_trellis_dequant(const KernelLaunch& launch, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                            cudaStream_t stream);
// The same from indices in the CUDA lane layout: a warp per lane chunk.
template <typename T>
void launch_trellis_dequant_lanes(const KernelLaunch& launch, const TrellisParams& p, const TrellisMatrixPtrs& w,
                                  T* W, cudaStream_t stream);
// MoE routing in one block (rows = tokens * top_k <= TM_TRELLIS_CUDA_ROUTE_MAX_ROWS): expert_offsets
// [E + 1], sorted_token and slot_row as trellis_route (csrc/ops/trellis.h) makes them, and
// active [min(E, rows)]: the experts with rows in increasing order, then -1.
void launch_trellis_route(const KernelLaunch& launch, const void* ids, bool ids_int64, uint32_t rows,
                          uint32_t top_k, uint32_t experts, int32_t* offsets, int32_t* sorted_token,
                          int32_t* slot_row, int32_t* active, cudaStream_t stream);
// C[i] = sum over s < parts of ws[s * count + i], in s order, rounded once to T (float, __half, __nv_bfloat16).
template <typename T>
void launch_trellis_reduce(const KernelLaunch& launch, const float* ws, uint32_t parts, uint64_t count, T* C,
                           cudaStream_t stream);
// y[t, h] = sum_j probs[t, j] * sum_s rows_y[s][slot_row[t * top_k + j], h], j and s in order
// (slot_row nullptr: row t * top_k + j).
template <typename T>
void launch_trellis_combine(const KernelLaunch& launch, const float* rows_y, uint32_t parts, uint64_t part_stride,
                            const float* probs, const int32_t* slot_row, uint32_t tokens, uint32_t top_k,
                            uint32_t hidden, T* y, cudaStream_t stream);

}  // namespace cuda_backend
}  // namespace torch_marlin
