// CPU geometry (csrc/cpu/decode.cpp, csrc/cpu/dequant_blas.cpp): tasks over column tiles.
//  - decode: every packed word read once for all rows;
//  - dequant_blas: column chunks of B dequantized to fp32 once, multiplied by one BLAS call each.
#include <algorithm>

#include "plan/plan_common.h"

namespace torch_marlin {

namespace {
// Decode re-decodes the weights per 4-row chunk and is compute bound: from 9 rows on the
// dequantize-chunk + BLAS path is faster (4096 x 4096: 6.3 ms decode against ~6 ms at M = 8,
// 13 ms against 9 ms at M = 16; benchmarks/notes/cuda-tuning.md CPU-DECODE-MAX-M).
constexpr int64_t kCpuDecodePolicyMaxM = 8;
}  // namespace

int64_t cpu_decode_policy_max_m() { return kCpuDecodePolicyMaxM; }

void plan_cpu(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps) {
  if (p.desc.family == KernelFamily::Decode) {
    // Wide column tiles read 1 KB of each packed row per visit (rows are N words apart, so a
    // narrow tile is latency bound on a new page per row); narrow ones when N is too small to
    // give every thread two tiles.
    const uint32_t tile_n = N >= int64_t(256) * 2 * std::max(1, caps.compute_units) ? 256 : 64;
    set_tiles(p, M, N, uint32_t(kDecodeMaxM), tile_n);
  } else {  // DequantBlas: each task dequantizes a [K, tile_n] panel for every row of A
    set_tiles(p, M, N, uint32_t(std::max<int64_t>(M, 1)), 128);
  }
  set_k_parallel(p, K, 1, TM_PACK_FACTOR);
  p.launches[LaunchRole::Main].grid[0] = p.params.n_tiles;
}

}  // namespace torch_marlin
