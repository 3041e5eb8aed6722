// Trellis codebook GEMM for Apple GPUs (MSL 3.0; bfloat needs MSL 3.1).
//
//   C[M, N] = A[M, K] @ W[K, N],  W[k, n] = grid[idx[k, n]] * scales[k / group_size, n] * su[k] * sv[n]
//
// Format: docs/formats.md ("Trellis"): packed_indices uint8 [ceil(K/16), ceil(N/16), 32*bits],
// 16x16 tiles, indices row-major inside a tile, LSB-first bit stream (trellis_params.h unpacks).
// Launch geometry comes from the planner (csrc/plan/trellis_plan.cpp); every kernel reads it from
// TrellisParams. All accumulation is fp32; C is rounded to the activation dtype once.
//
// Kernels (host names <stem>_<dtype>, dtype in {half, float, bfloat}):
//   gemm_trellis_packed_decode_*  M <= 16: the decode core of trellis_msl.h (a threadgroup owns 32
//                                 columns for all rows; K blocks of 128 rows staged with 16-byte
//                                 loads, each index byte read once; codebook in registers), the 4
//                                 simdgroups' partials met in a fixed order. Grid (ceil(N/32), 1).
//   gemm_trellis_packed_*         prefill: the tiled core of trellis_msl.h, 64x64 output tile, 4
//                                 simdgroups as 2x2 of 32x32, K blocks of one tile row (16),
//                                 double-buffered padded A and decoded-B tiles (21.5 KiB fp32,
//                                 11 KiB half / bfloat). Grid (ceil(N/64), ceil(M/64)).
//   dequant_trellis               dense f32 W, one thread per element of a 16x16 tile.
//                                 Grid (tiles_n, tiles_k), 256 threads.
//
// Portability rules (the Metal-on-CPU harness compiles this file as C++): csrc/include/torch_marlin/msl_kernel.h.
#include "torch_marlin/trellis_msl.h"

using namespace metal;
using namespace torch_marlin;

template <typename T>
[[kernel]] void gemm_trellis_packed_decode(device const T* A [[buffer(0)]], device const uchar* packed [[buffer(1)]],
                                           device const float* scales [[buffer(2)]],
                                           device const float* grid [[buffer(3)]], device const float* su [[buffer(4)]],
                                           device const float* sv [[buffer(5)]], device T* C [[buffer(6)]],
                                           constant TrellisParams& p [[buffer(7)]],
                                           uint3 tgid [[threadgroup_position_in_grid]],
                                           uint lid [[thread_index_in_threadgroup]],
                                           uint sgid [[simdgroup_index_in_threadgroup]],
                                           uint lane [[thread_index_in_simdgroup]]) {
  // 16 KiB of activations (the meet reuses it) + 4 KiB of index bytes + 1 KiB of su.
  TM_THREADGROUP_ARRAY(float, a_s, [2 * kTrDecodeRows * kTrDecodeK]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * kTrRawWords]);
  TM_THREADGROUP_ARRAY(float, su_s, [2 * kTrDecodeK]);
  const TrMat w = tr_mat(p);
  const TrDecodeMat mats[1] = {{packed, scales, grid, su}};
  const uint col0 = tgid.x * kTrDecodeCols;
  float acc[kTrDecodeRows];
  TM_UNROLL
  for (uint m = 0; m < kTrDecodeRows; ++m) acc[m] = 0.0f;
  tr_decode_core<T, false, 1>(A, nullptr, 0u, min(p.M, kTrDecodeRows), mats, w, col0, a_s, raw_s, su_s, lid, sgid,
                              lane, acc);
  TM_UNROLL
  for (uint m = 0; m < kTrDecodeRows; ++m) a_s[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[m];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_decode_meet]
  for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
    const uint m = i / kTrDecodeCols;
    const uint c = i % kTrDecodeCols;
    const uint col = col0 + c;
    if (m < p.M && col < p.N) C[m * p.N + col] = T(tr_meet(a_s, m, c) * sv[col]);
  }
}

