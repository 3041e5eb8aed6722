// Fused-tiles family of the FP4 / INT4 GEMM: marlin_gemm_fused_<fmt>_<dtype>.
//
// One 64x64 output tile per threadgroup, B dequantized in registers and staged per simdgroup
// (the tile body is fused_tile_impl, shared with the striped family). Grid (n_tiles, m_tiles,
// k_parallel); with k_parallel > 1 the slices write fp32 partials to the workspace and
// marlin_reduce_partials (metal/reduce.metal) sums them.
#include "torch_marlin/fused_tile_msl.h"

using namespace metal;
using namespace torch_marlin;

template <uint FMT, typename T>
[[kernel]] void marlin_gemm_fused(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                                  device const T* scales [[buffer(2)]], device const uchar* zeros [[buffer(3)]],
                                  device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                                  device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint lid [[thread_index_in_threadgroup]],
                                  uint sgid [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(T, a_tile, [kTileM * kAStride]);
  TM_THREADGROUP_ARRAY(T, b_stage, [kSimdgroups * 8 * kStageCols]);
  TM_THREADGROUP_ARRAY(float, c_stage, [kSimdgroups * 64]);
  fused_tile_impl<FMT, T>(A, B, scales, zeros, bias, C, workspace, p, a_tile, b_stage, c_stage, tgid.y, tgid.x, tgid.z,
                          lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, bfloat, bfloat)
#endif
