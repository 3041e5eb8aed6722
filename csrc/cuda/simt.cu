// The simt kernel: fp32 activations on CUDA cores (correct, not fast).
#include <ATen/ATen.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace torch_marlin {
namespace {

// fp32 activations: one thread per column, 8 rows per block row; A reads are warp broadcasts.
template <u32 FMT>
__global__ void __launch_bounds__(128) simt_kernel(QuantGemmParams p, const float* __restrict__ A,
                                                   const u32* __restrict__ B, const float* __restrict__ scales,
                                                   const uint8_t* __restrict__ zeros,
                                                   const float* __restrict__ offsets, const float* __restrict__ bias,
                                                   float* __restrict__ C) {
  const u32 n = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 m0 = blockIdx.y * 8u;
  if (n >= p.N) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (u32 kw = 0; kw < p.K / 8u; ++kw) {
    const u32 w = B[size_t(kw) * p.N + n];
    const u32 grp = kw * 8u / p.group_size;
    const float s = scales[size_t(grp) * p.N + n];
    // The zero point (U4) or the offset (affine).
    const float z = FMT == TM_FORMAT_U4 ? float(zeros[size_t(grp) * p.N + n])
                    : FMT == TM_FORMAT_AFFINE ? offsets[size_t(grp) * p.N + n] : 0.f;
    float wv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) wv[i] = dequant_scalar<FMT>(tm_nibble(w, i), s, z);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      if (m0 + r >= p.M) break;
      const float* a = A + size_t(m0 + r) * p.K + kw * 8u;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r] = fmaf(a[i], wv[i], acc[r]);
    }
  }
  const float b = p.has_bias ? bias[n] : 0.f;
  for (int r = 0; r < 8 && m0 + r < p.M; ++r) C[size_t(m0 + r) * p.N + n] = acc[r] + b;
}

}  // namespace

namespace cuda_backend {

template <uint32_t FMT>
void launch_simt(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, cudaStream_t stream) {
  const QuantGemmParams& q = plan.params;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  // A block is tile_n threads (one column each, __launch_bounds__(128)) over 8 rows.
  TORCH_CHECK(q.tile_m == 8u && main.threads[0] == q.tile_n && q.tile_n <= 128u && main.grid[0] == q.n_tiles &&
                  main.grid[1] == q.m_tiles && q.k_parallel == 1u,
              "torch_marlin: bad simt plan");
  const dim3 grid(main.grid[0], main.grid[1], 1);
  simt_kernel<FMT><<<grid, main.threads[0], 0, stream>>>(
      plan.params, a.A.data_ptr<float>(), reinterpret_cast<const u32*>(a.B.data_ptr()), a.scales.data_ptr<float>(),
      FMT == TM_FORMAT_U4 ? a.zeros.data_ptr<uint8_t>() : nullptr,
      FMT == TM_FORMAT_AFFINE ? a.offsets.data_ptr<float>() : nullptr,
      a.bias.defined() ? a.bias.data_ptr<float>() : nullptr, C.data_ptr<float>());
  check_launch(main.kernel.c_str());
}

template void launch_simt<TM_FORMAT_FP4>(const GemmPlan&, const QuantGemmArgs&, at::Tensor&, cudaStream_t);
template void launch_simt<TM_FORMAT_U4>(const GemmPlan&, const QuantGemmArgs&, at::Tensor&, cudaStream_t);
template void launch_simt<TM_FORMAT_AFFINE>(const GemmPlan&, const QuantGemmArgs&, at::Tensor&, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
