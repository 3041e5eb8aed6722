// CUDA kernels of the FP4 E2M1 / INT4 op family (docs/cuda.md explains the design).
//
// Every launch executes a GemmPlan from plan_cuda (csrc/plan/plan.cpp); the kernel tag says which
// kernel, the params struct carries the geometry. Kernels:
//   decode_*   M <= 32 (M <= 128 where wgmma_ws does not apply). mma.sync m16n8k16 with the
//              dequantized weights as the A operand and the activations (M padded to 8, 16, 32 or
//              64; 64-row tiles along grid.x above) as the n dimension. Packed weights stream
//              from global memory into a register ring with 16-byte loads, each word read once
//              per row tile. 8 warps per block split the block's K slice and reduce in shared
//              memory in a fixed order; grid.z K slices are summed in slice order (deterministic,
//              no second launch): on sm_90 with 2 slices by a thread-block cluster through
//              distributed shared memory, otherwise the slices write fp32 partials and the last
//              block of each tile to arrive sums them. On sm_90 launched with programmatic
//              dependent launch: it starts behind the previous kernel, prefetches its first
//              weights into L2 and waits for that kernel before its first load.
//   wgmma_ws_* sm_90a, M > 32, group_size % 64 == 0 (plan.cpp cuda_wgmma_ws_pays).
//              Warp-specialized: a TMA producer warpgroup feeds 2 or 3 consumer warpgroups that
//              dequantize straight into wgmma's register A operand (weights = the m64 rows,
//              activations = n); up to 4 K slices: 2 (3 for 256-row tiles) summed through a
//              thread-block cluster, 3..4 by each tile's last block through global memory.
//              Launched with programmatic dependent launch, like decode on sm_90.
//   wgmma_*    sm_90a, group_size % 64 != 0, 64 < M <= 512 with >= 64 output tiles or long K
//              (plan.cpp cuda_wgmma_pays). Two warpgroups over a 128 x 256, 128 x 128 or
//              256 x 128 (rows x columns) tile: each stage's weight tile is dequantized once into
//              shared memory (natural k order) and both operands feed wgmma.m64n{128,256}k16 from
//              there; activations by TMA, weights/scales by cp.async; up to 4 K slices summed
//              through a thread-block cluster.
//   dequant_blas  M > 128 where neither wgmma kernel applies. Each column panel of B (all of N
//              up to 1 GiB) is dequantized into a workspace (the dequant kernel below) and
//              multiplied by cuBLAS (at::mm_out) into C's columns: from 129 rows on that beats
//              our decode kernel and the fused tensor-core kernel we had (docs/cuda.md).
//   simt       fp32 activations: a plain CUDA-core kernel (correct, not fast).
//   dequant    [K, N] (or a column panel of it) in the scales' dtype.
//
// The mma K-permutation trick. A lane (g = lane/4, t = lane%4) of m16n8k16 holds B at logical
// k = {2t, 2t+1, 2t+8, 2t+9} of column g (and A at the same k of rows g and g+8). The order of k
// inside an mma does not matter as long as both operands use the same order, so over a 32-row K
// chunk lane t takes the physical rows 8t..8t+7: exactly one packed word per column. Two k16 steps
// consume it: the first gets the nibble pairs (0,4), (1,5), the second (2,6), (3,7) ((p, p+4)
// pairs sit 16 bits apart, so one shift aligns both halves of a half2). The lane's activation
// fragment is then one 16-byte load of A[row][k0+8t .. k0+8t+7], regrouped with byte permutes.
// The decode kernel makes the weights the mma's A operand: its rows g and g+8 are two of the
// lane's 4 columns, so one 16-byte load of 4 columns feeds 4 mmas per 8 activation rows.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "ops/quant_gemm.h"
#include "torch_marlin/quant_gemm_params.h"

namespace torch_marlin {
namespace {

using u32 = uint32_t;

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

template <int S>
__device__ __forceinline__ u32 shift_left(u32 x) {
  if constexpr (S >= 0) return x << S;
  else return x >> (-S);
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) { return __byte_perm(a, b, sel); }

// Per-dtype pieces: the mma instruction, pair construction and the dequant bit tricks.
template <typename T>
struct Tr;

template <>
struct Tr<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ T2 dup(__half x) { return __half2half2(x); }
  // FP4 nibbles p and p+4 of w -> the E2M1 bit pattern scaled by 2^-14 (sign -> bit 15, e e m ->
  // exponent bits 1..0 and the top mantissa bit; E = 0 lands on fp16 subnormals, which is exactly
  // the E2M1 subnormal 0.5). Multiplying by 2^14 is exact.
  template <int P>
  static __device__ __forceinline__ u32 fp4_bits(u32 w) {
    return (shift_left<12 - 4 * P>(w) & 0x80008000u) | (shift_left<9 - 4 * P>(w) & 0x0E000E00u);
  }
  static constexpr unsigned short kFp4Rescale = 0x7400;  // 2^14
  static constexpr u32 kMagic = 0x64006400u;             // 1024.0: OR a nibble into the mantissa
  static constexpr float kMagicF = 1024.0f;
};

template <>
struct Tr<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ T2 dup(__nv_bfloat16 x) { return __bfloat162bfloat162(x); }
  // bf16: e e m -> bits 8..6 (exponent bits 1..0, top mantissa bit): value * 2^-126.
  template <int P>
  static __device__ __forceinline__ u32 fp4_bits(u32 w) {
    return (shift_left<12 - 4 * P>(w) & 0x80008000u) | (shift_left<6 - 4 * P>(w) & 0x01C001C0u);
  }
  static constexpr unsigned short kFp4Rescale = 0x7E80;  // 2^126
  static constexpr u32 kMagic = 0x43004300u;             // 128.0 (7 mantissa bits hold 0..15)
  static constexpr float kMagicF = 128.0f;
};

template <typename T2>
__device__ __forceinline__ u32 as_u32(T2 v) {
  return *reinterpret_cast<u32*>(&v);
}
template <typename T2>
__device__ __forceinline__ T2 as_t2(u32 v) {
  return *reinterpret_cast<T2*>(&v);
}

template <typename T>
__device__ __forceinline__ T t_from_bits(unsigned short b) {
  return *reinterpret_cast<T*>(&b);
}

// magic + zero point (the value a U4 dequant subtracts from magic | nibble) from the low byte of z.
// Zero points are 0..15 (docs/formats.md); the kernels use the byte's low 4 bits, as the CPU and
// Metal kernels do, so an out-of-range byte gives the same value on every backend.
template <typename T>
__device__ __forceinline__ T magic_zero(u32 z) {
  return Tr<T>::from_f(Tr<T>::kMagicF + float(z & 0xFu));
}

// Per-column dequant constants for one group: the scale pair and, for U4, (magic + zero) pair.
template <typename T>
struct ColQ {
  typename Tr<T>::T2 s2, z2;
};

// Dequantizes the nibble pair (P, P+4) of word w into a 2 x T register (lo = nibble P).
template <typename T, u32 FMT, int P>
__device__ __forceinline__ u32 dequant_pair(u32 w, const ColQ<T>& q) {
  using T2 = typename Tr<T>::T2;
  if constexpr (FMT == TM_FORMAT_FP4) {
    const T2 r = Tr<T>::dup(t_from_bits<T>(Tr<T>::kFp4Rescale));
    const T2 v = as_t2<T2>(Tr<T>::template fp4_bits<P>(w));
    return as_u32(__hmul2(__hmul2(v, r), q.s2));
  } else {
    const u32 x = (shift_left<-4 * P>(w) & 0x000F000Fu) | Tr<T>::kMagic;
    return as_u32(__hmul2(__hsub2(as_t2<T2>(x), q.z2), q.s2));
  }
}

