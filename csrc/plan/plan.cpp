#include "plan/plan.h"

#include <algorithm>
#include <stdexcept>

namespace torch_marlin {

const char* variant_name(GemmVariant v) {
  switch (v) {
    case GemmVariant::Auto: return "auto";
    case GemmVariant::Decode: return "decode";
    case GemmVariant::Tiled: return "tiled";
    case GemmVariant::TiledStaged: return "tiled_staged";
    case GemmVariant::Striped: return "striped";
    case GemmVariant::DequantBlas: return "dequant_blas";
    case GemmVariant::WarpSpecialized: return "warp_specialized";
  }
  return "?";
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::CPU: return "cpu";
    case Backend::Metal: return "metal";
    case Backend::CUDA: return "cuda";
  }
  return "?";
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "half";
    case DType::BF16: return "bfloat";
    case DType::F32: return "float";
  }
  return "?";
}

const char* format_name(QuantFormat f) { return f == QuantFormat::FP4 ? "fp4" : "u4"; }

DeviceCaps default_metal_caps() {
  DeviceCaps caps;
  caps.backend = Backend::Metal;
  caps.compute_units = 8;
  caps.max_shared_memory = 32768;
  return caps;
}

namespace {

// plan_cuda: one decode tile of 8, 16, 32 or 64 rows up to 64, then 64-row tiles (a grid dimension)
// up to 128: two 64-row passes beat dequant + cuBLAS at M = 96..128 on all five issue shapes
// (0.54..0.81x against 0.42..0.57x of cuBLAS, H100), at 160..192 only on some.
constexpr int64_t kCudaDecodeMaxM = 128;
// Largest dequantized panel plan_cuda's DequantBlas makes (the op's transient workspace).
// One panel of all of N measured fastest (H100, 28672 x 8192 at M = 4096: 2783 us whole against
// 3133 us in two 4096-column panels); the cap bounds the workspace of layers past ~500M weights.
constexpr int64_t kCudaPanelMaxBytes = int64_t(1) << 30;

// Most rows the decode kernels of a backend handle.
int64_t decode_kernel_max_m(Backend b) { return b == Backend::CUDA ? kCudaDecodeMaxM : kDecodeMaxM; }

// Rows up to which the policy picks decode, measured per backend (docs/benchmarks.md):
//  - CUDA: its decode kernel streams the weights once per 64 rows (kCudaDecodeMaxM); fp32
//    activations have no tensor-core path: 16;
//  - CPU: decode re-decodes the weights per 4-row chunk and is compute bound; from 9 rows on the
//    dequantize-chunk + BLAS path is faster (4096x4096: 6.3 ms decode vs ~6 ms tiled at M = 8,
//    13 ms vs 9 ms at M = 16);
//  - Metal: the seed's M <= 16 (no hardware to measure on).
int64_t decode_policy_max_m(Backend b, DType d) {
  switch (b) {
    case Backend::CUDA: return d == DType::F32 ? kDecodeMaxM : kCudaDecodeMaxM;
    case Backend::CPU: return 8;
    case Backend::Metal: return kDecodeMaxM;
  }
  return kDecodeMaxM;
}

uint32_t ceil_div(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// How a CUDA tile kernel splits K: slices of at least min_slice rows, at most max_slices of them,
// each slice one kernel iteration multiple (k_step).
struct CudaSliceRule {
  int64_t min_slice, max_slices;
  uint32_t k_step;
};
// Decode: a slice is whole rounds of the 8 warps' 32-row chunks.
constexpr CudaSliceRule kCudaDecodeSlices{1024, 16, 32 * TM_CUDA_DECODE_WARPS};
constexpr CudaSliceRule kCudaWgmmaSlices{8 * TM_CUDA_WGMMA_K_STEP, TM_CUDA_WGMMA_MAX_SLICES, TM_CUDA_WGMMA_K_STEP};
// wgmma_ws: at most 4 slices, 3 or 4 through global memory (cuda_wgmma_ws_geometry_for), at most 3
// through a cluster (cuda_wgmma_ws_slices).
constexpr CudaSliceRule kCudaWgmmaWsSlices{8 * TM_CUDA_WGMMA_K_STEP, 4, TM_CUDA_WGMMA_K_STEP};
constexpr CudaSliceRule kCudaWgmmaWsClusterSlices{8 * TM_CUDA_WGMMA_K_STEP, 3, TM_CUDA_WGMMA_K_STEP};
// K slices for `tiles` output tiles: as many as keep the resident block slots (`slots`) full in
// one wave, never a second wave, within the rule's bounds.
int64_t cuda_tile_slices(int64_t tiles, int64_t K, int64_t slots, const CudaSliceRule& rule) {
  const int64_t by_slots = std::max<int64_t>(1, slots / std::max<int64_t>(1, tiles));
  const int64_t by_k = std::max<int64_t>(1, K / rule.min_slice);
  return std::min<int64_t>({by_slots, by_k, rule.max_slices});
}

// CUDA wgmma kernel (sm_90a) policy, measured on an H100 over the five issue shapes (FP4, fp16;
// docs/cuda.md "The wgmma kernel", docs/cuda-tuning.md CUDA-WGMMA-BAND): it beats the decode
// kernel above 64 rows and dequant + cuBLAS up to 512 rows when
//  - the output has at least 64 tiles (N >= 8192, or 2 row tiles of a 4096-column layer), or
//  - K >= 8192: fewer tiles run 4 K slices through a cluster, and a long slice (>= 2048 k) pays
//    for the cluster reduction (10752 x 4096 at M = 96 / 128: 56.2 / 57.3 us against decode's
//    62.2 at 128; at M = 192 / 256: 97 / 98 against dequant + cuBLAS's 116 / 105; 4096 x 4096,
//    slices of 1024: 47.5 / 48.5 against 42.0 / 45.5 at M = 192 / 256, a tie with decode at 128);
// and above 256 rows (256-row tiles) when the tiles fit in one wave or their last wave is at
// least 80 % full (4096 x 21504 at M = 384 / 512, 3 waves 85 % full: 191 / 200 us against
// 203 / 241; 4096 x 12288, 2 waves 73 % full: 130 / 136 against 127 / 137). From 768 rows on,
// dequant + cuBLAS wins on most shapes (1024 rows: 0.65..0.70x against 0.69..0.71x).
constexpr int64_t kCudaWgmmaMinM = 64;          // exclusive: decode below
constexpr int64_t kCudaWgmmaMaxM = 512;
constexpr int64_t kCudaWgmmaMinTiles = 64;
constexpr int64_t kCudaWgmmaLongK = 8192;       // 4 slices of >= 2048 k
// Shapes the wgmma kernel takes: whole 64-row K stages, a thread's 32 k under one scale.
bool cuda_wgmma_shape_ok(int64_t K, int64_t group_size) {
  return K % TM_CUDA_WGMMA_K_STEP == 0 && group_size % 32 == 0;
}
// Its row tile: one m64 wgmma per warpgroup up to 128 rows, two above.
uint32_t cuda_wgmma_tile_m(int64_t M) { return M <= 128 ? 128 : 256; }
// Its column tile: with 128-row tiles, 256 columns (twice the weights a stage between the same
// waits and barriers) unless half as many tiles would need more K slices than 128-column ones.
// Measured at M = 64..128 (docs/cuda-tuning.md CUDA-WGMMA-WIDE): 4096 x 21504
// (84 tiles, 1 slice either way) 78.6..83.1 us against 91.6..95.6; 4096 x 4096 and 10752 x 4096
// (4 slices either way) 17..21 % faster; 28672 x 8192, where 32 wide tiles need 4 slices instead
// of 2 (32 clusters of 4 blocks, more than one wave of them), 256..259 us against 159..162.
uint32_t cuda_wgmma_tile_n(int64_t M, int64_t K, int64_t N, int64_t slots) {
  if (M > 128) return TM_CUDA_WGMMA_TILE_N;
  const auto slices = [&](int64_t tile_n) {
    return cuda_tile_slices((N + tile_n - 1) / tile_n, K, slots, kCudaWgmmaSlices);
  };
  return slices(TM_CUDA_WGMMA_WIDE_TILE_N) <= slices(TM_CUDA_WGMMA_TILE_N) ? TM_CUDA_WGMMA_WIDE_TILE_N
                                                                           : TM_CUDA_WGMMA_TILE_N;
}
// ---- wgmma_ws (warp-specialized, sm_90a) policy and geometry ---------------------------------------
// Measured on an H100 over the five issue shapes (FP4, fp16, every kernel forced in one process:
// docs/cuda-tuning.md WS-MIN-M): it beats every other kernel from 33 rows on, on every shape, up to
// the largest M measured (4096; 4096 x 21504 there within 2 % of dequant + cuBLAS): e.g. at
// M = 64 1.19x..2.03x of cuBLAS against decode's 0.92x..1.35x, at M = 1024 0.89x..1.08x against
// dequant + cuBLAS's 0.69x..0.75x (exp_policy_sweep.txt). At 17..32 rows it depends on the shape
// (cuda_wgmma_ws_pays).
constexpr int64_t kCudaWgmmaWsMinM = 32;  // exclusive: always wgmma_ws above
// Whole 64-k stages under one scale row.
bool cuda_wgmma_ws_shape_ok(int64_t K, int64_t group_size) {
  return K % TM_CUDA_WGMMA_K_STEP == 0 && group_size % TM_CUDA_WGMMA_K_STEP == 0;
}
// Activation rows of a tile: the wgmma n dimension.
uint32_t cuda_wgmma_ws_tile_m(int64_t M) { return M <= 64 ? 64 : (M <= 128 ? 128 : 256); }
// K slices summed through a cluster (the tail launch): fill the SMs (at most 3), but 3-block
// clusters only where they take at most 3/4 of the SMs: a cluster's blocks must share a GPC, and
// on the H100 32 clusters of 4 (4096 x 4096, M = 64: 20.5 us of kernel time against 13.5 with 3
// slices) and 43 clusters of 3 (28672 x 8192 with 192-column tiles: 171 us against 103 for 64 x 2)
// did not fit in one wave (docs/cuda-tuning.md WS-CLUSTER-SLICES).
int64_t cuda_wgmma_ws_slices(int64_t tiles, int64_t K, int64_t slots) {
  const int64_t kp = cuda_tile_slices(tiles, K, slots, kCudaWgmmaWsClusterSlices);
  return kp >= 3 && tiles * kp * 4 > slots * 3 ? 2 : kp;
}
// The main grid's K slices. 64- and 128-row tiles: fill the SMs with up to 4; 1 or 2 are summed
// through a cluster, 3 or 4 by the last block of each tile through global memory (no GPC
// constraint). 256-row tiles keep the cluster rule: their 128 KB partial tiles make the global sum
// cost more than a fourth slice saves. Measured on the H100 (FP4, fp16, flushed;
// docs/cuda-tuning.md WS-GLOBAL-SLICES):
//  - 32 column tiles of 4096 x 4096 / 10752 x 4096 at M = 64: 4 slices 16.1 / 25.4 us against 3
//    through clusters 17.3 / 29.7 (3 through global memory 17.7 / 29.3); 10752 x 4096 at M = 128
//    32.0 against 36.7;
//  - 28672 x 8192 at M = 48..128: 43 tiles of 192 columns x 3 slices (129 blocks) 81.6..106.7 us
//    against 64 x 2 through clusters 93.3..120.4 (43 clusters of 3 would not fit in one wave);
//  - 2 slices through global memory against a cluster: 4096 x 12288 at M = 64..128 26.3..34.2
//    against 26.0..31.7;
//  - 256-row tiles, 4096 x 4096 at M = 192 / 256: 4 slices 29.0 / 29.4 against 3 through clusters
//    27.0 / 27.4 (10752 x 4096: 44.1 / 46.0 against 48.3 / 47.8).
constexpr int64_t kCudaWgmmaWsMaxClusterSlices = 2;
// The wgmma_ws launch geometry: consumer warpgroups (64 weight columns each), K slices, and the
// column tiles split off into a second launch (GemmPlan::tail_n_tiles).
struct WsGeometry {
  uint32_t consumers;
  int64_t tiles, k_parallel, tail_cols, tail_k_parallel;
  int64_t cost;  // stage-waves, a 2-consumer stage = 100
  bool global_reduce = false;  // K slices summed by last_block_reduce instead of a cluster
};
// The tail: where the tiles take more than one wave and the last is partial (4096 x 21504 at
// M = 1024: 672 tiles = 5 full waves + 12 tiles), the whole waves run as one launch and the last
// wave's tiles as a second one with K slices (12 tiles x 3 slices: a third of a tile's stages
// instead of all of them). A second launch costs about kCudaWgmmaWsTailLaunchStages stages. Only
// up to kCudaWgmmaWsTailMaxWaves whole waves: over more the blocks drift apart and the last wave
// is no longer a step. Measured on the H100 (FP4, fp16; docs/cuda-tuning.md WS-TAIL):
// 4096 x 21504 at M = 256 / 1024 / 2048 (1 / 5 / 10 waves): 86.1 / 265.5 / 506.0 us against
// 94.4 / 275.6 / 511.2; 4096 x 12288 at M = 512: 83.8 against 91.6; but at M = 4096 (20 waves)
// 1036 against 1015.
constexpr int64_t kCudaWgmmaWsTailLaunchStages = 4;
constexpr int64_t kCudaWgmmaWsTailMaxWaves = 10;
WsGeometry cuda_wgmma_ws_geometry_for(int64_t M, int64_t K, int64_t N, int64_t slots, uint32_t consumers) {
  const int64_t m = (M + cuda_wgmma_ws_tile_m(M) - 1) / cuda_wgmma_ws_tile_m(M);
  const int64_t n = (N + 64 * consumers - 1) / (64 * consumers);
  const int64_t tiles = m * n;
  const auto waves = [&](int64_t blocks) { return (blocks + slots - 1) / slots; };
  const auto stages = [&](int64_t kp) { return (K / kp + TM_CUDA_WGMMA_K_STEP - 1) / TM_CUDA_WGMMA_K_STEP; };
  const bool global = cuda_wgmma_ws_tile_m(M) <= 128;  // may sum 3..4 slices through global memory
  const int64_t kp =
      global ? cuda_tile_slices(tiles, K, slots, kCudaWgmmaWsSlices) : cuda_wgmma_ws_slices(tiles, K, slots);
  WsGeometry g{consumers, tiles, kp, 0, 1, waves(tiles * kp) * stages(kp), global && kp > kCudaWgmmaWsMaxClusterSlices};
  const int64_t main_cols = (tiles / slots) * slots / m;  // column tiles of the whole waves
  if (kp == 1 && tiles % slots != 0 && main_cols > 0 && tiles / slots <= kCudaWgmmaWsTailMaxWaves) {
    const int64_t tail_tiles = m * (n - main_cols);
    const int64_t tail_kp = cuda_wgmma_ws_slices(tail_tiles, K, slots);
    const int64_t cost = waves(m * main_cols) * stages(1) + waves(tail_tiles * tail_kp) * stages(tail_kp) +
                         kCudaWgmmaWsTailLaunchStages;
    if (tail_kp > 1 && cost < g.cost) g = {consumers, tiles, 1, n - main_cols, tail_kp, cost, false};
  }
  g.cost *= consumers == 3 ? 137 : 100;
  return g;
}
// Consumers: 3 where the 192-column grid runs in fewer stage-waves, counting a 3-consumer stage
// as 1.37 2-consumer ones (4096 x 21504 at M = 64: 168 tiles in 2 waves of 64 stages, 58.5 us,
// against 112 tiles in 1 wave, 39.9 us; docs/cuda-tuning.md WS-CONSUMERS). 256-row
// tiles have registers for 2 only.
WsGeometry cuda_wgmma_ws_geometry(int64_t M, int64_t K, int64_t N, int64_t slots) {
  const WsGeometry two = cuda_wgmma_ws_geometry_for(M, K, N, slots, 2);
  if (cuda_wgmma_ws_tile_m(M) == 256) return two;
  const WsGeometry three = cuda_wgmma_ws_geometry_for(M, K, N, slots, 3);
  return three.cost < two.cost ? three : two;
}

// From 17 rows (decode's 32-row kernel, 176 instructions a 32 x 32 chunk) wgmma_ws with 64-row
// tiles wins where its blocks fill at least half the SMs with at most 2 K slices and K is short
// (decode's warps then stream short runs): 4096 x 12288 / 4096 x 21504 at M = 17..32 25.7..25.9 / 36.3..36.6
// us against decode's 33.7..34.3 / 46.9..48.8; decode stays faster on 4096 x 4096 (3 slices:
// 15.4..15.7 against 16.7), 10752 x 4096 (24.6..25.4 against 29.6) and 28672 x 8192 (85.8..88.8
// against 92.4..94.0; docs/cuda-tuning.md WS-SMALL-M). At M <= 16 decode wins
// or ties on every shape.
constexpr int64_t kCudaWgmmaWsSmallMMaxK = 8192;
bool cuda_wgmma_ws_pays(int64_t M, int64_t K, int64_t N, int64_t group_size, const DeviceCaps& caps) {
  if (!caps.wgmma || !cuda_wgmma_ws_shape_ok(K, group_size) || M <= kDecodeMaxM) return false;
  if (M > kCudaWgmmaWsMinM) return true;
  const int64_t slots = std::max(1, caps.compute_units);
  const WsGeometry g = cuda_wgmma_ws_geometry(M, K, N, slots);
  return K <= kCudaWgmmaWsSmallMMaxK && g.k_parallel <= 2 && g.tiles * g.k_parallel * 2 >= slots;
}

bool cuda_wgmma_pays(int64_t M, int64_t K, int64_t N, int64_t group_size, const DeviceCaps& caps) {
  if (!caps.wgmma || !cuda_wgmma_shape_ok(K, group_size)) return false;
  if (M <= kCudaWgmmaMinM || M > kCudaWgmmaMaxM) return false;
  const int64_t tile_m = cuda_wgmma_tile_m(M);
  const int64_t tiles = ((M + tile_m - 1) / tile_m) * ((N + TM_CUDA_WGMMA_TILE_N - 1) / TM_CUDA_WGMMA_TILE_N);
  if (tiles < kCudaWgmmaMinTiles && K < kCudaWgmmaLongK) return false;
  const int64_t sms = std::max<int64_t>(1, caps.compute_units);
  const int64_t waves = (tiles + sms - 1) / sms;
  return M <= 256 || waves == 1 || tiles * 5 >= waves * sms * 4;
}

void set_tiles(GemmPlan& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n) {
  p.params.tile_m = tile_m;
  p.params.tile_n = tile_n;
  p.params.m_tiles = ceil_div(M, tile_m);
  p.params.n_tiles = ceil_div(N, tile_n);
}

// K slices: k_slice_len is a multiple of `k_step` so a slice never splits a kernel iteration.
void set_k_slices(QuantGemmParams& q, int64_t K, uint32_t k_parallel, uint32_t k_step) {
  const uint32_t k_steps = ceil_div(K, k_step);
  k_parallel = std::max<uint32_t>(1, std::min(k_parallel, k_steps));
  const uint32_t steps_per_slice = ceil_div(k_steps, k_parallel);
  q.k_slice_len = steps_per_slice * k_step;
  // Recompute so no slice is empty (e.g. 10 steps / 4 slices -> 3,3,3,1 not 3,3,3,3).
  q.k_parallel = ceil_div(K, q.k_slice_len);
}
void set_k_parallel(GemmPlan& p, int64_t K, uint32_t k_parallel, uint32_t k_step) {
  set_k_slices(p.params, K, k_parallel, k_step);
}

// slice_floats: the fp32 partials one K slice leaves, M x N unless the kernel keeps whole tiles.
void set_reduction(GemmPlan& p, const char* reduce_kernel, uint32_t threads, size_t slice_floats) {
  const QuantGemmParams& q = p.params;
  if (q.k_parallel <= 1) return;
  p.workspace_bytes = size_t(q.k_parallel) * slice_floats * sizeof(float);
  p.reduce_kernel = reduce_kernel;
  p.reduce_threads[0] = threads;
  p.reduce_grid[0] = ceil_div(int64_t(q.M) * q.N, threads);
}

// K slices that fill the machine when the output alone has too few tiles to do so (seed
// stripe_partitioning.md §3.1): only when K is long enough that each slice still has work.
uint32_t k_split_for(int64_t tiles, int64_t K, uint32_t k_step, int compute_units, int waves,
                     uint32_t min_steps_per_slice) {
  const int64_t want = int64_t(compute_units) * waves;
  if (tiles >= want) return 1;
  const int64_t k_steps = (K + k_step - 1) / k_step;
  const int64_t by_units = (want + tiles - 1) / tiles;
  const int64_t by_k = k_steps / min_steps_per_slice;
  return uint32_t(std::max<int64_t>(1, std::min<int64_t>({by_units, by_k, 16})));
}

std::string metal_name(const char* stem, QuantFormat f, DType d) {
  return std::string(stem) + "_" + format_name(f) + "_" + dtype_name(d);
}

// ---- Metal (and the Metal-on-CPU harness) --------------------------------------------------
// Kernels in metal/quant_gemm.metal; names are <stem>_<format>_<dtype>.
void plan_metal(GemmPlan& p, QuantFormat f, int64_t M, int64_t K, int64_t N, DType d,
                const DeviceCaps& caps) {
  constexpr uint32_t kTile = 64, kTileK = 32, kThreads = 128;
  switch (p.variant) {
    case GemmVariant::Decode: {
      // 4 simdgroups x 32 lanes; a lane owns one output column for all M <= 16 rows, the four
      // simdgroups split the threadgroup's K range and meet in threadgroup memory.
      constexpr uint32_t kDecodeTileN = 32, kDecodeKStep = 32;
      set_tiles(p, M, N, uint32_t(kDecodeMaxM), kDecodeTileN);
      set_k_parallel(p, K, k_split_for(p.params.n_tiles, K, kDecodeKStep, caps.compute_units, 4, 8),
                     kDecodeKStep);
      p.kernel = metal_name("marlin_gemv", f, d);
      p.grid[0] = p.params.n_tiles;
      p.grid[1] = p.params.k_parallel;
      p.threads[0] = kThreads;
      break;
    }
    case GemmVariant::Tiled:
    case GemmVariant::TiledStaged: {
      set_tiles(p, M, N, kTile, kTile);
      set_k_parallel(p, K, 1, kTileK);
      p.kernel = metal_name(p.variant == GemmVariant::Tiled ? "marlin_gemm_fused" : "marlin_gemm", f, d);
      p.grid[0] = p.params.n_tiles;
      p.grid[1] = p.params.m_tiles;
      p.threads[0] = kThreads;
      break;
    }
    case GemmVariant::Striped: {
      set_tiles(p, M, N, kTile, kTile);
      const int64_t tiles = int64_t(p.params.m_tiles) * p.params.n_tiles;
      set_k_parallel(p, K, k_split_for(tiles, K, kTileK, caps.compute_units, 2, 4), kTileK);
      const int64_t work = tiles * p.params.k_parallel;
      // Seed §4.3: a fixed number of threadgroups that each walk a contiguous stripe of work.
      const int64_t target = int64_t(caps.compute_units) * (M * N > (1 << 20) ? 4 : 2);
      p.params.num_groups = uint32_t(std::max<int64_t>(1, std::min(work, target)));
      p.kernel = metal_name("marlin_gemm_striped", f, d);
      p.grid[0] = p.params.num_groups;
      p.threads[0] = kThreads;
      break;
    }
    case GemmVariant::Auto: break;
  }
  set_reduction(p, (std::string("marlin_reduce_partials_") + dtype_name(d)).c_str(), 256, size_t(M) * N);
  // The kernels index with 32-bit uints (cheaper on Apple GPUs); see docs/limitations.md.
  if (uint64_t(M) * uint64_t(K) > UINT32_MAX || uint64_t(K / TM_PACK_FACTOR) * uint64_t(N) > UINT32_MAX ||
      uint64_t(M) * uint64_t(N) * p.params.k_parallel > UINT32_MAX) {
    throw std::invalid_argument(
        "plan_quant_gemm: the Metal kernels need M*K, K/8*N and k_parallel*M*N below 2^32; split the call");
  }
}

// ---- CUDA -----------------------------------------------------------------------------------
// Kernels in csrc/cuda/quant_gemm.cu; `kernel` is a tag the launcher switches on (docs/cuda.md).
//  - fp32 activations: "simt_<fmt>_float", a plain CUDA-core kernel (8 rows x 128 columns per block).
//  - Decode (M <= 128, or up to 16..32 rows where wgmma_ws applies): "decode_<fmt>_<dtype>", mma.sync
//    m16n8k16 with the weights as the A operand and M padded to 8/16/32/64 as the n dimension
//    (64-row tiles above 64); a block is 8 warps over 32 columns; each warp streams a contiguous
//    run of 32-row K chunks and the 8 meet in shared memory; grid = (row tiles, column tiles,
//    K slices), the K slices' fp32 partials summed in slice order by the last block of each tile
//    inside the same kernel.
//  - Warp-specialized, sm_90a only (cuda_wgmma_ws_pays: M > 32, some shapes M > 16; group_size % 64 == 0):
//    "wgmma_ws_<fmt>_<dtype>", a TMA producer warpgroup and 2 or 3 consumer warpgroups over
//    64 x 128/192 .. 256 x 128 (activation rows x weight columns) tiles, the weights dequantized
//    into wgmma's register A operand; up to 4 K slices (2, or 3 of 256-row tiles, through a
//    cluster; 3..4 through global memory); a partial last wave of tiles as a second launch in K
//    slices (GemmPlan::tail_n_tiles).
//  - Tiled, sm_90a only (cuda_wgmma_pays; group sizes wgmma_ws does not take):
//    "wgmma_<fmt>_<dtype>", 2 warpgroups over 128 x 256, 128 x 128 or 256 x 128 (rows x columns)
//    tiles; each stage's weight tile is dequantized once into shared memory and both operands
//    feed wgmma from there (activations by TMA); grid = (row tiles, column tiles, K slices), up
//    to 4 slices summed through a thread-block cluster.
//  - Larger M: "dequant_blas_<fmt>_<dtype>": the dequant kernel writes column panels of B into
//    the workspace and cuBLAS (at::mm_out) multiplies each into C's columns.
// The CUDA tile kernels' grid = (row tiles, column tiles, K slices), row tiles fastest so they
// share each column tile's weights in L2.
void set_cuda_tile_grid(GemmPlan& p, int64_t K, int64_t k_parallel, uint32_t k_step) {
  set_k_parallel(p, K, uint32_t(k_parallel), k_step);
  p.grid[0] = p.params.m_tiles;
  p.grid[1] = p.params.n_tiles;
  p.grid[2] = p.params.k_parallel;
}
int64_t cuda_tiles(const GemmPlan& p) { return int64_t(p.params.m_tiles) * p.params.n_tiles; }

// A forced wgmma variant needs the sm_90a kernels and a shape they take.
void require_wgmma(const DeviceCaps& caps, bool shape_ok, const char* kernel, const char* group_multiple) {
  if (!caps.wgmma) {
    throw std::invalid_argument(std::string("plan_quant_gemm: the CUDA ") + kernel +
                                " kernel needs an sm_90a build on a compute capability 9.0 device");
  }
  if (!shape_ok) {
    throw std::invalid_argument(std::string("plan_quant_gemm: the CUDA ") + kernel +
                                " kernel needs K % 64 == 0 and group_size % " + group_multiple + " == 0");
  }
}

void plan_cuda(GemmPlan& p, QuantFormat f, int64_t M, int64_t K, int64_t N, DType d,
               const DeviceCaps& caps) {
  std::string stem;
  bool cluster_slices = false;  // K slices summed through a thread-block cluster (below)
  size_t slice_floats = size_t(M) * N;  // otherwise: the fp32 partials a slice leaves in the workspace
  if (d == DType::F32) {
    constexpr uint32_t kRows = 8, kCols = 128;
    p.variant = GemmVariant::Tiled;
    set_tiles(p, M, N, kRows, kCols);
    set_k_parallel(p, K, 1, TM_PACK_FACTOR);
    p.grid[0] = p.params.n_tiles;
    p.grid[1] = p.params.m_tiles;
    p.threads[0] = kCols;
    stem = "simt";
  } else if (p.variant == GemmVariant::Decode) {
    // K slices are whole multiples of one 32-row chunk per warp. The kernel is memory-bound and
    // its blocks all run in one wave: as many K slices as keep the resident block slots full
    // (2 blocks per SM, 1 for 64 rows: decode_kernel's __launch_bounds__), never a second wave,
    // and slices of at least 1024 rows (N past the slots' columns gets a second wave, unsplit).
    // M is padded to 8, 16, 32 or 64 rows (1, 2, 4 or 8 n8 mma tiles: the activations are the
    // mma's n dimension); above 64 rows, 64-row tiles along grid.x (each streams the weights once
    // more, mostly from L2). Geometry from quant_gemm_params.h (shared with the kernel): 8 warps
    // over 32 columns.
    const uint32_t tile_m = M <= 8 ? 8 : (M <= 16 ? 16 : (M <= 32 ? 32 : 64));
    const int64_t blocks_per_sm = TM_CUDA_DECODE_BLOCKS_PER_SM(tile_m);
    set_tiles(p, M, N, tile_m, TM_CUDA_DECODE_TILE_N);
    set_cuda_tile_grid(p, K,
                       cuda_tile_slices(cuda_tiles(p), K, int64_t(caps.compute_units) * blocks_per_sm, kCudaDecodeSlices),
                       kCudaDecodeSlices.k_step);
    p.threads[0] = 32 * TM_CUDA_DECODE_WARPS;
    stem = "decode";
    cluster_slices = caps.thread_block_clusters && p.params.k_parallel <= TM_CUDA_DECODE_MAX_CLUSTER_SLICES;
    // PDL needs sm_90 and kernels from sm_90 PTX: the devices that run clusters.
    p.dependent_launch = caps.thread_block_clusters != 0;
  } else if (p.variant == GemmVariant::Tiled) {
    // wgmma (sm_90a): 2 warpgroups over 128 or 256 columns x 128 or 256 rows, 1 block per SM. K slices
    // (of at least 8 stages) only when the tiles leave SMs idle, as for decode.
    require_wgmma(caps, cuda_wgmma_shape_ok(K, p.params.group_size), "tiled (wgmma)", "32");
    set_tiles(p, M, N, cuda_wgmma_tile_m(M), cuda_wgmma_tile_n(M, K, N, caps.compute_units));
    set_cuda_tile_grid(p, K, cuda_tile_slices(cuda_tiles(p), K, caps.compute_units, kCudaWgmmaSlices),
                       kCudaWgmmaSlices.k_step);
    p.threads[0] = TM_CUDA_WGMMA_THREADS;
    stem = "wgmma";
    cluster_slices = true;
  } else if (p.variant == GemmVariant::WarpSpecialized) {
    // wgmma_ws (sm_90a): 64 x consumers weight columns x 64/128/256 activation rows a block, 1 block
    // per SM; K slices and the tail launch by cuda_wgmma_ws_geometry.
    require_wgmma(caps, cuda_wgmma_ws_shape_ok(K, p.params.group_size), "warp_specialized (wgmma_ws)", "64");
    const WsGeometry g = cuda_wgmma_ws_geometry(M, K, N, std::max(1, caps.compute_units));
    set_tiles(p, M, N, cuda_wgmma_ws_tile_m(M), 64 * g.consumers);
    set_cuda_tile_grid(p, K, g.k_parallel, kCudaWgmmaWsSlices.k_step);
    if (g.tail_cols > 0) {
      QuantGemmParams tail = p.params;
      set_k_slices(tail, K, uint32_t(g.tail_k_parallel), kCudaWgmmaWsSlices.k_step);
      p.grid[1] -= uint32_t(g.tail_cols);
      p.tail_n_tiles = uint32_t(g.tail_cols);
      p.tail_k_parallel = tail.k_parallel;
      p.tail_k_slice_len = tail.k_slice_len;
    }
    p.threads[0] = 128 * (g.consumers + 1);
    stem = "wgmma_ws";
    cluster_slices = !g.global_reduce;
    p.dependent_launch = true;  // sm_90a only (require_wgmma)
    // Its partials stay in fragment order, whole tiles (quant_gemm.cu).
    slice_floats = size_t(p.params.m_tiles) * p.params.n_tiles * p.params.tile_m * p.params.tile_n;
  } else if (p.variant == GemmVariant::DequantBlas) {
    // Column panels of B are dequantized into a [K, tile_n] workspace in the activation dtype and
    // cuBLAS multiplies A by each into C's columns. One panel holds all of N unless that exceeds
    // kCudaPanelMaxBytes; then N is split evenly in whole 128-column cuBLAS tiles. (L2-sized
    // panels were measured slower: narrow GEMMs cost cuBLAS more than the DRAM round trip of the
    // dequantized weights, docs/cuda.md.)
    const int64_t Np = (N + 15) / 16 * 16;  // the dequant kernel's padded column count
    const int64_t widest = std::max<int64_t>(128, kCudaPanelMaxBytes / (K * 2) / 128 * 128);
    const int64_t panels = (Np + widest - 1) / widest;
    const int64_t width = panels == 1 ? Np : ((Np + panels - 1) / panels + 127) / 128 * 128;
    set_tiles(p, M, N, uint32_t(M), uint32_t(width));
    set_k_parallel(p, K, 1, TM_PACK_FACTOR);
    p.workspace_bytes = size_t(K) * p.params.tile_n * 2;  // fp16/bf16 panel, not fp32 partials
    // grid/threads stay {1,1,1}: each panel is one dequant launch (sized by its own column count)
    // and one cuBLAS GEMM, neither a grid this plan describes.
    stem = "dequant_blas";
  } else {
    throw std::invalid_argument(std::string("plan_quant_gemm: CUDA has no '") + variant_name(p.variant) +
                                "' kernel (decode, dequant_blas, or fp32 activations)");
  }
  p.kernel = stem + "_" + format_name(f) + "_" + dtype_name(d);
  // K slices are summed inside the GEMM kernel (no second dispatch; reduce_grid/threads unused):
  // wgmma slices (at most TM_CUDA_WGMMA_MAX_SLICES), wgmma_ws's cluster slices and up to
  // TM_CUDA_DECODE_MAX_CLUSTER_SLICES decode slices by a thread-block cluster through
  // distributed shared memory where the device and build have clusters (no workspace), otherwise
  // by the last block of each tile to finish, from an fp32 workspace [k_parallel][slice_floats].
  if (p.params.k_parallel > 1 && cluster_slices) {
    p.reduce_kernel = "cluster_reduce";
  } else {
    set_reduction(p, "last_block_reduce", 256, slice_floats);
  }
}

// ---- CPU ------------------------------------------------------------------------------------
// Decode: tasks over column blocks, every packed word read once for all rows. Tiled: tasks over
// column panels; each task dequantizes its [K, tile_n] panel once into an fp32 buffer and
// multiplies every row of A against it.
void plan_cpu(GemmPlan& p, int64_t M, int64_t K, int64_t N, int compute_units) {
  if (p.variant == GemmVariant::Decode) {
    // Wide column tiles read 1 KB of each packed row per visit (rows are N words apart, so a
    // narrow tile is latency bound on a new page per row); narrow ones when N is too small to
    // give every thread two tiles.
    const uint32_t tile_n = N >= int64_t(256) * 2 * std::max(1, compute_units) ? 256 : 64;
    set_tiles(p, M, N, uint32_t(kDecodeMaxM), tile_n);
  } else {
    p.variant = GemmVariant::Tiled;
    set_tiles(p, M, N, uint32_t(std::max<int64_t>(M, 1)), 128);
  }
  set_k_parallel(p, K, 1, TM_PACK_FACTOR);
  p.kernel = std::string("cpu_") + variant_name(p.variant);
  p.grid[0] = p.params.n_tiles;
}

}  // namespace

GemmPlan plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                         DType dtype, bool has_bias, const DeviceCaps& caps, GemmVariant force) {
  if (M < 0 || K <= 0 || N <= 0 || group_size <= 0 || K % TM_PACK_FACTOR != 0 ||
      group_size % TM_PACK_FACTOR != 0 || K % group_size != 0 || M > UINT32_MAX || K > UINT32_MAX ||
      N > UINT32_MAX) {
    throw std::invalid_argument("plan_quant_gemm: invalid shape (op-level checks should have caught this)");
  }
  GemmPlan p;
  p.params.M = uint32_t(M);
  p.params.K = uint32_t(K);
  p.params.N = uint32_t(N);
  p.params.group_size = uint32_t(group_size);
  p.params.has_bias = has_bias ? 1u : 0u;
  p.params.k_parallel = 1;

  if (force != GemmVariant::Auto) {
    p.variant = force;
  } else if (caps.backend == Backend::CUDA && dtype != DType::F32 && cuda_wgmma_ws_pays(M, K, N, group_size, caps)) {
    p.variant = GemmVariant::WarpSpecialized;
  } else if (caps.backend == Backend::CUDA && dtype != DType::F32 && cuda_wgmma_pays(M, K, N, group_size, caps)) {
    p.variant = GemmVariant::Tiled;
  } else if (M <= decode_policy_max_m(caps.backend, dtype)) {
    p.variant = GemmVariant::Decode;
  } else if (caps.backend == Backend::Metal) {
    // Stripes + K-parallel only pay when the output alone cannot fill the GPU.
    const int64_t tiles = int64_t((M + 63) / 64) * ((N + 63) / 64);
    p.variant = (tiles < caps.compute_units * 2 && K / 32 >= 16) ? GemmVariant::Striped : GemmVariant::Tiled;
  } else if (caps.backend == Backend::CUDA && dtype != DType::F32) {
    p.variant = GemmVariant::DequantBlas;
  } else {
    p.variant = GemmVariant::Tiled;
  }
  if (p.variant == GemmVariant::WarpSpecialized && (caps.backend != Backend::CUDA || dtype == DType::F32)) {
    throw std::invalid_argument("plan_quant_gemm: the warp_specialized variant is CUDA fp16/bf16 only");
  }
  if (p.variant == GemmVariant::DequantBlas && (caps.backend != Backend::CUDA || dtype == DType::F32)) {
    throw std::invalid_argument("plan_quant_gemm: the dequant_blas variant is CUDA fp16/bf16 only");
  }
  if (p.variant == GemmVariant::Decode && M > decode_kernel_max_m(caps.backend)) {
    throw std::invalid_argument("plan_quant_gemm: the decode variant handles M <= 16 only (128 on CUDA)");
  }

  switch (caps.backend) {
    case Backend::Metal: plan_metal(p, format, M, K, N, dtype, caps); break;
    case Backend::CUDA: plan_cuda(p, format, M, K, N, dtype, caps); break;
    case Backend::CPU: plan_cpu(p, M, K, N, caps.compute_units); break;
  }
  return p;
}

GemmPlan plan_quant_dequant_metal(QuantFormat format, int64_t K, int64_t N, int64_t group_size, DType dtype) {
  if (K <= 0 || N <= 0 || group_size <= 0 || K % TM_PACK_FACTOR != 0 || group_size % TM_PACK_FACTOR != 0 ||
      K % group_size != 0 || K > UINT32_MAX || N > UINT32_MAX || (K / TM_PACK_FACTOR) * N > UINT32_MAX) {
    throw std::invalid_argument("plan_quant_dequant_metal: invalid shape");
  }
  constexpr uint32_t kThreads = 256;  // kDequantThreads in metal/quant_gemm.metal
  GemmPlan p;
  p.params.K = uint32_t(K);
  p.params.N = uint32_t(N);
  p.params.group_size = uint32_t(group_size);
  p.params.k_parallel = 1;
  p.params.k_slice_len = uint32_t(K);
  p.kernel = metal_name("dequant", format, dtype);
  p.grid[0] = ceil_div((K / TM_PACK_FACTOR) * N, kThreads);
  p.threads[0] = kThreads;
  return p;
}

}  // namespace torch_marlin
