// The dequant kernel: [K, N] (or a column panel of it) in the scales' dtype. It serves the
// standalone dequant op and dequant_blas, the fp16/bf16 path for M past the decode and wgmma
// kernels: each column panel of B (all of N up to 1 GiB; benchmarks/notes/cuda-tuning.md CUDA-DEQUANT-PANEL)
// is dequantized into a workspace and multiplied by cuBLAS (at::mm_out) into C's columns, which
// from 129 rows on beats the decode kernel (benchmarks/notes/cuda-tuning.md CUDA-DECODE-MAX-M).
#include <ATen/ATen.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace torch_marlin {
namespace {

// Dequantizes columns [n0, n0 + cols) of B into W[K][ldw]: the standalone dequant op (n0 = 0,
// cols = ldw = N) and the panels of the dequant_blas path. B, scales and zeros are padded to Np columns
// (a multiple of 16, 16-byte aligned: launch.cu pad_cols) and n0 is a multiple of 16, so a thread reads 8
// adjacent columns of one packed row (two 16-byte loads) and writes 8 rows of 8 values, each one
// 16-byte store when ldw allows. fp16/bf16 use the GEMM kernels' dequant (bit-exact with the
// reference: one rounding of code x scale, affine of code x scale + offset); fp32 the scalar
// reference.
template <typename T, u32 FMT>
__global__ void dequant_kernel(u32 K, u32 Np, u32 gs, u32 n0, u32 cols, u32 ldw, const u32* __restrict__ B,
                               const T* __restrict__ scales, const uint8_t* __restrict__ zeros,
                               const T* __restrict__ offsets, T* __restrict__ W) {
  const u32 col8s = (cols + 7u) / 8u;
  const size_t total = size_t(K / 8u) * col8s;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const u32 kw = u32(i / col8s), c = 8u * u32(i % col8s);
    const u32* b = B + size_t(kw) * Np + n0 + c;
    const size_t q = size_t(kw * 8u / gs) * Np + n0 + c;
    T* w = W + size_t(kw) * 8u * ldw + c;
    const u32 valid = min(8u, cols - c);
    if constexpr (std::is_same<T, float>::value) {
      for (u32 j = 0; j < valid; ++j) {
        const float z =
            FMT == TM_FORMAT_U4 ? float(zeros[q + j]) : FMT == TM_FORMAT_AFFINE ? offsets[q + j] : 0.f;
#pragma unroll
        for (u32 r = 0; r < 8u; ++r)
          w[size_t(r) * ldw + j] = dequant_scalar<FMT>(tm_nibble(b[j], r), scales[q + j], z);
      }
    } else {
      const uint4 lo = *reinterpret_cast<const uint4*>(b), hi = *reinterpret_cast<const uint4*>(b + 4);
      const uint4 s8 = *reinterpret_cast<const uint4*>(scales + q);
      const uint2 z8 = FMT == TM_FORMAT_U4 ? *reinterpret_cast<const uint2*>(zeros + q) : make_uint2(0u, 0u);
      const uint4 o8 =
          FMT == TM_FORMAT_AFFINE ? *reinterpret_cast<const uint4*>(offsets + q) : make_uint4(0u, 0u, 0u, 0u);
      ColQ<T> qa[4], qb[4];
      make_colq<T, FMT>(qa, make_uint2(s8.x, s8.y), z8.x, make_uint2(o8.x, o8.y));
      make_colq<T, FMT>(qb, make_uint2(s8.z, s8.w), z8.y, make_uint2(o8.z, o8.w));
      u32 d[2][4][4];  // [column / 4][column % 4][p]: rows (p, p + 4) of the column
      dequant_words<T, FMT>(d[0], lo, qa);
      dequant_words<T, FMT>(d[1], hi, qb);
      const bool vec = valid == 8u && ldw % 8u == 0u;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const u32 sel = r < 4 ? 0x5410u : 0x7632u;  // the low (row p) or high (row p + 4) halves
        const int p = r & 3;
        uint4 row;
        row.x = prmt(d[0][0][p], d[0][1][p], sel);
        row.y = prmt(d[0][2][p], d[0][3][p], sel);
        row.z = prmt(d[1][0][p], d[1][1][p], sel);
        row.w = prmt(d[1][2][p], d[1][3][p], sel);
        T* dst = w + size_t(r) * ldw;
        if (vec) {
          *reinterpret_cast<uint4*>(dst) = row;
        } else {
          const T* v = reinterpret_cast<const T*>(&row);
          for (u32 j = 0; j < valid; ++j) dst[j] = v[j];
        }
      }
    }
  }
}

int grid_for(size_t total, int threads) {
  const size_t blocks = (total + threads - 1) / threads;
  return int(std::min<size_t>(blocks, 65535u * 8u));
}

}  // namespace