template <typename T>
[[kernel]] void gemm_trellis_packed(device const T* A [[buffer(0)]], device const uchar* packed [[buffer(1)]],
                                    device const float* scales [[buffer(2)]], device const float* grid [[buffer(3)]],
                                    device const float* su [[buffer(4)]], device const float* sv [[buffer(5)]],
                                    device T* C [[buffer(6)]], constant TrellisParams& p [[buffer(7)]],
                                    uint3 tgid [[threadgroup_position_in_grid]],
                                    uint lid [[thread_index_in_threadgroup]],
                                    uint sgid [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  // Two padded (A 64x16, B 16x64) stages; the epilogue reuses the front as fp32 staging.
  TM_THREADGROUP_ARRAY(T, smem, [2 * kTrStageElems]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * (kTrRawRowWords + 4)]);  // the B simdgroups' index bytes
  const TrMat w = tr_mat(p);
  const uint row0 = tgid.y * kTrTileM;
  const uint col0 = tgid.x * kTrTileN;
  simdgroup_matrix<float, 8, 8> acc[16];
  tr_tiled_core<T, false>(A, nullptr, 0u, p.M, packed, scales, grid, su, w, row0, col0, smem, raw_s, lid, sgid, lane,
                          acc);

  // Epilogue: each simdgroup stages one 8x8 fp32 fragment at a time, masked store with sv.
  const uint sg_first_row = row0 + (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  const uint mi_count = sg_first_row >= p.M ? 0u : min(4u, (p.M - sg_first_row + 7u) / 8u);
  threadgroup float* stage = (threadgroup float*)smem + sgid * 64u;
  // A constant trip count with the row guard inside: every acc[] index is a constant.
  TM_UNROLL
  for (uint f = 0; f < 16u; ++f) {
    const uint mi = f / 4u, ni = f % 4u;
    if (mi < mi_count) {  // uniform across the simdgroup
      simdgroup_store(acc[f], stage, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_epilogue_ready]
      for (uint e = lane; e < 64u; e += 32u) {
        const uint m = sg_first_row + mi * 8u + e / 8u;
        const uint n = col0 + sg_col + ni * 8u + e % 8u;
        if (m < p.M && n < p.N) C[m * p.N + n] = T(stage[e] * sv[n]);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_epilogue_free]
    }
  }
}

// ---- standalone dequant: W[K, N] f32 ------------------------------------------------------------
// ((grid * scale) * su) * sv: the reference's order of the fp32 products. A template (only
// TW = float is instantiated) so every kernel goes through the same instantiation hook.
template <typename TW>
[[kernel]] void dequant_trellis_kernel(device const uchar* packed [[buffer(0)]],
                                       device const float* scales [[buffer(1)]], device const float* grid [[buffer(2)]],
                                       device const float* su [[buffer(3)]], device const float* sv [[buffer(4)]],
                                       device TW* W [[buffer(5)]], constant TrellisParams& p [[buffer(6)]],
                                       uint3 tgid [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]],
                                       uint sgid [[simdgroup_index_in_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  const uint k = tgid.y * TM_TRELLIS_TILE + lid / TM_TRELLIS_TILE;
  const uint n = tgid.x * TM_TRELLIS_TILE + lid % TM_TRELLIS_TILE;
  if (lid >= TM_TRELLIS_TILE_ELEMS || k >= p.K || n >= p.N) return;
  device const uchar* tile = packed + trellis_tile_offset(tgid.y, tgid.x, p.tiles_n, p.packed_bytes);
  const uint idx = trellis_unpack_index(tile, lid, p.bits);
  W[k * p.N + n] = TW(((grid[idx] * scales[(k / p.group_size) * p.N + n]) * su[k]) * sv[n]);
}

// ---- instantiations: the host builds the same names (trellis_plan.cpp) ---------------------------
#define TM_TRELLIS_INSTANTIATE_DTYPE(tname, T)                                                \
  TM_INSTANTIATE("gemm_trellis_packed_decode_" #tname, gemm_trellis_packed_decode<T>)         \
  TM_INSTANTIATE("gemm_trellis_packed_" #tname, gemm_trellis_packed<T>)

TM_TRELLIS_INSTANTIATE_DTYPE(half, half)
TM_TRELLIS_INSTANTIATE_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_TRELLIS_INSTANTIATE_DTYPE(bfloat, bfloat)
#endif
TM_INSTANTIATE("dequant_trellis", dequant_trellis_kernel<float>)
