// dequant_trellis on CUDA: W[K, N] in f32 (the dequant op, with the product formed in the
// reference's order, grid * scale * su * sv, so it matches it bit for bit) or in fp16 / bf16 (the
// same fp32 product, rounded once) for the dequant_blas family's cuBLAS GEMM.
//
// A block owns 16 tiles of one tile row (256 columns, one scale group) and a thread one
// 16-column row of one tile: it reads that row's 2 x bits index bytes (the 16 threads of a tile
// read its bytes in order) and writes 16 consecutive outputs with 16-byte stores, so every 32-byte
// sector of W is written whole by one thread. The block stages its columns' scales and sv once
// (benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-DEQUANT). Indices in the CUDA lane layout have their own kernel.
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

// Stores the outputs of columns c, c + 1 of row k (a pair store where both are in W and aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* W, const TrellisParams& p, u32 k, u32 c, float v0, float v1) {
  if (k >= p.K || c >= p.N) return;
  T* dst = W + uint64_t(k) * p.N + c;
  if (c + 1u < p.N && p.N % 2u == 0) {
    if constexpr (std::is_same<T, float>::value) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      typename Tr<T>::T2 h;
      h.x = Tr<T>::from_f(v0);
      h.y = Tr<T>::from_f(v1);
      *reinterpret_cast<typename Tr<T>::T2*>(dst) = h;
    }
    return;
  }
  dst[0] = from_float<T>(v0);
  if (c + 1u < p.N) dst[1] = from_float<T>(v1);
}

// Indices in the CUDA lane layout (docs/trellis.md, "CUDA lane layout"): a warp per lane chunk,
// lane (g, t) decodes its 32 fields (columns 2g, 2g + 1, rows 4t..4t+3 of each of the chunk's 8
// tile rows) and writes them as column pairs: the 8 lanes of a t cover a row's 16 columns, 32
// contiguous bytes of fp16 W. The product is formed in the reference's order, as above.
template <typename T, u32 BITS>
__global__ void __launch_bounds__(kThreads)
    trellis_dequant_lanes_kernel(const cuda_backend::TrellisMatrixPtrs w, TrellisParams p, T* __restrict__ W) {
  __shared__ float grid_s[TM_TRELLIS_MAX_LEVELS];
  constexpr u32 kChunkBytes = TM_TRELLIS_LANE_CHUNK_TILES * 32u * BITS;
  constexpr u32 kMask = (1u << BITS) - 1u;
  const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u, g = lane / 4u, t = lane % 4u;
  if (tid < (1u << BITS)) grid_s[tid] = w.grid[tid];
  __syncthreads();
  const u32 tn = blockIdx.x * (kThreads / 32u) + warp, s = blockIdx.y;
  if (tn >= p.tiles_n) return;
  const u32* src = reinterpret_cast<const u32*>(w.packed + (uint64_t(s) * p.tiles_n + tn) * kChunkBytes +
                                                lane * 8u * BITS);
  u32 v[2 * BITS];
#pragma unroll
  for (u32 i = 0; i < 2 * BITS; ++i) v[i] = src[i];
  const u32 c = tn * TM_TRELLIS_TILE + 2u * g;
  const float sv0 = c < p.N ? w.sv[c] : 0.f, sv1 = c + 1u < p.N ? w.sv[c + 1u] : 0.f;
#pragma unroll
  for (u32 j = 0; j < TM_TRELLIS_LANE_CHUNK_TILES; ++j) {
    const u32 tk = s * TM_TRELLIS_LANE_CHUNK_TILES + j;
    if (tk >= p.tiles_k) break;
    const u32 x = lane_tile_bits<BITS>(v, j);
    const u32 gi = tk * TM_TRELLIS_TILE / p.group_size;
    const float s0 = c < p.N ? w.scales[uint64_t(gi) * p.N + c] : 0.f;
    const float s1 = c + 1u < p.N ? w.scales[uint64_t(gi) * p.N + c + 1u] : 0.f;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {  // rows 4t + 2h, 4t + 2h + 1: fields 2h (column c) and 2h + 1 (c + 1)
      const u32 f0 = x >> (2u * BITS * (2u * h)), f1 = x >> (2u * BITS * (2u * h + 1u));
      const u32 k = tk * TM_TRELLIS_TILE + 4u * t + 2u * h;
      const float su0 = k < p.K ? w.su[k] : 0.f, su1 = k + 1u < p.K ? w.su[k + 1u] : 0.f;
      store_pair<T>(W, p, k, c, grid_s[f0 & kMask] * s0 * su0 * sv0, grid_s[f1 & kMask] * s1 * su0 * sv1);
      store_pair<T>(W, p, k + 1u, c, grid_s[(f0 >> BITS) & kMask] * s0 * su1 * sv0,
                    grid_s[(f1 >> BITS) & kMask] * s1 * su1 * sv1);
    }
  }
}

