// K-slice reduction of the FP4 / INT4 GEMM (the second dispatch after a K-parallel plan):
// marlin_reduce_partials_<dtype>.
//
//   C[m, n] = sum_{s < k_parallel} workspace[s][m][n] (+ bias[n]), summed in slice order
//
// The fixed order makes the result bitwise independent of scheduling. No zeroing pass is needed:
// every workspace element [slice][m][n] is written exactly once by the first dispatch (the slices
// tile K, the masked epilogue covers every m < M, n < N). 1-D grid, one element per thread.
#include "torch_marlin/quant_gemm_msl.h"

using namespace metal;
using namespace torch_marlin;

constant constexpr uint kReduceThreads = TM_METAL_ELEMENTWISE_THREADS;

template <typename T>
inline void reduce_partials_impl(device const float* workspace, device const T* bias, device T* C,
                                 constant QuantReduceParams& p, uint3 tgid, uint lid) {
  const uint i = tgid.x * kReduceThreads + lid;
  const uint mn = p.M * p.N;
  if (i >= mn) return;
  float v = workspace[i];
  for (uint s = 1; s < p.k_parallel; ++s) v += workspace[s * mn + i];  // slice order, always
  if (p.has_bias != 0u) v += float(bias[i % p.N]);
  C[i] = T(v);
}

template <typename T>
[[kernel]] void marlin_reduce_partials(device const float* workspace [[buffer(0)]], device const T* bias [[buffer(1)]],
                                       device T* C [[buffer(2)]], constant QuantReduceParams& p [[buffer(3)]],
                                       uint3 tgid [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]],
                                       uint sgid [[simdgroup_index_in_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  reduce_partials_impl<T>(workspace, bias, C, p, tgid, lid);
}

TM_INSTANTIATE("marlin_reduce_partials_half", marlin_reduce_partials<half>)
TM_INSTANTIATE("marlin_reduce_partials_float", marlin_reduce_partials<float>)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE("marlin_reduce_partials_bfloat", marlin_reduce_partials<bfloat>)
#endif
