// dequant_trellis on CUDA: W[K, N] with the product formed in the reference's order
// (grid * scale * su * sv): in f32 for the dequant op (one thread per element of a 16x16 tile,
// bit for bit the reference), and in fp16 / bf16 (the same fp32 product, rounded once) for the
// dequant_blas family's cuBLAS GEMM, 8 columns a thread with 16-byte stores.
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

template <typename T>
__global__ void __launch_bounds__(TM_TRELLIS_TILE_ELEMS)
    trellis_dequant_kernel(const cuda_backend::TrellisMatrixPtrs w, TrellisParams p, T* __restrict__ W) {
  const u32 tn = blockIdx.x, tk = blockIdx.y, i = threadIdx.x;
  const u32 k = tk * TM_TRELLIS_TILE + i / TM_TRELLIS_TILE, n = tn * TM_TRELLIS_TILE + i % TM_TRELLIS_TILE;
  if (k >= p.K || n >= p.N) return;
  const uint8_t* tile = w.packed + trellis_tile_offset(tk, tn, p.tiles_n, p.packed_bytes);
  const u32 idx = trellis_unpack_index(tile, i, p.bits);
  const float v = w.grid[idx] * w.scales[uint64_t(k / p.group_size) * p.N + n] * w.su[k] * w.sv[n];
  if constexpr (std::is_same<T, float>::value) W[uint64_t(k) * p.N + n] = v;
  else W[uint64_t(k) * p.N + n] = Tr<T>::from_f(v);
}

// The dequant_blas operand: a block covers one tile row of K over 8 tile columns (128 columns);
// thread t takes row t / 16 and 8 adjacent columns, whose indices are bits consecutive bytes of
// the tile row, and writes them as one 16-byte store where the row allows it (a warp writes two
// contiguous 256-byte row pieces).
template <typename T>
__global__ void __launch_bounds__(TM_TRELLIS_CUDA_DEQUANT_THREADS)
    trellis_dequant_rows_kernel(const cuda_backend::TrellisMatrixPtrs w, TrellisParams p, T* __restrict__ W) {
  const u32 t = threadIdx.x, r = t / 16u, c = t % 16u;
  const u32 tn = blockIdx.x * TM_TRELLIS_CUDA_WARPS + c / 2u, tk = blockIdx.y;
  const u32 k = tk * TM_TRELLIS_TILE + r, n0 = tn * TM_TRELLIS_TILE + (c % 2u) * 8u;
  if (k >= p.K || n0 >= p.N) return;
  const uint8_t* bytes = w.packed + trellis_tile_offset(tk, tn, p.tiles_n, p.packed_bytes) +
                         (r * TM_TRELLIS_TILE + (c % 2u) * 8u) * p.bits / 8u;
  u32 v = 0;
  for (u32 j = 0; j < p.bits; ++j) v |= u32(bytes[j]) << (8u * j);
  const u32 mask = (1u << p.bits) - 1u;
  const float* s = w.scales + uint64_t(k / p.group_size) * p.N + n0;
  const float su = w.su[k];
  __align__(16) T out[8];
#pragma unroll
  for (u32 j = 0; j < 8; ++j) {
    const u32 n = min(n0 + j, p.N - 1u);  // columns past N are computed in bounds, never stored
    out[j] = Tr<T>::from_f(w.grid[(v >> (j * p.bits)) & mask] * s[n - n0] * su * w.sv[n]);
  }
  T* dst = W + uint64_t(k) * p.N + n0;
  if (n0 + 8u <= p.N && p.N % 8u == 0) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
  } else {
    for (u32 j = 0; j < 8 && n0 + j < p.N; ++j) dst[j] = out[j];
  }
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_dequant(const TrellisLaunch& l, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                            cudaStream_t stream) {
  if constexpr (std::is_same<T, float>::value) {
    TORCH_CHECK(l.threads[0] == TM_TRELLIS_TILE_ELEMS && l.grid[0] == p.tiles_n && l.grid[1] == p.tiles_k,
                "torch_marlin: the trellis plan '", l.kernel, "' does not match the dequant kernel");
    trellis_dequant_kernel<T><<<dim3(l.grid[0], l.grid[1]), TM_TRELLIS_TILE_ELEMS, 0, stream>>>(w, p, W);
  } else {
    TORCH_CHECK(l.threads[0] == TM_TRELLIS_CUDA_DEQUANT_THREADS &&
                    l.grid[0] == (p.tiles_n + TM_TRELLIS_CUDA_WARPS - 1) / TM_TRELLIS_CUDA_WARPS &&
                    l.grid[1] == p.tiles_k,
                "torch_marlin: the trellis plan '", l.kernel, "' does not match the dequant kernel");
    trellis_dequant_rows_kernel<T><<<dim3(l.grid[0], l.grid[1]), TM_TRELLIS_CUDA_DEQUANT_THREADS, 0, stream>>>(w, p, W);
  }
  check_launch(l.kernel.c_str());
}

template void launch_trellis_dequant<float>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                            float*, cudaStream_t);
template void launch_trellis_dequant<__half>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                             __half*, cudaStream_t);
template void launch_trellis_dequant<__nv_bfloat16>(const TrellisLaunch&, const TrellisParams&,
                                                    const TrellisMatrixPtrs&, __nv_bfloat16*, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
