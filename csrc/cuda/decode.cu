// The decode kernel: small M (up to 128 rows, 64-row tiles above 64; benchmarks/notes/cuda-tuning.md
// CUDA-DECODE-MAX-M). mma.sync m16n8k16 with the dequantized weights as the A operand and the
// activations (M padded to 8, 16, 32 or 64) as the n dimension. Packed weights stream from global
// memory into a register ring with 16-byte loads, each word read once per row tile. 2..8 warps per
// block split the block's K slice and reduce in shared memory in a fixed order; grid.z K slices
// are summed in slice order (deterministic, no second launch): on sm_90 with up to 4 slices by a
// thread-block cluster through distributed shared memory (benchmarks/notes/cuda-tuning.md
// CUDA-DECODE-CLUSTER), otherwise the slices write fp32 partials and the last block of each tile
// to arrive sums them. On sm_90 launched with programmatic dependent launch: it starts behind the
// previous kernel, prefetches its first weights into L2 and waits for that kernel before its first
// load.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

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

// ---------------------------------------------------------------------------------------------
// Decode kernel: M <= 128 (64-row tiles above 64)
// ---------------------------------------------------------------------------------------------
// Streams the packed weights once; the loop spends as few instructions per 16-byte chunk as it can
// (scripts/dev/sass_loop_stats.py: about 95 for FP4/fp16 with M <= 8 and scaled group sums). On an
// H200 it is neither issue- nor stream-bound: without its unpack and mma it streams at about the copy
// rate, and each part of its work adds its latency to every warp's chunk rather than hiding under the
// loads (benchmarks/notes/cuda-tuning.md CUDA-DECODE-ABLATION).
//  - Weights are the mma's A operand and activations its B operand (C^T = W^T A^T): a lane's 4
//    words (4 columns x 8 k) fill 4 m16n8k16 mmas per 8 activation rows, and M <= 8 wastes no
//    mma rows on zero padding (M is padded to 8, 16, 32 or 64: NT = 1, 2, 4 or 8 n8 tiles).
//    Lane (g, t) gives A rows g and g+8 = columns j0, j1 of its 4; its B fragment is row 8nt+g of
//    the activations at the same permuted k as the weights (the K-permutation trick, common.cuh).
//  - Each lane streams its own chunks straight into a register ring kDecDepth deep (16-byte loads
//    that skip L1; every word is read once): no shared-memory staging, no barrier in the loop.
//  - Rows of A past M are clamped to row M-1 instead of predicated (their outputs are never
//    stored); only a partial last chunk of K (K % 32 != 0) takes a predicated path.
//  - WARPS (2, 4 or 8: the plan's threads / 32) warps a block split its K slice; the planner
//    takes fewer, longer-streaming warps a block when the tiles outnumber the 8-warp slots.
static_assert(TM_CUDA_DECODE_TILE_N == 32u, "a warp's 8 lane groups x 4 columns");
// Resident warps per SM: 16 (128 registers a thread), 8 for 8 n8 tiles (up to 255, no spills);
// TM_CUDA_DECODE_WARPS_PER_SM, shared with the planner. The ring is 4 chunks deep. Measured on an
// H200 (benchmarks/notes/cuda-tuning.md CUDA-DECODE-RING): deeper rings, 3 blocks per SM, 12-warp
// blocks, a cp.async shared-memory ring, L2 or L1 prefetches (CUDA-DECODE-L1-PREFETCH) and (for
// 4 / 8 n8 tiles) 128-column blocks sharing A chunks were all as fast or slower; 1 block per SM is
// faster for 8 tiles (128 registers spilled) and slower for 4. Every load of the loop shares one
// dependency barrier, so a use of any loaded register also waits for the refills issued before it;
// per-warp cp.async rings and two register sets taking turns avoid that and still ran slower, as
// did a per-warp TMA ring (benchmarks/notes/cuda-tuning.md CUDA-DECODE-CPASYNC-RING,
// CUDA-DECODE-SETS, CUDA-DECODE-TMA-WARP).
constexpr int kDecDepth = 4;

// The decode kernel's global loads. On sm_90 it may run beside the previous kernel on the stream
// (PDL), which may write A, the weights or the scales until pdl_wait() returns, so it reads them
// with coherent loads (benchmarks/notes/cuda-tuning.md CUDA-PDL): ld.global.nc requires data read-only for
// the kernel's whole lifetime, and the compiler may hoist such (invariant) loads above the wait.
// Below sm_90, no PDL: .nc loads.
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p)
               : "memory");
#else
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
#endif
  return r;
}

