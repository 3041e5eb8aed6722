// CUDA geometry of the trellis family (csrc/cuda/trellis_mma.cu, trellis_decode.cu,
// trellis_wgmma.cu, trellis_simt.cu; the numbers live in trellis_params.h).
//  - fp16/bf16: the tensor-core kernel. 8 warps, warp w owns one 16-column tile column, so a block
//    covers 128 columns; its rows are one m16 mma tile (decode, M <= 16: every index byte is read
//    once for all rows) or four (prefill: 64 rows share each decoded weight). Index bytes are
//    staged 8 tile rows at a time with 16-byte copies: for one tile row the block's 8 tiles are one
//    contiguous run. K is sliced until the grid has kCudaBlocksPerSm blocks per SM (each slice at
//    least one stage, at most kCudaMaxKParallel slices): at M = 1 a 4096 x 4096 layer is only 32
//    column blocks, and a few blocks per SM cannot keep enough bytes in flight.
//  - fp16/bf16 with more than 16 rows: the dense weight in the activation dtype, then cuBLAS
//    (dequant_blas): the fused-tile instantiation of the tensor-core kernel is far slower there.
//  - fp16/bf16 decode with K % 8 == 0: the streaming kernel (trellis_decode.cu), the same 8 warps and
//    128 columns with the indices as the mma's A operand (M padded to 8 or 16), K in stages of 8 tile
//    rows 3 stages ahead in a shared-memory ring, sliced the same way.
//  - fp32 activations: a CUDA-core kernel, one column per thread, 16 rows per pass.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/trellis_plan_backends.h"