// Scale-free dequant for the folded path (the per-group scale is applied to fp32 partial sums):
// FP4 in fp16 stays at 2^-14 x value (the 2^14 goes into the fp32 scale); bf16 is rescaled here
// (its 2^-126 form is subnormal, which the tensor cores must not see); U4 is q - z.
template <typename T, u32 FMT, int P>
__device__ __forceinline__ u32 dequant_pair_fold(u32 w, typename Tr<T>::T2 z2) {
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

// Four columns' constants from 4 scales (8 bytes) and 4 zero points (4 bytes).
template <typename T, u32 FMT>
__device__ __forceinline__ void make_colq(ColQ<T> (&q)[4], uint2 s4, u32 z4) {
  const T* s = reinterpret_cast<const T*>(&s4);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    q[j].s2 = Tr<T>::dup(s[j]);
    if constexpr (FMT == TM_FORMAT_U4) {
      q[j].z2 = Tr<T>::dup(magic_zero<T>(z4 >> (8 * j)));
    }
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

// Four packed words (4 columns x 8 rows of k) -> b[j][P] = the scaled nibble pair (P, P+4) of
// column j.
template <typename T, u32 FMT>
__device__ __forceinline__ void dequant_words(u32 (&b)[4][4], const uint4& words, const ColQ<T> (&q)[4]) {
  const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    b[j][0] = dequant_pair<T, FMT, 0>(w[j], q[j]);
    b[j][1] = dequant_pair<T, FMT, 1>(w[j], q[j]);
    b[j][2] = dequant_pair<T, FMT, 2>(w[j], q[j]);
    b[j][3] = dequant_pair<T, FMT, 3>(w[j], q[j]);
  }
}

// bar.sync over threads 0 .. nthreads - 1 of the block (a multiple of 32): wgmma_ws's consumer
// warpgroups synchronize without its producer.
__device__ __forceinline__ void named_barrier(u32 id, u32 nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// K-parallel arrival, after a block has written its fp32 partial tile to global memory: true for
// the last of the k_parallel blocks of output tile `tile` to arrive (a per-tile counter, which it
// re-arms), which then sums every slice's partials in slice order, so the result is bitwise
// reproducible whichever block comes last and no second launch is needed. Counters are per
// (device, stream) and start at zero (quant_gemm_cuda). Threads 0 .. nthreads - 1 take part,
// synchronized by named barrier bar_id.
__device__ bool last_arrival(u32 k_parallel, int* counters, u32 tile, u32 tid, u32 nthreads, u32 bar_id) {
  __shared__ int is_last;
  __threadfence();  // this block's partials are visible device-wide before it is counted
  named_barrier(bar_id, nthreads);
  if (tid == 0) {
    is_last = atomicAdd(counters + tile, 1) == int(k_parallel) - 1;
    if (is_last) counters[tile] = 0;  // every block of the tile has counted
  }
  named_barrier(bar_id, nthreads);
  if (!is_last) return false;
  __threadfence();
  return true;
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
  __trap();  // planned only where the kernels come from sm_90+ PTX (cuda_device_caps)
#endif
}

// ---------------------------------------------------------------------------------------------
// Decode kernel: M <= 128 (64-row tiles above 64)
// ---------------------------------------------------------------------------------------------
// Streams the packed weights once; the loop spends as few instructions per 16-byte chunk as it can
// (scripts/dev/sass_loop_stats.py: about 95 for FP4/fp16 with M <= 8 and folded scales, 228 before
// this design). On an H200 it is now latency-bound rather than issue-bound (docs/cuda.md).
//  - Weights are the mma's A operand and activations its B operand (C^T = W^T A^T): a lane's 4
//    words (4 columns x 8 k) fill 4 m16n8k16 mmas per 8 activation rows, and M <= 8 wastes no
//    mma rows on zero padding (M is padded to 8, 16, 32 or 64: NT = 1, 2, 4 or 8 n8 tiles).
//    Lane (g, t) gives A rows g and g+8 = columns j0, j1 of its 4; its B fragment is row 8nt+g of
//    the activations at the same permuted k as the weights (the K-permutation trick above).
//  - Each lane streams its own chunks straight into a register ring kDecDepth deep (16-byte loads
//    that skip L1; every word is read once): no shared-memory staging, no barrier in the loop.
//  - Rows of A past M are clamped to row M-1 instead of predicated (their outputs are never
//    stored); only a partial last chunk of K (K % 32 != 0) takes a predicated path.
constexpr int kDecWarps = int(TM_CUDA_DECODE_WARPS);
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kDecSmemBytes = kDecWarps * 8 * 32 * 4;  // cross-warp reduction, one n8 tile at a time
// kCluster: plus the block's partial tile (NT x 256 floats) for cluster_reduce.
template <int NT, bool kCluster>
constexpr int dec_smem_bytes() {
  return kDecSmemBytes + (kCluster ? NT * 256 * 4 : 0);
}
static_assert(TM_CUDA_DECODE_TILE_N == 32u, "a warp's 8 lane groups x 4 columns");
// Resident blocks per SM: 2 (128 registers a thread), 1 for 8 n8 tiles (up to 255, no spills);
// TM_CUDA_DECODE_BLOCKS_PER_SM, shared with the planner. The ring is 4 chunks deep. Measured on an
// H200 (docs/cuda.md): deeper rings, 3 blocks per SM, 12-warp blocks, a cp.async shared-memory
// ring, L2 prefetches and (for 4 / 8 n8 tiles) 128-column blocks sharing A chunks were all as
// fast or slower; 1 block per SM is faster for 8 tiles (128 registers spilled) and slower for 4.
constexpr int kDecDepth = 4;

// The decode kernel's global loads. On sm_90 it may run beside the previous kernel on the stream
// (PDL), which may write A, the weights or the scales until pdl_wait() returns, so it reads them
// with coherent loads: ld.global.nc requires data read-only for the kernel's whole lifetime, and
// the compiler may hoist such (invariant) loads above the wait. Below sm_90, no PDL: .nc loads.
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

// Programmatic dependent launch (PDL; GemmPlan::dependent_launch, set by plan_cuda for decode on
// the devices that run clusters and for wgmma_ws): a kernel launched with it may start while the previous kernel on the stream still runs, once every
// block of that kernel has called pdl_launch_dependents(); pdl_wait() then blocks until that kernel
// has finished and its writes are visible. Both are no-ops for a kernel launched without it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// NT: n8 tiles of activation rows (M <= 8 NT). kFold (NT <= 2, group_size % 32 == 0, so a chunk
// never straddles two groups): the mmas of one group accumulate unscaled weights and the group's
// fp32 scales multiply those partial sums once per group (8 FMAs per n8 tile and group instead of
// 16 multiplies per chunk); otherwise every weight pair is scaled.
// kCluster (plan.reduce_kernel "cluster_reduce": sm_90, k_parallel <=
// TM_CUDA_DECODE_MAX_CLUSTER_SLICES): the K slices of a tile form a cluster and reduce through
// distributed shared memory (cluster_reduce); otherwise through global memory (last_block_reduce).
template <typename T, u32 FMT, int NT, bool kFold, bool kCluster>
__global__ void __launch_bounds__(kDecThreads, TM_CUDA_DECODE_BLOCKS_PER_SM(8u * NT))
    decode_kernel(QuantGemmParams p, u32 Np, int gs_shift, const T* A, const u32* B, const T* S, const uint8_t* Z,
                  const T* bias, T* __restrict__ C, float* __restrict__ ws, int* __restrict__ counters) {
  using T2 = typename Tr<T>::T2;
  // A one chunk ahead, except for 4 n8 tiles: at 2 blocks per SM they leave no registers for it.
  constexpr bool kAhead = NT != 4;
  static_assert(!kFold || NT <= 2, "folded scales need a second accumulator set");
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
  // Each warp owns a contiguous run of 32-row chunks of the slice (8 runs, one per warp).
  const u32 per_warp = (c_end - c_begin + kDecWarps - 1) / kDecWarps;
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
  pdl_launch_dependents();
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

  // kFold state: this group's partial sums, the fp32 scales of the lane's 4 columns for this group,
  // the next group's raw scales and zero points (prefetched), and per column (magic + zero) (U4).
  float accg[NT][2][4];
  float s4f[4];
  uint2 s_next = make_uint2(0, 0);
  u32 z_next = 0;
  T2 zf[4];
  const u32 cpg = gs / 32u;  // chunks per group (kFold)
  u32 grp = kFold ? wc0 / cpg : 0u;
  u32 left = kFold ? cpg - wc0 % cpg : 0u;  // chunks left in the current group
  auto fetch_scales = [&](u32 gi) {
    const size_t so = size_t(min(gi, num_groups - 1u)) * Np + col;
    s_next = ld_dec(reinterpret_cast<const uint2*>(S + so));
    if constexpr (FMT == TM_FORMAT_U4) z_next = ld_dec(reinterpret_cast<const u32*>(Z + so));
  };
  auto take_scales = [&]() {
    const T* sp = reinterpret_cast<const T*>(&s_next);
    // FP4 in fp16 is dequantized at 2^-14 x value; the 2^14 goes into the fp32 scale.
    constexpr float f = (FMT == TM_FORMAT_FP4 && std::is_same<T, __half>::value) ? 16384.f : 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) s4f[j] = Tr<T>::to_f(sp[j]) * f;
    if constexpr (FMT == TM_FORMAT_U4) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        zf[j] = Tr<T>::dup(magic_zero<T>(z_next >> (8 * j)));
    }
  };
  auto flush = [&]() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[nt][jp][c] = fmaf(accg[nt][jp][c], s4f[2 * jp + (c >> 1)], acc[nt][jp][c]);
          accg[nt][jp][c] = 0.f;
        }
  };
  if constexpr (kFold) {
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
    if constexpr (kFold) {
      const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        b[j][0] = dequant_pair_fold<T, FMT, 0>(w[j], zf[j]);
        b[j][1] = dequant_pair_fold<T, FMT, 1>(w[j], zf[j]);
        b[j][2] = dequant_pair_fold<T, FMT, 2>(w[j], zf[j]);
        b[j][3] = dequant_pair_fold<T, FMT, 3>(w[j], zf[j]);
      }
    } else {
      // The group of the lane's 8 rows (group_size % 8 == 0: one group).
      const u32 k = (wc0 + u32(i)) * 32u + 8u * t;
      const u32 gi = min(gs_shift >= 0 ? k >> gs_shift : k / gs, num_groups - 1u);
      const size_t so = size_t(gi) * Np + col;
      const uint2 sc = ld_dec(reinterpret_cast<const uint2*>(S + so));
      const u32 zz = FMT == TM_FORMAT_U4 ? ld_dec(reinterpret_cast<const u32*>(Z + so)) : 0u;
      ColQ<T> q[4];
      make_colq<T, FMT>(q, sc, zz);
      dequant_words<T, FMT>(b, words, q);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const APairs x = a_pairs(av[nt]);
      float(&d)[2][4] = kFold ? accg[nt] : acc[nt];
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          const u32 a[4] = {b[2 * jp][2 * s], b[2 * jp + 1][2 * s], b[2 * jp][2 * s + 1], b[2 * jp + 1][2 * s + 1]};
          Tr<T>::mma(d[jp], a, x.p[2 * s], x.p[2 * s + 1]);
        }
    }
    if constexpr (kFold) {
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
  if constexpr (kFold) {
    if (left != cpg) flush();
  }

  // Fixed-order reduction of the 8 warps' partial tiles, one n8 tile at a time.
  float* red = reinterpret_cast<float*>(smem);  // [warp][8][32]
  float* part = red + kDecWarps * 8 * 32;        // kCluster: [NT][256]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    __syncthreads();  // the previous tile's sums have been read
#pragma unroll
    for (int e = 0; e < 8; ++e) red[(warp * 8 + e) * 32 + lane] = acc[nt][e >> 2][e & 3];
    __syncthreads();
    const int e = threadIdx.x >> 5, l = threadIdx.x & 31;  // 256 threads: one element each
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) sum += red[(w * 8 + e) * 32 + l];
    if constexpr (kCluster) {
      part[nt * 256 + threadIdx.x] = sum;
      continue;
    }
    u32 row, n;
    dec_out_coord(u32(nt), threadIdx.x, m0, n0, row, n);
    if (row < p.M && n < p.N) {
      if (p.k_parallel > 1) {
        ws[(size_t(slice) * p.M + row) * p.N + n] = sum;
      } else {
        if (p.has_bias) sum += Tr<T>::to_f(bias[n]);
        C[size_t(row) * p.N + n] = Tr<T>::from_f(sum);
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
// Plain fp32 kernel, standalone dequant
// ---------------------------------------------------------------------------------------------
template <u32 FMT>
__device__ __forceinline__ float dequant_scalar(u32 code, float s, float z) {
  if constexpr (FMT == TM_FORMAT_FP4) return fp4_e2m1_to_float(code) * s;
  else return (float(code) - z) * s;
}

// fp32 activations: one thread per column, 8 rows per block row; A reads are warp broadcasts.
template <u32 FMT>
__global__ void __launch_bounds__(128) simt_kernel(QuantGemmParams p, const float* __restrict__ A,
                                                   const u32* __restrict__ B, const float* __restrict__ S,
                                                   const uint8_t* __restrict__ Z, const float* __restrict__ bias,
                                                   float* __restrict__ C) {
  const u32 n = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 m0 = blockIdx.y * 8u;
  if (n >= p.N) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (u32 kw = 0; kw < p.K / 8u; ++kw) {
    const u32 w = B[size_t(kw) * p.N + n];
    const u32 grp = kw * 8u / p.group_size;
    const float s = S[size_t(grp) * p.N + n];
    const float z = FMT == TM_FORMAT_U4 ? float(Z[size_t(grp) * p.N + n]) : 0.f;
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

// Dequantizes columns [n0, n0 + cols) of B into W[K][ldw]: the standalone dequant op (n0 = 0,
// cols = ldw = N) and the panels of the dequant_blas path. B, S and Z are padded to Np columns (a
// multiple of 16, 16-byte aligned: pad_cols) and n0 is a multiple of 16, so a thread reads 8
// adjacent columns of one packed row (two 16-byte loads) and writes 8 rows of 8 values, each one
// 16-byte store when ldw allows. fp16/bf16 use the GEMM kernels' dequant (bit-exact with the
// reference: one rounding of code x scale); fp32 the scalar reference.
template <typename T, u32 FMT>
__global__ void dequant_kernel(u32 K, u32 Np, u32 gs, u32 n0, u32 cols, u32 ldw, const u32* __restrict__ B,
                               const T* __restrict__ S, const uint8_t* __restrict__ Z, T* __restrict__ W) {
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
        const float z = FMT == TM_FORMAT_U4 ? float(Z[q + j]) : 0.f;
#pragma unroll
        for (u32 r = 0; r < 8u; ++r) w[size_t(r) * ldw + j] = dequant_scalar<FMT>(tm_nibble(b[j], r), S[q + j], z);
      }
    } else {
      const uint4 lo = *reinterpret_cast<const uint4*>(b), hi = *reinterpret_cast<const uint4*>(b + 4);
      const uint4 s8 = *reinterpret_cast<const uint4*>(S + q);
      const uint2 z8 = FMT == TM_FORMAT_U4 ? *reinterpret_cast<const uint2*>(Z + q) : make_uint2(0u, 0u);
      ColQ<T> qa[4], qb[4];
      make_colq<T, FMT>(qa, make_uint2(s8.x, s8.y), z8.x);
      make_colq<T, FMT>(qb, make_uint2(s8.z, s8.w), z8.y);
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

// The Hopper kernels' device helpers below are referenced only from kernel bodies that compile
// for sm_90a alone (__CUDA_ARCH_FEAT_SM90_ALL); nvcc's other passes would warn they are unused.
#pragma nv_diag_suppress 177
// ---------------------------------------------------------------------------------------------
// wgmma kernel (sm_90a): fused dequant into Hopper warpgroup MMAs, 64 < M <= 512 (cuda_wgmma_pays)
// ---------------------------------------------------------------------------------------------
// A block of 2 warpgroups (256 threads) computes a BM x TN output tile (BM = 128 or 256 rows of
// activations, TN = 128 weight columns, or 256 with BM = 128), one block per SM. Per 64-k stage:
//  - every thread dequantizes 4 packed words (one column x 32 k; two columns for TN = 256) of the
//    stage's TN x 64 weight tile into shared memory, in natural k order, as wgmma's B operand (K-major: a dequantized
//    word is exactly one 16-byte core-matrix row). The tile is dequantized once and read by both
//    warpgroups, so the dequant cost per multiply-add halves against a warpgroup dequantizing its
//    own register fragments (measured: 0.51x cuBLAS at M = 1024, issue-bound);
//  - each warpgroup multiplies its BM / 2 activation rows (1 or 2 m64nTN wgmmas per k16 step, both
//    operands from shared memory) while the threads dequantize the next stage's tile;
//  - the activation tile arrives by one TMA copy (mbarrier), packed weights and scales by
//    cp.async, kWgStages deep; each thread copies the weights and scales it dequantizes itself
//    (no barrier for those).
// One barrier per stage: three B buffers, so the buffer written for stage s + 1 was last read by
// stage s - 2, which both warpgroups have retired before the previous barrier.
// Shared-memory layouts (K-major): A slot = the TMA box, BM rows of 128 bytes with the 128-byte
// swizzle (wgmma's canonical SW128 layout: 8-row atoms of 1024 bytes); B buffer = no swizzle,
// core matrix (8 columns x 8 k, 128 contiguous bytes) (kc, cg) at (kc * TN / 8 + cg) * 128.
constexpr int kWgThreads = int(TM_CUDA_WGMMA_THREADS);
constexpr int kWgKStep = int(TM_CUDA_WGMMA_K_STEP);
constexpr int kWgStages = 4;  // cp.async ring: stages s + 1 .. s + 3 in flight while s is used
constexpr int kWgBBufs = 3;
static_assert(kWgThreads == 256 && kWgKStep == 64, "2 warpgroups; a thread dequantizes 32 k of a column per stage");
// BM x TN tile: TN = 128 (one column a thread) or, with BM = 128, 256 (two columns a thread,
// TM_CUDA_WGMMA_WIDE_TILE_N: twice the work between the same barriers and waits).
template <int BM, int TN>
struct WgSmem {
  static_assert(TN == 128 || (TN == 256 && BM == 128), "128-column tiles, or 256 with 128 rows");
  static constexpr int kCols = TN / 128;                  // columns a thread dequantizes
  static constexpr int kA = BM * kWgKStep * 2;           // one activation stage
  static constexpr int kB = TN * kWgKStep * 2;            // one dequantized weight tile
  static constexpr int kBLbo = TN / 8 * 128;              // bytes between k-adjacent core matrices
  static constexpr int kW = kWgThreads * 16 * kCols;      // packed words: 4 a thread and column
  static constexpr int kS = kWgThreads * 4 * kCols;       // 2 scales a thread (its column pair)
  static constexpr int kZ = kWgThreads * 4 * kCols;       // 4 zero points a thread (its column quad)
  static constexpr int kStage = kA + kW + kS + kZ;  // kA % 1024 == 0: TMA 128-byte swizzle atoms
  static constexpr int kBytes = kWgStages * kStage + kWgBBufs * kB + 1024;  // + alignment slack
  static_assert(kStage % 1024 == 0 && kBytes <= 227 * 1024, "stage alignment / shared-memory limit");
};

// Eight accumulator operands d[i .. i + 7] of a wgmma asm statement (the SS and RS forms below).
#define TM_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define TM_WGMMA_SS(TY)                                                                           \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                      \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                                                        \
               "%64, %65, 1, 1, 1, 0, 0;\n"                                                      \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48),       \
                 TM_D8(56)                                                                       \
               : "l"(desc_a), "l"(desc_b))

#define TM_WGMMA_SS256(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                      \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "                                                                      \
               "%128, %129, 1, 1, 1, 0, 0;\n"                                                    \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48),       \
                 TM_D8(56), TM_D8(64), TM_D8(72), TM_D8(80), TM_D8(88), TM_D8(96), TM_D8(104),    \
                 TM_D8(112), TM_D8(120)                                                           \
               : "l"(desc_a), "l"(desc_b))

