// CPU decode family (M <= 16): every packed word is read once for all M rows; per group the
// kernel sums a[m,k] * code_value[k,n] in fp32 and applies the scale (and zero point) once per
// group:
//   FP4: acc += s * sum_k a*v          U4: acc += s * (sum_k a*q - z * sum_k a)
//   Affine: acc += s * sum_k a*q + b * sum_k a
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu/quant_gemm_cpu.h"

namespace torch_marlin {
namespace {

constexpr int64_t kBlockN = 64;       // columns per portable inner block (a [16 x 64] fp32 accumulator fits L1)
constexpr int64_t kPrefetchRows = 8;  // packed rows ahead in the decode strip kernel
constexpr int64_t kMaxStrips = 16;    // 16-column strips per decode pass: 1 KB of each packed row

// Fills vals[r][n] (r in 0..7) with the decoded codes of one packed row for columns [0, nb).
// U4 and Affine codes decode to their unsigned value; the zero point or offset is applied per group
// by the caller.
template <QuantFormat F>
inline void decode_word_row(const int32_t* __restrict words, int64_t nb, float (*__restrict vals)[kBlockN]) {
  int64_t n = 0;
#if defined(__AVX2__)
  for (; n + 8 <= nb; n += 8) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + n));
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(vals[r] + n, decode8<F>(w, r));
  }
#endif
  for (int r = 0; r < 8; ++r) {
    for (int64_t c = n; c < nb; ++c) {
      const uint32_t code = (uint32_t(words[c]) >> (4 * r)) & 15u;
      vals[r][c] = F == QuantFormat::FP4 ? fp4_e2m1_to_float(code) : float(code);
    }
  }
}

template <QuantFormat F>
void decode_block(const QuantGemmArgs& a, const float* __restrict A, const float* __restrict scales,
                  const uint8_t* __restrict zeros, const float* __restrict offsets, const float* __restrict bias,
                  int64_t n0, int64_t nb, float* __restrict C) {
  const int64_t M = a.M, K = a.K, N = a.N, gs = a.group_size;
  const int32_t* B = a.B.data_ptr<int32_t>();
  float acc[kDecodeMaxM][kBlockN] = {};
  float gacc[kDecodeMaxM][kBlockN];
  float vals[8][kBlockN];
  for (int64_t g = 0; g < K / gs; ++g) {
    for (int64_t m = 0; m < M; ++m) std::fill(gacc[m], gacc[m] + nb, 0.f);
    for (int64_t kw = g * gs / 8; kw < (g + 1) * gs / 8; ++kw) {
      decode_word_row<F>(B + kw * N + n0, nb, vals);
      for (int64_t m = 0; m < M; ++m) {
        const float* am = A + m * K + kw * 8;
        for (int r = 0; r < 8; ++r) {
          const float av = am[r];
          for (int64_t n = 0; n < nb; ++n) gacc[m][n] += av * vals[r][n];
        }
      }
    }
    const float* s = scales + g * N + n0;
    if (F == QuantFormat::FP4) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < nb; ++n) acc[m][n] += s[n] * gacc[m][n];
    } else if (F == QuantFormat::Affine) {
      const float* b = offsets + g * N + n0;
      for (int64_t m = 0; m < M; ++m) {
        float asum = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) asum += A[m * K + k];
        for (int64_t n = 0; n < nb; ++n) acc[m][n] += s[n] * gacc[m][n] + b[n] * asum;
      }
    } else {
      const uint8_t* z = zeros + g * N + n0;
      for (int64_t m = 0; m < M; ++m) {
        float asum = 0.f;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) asum += A[m * K + k];
        for (int64_t n = 0; n < nb; ++n) acc[m][n] += s[n] * (gacc[m][n] - float(z[n] & 15u) * asum);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < nb; ++n) C[m * N + n0 + n] = acc[m][n] + (bias ? bias[n0 + n] : 0.f);
}

