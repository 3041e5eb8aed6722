// CUDA policy inputs and geometry (kernels in csrc/cuda/; the launcher instantiates what
// plan.desc names and decides nothing). Every tuning constant here was measured on an H100 over
// the five benchmark layer shapes (K x N: 4096 x 4096, 10752 x 4096, 4096 x 12288, 4096 x 21504,
// 28672 x 8192; FP4, fp16); the rows of benchmarks/notes/cuda-tuning.md hold the data under the IDs cited.
//  - simt (fp32 activations): a plain CUDA-core kernel, 8 rows x 128 columns per block.
//  - decode (M <= 128, or up to 16..32 rows where wgmma_ws does not pay): mma.sync m16n8k16 with
//    the weights as the A operand and M padded to 8/16/32/64 as the n dimension (64-row tiles
//    above 64); a block is 8 warps over 32 columns; each warp streams a contiguous run of 32-row
//    K chunks and the 8 meet in shared memory; grid = (row tiles, column tiles, K slices).
//  - wgmma_ws, sm_90a (cuda_wgmma_ws_pays: M > 32, some shapes M > 16; group_size % 64 == 0): a
//    TMA producer warpgroup and 2 or 3 consumer warpgroups over 64 x 128/192 .. 256 x 128
//    (activation rows x weight columns) tiles, the weights dequantized into wgmma's register A
//    operand; up to 4 K slices (2, or 3 of 256-row tiles, through a cluster; 3..4 through global
//    memory); a partial last wave of tiles as a second launch in K slices (the Tail launch).
//  - wgmma, sm_90a (cuda_wgmma_pays; group sizes wgmma_ws does not take): 2 warpgroups over
//    128 x 256, 128 x 128 or 256 x 128 tiles; each stage's weight tile is dequantized once into
//    shared memory and both operands feed wgmma from there; up to 4 K slices through a cluster.
//  - dequant_blas (larger M): the dequant kernel writes column panels of B into the workspace and
//    cuBLAS multiplies each into C's columns.
// The tile kernels' grid = (row tiles, column tiles, K slices), row tiles fastest so they share
// each column tile's weights in L2. Their K slices are summed inside the GEMM kernel (no second
// dispatch): through a thread-block cluster (ReduceKind::Cluster, no workspace) or by the last
// block of each tile to finish, from an fp32 workspace [k_parallel][slice floats] (LastBlock).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/plan_common.h"