template <typename T, u32 BITS>
void launch_bits(const TrellisLaunch& l, const TrellisParams& p, const cuda_backend::TrellisMatrixPtrs& w, T* W,
                 bool lanes, cudaStream_t stream) {
  if (lanes) trellis_dequant_lanes_kernel<T, BITS><<<dim3(l.grid[0], l.grid[1]), kThreads, 0, stream>>>(w, p, W);
  else trellis_dequant_kernel<T, BITS><<<dim3(l.grid[0], l.grid[1]), kThreads, 0, stream>>>(w, p, W);
  cuda_backend::check_launch(l.kernel.c_str());
}

template <typename T>
void launch_any(const TrellisLaunch& l, const TrellisParams& p, const cuda_backend::TrellisMatrixPtrs& w, T* W,
                bool lanes, cudaStream_t stream) {
  with_trellis_bits(p.bits, [&](auto b) { launch_bits<T, b.value>(l, p, w, W, lanes, stream); });
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_dequant(const TrellisLaunch& l, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                            cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == kThreads && l.grid[0] == (p.tiles_n + kTiles - 1) / kTiles && l.grid[1] == p.tiles_k &&
                  p.group_size % TM_TRELLIS_TILE == 0,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the dequant kernel");
  launch_any<T>(l, p, w, W, false, stream);
}

template <typename T>
void launch_trellis_dequant_lanes(const TrellisLaunch& l, const TrellisParams& p, const TrellisMatrixPtrs& w, T* W,
                                  cudaStream_t stream) {
  constexpr u32 kChunk = TM_TRELLIS_LANE_CHUNK_TILES, kWarpsPerBlock = kThreads / 32u;
  TORCH_CHECK(l.threads[0] == kThreads && l.grid[0] == (p.tiles_n + kWarpsPerBlock - 1) / kWarpsPerBlock &&
                  l.grid[1] == (p.tiles_k + kChunk - 1) / kChunk && p.group_size % TM_TRELLIS_TILE == 0,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the lane dequant kernel");
  launch_any<T>(l, p, w, W, true, stream);
}

template void launch_trellis_dequant<float>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                            float*, cudaStream_t);
template void launch_trellis_dequant<__half>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                             __half*, cudaStream_t);
template void launch_trellis_dequant<__nv_bfloat16>(const TrellisLaunch&, const TrellisParams&,
                                                    const TrellisMatrixPtrs&, __nv_bfloat16*, cudaStream_t);
template void launch_trellis_dequant_lanes<float>(const TrellisLaunch&, const TrellisParams&, const TrellisMatrixPtrs&,
                                                  float*, cudaStream_t);
template void launch_trellis_dequant_lanes<__half>(const TrellisLaunch&, const TrellisParams&,
                                                   const TrellisMatrixPtrs&, __half*, cudaStream_t);
template void launch_trellis_dequant_lanes<__nv_bfloat16>(const TrellisLaunch&, const TrellisParams&,
                                                          const TrellisMatrixPtrs&, __nv_bfloat16*, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