#if defined(__AVX2__)
// Decode kernel for one scale group g, 16 columns [n0, n0 + 16) and rows [m0, m0 + R): the group
// accumulators live in 2R ymm registers; each packed word is decoded once per row chunk of R <= 4
// rows. asum[m][g] = sum of A over group g (the U4 zero-point and Affine offset term).
template <QuantFormat F, int R>
void decode_strip16(const QuantGemmArgs& a, const float* __restrict A, const float* __restrict scales,
                    const uint8_t* __restrict zeros, const float* __restrict offsets, const float* __restrict asum,
                    int64_t m0, int64_t n0, int64_t g, float (*__restrict acc)[16]) {
  const int64_t K = a.K, N = a.N, gs = a.group_size, G = K / gs;
  const int32_t* B = a.B.data_ptr<int32_t>() + n0;
  {
    __m256 ga[R][2];
    for (int m = 0; m < R; ++m) ga[m][0] = ga[m][1] = _mm256_setzero_ps();
    for (int64_t kw = g * gs / 8; kw < (g + 1) * gs / 8; ++kw) {
      // Rows are N words apart (>= 4 KB for real layers): the hardware prefetchers do not follow
      // such strides, so fetch a few rows ahead explicitly (the kernel is otherwise latency bound).
      _mm_prefetch(reinterpret_cast<const char*>(B + (kw + kPrefetchRows) * N), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + kw * N));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + kw * N + 8));
      const float* ak = A + m0 * K + kw * 8;
      for (int r = 0; r < 8; ++r) {
        const __m256 v0 = decode8<F>(w0, r), v1 = decode8<F>(w1, r);
        for (int m = 0; m < R; ++m) {
          const __m256 av = _mm256_broadcast_ss(ak + m * K + r);
          ga[m][0] = _mm256_fmadd_ps(av, v0, ga[m][0]);
          ga[m][1] = _mm256_fmadd_ps(av, v1, ga[m][1]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(scales + g * N + n0 + 8 * h);
      __m256 z = _mm256_setzero_ps();
      if (F == QuantFormat::U4) {
        z = zero_points8(zeros + g * N + n0 + 8 * h);
      }
      __m256 b = _mm256_setzero_ps();
      if (F == QuantFormat::Affine) {
        b = _mm256_loadu_ps(offsets + g * N + n0 + 8 * h);
      }
      for (int m = 0; m < R; ++m) {
        __m256 t = ga[m][h];
        if (F == QuantFormat::U4) t = _mm256_fnmadd_ps(z, _mm256_set1_ps(asum[(m0 + m) * G + g]), t);
        __m256 out = _mm256_fmadd_ps(s, t, _mm256_loadu_ps(acc[m] + 8 * h));
        if (F == QuantFormat::Affine) out = _mm256_fmadd_ps(b, _mm256_set1_ps(asum[(m0 + m) * G + g]), out);
        _mm256_storeu_ps(acc[m] + 8 * h, out);
      }
    }
  }
}

// All rows for the 16-column strips [n0, n0 + 16 * strips), strips <= kMaxStrips: row chunks of up to 4,
// then per group every strip in turn, so consecutive reads of a packed row are adjacent cache
// lines of one page (rows are N words apart; one strip per pass would touch a new page per row).
template <QuantFormat F>
void decode_cols(const QuantGemmArgs& a, const float* A, const float* scales, const uint8_t* zeros,
                 const float* offsets, const float* asum, const float* bias, int64_t n0, int64_t strips, float* C) {
  for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
    float acc[kMaxStrips][4][16] = {};
    const int64_t rows = std::min<int64_t>(4, a.M - m0);
    for (int64_t g = 0; g < a.K / a.group_size; ++g) {
      for (int64_t st = 0; st < strips; ++st) {
        const int64_t c = n0 + 16 * st;
        switch (rows) {
          case 4: decode_strip16<F, 4>(a, A, scales, zeros, offsets, asum, m0, c, g, acc[st]); break;
          case 3: decode_strip16<F, 3>(a, A, scales, zeros, offsets, asum, m0, c, g, acc[st]); break;
          case 2: decode_strip16<F, 2>(a, A, scales, zeros, offsets, asum, m0, c, g, acc[st]); break;
          default: decode_strip16<F, 1>(a, A, scales, zeros, offsets, asum, m0, c, g, acc[st]); break;
        }
      }
    }
    for (int64_t st = 0; st < strips; ++st)
      for (int64_t m = m0; m < m0 + rows; ++m)
        for (int n = 0; n < 16; ++n) {
          const int64_t col = n0 + 16 * st + n;
          C[m * a.N + col] = acc[st][m - m0][n] + (bias ? bias[col] : 0.f);
        }
  }
}
#endif

template <QuantFormat F>
void decode_impl(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o) {
  const float* A = o.A.data_ptr<float>();
  const float* scales = o.scales.data_ptr<float>();
  const uint8_t* zeros = F == QuantFormat::U4 ? a.zeros.data_ptr<uint8_t>() : nullptr;
  const float* offsets = F == QuantFormat::Affine ? o.offsets.data_ptr<float>() : nullptr;
  const float* bias = o.bias.defined() ? o.bias.data_ptr<float>() : nullptr;
  float* Cp = o.C.data_ptr<float>();
  const int64_t tile_n = plan.params.tile_n;
  const int64_t n_tiles = plan.params.n_tiles;
  std::vector<float> asum;  // [M][G] sums of A per group: the U4 zero-point and Affine offset term
  if (F != QuantFormat::FP4) {
    asum = std::vector<float>(size_t(a.M) * (a.K / a.group_size));
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t k = 0; k < a.K; ++k) asum[m * (a.K / a.group_size) + k / a.group_size] += A[m * a.K + k];
  }
  at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t c = t * tile_n;
      const int64_t end = std::min(c + tile_n, a.N);
#if defined(__AVX2__)
      while (c + 16 <= end) {
        const int64_t strips = std::min<int64_t>(kMaxStrips, (end - c) / 16);
        decode_cols<F>(a, A, scales, zeros, offsets, asum.data(), bias, c, strips, Cp);
        c += 16 * strips;
      }
#endif
      for (; c < end; c += kBlockN)
        decode_block<F>(a, A, scales, zeros, offsets, bias, c, std::min(kBlockN, end - c), Cp);
    }
  });
}

}  // namespace

void decode_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o) {
  switch (a.format) {
    case QuantFormat::FP4: decode_impl<QuantFormat::FP4>(plan, a, o); break;
    case QuantFormat::U4: decode_impl<QuantFormat::U4>(plan, a, o); break;
    case QuantFormat::Affine: decode_impl<QuantFormat::Affine>(plan, a, o); break;
  }
}

}  // namespace torch_marlin
