// dequant_trellis on CUDA: W[K, N], one thread per element of a 16x16 tile (block = tile). In f32
// for the dequant op, with the product formed in the reference's order (grid * scale * su * sv) so
// it matches it bit for bit; in fp16 / bf16 (the same fp32 product, rounded once) for the
// dequant_blas family's cuBLAS GEMM.
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

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_dequant(const TrellisLaunch& l, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                            cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == TM_TRELLIS_TILE_ELEMS && l.grid[0] == p.tiles_n && l.grid[1] == p.tiles_k,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the dequant kernel");
  trellis_dequant_kernel<T><<<dim3(l.grid[0], l.grid[1]), TM_TRELLIS_TILE_ELEMS, 0, stream>>>(w, p, W);
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
