// The FP4 / INT4 prefill tile: one TM x 64 output tile (TM = 64, or 32 for M <= 32) of
// C = A @ dequant(B) (+ bias), the body of
// marlin_gemm_fused_* (metal/fused_tiles.metal, one tile per threadgroup), marlin_gemm_striped_*
// (metal/striped.metal, a run of (tile, K slice) work units per threadgroup) and marlin_gemm_*
// (metal/staged_tiles.metal). MSL only.
//
// Per K step of KS rows the 128 threads together
//  - copy A[64][KS] with 16-byte loads (4 or 8 activations; rows past M and columns past the
//    slice are zero) into the padded A stage [64][KS + pad];
//  - dequantize the step's KS/8 x 64 packed words, each word once per threadgroup, into the padded
//    B stage, held transposed ([n][k]: a word's 8 weights are 8 adjacent elements);
// then simdgroup s multiplies rows (s/2)*32.. +32 by columns (s%2)*32.. +32 of the tile out of
// the stages: 4 A fragments, 4 B fragments (transposing simdgroup_load), 16 fp32 accumulators,
// every fragment index a compile-time constant so the accumulators stay in registers. The 32-row
// tile: simdgroup s takes all 32 rows by columns s*16.. +16 (4 A, 2 B fragments, 8 accumulators).
//
// Each row of a stage is padded by 16 bytes: the 8 rows an 8x8 simdgroup_load touches then start
// 20 (or 36) words apart, which puts them on 8 different banks.
//
// Software pipelining (STAGES = 2, fused and striped): in iteration i the device loads of step i
// are issued into registers, the simdgroups multiply step i-1 out of one stage, then the
// registers are stored into the other stage; one threadgroup barrier per step orders both
// hazards. STAGES = 1 (staged) issues the loads the same way but has a single stage, so it needs a
// second barrier before the stage is overwritten; it can afford 32-row steps in fp32.
//
// Scale groups: each thread follows the rows of its words with a counter inside the group
// (advanced by KS per step, wrapping as many groups as it crosses), so no K step divides; any
// group size that is a multiple of 8 works, smaller or larger than a step.
#pragma once

#include "torch_marlin/quant_gemm_msl.h"

