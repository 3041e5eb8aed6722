// Metal geometry of the trellis family (metal/trellis_gemm.metal, metal/trellis_moe.metal; the
// numbers live in trellis_params.h, shared with the kernels):
//  - decode (M <= 16, and the MoE's experts with <= 16 rows): 32 output columns (two tile
//    columns) x all rows per threadgroup, lane l owns column l; K in blocks of 8 tile rows (128)
//    whose index bytes are one contiguous run per tile row, staged with 16-byte loads. A 32x128
//    tile would compute 31 wasted rows at M = 1 and give only N/128 threadgroups.
//  - prefill: 64x64 output tile, 128 threads = 4 simdgroups as a 2x2 grid of 32x32 sub-tiles,
//    K blocks of one tile row (16): double-buffered padded A and decoded-B tiles stay at 21.5 KiB
//    in fp32 (a 32-row K block would need 39 KiB with padding), under the 28 KiB budget.
//  - k_vec4: activation rows (and su) are read 4 elements at a time when their length is a
//    multiple of 4 (16-byte aligned rows), element by element otherwise.
#include <algorithm>
#include <string>

#include "plan/trellis_plan_backends.h"

namespace torch_marlin {
namespace {

constexpr uint32_t kMetalThreads = TM_TRELLIS_THREADS;
constexpr uint32_t kMetalPrefillTile = TM_TRELLIS_PREFILL_TILE;
constexpr uint32_t kMetalPrefillTileK = TM_TRELLIS_PREFILL_TILE_K;
constexpr uint32_t kMetalDecodeTileN = TM_TRELLIS_DECODE_COLS;
constexpr uint32_t kMetalDecodeTileK = TM_TRELLIS_DECODE_K_TILES * TM_TRELLIS_TILE;
constexpr uint32_t kMetalDequantThreads = TM_TRELLIS_DEQUANT_THREADS;
constexpr uint32_t kMetalCombineThreads = TM_TRELLIS_COMBINE_THREADS;

void set_launch(TrellisPlan& p, LaunchRole role, const std::string& kernel, uint32_t x, uint32_t y, uint32_t z,
                uint32_t threads) {
  KernelLaunch& l = p.launches[role];
  l.kernel = kernel;
  l.grid[0] = x;
  l.grid[1] = y;
  l.grid[2] = z;
  l.threads[0] = threads;
}

// The MoE's 64x64-tile stages for experts with more than 16 routed rows. The host cannot size them
// per expert without a sync: grid.y covers every routed row, and threadgroups past their expert's
// rows (or of experts with <= 16 rows) exit at once. Slots: at most rows / 17 experts have more
// than 16 rows (the tiled kernels' experts).
void set_moe_tiled_stages(TrellisPlan& p, uint64_t rows, int64_t hidden, int64_t intermediate,
                          const std::string& suffix) {
  const uint32_t row_tiles = ceil_div(int64_t(rows), kMetalPrefillTile);
  const uint32_t slots = uint32_t(std::min<uint64_t>(p.params.num_experts, rows / (kDecodeMaxM + 1)));
  const uint32_t gate_up_blocks = ceil_div(intermediate, kMetalPrefillTile);
  const uint32_t down_blocks = ceil_div(hidden, kMetalPrefillTile);
  set_launch(p, LaunchRole::TiledGate, "moe_trellis_tiled_gate" + suffix, gate_up_blocks, row_tiles, slots,
             kMetalThreads);
  set_launch(p, LaunchRole::TiledUp, "moe_trellis_tiled_up" + suffix, gate_up_blocks, row_tiles, slots, kMetalThreads);
  set_launch(p, LaunchRole::TiledDown, "moe_trellis_tiled_down" + suffix, down_blocks, row_tiles, slots, kMetalThreads);
}

}  // namespace

void plan_trellis_gemm_metal(TrellisPlan& p, int64_t M, int64_t K, int64_t N, DType dtype) {
  check_metal_indices({uint64_t(M) * uint64_t(K), uint64_t(M) * uint64_t(N),
                       uint64_t(p.params.tiles_k) * p.params.tiles_n * p.params.packed_bytes},
                      "plan_trellis_gemm");
  const std::string suffix = std::string("_") + dtype_name(dtype);
  const bool decode = p.family == KernelFamily::Decode;
  if (decode) {
    set_trellis_tiles(p.params, M, N, uint32_t(kDecodeMaxM), kMetalDecodeTileN);
    p.params.tile_k = kMetalDecodeTileK;
  } else {
    set_trellis_tiles(p.params, M, N, kMetalPrefillTile, kMetalPrefillTile);
    p.params.tile_k = kMetalPrefillTileK;
  }
  p.params.k_vec4 = K % 4 == 0 ? 1u : 0u;
  set_launch(p, LaunchRole::Main, (decode ? "gemm_trellis_packed_decode" : "gemm_trellis_packed") + suffix,
             p.params.n_tiles, p.params.m_tiles, 1, kMetalThreads);
}

void plan_trellis_dequant_metal(TrellisPlan& p, int64_t K, int64_t N) {
  const TrellisParams& q = p.params;
  check_metal_indices({uint64_t(K) * uint64_t(N), uint64_t(q.tiles_k) * q.tiles_n * q.packed_bytes},
                      "plan_trellis_dequant");
  set_launch(p, LaunchRole::Main, "dequant_trellis", p.params.tiles_n, p.params.tiles_k, 1, kMetalDequantThreads);
}

// Grid (column blocks, expert slots): a threadgroup owns one expert's column block and walks that
// expert's routed rows in chunks of 16, so each expert's weights stream once per block. Only
// min(E, T*top_k) slots (at most that many experts have rows): slot s runs the s-th expert with
// rows (metal/trellis_moe.metal, tr_slot_expert), so idle experts cost nothing.
void plan_trellis_moe_metal(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate, DType dtype) {
  const TrellisParams& q = p.params;
  const uint64_t R = uint64_t(tokens) * q.top_k, E = q.num_experts;
  const uint32_t slots = uint32_t(std::min<uint64_t>(E, std::max<uint64_t>(R, 1)));
  check_metal_indices({R * uint64_t(hidden), R * uint64_t(intermediate), E * q.tiles_k * q.tiles_n * q.packed_bytes,
                       E * q.n_groups * uint64_t(intermediate), E * q.down_n_groups * uint64_t(hidden)},
                      "plan_trellis_moe");
  const std::string suffix = std::string("_") + dtype_name(dtype);
  set_trellis_tiles(p.params, kDecodeMaxM, intermediate, uint32_t(kDecodeMaxM), kMetalDecodeTileN);
  // The decode stages' K block; the tiled stages (when planned) step kMetalPrefillTileK.
  p.params.tile_k = kMetalDecodeTileK;
  p.params.k_vec4 = hidden % 4 == 0 ? 1u : 0u;
  p.params.down_k_vec4 = intermediate % 4 == 0 ? 1u : 0u;
  set_launch(p, LaunchRole::Main, "moe_trellis_gate_up" + suffix, p.params.n_tiles, slots, 1, kMetalThreads);
  set_launch(p, LaunchRole::Down, "moe_trellis_down" + suffix, ceil_div(hidden, kMetalDecodeTileN), slots, 1,
             kMetalThreads);
  if (R > uint64_t(kDecodeMaxM)) set_moe_tiled_stages(p, R, hidden, intermediate, suffix);
  set_launch(p, LaunchRole::Combine, "moe_trellis_combine" + suffix,
             ceil_div(int64_t(tokens) * hidden, kMetalCombineThreads), 1, 1, kMetalCombineThreads);
}

}  // namespace torch_marlin