// NT: n8 tiles of activation rows (M <= 8 NT). kScaleGroupSums (NT <= 2, group_size % 32 == 0, so a chunk
// never straddles two groups): the mmas of one group accumulate unscaled weights and the group's
// fp32 scales multiply those partial sums once per group (8 FMAs per n8 tile and group instead of
// 16 multiplies per chunk); otherwise every weight pair is scaled.
// kCluster (ReduceKind::Cluster: sm_90, k_parallel <= TM_CUDA_DECODE_MAX_CLUSTER_SLICES): the K
// slices of a tile form a cluster and reduce through distributed shared memory (cluster_reduce);
// otherwise through global memory (last_block_reduce, ReduceKind::LastBlock).
template <typename T, u32 FMT, int NT, bool kScaleGroupSums, int WARPS, bool kCluster>
__global__ void __launch_bounds__(WARPS * 32, TM_CUDA_DECODE_WARPS_PER_SM(8u * NT) / WARPS)
    decode_kernel(QuantGemmParams p, u32 Np, int gs_shift, const T* A, const u32* B, const T* scales, const uint8_t* zeros,
                  const T* offsets, const T* bias, T* __restrict__ C, float* __restrict__ ws, int* __restrict__ counters) {
  using T2 = typename Tr<T>::T2;
  // A one chunk ahead, except for 4 n8 tiles: at 2 blocks per SM they leave no registers for it.
  constexpr bool kAhead = NT != 4;
  static_assert(!kScaleGroupSums || NT <= 2, "scaled group sums need a second accumulator set");
  static_assert(!kScaleGroupSums || FMT != TM_FORMAT_AFFINE, "affine scales every weight (plan_cuda.cpp plan_decode)");
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // blockIdx.x: row tile (fastest: the row tiles of a column tile run together and share its
  // weights through L2), y: 32-column tile, z: K slice.
  const u32 m0 = blockIdx.x * (8u * NT);
  const u32 n0 = blockIdx.y * 32u;
  // Columns past Np (the last tile when Np % 32 == 16) read column 0: their outputs are dropped.
  const u32 col = n0 + 4u * g < Np ? n0 + 4u * g : 0u;
  const u32 slice = blockIdx.z;
  const u32 k_begin = slice * p.k_slice_len;
  const u32 k_end = min(p.K, k_begin + p.k_slice_len);
  const u32 c_begin = k_begin / 32u, c_end = (k_end + 31u) / 32u;
  // Each warp owns a contiguous run of 32-row chunks of the slice.
  const u32 per_warp = (c_end - c_begin + WARPS - 1) / WARPS;
  const u32 wc0 = c_begin + warp * per_warp;
  const int n_w = wc0 < c_end ? int(min(per_warp, c_end - wc0)) : 0;
  // Chunks wholly inside K; at most the warp's last chunk is partial.
  const int n_full = min(n_w, max(0, int(p.K / 32u) - int(wc0)));
  const u32 gs = p.group_size;
  const u32 num_groups = p.K / gs;

  // The lane's packed row in its first chunk is 4 * wc0 + t; the next chunk is Np uint4 further.
  const uint4* bp = reinterpret_cast<const uint4*>(B + size_t(4u * wc0 + t) * Np + col);
  const uint4* ap[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    ap[nt] = reinterpret_cast<const uint4*>(A + size_t(min(m0 + u32(8 * nt + g), p.M - 1u)) * p.K + size_t(wc0) * 32u + 8u * t);

  // Launched early behind the previous kernel (PDL), the block brings the ring's first chunks into
  // L2 while that kernel finishes, then waits for it before it reads anything (the previous kernel
  // may write A, the weights or C). A prefetch only warms L2, the point of coherence, so a
  // weight written by that kernel is still read fresh after the wait.
#pragma unroll
  for (int d = 0; d < kDecDepth; ++d)
    if (d < n_full) prefetch_l2(bp + size_t(d) * Np);
  pdl_wait();

  // acc[nt][jp][c]: A rows g / g+8 (c >> 1) = columns col + 2jp + (c >> 1), activation row
  // 8nt + 2t + (c & 1).
  float acc[NT][2][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][jp][c] = 0.f;

  // kScaleGroupSums state: this group's partial sums, the fp32 scales of the lane's 4 columns for this group,
  // the next group's raw scales and zero points (prefetched), and per column (magic + zero) (U4).
  float accg[NT][2][4];
  float s4f[4];
  uint2 s_next = make_uint2(0, 0);
  u32 z_next = 0;
  T2 zf[4];
  const u32 cpg = gs / 32u;  // chunks per group (kScaleGroupSums)
  u32 grp = kScaleGroupSums ? wc0 / cpg : 0u;
  u32 left = kScaleGroupSums ? cpg - wc0 % cpg : 0u;  // chunks left in the current group
  auto fetch_scales = [&](u32 gi) {
    const size_t so = size_t(min(gi, num_groups - 1u)) * Np + col;
    s_next = ld_dec(reinterpret_cast<const uint2*>(scales + so));
    if constexpr (FMT == TM_FORMAT_U4) z_next = ld_dec(reinterpret_cast<const u32*>(zeros + so));
  };
  auto take_scales = [&]() { group_scales<T, FMT>(s_next, z_next, s4f, zf); };
  auto flush = [&]() { flush_group_sums<NT>(acc, accg, s4f); };
  if constexpr (kScaleGroupSums) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int c = 0; c < 4; ++c) accg[nt][jp][c] = 0.f;
    fetch_scales(grp);
    take_scales();
    fetch_scales(grp + 1u);
  }

  // One 32-row chunk: dequantize the lane's 4 words (b[j][P] = nibble pair (P, P+4) of column j)
  // and run 4 mmas per n8 tile.
  auto load_a = [&](int i, uint4 (&av)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) av[nt] = ld_dec(ap[nt] + 4 * i);
  };
  auto process = [&](const uint4& words, int i, const uint4 (&av)[NT]) {
    u32 b[4][4];
    if constexpr (kScaleGroupSums) {
      dequant_chunk_unscaled<T, FMT>(b, words, zf);
    } else {
      // The group of the lane's 8 rows (group_size % 8 == 0: one group).
      const u32 k = (wc0 + u32(i)) * 32u + 8u * t;
      const u32 gi = min(gs_shift >= 0 ? k >> gs_shift : k / gs, num_groups - 1u);
      const size_t so = size_t(gi) * Np + col;
      const uint2 sc = ld_dec(reinterpret_cast<const uint2*>(scales + so));
      const u32 zz = FMT == TM_FORMAT_U4 ? ld_dec(reinterpret_cast<const u32*>(zeros + so)) : 0u;
      const uint2 oo = FMT == TM_FORMAT_AFFINE ? ld_dec(reinterpret_cast<const uint2*>(offsets + so)) : make_uint2(0u, 0u);
      ColQ<T> q[4];
      make_colq<T, FMT>(q, sc, zz, oo);
      dequant_words<T, FMT>(b, words, q);
    }
    chunk_mma<T, NT>(b, av, kScaleGroupSums ? accg : acc);
    if constexpr (kScaleGroupSums) {
      if (--left == 0u) {  // warp-uniform: the next chunk starts a new group
        flush();
        take_scales();
        ++grp;
        fetch_scales(grp + 1u);
        left = cpg;
      }
    }
  };

  // A one chunk ahead (kAhead), else at use.
  uint4 a_cur[NT];
  if (kAhead && n_full > 0) load_a(0, a_cur);
  auto step = [&](const uint4& words, int i) {
    if constexpr (kAhead) {
      uint4 a_next[NT];
      load_a(min(i + 1, n_full - 1), a_next);
      process(words, i, a_cur);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) a_cur[nt] = a_next[nt];
    } else {
      uint4 av[NT];
      load_a(i, av);
      process(words, i, av);
    }
  };
  uint4 ring[kDecDepth];
