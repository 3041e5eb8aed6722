// Striped family of the FP4 / INT4 GEMM: marlin_gemm_striped_<fmt>_<dtype> (64x64 tiles) and
// marlin_gemm_striped_m32_<fmt>_<dtype> (32x64 tiles, M <= 32).
//
// A 1-D grid of num_groups threadgroups walks the (tile, K slice) work units in column-major
// stripes: work unit w -> tile_linear = w / k_parallel, k_slice = w % k_parallel; tiles are
// numbered column-major (tile_row = tile_linear % m_tiles) so consecutive units of one
// threadgroup share B columns. Threadgroup g walks [g * per, min((g + 1) * per, total)), so the
// work spreads evenly over the GPU cores whatever the tile count. Each unit is the fused tile
// (prefill_tile_impl, csrc/include/torch_marlin/fused_tile_msl.h: two pipelined stages). K
// slices write fp32 partials to the workspace; marlin_reduce_partials (metal/reduce.metal) sums
// them.
#include "torch_marlin/fused_tile_msl.h"

using namespace metal;
using namespace torch_marlin;

template <uint FMT, typename T, uint TM>
inline void striped_impl(device const T* A, device const uint* B, device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets,
                         device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                         threadgroup T* stages, threadgroup float* c_stage, uint3 tgid, uint lid, uint sgid,
                         uint lane) {
  const uint kp = p.k_parallel;
  const uint total = p.m_tiles * p.n_tiles * kp;
  const uint per = (total + p.num_groups - 1u) / p.num_groups;
  const uint w_begin = tgid.x * per;
  const uint w_end = min(w_begin + per, total);
  if (w_begin >= w_end) return;  // uniform across the threadgroup
  // The unit's coordinates, divided out once and then stepped like an odometer.
  const uint tile_begin = w_begin / kp;
  uint k_slice = w_begin - tile_begin * kp;
  uint tile_row = tile_begin % p.m_tiles;
  uint tile_col = tile_begin / p.m_tiles;
  for (uint w = w_begin; w < w_end; ++w) {
    prefill_tile_impl<FMT, T, prefill_k_step<T>(), 2u, TM>(A, B, scales, zeros_or_offsets, bias, C, workspace, p,
                                                           stages, c_stage, tile_row, tile_col, k_slice, lid, sgid,
                                                           lane);
    if (++k_slice == kp) {
      k_slice = 0;
      if (++tile_row == p.m_tiles) {
        tile_row = 0;
        ++tile_col;
      }
    }
  }
}

template <uint FMT, typename T, uint TM = TM_METAL_TILE_M, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void marlin_gemm_striped(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                                    device const T* scales [[buffer(2)]],
                                    device const AuxT* zeros_or_offsets [[buffer(3)]],
                                    device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                                    device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                                    uint3 tgid [[threadgroup_position_in_grid]],
                                    uint lid [[thread_index_in_threadgroup]],
                                    uint sgid [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(T, stages, [prefill_stage_elems<T>(prefill_k_step<T>(), 2u, TM)]);
  TM_THREADGROUP_ARRAY(float, c_stage, [kSimdgroups * 64]);
  striped_impl<FMT, T, TM>(A, B, scales, zeros_or_offsets, bias, C, workspace, p, stages, c_stage, tgid, lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_striped", marlin_gemm_striped, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_striped", marlin_gemm_striped, float, float)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_striped_m32", marlin_gemm_striped, half, half, TM_METAL_SMALL_TILE_M)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_striped_m32", marlin_gemm_striped, float, float, TM_METAL_SMALL_TILE_M)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_striped", marlin_gemm_striped, bfloat, bfloat)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_striped_m32", marlin_gemm_striped, bfloat, bfloat, TM_METAL_SMALL_TILE_M)
#endif