namespace torch_marlin {

// K rows per step of the two-stage kernels for activation type T (shared with the planner).
template <typename T>
constexpr uint prefill_k_step() {
  return TM_METAL_PIPELINED_TILE_K(uint(sizeof(T)));
}

// Row pitch of a stage, in elements: KS plus 16 bytes.
template <typename T>
constexpr uint prefill_pitch(uint ks) {
  return ks + 16u / uint(sizeof(T));
}

// Elements of STAGES stages of A [tm][pitch] and transposed B [64][pitch].
template <typename T>
constexpr uint prefill_stage_elems(uint ks, uint stages, uint tm = TM_METAL_TILE_M) {
  return stages * (tm + TM_METAL_TILE_N) * prefill_pitch<T>(ks);
}

// The simdgroup layout of a TM x 64 tile: rows x columns of 8x8 fragments per simdgroup.
template <uint TM>
struct PrefillLayout {
  enum : uint {
    kMi = 4u,                                            // 32 rows per simdgroup
    kNi = TM == TM_METAL_TILE_M ? 4u : 2u,               // 32 or 16 columns
    kSgCols = TM == TM_METAL_TILE_M ? 2u : 4u,           // simdgroups across the 64 columns
  };
  static_assert(TM == TM_METAL_TILE_M || TM == TM_METAL_SMALL_TILE_M, "tile rows: 64 or 32");
};

// One thread's share of a K step's device loads, held in registers between the load and the
// store to threadgroup memory, and the offsets that walk them along K.
template <uint FMT, typename T, uint KS, uint TM = TM_METAL_TILE_M>
struct PrefillFetch {
  enum : uint {
    kChunkElems = 16u / uint(sizeof(T)),                          // activations per 16-byte chunk
    kChunksPerRow = KS / (16u / uint(sizeof(T))),
    kAChunks = TM * (KS / (16u / uint(sizeof(T)))) / kThreads,    // per thread
    kWords = (KS / 8u) * TM_METAL_TILE_N / kThreads,                         // per thread
  };
  uint a_off[kAChunks];  // element index of the chunk in A at the next step
  bool a_live[kAChunks];  // its row is < M
  uint4 a_val[kAChunks];
  uint b_off[kWords];  // index of the word in B at the next step
  uint s_off[kWords];  // index of its scale (and zero point)
  uint g_row[kWords];  // its first row's offset inside the scale group
  uint b_word[kWords];
  float b_s[kWords];
  float b_z[kWords];
  bool b_live;  // the thread's column is < N
};

// Thread lid's chunk i: row (lid + 128 i) / chunks_per_row, column chunk (lid + 128 i) % it.
// Word j: row of words (lid + 128 j) / 64, column lid % 64 (32 lanes, 32 adjacent words).
template <uint FMT, typename T, uint KS, uint TM>
inline void prefill_fetch_begin(thread PrefillFetch<FMT, T, KS, TM>& f, constant QuantGemmParams& p, uint row0,
                                uint col0, uint k_begin, uint lid) {
  typedef PrefillFetch<FMT, T, KS, TM> F;
  for (uint i = 0; i < uint(F::kAChunks); ++i) {
    const uint c = lid + i * kThreads;
    const uint m = row0 + c / uint(F::kChunksPerRow);
    f.a_live[i] = m < p.M;
    f.a_off[i] = m * p.K + k_begin + (c % uint(F::kChunksPerRow)) * uint(F::kChunkElems);
  }
  const uint n = col0 + lid % TM_METAL_TILE_N;
  f.b_live = n < p.N;
  for (uint j = 0; j < uint(F::kWords); ++j) {
    const uint k = k_begin + ((lid + j * kThreads) / TM_METAL_TILE_N) * 8u;
    const uint g = k / p.group_size;
    f.b_off[j] = (k / 8u) * p.N + n;
    f.s_off[j] = g * p.N + n;
    f.g_row[j] = k - g * p.group_size;
  }
}

// Issues the device loads of the step at row kb (rows past k_end read as zero) and moves the
// offsets to the next step.
template <uint FMT, typename T, uint KS, uint TM>
inline void prefill_fetch(thread PrefillFetch<FMT, T, KS, TM>& f, device const T* A, device const uint* B,
                          device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets, constant QuantGemmParams& p, uint kb,
                          uint k_end, uint lid) {
  typedef PrefillFetch<FMT, T, KS, TM> F;
  const uint k_rows = min(KS, k_end - kb);  // a multiple of 8
  for (uint i = 0; i < uint(F::kAChunks); ++i) {
    const uint col = ((lid + i * kThreads) % uint(F::kChunksPerRow)) * uint(F::kChunkElems);
    if (f.a_live[i] && col < k_rows) {
      f.a_val[i] = *((device const uint4*)(A + f.a_off[i]));
    } else {
      f.a_val[i] = uint4(0u, 0u, 0u, 0u);
    }
    f.a_off[i] += KS;
  }
  for (uint j = 0; j < uint(F::kWords); ++j) {
    const uint row = ((lid + j * kThreads) / TM_METAL_TILE_N) * 8u;
    if (f.b_live && row < k_rows) {
      f.b_word[j] = B[f.b_off[j]];
      f.b_s[j] = float(scales[f.s_off[j]]);
      f.b_z[j] = FMT == TM_FORMAT_FP4 ? 0.0f : group_value(zeros_or_offsets[f.s_off[j]]);
    } else {
      f.b_word[j] = 0u;
      f.b_s[j] = 0.0f;
      f.b_z[j] = 0.0f;
    }
    f.b_off[j] += (KS / 8u) * p.N;
    for (f.g_row[j] += KS; f.g_row[j] >= p.group_size; f.g_row[j] -= p.group_size) f.s_off[j] += p.N;
  }
}

// Stores the loaded step into a stage: A as is, B dequantized and transposed.
template <uint FMT, typename T, uint KS, uint TM>
inline void prefill_store(thread const PrefillFetch<FMT, T, KS, TM>& f, threadgroup T* sa, threadgroup T* sb, uint lid) {
  typedef PrefillFetch<FMT, T, KS, TM> F;
  constexpr uint kPitch = prefill_pitch<T>(KS);
  for (uint i = 0; i < uint(F::kAChunks); ++i) {
    const uint c = lid + i * kThreads;
    const uint r = c / uint(F::kChunksPerRow);
    const uint col = (c % uint(F::kChunksPerRow)) * uint(F::kChunkElems);
    *((threadgroup uint4*)(sa + r * kPitch + col)) = f.a_val[i];
  }
  threadgroup T* column = sb + (lid % TM_METAL_TILE_N) * kPitch;
  for (uint j = 0; j < uint(F::kWords); ++j) {
    float w[8];
    dequant_word<FMT>(f.b_word[j], f.b_s[j], f.b_z[j], w);
    threadgroup T* dst = column + ((lid + j * kThreads) / TM_METAL_TILE_N) * 8u;
    for (uint e = 0; e < 8u; ++e) dst[e] = T(w[e]);
  }
}

// acc[mi * NI + ni] += A rows sg_row + 8 mi x B columns sg_col + 8 ni over the stage's KS rows.
template <typename T, uint KS, uint TM>
inline void prefill_mma(thread simdgroup_matrix<float, 8, 8>* acc, threadgroup const T* sa,
                        threadgroup const T* sb, uint sg_row, uint sg_col) {
  typedef PrefillLayout<TM> L;
  constexpr uint kPitch = prefill_pitch<T>(KS);
  TM_UNROLL
  for (uint kk = 0; kk < KS; kk += 8u) {
    simdgroup_matrix<T, 8, 8> a[L::kMi];
    simdgroup_matrix<T, 8, 8> b[L::kNi];
    TM_UNROLL
    for (uint mi = 0; mi < uint(L::kMi); ++mi) simdgroup_load(a[mi], sa + (sg_row + mi * 8u) * kPitch + kk, kPitch);
    TM_UNROLL
    for (uint ni = 0; ni < uint(L::kNi); ++ni)
      simdgroup_load(b[ni], sb + (sg_col + ni * 8u) * kPitch + kk, kPitch, ulong2(0, 0), true);
    TM_UNROLL
    for (uint f = 0; f < uint(L::kMi * L::kNi); ++f)
      simdgroup_multiply_accumulate(acc[f], a[f / uint(L::kNi)], b[f % uint(L::kNi)], acc[f]);
  }
}

// The whole tile (tile_row, tile_col) over K slice k_slice. stages: prefill_stage_elems<T>(KS,
// STAGES) elements; c_stage: kSimdgroups * 64 floats (the epilogue's per-simdgroup 8x8 stage).
template <uint FMT, typename T, uint KS, uint STAGES, uint TM = TM_METAL_TILE_M>
inline void prefill_tile_impl(device const T* A, device const uint* B, device const T* scales,
                              device const group_aux_t<FMT, T>* zeros_or_offsets, device const T* bias, device T* C, device float* workspace,
                              constant QuantGemmParams& p, threadgroup T* stages, threadgroup float* c_stage,
                              uint tile_row, uint tile_col, uint k_slice, uint lid, uint sgid, uint lane) {
  typedef PrefillLayout<TM> L;
  constexpr uint kPitch = prefill_pitch<T>(KS);
  constexpr uint kAElems = TM * kPitch;
  constexpr uint kStageElems = (TM + TM_METAL_TILE_N) * kPitch;
  constexpr uint kFrags = L::kMi * L::kNi;
  const uint row0 = tile_row * TM;
  const uint col0 = tile_col * TM_METAL_TILE_N;
  const uint k_begin = k_slice * p.k_slice_len;
  const uint k_end = min(p.K, k_begin + p.k_slice_len);
  const uint sg_row = (sgid / uint(L::kSgCols)) * 32u;
  const uint sg_col = (sgid % uint(L::kSgCols)) * (8u * L::kNi);

  simdgroup_matrix<float, 8, 8> acc[kFrags];
  TM_UNROLL
  for (uint i = 0; i < kFrags; ++i) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  PrefillFetch<FMT, T, KS, TM> f;
  prefill_fetch_begin<FMT, T, KS, TM>(f, p, row0, col0, k_begin, lid);
  uint buf = 0;
  for (uint kb = k_begin;; kb += KS) {  // one extra iteration drains the pipeline
    const bool more = kb < k_end;         // uniform across the threadgroup
    if (more) prefill_fetch<FMT, T, KS, TM>(f, A, B, scales, zeros_or_offsets, p, kb, k_end, lid);
    if (STAGES == 1u) {
      if (kb != k_begin) {
        prefill_mma<T, KS, TM>(acc, stages, stages + kAElems, sg_row, sg_col);
        threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:staged_free]
      }
      if (!more) break;
      prefill_store<FMT, T, KS, TM>(f, stages, stages + kAElems, lid);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:staged_ready]
    } else {
      if (kb != k_begin) {
        threadgroup const T* cur = stages + (buf ^ 1u) * kStageElems;
        prefill_mma<T, KS, TM>(acc, cur, cur + kAElems, sg_row, sg_col);
      }
      threadgroup T* next = stages + buf * kStageElems;
      if (more) prefill_store<FMT, T, KS, TM>(f, next, next + kAElems, lid);
      // The step just stored is complete, and the stage multiplied out is free again (the next
      // work unit of a striped threadgroup starts by storing into stage 0).
      threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:fused_swap]
      if (!more) break;
      buf ^= 1u;
    }
  }

  threadgroup float* my_c = c_stage + sgid * 64u;
  TM_UNROLL
  for (uint f = 0; f < kFrags; ++f) {
    const uint m = row0 + sg_row + (f / uint(L::kNi)) * 8u;
    const uint n = col0 + sg_col + (f % uint(L::kNi)) * 8u;
    if (m < p.M && n < p.N)  // uniform across the simdgroup
      store_fragment<T>(acc[f], my_c, bias, C, workspace, p, m, n, k_slice, lane);
  }
}

}  // namespace torch_marlin
