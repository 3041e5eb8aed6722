#include "plan/rans_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace torch_marlin {
namespace {

void fail(const char* who, const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); }

// The shape rules of docs/formats.md ("rANS-coded 4-bit codes"), in the ops' words.
RansParams base_params(int64_t M, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                       const char* who) {
  if (K <= 0 || K % TM_RANS_LANES != 0 || K >= (int64_t(1) << 30)) {
    fail(who, "K must be a positive multiple of 32 below 2^30 (32 lanes decode one scale group's rows), got " +
                  std::to_string(K));
  }
  if (N <= 0 || N >= (int64_t(1) << 30)) fail(who, "N must be positive and below 2^30, got " + std::to_string(N));
  if (M < 0 || M >= (int64_t(1) << 31)) fail(who, "M must be in [0, 2^31), got " + std::to_string(M));
  if (group_size != 0 && (group_size < 0 || group_size % TM_RANS_LANES != 0 || K % group_size != 0)) {
    fail(who, "group_size must be a positive multiple of 32 dividing K = " + std::to_string(K) + ", got " +
                  std::to_string(group_size));
  }
  const int64_t C = channels_per_tile > 0 ? channels_per_tile : rans_default_channels_per_tile(K);
  if (C >= (int64_t(1) << 30)) {
    fail(who, "channels_per_tile must be below 2^30, got " + std::to_string(C));
  }
  RansParams p{};
  p.M = uint32_t(M);
  p.K = uint32_t(K);
  p.N = uint32_t(N);
  p.group_size = uint32_t(group_size);
  p.n_groups = group_size > 0 ? uint32_t(K / group_size) : 0u;
  p.channels_per_tile = uint32_t(C);
  p.tiles = uint32_t((N + C - 1) / C);
  p.steps_per_channel = uint32_t(K / TM_RANS_LANES);
  return p;
}

// One task (CPU) or one 32-thread group (a warp, a simdgroup) per tile.
RansLaunch tile_launch(const std::string& kernel, const RansParams& p, Backend b) {
  RansLaunch l;
  l.kernel = kernel;
  l.grid[0] = p.tiles;
  l.threads[0] = b == Backend::CPU ? 1u : TM_RANS_LANES;
  return l;
}

// CUDA: TM_CUDA_RANS_WARPS warps per block, one tile each (csrc/cuda/rans.cu).
RansLaunch cuda_launch(const std::string& kernel, const RansParams& p) {
  RansLaunch l;
  l.kernel = kernel;
  l.grid[0] = (p.tiles + TM_CUDA_RANS_WARPS - 1u) / TM_CUDA_RANS_WARPS;
  l.threads[0] = TM_CUDA_RANS_WARPS * TM_RANS_LANES;
  return l;
}

// The fused kernels' row count (CUDA and Metal): M rounded up to 1, 2, 4, 8 or 16 (fp32 sums per row in
// registers; the rows past M repeat row M - 1 and are not stored).
uint32_t fused_rows(int64_t M) {
  uint32_t rows = 1;
  while (int64_t(rows) < M) rows *= 2;
  return rows;
}

// The Metal kernels index A, C, B_packed and the scales with 32-bit unsigned arithmetic.
void check_metal_indices(int64_t M, int64_t K, int64_t N) {
  const int64_t lim = int64_t(1) << 32;
  if (M * K >= lim || M * N >= lim || (K / 8) * N >= lim) {
    fail("plan_rans_gemm", "problem too large for the Metal kernels' 32-bit indices");
  }
}

}  // namespace

const char* rans_family_name(RansFamily f) { return f == RansFamily::Fused ? "decode" : "staged"; }

int64_t rans_default_channels_per_tile(int64_t K) {
  if (K <= 0) return 1;
  return std::max<int64_t>(1, (int64_t(TM_RANS_LANES) * TM_RANS_MIN_LANE_SYMBOLS + K - 1) / K);
}

RansPlan plan_rans_gemm(int64_t M, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                        QuantFormat format, DType dtype, bool has_bias, const DeviceCaps& caps) {
  const char* who = "plan_rans_gemm";
  if (group_size <= 0) {
    fail(who, "group_size must be a positive multiple of 32 dividing K, got " + std::to_string(group_size));
  }
  RansPlan p;
  p.caps = caps;
  p.params = base_params(M, K, N, group_size, channels_per_tile, who);
  p.params.format = uint32_t(format);
  p.params.has_bias = has_bias ? 1u : 0u;
  p.family = M <= int64_t(TM_RANS_FUSED_MAX_M) ? RansFamily::Fused : RansFamily::Staged;
  const std::string fmt = format_name(format);
  if (p.family == RansFamily::Staged) {
    p.gemm = plan_quant_gemm(format, M, K, N, group_size, dtype, has_bias, caps);
  }
  switch (caps.backend) {
    case Backend::CPU:
      p.cpu_avx2 = caps.avx2 != 0;
      p.decode = tile_launch(std::string(p.family == RansFamily::Fused ? "cpu_rans_gemm" : "cpu_rans_decode") +
                                 (p.cpu_avx2 ? "_avx2" : ""),
                             p.params, caps.backend);
      break;
    case Backend::Metal:
      // metal/rans.metal, one simdgroup per tile. The fused GEMV keeps R fp32 accumulators per lane,
      // R the power of two >= M (1, 2, 4, 8, 16), as the FP4 / INT4 decode kernels do: a fixed count
      // stays in registers, and M = 1 does not pay for 16.
      check_metal_indices(M, K, N);
      if (p.family == RansFamily::Fused) {
        p.tile_m = fused_rows(M);
        p.decode = tile_launch("rans_gemv_m" + std::to_string(p.tile_m) + "_" + fmt + "_" + dtype_name(dtype),
                               p.params, caps.backend);
      } else {
        p.decode = tile_launch("rans_decode_packed", p.params, caps.backend);
      }
      break;
    case Backend::CUDA:
      if (p.family == RansFamily::Fused) {
        p.tile_m = fused_rows(M);
        p.decode = cuda_launch("gemm_rans_" + fmt + "_" + dtype_name(dtype) + "_m" + std::to_string(p.tile_m),
                               p.params);
      } else {
        p.decode = cuda_launch("rans_decode", p.params);
      }
      break;
  }
  return p;
}

RansPlan plan_rans_decode(int64_t K, int64_t N, int64_t channels_per_tile, const DeviceCaps& caps) {
  RansPlan p;
  p.caps = caps;
  p.params = base_params(0, K, N, 0, channels_per_tile, "plan_rans_decode");
  p.family = RansFamily::Staged;
  p.cpu_avx2 = caps.backend == Backend::CPU && caps.avx2 != 0;
  switch (caps.backend) {
    case Backend::CPU:
      p.decode = tile_launch(p.cpu_avx2 ? "cpu_rans_decode_avx2" : "cpu_rans_decode", p.params, caps.backend);
      break;
    case Backend::Metal:
      check_metal_indices(0, K, N);
      p.decode = tile_launch("rans_decode_packed", p.params, caps.backend);
      break;
    case Backend::CUDA:
      p.decode = cuda_launch("rans_decode", p.params);
      break;
  }
  return p;
}

}  // namespace torch_marlin
