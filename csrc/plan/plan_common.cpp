#include "plan/plan_common.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace torch_marlin {

uint32_t ceil_div(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

void check_metal_indices(std::initializer_list<uint64_t> extents, const char* who) {
  for (uint64_t e : extents) {
    if (e >= (uint64_t(1) << 32)) {
      throw std::invalid_argument(std::string(who) + ": problem too large for the Metal kernels' 32-bit indices");
    }
  }
}

void set_tiles(GemmPlan& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n) {
  set_param_tiles(p.params, M, N, tile_m, tile_n);
  p.desc.tile_m = tile_m;
  p.desc.tile_n = tile_n;
}

void set_k_slices(QuantGemmParams& q, int64_t K, uint32_t k_parallel, uint32_t k_step) {
  const uint32_t k_steps = ceil_div(K, k_step);
  k_parallel = std::max<uint32_t>(1, std::min(k_parallel, k_steps));
  const uint32_t steps_per_slice = ceil_div(k_steps, k_parallel);
  q.k_slice_len = steps_per_slice * k_step;
  // Recompute so no slice is empty (e.g. 10 steps / 4 slices -> 3,3,3,1 not 3,3,3,3).
  q.k_parallel = ceil_div(K, q.k_slice_len);
}

void set_k_parallel(GemmPlan& p, int64_t K, uint32_t k_parallel, uint32_t k_step) {
  set_k_slices(p.params, K, k_parallel, k_step);
}

void set_partials_workspace(GemmPlan& p, size_t slice_floats) {
  if (p.params.k_parallel <= 1) return;
  p.workspace_bytes = size_t(p.params.k_parallel) * slice_floats * sizeof(float);
}

void set_second_dispatch_reduction(GemmPlan& p, const char* reduce_kernel, uint32_t threads) {
  const QuantGemmParams& q = p.params;
  if (q.k_parallel <= 1) return;
  set_partials_workspace(p, size_t(q.M) * q.N);
  p.desc.reduce = ReduceKind::SecondDispatch;
  KernelLaunch& reduce = p.launches[LaunchRole::Reduce];
  reduce.kernel = reduce_kernel;
  reduce.threads[0] = threads;
  reduce.grid[0] = ceil_div(int64_t(q.M) * q.N, threads);
}

uint32_t k_split_for(int64_t tiles, int64_t K, uint32_t k_step, int compute_units, int waves,
                     uint32_t min_steps_per_slice) {
  const int64_t want = int64_t(compute_units) * waves;
  if (tiles >= want) return 1;
  const int64_t k_steps = (K + k_step - 1) / k_step;
  const int64_t by_units = (want + tiles - 1) / tiles;
  const int64_t by_k = k_steps / min_steps_per_slice;
  return uint32_t(std::max<int64_t>(1, std::min<int64_t>({by_units, by_k, 16})));
}

}  // namespace torch_marlin