namespace torch_marlin {
namespace {

constexpr uint32_t kCudaThreads = TM_TRELLIS_CUDA_THREADS;
constexpr uint32_t kCudaTileN = TM_TRELLIS_CUDA_TILE_N;
constexpr uint32_t kCudaStageTiles = TM_TRELLIS_CUDA_STAGE_K_TILES;
constexpr uint32_t kCudaStreamStageTiles = TM_TRELLIS_CUDA_STREAM_STAGE_TILES;
constexpr uint32_t kCudaSimtThreads = TM_TRELLIS_CUDA_SIMT_THREADS;
constexpr uint32_t kCudaElemThreads = TM_TRELLIS_CUDA_ELEMWISE_THREADS;
constexpr uint32_t kCudaMaxKParallel = 32;
constexpr uint32_t kCudaBlocksPerSm = 4;  // benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-SLICES
// The fewest blocks per SM that longer slices (min_slice_stages) may leave (TRELLIS-CUDA-STREAM-SLICES).
constexpr uint32_t kCudaLongSliceMinBlocksPerSm = 2;
constexpr int64_t kCudaBlasMinM = kDecodeMaxM + 1;  // benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-BLAS
// Lane-layout prefill on sm_90a (caps.wgmma): the wgmma kernel for kCudaWgmmaMinM..kCudaWgmmaMaxM
// rows of A where its 128-column blocks alone cover at least half the SMs, dequant + cuBLAS
// otherwise. It writes no dense weight, which wins while that write is a large part of the GEMM's
// time (wide layers, few rows), but its tensor cores wait on the decode more than cuBLAS's do, and
// it does not slice K (benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-WGMMA).
constexpr int64_t kCudaWgmmaMinM = 64;
constexpr int64_t kCudaWgmmaMaxM = 256;

static_assert(TM_TRELLIS_LANE_CHUNK_TILES == TM_TRELLIS_CUDA_STREAM_STAGE_TILES,
              "a streaming-decode stage is one lane chunk");

// The streaming decode's shortest K slice in stages: a 16-row block converts 16 activation rows of
// its slice and writes 16 partial rows, which slices of one or two stages of 3- or 4-bit indices
// do not repay; 2-bit stages are short enough that more slices still win (benchmarks/notes/cuda-tuning.md
// TRELLIS-CUDA-STREAM-SLICES).
uint32_t cuda_stream_min_slice_stages(uint32_t tile_m, uint32_t bits) { return tile_m == 16u && bits >= 3u ? 3u : 1u; }

// Sets l.k_parallel / l.k_slice_tiles for a launch of `blocks` blocks per K slice over tiles_k
// tile rows, and multiplies grid[1] by the slice count. A slice holds at least min_slice_stages
// stages; max_slice_tiles (0: none) bounds it, which may then take more than kCudaMaxKParallel
// slices.
void cuda_k_split(KernelLaunch& l, uint32_t tiles_k, uint64_t blocks, int sms, uint32_t stage_tiles = kCudaStageTiles,
                  uint32_t max_slice_tiles = 0, uint32_t one_wave_blocks_per_sm = 0, uint32_t min_slice_stages = 1) {
  const uint32_t stages = ceil_div(tiles_k, stage_tiles);
  // At least kCudaBlocksPerSm blocks per SM, or (one_wave_blocks_per_sm) at most one wave of that
  // many resident blocks.
  const uint64_t per_sm = one_wave_blocks_per_sm != 0 ? one_wave_blocks_per_sm : kCudaBlocksPerSm;
  const uint64_t want = per_sm * uint64_t(std::max(sms, 1));
  uint64_t kp = blocks >= want                 ? 1
                : one_wave_blocks_per_sm != 0 ? want / std::max<uint64_t>(blocks, 1)
                                              : (want + blocks - 1) / std::max<uint64_t>(blocks, 1);
  kp = std::min<uint64_t>({kp, stages, kCudaMaxKParallel});
  uint32_t slice_stages = ceil_div(stages, int64_t(kp));
  // Slices of min_slice_stages where that leaves at least kCudaLongSliceMinBlocksPerSm blocks per SM.
  const uint64_t floor_blocks = uint64_t(kCudaLongSliceMinBlocksPerSm) * uint64_t(std::max(sms, 1));
  if (slice_stages < min_slice_stages && blocks * ceil_div(stages, int64_t(min_slice_stages)) >= floor_blocks) {
    slice_stages = min_slice_stages;
  }
  if (max_slice_tiles != 0) slice_stages = std::min(slice_stages, max_slice_tiles / stage_tiles);
  l.k_slice_tiles = slice_stages * stage_tiles;
  l.k_parallel = ceil_div(stages, slice_stages);
  l.grid[1] *= l.k_parallel;
}

// CUDA grids allow 65535 blocks along y and z: refuse (clearly) what would exceed them.
void check_cuda_grid(const KernelLaunch& l, const char* who) {
  if (l.grid[1] > 65535u || l.grid[2] > 65535u) {
    throw std::invalid_argument(std::string(who) + ": problem too large for the CUDA kernels' grid (" +
                                std::to_string(l.grid[1]) + " row blocks, " + std::to_string(l.grid[2]) +
                                " expert blocks; at most 65535 each)");
  }
}

// The CUDA fp16/bf16 GEMM kernel for decode (the streaming kernel where `stream`, else the
// tensor-core kernel at one m16 tile) or the fused tiles: sets the plan's streaming flags and
// stage rows (tile_k), and returns the tile rows that `rows` pad to.
uint32_t cuda_gemm_kernel_rows(TrellisPlan& p, bool decode, bool stream, int64_t rows, int64_t group_size) {
  p.cuda_stream_decode = decode && stream;
  p.cuda_stream_stage_groups =
      p.cuda_stream_decode && group_size % (kCudaStreamStageTiles * TM_TRELLIS_TILE) == 0;
  p.params.tile_k = (p.cuda_stream_decode ? kCudaStreamStageTiles : kCudaStageTiles) * TM_TRELLIS_TILE;
  return p.cuda_stream_decode ? (rows <= 8 ? 8u : 16u) : decode ? TM_TRELLIS_CUDA_DECODE_M : TM_TRELLIS_CUDA_PREFILL_M;
}

// Launch of the lane dequant kernel: a block of 8 warps, a warp per lane chunk (8 tile rows of one
// tile column), grid (column chunks of 8 tile columns, lane chunks along K).
void set_lanes_dequant(TrellisPlan& p, const std::string& kernel, const char* who) {
  p.index_layout = TrellisIndexLayout::Lanes;
  KernelLaunch& dequant = p.launches[LaunchRole::Main];
  dequant.kernel = kernel;
  dequant.grid[0] = ceil_div(p.params.tiles_n, TM_TRELLIS_CUDA_WARPS);
  dequant.grid[1] = ceil_div(p.params.tiles_k, TM_TRELLIS_LANE_CHUNK_TILES);
  dequant.threads[0] = kCudaThreads;
  check_cuda_grid(dequant, who);
}

// The launch of the canonical-layout dequant kernel (dequant_trellis, and the dequant_blas GEMM's
// dense weight): TM_TRELLIS_CUDA_DEQUANT_TILES tile columns per block, a block row per tile row.
void set_tiles_dequant(TrellisPlan& p, const std::string& kernel, const char* who) {
  KernelLaunch& dequant = p.launches[LaunchRole::Main];
  dequant.kernel = kernel;
  dequant.grid[0] = ceil_div(p.params.tiles_n, TM_TRELLIS_CUDA_DEQUANT_TILES);
  dequant.grid[1] = p.params.tiles_k;
  dequant.threads[0] = TM_TRELLIS_CUDA_DEQUANT_TILES * TM_TRELLIS_TILE;
  check_cuda_grid(dequant, who);
}

// The launch of a CUDA block-per-128-columns kernel (streaming decode, tensor-core kernel): grid
// (column blocks, row tiles x K slices); the slices' fp32 partials summed in slice order
// (deterministic) into C by gemm_trellis_reduce, which on sm_90 (caps.thread_block_clusters: the
// PTX has griddepcontrol) launches behind the GEMM kernel (PDL) and so skips the launch gap
// between them (benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-PDL).
void set_cuda_sliced_launch(TrellisPlan& p, int64_t M, int64_t N, const std::string& kernel, const std::string& suffix,
                            const DeviceCaps& caps, uint32_t stage_tiles) {
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.kernel = kernel + suffix;
  main.grid[0] = p.params.n_tiles;
  main.grid[1] = p.params.m_tiles;
  main.threads[0] = kCudaThreads;
  // The streaming decode itself launches behind the previous kernel too: its blocks warm L2 with
  // their first indices and wait for that kernel before they read (benchmarks/notes/cuda-tuning.md
  // TRELLIS-CUDA-PDL).
  main.dependent_launch = p.cuda_stream_decode && caps.thread_block_clusters != 0;
  // The streaming decode converts a slice's activations into shared memory once: bounded slices.
  cuda_k_split(main, p.params.tiles_k, uint64_t(p.params.n_tiles) * p.params.m_tiles, caps.compute_units,
               stage_tiles, p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(p.params.tile_m) : 0u, 0u,
               p.cuda_stream_decode ? cuda_stream_min_slice_stages(p.params.tile_m, p.params.bits) : 1u);
  if (main.k_parallel > 1) {
    KernelLaunch& reduce = p.launches[LaunchRole::Reduce];
    reduce.kernel = "gemm_trellis_reduce" + suffix;
    reduce.grid[0] = ceil_div(int64_t(M) * N, kCudaElemThreads);
    reduce.threads[0] = kCudaElemThreads;
    reduce.dependent_launch = caps.thread_block_clusters != 0;
  }
  check_cuda_grid(main, "plan_trellis_gemm");
}

// Rows of A a wgmma prefill block takes: 256 unless 128-row blocks take less time counted in waves
// of one block per SM (a 256-row block costs two 128-row ones; at equal cost the 256-row wgmma
// decodes each weight once for twice the MACs).
uint32_t trellis_wgmma_tile_m(int64_t M, uint32_t n_tiles, int sms) {
  const uint64_t blocks256 = uint64_t(ceil_div(M, 256)) * n_tiles, blocks128 = uint64_t(ceil_div(M, 128)) * n_tiles;
  const uint64_t slots = uint64_t(std::max(sms, 1));
  auto waves = [slots](uint64_t blocks) { return (blocks + slots - 1) / slots; };
  return M > 128 && 2 * waves(blocks256) <= waves(blocks128) ? 256u : 128u;
}

bool trellis_wgmma_pays(int64_t M, int64_t N, const DeviceCaps& caps) {
  return M >= kCudaWgmmaMinM && M <= kCudaWgmmaMaxM && 2 * int64_t(ceil_div(N, kCudaTileN)) >= caps.compute_units;
}

// The lane-layout family: the streaming decode (fp16/bf16, M <= 16, K % 8 == 0); on sm_90a from
// kCudaWgmmaMinM rows the wgmma prefill kernel (fp16/bf16); else the lane dequant kernel writes the
// dense weight in the activation dtype (fp32 too) and at::mm multiplies.
KernelFamily lanes_family(int64_t M, int64_t K, int64_t N, DType dtype, const DeviceCaps& caps, KernelFamily force) {
  const bool can_decode = M <= kDecodeMaxM && dtype != DType::F32 && K % 8 == 0;
  const bool can_wgmma = caps.wgmma && dtype != DType::F32;
  if (force == KernelFamily::Auto) {
    return can_decode                                    ? KernelFamily::Decode
           : can_wgmma && trellis_wgmma_pays(M, N, caps) ? KernelFamily::Wgmma
                                                         : KernelFamily::DequantBlas;
  }
  if (force == KernelFamily::DequantBlas || (force == KernelFamily::Decode && can_decode) ||
      (force == KernelFamily::Wgmma && can_wgmma)) {
    return force;
  }
  throw std::invalid_argument(std::string("plan_trellis_gemm: indices in the lane layout run decode (fp16/bf16, ") +
                              "M <= 16, K % 8 == 0), wgmma (fp16/bf16, caps wgmma) or dequant_blas, not " +
                              family_name(force));
}

// The wgmma prefill kernel on lane-layout indices, behind the launch that rewrites the activations
// for its TMA (times su, k-permuted to the lane layout's order, K padded to whole lane chunks).
void set_lanes_wgmma(TrellisPlan& p, int64_t M, int64_t N, const std::string& suffix, const DeviceCaps& caps) {
  const uint32_t n_tiles = ceil_div(N, kCudaTileN);
  set_trellis_tiles(p.params, M, N, trellis_wgmma_tile_m(M, n_tiles, caps.compute_units), kCudaTileN);
  p.params.tile_k = TM_TRELLIS_LANE_CHUNK_TILES * TM_TRELLIS_TILE;
  KernelLaunch& main = p.launches[LaunchRole::Main];
  main.kernel = "gemm_trellis_wgmma_lanes" + suffix;
  main.grid[0] = p.params.m_tiles;
  main.grid[1] = p.params.n_tiles;
  main.threads[0] = TM_TRELLIS_CUDA_WGMMA_THREADS;
  // A thread per 16 k of each row, K padded to whole lane chunks.
  const uint64_t runs = uint64_t(M) * (trellis_lane_padded_k(p.params.tiles_k) / TM_TRELLIS_TILE);
  KernelLaunch& activations = p.launches[LaunchRole::Activations];
  activations.kernel = "trellis_wgmma_activations" + suffix;
  activations.grid[0] = ceil_div(int64_t(runs), kCudaElemThreads);
  activations.threads[0] = kCudaElemThreads;
  check_cuda_grid(main, "plan_trellis_gemm");
}

}  // namespace

int64_t trellis_cuda_blas_min_m() { return kCudaBlasMinM; }

void plan_trellis_gemm_lanes(TrellisPlan& p, int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype,
                             const DeviceCaps& caps, KernelFamily force) {
  p.family = lanes_family(M, K, N, dtype, caps, force);
  p.index_layout = TrellisIndexLayout::Lanes;
  const std::string suffix = std::string("_") + dtype_name(dtype);
  if (p.family == KernelFamily::Wgmma) return set_lanes_wgmma(p, M, N, suffix, caps);
  if (p.family == KernelFamily::DequantBlas) {
    set_trellis_tiles(p.params, M, N, uint32_t(std::clamp<int64_t>(M, 1, UINT32_MAX / 2)), N);
    return set_lanes_dequant(p, "dequant_trellis_lanes" + suffix, "plan_trellis_gemm");
  }
  set_trellis_tiles(p.params, M, N, cuda_gemm_kernel_rows(p, true, true, M, group_size), kCudaTileN);
  set_cuda_sliced_launch(p, M, N, "gemm_trellis_decode_lanes", suffix, caps, kCudaStreamStageTiles);
}

void plan_trellis_dequant_lanes(TrellisPlan& p) {
  set_lanes_dequant(p, "dequant_trellis_lanes", "plan_trellis_dequant");
}

void plan_trellis_gemm_cuda(TrellisPlan& p, int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype,
                            const DeviceCaps& caps) {
  const std::string suffix = std::string("_") + dtype_name(dtype);
  if (dtype == DType::F32) {
    // fp32 activations keep exact fp32 products: the CUDA-core kernel at every M.
    p.family = KernelFamily::Simt;
    set_trellis_tiles(p.params, M, N, TM_TRELLIS_CUDA_SIMT_M, kCudaSimtThreads);
    KernelLaunch& main = p.launches[LaunchRole::Main];
    main.kernel = "gemm_trellis_simt_float";
    main.grid[0] = p.params.n_tiles;
    main.grid[1] = p.params.m_tiles;
    main.threads[0] = kCudaSimtThreads;
    return check_cuda_grid(main, "plan_trellis_gemm");
  }
  if (p.family == KernelFamily::DequantBlas) {
    // The dequant kernel writes W [K, N] in the activation dtype; at::mm then runs cuBLAS.
    set_trellis_tiles(p.params, M, N, uint32_t(std::clamp<int64_t>(M, 1, UINT32_MAX / 2)), N);
    return set_tiles_dequant(p, "dequant_trellis" + suffix, "plan_trellis_gemm");
  }
  // Decode streams through trellis_decode.cu where its 16-byte activation copies fit (K % 8 == 0),
  // with M padded to 8 or 16 rows; otherwise the tensor-core kernel at one m16 tile.
  const bool decode = p.family == KernelFamily::Decode;
  const uint32_t tile_m = cuda_gemm_kernel_rows(p, decode, K % 8 == 0, M, group_size);
  const uint32_t stage_tiles = p.params.tile_k / TM_TRELLIS_TILE;
  set_trellis_tiles(p.params, M, N, tile_m, kCudaTileN);
  set_cuda_sliced_launch(p, M, N,
                         p.cuda_stream_decode ? "gemm_trellis_decode"
                         : decode             ? "gemm_trellis_decode_mma"
                                              : "gemm_trellis_tiles",
                         suffix, caps, stage_tiles);
}

void plan_trellis_dequant_cuda(TrellisPlan& p) { set_tiles_dequant(p, "dequant_trellis", "plan_trellis_dequant"); }

namespace {

// The MoE's gate/up and down stages. Grid (column blocks, K slices, experts): a block owns one
// expert's column block (gate and up share one launch, grid.z = 2 * slots) and walks that expert's
// routed rows in chunks of tile_m, so each expert's weights stream once per chunk. Experts without
// rows exit at once; the slice count assumes `active` experts (the host does not see the routing).
void set_moe_stages(TrellisPlan& p, uint64_t rows, uint64_t active, int64_t hidden, int64_t intermediate,
                    const std::string& suffix, const DeviceCaps& caps) {
  const bool decode = p.family == KernelFamily::Decode;
  // Decode runs the streaming kernel (trellis_decode.cu) where both stages' 16-byte activation
  // rows fit (hidden and intermediate % 8 == 0): every expert's rows are one 8- or 16-row tile.
  // Its down stage starts behind gate/up and the combine behind down (dependent launches on
  // sm_90), so their launches and index copies overlap the previous stage's tail.
  const uint32_t tile_m =
      cuda_gemm_kernel_rows(p, decode, hidden % 8 == 0 && intermediate % 8 == 0, int64_t(rows), p.params.group_size);
  const uint32_t stage_tiles = p.params.tile_k / TM_TRELLIS_TILE;
  const uint32_t max_slice = p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m) : 0u;
  // The streaming kernel's expert blocks: one wave of its resident blocks (more leaves a
  // second, mostly idle wave; benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-MOE-STREAM).
  const uint32_t one_wave = p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_EXPERT_BLOCKS_PER_SM : 0u;
  set_trellis_tiles(p.params, tile_m, intermediate, tile_m, kCudaTileN);
  const char* kind = p.cuda_stream_decode ? "_decode" : decode ? "_decode_mma" : "_tiles";
  KernelLaunch& gate_up = p.launches[LaunchRole::Main];
  KernelLaunch& down = p.launches[LaunchRole::Down];
  gate_up.kernel = std::string("moe_trellis_gate_up") + kind + suffix;
  down.kernel = std::string("moe_trellis_down") + kind + suffix;
  gate_up.threads[0] = down.threads[0] = kCudaThreads;
  gate_up.grid[0] = ceil_div(intermediate, kCudaTileN);
  down.grid[0] = ceil_div(hidden, kCudaTileN);
  cuda_k_split(gate_up, p.params.tiles_k, uint64_t(gate_up.grid[0]) * 2 * active, caps.compute_units, stage_tiles,
               max_slice, one_wave);
  cuda_k_split(down, p.params.down_tiles_k, uint64_t(down.grid[0]) * active, caps.compute_units, stage_tiles,
               max_slice, one_wave);
  down.dependent_launch = p.cuda_stream_decode && caps.thread_block_clusters != 0;
  p.launches[LaunchRole::Combine].dependent_launch = down.dependent_launch;
}

// The fp32 stages: the CUDA-core kernel.
void set_moe_simt_stages(TrellisPlan& p, int64_t hidden, int64_t intermediate) {
  p.family = KernelFamily::Simt;
  set_trellis_tiles(p.params, TM_TRELLIS_CUDA_SIMT_M, intermediate, TM_TRELLIS_CUDA_SIMT_M, kCudaSimtThreads);
  KernelLaunch& gate_up = p.launches[LaunchRole::Main];
  KernelLaunch& down = p.launches[LaunchRole::Down];
  gate_up.kernel = "moe_trellis_gate_up_simt_float";
  down.kernel = "moe_trellis_down_simt_float";
  gate_up.threads[0] = down.threads[0] = kCudaSimtThreads;
  gate_up.grid[0] = ceil_div(intermediate, kCudaSimtThreads);
  down.grid[0] = ceil_div(hidden, kCudaSimtThreads);
}

// Expert slots of the GEMM grids and how rows find their expert: one slot per routed row at one
// token of the streaming decode (moe_row_slots); the one-launch routing for small batches, which
// lists only the experts that have rows (min(E, T*top_k) slots, spare ones exit); else one slot per
// expert, routed with ATen ops.
uint32_t set_moe_routing(TrellisPlan& p, int64_t tokens, uint64_t rows, uint64_t active) {
  const uint32_t E = p.params.num_experts;
  p.moe_row_slots = p.cuda_stream_decode && tokens == 1;
  if (p.moe_row_slots) return p.params.top_k;
  if (rows <= TM_TRELLIS_CUDA_ROUTE_MAX_ROWS && E <= TM_TRELLIS_CUDA_ROUTE_MAX_EXPERTS) {
    // One block instead of a dozen ATen launches (sort, counts, scans): at decode batches the
    // launches, not the routing work, would dominate the expert GEMVs.
    KernelLaunch& route = p.launches[LaunchRole::Route];
    route.kernel = "moe_trellis_route";
    route.threads[0] = TM_TRELLIS_CUDA_ROUTE_THREADS;
    return uint32_t(active);
  }
  return E;
}

}  // namespace