// d[TN / 2] += A (64 x 16) x B (16 x TN), both from shared memory (descriptors, K-major).
template <typename T, int TN>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (TN == 128) {
    if constexpr (std::is_same<T, __half>::value) TM_WGMMA_SS("f16");
    else TM_WGMMA_SS("bf16");
  } else {
    if constexpr (std::is_same<T, __half>::value) TM_WGMMA_SS256("f16");
    else TM_WGMMA_SS256("bf16");
  }
#endif
}
#undef TM_WGMMA_SS
#undef TM_WGMMA_SS256

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accesses of r across the asynchronous wgmma boundaries.
__device__ __forceinline__ void wg_pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Makes this thread's generic-proxy shared-memory stores visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarrier and TMA (cp.async.bulk.tensor) wrappers: shared-memory addresses as u32.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Spins until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One 2-D TMA box at coordinates (c0 innermost, c1) into dst, completing bytes on bar.
__device__ __forceinline__ void tma_load_2d(u32 dst, const CUtensorMap* map, u32 c0, u32 c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The box at (c0, c1) of a tensor map into L2 only (no shared memory, no barrier).
__device__ __forceinline__ void tma_prefetch_l2_2d(const CUtensorMap* map, u32 c0, u32 c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(map), "r"(c0), "r"(c1)
               : "memory");
}

// K-major, no-swizzle shared-memory matrix descriptor: lbo = bytes between the two core matrices
// of a k16 step (adjacent in k), sbo = bytes between core matrices 8 rows apart.
__device__ __forceinline__ uint64_t wg_desc(u32 smem_addr, u32 lbo, u32 sbo) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}

// FP4 word -> its 8 unscaled values in natural k order, h[i] = (k 2i, k 2i + 1) (see below).
template <typename T>
__device__ __forceinline__ void fp4_natural(u32 w, u32 (&h)[4]) {
  const u32 idx_lo = w & 0x77777777u, idx_hi = idx_lo >> 16;  // magnitudes of codes 0..3, 4..7
  // Byte j bit 7 = sign of code 2j (even) / 2j + 1 (odd), then in code order 0..3 and 4..7.
  const u32 even = (w << 4) & 0x80808080u, odd = w & 0x80808080u;
  const u32 sign_lo = prmt(even, odd, 0x5140), sign_hi = prmt(even, odd, 0x7362);
  if constexpr (std::is_same<T, __half>::value) {
    constexpr u32 kHi0 = 0x3E3C3800u, kHi1 = 0x46444240u;  // fp16 high bytes of magnitudes 0..7
    const u32 lo4 = prmt(kHi0, kHi1, idx_lo) | sign_lo, hi4 = prmt(kHi0, kHi1, idx_hi) | sign_hi;
    h[0] = prmt(lo4, 0u, 0x1404);  // (k0, k1): bytes 0, hi(k0), 0, hi(k1)
    h[1] = prmt(lo4, 0u, 0x3424);
    h[2] = prmt(hi4, 0u, 0x1404);
    h[3] = prmt(hi4, 0u, 0x3424);
  } else {
    constexpr u32 kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;  // bf16 high bytes
    constexpr u32 kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;  // bf16 low bytes
    const u32 lo4h = prmt(kHi0, kHi1, idx_lo) | sign_lo, hi4h = prmt(kHi0, kHi1, idx_hi) | sign_hi;
    const u32 lo4l = prmt(kLo0, kLo1, idx_lo), hi4l = prmt(kLo0, kLo1, idx_hi);
    h[0] = prmt(lo4l, lo4h, 0x5140);  // (k0, k1): lo(k0), hi(k0), lo(k1), hi(k1)
    h[1] = prmt(lo4l, lo4h, 0x7362);
    h[2] = prmt(hi4l, hi4h, 0x5140);
    h[3] = prmt(hi4l, hi4h, 0x7362);
  }
}

// U4 word -> 8 values in natural k order: the pairs (k p, k p + 4) dequantized with q (whose two
// halves may belong to different columns: lo for k 0..3, hi for k 4..7), then regrouped.
template <typename T>
__device__ __forceinline__ uint4 u4_natural(u32 w, const ColQ<T>& q) {
  const u32 d0 = dequant_pair<T, TM_FORMAT_U4, 0>(w, q), d1 = dequant_pair<T, TM_FORMAT_U4, 1>(w, q);
  const u32 d2 = dequant_pair<T, TM_FORMAT_U4, 2>(w, q), d3 = dequant_pair<T, TM_FORMAT_U4, 3>(w, q);
  // d_p = (k p, k p + 4): regroup into (0, 1), (2, 3), (4, 5), (6, 7).
  return make_uint4(prmt(d0, d1, 0x5410), prmt(d2, d3, 0x5410), prmt(d0, d1, 0x7632), prmt(d2, d3, 0x7632));
}

