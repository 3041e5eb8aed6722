// Standalone dequant of the FP4 / INT4 formats: dequant_<fmt>_<dtype> writes the dense weight
// W[K, N] in the scales' dtype, one packed word (8 rows of one column) per thread, 1-D grid.
// The values are the reference's: one fp32 product rounded once to the dtype.
#include "torch_marlin/quant_gemm_msl.h"

using namespace metal;
using namespace torch_marlin;

constant constexpr uint kDequantThreads = TM_METAL_ELEMENTWISE_THREADS;

template <uint FMT, typename T>
inline void dequant_impl(device const uint* B, device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets, device T* W,
                         constant QuantGemmParams& p, uint3 tgid, uint lid) {
  const uint i = tgid.x * kDequantThreads + lid;
  // 64-bit: the planner bounds the word count to 32 bits (the grid), not the element count.
  if (ulong(i) >= ulong(p.K / 8u) * p.N) return;
  const uint n = i % p.N;
  const uint k = (i / p.N) * 8u;
  uint word;
  float s, z;
  load_word<FMT, T>(B, scales, zeros_or_offsets, p, k, n, word, s, z);
  float w[8];
  dequant_word<FMT>(word, s, z, w);
  for (uint j = 0; j < 8u; ++j) W[ulong(k + j) * p.N + n] = T(w[j]);
}

template <uint FMT, typename T, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void dequant_kernel(device const uint* B [[buffer(0)]], device const T* scales [[buffer(1)]],
                               device const AuxT* zeros_or_offsets [[buffer(2)]], device T* W [[buffer(3)]],
                               constant QuantGemmParams& p [[buffer(4)]],
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint lid [[thread_index_in_threadgroup]],
                               uint sgid [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  dequant_impl<FMT, T>(B, scales, zeros_or_offsets, W, p, tgid, lid);
}

TM_INSTANTIATE_QUANT_DTYPE("dequant", dequant_kernel, half, half)
TM_INSTANTIATE_QUANT_DTYPE("dequant", dequant_kernel, float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("dequant", dequant_kernel, bfloat, bfloat)
#endif
