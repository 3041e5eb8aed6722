// The decode kernel's (decode.cu) building blocks: the scale-free dequant of scaled group sums,
// the activation fragments and mmas of a chunk, the coherent loads and the fixed-order epilogue
// that sums the warps' partial tiles and the K slices.
#pragma once

#include "cuda/common.cuh"

namespace torch_marlin {
namespace {

// Scale-free dequant for kScaleGroupSums (the per-group scale is applied to fp32 partial sums):
// FP4 in fp16 stays at 2^-14 x value (the 2^14 goes into the fp32 scale); bf16 is rescaled here
// (its 2^-126 form is subnormal, which the tensor cores must not see); U4 is q - z.
template <typename T, u32 FMT, int P>
__device__ __forceinline__ u32 dequant_pair_unscaled(u32 w, typename Tr<T>::T2 z2) {
  using T2 = typename Tr<T>::T2;
  if constexpr (FMT == TM_FORMAT_FP4) {
    const u32 bits = Tr<T>::template fp4_bits<P>(w);
    if constexpr (std::is_same<T, __half>::value) return bits;
    else return as_u32(__hmul2(as_t2<T2>(bits), Tr<T>::dup(t_from_bits<T>(Tr<T>::kFp4Rescale))));
  } else {
    const u32 x = (shift_left<-4 * P>(w) & 0x000F000Fu) | Tr<T>::kMagic;
    return as_u32(__hsub2(as_t2<T2>(x), z2));
  }
}

// 16-byte A chunk of a row (8 values along k) -> the two mma steps' (a0|a2) registers of that row.
// Step 0 uses physical pairs (0,4) and (1,5); step 1 uses (2,6) and (3,7).
struct APairs {
  u32 p[4];
};
__device__ __forceinline__ APairs a_pairs(uint4 r) {
  APairs o;
  o.p[0] = prmt(r.x, r.z, 0x5410);
  o.p[1] = prmt(r.x, r.z, 0x7632);
  o.p[2] = prmt(r.y, r.w, 0x5410);
  o.p[3] = prmt(r.y, r.w, 0x7632);
  return o;
}

// K-parallel epilogue of the decode kernel: ws[slice] holds every block's partial tile as rows of C
// ([k_parallel][M][N]); the last block sums them (+ bias) into C.
template <typename T>
__device__ void last_block_reduce(const QuantGemmParams& p, u32 tile, u32 m0, u32 rows, u32 n0, u32 cols,
                                  const float* ws, const T* bias, T* C, int* counters) {
  if (!last_arrival(p.k_parallel, counters, tile, threadIdx.x, blockDim.x, 0u)) return;
  const size_t plane = size_t(p.M) * p.N;
  for (u32 v = threadIdx.x; v < rows * cols; v += blockDim.x) {
    const u32 row = m0 + v / cols, n = n0 + v % cols;
    if (row >= p.M || n >= p.N) continue;
    const float* src = ws + size_t(row) * p.N + n;
    float sum = 0.f;
    for (u32 s = 0; s < p.k_parallel; ++s) sum += __ldcg(src + s * plane);  // L2: skip stale L1 lines
    if (p.has_bias) sum += Tr<T>::to_f(bias[n]);
    C[size_t(row) * p.N + n] = Tr<T>::from_f(sum);
  }
}

// Output element of a decode tile that thread t (0..255) of the block's fixed-order warp
// reduction holds for n8 tile nt: e = t / 32 picks the accumulator register, l = t % 32 the lane
// (acc[nt][jp][c]: column col + 2 jp + (c >> 1), activation row 8 nt + 2 (lane & 3) + (c & 1)).
__device__ __forceinline__ void dec_out_coord(u32 nt, u32 t, u32 m0, u32 n0, u32& row, u32& n) {
  const u32 e = t >> 5, l = t & 31u;
  row = m0 + 8u * nt + 2u * (l & 3u) + (e & 1u);
  n = n0 + 4u * (l >> 2) + 2u * (e >> 2) + ((e >> 1) & 1u);
}

// K-parallel epilogue on sm_90: the k_parallel slices of one output tile run as one thread-block
// cluster (cluster dims (1, 1, k_parallel), so cluster rank = slice). Every block has left its
// partial tile in its own shared memory (part[v], v = the element index of the warp reduction);
// after a cluster barrier block r sums a 1/k_parallel share of the tile over all blocks' shared
// memory (distributed shared memory) in slice order (+ bias) and writes C. The same sums in the
// same order as last_block_reduce (bitwise equal results), without its global-memory round trip,
// fences and counter atomics; a second barrier keeps every block resident until the others have
// read its shared memory.
template <typename T, int NT>
__device__ void cluster_reduce(const QuantGemmParams& p, u32 m0, u32 n0, float* part, const T* bias, T* C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const u32 kp = p.k_parallel, rank = cluster.block_rank();
  constexpr u32 kElems = u32(NT) * 256u;
  const u32 share = (kElems + kp - 1u) / kp;
  const u32 v_end = min(kElems, (rank + 1u) * share);
  for (u32 v = rank * share + threadIdx.x; v < v_end; v += blockDim.x) {
    u32 row, n;
    dec_out_coord(v >> 8, v & 255u, m0, n0, row, n);
    if (row >= p.M || n >= p.N) continue;
    float sum = 0.f;
    for (u32 sl = 0; sl < kp; ++sl) sum += cluster.map_shared_rank(part, sl)[v];
    if (p.has_bias) sum += Tr<T>::to_f(bias[n]);
    C[size_t(row) * p.N + n] = Tr<T>::from_f(sum);
  }
  cluster.sync();
#else
  __trap();  // planned only where the kernels come from sm_90+ PTX (CudaBackend::caps)
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint4 ld_dec(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
  return r;
}
__device__ __forceinline__ uint2 ld_dec(const uint2* p) {
  uint2 r;
  asm volatile("ld.global.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p) : "memory");
  return r;
}
__device__ __forceinline__ u32 ld_dec(const u32* p) {
  u32 r;
  asm volatile("ld.global.u32 %0, [%1];\n" : "=r"(r) : "l"(p) : "memory");
  return r;
}
#else
template <typename V>
__device__ __forceinline__ V ld_dec(const V* p) {
  return __ldg(p);
}
#endif

// The fp32 scales of the lane's 4 columns for one group (s: their 4 scales of T; z: their 4 U4
// zero points) as scaled group sums apply them: FP4 in fp16 is dequantized at 2^-14 x value, so
// the 2^14 goes into the fp32 scale; U4 gets the (magic + zero) pairs of dequant_pair_unscaled.
template <typename T, u32 FMT>
__device__ __forceinline__ void group_scales(uint2 s, u32 z, float (&s4f)[4], typename Tr<T>::T2 (&zf)[4]) {
  const T* sp = reinterpret_cast<const T*>(&s);
  constexpr float f = (FMT == TM_FORMAT_FP4 && std::is_same<T, __half>::value) ? 16384.f : 1.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) s4f[j] = Tr<T>::to_f(sp[j]) * f;
  if constexpr (FMT == TM_FORMAT_U4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) zf[j] = Tr<T>::dup(magic_zero<T>(z >> (8 * j)));
  }
}

// The lane's 4 words of a 32-row chunk without their scales: b[j][P] = nibble pair (P, P+4) of
// column j.
template <typename T, u32 FMT>
__device__ __forceinline__ void dequant_chunk_unscaled(u32 (&b)[4][4], const uint4& words,
                                                       const typename Tr<T>::T2 (&zf)[4]) {
  const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    b[j][0] = dequant_pair_unscaled<T, FMT, 0>(w[j], zf[j]);
    b[j][1] = dequant_pair_unscaled<T, FMT, 1>(w[j], zf[j]);
    b[j][2] = dequant_pair_unscaled<T, FMT, 2>(w[j], zf[j]);
    b[j][3] = dequant_pair_unscaled<T, FMT, 3>(w[j], zf[j]);
  }
}

// The chunk's 4 mmas per n8 tile: the dequantized words b as A, the activation chunks av as B.
// d[nt][jp][c]: A rows g / g+8 (c >> 1) = columns col + 2jp + (c >> 1), activation row
// 8nt + 2t + (c & 1).
template <typename T, int NT>
__device__ __forceinline__ void chunk_mma(const u32 (&b)[4][4], const uint4 (&av)[NT], float (&d)[NT][2][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const APairs x = a_pairs(av[nt]);
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const u32 a[4] = {b[2 * jp][2 * s], b[2 * jp + 1][2 * s], b[2 * jp][2 * s + 1], b[2 * jp + 1][2 * s + 1]};
        Tr<T>::mma(d[nt][jp], a, x.p[2 * s], x.p[2 * s + 1]);
      }
  }
}

