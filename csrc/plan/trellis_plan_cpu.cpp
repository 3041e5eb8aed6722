// CPU geometry of the trellis family. Decode (csrc/cpu/trellis_decode.cpp): each task owns a
// contiguous column block and streams its tile rows front to back, keeping M x tile_n fp32
// accumulators; tile_n is as wide as kCpuDecodeAccFloats allows (long sequential runs per tile row,
// accumulators in L1), with a task count that is a multiple of the thread count (equal shares, no
// split K). The prefill path (csrc/cpu/trellis.cpp) dequantizes column chunks of at most
// k_chunk * 128 fp32 (8 MiB) with all threads and hands each chunk to one BLAS call (few, large
// calls; BLAS per tile inside the parallel region oversubscribed the cores).
#include <algorithm>

#include "plan/trellis_plan_backends.h"

namespace torch_marlin {
namespace {

constexpr int64_t kCpuDecodeAccFloats = 4096;  // 16 KiB, half of a 32 KiB L1d
constexpr uint32_t kCpuPrefillTileN = 128;
constexpr uint32_t kCpuKChunk = 16384;
constexpr uint32_t kCpuMoeTileN = 64;

// The decode kernel: the AVX-512 one (caps.avx512), else the AVX2 one (caps.avx2), else the portable one.
void set_decode_kernel(TrellisPlan& p, const DeviceCaps& caps) {
  p.cpu_avx512 = caps.avx512 != 0;
  p.cpu_avx2 = !p.cpu_avx512 && caps.avx2 != 0;
}

}  // namespace

void plan_trellis_gemm_cpu(TrellisPlan& p, int64_t M, int64_t N, const DeviceCaps& caps) {
  KernelLaunch& main = p.launches[LaunchRole::Main];
  if (p.family == KernelFamily::Decode) {
    const int64_t threads = std::max(1, caps.compute_units);
    const int64_t max_cols = std::max<int64_t>(TM_TRELLIS_TILE, kCpuDecodeAccFloats / std::max<int64_t>(M, 1) /
                                                                    TM_TRELLIS_TILE * TM_TRELLIS_TILE);
    const int64_t tasks = threads * ((N + threads * max_cols - 1) / (threads * max_cols));
    const int64_t tile_n = (N + tasks - 1) / tasks;
    set_trellis_tiles(p.params, M, N, uint32_t(kDecodeMaxM), ceil_div(tile_n, TM_TRELLIS_TILE) * TM_TRELLIS_TILE);
    set_decode_kernel(p, caps);
    main.kernel = p.cpu_avx512 ? "cpu_trellis_decode_avx512"
                  : p.cpu_avx2 ? "cpu_trellis_decode_avx2"
                               : "cpu_trellis_decode";
  } else {
    set_trellis_tiles(p.params, M, N, uint32_t(std::max<int64_t>(M, 1)), kCpuPrefillTileN);
    main.kernel = "cpu_trellis_prefill";
  }
  main.grid[0] = p.params.n_tiles;
  p.k_chunk = kCpuKChunk;
}

void plan_trellis_dequant_cpu(TrellisPlan& p) {
  KernelLaunch& dequant = p.launches[LaunchRole::Main];
  dequant.kernel = "cpu_trellis_dequant";
  dequant.grid[0] = p.params.tiles_k;
}

void plan_trellis_moe_cpu(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate,
                          const DeviceCaps& caps) {
  const uint32_t E = p.params.num_experts;
  set_trellis_tiles(p.params, kDecodeMaxM, intermediate, uint32_t(kDecodeMaxM), kCpuMoeTileN);
  set_decode_kernel(p, caps);  // the decode stages' kernel, as for the GEMM
  KernelLaunch& gate_up = p.launches[LaunchRole::Main];
  gate_up.kernel = "cpu_trellis_moe_gate_up";
  gate_up.grid[0] = p.params.n_tiles;
  gate_up.grid[1] = E;
  KernelLaunch& down = p.launches[LaunchRole::Down];
  down.kernel = "cpu_trellis_moe_down";
  down.grid[0] = ceil_div(hidden, kCpuMoeTileN);
  down.grid[1] = E;
  KernelLaunch& combine = p.launches[LaunchRole::Combine];
  combine.kernel = "cpu_trellis_moe_combine";
  combine.grid[0] = uint32_t(tokens);
  p.k_chunk = kCpuKChunk;
}

}  // namespace torch_marlin