namespace cuda_backend {

template <typename T, u32 FMT>
void launch_dequant(const QuantGemmArgs& a, const PaddedWeights& w, u32 n0, u32 cols, u32 ldw, T* W,
                    cudaStream_t stream) {
  const int threads = 256;
  dequant_kernel<T, FMT><<<grid_for(size_t(a.K / 8) * ((cols + 7) / 8), threads), threads, 0, stream>>>(
      u32(a.K), u32(w.B.size(1)), u32(a.group_size), n0, cols, ldw, reinterpret_cast<const u32*>(w.B.data_ptr()),
      reinterpret_cast<const T*>(w.scales.data_ptr()), w.zeros.defined() ? w.zeros.data_ptr<uint8_t>() : nullptr,
      w.offsets.defined() ? reinterpret_cast<const T*>(w.offsets.data_ptr()) : nullptr, W);
  check_launch("dequant");
}

// dequant_blas: per column panel of params.tile_n columns (the planner: all of N unless over
// 1 GiB), dequantize into the [K, tile_n] workspace and let cuBLAS (at::mm_out: torch's handle,
// workspace and current stream) multiply into C's columns. C's panel is a row-major view with
// leading dimension N, which torch passes to cuBLAS as is (no copy). Panels run in order on the
// stream, so one buffer serves them all.
template <typename T, u32 FMT>
void launch_dequant_blas(const GemmPlan& plan, const QuantGemmArgs& a, const PaddedWeights& w, at::Tensor& C,
                         at::Tensor& ws, cudaStream_t stream) {
  const int64_t P = plan.params.tile_n;
  TORCH_CHECK(ws.defined() && size_t(ws.numel()) * sizeof(float) >= size_t(a.K) * P * sizeof(T) && P % 16 == 0,
              "torch_marlin: bad dequant_blas plan");
  const at::Tensor panel = ws.view(a.A.scalar_type()).narrow(0, 0, a.K * P).view({a.K, P});
  T* pW = reinterpret_cast<T*>(panel.data_ptr());
  for (int64_t n0 = 0; n0 < a.N; n0 += P) {
    const int64_t cols = std::min(P, a.N - n0);
    launch_dequant<T, FMT>(a, w, u32(n0), u32(cols), u32(P), pW, stream);
    at::Tensor Cp = C.narrow(1, n0, cols);
    const at::Tensor Wp = panel.narrow(1, 0, cols);
    if (a.bias.defined()) at::addmm_out(Cp, a.bias.narrow(0, n0, cols), a.A, Wp);
    else at::mm_out(Cp, a.A, Wp);
  }
}

template void launch_dequant<__half, TM_FORMAT_FP4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                    uint32_t, __half*, cudaStream_t);
template void launch_dequant<__half, TM_FORMAT_U4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                   uint32_t, __half*, cudaStream_t);
template void launch_dequant<__nv_bfloat16, TM_FORMAT_FP4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t,
                                                           uint32_t, uint32_t, __nv_bfloat16*, cudaStream_t);
template void launch_dequant<__nv_bfloat16, TM_FORMAT_U4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t,
                                                          uint32_t, uint32_t, __nv_bfloat16*, cudaStream_t);
template void launch_dequant<float, TM_FORMAT_FP4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                   uint32_t, float*, cudaStream_t);
template void launch_dequant<float, TM_FORMAT_U4>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                  uint32_t, float*, cudaStream_t);
template void launch_dequant_blas<__half, TM_FORMAT_FP4>(const GemmPlan&, const QuantGemmArgs&, const PaddedWeights&,
                                                         at::Tensor&, at::Tensor&, cudaStream_t);
template void launch_dequant_blas<__half, TM_FORMAT_U4>(const GemmPlan&, const QuantGemmArgs&, const PaddedWeights&,
                                                        at::Tensor&, at::Tensor&, cudaStream_t);
template void launch_dequant_blas<__nv_bfloat16, TM_FORMAT_FP4>(const GemmPlan&, const QuantGemmArgs&,
                                                                const PaddedWeights&, at::Tensor&, at::Tensor&,
                                                                cudaStream_t);
template void launch_dequant_blas<__nv_bfloat16, TM_FORMAT_U4>(const GemmPlan&, const QuantGemmArgs&,
                                                               const PaddedWeights&, at::Tensor&, at::Tensor&,
                                                               cudaStream_t);

template void launch_dequant<__half, TM_FORMAT_AFFINE>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                       uint32_t, __half*, cudaStream_t);
template void launch_dequant<__nv_bfloat16, TM_FORMAT_AFFINE>(const QuantGemmArgs&, const PaddedWeights&, uint32_t,
                                                              uint32_t, uint32_t, __nv_bfloat16*, cudaStream_t);
template void launch_dequant<float, TM_FORMAT_AFFINE>(const QuantGemmArgs&, const PaddedWeights&, uint32_t, uint32_t,
                                                      uint32_t, float*, cudaStream_t);
template void launch_dequant_blas<__half, TM_FORMAT_AFFINE>(const GemmPlan&, const QuantGemmArgs&,
                                                            const PaddedWeights&, at::Tensor&, at::Tensor&,
                                                            cudaStream_t);
template void launch_dequant_blas<__nv_bfloat16, TM_FORMAT_AFFINE>(const GemmPlan&, const QuantGemmArgs&,
                                                                   const PaddedWeights&, at::Tensor&, at::Tensor&,
                                                                   cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
