// The trellis planner's entries: validation (in the ops' words), the policy's choice of family
// and the names; each backend's geometry lives in trellis_plan_cpu.cpp, trellis_plan_metal.cpp and
// trellis_plan_cuda.cpp.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "plan/trellis_plan_backends.h"

namespace torch_marlin {
namespace {

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

void check_lanes_backend(const DeviceCaps& caps, const char* who) {
  if (caps.backend != Backend::CUDA) {
    throw std::invalid_argument(std::string(who) + ": indices in the lane layout run on CUDA only, not " +
                                backend_name(caps.backend) +
                                " (torch_marlin.formats.trellis.lanes_to_tiles gives the canonical layout)");
  }
}

// A plan for `caps` with the format's geometry of a K x N matrix (M rows of activations), tiles unset.
TrellisPlan base_plan(int64_t M, int64_t K, int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps) {
  TrellisPlan p;
  p.caps = caps;
  TrellisParams& q = p.params;
  q.M = uint32_t(M);
  q.K = uint32_t(K);
  q.N = uint32_t(N);
  q.bits = uint32_t(bits);
  q.n_levels = 1u << bits;
  q.group_size = uint32_t(group_size);
  q.tiles_k = ceil_div(K, TM_TRELLIS_TILE);
  q.tiles_n = ceil_div(N, TM_TRELLIS_TILE);
  q.packed_bytes = TM_TRELLIS_TILE_ELEMS * uint32_t(bits) / 8u;
  q.n_groups = ceil_div(K, group_size);
  return p;
}

// The policy (canonical tiles): decode up to 16 rows, the backend's prefill family above; CUDA
// fp16/bf16 takes the dense weight + cuBLAS above the decode rows (benchmarks/notes/cuda-tuning.md
// TRELLIS-CUDA-BLAS), so fused_tiles runs there only when forced.
KernelFamily choose_gemm_family(int64_t M, DType dtype, const DeviceCaps& caps, KernelFamily force) {
  const KernelFamily prefill = trellis_prefill_family(caps.backend);
  const bool cuda_blas = caps.backend == Backend::CUDA && dtype != DType::F32;
  KernelFamily family = force;
  if (force == KernelFamily::Auto) {
    family = M <= kDecodeMaxM ? KernelFamily::Decode : prefill;
    if (cuda_blas && M >= trellis_cuda_blas_min_m()) family = KernelFamily::DequantBlas;
  } else if (!(force == KernelFamily::Decode || force == prefill ||
               (cuda_blas && force == KernelFamily::DequantBlas))) {
    throw std::invalid_argument(std::string("plan_trellis_gemm: the ") + family_name(force) +
                                " family does not run trellis on " + backend_name(caps.backend) +
                                " (families there: decode, " + family_name(prefill) + ")");
  }
  if (family == KernelFamily::Decode && M > kDecodeMaxM) {
    throw std::invalid_argument("plan_trellis_gemm: the decode family handles M <= 16 only");
  }
  return family;
}

}  // namespace

void set_trellis_tiles(TrellisParams& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n) {
  set_param_tiles(p, std::max<int64_t>(M, 1), N, tile_m, tile_n);
}

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
  TrellisPlan p = base_plan(M, K, N, bits, group_size, caps);
  if (layout == TrellisIndexLayout::Lanes) {
    check_lanes_backend(caps, "plan_trellis_gemm");
    plan_trellis_gemm_lanes(p, M, K, N, group_size, dtype, caps, force);
    return p;
  }
  p.family = choose_gemm_family(M, dtype, caps, force);
  switch (caps.backend) {
    case Backend::Metal: plan_trellis_gemm_metal(p, M, K, N, dtype); break;
    case Backend::CPU: plan_trellis_gemm_cpu(p, M, N, caps); break;
    case Backend::CUDA: plan_trellis_gemm_cuda(p, M, K, N, group_size, dtype, caps); break;
  }
  return p;
}

TrellisPlan plan_trellis_dequant(int64_t K, int64_t N, int64_t bits, int64_t group_size, const DeviceCaps& caps,
                                 TrellisIndexLayout layout) {
  check_common(K, N, bits, group_size, "plan_trellis_dequant");
  TrellisPlan p = base_plan(0, K, N, bits, group_size, caps);
  p.family = KernelFamily::Auto;  // no GEMM
  set_trellis_tiles(p.params, K, N, TM_TRELLIS_TILE, TM_TRELLIS_TILE);
  if (layout == TrellisIndexLayout::Lanes) {
    check_lanes_backend(caps, "plan_trellis_dequant");
    plan_trellis_dequant_lanes(p);
    return p;
  }
  switch (caps.backend) {
    case Backend::Metal: plan_trellis_dequant_metal(p, K, N); break;
    case Backend::CPU: plan_trellis_dequant_cpu(p); break;
    case Backend::CUDA: plan_trellis_dequant_cuda(p); break;
  }
  return p;
}

TrellisPlan plan_trellis_moe(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                             int64_t top_k, int64_t bits, int64_t group_size, DType dtype, const DeviceCaps& caps) {
  check_common(hidden, intermediate, bits, group_size, "plan_trellis_moe");
  if (tokens < 0 || num_experts <= 0 || top_k <= 0 || top_k > num_experts || tokens * top_k > UINT32_MAX / 2) {
    throw std::invalid_argument("plan_trellis_moe: invalid tokens / num_experts / top_k");
  }
  TrellisPlan p = base_plan(tokens, hidden, intermediate, bits, group_size, caps);
  p.params.num_experts = uint32_t(num_experts);
  p.params.top_k = uint32_t(top_k);
  p.params.down_tiles_k = ceil_div(intermediate, TM_TRELLIS_TILE);
  p.params.down_tiles_n = ceil_div(hidden, TM_TRELLIS_TILE);
  p.params.down_n_groups = ceil_div(intermediate, group_size);
  p.params.max_rows = uint32_t(tokens * top_k);
  p.family = tokens * top_k <= kDecodeMaxM ? KernelFamily::Decode : trellis_prefill_family(caps.backend);
  switch (caps.backend) {
    case Backend::Metal: plan_trellis_moe_metal(p, tokens, hidden, intermediate, dtype); break;
    case Backend::CPU: plan_trellis_moe_cpu(p, tokens, hidden, intermediate, caps); break;
    case Backend::CUDA: plan_trellis_moe_cuda(p, tokens, hidden, intermediate, dtype, caps); break;
  }
  return p;
}

}  // namespace torch_marlin
