// Staged-tiles family of the FP4 / INT4 GEMM: marlin_gemm_<fmt>_<dtype>.
//
// One 64x64 output tile per threadgroup with double-buffered threadgroup tiles: A[64][32] and the
// dequantized B[32][64] of K block i+1 are written into one buffer while the simdgroups multiply
// out of the other; one threadgroup barrier per K block separates both hazards. Simdgroup s owns
// rows (s/2)*32.. +32 and columns (s%2)*32.. +32 of the tile. Grid (n_tiles, m_tiles, k_parallel);
// with k_parallel > 1 the slices write fp32 partials to the workspace and marlin_reduce_partials
// (metal/reduce.metal) sums them.
#include "torch_marlin/quant_gemm_msl.h"

using namespace metal;
using namespace torch_marlin;

template <uint FMT, typename T>
inline void staged_load(device const T* A, device const uint* B, device const T* scales, device const uchar* zeros,
                        constant QuantGemmParams& p, threadgroup T* As, threadgroup T* Bs, uint row0, uint col0,
                        uint kb, uint k_end, uint lid) {
  const uint k_rows = min(kTileK, k_end - kb);
  for (uint i = lid; i < kTileM * kTileK; i += kThreads) {
    const uint r = i / kTileK;
    const uint c = i % kTileK;
    const uint m = row0 + r;
    As[i] = (m < p.M && c < k_rows) ? A[m * p.K + kb + c] : T(0.0f);
  }
  // 4 word rows x 64 columns; adjacent threads take adjacent columns (coalesced).
  for (uint i = lid; i < (kTileK / 8u) * kTileN; i += kThreads) {
    const uint wr = i / kTileN;
    const uint c = i % kTileN;
    const uint n = col0 + c;
    float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (wr * 8u < k_rows && n < p.N) {
      uint word;
      float s, z;
      load_word<FMT, T>(B, scales, zeros, p, kb + wr * 8u, n, word, s, z);
      dequant_word<FMT>(word, s, z, w);
    }
    for (uint j = 0; j < 8u; ++j) Bs[(wr * 8u + j) * kTileN + c] = T(w[j]);
  }
}

template <uint FMT, typename T>
inline void staged_impl(device const T* A, device const uint* B, device const T* scales, device const uchar* zeros,
                        device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                        threadgroup T* smem, uint3 tgid, uint lid, uint sgid, uint lane) {
  threadgroup T* As[2] = {smem, smem + kTileM * kTileK};
  threadgroup T* Bs[2] = {smem + 2 * kTileM * kTileK, smem + 2 * kTileM * kTileK + kTileK * kTileN};
  const uint row0 = tgid.y * kTileM;
  const uint col0 = tgid.x * kTileN;
  const uint k_slice = tgid.z;
  const uint k_begin = k_slice * p.k_slice_len;
  const uint k_end = min(p.K, k_begin + p.k_slice_len);
  const uint sg_row = (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  const uint sg_first_row = row0 + sg_row;
  const uint mi_count = sg_first_row >= p.M ? 0u : min(4u, (p.M - sg_first_row + 7u) / 8u);

  simdgroup_matrix<float, 8, 8> acc[4][4];
  for (uint mi = 0; mi < 4u; ++mi)
    for (uint ni = 0; ni < 4u; ++ni) acc[mi][ni] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  staged_load<FMT, T>(A, B, scales, zeros, p, As[0], Bs[0], row0, col0, k_begin, k_end, lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:staged_prologue]
  uint buf = 0;
  for (uint kb = k_begin; kb < k_end; kb += kTileK) {
    if (kb + kTileK < k_end) {
      staged_load<FMT, T>(A, B, scales, zeros, p, As[buf ^ 1u], Bs[buf ^ 1u], row0, col0, kb + kTileK, k_end, lid);
    }
    const uint k_rows = min(kTileK, k_end - kb);
    for (uint kt = 0; kt < k_rows / 8u; ++kt) {
      simdgroup_matrix<T, 8, 8> b_frag[4];
      for (uint ni = 0; ni < 4u; ++ni) simdgroup_load(b_frag[ni], Bs[buf] + kt * 8u * kTileN + sg_col + ni * 8u, kTileN);
      for (uint mi = 0; mi < mi_count; ++mi) {
        simdgroup_matrix<T, 8, 8> a_frag;
        simdgroup_load(a_frag, As[buf] + (sg_row + mi * 8u) * kTileK + kt * 8u, kTileK);
        for (uint ni = 0; ni < 4u; ++ni) simdgroup_multiply_accumulate(acc[mi][ni], a_frag, b_frag[ni], acc[mi][ni]);
      }
    }
    // Next block's tiles are complete, and nobody reads this block's tiles any more.
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:staged_swap]
    buf ^= 1u;
  }

  threadgroup float* my_c = (threadgroup float*)smem + sgid * 64u;
  for (uint mi = 0; mi < mi_count; ++mi)
    for (uint ni = 0; ni < 4u; ++ni)
      store_fragment<T>(acc[mi][ni], my_c, bias, C, workspace, p, sg_first_row + mi * 8u, col0 + sg_col + ni * 8u,
                        k_slice, lane);
}

template <uint FMT, typename T>
[[kernel]] void marlin_gemm(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                            device const T* scales [[buffer(2)]], device const uchar* zeros [[buffer(3)]],
                            device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                            device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint lid [[thread_index_in_threadgroup]],
                            uint sgid [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  // 2 x (A 64x32 + B 32x64) elements: 16 KiB for half/bfloat, 32 KiB for float. The epilogue
  // reuses the front of it as fp32 staging once the K loop is over.
  TM_THREADGROUP_ARRAY(T, smem, [2 * (kTileM * kTileK + kTileK * kTileN)]);
  staged_impl<FMT, T>(A, B, scales, zeros, bias, C, workspace, p, smem, tgid, lid, sgid, lane);
}

TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, half, half)
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_QUANT_DTYPE("marlin_gemm", marlin_gemm, bfloat, bfloat)
#endif