#pragma unroll
  for (int d = 0; d < kDecDepth; ++d) ring[d] = d < n_full ? ldg_stream(bp + size_t(d) * Np) : make_uint4(0, 0, 0, 0);
  const uint4* bnext = bp + size_t(kDecDepth) * Np;
  // Steady state: every refill is in range, so no predicate (a predicated refill makes the
  // compiler copy the ring). Unrolled by the ring depth so every ring index is a constant.
  int i0 = 0;
  for (; i0 + 2 * kDecDepth <= n_full; i0 += kDecDepth) {
#pragma unroll
    for (int u = 0; u < kDecDepth; ++u) {
      const uint4 words = ring[u];
      ring[u] = ldg_stream(bnext);
      bnext += Np;
      step(words, i0 + u);
    }
  }
  // Drain: the last (under 2 kDecDepth) chunks.
  for (; i0 < n_full; i0 += kDecDepth) {
#pragma unroll
    for (int u = 0; u < kDecDepth; ++u) {
      const int i = i0 + u;
      if (i >= n_full) break;
      const uint4 words = ring[u];
      if (i + kDecDepth < n_full) ring[u] = ldg_stream(bnext);
      bnext += Np;
      step(words, i);
    }
  }
  if (n_full < n_w) {  // the partial last chunk of K: rows past K read as zero
    const bool ok = 4u * (wc0 + u32(n_full)) + t < p.K / 8u;
    const uint4 words = ok ? ldg_stream(bp + size_t(n_full) * Np) : make_uint4(0, 0, 0, 0);
    uint4 av[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) av[nt] = ok ? ld_dec(ap[nt] + 4 * n_full) : make_uint4(0, 0, 0, 0);
    process(words, n_full, av);
  }
  if constexpr (kScaleGroupSums) {
    if (left != cpg) flush();
  }

  // The next kernel may launch once every block is past its wait (common.cuh, PDL protocol); here,
  // past the loop, it measured faster in a model's step than right after the wait
  // (benchmarks/notes/cuda-tuning.md CUDA-PDL-TRIGGER). With the last-block K-slice reduction the
  // epilogue still uses this call's workspace, which the allocator may already have handed to the
  // next kernel: then at exit.
  if (kCluster || p.k_parallel == 1) pdl_launch_dependents();
  decode_epilogue<T, NT, WARPS, kCluster>(p, acc, smem, slice, m0, n0, bias, C, ws, counters);
}

}  // namespace

