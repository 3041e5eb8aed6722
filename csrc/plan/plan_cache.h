// Plans cached by everything they depend on: the op's arguments (format or bits, M, K, N, group
// size, activation dtype, bias) and the device caps. A plan is a pure function of these, so a
// cached plan is the plan (tests compare the two), and an op call after the first of its shape
// does no planner work: a decode step calls every layer shape once per token.
// Portable C++17 like the planner itself.
#pragma once

#include <cstddef>
#include <memory>

#include "plan/plan.h"
#include "plan/rans_plan.h"
#include "plan/trellis_plan.h"

namespace torch_marlin {

std::shared_ptr<const GemmPlan> cached_plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N,
                                                       int64_t group_size, DType dtype, bool has_bias,
                                                       const DeviceCaps& caps);

std::shared_ptr<const TrellisPlan> cached_plan_trellis_gemm(int64_t M, int64_t K, int64_t N, int64_t bits,
                                                            int64_t group_size, DType dtype, const DeviceCaps& caps,
                                                            TrellisIndexLayout layout = TrellisIndexLayout::Tiles);

std::shared_ptr<const RansPlan> cached_plan_rans_gemm(int64_t M, int64_t K, int64_t N, int64_t group_size,
                                                      int64_t channels_per_tile, QuantFormat format, DType dtype,
                                                      bool has_bias, const DeviceCaps& caps);

// Plans held (every op family). The cache empties itself when it reaches kPlanCacheCapacity
// entries: a workload of more distinct shapes than that (prefill over every prompt length) plans
// again rather than growing without bound.
size_t plan_cache_size();
void clear_plan_cache();
constexpr size_t kPlanCacheCapacity = 4096;

}  // namespace torch_marlin
