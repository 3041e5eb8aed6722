// dequant_trellis on CUDA: W[K, N] in f32 (the dequant op, with the product formed in the
// reference's order, grid * scale * su * sv, so it matches it bit for bit) or in fp16 / bf16 (the
// same fp32 product, rounded once) for the dequant_blas family's cuBLAS GEMM.
//
// A block owns 16 tiles of one tile row (256 columns, one scale group) and a thread one
// 16-column row of one tile: it reads that row's 2 x bits index bytes (the 16 threads of a tile
// read its bytes in order) and writes 16 consecutive outputs with 16-byte stores, so every 32-byte
// sector of W is written whole by one thread. The block stages its columns' scales and sv once
// (docs/cuda-tuning.md TRELLIS-CUDA-DEQUANT).
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

constexpr u32 kTiles = TM_TRELLIS_CUDA_DEQUANT_TILES;
constexpr u32 kThreads = kTiles * TM_TRELLIS_TILE;
constexpr u32 kCols = kTiles * TM_TRELLIS_TILE;
static_assert(kThreads == 256u, "one thread per tile row of the block's tiles");

// The 16 indices of tile row r (2 x bits bytes at r * 2 * bits), as one little-endian bit stream.
template <u32 BITS>
__device__ __forceinline__ uint64_t row_bits(const uint8_t* tile, u32 r) {
  if constexpr (BITS == 4) {
    const uint2 q = *reinterpret_cast<const uint2*>(tile + 8u * r);
    return uint64_t(q.x) | uint64_t(q.y) << 32;
  } else if constexpr (BITS == 2) return *reinterpret_cast<const u32*>(tile + 4u * r);
  else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(tile + 6u * r);
    return uint64_t(h[0]) | uint64_t(h[1]) << 16 | uint64_t(h[2]) << 32;
  }
}

template <typename T>
__device__ __forceinline__ void store16(T* dst, const float (&v)[16], bool vec, u32 valid) {
  if constexpr (std::is_same<T, float>::value) {
    if (vec) {
#pragma unroll
      for (u32 i = 0; i < 16; i += 4) *reinterpret_cast<float4*>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
      return;
    }
    for (u32 i = 0; i < valid; ++i) dst[i] = v[i];
  } else {
    using T2 = typename Tr<T>::T2;
    if (vec) {
      u32 h[8];
#pragma unroll
      for (u32 i = 0; i < 8; ++i) {
        T2 p;
        p.x = Tr<T>::from_f(v[2 * i]);
        p.y = Tr<T>::from_f(v[2 * i + 1]);
        h[i] = as_u32(p);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
      *reinterpret_cast<uint4*>(dst + 8) = make_uint4(h[4], h[5], h[6], h[7]);
      return;
    }
    for (u32 i = 0; i < valid; ++i) dst[i] = Tr<T>::from_f(v[i]);
  }
}

template <typename T, u32 BITS>
__global__ void __launch_bounds__(kThreads)
    trellis_dequant_kernel(const cuda_backend::TrellisMatrixPtrs w, TrellisParams p, T* __restrict__ W) {
  __shared__ float grid_s[TM_TRELLIS_MAX_LEVELS];
  __shared__ float scale_s[kCols], sv_s[kCols];
  const u32 tid = threadIdx.x, tk = blockIdx.y;
  const u32 n_block = blockIdx.x * kCols;
  const u32 gi = tk * TM_TRELLIS_TILE / p.group_size;  // a tile row never straddles two groups
  if (tid < (1u << BITS)) grid_s[tid] = w.grid[tid];
  {
    const u32 n = n_block + tid;
    scale_s[tid] = n < p.N ? w.scales[uint64_t(gi) * p.N + n] : 0.f;
    sv_s[tid] = n < p.N ? w.sv[n] : 0.f;
  }
  __syncthreads();
  const u32 tile = tid / TM_TRELLIS_TILE, r = tid % TM_TRELLIS_TILE;
  const u32 tn = blockIdx.x * kTiles + tile, k = tk * TM_TRELLIS_TILE + r;
  if (tn >= p.tiles_n || k >= p.K) return;
  const uint64_t bits = row_bits<BITS>(w.packed + trellis_tile_offset(tk, tn, p.tiles_n, p.packed_bytes), r);
  const float su = w.su[k];
  const u32 c0 = tile * TM_TRELLIS_TILE, n0 = n_block + c0;
  float v[16];
#pragma unroll
  for (u32 i = 0; i < 16; ++i) {
    const u32 idx = u32(bits >> (BITS * i)) & ((1u << BITS) - 1u);
    v[i] = grid_s[idx] * scale_s[c0 + i] * su * sv_s[c0 + i];
  }
  // 16-byte stores where the row piece is whole and aligned (N a multiple of the vector width).
  constexpr u32 kVec = 16u / sizeof(T);
  const bool vec = n0 + 16u <= p.N && p.N % kVec == 0;
  store16<T>(W + uint64_t(k) * p.N + n0, v, vec, min(16u, p.N - n0));
}

template <typename T, u32 BITS>
void launch_bits(const TrellisLaunch& l, const TrellisParams& p, const cuda_backend::TrellisMatrixPtrs& w, T* W,
                 cudaStream_t stream) {
  trellis_dequant_kernel<T, BITS><<<dim3(l.grid[0], l.grid[1]), kThreads, 0, stream>>>(w, p, W);
  cuda_backend::check_launch(l.kernel.c_str());
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_dequant(const TrellisLaunch& l, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                            cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == kThreads && l.grid[0] == (p.tiles_n + kTiles - 1) / kTiles && l.grid[1] == p.tiles_k &&
                  p.group_size % TM_TRELLIS_TILE == 0,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the dequant kernel");
  switch (p.bits) {
    case 2: return launch_bits<T, 2>(l, p, w, W, stream);
    case 3: return launch_bits<T, 3>(l, p, w, W, stream);
    case 4: return launch_bits<T, 4>(l, p, w, W, stream);
    default: TORCH_CHECK(false, "torch_marlin: trellis bits must be 2, 3 or 4, got ", p.bits);
  }
}

template void launch_trellis_dequant<float>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                            float*, cudaStream_t);
template void launch_trellis_dequant<__half>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                             __half*, cudaStream_t);
template void launch_trellis_dequant<__nv_bfloat16>(const TrellisLaunch&, const TrellisParams&,
                                                    const TrellisMatrixPtrs&, __nv_bfloat16*, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
