// The wgmma kernel (sm_90a): fused dequant into Hopper warpgroup MMAs for the group sizes wgmma_ws
// does not take (group_size % 64 != 0), 64 < M <= 512 with >= 64 output tiles or long K
// (benchmarks/notes/cuda-tuning.md CUDA-WGMMA-BAND). Two warpgroups over a 128 x 256, 128 x 128 or 256 x 128
// (rows x columns) tile: each stage's weight tile is dequantized once into shared memory (natural
// k order) and both operands feed wgmma.m64n{128,256}k16 from there; activations by TMA,
// weights/scales by cp.async; up to 4 K slices summed through a thread-block cluster.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

// The kernel's helpers are referenced only from its body, which compiles for sm_90a alone
// (__CUDA_ARCH_FEAT_SM90_ALL); nvcc's other passes would warn they are unused.
#pragma nv_diag_suppress 177

namespace torch_marlin {
namespace {

// A block of 2 warpgroups (256 threads) computes a BM x TN output tile (BM = 128 or 256 rows of
// activations, TN = 128 weight columns, or 256 with BM = 128), one block per SM. Per 64-k stage:
//  - every thread dequantizes 4 packed words (one column x 32 k; two columns for TN = 256) of the
//    stage's TN x 64 weight tile into shared memory, in natural k order, as wgmma's B operand
//    (K-major: a dequantized word is exactly one 16-byte core-matrix row). The tile is dequantized
//    once and read by both warpgroups, so the dequant cost per multiply-add halves against a
//    warpgroup dequantizing its own register fragments (which measured issue-bound at 0.51x
//    cuBLAS for M = 1024);
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
  static constexpr int kZ = kWgThreads * 4 * kCols;       // 4 zero points (its column quad) or 2 offsets
                                                          // (its column pair) a thread
  static constexpr int kStage = kA + kW + kS + kZ;  // kA % 1024 == 0: TMA 128-byte swizzle atoms
  static constexpr int kBytes = kWgStages * kStage + kWgBBufs * kB + 1024;  // + alignment slack
  static_assert(kStage % 1024 == 0 && kBytes <= 227 * 1024, "stage alignment / shared-memory limit");
};

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

// One packed word (8 k of one column) -> 8 values in natural k order (16 bytes): FP4 by table
// lookup (fp4_natural), U4 and affine by magic numbers (int4_natural).
template <typename T, u32 FMT>
__device__ __forceinline__ uint4 dequant_word_natural(u32 w, const ColQ<T>& q) {
  if constexpr (FMT == TM_FORMAT_FP4) {
    using T2 = typename Tr<T>::T2;
    u32 h[4];
    fp4_natural<T>(w, h);
    return make_uint4(as_u32(__hmul2(as_t2<T2>(h[0]), q.s2)), as_u32(__hmul2(as_t2<T2>(h[1]), q.s2)),
                      as_u32(__hmul2(as_t2<T2>(h[2]), q.s2)), as_u32(__hmul2(as_t2<T2>(h[3]), q.s2)));
  } else {
    return int4_natural<T, FMT>(w, q);
  }
}

// kCluster (ReduceKind::Cluster): the K slices of a tile run as one thread-block
// cluster and sum their partial tiles through distributed shared memory (the epilogue below).
template <typename T, u32 FMT, int BM, int TN, bool kCluster>
__global__ void __launch_bounds__(kWgThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap tmap_a, QuantGemmParams p, u32 Np, const u32* __restrict__ B,
                 const T* __restrict__ scales, const uint8_t* __restrict__ zeros, const T* __restrict__ offsets,
                 const T* __restrict__ bias, T* __restrict__ C) {
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
  // U4: the 4 zero points of the thread's column quad; affine: the 2 offsets of its column pair
  // (4 bytes either way: the stage's kZ slot).
  const uint8_t* z_src[kCols];
  const size_t z_row_bytes = FMT == TM_FORMAT_AFFINE ? size_t(Np) * sizeof(T) : size_t(Np);
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    b_src[i] = B + size_t(k_begin / 8u + 4u * h_w) * Np + col_w[i];
    s_src[i] = scales + g_off + (col_w[i] & ~1u);
    z_src[i] = FMT == TM_FORMAT_U4        ? zeros + g_off + (col_w[i] & ~3u)
               : FMT == TM_FORMAT_AFFINE ? reinterpret_cast<const uint8_t*>(offsets + g_off + (col_w[i] & ~1u))
                                         : nullptr;
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
        if constexpr (FMT != TM_FORMAT_FP4)
          cp_async4(slot + u32(L::kA + L::kW + L::kS) + u32(i * kWgThreads + tid) * 4u, z_src[i]);
      }
      k_in_group += u32(kWgKStep);  // the next stage's 32 k: 0, 1 or 2 groups on
      while (k_in_group >= p.group_size) {
        k_in_group -= p.group_size;
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
          s_src[i] += Np;
          if constexpr (FMT != TM_FORMAT_FP4) z_src[i] += z_row_bytes;
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
      } else if constexpr (FMT == TM_FORMAT_AFFINE) {
        const u32 op = *reinterpret_cast<const u32*>(slot + L::kA + L::kW + L::kS + ti * 4);
        q.z2 = Tr<T>::dup(t_from_bits<T>((unsigned short)(op >> (16u * (col_w[i] & 1u)))));
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
  __trap();  // planned only where the loaded kernels are sm_90a (CudaBackend::caps)
#endif
}

}  // namespace

