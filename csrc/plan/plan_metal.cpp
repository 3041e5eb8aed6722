// Metal geometry (metal/*.metal; also what the Metal-on-CPU harness runs). Kernel names
// are <stem>_<format>_<dtype> (kernel_name in plan.cpp).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/plan_common.h"

namespace torch_marlin {

DeviceCaps default_metal_caps() {
  DeviceCaps caps;
  caps.backend = Backend::Metal;
  caps.compute_units = 8;
  caps.max_shared_memory = 32768;
  return caps;
}

namespace {
constexpr uint32_t kTile = TM_METAL_TILE_M, kThreads = TM_METAL_THREADS;
constexpr uint32_t kReduceThreads = TM_METAL_ELEMENTWISE_THREADS;
constexpr uint32_t kDecodeMinKStep = 64, kDecodeMinSliceRows = 512;
static_assert(TM_METAL_TILE_M == TM_METAL_TILE_N, "the prefill tiles are square");

uint32_t dtype_bytes(DType d) { return d == DType::F32 ? 4u : 2u; }

// K rows per iteration of the prefill kernels (fused_tile_msl.h): K slices are multiples of it.
uint32_t prefill_k_step(KernelFamily f, DType d) {
  return f == KernelFamily::StagedTiles ? TM_METAL_STAGED_TILE_K : TM_METAL_PIPELINED_TILE_K(dtype_bytes(d));
}

// Rows of the fused and striped families' tile: 32 up to 32 rows (a 64-row tile would compute
// up to 3.8x the rows it keeps at M = 17), else 64 (two 32-row tiles would dequantize B twice).
uint32_t prefill_tile_m(int64_t M) { return M <= int64_t(TM_METAL_SMALL_TILE_M) ? TM_METAL_SMALL_TILE_M : kTile; }
}  // namespace

// Stripes + K slices pay only where they shorten the critical path enough to cover their second
// dispatch (the K-slice reduction) and the workspace round trip: by a quarter or more. Counted in
// K rows one core walks, with one tile threadgroup resident per core (a fp32 tile's 21 KiB of
// the 32 KiB leave no room for a second): the fused kernel walks ceil(tiles / cores) whole tiles
// of K rows; the striped one spreads tiles x slices work items (slices of >= 128 rows, as it
// plans them) over the cores, ceil(items / cores) slices of K / slices rows each. With about as
// many tiles as cores (M <= 64 on a large GPU: 64 tiles on 38 cores) both walk 2 K: no stripes.
bool metal_striped_pays(int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  constexpr int64_t kStripedMinK = 512;
  constexpr uint32_t kMinSliceRows = 128;
  const int64_t tile_m = prefill_tile_m(M);
  const int64_t tiles = int64_t((M + tile_m - 1) / tile_m) * ((N + kTile - 1) / kTile);
  if (tiles >= caps.compute_units * 2 || K < kStripedMinK) return false;
  const int64_t cores = std::max(1, caps.compute_units);
  const int64_t slices = k_split_for(tiles, K, kMinSliceRows, caps.compute_units, 2, 1);
  const int64_t fused_rows = (tiles + cores - 1) / cores * K;
  const int64_t striped_rows = (tiles * slices + cores - 1) / cores * ((K + slices - 1) / slices);
  return striped_rows * 4 <= fused_rows * 3;
}

void plan_metal(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  KernelLaunch& main = p.launches[LaunchRole::Main];
  switch (p.desc.family) {
    case KernelFamily::Decode: {
      // A lane owns 4 adjacent columns for all rows of the kernel's row count (1, 2, 4, 8 or 16:
      // the accumulators are a fixed-size register array), a threadgroup 128 columns; its 4
      // simdgroups split the K slice. 16-byte weight loads need N % 4 == 0 (rows of B_packed,
      // scales and zeros start 16 / 8 / 4-byte aligned); other N run the per-column-load kernel.
      p.desc.vector_loads = N % TM_METAL_DECODE_LANE_COLS == 0;
      uint32_t rows = 16;
      if (p.desc.vector_loads) {
        rows = 1;
        while (int64_t(rows) < M) rows *= 2;
      }
      set_tiles(p, M, N, rows, TM_METAL_DECODE_TILE_N);
      // Slices of whole groups (a group's scales are read once), at least 64 rows per K step;
      // split only when the output has too few threadgroups for 4 per core and each slice keeps
      // 512 rows or more (128 per simdgroup).
      const uint32_t gs = p.params.group_size;
      const uint32_t k_step = gs * ceil_div(kDecodeMinKStep, gs);
      const uint32_t min_steps = ceil_div(kDecodeMinSliceRows, k_step);
      set_k_parallel(p, K, k_split_for(p.params.n_tiles, K, k_step, caps.compute_units, 4, min_steps), k_step);
      main.grid[0] = p.params.n_tiles;
      main.grid[1] = p.params.k_parallel;
      main.threads[0] = TM_METAL_DECODE_THREADS;
      break;
    }
    case KernelFamily::FusedTiles:
    case KernelFamily::StagedTiles: {
      set_tiles(p, M, N, p.desc.family == KernelFamily::FusedTiles ? prefill_tile_m(M) : kTile, kTile);
      p.desc.tile_k = prefill_k_step(p.desc.family, p.desc.dtype);
      set_k_parallel(p, K, 1, p.desc.tile_k);
      main.grid[0] = p.params.n_tiles;
      main.grid[1] = p.params.m_tiles;
      main.threads[0] = kThreads;
      break;
    }
    case KernelFamily::Striped: {
      set_tiles(p, M, N, prefill_tile_m(M), kTile);
      p.desc.tile_k = prefill_k_step(p.desc.family, p.desc.dtype);
      const int64_t tiles = int64_t(p.params.m_tiles) * p.params.n_tiles;
      // At least 128 K rows per slice, whatever the step.
      set_k_parallel(p, K, k_split_for(tiles, K, p.desc.tile_k, caps.compute_units, 2, 128 / p.desc.tile_k),
                     p.desc.tile_k);
      const int64_t work = tiles * p.params.k_parallel;
      // A fixed number of threadgroups, each walking a contiguous stripe of the (tile, K slice)
      // work items: 2 per core, 4 for large outputs.
      const int64_t target = int64_t(caps.compute_units) * (M * N > (1 << 20) ? 4 : 2);
      p.params.num_groups = uint32_t(std::max<int64_t>(1, std::min(work, target)));
      main.grid[0] = p.params.num_groups;
      main.threads[0] = kThreads;
      break;
    }
    default:
      throw std::logic_error("plan_metal: family not validated");
  }
  set_second_dispatch_reduction(p, (std::string("marlin_reduce_partials_") + dtype_name(p.desc.dtype)).c_str(),
                                kReduceThreads);
  // The kernels index with 32-bit uints (cheaper on Apple GPUs); see docs/limitations.md.
  if (uint64_t(M) * uint64_t(K) > UINT32_MAX || uint64_t(K / TM_PACK_FACTOR) * uint64_t(N) > UINT32_MAX ||
      uint64_t(M) * uint64_t(N) * p.params.k_parallel > UINT32_MAX) {
    throw std::invalid_argument(
        "plan_quant_gemm: the Metal kernels need M*K, K/8*N and k_parallel*M*N below 2^32; split the call");
  }
}

GemmPlan plan_quant_dequant_metal(QuantFormat format, int64_t K, int64_t N, int64_t group_size, DType dtype) {
  if (K <= 0 || N <= 0 || K % TM_PACK_FACTOR != 0 || K > UINT32_MAX || N > UINT32_MAX ||
      (K / TM_PACK_FACTOR) * N > UINT32_MAX) {
    throw std::invalid_argument("plan_quant_dequant_metal: invalid shape");
  }
  check_quant_group_size(K, group_size, "plan_quant_dequant_metal");
  constexpr uint32_t kDequantThreads = TM_METAL_ELEMENTWISE_THREADS;
  GemmPlan p;
  p.caps = default_metal_caps();
  p.desc.backend = Backend::Metal;
  p.desc.family = KernelFamily::Auto;  // no GEMM
  p.desc.format = format;
  p.desc.dtype = dtype;
  p.params.K = uint32_t(K);
  p.params.N = uint32_t(N);
  p.params.group_size = uint32_t(group_size);
  p.params.k_parallel = 1;
  p.params.k_slice_len = uint32_t(K);
  KernelLaunch& dequant = p.launches[LaunchRole::Main];
  dequant.kernel = std::string("dequant_") + format_name(format) + "_" + dtype_name(dtype);
  dequant.grid[0] = ceil_div((K / TM_PACK_FACTOR) * N, kDequantThreads);
  dequant.threads[0] = kDequantThreads;
  return p;
}

}  // namespace torch_marlin
