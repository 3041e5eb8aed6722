// plan_quant_gemm: validation, the policy's choice of kernel family (choose_family: every
// branch on shape, dtype and device caps that picks a family is there), then the backend's
// geometry (plan_cpu.cpp, plan_metal.cpp, plan_cuda.cpp). Also the names of everything.
#include "plan/plan.h"

#include <stdexcept>
#include <string>

#include "plan/plan_common.h"

namespace torch_marlin {

const char* family_name(KernelFamily f) {
  switch (f) {
    case KernelFamily::Auto: return "auto";
    case KernelFamily::Decode: return "decode";
    case KernelFamily::DequantBlas: return "dequant_blas";
    case KernelFamily::FusedTiles: return "fused_tiles";
    case KernelFamily::StagedTiles: return "staged_tiles";
    case KernelFamily::Striped: return "striped";
    case KernelFamily::Simt: return "simt";
    case KernelFamily::Wgmma: return "wgmma";
    case KernelFamily::WgmmaWs: return "wgmma_ws";
  }
  return "?";
}

const char* reduce_name(ReduceKind r) {
  switch (r) {
    case ReduceKind::None: return "none";
    case ReduceKind::SecondDispatch: return "second_dispatch";
    case ReduceKind::Cluster: return "cluster";
    case ReduceKind::LastBlock: return "last_block";
  }
  return "?";
}

const char* launch_role_name(LaunchRole r) {
  switch (r) {
    case LaunchRole::Route: return "route";
    case LaunchRole::Activations: return "activations";
    case LaunchRole::Decode: return "decode";
    case LaunchRole::Main: return "main";
    case LaunchRole::Tail: return "tail";
    case LaunchRole::TiledGate: return "tiled_gate";
    case LaunchRole::TiledUp: return "tiled_up";
    case LaunchRole::Down: return "down";
    case LaunchRole::TiledDown: return "tiled_down";
    case LaunchRole::Reduce: return "reduce";
    case LaunchRole::Combine: return "combine";
  }
  return "?";
}

const KernelLaunch* LaunchList::find(LaunchRole role) const {
  const auto it = launches_.find(role);
  return it == launches_.end() ? nullptr : &it->second;
}

const KernelLaunch& LaunchList::at(LaunchRole role) const {
  const KernelLaunch* l = find(role);
  if (l == nullptr) throw std::logic_error(std::string("the plan has no ") + launch_role_name(role) + " launch");
  return *l;
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::CPU: return "cpu";
    case Backend::Metal: return "metal";
    case Backend::CUDA: return "cuda";
  }
  return "?";
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F16: return "half";
    case DType::BF16: return "bfloat";
    case DType::F32: return "float";
  }
  return "?";
}

const char* format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::FP4: return "fp4";
    case QuantFormat::U4: return "u4";
    case QuantFormat::Affine: return "affine";
  }
  return "?";
}
static_assert(int(QuantFormat::FP4) == TM_FORMAT_FP4 && int(QuantFormat::U4) == TM_FORMAT_U4 &&
                  int(QuantFormat::Affine) == TM_FORMAT_AFFINE,
              "QuantFormat values are the kernels' TM_FORMAT_* template arguments");

namespace {

// Metal function stems (metal/*.metal).
const char* metal_stem(KernelFamily f) {
  switch (f) {
    case KernelFamily::FusedTiles: return "marlin_gemm_fused";
    case KernelFamily::StagedTiles: return "marlin_gemm";
    case KernelFamily::Striped: return "marlin_gemm_striped";
    default: return nullptr;
  }
}

}  // namespace

std::string kernel_name(const KernelDesc& k) {
  const std::string suffix = std::string("_") + format_name(k.format) + "_" + dtype_name(k.dtype);
  switch (k.backend) {
    case Backend::CPU: return std::string("cpu_") + family_name(k.family);
    case Backend::Metal: {
      // Decode: one kernel per row count (tile_m) with 16-byte weight loads, one without.
      if (k.family == KernelFamily::Decode) {
        return (k.vector_loads ? "marlin_gemv_m" + std::to_string(k.tile_m) : std::string("marlin_gemv_unaligned")) +
               suffix;
      }
      const char* stem = metal_stem(k.family);
      if (stem == nullptr) return std::string();
      // The fused and striped families' 32-row tile: <stem>_m32_<fmt>_<dtype>.
      return stem + std::string(k.tile_m == TM_METAL_SMALL_TILE_M ? "_m32" : "") + suffix;
    }
    case Backend::CUDA: return family_name(k.family) + suffix;  // decode_fp4_half, wgmma_ws_u4_bfloat, ...
  }
  return std::string();
}

DeviceCaps default_caps(Backend b) {
  if (b == Backend::Metal) return default_metal_caps();
  DeviceCaps caps;
  caps.backend = b;
  return caps;
}

