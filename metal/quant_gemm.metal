// FP4 E2M1 / INT4 weight-quantized GEMM for Apple GPUs (MSL 3.0; bfloat needs MSL 3.1).
//
//   C[M, N] = A[M, K] @ dequant(B_packed[K/8, N], scales, zeros)[K, N] (+ bias[N])
//
// Formats: docs/formats.md (B_packed: 8 four-bit codes along K per word, LSB first). Launch
// geometry comes from the planner (csrc/plan/plan.cpp, plan_metal); each kernel reads it from
// QuantGemmParams (csrc/include/torch_marlin/quant_gemm_params.h, shared with the host).
// Every accumulation is fp32; C is rounded to the activation dtype once, in the epilogue.
//
// Kernels (host names are <stem>_<fmt>_<dtype>, dtype in {half, float, bfloat}):
//   marlin_gemv_*          decode, M <= 16: lanes over 32 columns, every packed word read once
//                          for all rows, 4 simdgroups split K and meet in threadgroup memory;
//                          grid (n_tiles, k_parallel)
//   marlin_gemm_fused_*    64x64 tile, dequant in registers, per-simdgroup staging (seed
//                          fused_dequant_gemm.md); grid (n_tiles, m_tiles)
//   marlin_gemm_*          64x64 tile, double-buffered A and dequantized-B tiles in threadgroup
//                          memory (seed architecture.md, marlin_gemm_fp4); grid (n_tiles, m_tiles)
//   marlin_gemm_striped_*  1-D grid, column-major stripes over (tile, k-slice) work units (seed
//                          stripe_partitioning.md); K slices write fp32 partials to a workspace
//   marlin_reduce_partials_<dtype>  C = sum of the partials in slice order (+ bias): deterministic
//   dequant_*              standalone dequant to a dense [K, N] weight
// No marlin_zero_reduction: every workspace element [slice][m][n] is written exactly once (the
// slices tile K, the masked epilogue covers every m < M, n < N), so nothing needs zeroing.
//
// Portability rules (the Metal-on-CPU harness compiles this file as C++, docs/metal.md):
// threadgroup arrays go through TM_THREADGROUP_ARRAY; every [[kernel]] ends with the four thread
// ids (tgid, lid, sgid, lane) and its buffers come first, in [[buffer(i)]] order.
#include <metal_stdlib>

#include "torch_marlin/quant_gemm_params.h"

using namespace metal;
using namespace torch_marlin;

#ifndef TM_THREADGROUP_ARRAY
#define TM_THREADGROUP_ARRAY(T, name, dims) threadgroup T name dims
#endif

// The Metal-on-CPU harness and the address-space check supply their own instantiation hook.
#if defined(TM_EMU_REGISTER_KERNEL)
#define TM_INSTANTIATE(name, ...) TM_EMU_REGISTER_KERNEL(name, __VA_ARGS__)
#else
#define TM_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
#endif

// ---- tuning constants (the planner's plan_metal uses the same numbers) -------------------------
constant constexpr uint kThreads = 128;      // 4 simdgroups of 32
constant constexpr uint kSimdgroups = 4;
constant constexpr uint kDecodeRows = 16;    // kDecodeMaxM
constant constexpr uint kDecodeCols = 32;    // one column per lane
constant constexpr uint kTileM = 64;
constant constexpr uint kTileN = 64;
constant constexpr uint kTileK = 32;
constant constexpr uint kAStride = kTileK + 8;  // fused A tile row pitch: padding spreads banks
constant constexpr uint kStageCols = 32;        // fused: a simdgroup's B slab is 8 x 32
constant constexpr uint kReduceThreads = 256;
constant constexpr uint kDequantThreads = 256;

