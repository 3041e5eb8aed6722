// CPU gemm_rans (docs/formats.md, "rANS-coded 4-bit codes"), the family the plan names:
//   decode (M <= TM_RANS_FUSED_MAX_M): one task per tile range; each tile's 32 lanes decode one
//     step (32 consecutive k of one channel, one scale group) and the step is multiplied into
//     per-lane fp32 group sums of every row at once, so the dense weight never exists. Per group:
//       FP4: acc += s * sum a*v    U4: acc += s * (sum a*q - z * sum a)    Affine: acc += s * sum a*q + b * sum a
//     with the lane sums added in lane order (deterministic).
//   staged: the whole layer decoded to a temporary B_packed, then the format's CPU GEMM (plan.gemm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <memory>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/rans_cpu.h"

namespace torch_marlin {
namespace {

constexpr int64_t kLanes = TM_RANS_LANES;

struct FusedOperands {
  const float* A = nullptr;       // [M, K]
  const float* scales = nullptr;  // [G, N]
  const uint8_t* zeros = nullptr;
  const float* offsets = nullptr;
  const float* bias = nullptr;
  const float* asum = nullptr;    // [M, G]: sums of A per group (U4, Affine)
};

#if defined(__AVX2__)
// 8 symbols (int32 lanes) as weights: FP4 -> E2M1 value (vpermps reads the 3 magnitude bits, the
// sign bit is moved to bit 31), U4 and Affine -> the unsigned code.
template <QuantFormat F>
inline __m256 values8(__m256i s) {
  if (F == QuantFormat::FP4) {
    const __m256 mags = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(s, 28), _mm256_set1_epi32(int32_t(0x80000000u)));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, s), _mm256_castsi256_ps(sign));
  }
  return _mm256_cvtepi32_ps(s);
}
#endif

template <QuantFormat F, bool kAvx2>
void fused_tiles(const RansGemmArgs& a, const FusedOperands& o, float* C, int64_t t0, int64_t t1) {
  const int64_t M = a.M, K = a.K, N = a.N, gs = a.group_size, G = K / gs;
  const int64_t Cw = a.codes.channels_per_tile;
  float lut[TM_RANS_SYMBOLS];
  for (uint32_t s = 0; s < TM_RANS_SYMBOLS; ++s) lut[s] = F == QuantFormat::FP4 ? fp4_e2m1_to_float(s) : float(s);
  auto dec = std::make_unique<RansTileDecoder>();
  alignas(32) uint8_t sym[kLanes];
  alignas(32) float v[kLanes];
  alignas(32) float gacc[TM_RANS_FUSED_MAX_M][kLanes];
  float acc[TM_RANS_FUSED_MAX_M];
  for (int64_t t = t0; t < t1; ++t) {
    dec->init(a.codes.words.data_ptr<int16_t>(), a.codes.word_offsets.data_ptr<int32_t>(),
              a.codes.states.data_ptr<int32_t>(), a.codes.freqs.data_ptr<int16_t>(), t);
    const int64_t n0 = t * Cw, channels = std::min(Cw, N - n0);
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t n = n0 + c;
      for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t l = 0; l < kLanes; ++l) gacc[m][l] = 0.f;
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += kLanes) {
#if defined(__AVX2__)
          if constexpr (kAvx2) {
            // Each 8-lane vector of symbols becomes 8 weights in a register and meets A there.
            dec->step_avx2([&](uint32_t v8, __m256i s32) {
              const __m256 w = values8<F>(s32);
              for (int64_t m = 0; m < M; ++m) {
                float* ga = gacc[m] + 8 * v8;
                _mm256_store_ps(ga, _mm256_fmadd_ps(_mm256_loadu_ps(o.A + m * K + k0 + 8 * v8), w, _mm256_load_ps(ga)));
              }
            });
            continue;
          }
#endif
          dec->step(sym);
          for (int64_t l = 0; l < kLanes; ++l) v[l] = lut[sym[l]];
          for (int64_t m = 0; m < M; ++m) {
            const float* __restrict am = o.A + m * K + k0;
            float* __restrict ga = gacc[m];
            for (int64_t l = 0; l < kLanes; ++l) ga[l] += am[l] * v[l];
          }
        }
        const float s = o.scales[g * N + n];
        for (int64_t m = 0; m < M; ++m) {
          float sum = 0.f;
          for (int64_t l = 0; l < kLanes; ++l) sum += gacc[m][l];
          if (F == QuantFormat::FP4) {
            acc[m] += s * sum;
          } else if (F == QuantFormat::U4) {
            acc[m] += s * (sum - float(o.zeros[g * N + n] & 15u) * o.asum[m * G + g]);
          } else {
            acc[m] += s * sum + o.offsets[g * N + n] * o.asum[m * G + g];
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) C[m * N + n] = acc[m] + (o.bias ? o.bias[n] : 0.f);
    }
  }
}