// One packed word (8 k of one column) -> 8 values in natural k order (16 bytes).
// FP4 by table lookup (fp4_natural): a byte permute picks 4 of 8 table bytes by the low 3 bits of
// 4 selector nibbles, so one prmt turns 4 codes' magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) into the
// high bytes of their exact fp16 (low bytes all 0) or bf16 values; the signs are ORed into those
// bytes and a second prmt places the bytes in k order. 19 instructions a word against 28 for the
// shift/mask form with its 2^-14 rescale (the wgmma kernel is issue-bound; docs/cuda.md). Products
// with the scale are the same single rounding of value x scale as the shift/mask form.
template <typename T, u32 FMT>
__device__ __forceinline__ uint4 dequant_word_natural(u32 w, const ColQ<T>& q) {
  if constexpr (FMT == TM_FORMAT_FP4) {
    using T2 = typename Tr<T>::T2;
    u32 h[4];
    fp4_natural<T>(w, h);
    return make_uint4(as_u32(__hmul2(as_t2<T2>(h[0]), q.s2)), as_u32(__hmul2(as_t2<T2>(h[1]), q.s2)),
                      as_u32(__hmul2(as_t2<T2>(h[2]), q.s2)), as_u32(__hmul2(as_t2<T2>(h[3]), q.s2)));
  } else {
    return u4_natural<T>(w, q);
  }
}

// Stores an output pair C[row][col, col + 1] (just col unless pair): one 4-byte store when the row
// stride keeps it aligned (N even; col is even in both wgmma epilogues).
template <typename T>
__device__ __forceinline__ void store_c_pair(T* dst, float v0, float v1, bool pair, u32 N) {
  if (pair && N % 2u == 0u) {
    typename Tr<T>::T2 v;
    v.x = Tr<T>::from_f(v0);
    v.y = Tr<T>::from_f(v1);
    *reinterpret_cast<typename Tr<T>::T2*>(dst) = v;
  } else {
    dst[0] = Tr<T>::from_f(v0);
    if (pair) dst[1] = Tr<T>::from_f(v1);
  }
}

// K-slice epilogue of the wgmma kernels (plan.reduce_kernel "cluster_reduce"): the slices of an
// output tile run as one cluster (dims (1, 1, k_parallel): cluster rank = slice) and every block
// has left its fp32 partial tile part[rows][TN] in its own shared memory. After a cluster barrier
// block r sums rows [r rows / kp, (r + 1) rows / kp) over all blocks' tiles in slice order
// (deterministic), adds the bias and writes C; a second barrier keeps every block resident until
// the others have read its shared memory. Threads tid = 0 .. nthreads - 1 share the sums; every
// other thread of the cluster must pass the two barriers too.
template <typename T, int TN>
__device__ void wgmma_cluster_reduce(const QuantGemmParams& p, const float* part, u32 rows, u32 m0, u32 n0,
                                     const T* bias, T* C, u32 tid, u32 nthreads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const u32 kp = p.k_parallel, rank = cluster.block_rank();
  const u32 rows_per = (rows + kp - 1u) / kp;
  const u32 r_end = min(rows, (rank + 1u) * rows_per);
  constexpr u32 kQuads = u32(TN) / 4u;  // 4 columns a thread and step
  for (u32 v = rank * rows_per * kQuads + tid; v < r_end * kQuads; v += nthreads) {
    const u32 r = v / kQuads, c4 = 4u * (v % kQuads);
    const u32 row = m0 + r, col = n0 + c4;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (u32 sl = 0; sl < kp; ++sl) {
      const float4 x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, sl) + r * TN + c4);
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    if (row >= p.M) continue;
    const float v4[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (u32 q = 0; q < 4u; ++q)
      if (col + q < p.N) C[size_t(row) * p.N + col + q] = Tr<T>::from_f(v4[q] + (p.has_bias ? Tr<T>::to_f(bias[col + q]) : 0.f));
  }
  cluster.sync();
#else
  __trap();
#endif
}

// kCluster (plan.reduce_kernel "cluster_reduce"): the K slices of a tile run as one thread-block
// cluster and sum their partial tiles through distributed shared memory (the epilogue below).
template <typename T, u32 FMT, int BM, int TN, bool kCluster>
__global__ void __launch_bounds__(kWgThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap tmap_a, QuantGemmParams p, u32 Np, const u32* __restrict__ B,
                 const T* __restrict__ S, const uint8_t* __restrict__ Z, const T* __restrict__ bias,
                 T* __restrict__ C) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgSmem<BM, TN>;
  constexpr int kHalves = BM / 128;  // m64 wgmmas per warpgroup and k16 step
  constexpr int kCols = L::kCols;    // columns a thread dequantizes (TN / 128)
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  // blockIdx.x: row tile (fastest: the row tiles of a column tile share its weights in L2),
  // y: TN-column tile, z: K slice.
  const u32 m0 = blockIdx.x * u32(BM);
  const u32 n0 = blockIdx.y * u32(TN);
  const u32 k_begin = blockIdx.z * p.k_slice_len;
  const u32 k_end = min(p.K, k_begin + p.k_slice_len);
  const int n_stages = int((k_end - k_begin) / u32(kWgKStep));  // K, k_slice_len: multiples of 64
  // 1024-byte aligned base: the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
  const u32 smem_raw = u32(__cvta_generic_to_shared(smem));
  const u32 align_pad = (1024u - (smem_raw & 1023u)) & 1023u;
  unsigned char* const sm = smem + align_pad;
  const u32 smem_base = smem_raw + align_pad;
  const u32 b_base = smem_base + u32(kWgStages * L::kStage);
  __shared__ __align__(8) uint64_t mbar[kWgStages];
  const u32 mbar_base = u32(__cvta_generic_to_shared(mbar));
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kWgStages; ++i) mbar_init(mbar_base + 8u * i, 1u);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Waits until the TMA copy of stage s has landed (the slot's barrier completes once per use).
  auto wait_act = [&](int s) { mbar_wait(mbar_base + 8u * u32(s % kWgStages), u32(s / kWgStages) & 1u); };

  // Activations: one TMA copy per stage of the BM x 64 tile (k innermost, 128-byte rows, 128-byte
  // swizzle: the canonical K-major SW128 layout wgmma reads), completing on the slot's mbarrier.
  // Weights: thread = column c = tid % 128 (and c + 128 for 256-column tiles) and half h = tid / 128
  // of the stage (k 32h .. 32h + 31, packed rows 4h .. 4h + 3). Columns past Np read column 0
  // (their outputs are dropped).
  const u32 c_w = u32(tid & 127), h_w = u32(tid >> 7);
  u32 col_w[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) col_w[i] = n0 + c_w + 128u * i < Np ? n0 + c_w + 128u * i : 0u;
  // Running sources of this thread's next copy_stage (stages are copied in order, one call each):
  // the first of its 4 packed rows per column, and the scales (zero points) of the group its 32 k
  // lie in (group_size % 32 == 0, planner; K % group_size == 0, op checks), advanced without a
  // division.
  const size_t b_stage_step = size_t(kWgKStep / 8) * Np;
  const u32 k_thread = k_begin + 32u * h_w;
  u32 k_in_group = k_thread % p.group_size;
  const size_t g_off = size_t(k_thread / p.group_size) * Np;
  const u32* b_src[kCols];
  const T* s_src[kCols];
  const uint8_t* z_src[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    b_src[i] = B + size_t(k_begin / 8u + 4u * h_w) * Np + col_w[i];
    s_src[i] = S + g_off + (col_w[i] & ~1u);
    z_src[i] = FMT == TM_FORMAT_U4 ? Z + g_off + (col_w[i] & ~3u) : nullptr;
  }
  auto copy_stage = [&](int s) {
    if (s < n_stages) {
      const u32 slot = smem_base + u32(s % kWgStages) * u32(L::kStage);
      const u32 k0 = k_begin + u32(s) * u32(kWgKStep);
      if (tid == 0) {  // the activation tile: one TMA copy (rows past M are zero-filled)
        const u32 bar = mbar_base + 8u * u32(s % kWgStages);
        mbar_expect_tx(bar, u32(L::kA));
        tma_load_2d(slot, &tmap_a, k0, m0, bar);
      }
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const u32 wslot = slot + u32(L::kA) + u32(i * kWgThreads + tid) * 16u;
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async4(wslot + 4u * j, b_src[i] + size_t(j) * Np);
        b_src[i] += b_stage_step;
        cp_async4(slot + u32(L::kA + L::kW) + u32(i * kWgThreads + tid) * 4u, s_src[i]);
        if constexpr (FMT == TM_FORMAT_U4)
          cp_async4(slot + u32(L::kA + L::kW + L::kS) + u32(i * kWgThreads + tid) * 4u, z_src[i]);
      }
      k_in_group += u32(kWgKStep);  // the next stage's 32 k: 0, 1 or 2 groups on
      while (k_in_group >= p.group_size) {
        k_in_group -= p.group_size;
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
          s_src[i] += Np;
          if constexpr (FMT == TM_FORMAT_U4) z_src[i] += Np;
        }
      }
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };
  // Dequantizes this thread's 4 words a column of stage s into B buffer b: word j (k 32h + 8j ..)
  // of column c -> core (4h + j, c / 8), row c % 8 = byte (4h + j) * kBLbo + c * 16. A warp stores
  // 512 contiguous bytes per word: no bank conflicts.
  auto dequant_stage = [&](int s, int b) {
    const unsigned char* slot = sm + (s % kWgStages) * L::kStage;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int ti = i * kWgThreads + tid;
      const uint4 words = *reinterpret_cast<const uint4*>(slot + L::kA + ti * 16);
      const u32 sp = *reinterpret_cast<const u32*>(slot + L::kA + L::kW + ti * 4);
      ColQ<T> q;
      q.s2 = Tr<T>::dup(t_from_bits<T>((unsigned short)(sp >> (16u * (col_w[i] & 1u)))));
      if constexpr (FMT == TM_FORMAT_U4) {
        const u32 zq = *reinterpret_cast<const u32*>(slot + L::kA + L::kW + L::kS + ti * 4);
        q.z2 = Tr<T>::dup(magic_zero<T>(zq >> (8u * (col_w[i] & 3u))));
      }
      unsigned char* dst =
          sm + kWgStages * L::kStage + b * L::kB + (4 * int(h_w)) * L::kBLbo + (int(c_w) + 128 * i) * 16;
      const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4*>(dst + j * L::kBLbo) = dequant_word_natural<T, FMT>(w[j], q);
    }
    fence_proxy_async_smem();
  };

  constexpr int kAcc = TN / 2;  // accumulators a thread per m64 half
  float acc[kHalves][kAcc];
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[hh][i] = 0.f;
  // This warpgroup's rows: BM / 2 from wg * BM / 2, in m64 halves (128 bytes a row).
  // Descriptors of the first A slot (this warpgroup's rows) and B buffer; the others are byte
  // offsets added to the start-address field (16-byte units; no carry: shared addresses < 256 KB).
  const uint64_t desc_a0 = wg_desc(smem_base + u32(wg) * u32(BM / 2) * 128u, 16u, 1024u) | (uint64_t(1) << 62);
  const uint64_t desc_b0 = wg_desc(b_base, u32(L::kBLbo), 128u);
  auto issue_stage = [&](int s, int b) {
    const uint64_t da_s = desc_a0 + ((u32(s % kWgStages) * u32(L::kStage)) >> 4);
    const uint64_t db_b = desc_b0 + ((u32(b) * u32(L::kB)) >> 4);
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) wg_pin(acc[hh][i]);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t db = db_b + ((2u * u32(ks) * u32(L::kBLbo)) >> 4);
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        // SW128 K-major: 8-row atoms 1024 bytes apart; k16 step ks starts 32 ks bytes in.
        const uint64_t da = da_s + ((u32(hh) * 64u * 128u + 32u * u32(ks)) >> 4);
        wgmma_ss<T, TN>(acc[hh], da, db);
      }
    }
    wg_commit();
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) wg_pin(acc[hh][i]);
  };

