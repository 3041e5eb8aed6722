// The trellis prefill GEMM on sm_90a (fp16 / bf16 activations, indices in the CUDA lane layout):
// the indices are decoded straight into wgmma's register A operand, as the wgmma_ws kernel does
// with FP4 / INT4 codes, so no dense weight is ever written.
//
// C^T = W^T A^T. A block is one producer warpgroup and two consumer warpgroups over a 128-column
// (8 tile columns) x BN-row output tile, one block per SM. K runs in stages of one lane-chunk row
// (8 tile rows, 128 k) through a ring in shared memory:
//  - One producer thread issues the stage's activations (two TMA boxes of BN rows x 64 k, 128-byte
//    swizzle: wgmma's canonical K-major layout) and the block's 8 lane chunks (one contiguous run,
//    one bulk copy); every producer thread copies its column's fp32 group scales of the stage's 8
//    tile rows (cp.async), which arrive on the slot's "full" barrier as they land.
//  - Consumer warp w of warpgroup wg owns tile column 4 wg + w. The lane layout was made for the
//    mma A fragment, which is also wgmma's per warp: field p of tile row j of lane (g, t) is
//    register p of k16 step j (columns 2g / 2g + 1 = A rows g / g + 8; tile rows 4t, 4t+1 /
//    4t+2, 4t+3 = logical k 2t, 2t+1 / 2t+8, 2t+9). The lane's two columns' codebooks times their
//    group scales sit in registers as byte planes, rebuilt when the scale group changes, so two
//    registers cost a few byte permutes.
//  - wgmma reads B from shared memory in logical k order, so the call first rewrites the
//    activations once (trellis_wgmma_act_kernel): times su, rounded to T once, each run of 16 k
//    permuted into the fields' k order, K padded with zeros to whole chunks.
// The consumers decode half a stage (64 k) into one of two register fragment sets while the other
// half's wgmmas run, and release a slot once both its halves' wgmmas retired. sv multiplies each
// output once. Roundings: codebook value x group scale to T once, activation x su to T once.
#include <atomic>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

#include <cudaTypedefs.h>

// The kernel's helpers are referenced only from its body, which compiles for sm_90a alone.
#pragma nv_diag_suppress 177

