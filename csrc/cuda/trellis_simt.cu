// The fp32-activation trellis GEMM on CUDA cores (dense, and the MoE's stages): exact fp32
// weights grid[idx] * scale, one column per thread, 16 rows per pass. Correct, not fast: fp32
// activations are a reference path on GPUs; fp16 / bf16 run trellis_mma.cu.
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

using cuda_backend::TrellisKernelArgs;

constexpr u32 kThreads = TM_TRELLIS_CUDA_SIMT_THREADS;
constexpr u32 kRows = TM_TRELLIS_CUDA_SIMT_M;
constexpr u32 kChunk = 64;  // K rows of activations staged at a time

template <bool SWIGLU>
__global__ void __launch_bounds__(kThreads) trellis_simt_kernel(const TrellisKernelArgs a, u32 bits) {
  __shared__ float a_s[kRows][kChunk];
  __shared__ float grid_s[TM_TRELLIS_MAX_LEVELS];
  const TrellisBlockOperand op = trellis_block_operand(a);
  if (!op.valid) return;  // uniform: an empty expert slot
  u32 row_begin = 0, row_end = a.M;
  if (a.offsets != nullptr) {
    row_begin = u32(a.offsets[op.e]);
    row_end = u32(a.offsets[op.e + 1]);
  }
  if (row_begin + blockIdx.y * kRows >= row_end) return;  // uniform over the block
  const u32 tid = threadIdx.x;
  if (tid < (1u << bits)) grid_s[tid] = op.w.grid[tid];
  const u32 col = blockIdx.x * kThreads + tid;
  const bool valid = col < a.N;
  const u32 tile_bytes = 32u * bits;
  float* out = static_cast<float*>(op.which ? a.out[1] : a.out[0]);
  for (u32 r0 = row_begin + blockIdx.y * kRows; r0 < row_end; r0 += kRows * a.m_tiles) {
    float acc[kRows];
#pragma unroll
    for (u32 r = 0; r < kRows; ++r) acc[r] = 0.f;
    for (u32 k0 = 0; k0 < a.K; k0 += kChunk) {
      __syncthreads();  // the previous chunk's readers are done (and grid_s is written)
      for (u32 i = tid; i < kRows * kChunk; i += kThreads) {
        const u32 r = i / kChunk, k = k0 + i % kChunk;
        a_s[r][i % kChunk] = r0 + r < row_end && k < a.K ? trellis_load_act<float, SWIGLU>(a, r0 + r, k) * op.w.su[k] : 0.f;
      }
      __syncthreads();
      if (!valid) continue;
      const u32 kn = min(kChunk, a.K - k0);
      for (u32 kk = 0; kk < kn; ++kk) {
        const u32 k = k0 + kk;
        const uint8_t* tile = op.w.packed + (uint64_t(k / TM_TRELLIS_TILE) * a.tiles_n + col / TM_TRELLIS_TILE) * tile_bytes;
        const u32 idx = trellis_unpack_index(tile, (k % TM_TRELLIS_TILE) * TM_TRELLIS_TILE + col % TM_TRELLIS_TILE, bits);
        const float w = grid_s[idx] * op.w.scales[uint64_t(k / a.group_size) * a.N + col];
#pragma unroll
        for (u32 r = 0; r < kRows; ++r) acc[r] = fmaf(a_s[r][kk], w, acc[r]);
      }
    }
    if (!valid) continue;
    const float s = op.w.sv[col];
    for (u32 r = 0; r < kRows && r0 + r < row_end; ++r) out[uint64_t(r0 + r) * a.ldc + col] = acc[r] * s;
  }
}

}  // namespace

namespace cuda_backend {

void launch_trellis_simt(const KernelLaunch& l, uint32_t bits, bool swiglu, const TrellisKernelArgs& a,
                         cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == kThreads && a.k_parallel == 1, "torch_marlin: the trellis plan '", l.kernel,
              "' does not match the fp32 kernel's geometry");
  const dim3 grid(l.grid[0], l.grid[1], l.grid[2]);
  if (swiglu) trellis_simt_kernel<true><<<grid, kThreads, 0, stream>>>(a, bits);
  else trellis_simt_kernel<false><<<grid, kThreads, 0, stream>>>(a, bits);
  check_launch(l.kernel.c_str());
}

}  // namespace cuda_backend
}  // namespace torch_marlin