namespace {

// Families each backend implements, per activation dtype.
bool family_runs_on(KernelFamily f, Backend b, DType d) {
  switch (b) {
    case Backend::CPU: return f == KernelFamily::Decode || f == KernelFamily::DequantBlas;
    case Backend::Metal:
      return f == KernelFamily::Decode || f == KernelFamily::FusedTiles || f == KernelFamily::StagedTiles ||
             f == KernelFamily::Striped;
    case Backend::CUDA:
      if (d == DType::F32) return f == KernelFamily::Simt;  // no tensor-core path for fp32 activations
      return f == KernelFamily::Decode || f == KernelFamily::DequantBlas || f == KernelFamily::Wgmma ||
             f == KernelFamily::WgmmaWs;
  }
  return false;
}

std::string families_on(Backend b, DType d) {
  std::string s;
  for (KernelFamily f : {KernelFamily::Decode, KernelFamily::DequantBlas, KernelFamily::FusedTiles,
                         KernelFamily::StagedTiles, KernelFamily::Striped, KernelFamily::Simt, KernelFamily::Wgmma,
                         KernelFamily::WgmmaWs}) {
    if (family_runs_on(f, b, d)) s += std::string(s.empty() ? "" : ", ") + family_name(f);
  }
  return s;
}

// Rows up to which the policy picks decode, measured per backend: CUDA's decode kernel streams
// the weights once per 64 rows (plan_cuda.cpp); the CPU's is compute bound (plan_cpu.cpp);
// Metal keeps the design's M <= 16 (no hardware to measure on).
int64_t decode_policy_max_m(Backend b) {
  switch (b) {
    case Backend::CUDA: return cuda_decode_max_m();
    case Backend::CPU: return cpu_decode_policy_max_m();
    case Backend::Metal: return kDecodeMaxM;
  }
  return kDecodeMaxM;
}

// Most rows the decode kernels of a backend handle (a forced decode beyond is refused).
int64_t decode_kernel_max_m(Backend b) { return b == Backend::CUDA ? cuda_decode_max_m() : kDecodeMaxM; }

// The policy.
KernelFamily choose_family(int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype, const DeviceCaps& caps) {
  switch (caps.backend) {
    case Backend::CUDA:
      if (dtype == DType::F32) return KernelFamily::Simt;
      if (cuda_wgmma_ws_pays(M, K, N, group_size, caps)) return KernelFamily::WgmmaWs;
      if (cuda_wgmma_pays(M, K, N, group_size, caps)) return KernelFamily::Wgmma;
      return M <= decode_policy_max_m(Backend::CUDA) ? KernelFamily::Decode : KernelFamily::DequantBlas;
    case Backend::Metal:
      if (M <= decode_policy_max_m(Backend::Metal)) return KernelFamily::Decode;
      return metal_striped_pays(M, K, N, caps) ? KernelFamily::Striped : KernelFamily::FusedTiles;
    case Backend::CPU:
      return M <= decode_policy_max_m(Backend::CPU) ? KernelFamily::Decode : KernelFamily::DequantBlas;
  }
  return KernelFamily::Decode;
}

}  // namespace

void check_quant_group_size(int64_t K, int64_t group_size, const char* who) {
  auto fail = [who](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  if (group_size <= 0 || group_size % TM_PACK_FACTOR != 0) {
    fail("group_size must be a positive multiple of 8, got " + std::to_string(group_size));
  }
  if (K % group_size != 0) {
    fail("group_size (" + std::to_string(group_size) + ") must divide K (" + std::to_string(K) + ")");
  }
}

namespace {

// The op's own checks (csrc/ops/quant_gemm.cpp), in its words, for callers of the planner alone.
void check_shape(int64_t M, int64_t K, int64_t N, int64_t group_size) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("plan_quant_gemm: " + what); };
  if (M < 0 || M > UINT32_MAX) fail("M must be in [0, 2^32), got " + std::to_string(M));
  if (K <= 0 || K % TM_PACK_FACTOR != 0) fail("K must be a positive multiple of 8, got " + std::to_string(K));
  check_quant_group_size(K, group_size, "plan_quant_gemm");
  if (N <= 0) fail("N must be positive, got " + std::to_string(N) + " (the ops return N = 0 results unplanned)");
  if (K > UINT32_MAX || N > UINT32_MAX) fail("K and N must fit in 32 bits");
}

}  // namespace

GemmPlan plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                         DType dtype, bool has_bias, const DeviceCaps& caps, KernelFamily force) {
  check_shape(M, K, N, group_size);
  GemmPlan p;
  p.caps = caps;
  p.params.M = uint32_t(M);
  p.params.K = uint32_t(K);
  p.params.N = uint32_t(N);
  p.params.group_size = uint32_t(group_size);
  p.params.has_bias = has_bias ? 1u : 0u;
  p.params.k_parallel = 1;
  p.desc.backend = caps.backend;
  p.desc.format = format;
  p.desc.dtype = dtype;
  p.desc.family = force != KernelFamily::Auto ? force : choose_family(M, K, N, group_size, dtype, caps);

  if (!family_runs_on(p.desc.family, caps.backend, dtype)) {
    throw std::invalid_argument(std::string("plan_quant_gemm: the ") + family_name(p.desc.family) +
                                " family does not run on " + backend_name(caps.backend) + " with " +
                                dtype_name(dtype) + " activations (families there: " +
                                families_on(caps.backend, dtype) + ")");
  }
  if (p.desc.family == KernelFamily::Decode && M > decode_kernel_max_m(caps.backend)) {
    throw std::invalid_argument("plan_quant_gemm: the decode family handles M <= 16 only (128 on CUDA)");
  }

  switch (caps.backend) {
    case Backend::Metal: plan_metal(p, M, K, N, caps); break;
    case Backend::CUDA: plan_cuda(p, M, K, N, caps); break;
    case Backend::CPU: plan_cpu(p, M, K, N, caps); break;
  }
  // The backend planned the grids; the kernel is the desc's (a Tail launch runs it on the last tiles).
  const std::string kernel = kernel_name(p.desc);
  p.launches[LaunchRole::Main].kernel = kernel;
  if (p.launches.find(LaunchRole::Tail) != nullptr) p.launches[LaunchRole::Tail].kernel = kernel;
  return p;
}

}  // namespace torch_marlin