#pragma unroll
  for (int j = 0; j < kWgStages - 1; ++j) copy_stage(j);
  cp_async_wait<kWgStages - 2>();  // stage 0's weights landed (this thread's copies)
  if (n_stages > 0) {
    dequant_stage(0, 0);
    wait_act(0);
  }
  __syncthreads();  // B buffer 0
  for (int s = 0; s < n_stages; ++s) {
    issue_stage(s, s % kWgBBufs);
    cp_async_wait<kWgStages - 3>();  // stage s + 1 landed (this thread's copies)
    if (s + 1 < n_stages) {
      // Into the buffer stage s - 2 read (retired by both warpgroups before the last barrier), so
      // it overlaps the tensor work of stages s - 1 and s.
      dequant_stage(s + 1, (s + 1) % kWgBBufs);
      wait_act(s + 1);
    }
    wg_wait<1>();     // this warpgroup's stage s - 1 retired
    __syncthreads();  // B buffer s + 1 ready; both warpgroups retired stage s - 1 (its slot is free)
    copy_stage(s + kWgStages - 1);  // into the slot of stage s - 1
  }
  wg_wait<0>();
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) wg_pin(acc[hh][i]);

  // acc[hh][4j + 2e + f]: activation row m0 + wg BM/2 + 64 hh + 16 warp + g + 8e, column
  // n0 + 8j + 2t + f (the m64nNk16 accumulator layout; warp and lane within the warpgroup).
  const int wwarp = wtid >> 5, lane = wtid & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kCluster) {
    // K slices: every block leaves its fp32 partial tile [BM][TN] in its own shared memory (the
    // pipeline's, free now); after a cluster barrier block r (= slice r) sums rows
    // [r BM / kp, (r + 1) BM / kp) over all blocks' tiles in slice order (deterministic), adds the
    // bias and writes C; a second barrier keeps every block resident until the others have read it.
    float* part = reinterpret_cast<float*>(sm);
    __syncthreads();  // every wgmma retired: the shared memory is free
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = wg * (BM / 2) + 64 * hh + 16 * wwarp + g + 8 * e;
#pragma unroll
        for (int j = 0; j < TN / 8; ++j)
          *reinterpret_cast<float2*>(part + r * TN + 8 * j + 2 * t) =
              make_float2(acc[hh][4 * j + 2 * e], acc[hh][4 * j + 2 * e + 1]);
      }
    wgmma_cluster_reduce<T, TN>(p, part, u32(BM), m0, n0, bias, C, threadIdx.x, blockDim.x);
  } else {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const u32 row = m0 + u32(wg) * u32(BM / 2) + 64u * hh + 16u * wwarp + u32(g) + 8u * e;
        if (row >= p.M) continue;
#pragma unroll
        for (int j = 0; j < TN / 8; ++j) {
          const u32 col = n0 + 8u * j + 2u * t;
          if (col >= p.N) continue;
          float v0 = acc[hh][4 * j + 2 * e], v1 = acc[hh][4 * j + 2 * e + 1];
          const bool pair = col + 1u < p.N;
          if (p.has_bias) {
            v0 += Tr<T>::to_f(bias[col]);
            if (pair) v1 += Tr<T>::to_f(bias[col + 1u]);
          }
          store_c_pair<T>(C + size_t(row) * p.N + col, v0, v1, pair, p.N);
        }
      }
  }
#else
  __trap();  // planned only where the loaded kernels are sm_90a (cuda_device_caps)
#endif
}

// ---------------------------------------------------------------------------------------------
// wgmma_ws kernel (sm_90a): warp-specialized, weights as the register A operand
// ---------------------------------------------------------------------------------------------
// C^T = W^T A^T: the dequantized weights are wgmma's A operand straight from registers (64 weight
// columns = the m64 rows of one warpgroup), the activations its B operand from shared memory (the
// n dimension: BN = 64, 128 or 256 rows of A). A block is one producer warpgroup and NC = 2 or 3
// consumer warpgroups over a 64 NC-column x BN-row output tile, one block per SM.
//  - One producer thread keeps a kStages-deep ring of 64-k stages full by TMA: the activation box
//    (BN rows x 64 k, 128-byte swizzle: wgmma's canonical K-major layout), the packed-weight box
//    (8 packed rows x 64 NC columns) and the stage's scale (and U4 zero-point) row, all completing
//    on the slot's "full" mbarrier; it refills a slot once every consumer warp has arrived on its
//    "empty" mbarrier.
//  - A consumer lane (g, t) of warp w holds the A rows 16 w + g and 16 w + g + 8 of its warpgroup.
//    The order of the m64 rows is free (it only decides where each output lands), so those two rows
//    are the adjacent weight columns 2 g and 2 g + 1 of the warp's 16: one 8-byte shared load per
//    packed row gives both. A k16 step needs k = {2t, 2t+1} (a0, a1) and {2t+8, 2t+9} (a2, a3): byte
//    t of packed rows 2 ks and 2 ks + 1. Three byte permutes gather the 4 bytes (2 columns x 2 rows)
//    into one word that the FP4 table lookup / INT4 magic numbers turn into the 4 A registers.
//  - No shared-memory store of dequantized weights, no fence and no block barrier per stage: the
//    consumers dequantize stage s + 1 into the other of two register fragment sets while stage s's
//    wgmmas run, and wait only for the full barrier and their own wgmma groups.
// K slices sum through wgmma_cluster_reduce (cluster dims (1, 1, k_parallel)) or, without a
// cluster, by the last block of each tile from fragment-order partials in ws. group_size % 64 == 0:
// one scale row a stage (a second row for group sizes of 32 or 96 cost 10 % at M = 64..128 in
// session 8's sweep; the wgmma kernel serves them).
constexpr int kWsMaxConsumers = int(TM_CUDA_WGMMA_WS_MAX_TILE_N) / 64;
// setmaxnreg moves registers between the warpgroups of a block: the block starts with
// ws_launch_regs a thread (__launch_bounds__ (128 (NC + 1), 1): the 64 K registers of an SM in
// multiples of 8), the producer gives all but 40 back and the consumers share what it gave. They
// must not ask for more: setmaxnreg.inc waits for registers the block's pool does not have (a
// deadlock; launch_wgmma_ws_as checks the compiled count this assumes).
constexpr u32 kWsProducerRegs = 40;
template <int NC>
constexpr u32 ws_launch_regs() {
  return 65536u / (128u * (NC + 1)) / 8u * 8u;
}
template <int NC>
constexpr u32 ws_consumer_regs() {
  return ws_launch_regs<NC>() + (ws_launch_regs<NC>() - kWsProducerRegs) / NC / 8u * 8u;
}
static_assert(ws_consumer_regs<2>() == 232u && ws_consumer_regs<3>() == 152u, "consumer register budgets");
template <int BN, int NC>
struct WsSmem {
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma n of 64, 128 or 256 activation rows");
  static_assert(NC >= 2 && NC <= kWsMaxConsumers && (BN < 256 || NC == 2),
                "consumer registers (ws_consumer_regs) for BN / 2 accumulators");
  static constexpr int kTN = 64 * NC;                      // weight columns of a block
  static constexpr int kA = BN * kWgKStep * 2;             // activation box: BN rows of 128 bytes
  static constexpr int kW = (kWgKStep / 8) * kTN * 4;      // 8 packed rows x kTN columns
  static constexpr int kS = kTN * 2;                       // one scale row
  static constexpr int kZ = kTN;                           // one zero-point row (U4)
  static constexpr int kStage = (kA + kW + kS + kZ + 1023) / 1024 * 1024;  // 1024-aligned swizzle atoms
  static constexpr int kStages = (200 * 1024) / kStage < 8 ? (200 * 1024) / kStage : 8;
  static constexpr int kPart = BN * kTN * 4;               // fp32 partial tile of the K-slice epilogue
  static constexpr int kBytes = (kStages * kStage > kPart ? kStages * kStage : kPart) + 1024;
  static_assert(kStages >= 4 && kBytes <= 227 * 1024, "shared-memory budget");
};

#define TM_WGMMA_RS64(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
               "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define TM_WGMMA_RS128(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
               "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48), TM_D8(56)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define TM_WGMMA_RS256(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
               "{%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48), TM_D8(56), TM_D8(64), TM_D8(72), TM_D8(80), TM_D8(88), TM_D8(96), TM_D8(104), TM_D8(112), TM_D8(120)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))