// acc += accg x the group's scales (per column), accg = 0: the end of a group's scaled sums.
template <int NT>
__device__ __forceinline__ void flush_group_sums(float (&acc)[NT][2][4], float (&accg)[NT][2][4],
                                                 const float (&s4f)[4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[nt][jp][c] = fmaf(accg[nt][jp][c], s4f[2 * jp + (c >> 1)], acc[nt][jp][c]);
        accg[nt][jp][c] = 0.f;
      }
}

// Shared memory of a decode block: the cross-warp reduction, one n8 tile at a time; kCluster: plus
// the block's partial tile (NT x 256 floats) for cluster_reduce.
template <int NT, bool kCluster, int WARPS>
constexpr int dec_smem_bytes() {
  return WARPS * 8 * 32 * 4 + (kCluster ? NT * 256 * 4 : 0);
}

// Fixed-order reduction of the WARPS warps' partial tiles (acc as the decode kernels hold it), one
// n8 tile at a time, then the K slices' sum: through the cluster (kCluster) or by the tile's last
// block (k_parallel > 1), else straight to C (+ bias).
template <typename T, int NT, int WARPS, bool kCluster>
__device__ __forceinline__ void decode_epilogue(const QuantGemmParams& p, const float (&acc)[NT][2][4],
                                                unsigned char* smem, u32 slice, u32 m0, u32 n0, const T* bias, T* C,
                                                float* ws, int* counters) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* red = reinterpret_cast<float*>(smem);  // [warp][8][32]
  float* part = red + WARPS * 8 * 32;            // kCluster: [NT][256]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    __syncthreads();  // the previous tile's sums have been read
