// CPU dequant_blas family (any M; the policy's choice from 9 rows): column chunks of at most
// 8 MB are dequantized to fp32 once (all threads), then one BLAS call multiplies every row of A
// against the chunk; the dense weight never exists beyond one chunk. Also the standalone dequant
// op (the same panel routine over all of N).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "cpu/panel_buffer.h"
#include "cpu/quant_gemm_cpu.h"

namespace torch_marlin {
namespace {

constexpr int64_t kBlockN = 64;  // columns per dequant task
// Dequantized chunk: 2M floats (8 MB) per chunk.
constexpr int64_t kChunkFloats = int64_t(2) << 20;

// Dequantizes columns [n0, n0 + nb) of B into panel[K][ld] (fp32).
template <QuantFormat F>
void dequant_panel(const QuantGemmArgs& a, const float* __restrict scales, const uint8_t* __restrict zeros,
                   const float* __restrict offsets, int64_t n0, int64_t nb, float* __restrict panel, int64_t ld) {
  const int64_t K = a.K, N = a.N, gs = a.group_size;
  const int32_t* B = a.B.data_ptr<int32_t>();
  int64_t vec_end = 0;
#if defined(__AVX2__)
  // Decode, zero point (or offset) and scale in one pass per 8 columns, straight into the panel. Rows outer,
  // columns inner: the panel is written sequentially (column strips would touch a new page per
  // row and thrash the TLB).
  vec_end = nb / 8 * 8;
  for (int64_t kw = 0; kw < K / 8; ++kw) {
    const int64_t g = kw * 8 / gs;
    for (int64_t c0 = 0; c0 < vec_end; c0 += 8) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + kw * N + n0 + c0));
      const __m256 s = _mm256_loadu_ps(scales + g * N + n0 + c0);
      __m256 z = _mm256_setzero_ps();
      if (F == QuantFormat::U4) {
        z = zero_points8(zeros + g * N + n0 + c0);
      }
      if (F == QuantFormat::Affine) {
        const __m256 b = _mm256_loadu_ps(offsets + g * N + n0 + c0);
        for (int r = 0; r < 8; ++r) _mm256_storeu_ps(panel + (kw * 8 + r) * ld + c0, _mm256_fmadd_ps(decode8<F>(w, r), s, b));
        continue;
      }
      for (int r = 0; r < 8; ++r) {
        const __m256 v = F == QuantFormat::U4 ? _mm256_sub_ps(decode8<F>(w, r), z) : decode8<F>(w, r);
        _mm256_storeu_ps(panel + (kw * 8 + r) * ld + c0, _mm256_mul_ps(v, s));
      }
    }
  }
#endif
  for (int64_t kw = 0; kw < K / 8; ++kw) {
    const int64_t g = kw * 8 / gs;
    for (int64_t n = vec_end; n < nb; ++n) {
      const uint32_t word = uint32_t(B[kw * N + n0 + n]);
      const float s = scales[g * N + n0 + n];
      const float z = F == QuantFormat::U4 ? float(zeros[g * N + n0 + n] & 15u) : 0.f;
      const float b = F == QuantFormat::Affine ? offsets[g * N + n0 + n] : 0.f;
      for (int r = 0; r < 8; ++r) {
        const uint32_t code = (word >> (4 * r)) & 15u;
        // Affine: one rounding (fma), as every backend's dequant.
        panel[(kw * 8 + r) * ld + n] = F == QuantFormat::Affine ? std::fma(float(code), s, b)
                                       : (F == QuantFormat::FP4 ? fp4_e2m1_to_float(code) : float(code) - z) * s;
      }
    }
  }
}

template <QuantFormat F>
void dequant_blas_impl(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o) {
  const float* scales = o.scales.data_ptr<float>();
  const uint8_t* zeros = F == QuantFormat::U4 ? a.zeros.data_ptr<uint8_t>() : nullptr;
  const float* offsets = F == QuantFormat::Affine ? o.offsets.data_ptr<float>() : nullptr;
  const int64_t tile_n = plan.params.tile_n;
  // Chunks of whole tiles, each at most 8 MB of fp32 panel: dequantize the chunk with all
  // threads, then one multi-threaded BLAS call for every row. (Calling BLAS per tile from inside
  // parallel_for oversubscribes the cores.)
  const int64_t max_cols = std::max<int64_t>(tile_n, kChunkFloats / a.K / tile_n * tile_n);
  float* panel = panel_buffer(size_t(a.K) * std::min(max_cols, a.N));
  for (int64_t c0 = 0; c0 < a.N; c0 += max_cols) {
    const int64_t cw = std::min(max_cols, a.N - c0);
    at::parallel_for(0, (cw + kBlockN - 1) / kBlockN, 1, [&](int64_t b0, int64_t b1) {
      const int64_t lo = b0 * kBlockN, hi = std::min(b1 * kBlockN, cw);
      dequant_panel<F>(a, scales, zeros, offsets, c0 + lo, hi - lo, panel + lo, cw);
    });
    const at::Tensor P = at::from_blob(panel, {a.K, cw}, at::kFloat);
    at::Tensor out = o.C.narrow(1, c0, cw);
    at::mm_out(out, o.A, P);
    if (o.bias.defined()) out.add_(o.bias.narrow(0, c0, cw));
  }
}

template <QuantFormat F>
void dequant_impl(const QuantGemmArgs& a, at::Tensor& W) {
  const at::Tensor scales_f = a.scales.to(at::kFloat).contiguous();
  const bool direct = W.scalar_type() == at::kFloat;
  at::Tensor Wf = direct ? W : at::empty({a.K, a.N}, W.options().dtype(at::kFloat));
  const uint8_t* zeros = F == QuantFormat::U4 ? a.zeros.data_ptr<uint8_t>() : nullptr;
  const at::Tensor offsets_f = F == QuantFormat::Affine ? a.offsets.to(at::kFloat).contiguous() : at::Tensor();
  const float* offsets = F == QuantFormat::Affine ? offsets_f.data_ptr<float>() : nullptr;
  const int64_t n_tiles = (a.N + kBlockN - 1) / kBlockN;
  at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kBlockN, n1 = std::min(t1 * kBlockN, a.N);
    dequant_panel<F>(a, scales_f.data_ptr<float>(), zeros, offsets, n0, n1 - n0, Wf.data_ptr<float>() + n0, a.N);
  });
  if (!direct) W.copy_(Wf);
}

}  // namespace

void dequant_blas_gemm_cpu(const GemmPlan& plan, const QuantGemmArgs& a, CpuGemmOperands& o) {
  switch (a.format) {
    case QuantFormat::FP4: dequant_blas_impl<QuantFormat::FP4>(plan, a, o); break;
    case QuantFormat::U4: dequant_blas_impl<QuantFormat::U4>(plan, a, o); break;
    case QuantFormat::Affine: dequant_blas_impl<QuantFormat::Affine>(plan, a, o); break;
  }
}

void CpuBackend::quant_dequant(const QuantGemmArgs& args, at::Tensor& W) {
  switch (args.format) {
    case QuantFormat::FP4: dequant_impl<QuantFormat::FP4>(args, W); break;
    case QuantFormat::U4: dequant_impl<QuantFormat::U4>(args, W); break;
    case QuantFormat::Affine: dequant_impl<QuantFormat::Affine>(args, W); break;
  }
}

}  // namespace torch_marlin