// d[BN / 2] += A (64 x 16, registers) x B (16 x BN, shared memory descriptor, K-major).
template <typename T, int BN>
__device__ __forceinline__ void wgmma_rs(float* d, const u32 (&a)[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kH = std::is_same<T, __half>::value;
  if constexpr (BN == 64) {
    if constexpr (kH) TM_WGMMA_RS64("f16");
    else TM_WGMMA_RS64("bf16");
  } else if constexpr (BN == 128) {
    if constexpr (kH) TM_WGMMA_RS128("f16");
    else TM_WGMMA_RS128("bf16");
  } else {
    if constexpr (kH) TM_WGMMA_RS256("f16");
    else TM_WGMMA_RS256("bf16");
  }
#endif
}
#undef TM_WGMMA_RS64
#undef TM_WGMMA_RS128
#undef TM_WGMMA_RS256
#undef TM_D8

// 4 bytes (columns e = 0, 1 x packed rows 2 ks, 2 ks + 1) -> the A fragment of one k16 step:
// a0 = (col 0, k 2t, 2t+1), a1 = (col 1, same k), a2 = (col 0, k 2t+8, 2t+9), a3 = (col 1, same k).
// x = [row 2ks col 0, row 2ks+1 col 0, row 2ks col 1, row 2ks+1 col 1] (bytes, low first), so x's
// natural k order is (a0, a2, a1, a3). s0 / s1: the columns' scales (duplicated); U4: qp holds the
// pair (col 0, col 1) of scales and magic + zero points (nibbles p and p + 4 are the two columns).
template <typename T, u32 FMT>
__device__ __forceinline__ void rs_fragment(u32 (&a)[4], u32 x, typename Tr<T>::T2 s0, typename Tr<T>::T2 s1,
                                            const ColQ<T>& qp) {
  using T2 = typename Tr<T>::T2;
  if constexpr (FMT == TM_FORMAT_FP4) {
    u32 h[4];
    fp4_natural<T>(x, h);
    a[0] = as_u32(__hmul2(as_t2<T2>(h[0]), s0));
    a[2] = as_u32(__hmul2(as_t2<T2>(h[1]), s0));
    a[1] = as_u32(__hmul2(as_t2<T2>(h[2]), s1));
    a[3] = as_u32(__hmul2(as_t2<T2>(h[3]), s1));
  } else {
    const uint4 v = u4_natural<T>(x, qp);
    a[0] = v.x;
    a[2] = v.y;
    a[1] = v.z;
    a[3] = v.w;
  }
}

template <typename T, u32 FMT, int BN, int NC, bool kCluster>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    wgmma_ws_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                    const __grid_constant__ CUtensorMap tmap_s, const __grid_constant__ CUtensorMap tmap_z,
                    QuantGemmParams p, u32 n_tile0, const T* bias, T* __restrict__ C,
                    float* __restrict__ ws, int* __restrict__ counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WsSmem<BN, NC>;
  using T2 = typename Tr<T>::T2;
  constexpr int kS = L::kStages, kTN = L::kTN, kConsumers = 128 * NC;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 m0 = blockIdx.x * u32(BN), n0 = (blockIdx.y + n_tile0) * u32(kTN);  // n_tile0: GemmPlan::tail_n_tiles
  const u32 k_begin = blockIdx.z * p.k_slice_len;
  const u32 k_end = min(p.K, k_begin + p.k_slice_len);
  const int n_stages = int((k_end - k_begin) / u32(kWgKStep));  // multiples of 64 (planner)
  const u32 smem_raw = u32(__cvta_generic_to_shared(smem));
  const u32 align_pad = (1024u - (smem_raw & 1023u)) & 1023u;
  unsigned char* const sm = smem + align_pad;
  const u32 smem_base = smem_raw + align_pad;
  __shared__ __align__(8) uint64_t full_bar[kS], empty_bar[kS];
  const u32 full_base = u32(__cvta_generic_to_shared(full_bar)), empty_base = u32(__cvta_generic_to_shared(empty_bar));
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      mbar_init(full_base + 8u * i, 1u);
      mbar_init(empty_base + 8u * i, u32(kConsumers / 32));  // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Launched early behind the previous kernel (PDL), the producer brings the first ring's weights,
  // scales and zero points into L2 while that kernel finishes (they are usually the layer's own;
  // a prefetch only warms L2, so a weight that kernel writes is still read fresh), and every
  // thread waits for it before any other global access (it may write A, the weights, bias or C).
  pdl_launch_dependents();
  if (tid == kConsumers) {
    for (int s = 0; s < min(n_stages, kS); ++s) {
      const u32 k0 = k_begin + u32(s) * u32(kWgKStep), grp = k0 / p.group_size;
      tma_prefetch_l2_2d(&tmap_b, n0, k0 / 8u);
      tma_prefetch_l2_2d(&tmap_s, n0, grp);
      if constexpr (FMT == TM_FORMAT_U4) tma_prefetch_l2_2d(&tmap_z, n0, grp);
    }
  }
  pdl_wait();
  __syncthreads();

  if (tid >= kConsumers) {
    // Producer warpgroup: one thread puts stage s into slot s % kS once the consumers released the
    // slot's previous stage.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
    if (tid == kConsumers) {
      constexpr u32 kTx = u32(L::kA + L::kW + L::kS + (FMT == TM_FORMAT_U4 ? L::kZ : 0));
      for (int s = 0; s < n_stages; ++s) {
        const int slot = s % kS;
        if (s >= kS) mbar_wait(empty_base + 8u * slot, u32(s / kS - 1) & 1u);
        const u32 bar = full_base + 8u * slot, dst = smem_base + u32(slot * L::kStage);
        const u32 k0 = k_begin + u32(s) * u32(kWgKStep), grp = k0 / p.group_size;
        mbar_expect_tx(bar, kTx);
        tma_load_2d(dst, &tmap_a, k0, m0, bar);
        tma_load_2d(dst + L::kA, &tmap_b, n0, k0 / 8u, bar);
        tma_load_2d(dst + L::kA + L::kW, &tmap_s, n0, grp, bar);
        if constexpr (FMT == TM_FORMAT_U4) tma_load_2d(dst + L::kA + L::kW + L::kS, &tmap_z, n0, grp, bar);
      }
    }
    if constexpr (kCluster) {  // the two cluster barriers of the consumers' wgmma_cluster_reduce
      namespace cg = cooperative_groups;
      cg::this_cluster().sync();
      cg::this_cluster().sync();
    }
  } else {
    // Consumer warpgroup wg, warp w: A rows 16 w + g (+ 8) = tile columns 64 wg + 16 w + 2 g (+ 1).
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_consumer_regs<NC>()));
    const int wg = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
    const int col = 64 * wg + 16 * w + 2 * g;  // this lane's column pair within the tile
    const u32 sel = u32(t) | (u32(t + 4) << 4);  // byte t of each of two words
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    u32 frag[2][4][4];
    // Waits for stage s and dequantizes it into fragment set fr.
    auto load_stage = [&](int s, u32 (&fr)[4][4]) {
      const int slot = s % kS;
      mbar_wait(full_base + 8u * slot, u32(s / kS) & 1u);
      const unsigned char* st = sm + slot * L::kStage;
      uint2 wd[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) wd[r] = *reinterpret_cast<const uint2*>(st + L::kA + (r * kTN + col) * 4);
      const u32 sp = *reinterpret_cast<const u32*>(st + L::kA + L::kW + col * 2);
      const T2 s0 = as_t2<T2>(prmt(sp, sp, 0x1010)), s1 = as_t2<T2>(prmt(sp, sp, 0x3232));
      ColQ<T> qp;
      if constexpr (FMT == TM_FORMAT_U4) {
        const u32 zp = *reinterpret_cast<const unsigned short*>(st + L::kA + L::kW + L::kS + col);
        qp.s2 = as_t2<T2>(sp);
        qp.z2.x = magic_zero<T>(zp);
        qp.z2.y = magic_zero<T>(zp >> 8);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const u32 c0 = prmt(wd[2 * ks].x, wd[2 * ks + 1].x, sel), c1 = prmt(wd[2 * ks].y, wd[2 * ks + 1].y, sel);
        rs_fragment<T, FMT>(fr[ks], prmt(c0, c1, 0x5410), s0, s1, qp);
      }
    };
    // SW128 K-major B descriptor of slot 0 (8-row atoms 1024 bytes apart); k16 step ks starts 32 ks
    // bytes into the 128-byte rows.
    const uint64_t desc0 = wg_desc(smem_base, 16u, 1024u) | (uint64_t(1) << 62);
    auto issue_stage = [&](int s, const u32 (&fr)[4][4]) {
      const uint64_t ds = desc0 + ((u32(s % kS) * u32(L::kStage)) >> 4);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_rs<T, BN>(acc, fr[ks], ds + ((32u * u32(ks)) >> 4));
      wg_commit();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
    };
    // Stage s runs on fragment set s & 1; the set of s + 1 was read by stage s - 1, retired by the
    // wait below before it is overwritten.
    auto step = [&](int s, u32 (&cur)[4][4], u32 (&next)[4][4]) {
      issue_stage(s, cur);
      wg_wait<1>();  // stage s - 1 retired: its slot and fragment set are free
      if (s > 0 && lane == 0) mbar_arrive(empty_base + 8u * u32((s - 1) % kS));
      if (s + 1 < n_stages) load_stage(s + 1, next);
    };
    if (n_stages > 0) load_stage(0, frag[0]);
    for (int s = 0; s < n_stages; s += 2) {
      step(s, frag[0], frag[1]);
      if (s + 1 < n_stages) step(s + 1, frag[1], frag[0]);
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);

    // acc[4 j + 2 e + f]: tile column col + e, activation row m0 + 8 j + 2 t + f.
    if constexpr (kCluster) {
      // The partial tile goes where the ring was: every consumer warpgroup must be done with it.
      named_barrier(1u, u32(kConsumers));
      float* part = reinterpret_cast<float*>(sm);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int f = 0; f < 2; ++f)
          *reinterpret_cast<float2*>(part + (8 * j + 2 * t + f) * kTN + col) =
              make_float2(acc[4 * j + f], acc[4 * j + 2 + f]);
      wgmma_cluster_reduce<T, kTN>(p, part, u32(BN), m0, n0, bias, C, u32(tid), u32(kConsumers));
    } else {
      if (p.k_parallel > 1) {
        // K slices without a cluster (plan.reduce_kernel "last_block_reduce"): every block leaves
        // its accumulators in ws, fragment by fragment ([tile][slice][BN / 4][threads] float2:
        // coalesced, and the last block reads back exactly its own fragments' elements); the last
        // block sums the slices in slice order (the cluster path's sums), into acc.
        const u32 tile = (blockIdx.y + n_tile0) * gridDim.x + blockIdx.x;
        float2* tws = reinterpret_cast<float2*>(ws) + size_t(tile) * p.k_parallel * (BN / 4) * kConsumers + tid;
        float2* mine = tws + size_t(blockIdx.z) * (BN / 4) * kConsumers;
#pragma unroll
        for (int i = 0; i < BN / 4; ++i) __stcg(mine + i * kConsumers, make_float2(acc[2 * i], acc[2 * i + 1]));
        if (!last_arrival(p.k_parallel, counters, tile, u32(tid), u32(kConsumers), 1u)) return;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
        for (u32 sl = 0; sl < p.k_parallel; ++sl) {
          const float2* src = tws + size_t(sl) * (BN / 4) * kConsumers;
#pragma unroll
          for (int i = 0; i < BN / 4; ++i) {
            const float2 v = __ldcg(src + i * kConsumers);
            acc[2 * i] += v.x;
            acc[2 * i + 1] += v.y;
          }
        }
      }
      const u32 c = n0 + u32(col);
      if (c >= p.N) return;
      const bool pair = c + 1u < p.N;
      const float b0 = p.has_bias ? Tr<T>::to_f(bias[c]) : 0.f;
      const float b1 = p.has_bias && pair ? Tr<T>::to_f(bias[c + 1u]) : 0.f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const u32 row = m0 + u32(8 * j + 2 * t + f);
          if (row >= p.M) continue;
          const float v0 = acc[4 * j + f] + b0, v1 = acc[4 * j + 2 + f] + b1;
          store_c_pair<T>(C + size_t(row) * p.N + c, v0, v1, pair, p.N);
        }
    }
  }
#else
  __trap();  // planned only where the loaded kernels are sm_90a (cuda_device_caps)
#endif
}

#pragma nv_diag_default 177

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------
bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The fast kernels read 16-byte chunks of B (4 columns), scales (8) and zeros (16): they need the
// column count padded to a multiple of 16 and 16-byte aligned bases. Real models satisfy this;
// other shapes get a zero-padded copy (correct, one extra pass over the weights).
at::Tensor pad_cols(const at::Tensor& t, int64_t Np) {
  if (t.size(1) == Np && aligned16(t)) return t;
  at::Tensor out = at::zeros({t.size(0), Np}, t.options());
  out.narrow(1, 0, t.size(1)).copy_(t);
  return out;
}

// B, scales and (U4) zeros with N rounded up to 16 columns (B.size(1)).
struct PaddedWeights {
  at::Tensor B, S, Z;
};
PaddedWeights padded_weights(const QuantGemmArgs& a) {
  const int64_t Np = (a.N + 15) / 16 * 16;
  return {pad_cols(a.B, Np), pad_cols(a.scales, Np), a.zeros.defined() ? pad_cols(a.zeros, Np) : at::Tensor()};
}

