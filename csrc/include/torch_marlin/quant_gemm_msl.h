// MSL helpers shared by the FP4 / INT4 kernel families (metal/decode.metal, fused_tiles.metal,
// staged_tiles.metal, striped.metal, dequant.metal): tuning constants, the dequantization of one
// packed word, and the masked epilogue of an 8x8 fragment. Not for host C++.
//
//   C[M, N] = A[M, K] @ dequant(B_packed[K/8, N], scales, zeros)[K, N] (+ bias[N])
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
//  - INT4: 0x6400 | q is the fp16 number 1024 + q. Pass zero_bias = 1024 + z (folded once per
//    group): (float(h) - (1024 + z)) * scale == (q - z) * scale exactly, as the reference rounds it.
constant constexpr float kFp4BitsScale = 16384.0f;  // 2^14
constant constexpr float kU4BitsBias = 1024.0f;

template <uint FMT>
inline void dequant_word_bits(uint word, float scale, float zero_bias, thread float* w) {
  for (uint j = 0; j < 4u; ++j) {
    const uint t = word >> (4u * j);
    const uint bits = FMT == TM_FORMAT_FP4 ? ((t & 0x00070007u) << 9) | ((t & 0x00080008u) << 12)
                                           : (t & 0x000F000Fu) | 0x64006400u;
    const half2 h = as_type<half2>(bits);
    w[j] = (float(h.x) - zero_bias) * scale;
    w[j + 4u] = (float(h.y) - zero_bias) * scale;
  }
}

// The 8 weights of one packed word (rows k..k+7 of one column), all in one scale group because
// group_size is a multiple of 8, from the scale (and zero point) as stored: dequant_word_bits
// with the folding done per word. fp32 product, as the reference computes it.
template <uint FMT>
inline void dequant_word(uint word, float scale, float zero, thread float* w) {
  if (FMT == TM_FORMAT_FP4) {
    dequant_word_bits<FMT>(word, scale * kFp4BitsScale, 0.0f, w);
  } else {
    dequant_word_bits<FMT>(word, scale, kU4BitsBias + zero, w);
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
// TM_INSTANTIATE_QUANT_DTYPE("marlin_gemv", marlin_gemv, half, half) instantiates both formats.
#define TM_INSTANTIATE_QUANT_DTYPE(stem, fn, tname, T)       \
  TM_INSTANTIATE(stem "_fp4_" #tname, fn<TM_FORMAT_FP4, T>)  \
  TM_INSTANTIATE(stem "_u4_" #tname, fn<TM_FORMAT_U4, T>)
