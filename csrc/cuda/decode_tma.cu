// The decode kernel with its weights fed by TMA (sm_90, M <= 16, scaled group sums): the same
// mma.sync work as decode.cu (dequantized weights as the A operand, activations as the n
// dimension, the same fixed-order epilogue), but the packed weights arrive in a shared-memory ring
// of TM_CUDA_DECODE_TMA_STAGES stages of TM_CUDA_DECODE_TMA_STAGE_K rows x 32 columns, each stage
// one 2-D TMA copy. The register ring of decode.cu keeps at most 4..8 16-byte chunks a lane in
// flight and stalls on them (benchmarks/notes/cuda-tuning.md CUDA-DECODE-BOUND); here a block has
// up to TM_CUDA_DECODE_TMA_STAGES - 1 stages (48 KB) in flight while its warps compute, without
// registers.
//  - Stage s covers K rows [k_begin + s * STAGE_K, + STAGE_K) of the block's slice; warp w takes
//    its chunks 4w .. 4w + 3 (128 rows: one run of at most 4 groups, one for group sizes that are
//    multiples of 128).
//  - Thread 0 issues the copies: the first stages at the start, then, after its warp has used
//    stage s, stage s - 1 + STAGES into the slot of stage s - 1 once every warp has released it
//    (the lag keeps thread 0 from waiting on the slowest warp's current stage). Each warp releases
//    a slot by one arrival on the slot's "empty" barrier.
//  - The stage is stored with the 128-byte swizzle: lane (g, t) reads packed row 4j + t of its
//    run, 16-byte chunk g, at chunk g ^ (row & 7), which halves the bank conflicts of 8 lanes
//    reading 4 rows at the same chunk.
//  - Activations for the run's 4 chunks and the next run's scales are loaded before the wait, so
//    their latency hides behind it.
#include "cuda/decode_common.cuh"
#include "cuda/kernels.h"

namespace torch_marlin {
namespace {

constexpr int kTmaWarps = 8;
constexpr int kTmaThreads = kTmaWarps * 32;
constexpr int kTmaStages = int(TM_CUDA_DECODE_TMA_STAGES);
constexpr u32 kTmaStageK = TM_CUDA_DECODE_TMA_STAGE_K;
constexpr u32 kTmaStageRows = kTmaStageK / 8u;               // packed rows (8 k each)
constexpr u32 kTmaStageBytes = kTmaStageRows * 32u * 4u;      // 32 columns of u32
constexpr u32 kTmaRunChunks = kTmaStageK / 32u / kTmaWarps;   // 32-row chunks a warp per stage
static_assert(kTmaRunChunks == 4u, "a warp's run is 4 chunks (128 rows)");
static_assert(kTmaStageRows <= 256u, "a TMA box has at most 256 rows");

template <int NT, bool kCluster>
constexpr int tma_smem_bytes() {
  // 1024 bytes of slack: the ring starts at the first 1024-byte boundary (the swizzle's atom).
  return 1024 + kTmaStages * int(kTmaStageBytes) + dec_smem_bytes<NT, kCluster, kTmaWarps>();
}

template <typename T, u32 FMT, int NT, bool kCluster>
__global__ void __launch_bounds__(kTmaThreads, TM_CUDA_DECODE_WARPS_PER_SM(8u * NT) / kTmaWarps)
    decode_tma_kernel(const __grid_constant__ CUtensorMap tmap_b, QuantGemmParams p, u32 Np, int gs_shift, const T* A,
                      const T* scales, const uint8_t* zeros, const T* bias, T* __restrict__ C, float* __restrict__ ws,
                      int* __restrict__ counters) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T2 = typename Tr<T>::T2;
  static_assert(NT <= 2, "scaled group sums: up to 16 rows");
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) uint64_t full_bar[kTmaStages], empty_bar[kTmaStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 g = u32(lane) >> 2, t = u32(lane) & 3u;
  const u32 m0 = blockIdx.x * (8u * NT), n0 = blockIdx.y * 32u;
  const u32 col = n0 + 4u * g < Np ? n0 + 4u * g : 0u;  // the last tile's columns past Np read column 0
  const u32 slice = blockIdx.z;
  const u32 k_begin = slice * p.k_slice_len, k_end = min(p.K, k_begin + p.k_slice_len);
  const int n_stages = int((k_end - k_begin + kTmaStageK - 1u) / kTmaStageK);
  const u32 c_end = k_end / 32u;  // K % 32 == 0 (planner)
  const u32 gs = p.group_size, num_groups = p.K / gs;
  // Chunks a group: 1 or 2 (group size 32 or 64), else 4 or more (one group a run).
  const u32 run_groups = gs >= 128u ? 1u : 128u / gs;
  const u32 chunk_group_shift = gs >= 128u ? 2u : (gs == 64u ? 1u : 0u);

  const u32 smem_base = smem_u32(smem);
  const u32 ring = (smem_base + 1023u) & ~1023u;
  unsigned char* const ring_ptr = smem + (ring - smem_base);
  unsigned char* const red = ring_ptr + kTmaStages * kTmaStageBytes;
  const u32 full0 = smem_u32(full_bar), empty0 = smem_u32(empty_bar);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kTmaStages; ++i) {
      mbar_init(full0 + 8u * i, 1u);
      mbar_init(empty0 + 8u * i, u32(kTmaWarps));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Launched early behind the previous kernel (PDL): warm L2 with the first stages while it
  // finishes (a prefetch only warms L2, so a weight that kernel writes is still read fresh), then
  // wait for it before any read.
  pdl_launch_dependents();
  if (threadIdx.x == 0)
    for (int s = 0; s < min(n_stages, kTmaStages); ++s)
      tma_prefetch_l2_2d(&tmap_b, n0, (k_begin + u32(s) * kTmaStageK) / 8u);
  pdl_wait();
  __syncthreads();
  auto issue = [&](int s) {
    const u32 slot = u32(s % kTmaStages), bar = full0 + 8u * slot;
    mbar_expect_tx(bar, kTmaStageBytes);
    tma_load_2d(ring + slot * kTmaStageBytes, &tmap_b, n0, (k_begin + u32(s) * kTmaStageK) / 8u, bar);
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < min(n_stages, kTmaStages); ++s) issue(s);

  // The lane's byte offsets in a stage: packed row 16 warp + 4j + t, 16-byte chunk g swizzled by
  // the row's low 3 bits (4 (j & 1) + t).
  const u32 row0 = 16u * u32(warp) + t;
  const u32 off_even = row0 * 128u + ((g ^ t) << 4), off_odd = row0 * 128u + ((g ^ (t + 4u)) << 4);
  const T* arow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) arow[nt] = A + size_t(min(m0 + u32(8 * nt) + g, p.M - 1u)) * p.K + 8u * t;

