// The fused-dequant 64x64 output tile: the body of marlin_gemm_fused_* (metal/fused_tiles.metal,
// one tile per threadgroup) and of marlin_gemm_striped_* (metal/striped.metal, a run of
// (tile, K slice) work units per threadgroup). MSL only.
//
// Simdgroup s owns rows (s/2)*32.. +32 and columns (s%2)*32.. +32 of the tile: a 4x4 grid of 8x8
// fp32 accumulators. Per 8-row K step, each lane dequantizes one column of the simdgroup's 8x32 B
// slab (one packed word, coalesced across the 32 lanes) into the simdgroup's own staging area,
// so only simdgroup barriers guard that stage. Staging 8x32 with all lanes (rather than 8x8 with
// lanes 0-7) reads the same words with 4x fewer barriers and no idle lanes.
#pragma once

#include "torch_marlin/quant_gemm_msl.h"

namespace torch_marlin {

constant constexpr uint kAStride = kTileK + 8;  // A tile row pitch: the padding spreads banks
constant constexpr uint kStageCols = 32;        // a simdgroup's B slab is 8 x 32

// Threadgroup arrays the caller declares (TM_THREADGROUP_ARRAY):
//   a_tile  T[kTileM * kAStride], b_stage T[kSimdgroups * 8 * kStageCols], c_stage float[kSimdgroups * 64]
template <uint FMT, typename T>
inline void fused_tile_impl(device const T* A, device const uint* B, device const T* scales, device const uchar* zeros,
                            device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                            threadgroup T* a_tile, threadgroup T* b_stage, threadgroup float* c_stage, uint tile_row,
                            uint tile_col, uint k_slice, uint lid, uint sgid, uint lane) {
  const uint row0 = tile_row * kTileM;
  const uint col0 = tile_col * kTileN;
  const uint k_begin = k_slice * p.k_slice_len;
  const uint k_end = min(p.K, k_begin + p.k_slice_len);
  const uint sg_row = (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  // 8-row fragments of this simdgroup that hold real rows (uniform across the simdgroup).
  const uint sg_first_row = row0 + sg_row;
  const uint mi_count = sg_first_row >= p.M ? 0u : min(4u, (p.M - sg_first_row + 7u) / 8u);
  const uint b_col = col0 + sg_col + lane;
  threadgroup T* stage = b_stage + sgid * 8u * kStageCols;

  simdgroup_matrix<float, 8, 8> acc[4][4];
  for (uint mi = 0; mi < 4u; ++mi)
    for (uint ni = 0; ni < 4u; ++ni) acc[mi][ni] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint kb = k_begin; kb < k_end; kb += kTileK) {
    const uint k_rows = min(kTileK, k_end - kb);  // a multiple of 8
    for (uint i = lid; i < kTileM * kTileK; i += kThreads) {
      const uint r = i / kTileK;
      const uint c = i % kTileK;
      const uint m = row0 + r;
      a_tile[r * kAStride + c] = (m < p.M && c < k_rows) ? A[m * p.K + kb + c] : T(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:fused_a_ready]
    for (uint kt = 0; kt < k_rows / 8u; ++kt) {
      const uint k = kb + kt * 8u;
      float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (b_col < p.N) {
        uint word;
        float s, z;
        load_word<FMT, T>(B, scales, zeros, p, k, b_col, word, s, z);
        dequant_word<FMT>(word, s, z, w);
      }
      for (uint j = 0; j < 8u; ++j) stage[j * kStageCols + lane] = T(w[j]);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:fused_stage_ready]
      simdgroup_matrix<T, 8, 8> b_frag[4];
      for (uint ni = 0; ni < 4u; ++ni) simdgroup_load(b_frag[ni], stage + ni * 8u, kStageCols);
      for (uint mi = 0; mi < mi_count; ++mi) {
        simdgroup_matrix<T, 8, 8> a_frag;
        simdgroup_load(a_frag, a_tile + (sg_row + mi * 8u) * kAStride + kt * 8u, kAStride);
        for (uint ni = 0; ni < 4u; ++ni) simdgroup_multiply_accumulate(acc[mi][ni], a_frag, b_frag[ni], acc[mi][ni]);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:fused_stage_free]
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:fused_a_free]
  }

  threadgroup float* my_c = c_stage + sgid * 64u;
  for (uint mi = 0; mi < mi_count; ++mi)
    for (uint ni = 0; ni < 4u; ++ni)
      store_fragment<T>(acc[mi][ni], my_c, bias, C, workspace, p, sg_first_row + mi * 8u, col0 + sg_col + ni * 8u,
                        k_slice, lane);
}

}  // namespace torch_marlin
