#include "plan/trellis_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace torch_marlin {
namespace {

uint32_t cdiv(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Metal geometry (metal/trellis_gemm.metal, metal/trellis_moe.metal; the numbers live in
// trellis_params.h, shared with the kernels):
//  - decode (M <= 16, and the MoE's experts with <= 16 rows): 32 output columns (two tile
//    columns) x all rows per threadgroup, lane l owns column l; K in blocks of 8 tile rows (128)
//    whose index bytes are one contiguous run per tile row, staged with 16-byte loads. A 32x128
//    tile would compute 31 wasted rows at M = 1 and give only N/128 threadgroups.
//  - prefill: 64x64 output tile, 128 threads = 4 simdgroups as a 2x2 grid of 32x32 sub-tiles,
//    K blocks of one tile row (16): double-buffered padded A and decoded-B tiles stay at 21.5 KiB
//    in fp32 (a 32-row K block would need 39 KiB with padding), under the 28 KiB budget.
//  - k_vec4: activation rows (and su) are read 4 elements at a time when their length is a
//    multiple of 4 (16-byte aligned rows), element by element otherwise.
constexpr uint32_t kMetalThreads = TM_TRELLIS_THREADS;
constexpr uint32_t kMetalPrefillTile = TM_TRELLIS_PREFILL_TILE;
constexpr uint32_t kMetalPrefillTileK = TM_TRELLIS_PREFILL_TILE_K;
constexpr uint32_t kMetalDecodeTileN = TM_TRELLIS_DECODE_COLS;
constexpr uint32_t kMetalDecodeTileK = TM_TRELLIS_DECODE_K_TILES * TM_TRELLIS_TILE;
constexpr uint32_t kMetalDequantThreads = TM_TRELLIS_DEQUANT_THREADS;
constexpr uint32_t kMetalCombineThreads = TM_TRELLIS_COMBINE_THREADS;

// CPU geometry. Decode (csrc/cpu/trellis_decode.cpp): each task owns a contiguous column block
// and streams its tile rows front to back, keeping M x tile_n fp32 accumulators; tile_n is as
// wide as kCpuDecodeAccFloats allows (long sequential runs per tile row, accumulators in L1),
// with a task count that is a multiple of the thread count (equal shares, no split K). The
// prefill path (csrc/cpu/trellis.cpp) dequantizes column chunks of at most k_chunk * 128 fp32
// (8 MiB) with all threads and hands each chunk to one BLAS call (few, large calls; BLAS per tile
// inside the parallel region oversubscribed the cores).
constexpr int64_t kCpuDecodeAccFloats = 4096;  // 16 KiB, half of a 32 KiB L1d
constexpr uint32_t kCpuPrefillTileN = 128;
constexpr uint32_t kCpuKChunk = 16384;
constexpr uint32_t kCpuMoeTileN = 64;

// CUDA geometry (csrc/cuda/trellis_mma.cu, trellis_simt.cu; the numbers live in trellis_params.h).
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

// The streaming decode's shortest K slice in stages: a 16-row block converts 16 activation rows of
// its slice and writes 16 partial rows, which slices of one or two stages of 3- or 4-bit indices
// do not repay; 2-bit stages are short enough that more slices still win (benchmarks/notes/cuda-tuning.md
// TRELLIS-CUDA-STREAM-SLICES).
uint32_t cuda_stream_min_slice_stages(uint32_t tile_m, uint32_t bits) { return tile_m == 16u && bits >= 3u ? 3u : 1u; }

// Sets l.k_parallel / l.k_slice_tiles for a launch of `blocks` blocks per K slice over tiles_k
// tile rows, and multiplies grid[1] by the slice count. A slice holds at least min_slice_stages
// stages; max_slice_tiles (0: none) bounds it, which may then take more than kCudaMaxKParallel
// slices.
void cuda_k_split(TrellisLaunch& l, uint32_t tiles_k, uint64_t blocks, int sms, uint32_t stage_tiles = kCudaStageTiles,
                  uint32_t max_slice_tiles = 0, uint32_t one_wave_blocks_per_sm = 0, uint32_t min_slice_stages = 1) {
  const uint32_t stages = cdiv(tiles_k, stage_tiles);
  // At least kCudaBlocksPerSm blocks per SM, or (one_wave_blocks_per_sm) at most one wave of that
  // many resident blocks.
  const uint64_t per_sm = one_wave_blocks_per_sm != 0 ? one_wave_blocks_per_sm : kCudaBlocksPerSm;
  const uint64_t want = per_sm * uint64_t(std::max(sms, 1));
  uint64_t kp = blocks >= want                 ? 1
                : one_wave_blocks_per_sm != 0 ? want / std::max<uint64_t>(blocks, 1)
                                              : (want + blocks - 1) / std::max<uint64_t>(blocks, 1);
  kp = std::min<uint64_t>({kp, stages, kCudaMaxKParallel});
  uint32_t slice_stages = cdiv(stages, int64_t(kp));
  // Slices of min_slice_stages where that leaves at least kCudaLongSliceMinBlocksPerSm blocks per SM.
  const uint64_t floor_blocks = uint64_t(kCudaLongSliceMinBlocksPerSm) * uint64_t(std::max(sms, 1));
  if (slice_stages < min_slice_stages && blocks * cdiv(stages, int64_t(min_slice_stages)) >= floor_blocks) {
    slice_stages = min_slice_stages;
  }
  if (max_slice_tiles != 0) slice_stages = std::min(slice_stages, max_slice_tiles / stage_tiles);
  l.k_slice_tiles = slice_stages * stage_tiles;
  l.k_parallel = cdiv(stages, slice_stages);
  l.grid[1] *= l.k_parallel;
}

// CUDA grids allow 65535 blocks along y and z: refuse (clearly) what would exceed them.
void check_cuda_grid(const TrellisLaunch& l, const char* who) {
  if (l.grid[1] > 65535u || l.grid[2] > 65535u) {
    throw std::invalid_argument(std::string(who) + ": problem too large for the CUDA kernels' grid (" +
                                std::to_string(l.grid[1]) + " row blocks, " + std::to_string(l.grid[2]) +
                                " expert blocks; at most 65535 each)");
  }
}

// The op's own checks (csrc/ops/trellis.cpp), in its words, for callers of the planner alone.
void check_common(int64_t K, int64_t N, int64_t bits, int64_t group_size, const char* who) {
  auto fail = [who](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  if (bits != 2 && bits != 3 && bits != 4) fail("bits must be 2, 3 or 4, got " + std::to_string(bits));
  if (group_size <= 0 || group_size % TM_TRELLIS_TILE != 0 || group_size > UINT32_MAX) {
    fail("group_size must be a positive multiple of 16 (a 16x16 tile never straddles groups), got " +
         std::to_string(group_size));
  }
  if (K <= 0 || N <= 0) fail("K and N must be positive, got K=" + std::to_string(K) + ", N=" + std::to_string(N));
  if (K >= (int64_t(1) << 30) || N >= (int64_t(1) << 30)) fail("K and N must be < 2^30");
}

// The Metal kernels index with 32-bit unsigned arithmetic: refuse problems where an element or
// byte index could wrap (the CPU kernels use 64-bit indices).
void check_metal_indices(std::initializer_list<uint64_t> extents, const char* who) {
  for (uint64_t e : extents) {
    if (e >= (uint64_t(1) << 32)) {
      throw std::invalid_argument(std::string(who) + ": problem too large for the Metal kernels' 32-bit indices");
    }
  }
}

TrellisParams base_params(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size) {
  TrellisParams p{};
  p.M = uint32_t(M);
  p.K = uint32_t(K);
  p.N = uint32_t(N);
  p.bits = uint32_t(bits);
  p.n_levels = 1u << bits;
  p.group_size = uint32_t(group_size);
  p.tiles_k = cdiv(K, TM_TRELLIS_TILE);
  p.tiles_n = cdiv(N, TM_TRELLIS_TILE);
  p.packed_bytes = TM_TRELLIS_TILE_ELEMS * uint32_t(bits) / 8u;
  p.n_groups = cdiv(K, group_size);
  return p;
}

void set_tiles(TrellisParams& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n) {
  p.tile_m = tile_m;
  p.tile_n = tile_n;
  p.m_tiles = cdiv(std::max<int64_t>(M, 1), tile_m);
  p.n_tiles = cdiv(N, tile_n);
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

void check_lanes_backend(const DeviceCaps& caps, const char* who) {
  if (caps.backend != Backend::CUDA) {
    throw std::invalid_argument(std::string(who) + ": indices in the lane layout run on CUDA only, not " +
                                backend_name(caps.backend) +
                                " (torch_marlin.formats.trellis.lanes_to_tiles gives the canonical layout)");
  }
}

// Launch of the lane dequant kernel: a block of 8 warps, a warp per lane chunk (8 tile rows of one
// tile column), grid (column chunks of 8 tile columns, lane chunks along K).
void set_lanes_dequant(TrellisPlan& p, const std::string& kernel, const char* who) {
  p.index_layout = TrellisIndexLayout::Lanes;
  p.main.kernel = kernel;
  p.main.grid[0] = cdiv(p.params.tiles_n, TM_TRELLIS_CUDA_WARPS);
  p.main.grid[1] = cdiv(p.params.tiles_k, TM_TRELLIS_LANE_CHUNK_TILES);
  p.main.threads[0] = kCudaThreads;
  check_cuda_grid(p.main, who);
}

// The launch of a CUDA block-per-128-columns kernel (streaming decode, tensor-core kernel): grid
// (column blocks, row tiles x K slices); the slices' fp32 partials summed in slice order
// (deterministic) into C by gemm_trellis_reduce, which on sm_90 (caps.thread_block_clusters: the
// PTX has griddepcontrol) launches behind the GEMM kernel (PDL) and so skips the launch gap
// between them (benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-PDL).
void set_cuda_sliced_launch(TrellisPlan& p, int64_t M, int64_t N, const std::string& kernel, const std::string& suffix,
                            const DeviceCaps& caps, uint32_t stage_tiles) {
  p.main.kernel = kernel + suffix;
  p.main.grid[0] = p.params.n_tiles;
  p.main.grid[1] = p.params.m_tiles;
  p.main.threads[0] = kCudaThreads;
  // The streaming decode itself launches behind the previous kernel too: its blocks warm L2 with
  // their first indices and wait for that kernel before they read (benchmarks/notes/cuda-tuning.md
  // TRELLIS-CUDA-PDL).
  p.main.dependent_launch = p.cuda_stream_decode && caps.thread_block_clusters != 0;
  // The streaming decode converts a slice's activations into shared memory once: bounded slices.
  cuda_k_split(p.main, p.params.tiles_k, uint64_t(p.params.n_tiles) * p.params.m_tiles, caps.compute_units,
               stage_tiles, p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(p.params.tile_m) : 0u, 0u,
               p.cuda_stream_decode ? cuda_stream_min_slice_stages(p.params.tile_m, p.params.bits) : 1u);
  if (p.main.k_parallel > 1) {
    p.combine.kernel = "gemm_trellis_reduce" + suffix;
    p.combine.grid[0] = cdiv(int64_t(M) * N, kCudaElemThreads);
    p.combine.threads[0] = kCudaElemThreads;
    p.combine.dependent_launch = caps.thread_block_clusters != 0;
  }
  check_cuda_grid(p.main, "plan_trellis_gemm");
}

// Rows of A a wgmma prefill block takes: 256 unless 128-row blocks take less time counted in waves
// of one block per SM (a 256-row block costs two 128-row ones; at equal cost the 256-row wgmma
// decodes each weight once for twice the MACs).
uint32_t trellis_wgmma_tile_m(int64_t M, uint32_t n_tiles, int sms) {
  const uint64_t blocks256 = uint64_t(cdiv(M, 256)) * n_tiles, blocks128 = uint64_t(cdiv(M, 128)) * n_tiles;
  const uint64_t slots = uint64_t(std::max(sms, 1));
  auto waves = [slots](uint64_t blocks) { return (blocks + slots - 1) / slots; };
  return M > 128 && 2 * waves(blocks256) <= waves(blocks128) ? 256u : 128u;
}

bool trellis_wgmma_pays(int64_t M, int64_t N, const DeviceCaps& caps) {
  return M >= kCudaWgmmaMinM && M <= kCudaWgmmaMaxM && 2 * int64_t(cdiv(N, kCudaTileN)) >= caps.compute_units;
}

// CUDA with the indices in the lane layout: the streaming decode (fp16/bf16, M <= 16, K % 8 == 0,
// the same geometry as with tiles); on sm_90a from kCudaWgmmaMinM rows the wgmma prefill kernel
// (fp16/bf16); else the lane dequant kernel writes the dense weight in the activation dtype (fp32
// too) and at::mm multiplies.
TrellisPlan plan_trellis_gemm_lanes(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, DType dtype,
                                    const DeviceCaps& caps, KernelFamily force) {
  check_lanes_backend(caps, "plan_trellis_gemm");
  TrellisPlan p;
  p.caps = caps;
  p.params = base_params(M, K, N, bits, group_size);
  const bool can_decode = M <= kDecodeMaxM && dtype != DType::F32 && K % 8 == 0;
  const bool can_wgmma = caps.wgmma && dtype != DType::F32;
  if (force == KernelFamily::Auto) {
    p.family = can_decode                          ? KernelFamily::Decode
               : can_wgmma && trellis_wgmma_pays(M, N, caps) ? KernelFamily::Wgmma
                                                  : KernelFamily::DequantBlas;
  } else if (force == KernelFamily::DequantBlas || (force == KernelFamily::Decode && can_decode) ||
             (force == KernelFamily::Wgmma && can_wgmma)) {
    p.family = force;
  } else {
    throw std::invalid_argument(std::string("plan_trellis_gemm: indices in the lane layout run decode (fp16/bf16, ") +
                                "M <= 16, K % 8 == 0), wgmma (fp16/bf16, caps wgmma) or dequant_blas, not " +
                                family_name(force));
  }
  const std::string suffix = std::string("_") + dtype_name(dtype);
  if (p.family == KernelFamily::Wgmma) {
    p.index_layout = TrellisIndexLayout::Lanes;
    const uint32_t n_tiles = cdiv(N, kCudaTileN);
    set_tiles(p.params, M, N, trellis_wgmma_tile_m(M, n_tiles, caps.compute_units), kCudaTileN);
    p.params.tile_k = TM_TRELLIS_LANE_CHUNK_TILES * TM_TRELLIS_TILE;
    p.main.kernel = "gemm_trellis_wgmma_lanes" + suffix;
    p.main.grid[0] = p.params.m_tiles;
    p.main.grid[1] = p.params.n_tiles;
    p.main.threads[0] = TM_TRELLIS_CUDA_WGMMA_THREADS;
    // A thread per 16 k of each row, K padded to whole lane chunks.
    const uint64_t runs = uint64_t(M) * (trellis_lane_padded_k(p.params.tiles_k) / TM_TRELLIS_TILE);
    p.activations.kernel = "trellis_wgmma_activations" + suffix;
    p.activations.grid[0] = cdiv(int64_t(runs), kCudaElemThreads);
    p.activations.threads[0] = kCudaElemThreads;
    check_cuda_grid(p.main, "plan_trellis_gemm");
    return p;
  }
  if (p.family == KernelFamily::DequantBlas) {
    set_tiles(p.params, M, N, uint32_t(std::min<int64_t>(M, UINT32_MAX / 2)), N);
    set_lanes_dequant(p, "dequant_trellis_lanes" + suffix, "plan_trellis_gemm");
    return p;
  }
  p.index_layout = TrellisIndexLayout::Lanes;
  set_tiles(p.params, M, N, cuda_gemm_kernel_rows(p, true, true, M, group_size), kCudaTileN);
  set_cuda_sliced_launch(p, M, N, "gemm_trellis_decode_lanes", suffix, caps, kCudaStreamStageTiles);
  return p;
}

static_assert(TM_TRELLIS_LANE_CHUNK_TILES == TM_TRELLIS_CUDA_STREAM_STAGE_TILES,
              "a streaming-decode stage is one lane chunk");

}  // namespace

const char* index_layout_name(TrellisIndexLayout layout) {
  return layout == TrellisIndexLayout::Lanes ? "lanes" : "tiles";
}

TrellisIndexLayout parse_index_layout(const std::string& name) {
  if (name == "tiles") return TrellisIndexLayout::Tiles;
  if (name == "lanes") return TrellisIndexLayout::Lanes;
  throw std::invalid_argument("index layout must be 'tiles' or 'lanes', got '" + name + "'");
}

TrellisIndexLayout trellis_index_layout(int64_t K, int64_t N, int64_t bits, const DeviceCaps& caps) {
  check_common(K, N, bits, TM_TRELLIS_TILE, "trellis_index_layout");
  return caps.backend == Backend::CUDA && K % 8 == 0 ? TrellisIndexLayout::Lanes : TrellisIndexLayout::Tiles;
}

KernelFamily trellis_prefill_family(Backend b) {
  switch (b) {
    case Backend::Metal: return KernelFamily::StagedTiles;
    case Backend::CUDA: return KernelFamily::FusedTiles;
    default: return KernelFamily::DequantBlas;
  }
}

TrellisPlan plan_trellis_gemm(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, DType dtype,
                              const DeviceCaps& caps, KernelFamily force, TrellisIndexLayout layout) {
  check_common(K, N, bits, group_size, "plan_trellis_gemm");
  if (M < 0 || M > UINT32_MAX / 2) {
    throw std::invalid_argument("plan_trellis_gemm: M must be in [0, 2^31), got " + std::to_string(M));
  }
  if (layout == TrellisIndexLayout::Lanes) return plan_trellis_gemm_lanes(M, K, N, bits, group_size, dtype, caps, force);
  TrellisPlan p;
  p.caps = caps;
  p.params = base_params(M, K, N, bits, group_size);
  const KernelFamily prefill = trellis_prefill_family(caps.backend);
  // CUDA fp16/bf16: above the decode rows the dense weight + cuBLAS beats the fused tiles
  // (benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-BLAS); fused_tiles runs there only when forced.
  const bool cuda_blas = caps.backend == Backend::CUDA && dtype != DType::F32;
  if (force == KernelFamily::Auto) {
    p.family = M <= kDecodeMaxM ? KernelFamily::Decode : prefill;
    if (cuda_blas && M >= kCudaBlasMinM) p.family = KernelFamily::DequantBlas;
  } else if (force == KernelFamily::Decode || force == prefill || (cuda_blas && force == KernelFamily::DequantBlas)) {
    p.family = force;
  } else {
    throw std::invalid_argument(std::string("plan_trellis_gemm: the ") + family_name(force) +
                                " family does not run trellis on " + backend_name(caps.backend) +
                                " (families there: decode, " + family_name(prefill) + ")");
  }
  if (p.family == KernelFamily::Decode && M > kDecodeMaxM) {
    throw std::invalid_argument("plan_trellis_gemm: the decode family handles M <= 16 only");
  }
  const bool decode = p.family == KernelFamily::Decode;
  switch (caps.backend) {
    case Backend::Metal: {
      check_metal_indices({uint64_t(M) * uint64_t(K), uint64_t(M) * uint64_t(N),
                           uint64_t(p.params.tiles_k) * p.params.tiles_n * p.params.packed_bytes},
                          "plan_trellis_gemm");
      const std::string suffix = std::string("_") + dtype_name(dtype);
      if (decode) {
        set_tiles(p.params, M, N, uint32_t(kDecodeMaxM), kMetalDecodeTileN);
        p.params.tile_k = kMetalDecodeTileK;
        p.main.kernel = "gemm_trellis_packed_decode" + suffix;
      } else {
        set_tiles(p.params, M, N, kMetalPrefillTile, kMetalPrefillTile);
        p.params.tile_k = kMetalPrefillTileK;
        p.main.kernel = "gemm_trellis_packed" + suffix;
      }
      p.params.k_vec4 = K % 4 == 0 ? 1u : 0u;
      p.main.grid[0] = p.params.n_tiles;
      p.main.grid[1] = p.params.m_tiles;
      p.main.threads[0] = kMetalThreads;
      break;
    }
    case Backend::CPU: {
      if (decode) {
        const int64_t threads = std::max(1, caps.compute_units);
        const int64_t max_cols = std::max<int64_t>(TM_TRELLIS_TILE, kCpuDecodeAccFloats / std::max<int64_t>(M, 1) /
                                                                        TM_TRELLIS_TILE * TM_TRELLIS_TILE);
        const int64_t tasks = threads * ((N + threads * max_cols - 1) / (threads * max_cols));
        const int64_t tile_n = (N + tasks - 1) / tasks;
        set_tiles(p.params, M, N, uint32_t(kDecodeMaxM), cdiv(tile_n, TM_TRELLIS_TILE) * TM_TRELLIS_TILE);
        p.cpu_avx512 = caps.avx512 != 0;
        p.cpu_avx2 = !p.cpu_avx512 && caps.avx2 != 0;
        p.main.kernel = p.cpu_avx512 ? "cpu_trellis_decode_avx512"
                        : p.cpu_avx2 ? "cpu_trellis_decode_avx2"
                                     : "cpu_trellis_decode";
      } else {
        set_tiles(p.params, M, N, uint32_t(std::max<int64_t>(M, 1)), kCpuPrefillTileN);
        p.main.kernel = "cpu_trellis_prefill";
      }
      p.main.grid[0] = p.params.n_tiles;
      p.k_chunk = kCpuKChunk;
      break;
    }
    case Backend::CUDA: {
      const std::string suffix = std::string("_") + dtype_name(dtype);
      if (dtype == DType::F32) {
        // fp32 activations keep exact fp32 products: the CUDA-core kernel at every M.
        p.family = KernelFamily::Simt;
        set_tiles(p.params, M, N, TM_TRELLIS_CUDA_SIMT_M, kCudaSimtThreads);
        p.main.kernel = "gemm_trellis_simt_float";
        p.main.grid[0] = p.params.n_tiles;
        p.main.grid[1] = p.params.m_tiles;
        p.main.threads[0] = kCudaSimtThreads;
        check_cuda_grid(p.main, "plan_trellis_gemm");
        break;
      }
      if (p.family == KernelFamily::DequantBlas) {
        // The dequant kernel writes W [K, N] in the activation dtype; at::mm then runs cuBLAS.
        set_tiles(p.params, M, N, uint32_t(std::min<int64_t>(M, UINT32_MAX / 2)), N);
        p.main.kernel = "dequant_trellis" + suffix;
        p.main.grid[0] = cdiv(p.params.tiles_n, TM_TRELLIS_CUDA_DEQUANT_TILES);
        p.main.grid[1] = p.params.tiles_k;
        p.main.threads[0] = TM_TRELLIS_CUDA_DEQUANT_TILES * TM_TRELLIS_TILE;
        check_cuda_grid(p.main, "plan_trellis_gemm");
        break;
      }
      // Decode streams through trellis_decode.cu where its 16-byte activation copies fit (K % 8 == 0),
      // with M padded to 8 or 16 rows; otherwise the tensor-core kernel at one m16 tile.
      const uint32_t tile_m = cuda_gemm_kernel_rows(p, decode, K % 8 == 0, M, group_size);
      const uint32_t stage_tiles = p.params.tile_k / TM_TRELLIS_TILE;
      set_tiles(p.params, M, N, tile_m, kCudaTileN);
      set_cuda_sliced_launch(p, M, N,
                             p.cuda_stream_decode ? "gemm_trellis_decode"
                             : decode             ? "gemm_trellis_decode_mma"
                                                  : "gemm_trellis_tiles",
                             suffix, caps, stage_tiles);
      break;
    }
  }
  return p;
}

TrellisPlan plan_trellis_dequant(int64_t K, int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps,
                                 TrellisIndexLayout layout) {
  check_common(K, N, bits, group_size, "plan_trellis_dequant");
  TrellisPlan p;
  p.caps = caps;
  p.params = base_params(0, K, N, bits, group_size);
  p.family = KernelFamily::Auto;  // no GEMM
  set_tiles(p.params, K, N, TM_TRELLIS_TILE, TM_TRELLIS_TILE);
  if (layout == TrellisIndexLayout::Lanes) {
    check_lanes_backend(caps, "plan_trellis_dequant");
    set_lanes_dequant(p, "dequant_trellis_lanes", "plan_trellis_dequant");
    return p;
  }
  switch (caps.backend) {
    case Backend::Metal:
      check_metal_indices({uint64_t(K) * uint64_t(N), uint64_t(p.params.tiles_k) * p.params.tiles_n * p.params.packed_bytes},
                          "plan_trellis_dequant");
      p.main.kernel = "dequant_trellis";
      p.main.grid[0] = p.params.tiles_n;
      p.main.grid[1] = p.params.tiles_k;
      p.main.threads[0] = kMetalDequantThreads;
      break;
    case Backend::CPU:
      p.main.kernel = "cpu_trellis_dequant";
      p.main.grid[0] = p.params.tiles_k;
      break;
    case Backend::CUDA:
      p.main.kernel = "dequant_trellis";
      p.main.grid[0] = cdiv(p.params.tiles_n, TM_TRELLIS_CUDA_DEQUANT_TILES);
      p.main.grid[1] = p.params.tiles_k;
      p.main.threads[0] = TM_TRELLIS_CUDA_DEQUANT_TILES * TM_TRELLIS_TILE;
      check_cuda_grid(p.main, "plan_trellis_dequant");
      break;
  }
  return p;
}

TrellisPlan plan_trellis_moe(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                             int64_t top_k, int64_t bits, int64_t group_size, DType dtype, const DeviceCaps& caps) {
  check_common(hidden, intermediate, bits, group_size, "plan_trellis_moe");
  if (tokens < 0 || num_experts <= 0 || top_k <= 0 || top_k > num_experts || tokens * top_k > UINT32_MAX / 2) {
    throw std::invalid_argument("plan_trellis_moe: invalid tokens / num_experts / top_k");
  }
  TrellisPlan p;
  p.caps = caps;
  p.params = base_params(tokens, hidden, intermediate, bits, group_size);
  p.params.num_experts = uint32_t(num_experts);
  p.params.top_k = uint32_t(top_k);
  p.params.down_tiles_k = cdiv(intermediate, TM_TRELLIS_TILE);
  p.params.down_tiles_n = cdiv(hidden, TM_TRELLIS_TILE);
  p.params.down_n_groups = cdiv(intermediate, group_size);
  p.params.max_rows = uint32_t(tokens * top_k);
  p.family = tokens * top_k <= kDecodeMaxM ? KernelFamily::Decode : trellis_prefill_family(caps.backend);
  const uint32_t E = uint32_t(num_experts);
  switch (caps.backend) {
    case Backend::Metal: {
      // Grid (column blocks, expert slots): a threadgroup owns one expert's column block and walks
      // that expert's routed rows in chunks of 16, so each expert's weights stream once per block.
      // Only min(E, T*top_k) slots (at most that many experts have rows): slot s runs the s-th
      // expert with rows (metal/trellis_moe.metal, tr_slot_expert), so idle experts cost nothing.
      const uint64_t R = uint64_t(tokens) * uint64_t(top_k);
      const uint32_t slots = uint32_t(std::min<uint64_t>(E, std::max<uint64_t>(R, 1)));
      check_metal_indices({R * uint64_t(hidden), R * uint64_t(intermediate),
                           uint64_t(num_experts) * p.params.tiles_k * p.params.tiles_n * p.params.packed_bytes,
                           uint64_t(num_experts) * p.params.n_groups * uint64_t(intermediate),
                           uint64_t(num_experts) * p.params.down_n_groups * uint64_t(hidden)},
                          "plan_trellis_moe");
      const std::string suffix = std::string("_") + dtype_name(dtype);
      set_tiles(p.params, kDecodeMaxM, intermediate, uint32_t(kDecodeMaxM), kMetalDecodeTileN);
      // The decode stages' K block; the tiled stages (when planned) step kMetalPrefillTileK.
      p.params.tile_k = kMetalDecodeTileK;
      p.params.k_vec4 = hidden % 4 == 0 ? 1u : 0u;
      p.params.down_k_vec4 = intermediate % 4 == 0 ? 1u : 0u;
      p.main.kernel = "moe_trellis_gate_up" + suffix;
      p.main.grid[0] = p.params.n_tiles;
      p.main.grid[1] = slots;
      p.main.threads[0] = kMetalThreads;
      p.down.kernel = "moe_trellis_down" + suffix;
      p.down.grid[0] = cdiv(hidden, kMetalDecodeTileN);
      p.down.grid[1] = slots;
      p.down.threads[0] = kMetalThreads;
      if (R > uint64_t(kDecodeMaxM)) {
        // The host cannot size these per expert without a sync: grid.y covers every routed row,
        // and threadgroups past their expert's rows (or of experts with <= 16 rows) exit at once.
        // Slots: at most R / 17 experts have more than 16 rows (the tiled kernels' experts).
        const uint32_t tiled_slots = uint32_t(std::min<uint64_t>(E, R / (kDecodeMaxM + 1)));
        const uint32_t row_tiles = cdiv(int64_t(R), kMetalPrefillTile);
        for (TrellisLaunch* l : {&p.tiled_gate, &p.tiled_up}) {
          l->grid[0] = cdiv(intermediate, kMetalPrefillTile);
          l->grid[1] = row_tiles;
          l->grid[2] = tiled_slots;
          l->threads[0] = kMetalThreads;
        }
        p.tiled_gate.kernel = "moe_trellis_tiled_gate" + suffix;
        p.tiled_up.kernel = "moe_trellis_tiled_up" + suffix;
        p.tiled_down.kernel = "moe_trellis_tiled_down" + suffix;
        p.tiled_down.grid[0] = cdiv(hidden, kMetalPrefillTile);
        p.tiled_down.grid[1] = row_tiles;
        p.tiled_down.grid[2] = tiled_slots;
        p.tiled_down.threads[0] = kMetalThreads;
      }
      p.combine.kernel = "moe_trellis_combine" + suffix;
      p.combine.grid[0] = cdiv(int64_t(tokens) * hidden, kMetalCombineThreads);
      p.combine.threads[0] = kMetalCombineThreads;
      break;
    }
    case Backend::CPU: {
      set_tiles(p.params, kDecodeMaxM, intermediate, uint32_t(kDecodeMaxM), kCpuMoeTileN);
      // The decode stages' kernel, as for the GEMM.
      p.cpu_avx512 = caps.avx512 != 0;
      p.cpu_avx2 = !p.cpu_avx512 && caps.avx2 != 0;
      p.main.kernel = "cpu_trellis_moe_gate_up";
      p.main.grid[0] = p.params.n_tiles;
      p.main.grid[1] = E;
      p.down.kernel = "cpu_trellis_moe_down";
      p.down.grid[0] = cdiv(hidden, kCpuMoeTileN);
      p.down.grid[1] = E;
      p.combine.kernel = "cpu_trellis_moe_combine";
      p.combine.grid[0] = uint32_t(tokens);
      p.k_chunk = kCpuKChunk;
      break;
    }
    case Backend::CUDA: {
      // Grid (column blocks, K slices, experts): a block owns one expert's column block (gate
      // and up share one launch, grid.z = 2E) and walks that expert's routed rows in chunks of
      // tile_m, so each expert's weights stream once per chunk. Experts without rows exit at once;
      // the slice count assumes min(E, T*top_k) active experts (the host does not see the routing).
      const uint64_t R = uint64_t(tokens) * uint64_t(top_k);
      const uint64_t active = std::min<uint64_t>(uint64_t(num_experts), std::max<uint64_t>(R, 1));
      const std::string suffix = std::string("_") + dtype_name(dtype);
      p.params.k_vec4 = hidden % 4 == 0 ? 1u : 0u;
      p.params.down_k_vec4 = intermediate % 4 == 0 ? 1u : 0u;
      if (dtype == DType::F32) {
        p.family = KernelFamily::Simt;
        set_tiles(p.params, TM_TRELLIS_CUDA_SIMT_M, intermediate, TM_TRELLIS_CUDA_SIMT_M, kCudaSimtThreads);
        p.main.kernel = "moe_trellis_gate_up_simt_float";
        p.down.kernel = "moe_trellis_down_simt_float";
        p.main.threads[0] = p.down.threads[0] = kCudaSimtThreads;
        p.main.grid[0] = cdiv(intermediate, kCudaSimtThreads);
        p.down.grid[0] = cdiv(hidden, kCudaSimtThreads);
      } else {
        const bool decode = p.family == KernelFamily::Decode;
        // Decode runs the streaming kernel (trellis_decode.cu) where both stages' 16-byte activation
        // rows fit (hidden and intermediate % 8 == 0): every expert's rows are one 8- or 16-row tile.
        // Its down stage starts behind gate/up and the combine behind down (dependent launches on
        // sm_90), so their launches and index copies overlap the previous stage's tail.
        const uint32_t tile_m =
            cuda_gemm_kernel_rows(p, decode, hidden % 8 == 0 && intermediate % 8 == 0, int64_t(R), group_size);
        const uint32_t stage_tiles = p.params.tile_k / TM_TRELLIS_TILE;
        const uint32_t max_slice = p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m) : 0u;
        // The streaming kernel's expert blocks: one wave of its resident blocks (more leaves a
        // second, mostly idle wave; benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-MOE-STREAM).
        const uint32_t one_wave = p.cuda_stream_decode ? TM_TRELLIS_CUDA_STREAM_EXPERT_BLOCKS_PER_SM : 0u;
        set_tiles(p.params, tile_m, intermediate, tile_m, kCudaTileN);
        const char* kind = p.cuda_stream_decode ? "_decode" : decode ? "_decode_mma" : "_tiles";
        p.main.kernel = std::string("moe_trellis_gate_up") + kind + suffix;
        p.down.kernel = std::string("moe_trellis_down") + kind + suffix;
        p.main.threads[0] = p.down.threads[0] = kCudaThreads;
        p.main.grid[0] = cdiv(intermediate, kCudaTileN);
        p.down.grid[0] = cdiv(hidden, kCudaTileN);
        cuda_k_split(p.main, p.params.tiles_k, uint64_t(p.main.grid[0]) * 2 * active, caps.compute_units, stage_tiles,
                     max_slice, one_wave);
        cuda_k_split(p.down, p.params.down_tiles_k, uint64_t(p.down.grid[0]) * active, caps.compute_units,
                     stage_tiles, max_slice, one_wave);
        p.down.dependent_launch = p.cuda_stream_decode && caps.thread_block_clusters != 0;
        p.combine.dependent_launch = p.down.dependent_launch;
      }
      // Expert slots of the GEMM grids: with the one-launch routing, only min(E, T*top_k) (the
      // routing lists the experts that have rows; spare slots exit), else one per expert.
      uint32_t slots = E;
      p.moe_row_slots = p.cuda_stream_decode && tokens == 1;
      if (p.moe_row_slots) {
        slots = uint32_t(top_k);
      } else if (R <= TM_TRELLIS_CUDA_ROUTE_MAX_ROWS && E <= TM_TRELLIS_CUDA_ROUTE_MAX_EXPERTS) {
        // One block instead of a dozen ATen launches (sort, counts, scans): at decode batches the
        // launches, not the routing work, would dominate the expert GEMVs.
        p.route.kernel = "moe_trellis_route";
        p.route.threads[0] = TM_TRELLIS_CUDA_ROUTE_THREADS;
        slots = uint32_t(active);
      }
      p.main.grid[2] = 2 * slots;
      p.down.grid[2] = slots;
      p.combine.kernel = "moe_trellis_combine" + suffix;
      p.combine.grid[0] = cdiv(int64_t(tokens) * hidden, kCudaElemThreads);
      p.combine.threads[0] = kCudaElemThreads;
      check_cuda_grid(p.main, "plan_trellis_moe");
      check_cuda_grid(p.down, "plan_trellis_moe");
      break;
    }
  }
  return p;
}

}  // namespace torch_marlin
