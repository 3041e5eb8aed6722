// MSL helpers shared by the FP4 / INT4 / affine INT4 kernel families (metal/decode.metal, fused_tiles.metal,
// staged_tiles.metal, striped.metal, dequant.metal): tuning constants, the dequantization of one
// packed word, and the masked epilogue of an 8x8 fragment. Not for host C++.
//
//   C[M, N] = A[M, K] @ dequant(B_packed[K/8, N], scales, zeros_or_offsets)[K, N] (+ bias[N])
//
// zeros_or_offsets is buffer(3) of every GEMM kernel (buffer(2) of dequant): INT4 zero points
// (uchar), affine offsets (the scales' dtype, group_aux_t), unused by FP4.
//
// Formats: docs/formats.md (B_packed: 8 four-bit codes along K per word, LSB first). Launch
// geometry comes from the planner; every kernel reads it from QuantGemmParams
// (quant_gemm_params.h, shared with the host). Every accumulation is fp32; C is rounded to the
// activation dtype once, in the epilogue.
#pragma once

#include "torch_marlin/msl_kernel.h"
#include "torch_marlin/quant_gemm_params.h"

using namespace metal;  // MSL-only header: min/max, simdgroup_matrix and the address-space types

namespace torch_marlin {

// Threadgroup shape of the tiled families (quant_gemm_params.h, which the planner reads too).
constant constexpr uint kThreads = TM_METAL_THREADS;
constant constexpr uint kSimdgroups = TM_METAL_THREADS / 32u;

// The 8 weights of one packed word by bit arithmetic, no table: each step takes nibbles j and j+4
// (bits 4j and 16+4j) into the two halves of a half2 bit pattern.
//  - FP4 (E2M1, s eem): sign to bit 15, eem to bits 11..9 is the fp16 number v * 2^-14 for every
//    code (e = 0 lands on fp16 subnormals: m * 2^-15 = 0.5 m * 2^-14). Pass scale * 2^14
//    (kFp4BitsScale) and zero_bias 0: float(h) * (scale * 2^14) == v * scale exactly, as long as
//    scale * 2^14 stays finite (|scale| < 2^113).
//  - INT4: 0x6400 | q is the fp16 number 1024 + q. Pass group_term = 1024 + z (folded once per
//    group): (float(h) - (1024 + z)) * scale == (q - z) * scale exactly, as the reference rounds it.
//  - Affine: the same bits; pass group_term = the offset b: fma(float(h) - 1024, scale, b) is
//    q * scale + b rounded once, as the reference rounds it.
constant constexpr float kFp4BitsScale = 16384.0f;  // 2^14
constant constexpr float kU4BitsBias = 1024.0f;

// Element type of zeros_or_offsets: the scales' dtype for affine, uchar otherwise.
template <bool AFFINE, typename T>
struct GroupAux {
  typedef uchar type;
};
template <typename T>
struct GroupAux<true, T> {
  typedef T type;
};
template <uint FMT, typename T>
using group_aux_t = typename GroupAux<FMT == TM_FORMAT_AFFINE, T>::type;

// One zero point (its low 4 bits: zero points are 0..15, docs/formats.md) or offset as fp32.
inline float group_value(uchar z) { return float(z & 15u); }
inline float group_value(half b) { return float(b); }
inline float group_value(float b) { return b; }
#if __METAL_VERSION__ >= 310
inline float group_value(bfloat b) { return float(b); }
#endif

template <uint FMT>
inline void dequant_word_bits(uint word, float scale, float group_term, thread float* w) {
  for (uint j = 0; j < 4u; ++j) {
    const uint t = word >> (4u * j);
    const uint bits = FMT == TM_FORMAT_FP4 ? ((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12)
                                           : (t & 0x000F000Fu) | 0x64006400u;
    const half2 h = as_type<half2>(bits);
    if (FMT == TM_FORMAT_AFFINE) {
      w[j] = fma(float(h.x) - kU4BitsBias, scale, group_term);
      w[j + 4u] = fma(float(h.y) - kU4BitsBias, scale, group_term);
    } else {
      w[j] = (float(h.x) - group_term) * scale;
      w[j + 4u] = (float(h.y) - group_term) * scale;
    }
  }
}

// The 8 weights of one packed word (rows k..k+7 of one column), all in one scale group because
// group_size is a multiple of 8, from the scale and zero point or offset (group_value) as stored:
// dequant_word_bits with the folding done per word. fp32, as the reference computes it.
template <uint FMT>
inline void dequant_word(uint word, float scale, float zero_or_offset, thread float* w) {
  if (FMT == TM_FORMAT_FP4) {
    dequant_word_bits<FMT>(word, scale * kFp4BitsScale, 0.0f, w);
  } else if (FMT == TM_FORMAT_AFFINE) {
    dequant_word_bits<FMT>(word, scale, zero_or_offset, w);
  } else {
    dequant_word_bits<FMT>(word, scale, kU4BitsBias + zero_or_offset, w);
  }
}

template <uint FMT, typename T>
inline void load_word(device const uint* B, device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets,
                      constant QuantGemmParams& p, uint k, uint col, thread uint& word, thread float& s,
                      thread float& z) {
  const uint g = k / p.group_size;
  word = B[(k / 8u) * p.N + col];
  s = float(scales[g * p.N + col]);
  z = FMT == TM_FORMAT_FP4 ? 0.0f : group_value(zeros_or_offsets[g * p.N + col]);
}

// Writes one simdgroup's 8x8 fp32 fragment, masked, through a per-simdgroup 8x8 float stage so
// edge tiles need no special MMA path. k_parallel > 1: the raw fp32 partial goes to
// workspace[k_slice][M][N]; else C = T(acc + bias).
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

}  // namespace torch_marlin

// Host names are <stem>_<format>_<dtype>, dtype in {half, float, bfloat} (bfloat needs MSL 3.1):
// TM_INSTANTIATE_QUANT_DTYPE("marlin_gemv", marlin_gemv, half, half) instantiates every format.
#define TM_INSTANTIATE_QUANT_DTYPE(stem, fn, tname, T)       \
  TM_INSTANTIATE(stem "_fp4_" #tname, fn<TM_FORMAT_FP4, T>)  \
  TM_INSTANTIATE(stem "_u4_" #tname, fn<TM_FORMAT_U4, T>)    \
  TM_INSTANTIATE(stem "_affine_" #tname, fn<TM_FORMAT_AFFINE, T>)
// The same with one more template argument after the dtype (the prefill kernels' tile rows).
#define TM_INSTANTIATE_QUANT_DTYPE_ARG(stem, fn, tname, T, ARG)    \
  TM_INSTANTIATE(stem "_fp4_" #tname, fn<TM_FORMAT_FP4, T, ARG>)   \
  TM_INSTANTIATE(stem "_u4_" #tname, fn<TM_FORMAT_U4, T, ARG>)     \
  TM_INSTANTIATE(stem "_affine_" #tname, fn<TM_FORMAT_AFFINE, T, ARG>)