// E2M1 magnitudes by code (codes 8..15 are the negatives).
constant float kFp4Values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// ---- dequant ----------------------------------------------------------------------------------
// The 8 weights of one packed word (rows k..k+7 of one column), all in one scale group because
// group_size is a multiple of 8. fp32 product, as the reference computes it.
template <uint FMT>
inline void dequant_word(uint word, float scale, float zero, thread float* w) {
  for (uint j = 0; j < 8; ++j) {
    const uint code = (word >> (4u * j)) & 15u;
    w[j] = FMT == TM_FORMAT_FP4 ? kFp4Values[code] * scale : (float(code) - zero) * scale;
  }
}

template <uint FMT, typename T>
inline void load_word(device const uint* B, device const T* scales, device const uchar* zeros,
                      constant QuantGemmParams& p, uint k, uint col, thread uint& word, thread float& s,
                      thread float& z) {
  const uint g = k / p.group_size;
  word = B[(k / 8u) * p.N + col];
  s = float(scales[g * p.N + col]);
  z = FMT == TM_FORMAT_U4 ? float(zeros[g * p.N + col] & 15u) : 0.0f;  // zero points are 0..15 (docs/formats.md)
}

// ---- epilogue: write one simdgroup's 8x8 fp32 fragment, masked --------------------------------
// Through a per-simdgroup 8x8 float stage so edge tiles need no special MMA path. k_parallel > 1:
// raw fp32 partial into workspace[k_slice][M][N]; else C = T(acc + bias).
template <typename T>
inline void store_fragment(simdgroup_matrix<float, 8, 8> frag, threadgroup float* stage, device const T* bias,
                           device T* C, device float* workspace, constant QuantGemmParams& p, uint row0,
                           uint col0, uint k_slice, uint lane) {
  simdgroup_store(frag, stage, 8);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = lane; e < 64u; e += 32u) {
    const uint m = row0 + e / 8u;
    const uint n = col0 + e % 8u;
    if (m < p.M && n < p.N) {
      float v = stage[e];
      if (p.k_parallel > 1u) {
        workspace[(k_slice * p.M + m) * p.N + n] = v;
      } else {
        if (p.has_bias != 0u) v += float(bias[n]);
        C[m * p.N + n] = T(v);
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the stage is rewritten by the next fragment
}

// ---- decode: M <= 16 ------------------------------------------------------------------------------
template <uint FMT, typename T>
inline void gemv_impl(device const T* A, device const uint* B, device const T* scales, device const uchar* zeros,
                      device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                      threadgroup float* partial /* [kSimdgroups][kDecodeRows][kDecodeCols] */, uint3 tgid,
                      uint lid, uint sgid, uint lane) {
  const uint col = tgid.x * kDecodeCols + lane;  // 32 lanes: 32 adjacent words, one 128-byte load
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

// ---- fused 64x64 tile: dequant in registers -----------------------------------------------------
// Simdgroup s owns rows (s/2)*32.. +32 and columns (s%2)*32.. +32 of the tile: a 4x4 grid of 8x8
// fp32 accumulators. Per 8-row K step, each lane dequantizes one column of the simdgroup's 8x32 B
// slab (one packed word, coalesced across the 32 lanes) into its own staging area; only simdgroup
// barriers guard that stage. The seed stages 8x8 with lanes 0-7; 8x32 with all lanes reads the
// same words with 4x fewer barriers and no idle lanes.
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

// ---- striped: 1-D grid over (tile, k-slice) work units ---------------------------------------------
// Work unit w -> tile_linear = w / k_parallel, k_slice = w % k_parallel; tiles are numbered
// column-major (tile_row = tile_linear % m_tiles) so consecutive units of one threadgroup share
// B columns. Threadgroup g walks [g * per, min((g + 1) * per, total)).
template <uint FMT, typename T>
[[kernel]] void marlin_gemm_striped(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
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
  const uint kp = p.k_parallel;
  const uint total = p.m_tiles * p.n_tiles * kp;
  const uint per = (total + p.num_groups - 1u) / p.num_groups;
  const uint w_begin = tgid.x * per;
  const uint w_end = min(w_begin + per, total);
  for (uint w = w_begin; w < w_end; ++w) {  // uniform across the threadgroup
    const uint tile_linear = w / kp;
    const uint k_slice = w % kp;
    fused_tile_impl<FMT, T>(A, B, scales, zeros, bias, C, workspace, p, a_tile, b_stage, c_stage,
                       tile_linear % p.m_tiles, tile_linear / p.m_tiles, k_slice, lid, sgid, lane);
  }
}

// ---- staged: double-buffered threadgroup tiles (seed marlin_gemm_fp4) ------------------------------
// A[64][32] and the dequantized B[32][64] of K block i+1 are written into one buffer while the
// simdgroups multiply out of the other; one threadgroup barrier per K block separates both hazards.
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

// ---- deterministic K-parallel reduction -----------------------------------------------------------
template <typename T>
[[kernel]] void marlin_reduce_partials(device const float* workspace [[buffer(0)]], device const T* bias [[buffer(1)]],
                                       device T* C [[buffer(2)]], constant QuantReduceParams& p [[buffer(3)]],
                                       uint3 tgid [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]],
                                       uint sgid [[simdgroup_index_in_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  const uint i = tgid.x * kReduceThreads + lid;
  const uint mn = p.M * p.N;
  if (i >= mn) return;
  float v = workspace[i];
  for (uint s = 1; s < p.k_parallel; ++s) v += workspace[s * mn + i];  // slice order, always
  if (p.has_bias != 0u) v += float(bias[i % p.N]);
  C[i] = T(v);
}

// ---- standalone dequant: W[K, N] in the scales' dtype ------------------------------------------
template <uint FMT, typename T>
[[kernel]] void dequant_kernel(device const uint* B [[buffer(0)]], device const T* scales [[buffer(1)]],
                               device const uchar* zeros [[buffer(2)]], device T* W [[buffer(3)]],
                               constant QuantGemmParams& p [[buffer(4)]],
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint lid [[thread_index_in_threadgroup]],
                               uint sgid [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  const uint i = tgid.x * kDequantThreads + lid;  // one packed word per thread
  if (i >= (p.K / 8u) * p.N) return;
  const uint n = i % p.N;
  const uint k = (i / p.N) * 8u;
  uint word;
  float s, z;
  load_word<FMT, T>(B, scales, zeros, p, k, n, word, s, z);
  float w[8];
  dequant_word<FMT>(word, s, z, w);
  for (uint j = 0; j < 8u; ++j) W[(k + j) * p.N + n] = T(w[j]);
}

// ---- instantiations: the host builds the same name strings (plan.cpp metal_name) -----------------
#define TM_INSTANTIATE_FORMAT(fmt, FMT, tname, T)                                \
  TM_INSTANTIATE("marlin_gemv_" #fmt "_" #tname, marlin_gemv<FMT, T>)            \
  TM_INSTANTIATE("marlin_gemm_fused_" #fmt "_" #tname, marlin_gemm_fused<FMT, T>) \
  TM_INSTANTIATE("marlin_gemm_" #fmt "_" #tname, marlin_gemm<FMT, T>)            \
  TM_INSTANTIATE("marlin_gemm_striped_" #fmt "_" #tname, marlin_gemm_striped<FMT, T>) \
  TM_INSTANTIATE("dequant_" #fmt "_" #tname, dequant_kernel<FMT, T>)

#define TM_INSTANTIATE_DTYPE(tname, T)              \
  TM_INSTANTIATE_FORMAT(fp4, 0u, tname, T)          \
  TM_INSTANTIATE_FORMAT(u4, 1u, tname, T)           \
  TM_INSTANTIATE("marlin_reduce_partials_" #tname, marlin_reduce_partials<T>)

TM_INSTANTIATE_DTYPE(half, half)
TM_INSTANTIATE_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_DTYPE(bfloat, bfloat)
#endif
