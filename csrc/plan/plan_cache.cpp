#include "plan/plan_cache.h"

#include <array>
#include <map>
#include <mutex>

namespace torch_marlin {
namespace {

enum class PlanOp : int64_t { QuantGemm = 0, TrellisGemm = 1, RansGemm = 2 };

// (op, format or bits, dtype, bias, M, K, N, group_size, caps fields): every planner input.
using PlanKey = std::array<int64_t, 15>;

PlanKey make_key(PlanOp op, int64_t variant, DType dtype, bool has_bias, int64_t M, int64_t K, int64_t N,
                 int64_t group_size, const DeviceCaps& c) {
  return {int64_t(op), variant, int64_t(dtype), has_bias ? 1 : 0, M, K, N, group_size, int64_t(c.backend),
          c.compute_units, c.max_shared_memory, c.thread_block_clusters, c.wgmma, c.avx2, c.avx512};
}

struct PlanCache {
  std::mutex mu;
  std::map<PlanKey, std::shared_ptr<const void>> plans;
};

PlanCache& cache() {
  static PlanCache* c = new PlanCache();  // never destroyed: ops may run during interpreter exit
  return *c;
}

// The cached plan for `key`, made by `make` (outside the lock; planning is pure, so two threads
// racing on one key make equal plans and the first stored wins).
template <class Plan, class Make>
std::shared_ptr<const Plan> lookup(const PlanKey& key, Make make) {
  PlanCache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.plans.find(key);
    if (it != c.plans.end()) return std::static_pointer_cast<const Plan>(it->second);
  }
  auto plan = std::make_shared<const Plan>(make());  // planner errors propagate and are not cached
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.plans.size() >= kPlanCacheCapacity) c.plans.clear();
  auto inserted = c.plans.emplace(key, plan);
  return std::static_pointer_cast<const Plan>(inserted.first->second);
}

}  // namespace

std::shared_ptr<const GemmPlan> cached_plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N,
                                                       int64_t group_size, DType dtype, bool has_bias,
                                                       const DeviceCaps& caps) {
  return lookup<GemmPlan>(
      make_key(PlanOp::QuantGemm, int64_t(format), dtype, has_bias, M, K, N, group_size, caps),
      [&] { return plan_quant_gemm(format, M, K, N, group_size, dtype, has_bias, caps); });
}

std::shared_ptr<const TrellisPlan> cached_plan_trellis_gemm(int64_t M, int64_t K, int64_t N, int64_t bits,
                                                            int64_t group_size, DType dtype, const DeviceCaps& caps,
                                                            TrellisIndexLayout layout) {
  // The variant packs the bit width and the index layout.
  const int64_t variant = bits | (int64_t(layout) << 8);
  return lookup<TrellisPlan>(make_key(PlanOp::TrellisGemm, variant, dtype, false, M, K, N, group_size, caps), [&] {
    return plan_trellis_gemm(M, K, N, bits, group_size, dtype, caps, KernelFamily::Auto, layout);
  });
}

std::shared_ptr<const RansPlan> cached_plan_rans_gemm(int64_t M, int64_t K, int64_t N, int64_t group_size,
                                                      int64_t channels_per_tile, QuantFormat format, DType dtype,
                                                      bool has_bias, const DeviceCaps& caps) {
  // The variant packs the format and the tile width (below 2^30, checked by the op).
  const int64_t variant = int64_t(format) | (channels_per_tile << 8);
  return lookup<RansPlan>(make_key(PlanOp::RansGemm, variant, dtype, has_bias, M, K, N, group_size, caps), [&] {
    return plan_rans_gemm(M, K, N, group_size, channels_per_tile, format, dtype, has_bias, caps);
  });
}

size_t plan_cache_size() {
  PlanCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.plans.size();
}

void clear_plan_cache() {
  PlanCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.plans.clear();
}

}  // namespace torch_marlin
