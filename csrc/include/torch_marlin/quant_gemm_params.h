// FP4 E2M1 / INT4 fused-dequant GEMM: the launch parameters and format helpers shared
// byte-for-byte by the host (C++), the Metal kernels (MSL) and the CUDA kernels.
//
// Included by MSL (__METAL_VERSION__), nvcc (__CUDACC__) and plain C++. Keep it to the common
// subset: fixed-width unsigned fields only, no pointers, no bool (its size differs), no
// constructors. The host fills the struct once in the planner and every backend reads the same
// fields, so a launch-geometry bug shows up identically in the Metal-on-CPU harness.
#pragma once

#include "torch_marlin/portable.h"

TM_NAMESPACE_BEGIN

// ---- Format constants (docs/formats.md) ------------------------------------------------------
// B_packed is int32 [K/8, N]: 8 four-bit codes along K per word, LSB first
// (bits 0-3 = row k+0 ... bits 28-31 = row k+7). The GPTQ qweight layout.
#define TM_PACK_FACTOR 8u
// INT4 zero points: uint8 [K/group_size, N], value 0..15; w = (q - z) * s. S4 is z = 8.
#define TM_U4_SYMMETRIC_ZERO 8u

// Which weight format a kernel dequantizes.
#define TM_FORMAT_FP4 0u
#define TM_FORMAT_U4 1u
// Affine INT4: float offsets [K/group_size, N] in the scales' dtype; w = q * s + b, q in 0..15.
#define TM_FORMAT_AFFINE 2u

// ---- CUDA decode kernel geometry (csrc/cuda/decode.cu), read by plan_cuda.cpp too --------------
// A block is 2, 4 or 8 warps (the plan's threads; 8 above 16 rows) over TM_CUDA_DECODE_TILE_N
// columns. Warps resident per SM (the kernel's __launch_bounds__) by tile_m, whatever the block
// size: 64-row tiles need up to 255 registers a thread, the others 128.
#define TM_CUDA_DECODE_MAX_WARPS 8u
#define TM_CUDA_DECODE_TILE_N 32u
#define TM_CUDA_DECODE_WARPS_PER_SM(tile_m) ((tile_m) == 64u ? 8u : 16u)
// Most K slices the decode plan sums through a thread-block cluster (sm_90, ReduceKind::Cluster);
// more go through global memory (ReduceKind::LastBlock). 4-block clusters beat the global path on
// the H200 (4096 x 1024, M = 1, 4 slices: 4.3 against 7.5 us); 8-block clusters lose to it
// (benchmarks/notes/cuda-tuning.md CUDA-DECODE-CLUSTER).
#define TM_CUDA_DECODE_MAX_CLUSTER_SLICES 4u
// ---- CUDA wgmma kernel geometry (sm_90a) -------------------------------------------------------
// Two warpgroups per block over TM_CUDA_WGMMA_TILE_N columns and 128 or 256 rows (or, with 128
// rows, TM_CUDA_WGMMA_WIDE_TILE_N columns), K in stages of TM_CUDA_WGMMA_K_STEP rows (K and every K
// slice a multiple of it, group_size of 32), 1 block per SM.
#define TM_CUDA_WGMMA_TILE_N 128u
#define TM_CUDA_WGMMA_WIDE_TILE_N 256u
#define TM_CUDA_WGMMA_K_STEP 64u
#define TM_CUDA_WGMMA_THREADS 256u
// Most K slices of the wgmma kernels: they always reduce through a thread-block cluster (sm_90a).
#define TM_CUDA_WGMMA_MAX_SLICES 4u
// ---- CUDA warp-specialized wgmma kernel (wgmma_ws, sm_90a) -------------------------------------
// A producer warpgroup (TMA) and NC = 2 or 3 consumer warpgroups of 64 weight columns each (tile_n =
// 64 NC, at most TM_CUDA_WGMMA_WS_MAX_TILE_N; 128 (NC + 1) threads) over 64, 128 or 256 activation
// rows (256-row tiles: 2 consumers); 64-k stages under one scale row (group_size % 64 == 0).
#define TM_CUDA_WGMMA_WS_MAX_TILE_N 192u

// ---- Metal decode kernel geometry (metal/decode.metal), read by plan_metal.cpp too --------------
// A lane owns TM_METAL_DECODE_LANE_COLS adjacent columns (one 16-byte uint4 of packed words per
// 8 K rows); the 32 lanes of a simdgroup cover TM_METAL_DECODE_TILE_N columns, and the
// TM_METAL_DECODE_SIMDGROUPS simdgroups of a threadgroup split its K slice. Row counts (tile_m)
// are instantiated for 1, 2, 4, 8 and 16 rows, the vector-load kernels need N % 4 == 0.
#define TM_METAL_DECODE_LANE_COLS 4u
#define TM_METAL_DECODE_TILE_N 128u
#define TM_METAL_DECODE_SIMDGROUPS 4u
#define TM_METAL_DECODE_THREADS (TM_METAL_DECODE_SIMDGROUPS * 32u)

