// Decode family of the FP4 / INT4 GEMM (M <= 16): marlin_gemv_<fmt>_<dtype>.
//
// A threadgroup owns 32 adjacent columns (one per lane: 32 adjacent words, one 128-byte load) for
// all M rows, so every packed word is read once for all rows. The 4 simdgroups split the K range
// of the threadgroup's slice and meet in threadgroup memory, summed in a fixed order.
// Grid (n_tiles, k_parallel): with k_parallel > 1 each slice writes fp32 partials to the
// workspace and marlin_reduce_partials (metal/reduce.metal) sums them.
#include "torch_marlin/quant_gemm_msl.h"

using namespace metal;
using namespace torch_marlin;

constant constexpr uint kDecodeRows = 16;  // the planner's kDecodeMaxM
constant constexpr uint kDecodeCols = 32;  // one column per lane

template <uint FMT, typename T>
inline void gemv_impl(device const T* A, device const uint* B, device const T* scales, device const uchar* zeros,
                      device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                      threadgroup float* partial /* [kSimdgroups][kDecodeRows][kDecodeCols] */, uint3 tgid,
                      uint lid, uint sgid, uint lane) {
  const uint col = tgid.x * kDecodeCols + lane;
  const uint k_slice = tgid.y;
  const uint k_begin = k_slice * p.k_slice_len;
  const uint k_end = min(p.K, k_begin + p.k_slice_len);
  const uint M = p.M;

  float acc[kDecodeRows];
  for (uint m = 0; m < kDecodeRows; ++m) acc[m] = 0.0f;
  if (col < p.N) {
    // Simdgroup s takes words s, s+4, s+8, ... of the slice: the 4 simdgroups stream disjoint
    // rows of B concurrently and each word is read once for all M rows.
    for (uint k = k_begin + sgid * 8u; k < k_end; k += kSimdgroups * 8u) {
      uint word;
      float s, z;
      load_word<FMT, T>(B, scales, zeros, p, k, col, word, s, z);
      float w[8];
      dequant_word<FMT>(word, s, z, w);
      // Constant trip count so acc[] stays in registers; rows >= M are skipped uniformly.
      for (uint m = 0; m < kDecodeRows; ++m) {
        if (m < M) {
          device const T* a = A + m * p.K + k;  // same address on every lane: a broadcast load
          float d = 0.0f;
          for (uint j = 0; j < 8u; ++j) d += float(a[j]) * w[j];
          acc[m] += d;
        }
      }
    }
  }
  for (uint m = 0; m < kDecodeRows; ++m) partial[(sgid * kDecodeRows + m) * kDecodeCols + lane] = acc[m];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_meet]
  for (uint i = lid; i < kDecodeRows * kDecodeCols; i += kThreads) {
    const uint m = i / kDecodeCols;
    const uint n = tgid.x * kDecodeCols + i % kDecodeCols;
    if (m < M && n < p.N) {
      // Fixed simdgroup order: the result does not depend on scheduling.
      const uint stride = kDecodeRows * kDecodeCols;
      float v = ((partial[i] + partial[stride + i]) + partial[2u * stride + i]) + partial[3u * stride + i];
      if (p.k_parallel > 1u) {
        workspace[(k_slice * M + m) * p.N + n] = v;
      } else {
        if (p.has_bias != 0u) v += float(bias[n]);
        C[m * p.N + n] = T(v);
      }
    }
  }
}

template <uint FMT, typename T>
[[kernel]] void marlin_gemv(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                            device const T* scales [[buffer(2)]], device const uchar* zeros [[buffer(3)]],
                            device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                            device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint lid [[thread_index_in_threadgroup]],
                            uint sgid [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, partial, [kSimdgroups * kDecodeRows * kDecodeCols]);  // 8 KiB
  gemv_impl<FMT, T>(A, B, scales, zeros, bias, C, workspace, p, partial, tgid, lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemv", marlin_gemv, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemv", marlin_gemv, float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemv", marlin_gemv, bfloat, bfloat)
#endif