namespace cuda_backend {
namespace {

template <typename T, u32 FMT, int NT, bool kScaleGroupSums, int WARPS>
void launch_decode_warps(const GemmPlan& plan, int gs_shift, const GemmOperands<T>& o) {
  with_cluster(plan, [&](auto cluster) {
    constexpr bool kCluster = decltype(cluster)::value;
    launch_tile_kernel<kCluster>(plan, decode_kernel<T, FMT, NT, kScaleGroupSums, WARPS, kCluster>, WARPS * 32,
                                 dec_smem_bytes<NT, kCluster, WARPS>(), o.stream, plan.params, o.Np, gs_shift, o.A,
                                 o.B, o.scales, o.zeros, o.offsets, o.bias, o.C, o.ws, o.counters);
  });
}

// WARPS = the main launch's threads / 32: 2, 4 or 8 up to 2 n8 tiles, 8 above (cuda_decode_block_warps).
template <typename T, u32 FMT, int NT, bool kScaleGroupSums>
void launch_decode_as(const GemmPlan& plan, int gs_shift, const GemmOperands<T>& o) {
  if constexpr (NT > 2) {
    return launch_decode_warps<T, FMT, NT, kScaleGroupSums, 8>(plan, gs_shift, o);
  } else {
    switch (plan.launches.at(LaunchRole::Main).threads[0]) {
      case 64: return launch_decode_warps<T, FMT, NT, kScaleGroupSums, 2>(plan, gs_shift, o);
      case 128: return launch_decode_warps<T, FMT, NT, kScaleGroupSums, 4>(plan, gs_shift, o);
      default: return launch_decode_warps<T, FMT, NT, kScaleGroupSums, 8>(plan, gs_shift, o);
    }
  }
}

}  // namespace

// NT = desc.tile_m / 8 n8 tiles, kScaleGroupSums = desc.scale_group_sums, kCluster = (desc.reduce == ReduceKind::Cluster).
template <typename T, uint32_t FMT>
void launch_decode(const GemmPlan& plan, const GemmOperands<T>& o) {
  const KernelDesc& d = plan.desc;
  const QuantGemmParams& q = plan.params;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TORCH_CHECK((d.tile_m == 8u || d.tile_m == 16u || d.tile_m == 32u || d.tile_m == 64u) && d.tile_m == q.tile_m &&
                  d.tile_n == q.tile_n && q.tile_n == TM_CUDA_DECODE_TILE_N &&
                  uint64_t(q.M) <= uint64_t(q.tile_m) * q.m_tiles && main.grid[0] == q.m_tiles &&
                  main.grid[1] == q.n_tiles && main.grid[2] == q.k_parallel &&
                  (main.threads[0] == 256u || (d.tile_m <= 16u && (main.threads[0] == 64u || main.threads[0] == 128u))) &&
                  (!d.scale_group_sums || (d.tile_m <= 16u && q.group_size % 32u == 0 && FMT != TM_FORMAT_AFFINE)),
              "torch_marlin: bad decode plan");
  const int gs_shift = (q.group_size & (q.group_size - 1u)) == 0 ? __builtin_ctzll(uint64_t(q.group_size)) : -1;
  switch (d.tile_m) {
    case 64: return launch_decode_as<T, FMT, 8, false>(plan, gs_shift, o);
    case 32: return launch_decode_as<T, FMT, 4, false>(plan, gs_shift, o);
    case 16:
      if constexpr (FMT != TM_FORMAT_AFFINE) {
        if (d.scale_group_sums) return launch_decode_as<T, FMT, 2, true>(plan, gs_shift, o);
      }
      return launch_decode_as<T, FMT, 2, false>(plan, gs_shift, o);
    default:
      if constexpr (FMT != TM_FORMAT_AFFINE) {
        if (d.scale_group_sums) return launch_decode_as<T, FMT, 1, true>(plan, gs_shift, o);
      }
      return launch_decode_as<T, FMT, 1, false>(plan, gs_shift, o);
  }
}

TM_CUDA_INSTANTIATE_ENTRY(launch_decode)

cudaFuncAttributes decode_kernel_attributes() {
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, decode_kernel<__half, TM_FORMAT_FP4, 1, true, 8, true>));
  return attr;
}

}  // namespace cuda_backend
}  // namespace torch_marlin
