#include "plan/rans_plan_metal.h"

#include <stdexcept>
#include <string>

namespace torch_marlin {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("gemm_rans: " + what); }

uint32_t cdiv(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Decode accumulator rows: the power of two >= M, as the FP4 / INT4 decode kernels.
uint32_t decode_rows(int64_t M) {
  uint32_t r = 1;
  while (r < uint32_t(M)) r *= 2u;
  return r;
}

// One simdgroup (32 threads) per tile: the format gives a tile exactly 32 lane states.
RansLaunch tile_launch(const std::string& kernel, uint32_t tiles) {
  RansLaunch l;
  l.kernel = kernel;
  l.grid[0] = tiles;
  l.threads[0] = TM_METAL_RANS_THREADS;
  return l;
}

}  // namespace

RansParams rans_metal_params(int64_t M, int64_t K, int64_t N, int64_t group_size, QuantFormat format,
                             int64_t channels_per_tile, bool has_bias, int64_t n_words) {
  if (K <= 0 || K % TM_RANS_LANES != 0) fail("K must be a positive multiple of 32, got " + std::to_string(K));
  if (N <= 0) fail("N must be positive, got " + std::to_string(N));
  if (M < 0) fail("M must be non-negative, got " + std::to_string(M));
  if (group_size <= 0 || group_size % TM_RANS_LANES != 0 || K % group_size != 0) {
    fail("group_size must be a positive multiple of 32 dividing K=" + std::to_string(K) + ", got " +
         std::to_string(group_size));
  }
  if (channels_per_tile <= 0) fail("channels_per_tile must be positive, got " + std::to_string(channels_per_tile));
  if (n_words < 0) fail("words must not be negative in length");
  // 32-bit indices in the kernels: elements of A, C and B_packed, stream words.
  if (K * N >= (int64_t(1) << 32) || M * K >= (int64_t(1) << 32) || M * N >= (int64_t(1) << 32) ||
      n_words >= (int64_t(1) << 31) || channels_per_tile >= (int64_t(1) << 31)) {
    fail("problem too large for the Metal kernels' 32-bit indices");
  }
  RansParams p{};
  p.M = uint32_t(M);
  p.K = uint32_t(K);
  p.N = uint32_t(N);
  p.group_size = uint32_t(group_size);
  p.n_groups = uint32_t(K / group_size);
  p.format = uint32_t(format);
  p.channels_per_tile = uint32_t(channels_per_tile);
  p.tiles = cdiv(N, channels_per_tile);
  p.steps_per_channel = uint32_t(K / TM_RANS_LANES);
  p.has_bias = has_bias ? 1u : 0u;
  p.n_words = uint32_t(n_words);
  return p;
}

RansMetalPlan plan_rans_gemm_metal(int64_t M, int64_t K, int64_t N, int64_t group_size, QuantFormat format,
                                   DType dtype, int64_t channels_per_tile, bool has_bias, int64_t n_words,
                                   const DeviceCaps& caps, KernelFamily force) {
  if (M <= 0) fail("A must have at least one row, got M=" + std::to_string(M));
  RansMetalPlan plan;
  plan.params = rans_metal_params(M, K, N, group_size, format, channels_per_tile, has_bias, n_words);
  const bool decode = force == KernelFamily::Decode || (force == KernelFamily::Auto && M <= kDecodeMaxM);
  if (force == KernelFamily::Decode && M > kDecodeMaxM) {
    fail("the decode family takes at most " + std::to_string(kDecodeMaxM) + " rows, got M=" + std::to_string(M));
  }
  if (decode) {
    plan.family = KernelFamily::Decode;
    plan.rows = decode_rows(M);
    plan.decode = tile_launch("rans_gemv_m" + std::to_string(plan.rows) + "_" + format_name(format) + "_" +
                                  dtype_name(dtype),
                              plan.params.tiles);
    return plan;
  }
  plan.gemm = plan_quant_gemm(format, M, K, N, group_size, dtype, has_bias, caps, force);
  plan.family = plan.gemm.desc.family;
  plan.decode = tile_launch("rans_decode_packed", plan.params.tiles);
  plan.decoded_bytes = size_t(K / 8) * size_t(N) * 4u;
  return plan;
}

RansMetalPlan plan_rans_decode_metal(int64_t K, int64_t N, int64_t channels_per_tile, int64_t n_words) {
  RansMetalPlan plan;
  plan.params = rans_metal_params(0, K, N, TM_RANS_LANES, QuantFormat::FP4, channels_per_tile, false, n_words);
  plan.family = KernelFamily::Auto;
  plan.decode = tile_launch("rans_decode_packed", plan.params.tiles);
  return plan;
}

}  // namespace torch_marlin