// Per-tile arrival counters of the in-kernel K-slice reduction. One zeroed buffer per (device,
// stream): kernels on one stream run in order and every last block re-arms its counter, so a
// buffer is always all-zero when the next launch on that stream starts. (Per stream, because
// kernels on different streams may overlap.)
//  - Made during CUDA-graph capture, the buffer's zeroing is a graph node that only replays run.
//    Until an eager call has zeroed it, every call zeroes it again (captured calls as a node of
//    their own graph), so neither an eager call before the first replay nor another graph finds
//    stale counts.
//  - Growing keeps the old buffer alive: a captured graph may still launch kernels on it.
int* tile_counters(int64_t n, const at::Device& dev, cudaStream_t stream) {
  struct Counters {
    at::Tensor t;
    bool zero_pending = false;     // made under capture, not yet zeroed by an eager call
    std::vector<at::Tensor> kept;  // outgrown buffers
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Counters> cache;
  std::lock_guard<std::mutex> lock(mu);
  Counters& c = cache[{int(dev.index()), stream}];
  const bool grow = !c.t.defined() || c.t.numel() < n;
  if (!grow && !c.zero_pending) return c.t.data_ptr<int>();  // the steady state: no zeroing, no query
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (grow) {
    if (c.t.defined()) c.kept.push_back(c.t);
    c.t = at::zeros({std::max<int64_t>(n, 4096)}, at::TensorOptions().dtype(at::kInt).device(dev));
  } else {
    c.t.zero_();
  }
  c.zero_pending = capture != cudaStreamCaptureStatusNone;
  return c.t.data_ptr<int>();
}

int grid_for(size_t total, int threads) {
  const size_t blocks = (total + threads - 1) / threads;
  return int(std::min<size_t>(blocks, 65535u * 8u));
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  TORCH_CHECK(e == cudaSuccess, "torch_marlin: CUDA launch of ", what, " failed: ", cudaGetErrorString(e));
}

// Launches a tile kernel (decode, wgmma) over the plan's grid; with kCluster the K slices of an
// output tile (grid.z == k_parallel) run as one thread-block cluster; with plan.dependent_launch
// the kernel may start before the previous one on the stream has finished (its pdl_wait() orders
// them).
template <bool kCluster, typename... KArgs, typename... Args>
void launch_tile_kernel(const GemmPlan& plan, void (*kernel)(KArgs...), u32 threads, int smem_bytes,
                        cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(plan.grid[0], plan.grid[1], plan.grid[2]);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (kCluster) {  // no cluster attribute at all otherwise (sm_80 has none)
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = 1;
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs].val.clusterDim.z = plan.params.k_parallel;
    ++cfg.numAttrs;
  }
  if (plan.dependent_launch) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++cfg.numAttrs;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
  check_launch(plan.kernel.c_str());
}

// Calls f(std::true_type) when the plan sums K slices through a thread-block cluster, else
// f(std::false_type): the kernels' kCluster template argument.
template <typename F>
void with_cluster(const GemmPlan& plan, F&& f) {
  if (plan.reduce_kernel == "cluster_reduce") f(std::true_type{});
  else f(std::false_type{});
}

template <typename T, u32 FMT, int NT, bool kFold>
void launch_decode(const GemmPlan& plan, u32 Np, int gs_shift, const T* A, const u32* B, const T* S, const uint8_t* Z,
                   const T* bias, T* C, float* ws, int* counters, cudaStream_t stream) {
  with_cluster(plan, [&](auto cluster) {
    constexpr bool kCluster = decltype(cluster)::value;
    launch_tile_kernel<kCluster>(plan, decode_kernel<T, FMT, NT, kFold, kCluster>, kDecThreads,
                                 dec_smem_bytes<NT, kCluster>(), stream, plan.params, Np, gs_shift, A, B, S, Z, bias, C,
                                 ws, counters);
  });
}

// A 2-D TMA descriptor: rows x cols elements (cols contiguous, row stride in bytes), box_rows x
// box_cols boxes; out-of-range elements of a box read as zero. The encoder is a driver entry point
// (no link against libcuda), looked up once.
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int64_t rows, int64_t cols, int64_t row_bytes,
                          int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    TORCH_CHECK(fn != nullptr && q == cudaDriverEntryPointSuccess, "torch_marlin: cuTensorMapEncodeTiled unavailable");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "torch_marlin: cuTensorMapEncodeTiled failed (", int(r), ")");
  return map;
}

// The activations A [M, K] in rows x 64 boxes with the 128-byte swizzle (wgmma's K-major SW128).
template <typename T>
CUtensorMap activation_tensor_map(const T* A, int64_t M, int64_t K, int rows) {
  const CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return tensor_map_2d(A, type, M, K, K * int64_t(sizeof(T)), rows, kWgKStep, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Opts a kernel in to more than 48 KiB of dynamic shared memory, once per device.
template <typename Kernel>
void opt_in_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& opted_in) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(opted_in.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted_in.fetch_or(bit);
  }
}

template <typename T, u32 FMT, int BM, int TN, bool kCluster>
void launch_wgmma_as(const GemmPlan& plan, const CUtensorMap& tmap, u32 Np, const u32* B, const T* S,
                     const uint8_t* Z, const T* bias, T* C, cudaStream_t stream) {
  constexpr int kSmem = WgSmem<BM, TN>::kBytes;
  auto* kernel = wgmma_kernel<T, FMT, BM, TN, kCluster>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_smem(kernel, kSmem, opted_in);
  launch_tile_kernel<kCluster>(plan, kernel, kWgThreads, kSmem, stream, tmap, plan.params, Np, B, S, Z, bias, C);
}

template <typename T, u32 FMT, int BM, int TN>
void launch_wgmma(const GemmPlan& plan, u32 Np, const T* A, const u32* B, const T* S, const uint8_t* Z, const T* bias,
                  T* C, cudaStream_t stream) {
  const CUtensorMap tmap = activation_tensor_map<T>(A, plan.params.M, plan.params.K, BM);
  with_cluster(plan, [&](auto cluster) {
    launch_wgmma_as<T, FMT, BM, TN, decltype(cluster)::value>(plan, tmap, Np, B, S, Z, bias, C, stream);
  });
}

// wgmma_ws: TMA descriptors of the activations, packed weights (8 packed rows x 64 NC columns),
// scales and zero points (one row of 64 NC columns); the padded weights are 16-byte aligned with Np
// a multiple of 16 (padded_weights), as TMA needs.
template <typename T, u32 FMT, int BN, int NC, bool kCluster>
void launch_wgmma_ws_as(const GemmPlan& plan, const CUtensorMap (&maps)[4], u32 n_tile0, const T* bias, T* C,
                        float* ws, int* counters, cudaStream_t stream) {
  constexpr int kSmem = WsSmem<BN, NC>::kBytes;
  auto* kernel = wgmma_ws_kernel<T, FMT, BN, NC, kCluster>;
  static std::atomic<uint64_t> opted_in{0};
  if (opted_in.load() == 0) {  // first launch: the register pool setmaxnreg redistributes (ws_consumer_regs)
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    TORCH_CHECK(attr.numRegs == int(ws_launch_regs<NC>()), "torch_marlin: wgmma_ws compiled with ", attr.numRegs,
                " registers a thread, expected ", ws_launch_regs<NC>());
  }
  opt_in_smem(kernel, kSmem, opted_in);
  launch_tile_kernel<kCluster>(plan, kernel, u32(128 * (NC + 1)), kSmem, stream, maps[0], maps[1], maps[2], maps[3],
                               plan.params, n_tile0, bias, C, ws, counters);
}

// The second launch of a wgmma_ws plan with a tail (GemmPlan::tail_n_tiles), as a plan of its own:
// the last column tiles, in K slices summed through a cluster.
GemmPlan wgmma_ws_tail_plan(const GemmPlan& plan) {
  GemmPlan t = plan;
  t.params.k_parallel = plan.tail_k_parallel;
  t.params.k_slice_len = plan.tail_k_slice_len;
  t.grid[1] = plan.tail_n_tiles;
  t.grid[2] = plan.tail_k_parallel;
  t.reduce_kernel = "cluster_reduce";
  t.tail_n_tiles = 0;
  return t;
}

