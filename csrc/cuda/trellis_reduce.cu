// The ordered sums after the trellis GEMM kernels: the K slices' fp32 partials of a split GEMM,
// and the MoE's combine (top_k rows of a token, each the sum of its K slices). Fixed order, no
// atomics: the result does not depend on the schedule. Both launch behind the kernel that writes
// their input (PDL), so that input is not read-only for their lifetime: no __restrict__ on the
// pointers, which would let the compiler read it through the non-coherent path (ld.global.nc;
// benchmarks/notes/cuda-tuning.md CUDA-PDL).
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

template <typename T>
__global__ void __launch_bounds__(TM_TRELLIS_CUDA_ELEMWISE_THREADS)
    trellis_reduce_kernel(const float* ws, u32 parts, uint64_t count, T* C) {
  // Launched behind the GEMM kernel that writes ws (KernelLaunch::dependent_launch). No early trigger:
  // ws is read to the end and may be the next kernel's memory once the op returns (common.cuh, PDL
  // protocol).
  pdl_wait();
  const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float s = 0.f;
  for (u32 p = 0; p < parts; ++p) s += ws[p * count + i];
  C[i] = from_float<T>(s);
}

template <typename T>
__global__ void __launch_bounds__(TM_TRELLIS_CUDA_ELEMWISE_THREADS)
    trellis_combine_kernel(const float* rows_y, u32 parts, uint64_t part_stride, const float* __restrict__ probs,
                           const int32_t* __restrict__ slot_row, u32 tokens, u32 top_k, u32 hidden, T* y) {
  pdl_wait();  // may be launched behind the down stage that writes rows_y (KernelLaunch::dependent_launch)
  const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= uint64_t(tokens) * hidden) return;
  const u32 t = u32(i / hidden), h = u32(i % hidden);
  // Rows and probabilities of 8 slots first, then their partials: the loads of a group are all in
  // flight at once instead of one dependent chain per slot. The sums keep slot and slice order.
  constexpr u32 kGroup = 8;
  float acc = 0.f;
  for (u32 j0 = 0; j0 < top_k; j0 += kGroup) {
    uint64_t row[kGroup];
    float prob[kGroup];
#pragma unroll
    for (u32 q = 0; q < kGroup; ++q) {
      const uint64_t r = uint64_t(t) * top_k + min(j0 + q, top_k - 1u);
      row[q] = slot_row != nullptr ? uint64_t(slot_row[r]) : r;
      prob[q] = probs[r];
    }
#pragma unroll
    for (u32 q = 0; q < kGroup; ++q) {
      if (j0 + q >= top_k) break;
      float v = 0.f;
      for (u32 p = 0; p < parts; ++p) v += rows_y[p * part_stride + row[q] * hidden + h];
      acc = fmaf(prob[q], v, acc);
    }
  }
  y[i] = from_float<T>(acc);
}

u32 blocks_for(uint64_t count) {
  return u32((count + TM_TRELLIS_CUDA_ELEMWISE_THREADS - 1) / TM_TRELLIS_CUDA_ELEMWISE_THREADS);
}

// One thread an element over the plan's 1-D grid; with l.dependent_launch behind the previous kernel.
template <typename... KArgs, typename... Args>
void launch_elementwise(const KernelLaunch& l, void (*kernel)(KArgs...), cudaStream_t stream, Args... args) {
  cuda_backend::launch_kernel(kernel, dim3(l.grid[0]), dim3(TM_TRELLIS_CUDA_ELEMWISE_THREADS), 0, stream,
                              l.dependent_launch, l.kernel.c_str(), args...);
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_reduce(const KernelLaunch& l, const float* ws, uint32_t parts, uint64_t count, T* C,
                           cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == TM_TRELLIS_CUDA_ELEMWISE_THREADS && l.grid[0] == blocks_for(count),
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the reduction");
  launch_elementwise(l, trellis_reduce_kernel<T>, stream, ws, parts, count, C);
}

template <typename T>
void launch_trellis_combine(const KernelLaunch& l, const float* rows_y, uint32_t parts, uint64_t part_stride,
                            const float* probs, const int32_t* slot_row, uint32_t tokens, uint32_t top_k,
                            uint32_t hidden, T* y, cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == TM_TRELLIS_CUDA_ELEMWISE_THREADS && l.grid[0] == blocks_for(uint64_t(tokens) * hidden),
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the MoE combine");
  launch_elementwise(l, trellis_combine_kernel<T>, stream, rows_y, parts, part_stride, probs, slot_row, tokens, top_k,
                     hidden, y);
}

#define TM_TRELLIS_INSTANTIATE(T)                                                                                  \
  template void launch_trellis_reduce<T>(const KernelLaunch&, const float*, uint32_t, uint64_t, T*, cudaStream_t); \
  template void launch_trellis_combine<T>(const KernelLaunch&, const float*, uint32_t, uint64_t, const float*,      \
                                          const int32_t*, uint32_t, uint32_t, uint32_t, T*, cudaStream_t);
TM_TRELLIS_INSTANTIATE(float)
TM_TRELLIS_INSTANTIATE(__half)
TM_TRELLIS_INSTANTIATE(__nv_bfloat16)
#undef TM_TRELLIS_INSTANTIATE

}  // namespace cuda_backend
}  // namespace torch_marlin