template <bool kAvx2>
void fused_format(const RansGemmArgs& a, const FusedOperands& o, float* C, int64_t t0, int64_t t1) {
  switch (a.format) {
    case QuantFormat::FP4: fused_tiles<QuantFormat::FP4, kAvx2>(a, o, C, t0, t1); break;
    case QuantFormat::U4: fused_tiles<QuantFormat::U4, kAvx2>(a, o, C, t0, t1); break;
    case QuantFormat::Affine: fused_tiles<QuantFormat::Affine, kAvx2>(a, o, C, t0, t1); break;
  }
}

void fused_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  const at::Tensor A = a.A.to(at::kFloat).contiguous();
  const at::Tensor scales = a.scales.to(at::kFloat).contiguous();
  at::Tensor offsets, bias;
  FusedOperands o;
  o.A = A.data_ptr<float>();
  o.scales = scales.data_ptr<float>();
  if (a.format == QuantFormat::U4) o.zeros = a.zeros.data_ptr<uint8_t>();
  if (a.format == QuantFormat::Affine) {
    offsets = a.offsets.to(at::kFloat).contiguous();
    o.offsets = offsets.data_ptr<float>();
  }
  if (a.bias.defined()) {
    bias = a.bias.to(at::kFloat).contiguous();
    o.bias = bias.data_ptr<float>();
  }
  const int64_t G = a.K / a.group_size;
  std::vector<float> asum;
  if (a.format != QuantFormat::FP4) {
    asum.assign(size_t(a.M * G), 0.f);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t k = 0; k < a.K; ++k) asum[size_t(m * G + k / a.group_size)] += o.A[m * a.K + k];
    o.asum = asum.data();
  }
  const bool direct = C.scalar_type() == at::kFloat;
  at::Tensor out = direct ? C : at::empty({a.M, a.N}, C.options().dtype(at::kFloat));
  float* Cp = out.data_ptr<float>();
  at::parallel_for(0, int64_t(plan.launches.at(LaunchRole::Decode).grid[0]), 1, [&](int64_t t0, int64_t t1) {
    if (plan.cpu_avx2) {
      fused_format<true>(a, o, Cp, t0, t1);
    } else {
      fused_format<false>(a, o, Cp, t0, t1);
    }
  });
  if (!direct) C.copy_(out);
}

void staged_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  at::Tensor B = at::empty({a.K / 8, a.N}, a.codes.words.options().dtype(at::kInt));
  rans_decode_to_packed(a.codes, B, /*check=*/false, plan.cpu_avx2);
  at::Tensor no_workspace;
  CpuBackend::quant_gemm(plan.gemm, staged_gemm_args(a, B), C, no_workspace);
}

}  // namespace

void CpuBackend::rans_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  if (plan.family == RansFamily::Fused) {
    fused_gemm(plan, a, C);
  } else {
    staged_gemm(plan, a, C);
  }
}

}  // namespace torch_marlin
