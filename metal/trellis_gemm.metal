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
//   gemm_trellis_packed_decode_*  M <= 16, GEMV layout: a threadgroup owns 32 columns (one per
//                                 lane) for all rows; the 4 simdgroups take the 16-row trellis
//                                 tiles of K round-robin and meet in threadgroup memory (fixed
//                                 order). Grid (ceil(N/32), 1).
//   gemm_trellis_packed_*         prefill: 64x64 output tile, 4 simdgroups as 2x2 of 32x32, K step
//                                 32, double-buffered A and dequantized-B tiles in threadgroup
//                                 memory (each thread decodes one 16-index tile row per step).
//                                 Grid (ceil(N/64), ceil(M/64)).
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
  TM_THREADGROUP_ARRAY(float, partial, [kTrSimdgroups * kTrDecodeRows * kTrDecodeCols]);  // 8 KiB
  const uint n = tgid.x * kTrDecodeCols + lane;
  float acc[kTrDecodeRows];
  for (uint m = 0; m < kTrDecodeRows; ++m) acc[m] = 0.0f;
  const TrMat w = tr_mat(p);
  tr_gemv_accumulate<T, false>(A, p.K, nullptr, 0u, min(p.M, kTrDecodeRows), packed, scales, grid, su, w, n, sgid,
                               acc);
  for (uint m = 0; m < kTrDecodeRows; ++m) partial[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[m];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_decode_meet]
  for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
    const uint m = i / kTrDecodeCols;
    const uint c = i % kTrDecodeCols;
    const uint col = tgid.x * kTrDecodeCols + c;
    if (m < p.M && col < p.N) C[m * p.N + col] = T(tr_meet(partial, m, c) * sv[col]);
  }
}

// ---- prefill: 64x64 tile, double-buffered threadgroup tiles ---------------------------------------
// A[64][32] and the dequantized B[32][64] (without sv) of K block i+1 are written into one buffer
// while the simdgroups multiply out of the other; one threadgroup barrier per K block separates
// both hazards. B: thread lid decodes tile row r = lid / 4 (of 32) for trellis tile column lid % 4
// (of 4): one 2*bits-byte row read per thread per K block, no idle threads.
template <typename T>
inline void tr_stage_load(device const T* A, device const uchar* packed, device const float* scales,
                          device const float* grid, device const float* su, constant TrellisParams& p,
                          threadgroup T* As, threadgroup T* Bs, uint row0, uint col0, uint kb, uint lid) {
  for (uint i = lid; i < kTrTileM * kTrTileK; i += kTrThreads) {
    const uint r = i / kTrTileK;
    const uint c = i % kTrTileK;
    const uint m = row0 + r;
    const uint k = kb + c;
    As[i] = (m < p.M && k < p.K) ? A[m * p.K + k] : T(0.0f);
  }
  const TrMat w = tr_mat(p);
  const uint r = lid / 4u;
  const uint tc = lid % 4u;
  const uint k = kb + r;
  for (uint j = 0; j < TM_TRELLIS_TILE; ++j) {
    const uint n = col0 + tc * TM_TRELLIS_TILE + j;
    const float v = (k < p.K && n < p.N) ? tr_weight_no_sv(packed, scales, grid, su, w, k, n) : 0.0f;
    Bs[r * kTrTileN + tc * TM_TRELLIS_TILE + j] = T(v);
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
  // 2 x (A 64x32 + B 32x64) elements: 16 KiB for half/bfloat, 32 KiB for float. The epilogue
  // reuses the front as fp32 staging once the K loop is over.
  TM_THREADGROUP_ARRAY(T, smem, [2 * (kTrTileM * kTrTileK + kTrTileK * kTrTileN)]);
  threadgroup T* As[2] = {smem, smem + kTrTileM * kTrTileK};
  threadgroup T* Bs[2] = {smem + 2 * kTrTileM * kTrTileK, smem + 2 * kTrTileM * kTrTileK + kTrTileK * kTrTileN};
  const uint row0 = tgid.y * kTrTileM;
  const uint col0 = tgid.x * kTrTileN;
  const uint sg_row = (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  const uint sg_first_row = row0 + sg_row;
  // 8-row fragments of this simdgroup that hold real rows (uniform across the simdgroup).
  const uint mi_count = sg_first_row >= p.M ? 0u : min(4u, (p.M - sg_first_row + 7u) / 8u);

  simdgroup_matrix<float, 8, 8> acc[4][4];
  for (uint mi = 0; mi < 4u; ++mi)
    for (uint ni = 0; ni < 4u; ++ni) acc[mi][ni] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  tr_stage_load<T>(A, packed, scales, grid, su, p, As[0], Bs[0], row0, col0, 0u, lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_prologue]
  uint buf = 0;
  for (uint kb = 0; kb < p.K; kb += kTrTileK) {
    if (kb + kTrTileK < p.K) {
      tr_stage_load<T>(A, packed, scales, grid, su, p, As[buf ^ 1u], Bs[buf ^ 1u], row0, col0, kb + kTrTileK, lid);
    }
    // Rows past K are zero in both tiles, so whole 8-row steps are always safe.
    const uint k_steps = (min(kTrTileK, p.K - kb) + 7u) / 8u;
    for (uint kt = 0; kt < k_steps; ++kt) {
      simdgroup_matrix<T, 8, 8> b_frag[4];
      for (uint ni = 0; ni < 4u; ++ni)
        simdgroup_load(b_frag[ni], Bs[buf] + kt * 8u * kTrTileN + sg_col + ni * 8u, kTrTileN);
      for (uint mi = 0; mi < mi_count; ++mi) {
        simdgroup_matrix<T, 8, 8> a_frag;
        simdgroup_load(a_frag, As[buf] + (sg_row + mi * 8u) * kTrTileK + kt * 8u, kTrTileK);
        for (uint ni = 0; ni < 4u; ++ni) simdgroup_multiply_accumulate(acc[mi][ni], a_frag, b_frag[ni], acc[mi][ni]);
      }
    }
    // The next block's tiles are complete, and nobody reads this block's tiles any more.
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_swap]
    buf ^= 1u;
  }

  // Epilogue: each simdgroup stages one 8x8 fp32 fragment at a time, masked store with sv.
  threadgroup float* stage = (threadgroup float*)smem + sgid * 64u;
  for (uint mi = 0; mi < mi_count; ++mi) {
    for (uint ni = 0; ni < 4u; ++ni) {
      simdgroup_store(acc[mi][ni], stage, 8);
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
