// Trellis codebook GEMM / MoE: launch parameters and format helpers shared byte-for-byte by the
// host (C++), the Metal kernels (MSL, also run by the Metal-on-CPU harness) and any other backend.
//
// Same rules as quant_gemm_params.h: fixed-width unsigned fields only, no pointers, no bool, no
// constructors. The planner (csrc/plan/trellis_plan.cpp) fills it once; every backend reads it.
#pragma once

#include "torch_marlin/portable.h"

TM_NAMESPACE_BEGIN

// ---- Format constants (docs/formats.md, "Trellis") ---------------------------------------------
// packed_indices uint8 [ceil(K/16), ceil(N/16), 16*16*bits/8]; inside a 16x16 tile the indices are
// row-major (i = local_k * 16 + local_n), a little-endian bit stream with index i at bits
// [i*bits, (i+1)*bits). One tile row (16 indices) is 2*bits whole bytes.
// w[k, n] = grid[idx] * scales[k / group_size, n] * su[k] * sv[n]; scales/grid/su/sv are f32.
#define TM_TRELLIS_TILE 16u
#define TM_TRELLIS_TILE_ELEMS 256u
#define TM_TRELLIS_MAX_BITS 4u
#define TM_TRELLIS_MAX_LEVELS 16u
// The CUDA lane layout of the same indices (docs/trellis.md, "CUDA lane layout"), made at load
// time for the CUDA kernels only: uint8 [ceil(tiles_k / 8), tiles_n, 256*bits]. Chunk (s, n) holds
// tile rows 8s..8s+7 of tile column n (rows past tiles_k: index 0); in it lane l (g = l/4, t = l%4)
// owns bytes [l*8*bits, (l+1)*8*bits), a little-endian stream of 32 fields of 2*bits bits: field
// 4j + p = idx[r][c] | idx[r+1][c] << bits of tile row j, c = 2g + (p & 1), r = 4t + 2(p >> 1):
// one field is one mma A register (two k of one column), so a lane decodes a register with a shift,
// a mask and one table lookup.
#define TM_TRELLIS_LANE_CHUNK_TILES 8u

// ---- Metal kernel geometry (the planner and the kernels read the same numbers) ------------------
#define TM_TRELLIS_THREADS 128u          // every GEMM / MoE threadgroup: 4 simdgroups of 32
#define TM_TRELLIS_DECODE_COLS 32u       // decode: output columns per threadgroup (two tile columns)
#define TM_TRELLIS_DECODE_K_TILES 8u     // decode: trellis tile rows of K staged per block (128 rows)
#define TM_TRELLIS_PREFILL_TILE 64u      // prefill / tiled MoE: 64x64 output tile
#define TM_TRELLIS_PREFILL_TILE_K 16u    // prefill: K rows per block = one trellis tile row
#define TM_TRELLIS_DEQUANT_THREADS TM_TRELLIS_TILE_ELEMS  // dequant: one 16x16 tile per threadgroup
#define TM_TRELLIS_COMBINE_THREADS 256u  // MoE combine: one output element per thread

// ---- CUDA kernel geometry (csrc/cuda/trellis_*.cu; the planner reads the same numbers) ----------
// The tensor-core kernel (trellis_mma.cu): 8 warps, warp w owns tile column tn0 + w (16 output
// columns), so a block covers 128 columns; K is staged 8 tile rows (128 rows) at a time.
#define TM_TRELLIS_CUDA_WARPS 8u
#define TM_TRELLIS_CUDA_THREADS 256u
#define TM_TRELLIS_CUDA_TILE_N 128u         // output columns per block (TM_TRELLIS_CUDA_WARPS tiles)
#define TM_TRELLIS_CUDA_STAGE_K_TILES 8u    // tile rows of K per pipeline stage
#define TM_TRELLIS_CUDA_DECODE_M 16u        // decode: one m16 mma tile of rows
#define TM_TRELLIS_CUDA_PREFILL_M 64u       // prefill: four m16 mma tiles of rows
// The streaming decode kernel (trellis_decode.cu; M <= 16, K % 8 == 0): the same 8 warps and 128
// columns, the indices in stages of 8 tile rows (128 rows) through a 4-stage cp.async ring. A
// block converts its K slice's activations into shared memory once, so the planner keeps a slice
// within TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m) tile rows (2048 rows for 8-row tiles,
// 1024 for 16: 32 KiB of fp16 at most).
#define TM_TRELLIS_CUDA_STREAM_STAGE_TILES 8u
#define TM_TRELLIS_CUDA_STREAM_STAGES 4u
#define TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m) ((tile_m) == 8u ? 128u : 64u)
// Its MoE instantiation (expert pointers live in registers, not in the parameter bank) is built for
// this many resident blocks per SM, and the planner slices the MoE's K to fill one such wave.
#define TM_TRELLIS_CUDA_STREAM_EXPERT_BLOCKS_PER_SM 3u
// The prefill kernel on sm_90a (trellis_wgmma.cu; fp16/bf16, lane layout): a producer warpgroup
// and two consumer warpgroups over TM_TRELLIS_CUDA_TILE_N columns and 128 or 256 rows of A, K in
// stages of one lane-chunk row (TM_TRELLIS_LANE_CHUNK_TILES tile rows, 128 k). Its activations are
// first rewritten by a kernel of TM_TRELLIS_CUDA_ELEMWISE_THREADS threads a block, a thread per 16 k.
#define TM_TRELLIS_CUDA_WGMMA_THREADS 384u
// dequant_trellis on CUDA (trellis_dequant.cu): a block of 256 threads owns 16 tiles of one tile
// row; a thread writes one 16-column row of one tile.
#define TM_TRELLIS_CUDA_DEQUANT_TILES 16u
#define TM_TRELLIS_CUDA_SIMT_THREADS 128u   // fp32 kernel: one column per thread
#define TM_TRELLIS_CUDA_SIMT_M 16u          // fp32 kernel: rows per pass (fp32 accumulators a thread)
#define TM_TRELLIS_CUDA_ELEMWISE_THREADS 256u  // split-K reduction and MoE combine
#define TM_TRELLIS_CUDA_ROUTE_THREADS 256u     // MoE routing in one block ...
#define TM_TRELLIS_CUDA_ROUTE_MAX_ROWS 1024u   // ... for tokens * top_k up to this (ATen sort above)
#define TM_TRELLIS_CUDA_ROUTE_MAX_EXPERTS 4096u  // ... and up to this many experts

