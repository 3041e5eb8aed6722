// CPU kernels of the FP4 / INT4 family: the fallback users get, so real kernels, not a reference.
// One family per file, both walking column blocks of B (contiguous int32 words along N) so the
// inner loops run over N with unit stride and the compiler vectorizes decode + FMA (built with
// AVX2/FMA on x86-64):
//   decode.cpp        every packed word read once for all M rows (M <= 16)
//   dequant_blas.cpp  column chunks dequantized to fp32 once, one BLAS call each (any M); also
//                     the standalone dequant op
// quant_gemm.cpp runs the family plan.desc names.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu/cpu_backend.h"

namespace torch_marlin {

// The GEMM's operands in fp32 (what both families compute in). C is the output itself when it is
// fp32, else a scratch the entry copies back.
struct CpuGemmOperands {
  at::Tensor A, scales, offsets, bias, C;  // offsets: Affine only; bias undefined when absent
};

void decode_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o);
void dequant_blas_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o);

#if defined(__AVX2__)
// Codes of packed row r (0..7) for 8 columns: FP4 -> E2M1 value, U4 and Affine -> unsigned value.
// FP4: vpermps reads only the low 3 bits of each index (the magnitude bits), the sign bit of the
// nibble is shifted to bit 31 and xor-ed in: 5 instructions per 8 weights.
template <QuantFormat F>
inline __m256 decode8(__m256i w, int r) {
  if (F == QuantFormat::FP4) {
    const __m256 mags = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(w, 28 - 4 * r), _mm256_set1_epi32(int32_t(0x80000000u)));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, _mm256_srli_epi32(w, 4 * r)), _mm256_castsi256_ps(sign));
  }
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4 * r), _mm256_set1_epi32(15)));
}
// 8 zero points as floats. Zero points are 0..15 (docs/formats.md); every backend uses the byte's
// low 4 bits, so an out-of-range byte gives the same value everywhere.
inline __m256 zero_points8(const uint8_t* z) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
}
#endif

}  // namespace torch_marlin