namespace torch_marlin {
namespace {

using cuda_backend::TrellisKernelArgs;

constexpr u32 kChunkTiles = TM_TRELLIS_LANE_CHUNK_TILES;
constexpr u32 kStageK = kChunkTiles * TM_TRELLIS_TILE;                // 128 k a stage
constexpr u32 kColTiles = TM_TRELLIS_CUDA_TILE_N / TM_TRELLIS_TILE;   // 8 tile columns a block
constexpr u32 kConsumers = TM_TRELLIS_CUDA_WGMMA_THREADS - 128u;      // two consumer warpgroups
static_assert(kConsumers == 256u && kColTiles == 8u, "two consumer warpgroups, a warp per tile column");
static_assert(kStageK == 2u * u32(TM_CUDA_WGMMA_K_STEP), "a stage is two 64-k activation boxes");
// Registers of the producer after setmaxnreg, and of the consumers (the 64 K registers of an SM
// over 384 threads at launch, 168; the producer's share goes to the consumers).
constexpr u32 kProducerRegs = 40;
constexpr u32 kLaunchRegs = 65536u / TM_TRELLIS_CUDA_WGMMA_THREADS / 8u * 8u;
constexpr u32 kConsumerRegs = kLaunchRegs + (kLaunchRegs - kProducerRegs) / 2u / 8u * 8u;
static_assert(kLaunchRegs == 168u && kConsumerRegs == 232u, "register budgets");

template <typename T, u32 BITS, int BN>
struct WgmmaLayout {
  static constexpr u32 kChunkBytes = kChunkTiles * 32u * BITS;  // one lane chunk (8 tiles)
  static constexpr u32 kLaneBytes = kChunkBytes / 32u;
  static constexpr u32 kABox = u32(BN) * 128u;                   // BN rows x 64 k of T
  static constexpr u32 kA = 2u * kABox;
  static constexpr u32 kW = kColTiles * kChunkBytes;
  static constexpr u32 kS = kChunkTiles * TM_TRELLIS_CUDA_TILE_N * 4u;  // fp32 scales of 8 tile rows
  static constexpr u32 kGridBytes = TM_TRELLIS_MAX_LEVELS * 4u;  // the codebook, fp32
  // The ring's slots: activation boxes (1024-byte multiples: swizzle atoms stay aligned) from the
  // aligned base, then the chunks and scales of every slot, then the codebook; as many slots as
  // the 227 KiB of a block hold after the codebook, the alignment and the static barriers, at most 4.
  static constexpr u32 kWS = kW + kS;
  static constexpr u32 kBudget = 227u * 1024u - 1024u - 128u - kGridBytes;
  static constexpr u32 kStages = kBudget / (kA + kWS) < 4u ? kBudget / (kA + kWS) : 4u;
  static_assert(kStages >= 2u && kA % 1024u == 0u && kWS % 16u == 0u, "a double-buffered ring, aligned boxes");
  static constexpr u32 kWOffset = kStages * kA;
  static constexpr u32 kGridOffset = kWOffset + kStages * kWS;
  static constexpr u32 kBytes = kGridOffset + kGridBytes + 1024u;
};

// One column's codebook times its group scale, each value rounded to T once, as byte planes for
// byte permutes: lo[w] / hi[w] hold the low / high bytes of values 4w .. 4w + 3. In registers, so
// a weight costs no shared-memory lookup (a table lookup per register, beside wgmma's reads of the
// activations, left the decode latency-bound).
template <u32 BITS>
struct Planes {
  static constexpr u32 kWords = (1u << BITS) / 4u;
  u32 lo[kWords], hi[kWords];
};

template <typename T, u32 BITS>
__device__ __forceinline__ void build_planes(Planes<BITS>& pl, const float* grid, float s) {
  using T2 = typename Tr<T>::T2;
#pragma unroll
  for (u32 w = 0; w < Planes<BITS>::kWords; ++w) {
    T2 a, b;
    a.x = Tr<T>::from_f(grid[4 * w] * s);
    a.y = Tr<T>::from_f(grid[4 * w + 1] * s);
    b.x = Tr<T>::from_f(grid[4 * w + 2] * s);
    b.y = Tr<T>::from_f(grid[4 * w + 3] * s);
    pl.lo[w] = prmt(as_u32(a), as_u32(b), 0x6420);
    pl.hi[w] = prmt(as_u32(a), as_u32(b), 0x7531);
  }
}

// The byte-permute selector of column e's two registers in a tile row's lane bits x: its fields e
// and e + 2 (docs/trellis.md, "CUDA lane layout"), i.e. indices a, b (register e) and c, d
// (register e + 2), as nibbles 0..3.
template <u32 BITS>
__device__ __forceinline__ u32 column_selector(u32 x, u32 e) {
  const u32 y = x >> (2u * BITS * e);
  if constexpr (BITS == 2) return (y & 0x303u) | ((y & 0xC0Cu) << 2);   // a 0, b 2, c 8, d 10
  else if constexpr (BITS == 3)
    return (y & 0x7u) | ((y & 0x38u) << 1) | ((y >> 4) & 0x700u) | ((y >> 3) & 0x7000u);  // 0, 3, 12, 15
  else return (y & 0xFFu) | ((y >> 8) & 0xFF00u);                          // 0, 4, 16, 20
}

// The values of the selector's 4 indices as registers (a, b) and (c, d). prmt reads 8 bytes with
// 3-bit selectors (the 4th bit would replicate a sign), so 16 levels take two lookups and a third
// permute that picks by each index's top bit.
template <u32 BITS>
__device__ __forceinline__ void lookup4(const Planes<BITS>& pl, u32 sel, u32& ab, u32& cd) {
  u32 lo, hi;
  if constexpr (BITS == 2) {
    lo = prmt(pl.lo[0], 0u, sel);
    hi = prmt(pl.hi[0], 0u, sel);
  } else if constexpr (BITS == 3) {
    lo = prmt(pl.lo[0], pl.lo[1], sel);
    hi = prmt(pl.hi[0], pl.hi[1], sel);
  } else {
    const u32 s7 = sel & 0x7777u, pick = 0x3210u | ((sel >> 1) & 0x4444u);
    lo = prmt(prmt(pl.lo[0], pl.lo[1], s7), prmt(pl.lo[2], pl.lo[3], s7), pick);
    hi = prmt(prmt(pl.hi[0], pl.hi[1], s7), prmt(pl.hi[2], pl.hi[3], s7), pick);
  }
  ab = prmt(lo, hi, 0x5140);
  cd = prmt(lo, hi, 0x7362);
}

// Ap[m][16 r + l] = A[m][16 r + phys(l)] x su, rounded to T once; zero past K. Logical
// l = 2q + e takes tile row 4q + e for q < 4 and 4(q - 4) + 2 + e above: the k order of the lane
// layout's fields. One thread per run of 16 k.
template <typename T>
__global__ void trellis_wgmma_act_kernel(const T* __restrict__ A, const float* __restrict__ su, T* __restrict__ Ap,
                                         u32 M, u32 K, u32 Kp) {
  using T2 = typename Tr<T>::T2;
  const u32 runs = Kp / 16u;
  const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= uint64_t(M) * runs) return;
  const u32 m = u32(i / runs), k0 = u32(i % runs) * 16u;
  const T* src = A + uint64_t(m) * K + k0;
  float x[16];
  if (k0 + 16u <= K && K % 8u == 0u) {  // two aligned 16-byte loads (the launcher checks A's alignment)
    const uint4 q0 = *reinterpret_cast<const uint4*>(src), q1 = *reinterpret_cast<const uint4*>(src + 8);
    const u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    float s[16];
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {  // su is 16-byte aligned (the op's contiguous_aligned) and k0 % 16 == 0
      const float4 v = *reinterpret_cast<const float4*>(su + k0 + 4 * j);
      s[4 * j] = v.x, s[4 * j + 1] = v.y, s[4 * j + 2] = v.z, s[4 * j + 3] = v.w;
    }
#pragma unroll
    for (u32 j = 0; j < 8; ++j) {
      const T2 v = as_t2<T2>(w[j]);
      x[2 * j] = Tr<T>::to_f(v.x) * s[2 * j];
      x[2 * j + 1] = Tr<T>::to_f(v.y) * s[2 * j + 1];
    }
  } else {
#pragma unroll
    for (u32 j = 0; j < 16; ++j) x[j] = k0 + j < K ? Tr<T>::to_f(src[j]) * su[k0 + j] : 0.f;
  }
  u32 o[8];
#pragma unroll
  for (u32 q = 0; q < 8; ++q) {
    const u32 phys = q < 4u ? 4u * q : 4u * (q - 4u) + 2u;
    T2 v;
    v.x = Tr<T>::from_f(x[phys]);
    v.y = Tr<T>::from_f(x[phys + 1u]);
    o[q] = as_u32(v);
  }
  uint4* dst = reinterpret_cast<uint4*>(Ap + uint64_t(m) * Kp + k0);
  dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
  dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

template <typename T, u32 BITS, int BN>
__global__ void __launch_bounds__(TM_TRELLIS_CUDA_WGMMA_THREADS, 1)
    trellis_wgmma_kernel(const __grid_constant__ CUtensorMap tmap_a, const TrellisKernelArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaLayout<T, BITS, BN>;
  constexpr u32 kS = L::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u;
  const u32 m0 = blockIdx.x * u32(BN), tn0 = blockIdx.y * kColTiles, n0 = tn0 * TM_TRELLIS_TILE;
  const u32 block_tiles = min(kColTiles, a.tiles_n - tn0);
  const u32 n_stages = (a.tiles_k + kChunkTiles - 1u) / kChunkTiles;
  const u32 smem_raw = smem_u32(smem);
  const u32 align_pad = (1024u - (smem_raw & 1023u)) & 1023u;
  unsigned char* const sm = smem + align_pad;
  const u32 smem_base = smem_raw + align_pad;
  __shared__ __align__(8) uint64_t full_bar[kS], empty_bar[kS];
  const u32 full_base = smem_u32(full_bar), empty_base = smem_u32(empty_bar);
  const cuda_backend::TrellisMatrixPtrs& w = a.w[0];
  if (tid == 0) {
    for (u32 i = 0; i < kS; ++i) {
      mbar_init(full_base + 8u * i, 1u + 128u);      // the copy thread's expect_tx + every producer thread
      mbar_init(empty_base + 8u * i, kConsumers / 32u);  // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  float* const grid_s = reinterpret_cast<float*>(sm + L::kGridOffset);
  if (tid < (1u << BITS)) grid_s[tid] = w.grid[tid];
  __syncthreads();

  if (tid >= kConsumers) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    // Producer thread c (0..127) stages column n0 + c's scales; thread 0 also issues the copies.
    const u32 c = tid - kConsumers, col = n0 + c;
    const bool col_in = col < a.N;
    const uint8_t* chunks = w.packed + uint64_t(tn0) * L::kChunkBytes;
    const uint64_t chunk_row = uint64_t(a.tiles_n) * L::kChunkBytes;
    const u32 w_bytes = block_tiles * L::kChunkBytes;
    for (u32 s = 0; s < n_stages; ++s) {
      const u32 slot = s % kS;
      if (s >= kS) mbar_wait(empty_base + 8u * slot, ((s / kS) - 1u) & 1u);
      const u32 dst = smem_base + slot * L::kA;
      const u32 bar = full_base + 8u * slot;
      if (c == 0) {
        mbar_expect_tx(bar, L::kA + w_bytes);
        tma_load_2d(dst, &tmap_a, s * kStageK, m0, bar);
        tma_load_2d(dst + L::kABox, &tmap_a, s * kStageK + u32(TM_CUDA_WGMMA_K_STEP), m0, bar);
        bulk_load(smem_base + L::kWOffset + slot * L::kWS, chunks + s * chunk_row, w_bytes, bar);
      }
      // The scales by cp.async (zero past N), which arrive on the barrier once they land: the
      // producer never waits for a global load (waiting here cost a load latency per stage).
      const u32 ss = smem_base + L::kWOffset + slot * L::kWS + L::kW + c * 4u;
#pragma unroll
      for (u32 j = 0; j < kChunkTiles; ++j) {
        const u32 gi = min((s * kStageK + j * TM_TRELLIS_TILE) / a.group_size, a.n_groups - 1u);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ss + j * TM_TRELLIS_CUDA_TILE_N * 4u),
                     "l"(w.scales + (col_in ? uint64_t(gi) * a.N + col : 0u)), "r"(col_in ? 4u : 0u)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const u32 g = lane / 4u, tc = warp;  // warp w of warpgroup wg: tile column 4 wg + w = warp
    const u32 col = tc * TM_TRELLIS_TILE + 2u * g;  // the lane's columns col, col + 1 of the block
    const u32 lane_off = tc * L::kChunkBytes + lane * L::kLaneBytes;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    u32 frag[2][4][4];
    u32 lv[2 * BITS];  // the lane's words of the current stage's chunk
    Planes<BITS> planes[2];  // columns col, col + 1 at the current scale group
    const u32 tiles_per_group = a.group_size / TM_TRELLIS_TILE;
    u32 next_group_row = 0;  // the first tile row of the next scale group
    const u32 n_halves = 2u * n_stages;
    // Decodes half h (tile rows 4 (h % 2) .. + 3 of stage h / 2) into fr; the first half of a
    // stage waits for it and reads the lane's chunk words.
    auto load_half = [&](u32 h, u32 (&fr)[4][4]) {
      const u32 s = h / 2u, slot = s % kS;
      const unsigned char* st = sm + L::kWOffset + slot * L::kWS;
      if (h % 2u == 0u) {
        mbar_wait(full_base + 8u * slot, (s / kS) & 1u);
        load_lane_words<BITS>(st + lane_off, lv);
      }
      const float* ss = reinterpret_cast<const float*>(st + L::kW) + col;
#pragma unroll
      for (u32 ks = 0; ks < 4; ++ks) {
        const u32 j = 4u * (h % 2u) + ks;
        if (s * kChunkTiles + j == next_group_row) {  // a new scale group (uniform)
          const float2 sp = *reinterpret_cast<const float2*>(ss + j * TM_TRELLIS_CUDA_TILE_N);
          build_planes<T, BITS>(planes[0], grid_s, sp.x);
          build_planes<T, BITS>(planes[1], grid_s, sp.y);
          next_group_row += tiles_per_group;
        }
        const u32 x = lane_tile_bits<BITS>(lv, j);
        // Register p: column col + (p & 1), tile rows 4t + 2 (p >> 1) and the next.
        lookup4<BITS>(planes[0], column_selector<BITS>(x, 0u), fr[ks][0], fr[ks][2]);
        lookup4<BITS>(planes[1], column_selector<BITS>(x, 1u), fr[ks][1], fr[ks][3]);
      }
    };
    // SW128 K-major B descriptor of slot 0's first box; half h's box is kABox bytes into its
    // slot's, and k16 step ks starts 32 ks bytes into the 128-byte rows.
    const uint64_t desc0 = wg_desc(smem_base, 16u, 1024u) | (uint64_t(1) << 62);
    auto issue_half = [&](u32 h, const u32 (&fr)[4][4]) {
      const uint64_t ds = desc0 + ((((h / 2u) % kS) * L::kA + (h % 2u) * L::kABox) >> 4);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
      wg_fence();
#pragma unroll
      for (u32 ks = 0; ks < 4; ++ks) wgmma_rs<T, BN>(acc, fr[ks], ds + ((32u * ks) >> 4));
      wg_commit();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
    };
    // Half h runs on fragment set h % 2; set (h + 1) % 2 was read by half h - 1, retired by the
    // wait below before it is overwritten. A slot is free once its second half retired.
    auto step = [&](u32 h, u32 (&cur)[4][4], u32 (&next)[4][4]) {
      issue_half(h, cur);
      wg_wait<1>();
      if (h > 0u && h % 2u == 0u && lane == 0u) mbar_arrive(empty_base + 8u * (((h - 1u) / 2u) % kS));
      if (h + 1u < n_halves) load_half(h + 1u, next);
    };
    if (n_halves > 0u) load_half(0u, frag[0]);
    for (u32 h = 0; h < n_halves; h += 2u) {
      step(h, frag[0], frag[1]);
      step(h + 1u, frag[1], frag[0]);  // n_halves is even
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);

    // acc[4 j + 2 e + f]: column n0 + col + e, activation row m0 + 8 j + 2 t + f.
    const u32 t = lane % 4u, c = n0 + col;
    if (tc >= block_tiles || c >= a.N) return;
    const bool pair = c + 1u < a.N;
    const float sv0 = w.sv[c], sv1 = pair ? w.sv[c + 1u] : 0.f;
    T* C = static_cast<T*>(a.out[0]);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (u32 f = 0; f < 2; ++f) {
        const u32 row = m0 + u32(8 * j) + 2u * t + f;
        if (row >= a.M) continue;
        store_c_pair<T>(C + uint64_t(row) * a.ldc + c, acc[4 * j + f] * sv0, acc[4 * j + 2 + f] * sv1, pair, a.ldc);
      }
  }
#else
  __trap();  // planned only where the loaded kernels are sm_90a (caps wgmma)
#endif
}

}  // namespace

#pragma nv_diag_default 177

namespace cuda_backend {
namespace {

template <typename T, u32 BITS, int BN>
void launch_tile(const KernelLaunch& l, const TrellisKernelArgs& a, const T* Ap, u32 Kp, cudaStream_t stream) {
  using L = WgmmaLayout<T, BITS, BN>;
  static std::atomic<uint64_t> opted_in{0};
  auto kernel = trellis_wgmma_kernel<T, BITS, BN>;
  check_launch_registers(kernel, int(kLaunchRegs), "trellis wgmma kernel", opted_in);
  opt_in_smem(kernel, int(L::kBytes), opted_in);
  const CUtensorMap tmap = activation_tensor_map<T>(Ap, a.M, Kp, BN);
  launch_kernel(kernel, dim3(l.grid[0], l.grid[1], l.grid[2]), dim3(l.threads[0]), L::kBytes, stream,
                l.dependent_launch, l.kernel.c_str(), tmap, a);
}

}  // namespace

template <typename T>
void launch_trellis_wgmma(const KernelLaunch& act, const KernelLaunch& l, uint32_t bits, uint32_t tile_m,
                          const TrellisKernelArgs& a, T* Ap, cudaStream_t stream) {
  const u32 Kp = trellis_lane_padded_k(a.tiles_k);
  TORCH_CHECK(l.threads[0] == TM_TRELLIS_CUDA_WGMMA_THREADS && (tile_m == 128u || tile_m == 256u) &&
                  l.grid[0] == (a.M + tile_m - 1u) / tile_m &&
                  l.grid[1] == (a.tiles_n + kColTiles - 1u) / kColTiles && l.grid[2] == 1u && a.k_parallel == 1u &&
                  act.threads[0] > 0u && uint64_t(act.grid[0]) * act.threads[0] >= uint64_t(a.M) * (Kp / 16u) &&
                  reinterpret_cast<uintptr_t>(a.A) % 16u == 0u && reinterpret_cast<uintptr_t>(Ap) % 16u == 0u &&
                  reinterpret_cast<uintptr_t>(a.w[0].packed) % 16u == 0u,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the wgmma kernel's geometry");
  launch_kernel(trellis_wgmma_act_kernel<T>, dim3(act.grid[0]), dim3(act.threads[0]), 0, stream, false,
                act.kernel.c_str(), static_cast<const T*>(a.A), a.w[0].su, Ap, a.M, a.K, Kp);
  with_trellis_bits(bits, [&](auto b) {
    if (tile_m == 256u) launch_tile<T, b.value, 256>(l, a, Ap, Kp, stream);
    else launch_tile<T, b.value, 128>(l, a, Ap, Kp, stream);
  });
}

template void launch_trellis_wgmma<__half>(const KernelLaunch&, const KernelLaunch&, uint32_t, uint32_t,
                                           const TrellisKernelArgs&, __half*, cudaStream_t);
template void launch_trellis_wgmma<__nv_bfloat16>(const KernelLaunch&, const KernelLaunch&, uint32_t, uint32_t,
                                                  const TrellisKernelArgs&, __nv_bfloat16*, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
