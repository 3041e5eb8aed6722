// The rANS planner's entries: validation (in the ops' words) and the family; each backend's geometry
// lives in rans_plan_cpu.cpp, rans_plan_metal.cpp and rans_plan_cuda.cpp.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/rans_plan_backends.h"

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

}  // namespace

KernelLaunch rans_tile_launch(const std::string& kernel, const RansParams& p, Backend b) {
  KernelLaunch l;
  l.kernel = kernel;
  l.grid[0] = p.tiles;
  l.threads[0] = b == Backend::CPU ? 1u : TM_RANS_LANES;
  return l;
}

uint32_t rans_fused_rows(int64_t M) {
  uint32_t rows = 1;
  while (int64_t(rows) < M) rows *= 2;
  return rows;
}

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
  if (p.family == RansFamily::Staged) {
    p.gemm = plan_quant_gemm(format, M, K, N, group_size, dtype, has_bias, caps);
  }
  switch (caps.backend) {
    case Backend::CPU: plan_rans_gemm_cpu(p, caps); break;
    case Backend::Metal: plan_rans_gemm_metal(p, M, K, N, format, dtype); break;
    case Backend::CUDA: plan_rans_gemm_cuda(p, M, format, dtype); break;
  }
  return p;
}

RansPlan plan_rans_decode(int64_t K, int64_t N, int64_t channels_per_tile, const DeviceCaps& caps) {
  RansPlan p;
  p.caps = caps;
  p.params = base_params(0, K, N, 0, channels_per_tile, "plan_rans_decode");
  p.family = RansFamily::Staged;
  switch (caps.backend) {
    case Backend::CPU: plan_rans_decode_cpu(p, caps); break;
    case Backend::Metal: plan_rans_decode_metal(p, K, N); break;
    case Backend::CUDA: plan_rans_decode_cuda(p); break;
  }
  return p;
}

}  // namespace torch_marlin
