// Fused-tiles family of the FP4 / INT4 GEMM: marlin_gemm_fused_<fmt>_<dtype> (64x64 tiles) and
// marlin_gemm_fused_m32_<fmt>_<dtype> (32x64 tiles, M <= 32), the planner's choice for M > 16.
//
// One output tile per threadgroup, B dequantized once per threadgroup into the second of two
// pipelined stages while the simdgroups multiply the first (prefill_tile_impl in
// csrc/include/torch_marlin/fused_tile_msl.h, shared with the striped family). K steps of 32
// rows (16 in fp32). Grid (n_tiles, m_tiles, k_parallel); with k_parallel > 1 the slices write fp32 partials
// to the workspace and marlin_reduce_partials (metal/reduce.metal) sums them.
#include "torch_marlin/fused_tile_msl.h"

using namespace metal;
using namespace torch_marlin;

template <uint FMT, typename T, uint TM = TM_METAL_TILE_M, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void marlin_gemm_fused(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                                  device const T* scales [[buffer(2)]],
                                  device const AuxT* zeros_or_offsets [[buffer(3)]],
                                  device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                                  device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint lid [[thread_index_in_threadgroup]],
                                  uint sgid [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  // 2 stages x (A + B) x (TM + 64) x (k_step + 16 bytes): 20 KiB (TM = 64) or 15 KiB (TM = 32) in
  // every dtype, + 1 KiB epilogue stage.
  TM_THREADGROUP_ARRAY(T, stages, [prefill_stage_elems<T>(prefill_k_step<T>(), 2u, TM)]);
  TM_THREADGROUP_ARRAY(float, c_stage, [kSimdgroups * 64]);
  prefill_tile_impl<FMT, T, prefill_k_step<T>(), 2u, TM>(A, B, scales, zeros_or_offsets, bias, C, workspace, p, stages,
                                                         c_stage, tgid.y, tgid.x, tgid.z, lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, float, float)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_fused_m32", marlin_gemm_fused, half, half, TM_METAL_SMALL_TILE_M)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_fused_m32", marlin_gemm_fused, float, float, TM_METAL_SMALL_TILE_M)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm_fused", marlin_gemm_fused, bfloat, bfloat)
TM_INSTANTIATE_QUANT_DTYPE_ARG("marlin_gemm_fused_m32", marlin_gemm_fused, bfloat, bfloat, TM_METAL_SMALL_TILE_M)
#endif