namespace torch_marlin {
namespace {

// One decode tile of 8, 16, 32 or 64 rows up to 64, then 64-row tiles (a grid dimension) up to
// 128: two 64-row passes beat dequant + cuBLAS at M = 96..128 on all five shapes (0.54..0.81x
// against 0.42..0.57x of cuBLAS), at 160..192 only on some (benchmarks/notes/cuda-tuning.md CUDA-DECODE-MAX-M).
constexpr int64_t kCudaDecodeMaxM = 128;
// Decode that scales group sums keeps a second accumulator set: 1 or 2 n8 tiles only (tile_m <= 16).
constexpr uint32_t kCudaDecodeGroupSumsMaxTileM = 16;
// Largest dequantized panel dequant_blas makes (the op's transient workspace). One panel of all of
// N measured fastest (28672 x 8192 at M = 4096: 2783 us whole against 3133 us in two 4096-column
// panels); the cap bounds the workspace of layers past ~500M weights (benchmarks/notes/cuda-tuning.md
// CUDA-DEQUANT-PANEL).
constexpr int64_t kCudaPanelMaxBytes = int64_t(1) << 30;

// How a CUDA tile kernel splits K: slices of at least min_slice rows, at most max_slices of them,
// each slice one kernel iteration multiple (k_step).
struct CudaSliceRule {
  int64_t min_slice, max_slices;
  uint32_t k_step;
};
// Decode: a slice is whole rounds of the 8 warps' 32-row chunks (benchmarks/notes/cuda-tuning.md
// CUDA-DECODE-SLICES).
constexpr CudaSliceRule kCudaDecodeSlices{1024, 16, 32 * TM_CUDA_DECODE_MAX_WARPS};
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

// ---- wgmma (sm_90a) policy ------------------------------------------------------------------
// It beats the decode kernel above 64 rows and dequant + cuBLAS up to 512 rows when
//  - the output has at least 64 tiles (N >= 8192, or 2 row tiles of a 4096-column layer), or
//  - K >= 8192: fewer tiles run 4 K slices through a cluster, and a long slice (>= 2048 k) pays
//    for the cluster reduction (10752 x 4096 at M = 96 / 128: 56.2 / 57.3 us against decode's
//    62.2 at 128; at M = 192 / 256: 97 / 98 against dequant + cuBLAS's 116 / 105; 4096 x 4096,
//    slices of 1024: 47.5 / 48.5 against 42.0 / 45.5 at M = 192 / 256, a tie with decode at 128);
// and above 256 rows (256-row tiles) when the tiles fit in one wave or their last wave is at
// least 80 % full (4096 x 21504 at M = 384 / 512, 3 waves 85 % full: 191 / 200 us against
// 203 / 241; 4096 x 12288, 2 waves 73 % full: 130 / 136 against 127 / 137). From 768 rows on,
// dequant + cuBLAS wins on most shapes (1024 rows: 0.65..0.70x against 0.69..0.71x)
// (benchmarks/notes/cuda-tuning.md CUDA-WGMMA-BAND).
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
// At M = 64..128: 4096 x 21504 (84 tiles, 1 slice either way) 78.6..83.1 us against 91.6..95.6;
// 4096 x 4096 and 10752 x 4096 (4 slices either way) 17..21 % faster; 28672 x 8192, where 32 wide
// tiles need 4 slices instead of 2 (32 clusters of 4 blocks, more than one wave of them), 256..259
// us against 159..162 (benchmarks/notes/cuda-tuning.md CUDA-WGMMA-WIDE).
uint32_t cuda_wgmma_tile_n(int64_t M, int64_t K, int64_t N, int64_t slots) {
  if (M > 128) return TM_CUDA_WGMMA_TILE_N;
  const auto slices = [&](int64_t tile_n) {
    return cuda_tile_slices((N + tile_n - 1) / tile_n, K, slots, kCudaWgmmaSlices);
  };
  return slices(TM_CUDA_WGMMA_WIDE_TILE_N) <= slices(TM_CUDA_WGMMA_TILE_N) ? TM_CUDA_WGMMA_WIDE_TILE_N
                                                                           : TM_CUDA_WGMMA_TILE_N;
}

// ---- wgmma_ws (warp-specialized, sm_90a) policy and geometry ---------------------------------
// With every kernel forced on each shape, it beats every other kernel from 33 rows on, on every
// shape, up to the largest M measured (4096; 4096 x 21504 there within 2 % of dequant + cuBLAS):
// e.g. at M = 64 1.19x..2.03x of cuBLAS against decode's 0.92x..1.35x, at M = 1024 0.89x..1.08x
// against dequant + cuBLAS's 0.69x..0.75x (benchmarks/notes/cuda-tuning.md WS-MIN-M). At 17..32 rows it
// depends on the shape (cuda_wgmma_ws_pays).
constexpr int64_t kCudaWgmmaWsMinM = 32;  // exclusive: always wgmma_ws above
// Whole 64-k stages under one scale row.
bool cuda_wgmma_ws_shape_ok(int64_t K, int64_t group_size) {
  return K % TM_CUDA_WGMMA_K_STEP == 0 && group_size % TM_CUDA_WGMMA_K_STEP == 0;
}
// Activation rows of a tile: the wgmma n dimension.
uint32_t cuda_wgmma_ws_tile_m(int64_t M) { return M <= 64 ? 64 : (M <= 128 ? 128 : 256); }
// K slices summed through a cluster (the tail launch): fill the SMs (at most 3), but 3-block
// clusters only where they take at most 3/4 of the SMs: a cluster's blocks must share a GPC, and
// 32 clusters of 4 (4096 x 4096, M = 64: 20.5 us of kernel time against 13.5 with 3 slices) and
// 43 clusters of 3 (28672 x 8192 with 192-column tiles: 171 us against 103 for 64 x 2) did not fit
// in one wave (benchmarks/notes/cuda-tuning.md WS-CLUSTER-SLICES).
int64_t cuda_wgmma_ws_slices(int64_t tiles, int64_t K, int64_t slots) {
  const int64_t kp = cuda_tile_slices(tiles, K, slots, kCudaWgmmaWsClusterSlices);
  return kp >= 3 && tiles * kp * 4 > slots * 3 ? 2 : kp;
}
// The main grid's K slices. 64- and 128-row tiles: fill the SMs with up to 4; 1 or 2 are summed
// through a cluster, 3 or 4 by the last block of each tile through global memory (no GPC
// constraint). 256-row tiles keep the cluster rule: their 128 KB partial tiles make the global sum
// cost more than a fourth slice saves (benchmarks/notes/cuda-tuning.md WS-GLOBAL-SLICES):
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
// column tiles split off into a second launch (LaunchRole::Tail).
struct WsGeometry {
  uint32_t consumers;
  int64_t tiles, k_parallel, tail_cols, tail_k_parallel;
  int64_t cost;  // stage-waves, a 2-consumer stage = 100
  bool global_reduce = false;  // K slices summed by the last block of each tile instead of a cluster
};
// The tail: where the tiles take more than one wave and the last is partial (4096 x 21504 at
// M = 1024: 672 tiles = 5 full waves + 12 tiles), the whole waves run as one launch and the last
// wave's tiles as a second one with K slices (12 tiles x 3 slices: a third of a tile's stages
// instead of all of them). A second launch costs about kCudaWgmmaWsTailLaunchStages stages. Only
// up to kCudaWgmmaWsTailMaxWaves whole waves: over more the blocks drift apart and the last wave
// is no longer a step. 4096 x 21504 at M = 256 / 1024 / 2048 (1 / 5 / 10 waves): 86.1 / 265.5 /
// 506.0 us against 94.4 / 275.6 / 511.2; 4096 x 12288 at M = 512: 83.8 against 91.6; but at
// M = 4096 (20 waves) 1036 against 1015 (benchmarks/notes/cuda-tuning.md WS-TAIL).
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
// against 112 tiles in 1 wave, 39.9 us; benchmarks/notes/cuda-tuning.md WS-CONSUMERS). 256-row tiles have
// registers for 2 only.
WsGeometry cuda_wgmma_ws_geometry(int64_t M, int64_t K, int64_t N, int64_t slots) {
  const WsGeometry two = cuda_wgmma_ws_geometry_for(M, K, N, slots, 2);
  if (cuda_wgmma_ws_tile_m(M) == 256) return two;
  const WsGeometry three = cuda_wgmma_ws_geometry_for(M, K, N, slots, 3);
  return three.cost < two.cost ? three : two;
}

// From 17 rows (decode's 32-row kernel, 176 instructions a 32 x 32 chunk) wgmma_ws with 64-row
// tiles wins where its blocks fill at least half the SMs with at most 2 K slices and K is short
// (decode's warps then stream short runs): 4096 x 12288 / 4096 x 21504 at M = 17..32
// 25.7..25.9 / 36.3..36.6 us against decode's 33.7..34.3 / 46.9..48.8; decode stays faster on
// 4096 x 4096 (3 slices: 15.4..15.7 against 16.7), 10752 x 4096 (24.6..25.4 against 29.6) and
// 28672 x 8192 (85.8..88.8 against 92.4..94.0). At M <= 16 decode wins or ties on every shape
// (benchmarks/notes/cuda-tuning.md WS-SMALL-M).
constexpr int64_t kCudaWgmmaWsSmallMMaxK = 8192;

// The tile kernels' grid = (row tiles, column tiles, K slices).
void set_cuda_tile_grid(GemmPlan& p, int64_t K, int64_t k_parallel, uint32_t k_step) {
  set_k_parallel(p, K, uint32_t(k_parallel), k_step);
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.grid[0] = p.params.m_tiles;
  main.grid[1] = p.params.n_tiles;
  main.grid[2] = p.params.k_parallel;
}
int64_t cuda_tiles(const GemmPlan& p) { return int64_t(p.params.m_tiles) * p.params.n_tiles; }

// A forced wgmma family needs the sm_90a kernels and a shape they take.
void require_wgmma(const DeviceCaps& caps, bool shape_ok, const char* family, const char* group_multiple) {
  if (!caps.wgmma) {
    throw std::invalid_argument(std::string("plan_quant_gemm: the CUDA ") + family +
                                " kernel needs an sm_90a build on a compute capability 9.0 device (caps wgmma)");
  }
  if (!shape_ok) {
    throw std::invalid_argument(std::string("plan_quant_gemm: the CUDA ") + family +
                                " kernel needs K % 64 == 0 and group_size % " + group_multiple + " == 0");
  }
}

// Sums the K slices inside the kernel: through a cluster where `cluster` (no workspace), else by
// the last block of each tile from the fp32 workspace of `slice_floats` per slice.
void set_in_kernel_reduction(GemmPlan& p, bool cluster, size_t slice_floats) {
  if (p.params.k_parallel <= 1) return;
  if (cluster) {
    p.desc.reduce = ReduceKind::Cluster;
  } else {
    p.desc.reduce = ReduceKind::LastBlock;
    set_partials_workspace(p, slice_floats);
    // The counters share the call's workspace: allocated and zeroed per call, so a captured CUDA
    // graph owns its own and no buffer outlives a call (docs/cuda.md, "CUDA graphs").
    p.counters_offset = p.workspace_bytes;
    p.workspace_bytes += size_t(p.params.m_tiles) * p.params.n_tiles * sizeof(int32_t);
  }
}

void plan_simt(GemmPlan& p, int64_t M, int64_t K, int64_t N) {
  constexpr uint32_t kRows = 8, kCols = 128;
  set_tiles(p, M, N, kRows, kCols);
  set_k_parallel(p, K, 1, TM_PACK_FACTOR);
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.grid[0] = p.params.n_tiles;
  main.grid[1] = p.params.m_tiles;
  main.threads[0] = kCols;
}

// Warps a decode block: every block's warps split its K slice, and each warp pays the latency of
// its first loads before it streams. Up to 16 rows, fewer warps a block when the tiles outnumber
// the slots of 8-warp blocks: the fewest blocks that fit in one wave of slots (2-warp blocks
// beyond that), so each warp streams a longer run and no block starts in a second wave
// (H200, M = 1: 4096 x 14336 15.2 -> 14.1 us with 4 warps, 4096 x 28672 30.5 -> 26.1 us with 2;
// fewer warps lose where 8-warp blocks already fill the slots, benchmarks/notes/cuda-tuning.md
// CUDA-DECODE-WARPS). 64-row tiles and 32-row tiles keep 8 warps (their registers spill).
int64_t cuda_decode_block_warps(int64_t tiles, uint32_t tile_m, const DeviceCaps& caps) {
  if (tile_m > 16) return TM_CUDA_DECODE_MAX_WARPS;
  const int64_t sm_warps = int64_t(caps.compute_units) * TM_CUDA_DECODE_WARPS_PER_SM(tile_m);
  for (int64_t warps = TM_CUDA_DECODE_MAX_WARPS; warps > 2; warps /= 2)
    if (tiles * warps <= sm_warps) return warps;
  return 2;
}

// K slices are whole multiples of one 32-row chunk per warp. The kernel is memory-bound and its
// blocks all run in one wave: as many K slices as keep the resident block slots full (16 warps
// per SM, 8 for 64 rows: the kernel's __launch_bounds__), never a second wave, and slices of at
// least 1024 rows (N past the slots' columns gets a second wave, unsplit). M is padded to 8, 16,
// 32 or 64 rows (1, 2, 4 or 8 n8 mma tiles: the activations are the mma's n dimension); above 64
// rows, 64-row tiles along grid.x (each streams the weights once more, mostly from L2). Up to
// TM_CUDA_DECODE_MAX_CLUSTER_SLICES slices are summed through a cluster where the device and
// build run clusters (benchmarks/notes/cuda-tuning.md CUDA-DECODE-CLUSTER).
void plan_decode(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  const uint32_t tile_m = M <= 8 ? 8 : (M <= 16 ? 16 : (M <= 32 ? 32 : 64));
  set_tiles(p, M, N, tile_m, TM_CUDA_DECODE_TILE_N);
  // scale_group_sums: the tensor cores sum a * (q - z) per group and the fp32 sums are scaled; an affine
  // weight s q + b would also need each row's per-group sum of A for the b term, which the mma
  // layout does not hold, so affine dequantizes every chunk in full (fused multiply-add) instead.
  p.desc.scale_group_sums = tile_m <= kCudaDecodeGroupSumsMaxTileM && p.params.group_size % 32 == 0 &&
                p.desc.format != QuantFormat::Affine;
  const int64_t warps = cuda_decode_block_warps(cuda_tiles(p), tile_m, caps);
  const int64_t blocks_per_sm = TM_CUDA_DECODE_WARPS_PER_SM(tile_m) / warps;
  set_cuda_tile_grid(p, K,
                     cuda_tile_slices(cuda_tiles(p), K, int64_t(caps.compute_units) * blocks_per_sm, kCudaDecodeSlices),
                     kCudaDecodeSlices.k_step);
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.threads[0] = uint32_t(32 * warps);
  set_in_kernel_reduction(p, caps.thread_block_clusters && p.params.k_parallel <= TM_CUDA_DECODE_MAX_CLUSTER_SLICES,
                          size_t(M) * N);
  // PDL needs sm_90 and kernels from sm_90 PTX: the devices that run clusters (benchmarks/notes/cuda-tuning.md
  // CUDA-PDL).
  main.dependent_launch = caps.thread_block_clusters != 0;
}

// 2 warpgroups over 128 or 256 columns x 128 or 256 rows, 1 block per SM. K slices (of at least 8
// stages) only when the tiles leave SMs idle, as for decode; always summed through a cluster.
void plan_wgmma(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  require_wgmma(caps, cuda_wgmma_shape_ok(K, p.params.group_size), "wgmma", "32");
  set_tiles(p, M, N, cuda_wgmma_tile_m(M), cuda_wgmma_tile_n(M, K, N, caps.compute_units));
  set_cuda_tile_grid(p, K, cuda_tile_slices(cuda_tiles(p), K, caps.compute_units, kCudaWgmmaSlices),
                     kCudaWgmmaSlices.k_step);
  p.launches[LaunchRole::Main].threads[0] = TM_CUDA_WGMMA_THREADS;
  set_in_kernel_reduction(p, true, 0);
}

// 64 x consumers weight columns x 64/128/256 activation rows a block, 1 block per SM; K slices and
// the tail launch by cuda_wgmma_ws_geometry.
void plan_wgmma_ws(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  require_wgmma(caps, cuda_wgmma_ws_shape_ok(K, p.params.group_size), "wgmma_ws", "64");
  const WsGeometry g = cuda_wgmma_ws_geometry(M, K, N, std::max(1, caps.compute_units));
  set_tiles(p, M, N, cuda_wgmma_ws_tile_m(M), 64 * g.consumers);
  p.desc.consumers = g.consumers;
  set_cuda_tile_grid(p, K, g.k_parallel, kCudaWgmmaWsSlices.k_step);
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.threads[0] = 128 * (g.consumers + 1);
  main.dependent_launch = true;  // sm_90a only (require_wgmma; benchmarks/notes/cuda-tuning.md CUDA-PDL)
  if (g.tail_cols > 0) {  // the tail: the same kernel on the last column tiles, its K slices summed through a cluster
    QuantGemmParams tail = p.params;
    set_k_slices(tail, K, uint32_t(g.tail_k_parallel), kCudaWgmmaWsSlices.k_step);
    main.grid[1] -= uint32_t(g.tail_cols);
    KernelLaunch& t = p.launches[LaunchRole::Tail];
    t = main;
    t.grid[1] = uint32_t(g.tail_cols);
    t.grid[2] = tail.k_parallel;
    p.tail_k_slice_len = tail.k_slice_len;
  }
  // Its partials stay in fragment order, whole tiles.
  set_in_kernel_reduction(p, !g.global_reduce,
                          size_t(p.params.m_tiles) * p.params.n_tiles * p.params.tile_m * p.params.tile_n);
}

// Column panels of B are dequantized into a [K, tile_n] workspace in the activation dtype and
// cuBLAS multiplies A by each into C's columns. One panel holds all of N unless that exceeds
// kCudaPanelMaxBytes; then N is split evenly in whole 128-column cuBLAS tiles. (L2-sized panels
// were measured slower: narrow GEMMs cost cuBLAS more than the DRAM round trip of the dequantized
// weights.) grid/threads stay {1,1,1}: each panel is one dequant launch (sized by its own column
// count) and one cuBLAS GEMM, neither a grid this plan describes.
void plan_dequant_blas(GemmPlan& p, int64_t M, int64_t K, int64_t N) {
  const int64_t Np = p.padded_n;
  const int64_t widest = std::max<int64_t>(128, kCudaPanelMaxBytes / (K * 2) / 128 * 128);
  const int64_t panels = (Np + widest - 1) / widest;
  const int64_t width = panels == 1 ? Np : ((Np + panels - 1) / panels + 127) / 128 * 128;
  set_tiles(p, M, N, uint32_t(M), uint32_t(width));
  set_k_parallel(p, K, 1, TM_PACK_FACTOR);
  p.workspace_bytes = size_t(K) * p.params.tile_n * 2;  // fp16/bf16 panel, not fp32 partials
}

}  // namespace

int64_t cuda_decode_max_m() { return kCudaDecodeMaxM; }

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

void plan_cuda(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  if (p.desc.dtype != DType::F32) p.padded_n = uint32_t((N + 15) / 16 * 16);  // the kernels' column count
  switch (p.desc.family) {
    case KernelFamily::Simt: plan_simt(p, M, K, N); break;
    case KernelFamily::Decode: plan_decode(p, M, K, N, caps); break;
    case KernelFamily::Wgmma: plan_wgmma(p, M, K, N, caps); break;
    case KernelFamily::WgmmaWs: plan_wgmma_ws(p, M, K, N, caps); break;
    case KernelFamily::DequantBlas: plan_dequant_blas(p, M, K, N); break;
    default: throw std::logic_error("plan_cuda: family not validated");
  }
}

}  // namespace torch_marlin