// Launch parameters of every trellis kernel. For the dense GEMM: C[M,N] = A[M,K] @ W[K,N].
// For the MoE (moe_trellis): M = tokens, K = hidden size, N = intermediate size; gate/up are
// [K, N] per expert, down is [N, K] per expert.
struct TrellisParams {
  tm_u32 M;             // rows of A / tokens
  tm_u32 K;             // reduction length of the (gate/up) GEMM; any positive value
  tm_u32 N;             // output columns (intermediate size for the MoE); any positive value
  tm_u32 bits;          // 2, 3 or 4
  tm_u32 n_levels;      // 1 << bits (the grid length)
  tm_u32 group_size;    // K rows sharing a scale; multiple of 16
  tm_u32 tiles_k;       // ceil(K / 16)
  tm_u32 tiles_n;       // ceil(N / 16)
  tm_u32 packed_bytes;  // bytes per 16x16 tile = 32 * bits
  tm_u32 n_groups;      // ceil(K / group_size)
  tm_u32 tile_m;        // output tile rows of the chosen kernel
  tm_u32 tile_n;        // output tile columns of the chosen kernel
  tm_u32 m_tiles;       // ceil(M / tile_m)
  tm_u32 n_tiles;       // ceil(N / tile_n)
  // MoE only (0 for the dense GEMM)
  tm_u32 num_experts;   // E
  tm_u32 top_k;         // experts per token
  tm_u32 down_tiles_k;  // ceil(N / 16): the down projection reduces over the intermediate size
  tm_u32 down_tiles_n;  // ceil(K / 16)
  tm_u32 down_n_groups; // ceil(N / group_size)
  tm_u32 max_rows;      // M * top_k: rows of the routed (expert-sorted) buffers
  tm_u32 tile_k;        // K rows per block of the chosen kernel (decode 128, tiled 16)
  tm_u32 k_vec4;        // 1 when K % 4 == 0: rows of A / x (and su) are read 4 elements at a time
  tm_u32 down_k_vec4;   // MoE: 1 when N % 4 == 0, the same for rows_h and the down su
};

#if TM_HOST_CXX
static_assert(sizeof(TrellisParams) == 23 * 4, "TrellisParams must stay 23 x u32: MSL mirrors it");
static_assert(alignof(TrellisParams) == 4, "TrellisParams alignment");
#endif

// ---- Portable index unpacking (host and MSL agree bit for bit) ----------------------------------

// K padded to whole lane chunks (TM_TRELLIS_LANE_CHUNK_TILES tile rows): the rows the lane layout
// covers, and the row length of the CUDA wgmma prefill's rewritten activations.
TM_FN tm_u32 trellis_lane_padded_k(tm_u32 tiles_k) {
  return (tiles_k + TM_TRELLIS_LANE_CHUNK_TILES - 1u) / TM_TRELLIS_LANE_CHUNK_TILES * TM_TRELLIS_LANE_CHUNK_TILES *
         TM_TRELLIS_TILE;
}

// Byte offset of tile (tk, tn) in a [tiles_k, tiles_n, packed_bytes] array.
TM_FN tm_u32 trellis_tile_offset(tm_u32 tk, tm_u32 tn, tm_u32 tiles_n, tm_u32 packed_bytes) {
  return (tk * tiles_n + tn) * packed_bytes;
}

// Index `i` (0..255) of a tile whose bytes start at `tile`. A 3-bit index may span two bytes; the
// second byte is always inside the tile because the stream ends exactly at a byte boundary.
#if defined(__METAL_VERSION__)
TM_FN tm_u32 trellis_unpack_index(device const uchar* tile, tm_u32 i, tm_u32 bits) {
#else
TM_FN tm_u32 trellis_unpack_index(const uint8_t* tile, tm_u32 i, tm_u32 bits) {
#endif
  const tm_u32 bit = i * bits;
  const tm_u32 byte = bit >> 3u;
  const tm_u32 shift = bit & 7u;
  tm_u32 v = tm_u32(tile[byte]) >> shift;
  if (shift + bits > 8u) v |= tm_u32(tile[byte + 1u]) << (8u - shift);
  return v & ((1u << bits) - 1u);
}

TM_NAMESPACE_END