#pragma unroll
    for (int e = 0; e < 8; ++e) red[(warp * 8 + e) * 32 + lane] = acc[nt][e >> 2][e & 3];
    __syncthreads();
    // The tile's 256 sums (8 accumulators x 32 lanes), 256 / (32 WARPS) a thread.
#pragma unroll
    for (int v = threadIdx.x; v < 256; v += WARPS * 32) {
      const int e = v >> 5, l = v & 31;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += red[(w * 8 + e) * 32 + l];
      if constexpr (kCluster) {
        part[nt * 256 + v] = sum;
        continue;
      }
      u32 row, n;
      dec_out_coord(u32(nt), u32(v), m0, n0, row, n);
      if (row < p.M && n < p.N) {
        if (p.k_parallel > 1) {
          ws[(size_t(slice) * p.M + row) * p.N + n] = sum;
        } else {
          if (p.has_bias) sum += Tr<T>::to_f(bias[n]);
          C[size_t(row) * p.N + n] = Tr<T>::from_f(sum);
        }
      }
    }
  }
  if constexpr (kCluster) {
    cluster_reduce<T, NT>(p, m0, n0, part, bias, C);
  } else if (p.k_parallel > 1) {
    last_block_reduce<T>(p, blockIdx.y * gridDim.x + blockIdx.x, m0, 8 * NT, n0, 32, ws, bias, C, counters);
  }
}

}  // namespace
}  // namespace torch_marlin
