// Planner entries of the trellis op family (gemm_trellis, dequant_trellis, moe_trellis).
// Same contract as plan_quant_gemm: portable C++17, no torch; the CPU kernels, the MPS encoder
// and the Metal-on-CPU harness all execute the plan they are given and never re-decide.
#pragma once

#include <cstdint>
#include <string>

#include "plan/plan.h"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {

// How a dense matrix's indices are laid out (docs/trellis.md, "CUDA lane layout"): the canonical
// 16x16 tiles every backend and checkpoint uses, or the CUDA kernels' lane chunks made at load time.
enum class TrellisIndexLayout { Tiles = 0, Lanes = 1 };

struct TrellisPlan {
  // Decode (M <= 16, GEMV-style) or the backend's prefill family: Metal StagedTiles (64x64 tiles,
  // double-buffered A and dequantized-B tiles in threadgroup memory), CPU DequantBlas (column
  // chunks dequantized once, one BLAS call each). The MoE reports Decode when every expert's row
  // count fits one decode chunk in the worst case (tokens * top_k <= 16), else the prefill family
  // (experts past 16 routed rows take it). Dequant plans: Auto (no GEMM).
  KernelFamily family = KernelFamily::Decode;
  DeviceCaps caps;  // what the plan was made for
  // Main: the GEMM or the dequant. CUDA: Reduce sums a GEMM's K slices (Main's k_parallel > 1);
  // Activations (wgmma prefill) rewrites the activations for the kernel's TMA (times su, k-permuted
  // to the lane layout's order, K padded to whole lane chunks). The MoE: Main the gate/up + SwiGLU
  // stage, Down, Combine; CUDA Route where the routing runs in one launch (tokens * top_k <=
  // TM_TRELLIS_CUDA_ROUTE_MAX_ROWS; else ATen ops route, trellis_route in csrc/ops/trellis.h, as on
  // every backend); Metal, only when tokens * top_k > 16, TiledGate, TiledUp, TiledDown: 64x64-tile
  // kernels for experts with more than 16 routed rows (the GEMV stages skip those).
  LaunchList launches;
  // CUDA MoE decode at one token: one expert slot per routed row (t * top_k + j), whose expert the
  // kernels read from expert_ids, so neither the routing launch nor its indirections run (a
  // token's top_k experts are distinct, so no expert's weights are read twice).
  bool moe_row_slots = false;
  uint32_t k_chunk = 0;   // CPU: K rows dequantized per panel (bounded cache footprint)
  // CPU decode: the AVX-512 kernel (caps.avx512), else the AVX2 one (caps.avx2), else the portable
  // one; at most one of the two is set.
  bool cpu_avx512 = false;
  bool cpu_avx2 = false;
  // CUDA fp16/bf16 decode: the streaming kernel (trellis_decode.cu; K % 8 == 0, its 16-byte
  // activation copies), else the tensor-core kernel of the fused tiles at one m16 tile.
  bool cuda_stream_decode = false;
  // The streaming decode's scale groups are whole stages (group_size a multiple of 128 rows): the
  // kernel folds scales only at a stage's start and runs a stage's tiles without a branch.
  bool cuda_stream_stage_groups = false;
  // The layout of the indices the plan reads: Lanes (TM_TRELLIS_LANE_CHUNK_TILES) on CUDA only,
  // read by the streaming decode and the lane dequant kernel.
  TrellisIndexLayout index_layout = TrellisIndexLayout::Tiles;
  TrellisParams params{};
};

const char* index_layout_name(TrellisIndexLayout layout);
TrellisIndexLayout parse_index_layout(const std::string& name);

// The layout a module should keep a K x N matrix's indices in on a device with these caps: Lanes on
// CUDA where the streaming decode reads them (K % 8 == 0), Tiles everywhere else.
TrellisIndexLayout trellis_index_layout(int64_t K, int64_t N, int64_t bits, const DeviceCaps& caps);

// The family trellis prefill runs on a backend: Metal StagedTiles, CPU DequantBlas, CUDA FusedTiles
// (fp16/bf16; fp32 activations run Simt at every M on CUDA).
KernelFamily trellis_prefill_family(Backend b);

// C[M,N] = A[M,K] @ W[K,N]. M <= 16 -> gemm_trellis_packed_decode, else gemm_trellis_packed
// (`force` Decode or trellis_prefill_family overrides the policy for tests; Decode with M > 16 is
// rejected).
// Indices in the lane layout plan on CUDA only: decode (fp16/bf16, M <= 16, K % 8 == 0) on the
// streaming kernel, everything else dequant_blas through the lane dequant kernel.
TrellisPlan plan_trellis_gemm(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, DType dtype,
                              const DeviceCaps& caps, KernelFamily force = KernelFamily::Auto,
                              TrellisIndexLayout layout = TrellisIndexLayout::Tiles);

// W[K,N] (f32) from the packed format: one thread per element of a 16x16 tile.
TrellisPlan plan_trellis_dequant(int64_t K, int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps,
                                 TrellisIndexLayout layout = TrellisIndexLayout::Tiles);

// y[T,H] = sum_j p[t,j] * down_e( silu(gate_e(x_t)) * up_e(x_t) ), e = expert_ids[t,j].
TrellisPlan plan_trellis_moe(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                             int64_t top_k, int64_t bits, int64_t group_size, DType dtype, const DeviceCaps& caps);

}  // namespace torch_marlin
