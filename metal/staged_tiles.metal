// Staged-tiles family of the FP4 / INT4 GEMM: marlin_gemm_<fmt>_<dtype> (only when forced).
//
// The one-stage variant of the prefill tile (prefill_tile_impl in
// csrc/include/torch_marlin/fused_tile_msl.h): the device loads of step i+1 are issued into
// registers before the MMAs of step i, as in the fused kernel, but there is a single threadgroup
// stage, stored once the MMAs are done (two barriers per step). Half the threadgroup memory per K
// row of the two-stage kernels, so the step is 32 rows in every dtype (fp32: an 18 KiB stage).
// Grid (n_tiles, m_tiles, k_parallel); with k_parallel > 1 the slices write fp32 partials to the
// workspace and marlin_reduce_partials (metal/reduce.metal) sums them.
#include "torch_marlin/fused_tile_msl.h"

using namespace metal;
using namespace torch_marlin;

template <uint FMT, typename T, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void marlin_gemm(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                            device const T* scales [[buffer(2)]], device const AuxT* zeros_or_offsets [[buffer(3)]],
                            device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                            device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint lid [[thread_index_in_threadgroup]],
                            uint sgid [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  // (A + B) x 64 x (32 + 16 bytes): 10 KiB for half / bfloat, 18 KiB for float; + 1 KiB epilogue.
  TM_THREADGROUP_ARRAY(T, stage, [prefill_stage_elems<T>(TM_METAL_STAGED_TILE_K, 1u)]);
  TM_THREADGROUP_ARRAY(float, c_stage, [kSimdgroups * 64]);
  prefill_tile_impl<FMT, T, TM_METAL_STAGED_TILE_K, 1u>(A, B, scales, zeros_or_offsets, bias, C, workspace, p, stage, c_stage,
                                                        tgid.y, tgid.x, tgid.z, lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, bfloat, bfloat)
#endif