// ---- Metal prefill tile geometry (metal/fused_tiles.metal, striped.metal, staged_tiles.metal), read
// by plan_metal.cpp too -------------------------------------------------------------------------
// A 64x64 output tile per threadgroup of 4 simdgroups (each 32x32). K advances in steps of
// TM_METAL_PIPELINED_TILE_K(bytes of the activation dtype) rows in the two-stage pipelined kernels
// (fused, striped): 32 for fp16 / bf16, 16 for fp32, so that two stages of A and dequantized B
// (64 x (k_step + 16 bytes of padding) elements each) take 20 KiB in every dtype. The one-stage
// staged kernel steps TM_METAL_STAGED_TILE_K rows in every dtype (18 KiB for fp32).
#define TM_METAL_ELEMENTWISE_THREADS 256u  // metal/dequant.metal and metal/reduce.metal: one element (word) per thread
#define TM_METAL_THREADS 128u  // threads of every prefill threadgroup: 4 simdgroups of 32
#define TM_METAL_TILE_M 64u
// Rows of the small prefill tile (fused and striped, M <= 32): 32 x 64, the 4 simdgroups as 1 x 4
// of 32 x 16, so M = 17..32 computes at most twice its rows instead of up to 3.8 times.
#define TM_METAL_SMALL_TILE_M 32u
#define TM_METAL_TILE_N 64u
#define TM_METAL_PIPELINED_TILE_K(elem_bytes) ((elem_bytes) == 4u ? 16u : 32u)
#define TM_METAL_STAGED_TILE_K 32u

// ---- Launch parameters -------------------------------------------------------------------------
struct QuantGemmParams {
  tm_u32 M;            // rows of A and C
  tm_u32 K;            // reduction length; multiple of 8 and of group_size
  tm_u32 N;            // columns of B and C (any value; edge tiles are masked)
  tm_u32 group_size;   // K rows sharing one scale (and zero point or offset); multiple of 8
  tm_u32 tile_m;       // output tile rows of the chosen kernel
  tm_u32 tile_n;       // output tile columns of the chosen kernel
  tm_u32 m_tiles;      // ceil(M / tile_m)
  tm_u32 n_tiles;      // ceil(N / tile_n)
  tm_u32 k_parallel;   // number of K slices; 1 = no split, partials go straight to C
  tm_u32 k_slice_len;  // K rows per slice (multiple of the kernel's K step); last slice may be short
  tm_u32 num_groups;   // threadgroups / blocks in a 1-D (striped) grid; 0 for 2-D grids
  tm_u32 has_bias;     // 1: C += bias[N] in the epilogue (after the K reduction)
};

#if TM_HOST_CXX
static_assert(sizeof(QuantGemmParams) == 12 * 4, "QuantGemmParams must stay 12 x u32: MSL/CUDA mirror it");
static_assert(alignof(QuantGemmParams) == 4, "QuantGemmParams alignment");
#endif

// Parameters of the deterministic K-parallel reduction (second dispatch):
// C[m, n] = sum_{s=0}^{k_parallel-1} workspace[s][m][n] (+ bias[n]), summed in slice order.
struct QuantReduceParams {
  tm_u32 M;
  tm_u32 N;
  tm_u32 k_parallel;
  tm_u32 has_bias;
};

#if TM_HOST_CXX
static_assert(sizeof(QuantReduceParams) == 4 * 4, "QuantReduceParams must stay 4 x u32");
#endif

// ---- Portable reference dequant (host, CUDA, MSL). Kernels may use faster bit tricks but must
// agree with these bit for bit. ------------------------------------------------------------------

// FP4 E2M1 (bias 1): s eem. E=0 -> M * 0.5; E>0 -> 2^(E-1) * (1 + M/2). Exact in fp16/bf16/fp32.
TM_FN float fp4_e2m1_to_float(tm_u32 code) {
  const tm_u32 e = (code >> 1) & 3u;
  const tm_u32 m = code & 1u;
  const float mag = (e == 0u) ? 0.5f * float(m) : float(1u << (e - 1u)) * (1.0f + 0.5f * float(m));
  return (code & 8u) ? -mag : mag;
}

// The 4-bit code of row k (relative to the word's first row) in a packed word.
TM_FN tm_u32 tm_nibble(tm_u32 word, tm_u32 row_in_word) { return (word >> (4u * row_in_word)) & 15u; }

TM_NAMESPACE_END