void plan_trellis_moe_cuda(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate, DType dtype,
                           const DeviceCaps& caps) {
  const uint64_t R = uint64_t(tokens) * p.params.top_k;
  const uint64_t active = std::min<uint64_t>(uint64_t(p.params.num_experts), std::max<uint64_t>(R, 1));
  const std::string suffix = std::string("_") + dtype_name(dtype);
  p.params.k_vec4 = hidden % 4 == 0 ? 1u : 0u;
  p.params.down_k_vec4 = intermediate % 4 == 0 ? 1u : 0u;
  if (dtype == DType::F32) {
    set_moe_simt_stages(p, hidden, intermediate);
  } else {
    set_moe_stages(p, R, active, hidden, intermediate, suffix, caps);
  }
  const uint32_t slots = set_moe_routing(p, tokens, R, active);
  KernelLaunch& gate_up = p.launches[LaunchRole::Main];
  KernelLaunch& down = p.launches[LaunchRole::Down];
  KernelLaunch& combine = p.launches[LaunchRole::Combine];
  gate_up.grid[2] = 2 * slots;
  down.grid[2] = slots;
  combine.kernel = "moe_trellis_combine" + suffix;
  combine.grid[0] = ceil_div(int64_t(tokens) * hidden, kCudaElemThreads);
  combine.threads[0] = kCudaElemThreads;
  check_cuda_grid(gate_up, "plan_trellis_moe");
  check_cuda_grid(down, "plan_trellis_moe");
}

}  // namespace torch_marlin