  float acc[NT][2][4], accg[NT][2][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][jp][c] = accg[nt][jp][c] = 0.f;
  float s4f[4];
  T2 zf[4];
  // The raw scales (and U4 zero points) of the run's groups: this stage's and the next one's.
  uint2 sc[4], sc_next[4];
  u32 zc[4] = {0u, 0u, 0u, 0u}, zc_next[4] = {0u, 0u, 0u, 0u};
  auto fetch_run_scales = [&](int s) {
    const u32 k_run = k_begin + u32(s) * kTmaStageK + 128u * u32(warp);
    const u32 first = gs_shift >= 0 ? k_run >> gs_shift : k_run / gs;
#pragma unroll
    for (u32 q = 0; q < 4u; ++q) {
      if (q < run_groups) {
        const size_t so = size_t(min(first + q, num_groups - 1u)) * Np + col;
        sc_next[q] = ld_dec(reinterpret_cast<const uint2*>(scales + so));
        if constexpr (FMT == TM_FORMAT_U4) zc_next[q] = ld_dec(reinterpret_cast<const u32*>(zeros + so));
      }
    }
  };
  fetch_run_scales(0);

  for (int s = 0; s < n_stages; ++s) {
    const u32 slot = u32(s % kTmaStages);
    const u32 c0 = (k_begin + u32(s) * kTmaStageK) / 32u + kTmaRunChunks * u32(warp);
    const int n_run = c0 < c_end ? int(min(kTmaRunChunks, c_end - c0)) : 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      sc[q] = sc_next[q];
      zc[q] = zc_next[q];
    }
    if (s + 1 < n_stages) fetch_run_scales(s + 1);
    uint4 av[kTmaRunChunks][NT];
#pragma unroll
    for (int j = 0; j < int(kTmaRunChunks); ++j)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        av[j][nt] = j < n_run ? ld_dec(reinterpret_cast<const uint4*>(arow[nt] + size_t(c0 + u32(j)) * 32u))
                              : make_uint4(0u, 0u, 0u, 0u);
    if (n_run > 0) group_scales<T, FMT>(sc[0], zc[0], s4f, zf);
    mbar_wait(full0 + 8u * slot, u32(s / kTmaStages) & 1u);
    const unsigned char* st = ring_ptr + slot * kTmaStageBytes;
#pragma unroll
    for (int j = 0; j < int(kTmaRunChunks); ++j) {
      if (j < n_run) {  // warp-uniform
        const uint4 words = *reinterpret_cast<const uint4*>(st + 512u * u32(j) + ((j & 1) ? off_odd : off_even));
        u32 b[4][4];
        dequant_chunk_unscaled<T, FMT>(b, words, zf);
        chunk_mma<T, NT>(b, av[j], accg);
        // The group ends with the run or before the next chunk: scale its sums, take the next
        // one's scales (group (j + 1) >> chunk_group_shift of the run: j + 1 or (j + 1) / 2).
        const bool last = j + 1 == n_run;
        if (last || (u32(j + 1) >> chunk_group_shift) != (u32(j) >> chunk_group_shift)) {
          flush_group_sums<NT>(acc, accg, s4f);
          if (j + 1 < int(kTmaRunChunks) && !last) {
            const int next = (j + 1) & 3, next_half = ((j + 1) >> 1) & 3;
            group_scales<T, FMT>(chunk_group_shift == 0u ? sc[next] : sc[next_half],
                                 chunk_group_shift == 0u ? zc[next] : zc[next_half], s4f, zf);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8u * slot);
    // Refill the slot of stage s - 1 once every warp has released it.
    if (threadIdx.x == 0 && s >= 1 && s - 1 + kTmaStages < n_stages) {
      mbar_wait(empty0 + 8u * u32((s - 1) % kTmaStages), u32((s - 1) / kTmaStages) & 1u);
      issue(s - 1 + kTmaStages);
    }
  }
  decode_epilogue<T, NT, kTmaWarps, kCluster>(p, acc, red, slice, m0, n0, bias, C, ws, counters);
#else
  __trap();  // planned only where the kernels come from sm_90+ PTX (CudaBackend::caps)
#endif
}

}  // namespace

namespace cuda_backend {
namespace {

template <typename T, u32 FMT, int NT>
void launch_decode_tma_as(const GemmPlan& plan, int gs_shift, const CUtensorMap& tmap, const GemmOperands<T>& o) {
  with_cluster(plan, [&](auto cluster) {
    constexpr bool kCluster = decltype(cluster)::value;
    auto kernel = decode_tma_kernel<T, FMT, NT, kCluster>;
    constexpr int smem = tma_smem_bytes<NT, kCluster>();
    static std::atomic<uint64_t> opted_in{0};
    opt_in_smem(kernel, smem, opted_in);
    launch_tile_kernel<kCluster>(plan, kernel, kTmaThreads, smem, o.stream, tmap, plan.params, o.Np, gs_shift, o.A,
                                 o.scales, o.zeros, o.bias, o.C, o.ws, o.counters);
  });
}

}  // namespace

// NT = desc.tile_m / 8 (1 or 2), kCluster = (desc.reduce == ReduceKind::Cluster).
template <typename T, uint32_t FMT>
void launch_decode_tma(const GemmPlan& plan, const GemmOperands<T>& o) {
  const KernelDesc& d = plan.desc;
  const QuantGemmParams& q = plan.params;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TORCH_CHECK((d.tile_m == 8u || d.tile_m == 16u) && d.tile_m == q.tile_m && q.tile_n == TM_CUDA_DECODE_TILE_N &&
                  d.scale_group_sums && FMT != TM_FORMAT_AFFINE && q.K % 32u == 0 && q.group_size % 32u == 0 &&
                  (q.group_size <= 64u || q.group_size % 128u == 0) && q.k_slice_len % 128u == 0 &&
                  main.threads[0] == u32(kTmaThreads) && main.grid[0] == q.m_tiles && main.grid[1] == q.n_tiles &&
                  main.grid[2] == q.k_parallel,
              "torch_marlin: bad decode_tma plan");
  const int gs_shift = (q.group_size & (q.group_size - 1u)) == 0 ? __builtin_ctzll(uint64_t(q.group_size)) : -1;
  const CUtensorMap tmap = tensor_map_2d(o.B, CU_TENSOR_MAP_DATA_TYPE_UINT32, int64_t(q.K) / 8, int64_t(o.Np),
                                         int64_t(o.Np) * 4, int(kTmaStageRows), 32, CU_TENSOR_MAP_SWIZZLE_128B);
  if constexpr (FMT == TM_FORMAT_AFFINE) {
    TORCH_CHECK(false, "torch_marlin: decode_tma takes fp4 and u4 only");
  } else if (d.tile_m == 16u) {
    launch_decode_tma_as<T, FMT, 2>(plan, gs_shift, tmap, o);
  } else {
    launch_decode_tma_as<T, FMT, 1>(plan, gs_shift, tmap, o);
  }
}

TM_CUDA_INSTANTIATE_ENTRY(launch_decode_tma)

}  // namespace cuda_backend
}  // namespace torch_marlin
