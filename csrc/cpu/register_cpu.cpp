// The CPU backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key CPU through the op entry points (csrc/ops/op_entries.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/cpu_backend.h"
#include "cpu/trellis_cpu.h"
#include "ops/op_entries.h"

namespace torch_marlin {

DeviceCaps CpuBackend::caps(const at::Device&) {
  DeviceCaps c;
  c.backend = Backend::CPU;
  c.compute_units = at::get_num_threads();
#if defined(__AVX2__) && defined(__FMA__)
  static const bool cpu_has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  c.avx2 = cpu_has_avx2 ? 1 : 0;
#endif
#if defined(TM_TRELLIS_AVX512)
  c.avx512 = cpu_runs_trellis_avx512() ? 1 : 0;
#endif
  return c;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode(const at::Tensor& B, int64_t channels_per_tile) {
  const at::Tensor packed = prepare_rans_encode(B, channels_per_tile);
  return rans_encode_cpu(packed, channels_per_tile);
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  register_backend_ops<CpuBackend>(m);
  m.impl("rans_encode", &rans_encode);  // the host encoder: the CPU alone runs it
}

}  // namespace torch_marlin