template <typename T, u32 FMT, int BN, int NC>
void launch_wgmma_ws(const GemmPlan& plan, int64_t Np, const T* A, const u32* B, const T* S, const uint8_t* Z,
                     const T* bias, T* C, float* ws, int* counters, cudaStream_t stream) {
  const QuantGemmParams& q = plan.params;
  const int64_t groups = q.K / q.group_size;
  constexpr int kTN = 64 * NC;
  const CUtensorMap scales =
      tensor_map_2d(S, CU_TENSOR_MAP_DATA_TYPE_UINT16, groups, Np, Np * 2, 1, kTN, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap maps[4] = {
      activation_tensor_map<T>(A, q.M, q.K, BN),
      tensor_map_2d(B, CU_TENSOR_MAP_DATA_TYPE_UINT32, q.K / 8, Np, Np * 4, kWgKStep / 8, kTN,
                    CU_TENSOR_MAP_SWIZZLE_NONE),
      scales,
      // FP4 has no zero points: the kernel never reads this slot, which repeats the scales' map.
      FMT == TM_FORMAT_U4
          ? tensor_map_2d(Z, CU_TENSOR_MAP_DATA_TYPE_UINT8, groups, Np, Np, 1, kTN, CU_TENSOR_MAP_SWIZZLE_NONE)
          : scales};
  const auto launch = [&](const GemmPlan& pl, u32 n_tile0) {
    with_cluster(pl, [&](auto cluster) {
      launch_wgmma_ws_as<T, FMT, BN, NC, decltype(cluster)::value>(pl, maps, n_tile0, bias, C, ws, counters, stream);
    });
  };
  launch(plan, 0);
  if (plan.tail_n_tiles > 0) launch(wgmma_ws_tail_plan(plan), plan.grid[1]);
}

// Columns [n0, n0 + cols) of B into W[K][ldw].
template <typename T, u32 FMT>
void launch_dequant(const QuantGemmArgs& a, const PaddedWeights& w, u32 n0, u32 cols, u32 ldw, T* W,
                    cudaStream_t stream) {
  const int threads = 256;
  dequant_kernel<T, FMT><<<grid_for(size_t(a.K / 8) * ((cols + 7) / 8), threads), threads, 0, stream>>>(
      u32(a.K), u32(w.B.size(1)), u32(a.group_size), n0, cols, ldw, reinterpret_cast<const u32*>(w.B.data_ptr()),
      reinterpret_cast<const T*>(w.S.data_ptr()), w.Z.defined() ? w.Z.data_ptr<uint8_t>() : nullptr, W);
  check_launch("dequant");
}

// dequant_blas: per column panel (plan_cuda: all of N unless over 1 GiB), dequantize into the
// [K, tile_n] workspace and let cuBLAS (at::mm_out: torch's handle, workspace and current stream)
// multiply into C's columns. C's panel is a row-major view with leading dimension N, which torch passes to
// cuBLAS as is (no copy). Panels run in order on the stream, so one buffer serves them all.
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

template <typename T, u32 FMT>
void launch_fast(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& ws, cudaStream_t stream) {
  const std::string& k = plan.kernel;
  const PaddedWeights w = padded_weights(a);
  if (k.rfind("dequant_blas_", 0) == 0) return launch_dequant_blas<T, FMT>(plan, a, w, C, ws, stream);
  const int64_t Np = w.B.size(1);
  const at::Tensor &B = w.B, &S = w.S, &Z = w.Z;
  const at::Tensor A = aligned16(a.A) ? a.A : a.A.clone();
  const T* pA = reinterpret_cast<const T*>(A.data_ptr());
  const u32* pB = reinterpret_cast<const u32*>(B.data_ptr());
  const T* pS = reinterpret_cast<const T*>(S.data_ptr());
  const uint8_t* pZ = Z.defined() ? Z.data_ptr<uint8_t>() : nullptr;
  const T* pbias = a.bias.defined() ? reinterpret_cast<const T*>(a.bias.data_ptr()) : nullptr;
  T* pC = reinterpret_cast<T*>(C.data_ptr());
  float* pws = ws.defined() ? ws.data_ptr<float>() : nullptr;
  const bool global_reduce = plan.reduce_kernel == "last_block_reduce";
  TORCH_CHECK(!global_reduce || pws != nullptr, "torch_marlin: K-parallel plan without workspace");
  const int gs_shift = (a.group_size & (a.group_size - 1)) == 0 ? __builtin_ctzll(uint64_t(a.group_size)) : -1;
  int* counters = nullptr;
  if (global_reduce) {
    counters = tile_counters(int64_t(plan.params.m_tiles) * plan.params.n_tiles, a.A.device(), stream);
  }

  if (k.rfind("decode_", 0) == 0) {
    const uint32_t nt = plan.params.tile_m / 8u;
    TORCH_CHECK(plan.params.tile_m % 8u == 0 && a.M <= int64_t(plan.params.tile_m) * plan.params.m_tiles &&
                    plan.grid[0] == plan.params.m_tiles && plan.grid[1] == plan.params.n_tiles &&
                    plan.threads[0] == u32(kDecThreads) && plan.params.tile_n == TM_CUDA_DECODE_TILE_N,
                "torch_marlin: bad decode plan");
    const bool fold = a.group_size % 32 == 0;  // a 32-row chunk never straddles two groups
    const u32 np = u32(Np);
    if (nt == 8) launch_decode<T, FMT, 8, false>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (nt == 4) launch_decode<T, FMT, 4, false>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (nt == 2 && fold) launch_decode<T, FMT, 2, true>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (nt == 2) launch_decode<T, FMT, 2, false>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (fold) launch_decode<T, FMT, 1, true>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else launch_decode<T, FMT, 1, false>(plan, np, gs_shift, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
  } else if (k.rfind("wgmma_ws_", 0) == 0) {
    const QuantGemmParams& q = plan.params;
    const u32 nc = q.tile_n / 64u;
    TORCH_CHECK((q.tile_m == 64u || q.tile_m == 128u || q.tile_m == 256u) && q.tile_n % 64u == 0 && nc >= 2u &&
                    nc <= u32(kWsMaxConsumers) && (q.tile_m < 256u || nc == 2u) &&
                    q.K % TM_CUDA_WGMMA_K_STEP == 0 && q.k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 &&
                    q.group_size % TM_CUDA_WGMMA_K_STEP == 0 && plan.grid[0] == q.m_tiles &&
                    plan.grid[1] + plan.tail_n_tiles == q.n_tiles && plan.grid[2] == q.k_parallel &&
                    plan.threads[0] == 128u * (nc + 1u) &&
                    (q.k_parallel == 1 ||
                     (plan.reduce_kernel == "cluster_reduce" && q.k_parallel <= TM_CUDA_WGMMA_MAX_SLICES) ||
                     (global_reduce && plan.tail_n_tiles == 0 &&
                      size_t(ws.numel()) * sizeof(float) >= size_t(q.m_tiles) * q.n_tiles * q.k_parallel *
                                                                 q.tile_m * q.tile_n * sizeof(float))) &&
                    (plan.tail_n_tiles == 0 ||
                     (q.k_parallel == 1 && plan.grid[1] > 0 && plan.tail_k_parallel >= 2u &&
                      plan.tail_k_parallel <= TM_CUDA_WGMMA_MAX_SLICES && plan.tail_k_slice_len > 0 &&
                      plan.tail_k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 &&
                      uint64_t(plan.tail_k_slice_len) * plan.tail_k_parallel >= q.K)),
                "torch_marlin: bad wgmma_ws plan");
    if (q.tile_m == 256u) launch_wgmma_ws<T, FMT, 256, 2>(plan, Np, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (q.tile_m == 128u && nc == 2u) launch_wgmma_ws<T, FMT, 128, 2>(plan, Np, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (q.tile_m == 128u) launch_wgmma_ws<T, FMT, 128, 3>(plan, Np, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else if (nc == 2u) launch_wgmma_ws<T, FMT, 64, 2>(plan, Np, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
    else launch_wgmma_ws<T, FMT, 64, 3>(plan, Np, pA, pB, pS, pZ, pbias, pC, pws, counters, stream);
  } else if (k.rfind("wgmma_", 0) == 0) {
    const QuantGemmParams& q = plan.params;
    const bool wide = q.tile_m == 128u && q.tile_n == TM_CUDA_WGMMA_WIDE_TILE_N;
    TORCH_CHECK((q.tile_m == 128u || q.tile_m == 256u) && (q.tile_n == TM_CUDA_WGMMA_TILE_N || wide) &&
                    q.K % TM_CUDA_WGMMA_K_STEP == 0 && q.k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 &&
                    q.group_size % 32u == 0 && plan.grid[0] == q.m_tiles && plan.grid[1] == q.n_tiles &&
                    plan.grid[2] == q.k_parallel && plan.threads[0] == TM_CUDA_WGMMA_THREADS &&
                    (q.k_parallel == 1 || (plan.reduce_kernel == "cluster_reduce" &&
                                           q.k_parallel <= TM_CUDA_WGMMA_MAX_SLICES)),
                "torch_marlin: bad wgmma plan");
    const u32 np = u32(Np);
    if (wide) launch_wgmma<T, FMT, 128, int(TM_CUDA_WGMMA_WIDE_TILE_N)>(plan, np, pA, pB, pS, pZ, pbias, pC, stream);
    else if (q.tile_m == 128u) launch_wgmma<T, FMT, 128, 128>(plan, np, pA, pB, pS, pZ, pbias, pC, stream);
    else launch_wgmma<T, FMT, 256, 128>(plan, np, pA, pB, pS, pZ, pbias, pC, stream);
  } else {
    TORCH_CHECK(false, "torch_marlin: unknown CUDA kernel tag '", k, "'");
  }
}

template <u32 FMT>
void launch_simt(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, cudaStream_t stream) {
  TORCH_CHECK(plan.kernel.rfind("simt_", 0) == 0, "torch_marlin: fp32 plan has kernel '", plan.kernel, "'");
  const dim3 grid(plan.grid[0], plan.grid[1], 1);
  simt_kernel<FMT><<<grid, plan.threads[0], 0, stream>>>(
      plan.params, a.A.data_ptr<float>(), reinterpret_cast<const u32*>(a.B.data_ptr()), a.scales.data_ptr<float>(),
      FMT == TM_FORMAT_U4 ? a.zeros.data_ptr<uint8_t>() : nullptr,
      a.bias.defined() ? a.bias.data_ptr<float>() : nullptr, C.data_ptr<float>());
  check_launch(plan.kernel.c_str());
}

template <u32 FMT>
void gemm_for_format(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& ws,
                     cudaStream_t stream) {
  switch (a.dtype) {
    case DType::F16: launch_fast<__half, FMT>(plan, a, C, ws, stream); break;
    case DType::BF16: launch_fast<__nv_bfloat16, FMT>(plan, a, C, ws, stream); break;
    case DType::F32: launch_simt<FMT>(plan, a, C, stream); break;
  }
}

template <u32 FMT>
void dequant_for_format(const QuantGemmArgs& a, at::Tensor& W, cudaStream_t stream) {
  const PaddedWeights w = padded_weights(a);
  const u32 n = u32(a.N);
  switch (a.dtype) {
    case DType::F16: launch_dequant<__half, FMT>(a, w, 0, n, n, reinterpret_cast<__half*>(W.data_ptr()), stream); break;
    case DType::BF16:
      launch_dequant<__nv_bfloat16, FMT>(a, w, 0, n, n, reinterpret_cast<__nv_bfloat16*>(W.data_ptr()), stream);
      break;
    case DType::F32: launch_dequant<float, FMT>(a, w, 0, n, n, W.data_ptr<float>(), stream); break;
  }
}

}  // namespace

DeviceCaps cuda_device_caps(int device_index) {
  const int dev = device_index >= 0 ? device_index : int(c10::cuda::current_device());
  // Cached per device: the planner asks on every call.
  static std::mutex mu;
  static std::vector<DeviceCaps> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (int(cache.size()) <= dev) cache.resize(dev + 1);
  if (cache[dev].backend != Backend::CUDA) {
    int sms = 0, smem = 0, major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    // Clusters need an sm_90+ device and kernels from sm_90+ PTX: a build with only compute_80 PTX,
    // JIT-compiled on an H100, has cluster_reduce compiled out. All decode kernels come from this
    // file's one compilation, so one instantiation speaks for them.
    cudaFuncAttributes attr;
    {
      const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(dev)));
      C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, decode_kernel<__half, TM_FORMAT_FP4, 1, true, true>));
    }
    cache[dev].backend = Backend::CUDA;
    cache[dev].compute_units = sms;
    cache[dev].max_shared_memory = smem;
    cache[dev].thread_block_clusters = major >= 9 && attr.ptxVersion >= 90 ? 1 : 0;
    // wgmma needs the sm_90a kernels (setup.py builds them for TORCH_CUDA_ARCH_LIST "9.0a"), which
    // load only on compute capability 9.0; another build or device keeps dequant_blas.
    int minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
#ifdef TM_CUDA_SM90A
    cache[dev].wgmma = major == 9 && minor == 0 && attr.ptxVersion >= 90 ? 1 : 0;
#else
    cache[dev].wgmma = 0;
#endif
  }
  DeviceCaps caps = cache[dev];
  return caps;
}

void quant_gemm_cuda(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace) {
  const c10::cuda::CUDAGuard guard(args.A.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (args.format == QuantFormat::FP4) gemm_for_format<TM_FORMAT_FP4>(plan, args, C, workspace, stream);
  else gemm_for_format<TM_FORMAT_U4>(plan, args, C, workspace, stream);
}

void quant_dequant_cuda(const QuantGemmArgs& args, at::Tensor& W) {
  const c10::cuda::CUDAGuard guard(args.B.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (args.format == QuantFormat::FP4) dequant_for_format<TM_FORMAT_FP4>(args, W, stream);
  else dequant_for_format<TM_FORMAT_U4>(args, W, stream);
}

}  // namespace torch_marlin