#pragma nv_diag_default 177

namespace cuda_backend {
namespace {

template <typename T, u32 FMT, int BM, int TN, bool kCluster>
void launch_wgmma_as(const GemmPlan& plan, const CUtensorMap& tmap, const GemmOperands<T>& o) {
  constexpr int kSmem = WgSmem<BM, TN>::kBytes;
  auto* kernel = wgmma_kernel<T, FMT, BM, TN, kCluster>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_smem(kernel, kSmem, opted_in);
  launch_tile_kernel<kCluster>(plan, kernel, kWgThreads, kSmem, o.stream, tmap, plan.params, o.Np, o.B, o.scales,
                               o.zeros, o.offsets, o.bias, o.C);
}

template <typename T, u32 FMT, int BM, int TN>
void launch_wgmma_tile(const GemmPlan& plan, const GemmOperands<T>& o) {
  const CUtensorMap tmap = activation_tensor_map<T>(o.A, plan.params.M, plan.params.K, BM);
  with_cluster(plan, [&](auto cluster) { launch_wgmma_as<T, FMT, BM, TN, decltype(cluster)::value>(plan, tmap, o); });
}

}  // namespace

// BM = desc.tile_m activation rows, TN = desc.tile_n weight columns, kCluster = (desc.reduce ==
// ReduceKind::Cluster).
template <typename T, uint32_t FMT>
void launch_wgmma(const GemmPlan& plan, const GemmOperands<T>& o) {
  const KernelDesc& d = plan.desc;
  const QuantGemmParams& q = plan.params;
  const bool wide = d.tile_m == 128u && d.tile_n == TM_CUDA_WGMMA_WIDE_TILE_N;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TORCH_CHECK((d.tile_m == 128u || d.tile_m == 256u) && (d.tile_n == TM_CUDA_WGMMA_TILE_N || wide) &&
                  d.tile_m == q.tile_m && d.tile_n == q.tile_n && q.K % TM_CUDA_WGMMA_K_STEP == 0 &&
                  q.k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 && q.group_size % 32u == 0 && main.grid[0] == q.m_tiles &&
                  main.grid[1] == q.n_tiles && main.grid[2] == q.k_parallel &&
                  main.threads[0] == TM_CUDA_WGMMA_THREADS &&
                  (q.k_parallel == 1 || (d.reduce == ReduceKind::Cluster && q.k_parallel <= TM_CUDA_WGMMA_MAX_SLICES)),
              "torch_marlin: bad wgmma plan");
  if (wide) launch_wgmma_tile<T, FMT, 128, int(TM_CUDA_WGMMA_WIDE_TILE_N)>(plan, o);
  else if (d.tile_m == 128u) launch_wgmma_tile<T, FMT, 128, 128>(plan, o);
  else launch_wgmma_tile<T, FMT, 256, 128>(plan, o);
}

TM_CUDA_INSTANTIATE_ENTRY(launch_wgmma)

}  // namespace cuda_backend
}  // namespace torch_marlin
