// Test-only module (tests/cpu_with_caps.py builds it JIT, linked against torch_marlin._C; never part
// of the shipped extension): the CPU ops planned with caps the test chooses instead of the machine's,
// through the ops' own checks (prepare_<family>), planner and CPU kernels. avx2=False and
// avx512=False run the portable kernels on any machine; a kernel the build or the CPU lacks is refused.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu/cpu_backend.h"
#include "plan/plan_py.h"

namespace {

using namespace torch_marlin;

DeviceCaps cpu_caps(const py::dict& caps, const at::Tensor& t, const char* who) {
  const DeviceCaps c = caps_from_dict(Backend::CPU, caps);
  const DeviceCaps machine = CpuBackend::caps(t.device());
  TORCH_CHECK_VALUE(t.device().is_cpu(), who, ": the tensors must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(c.avx2 == 0 || machine.avx2 != 0, who,
                    ": caps['avx2'] is set but this build or CPU has no AVX2 kernels");
  TORCH_CHECK_VALUE(c.avx512 == 0 || machine.avx512 != 0, who,
                    ": caps['avx512'] is set but this build or CPU has no AVX-512 kernels");
  return c;
}

at::Tensor gemm_trellis(const py::dict& caps, const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N,
                        int64_t bits, int64_t group_size) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as the ops run (csrc/ops/op_entries.h)
  const DeviceCaps c = cpu_caps(caps, A, "gemm_trellis_cpu_with_caps");
  TrellisGemmCall call = prepare_trellis_gemm(A, packed, scales, grid, su, sv, K, N, bits, group_size, c);
  if (!call.empty) CpuBackend::trellis_gemm(*call.plan, call.args, call.out);
  return call.out;
}

at::Tensor gemm_rans(const py::dict& caps, const at::Tensor& A, const at::Tensor& words, const at::Tensor& word_offsets,
                     const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                     const std::string& format, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                     const c10::optional<at::Tensor>& bias) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const DeviceCaps c = cpu_caps(caps, A, "gemm_rans_cpu_with_caps");
  RansGemmCall call = prepare_rans_gemm(A, RansCodeTensors{words, word_offsets, states, freqs}, scales, zeros, offsets,
                                        format, K, N, group_size, channels_per_tile, bias, c);
  if (!call.empty) CpuBackend::rans_gemm(*call.plan, call.args, call.out);
  return call.out;
}

at::Tensor rans_decode(const py::dict& caps, const at::Tensor& words, const at::Tensor& word_offsets,
                       const at::Tensor& states, const at::Tensor& freqs, int64_t K, int64_t N,
                       int64_t channels_per_tile) {
  const DeviceCaps c = cpu_caps(caps, words, "rans_decode_cpu_with_caps");
  RansDecodeCall call = prepare_rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile, c);
  CpuBackend::rans_decode(*call.plan, call.args, call.out);
  return call.out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_trellis_cpu_with_caps", &gemm_trellis, py::arg("caps"), py::arg("A"), py::arg("packed_indices"),
        py::arg("scales"), py::arg("grid"), py::arg("su"), py::arg("sv"), py::arg("K"), py::arg("N"), py::arg("bits"),
        py::arg("group_size"), "gemm_trellis on the CPU planned with these caps (keys as default_caps).");
  m.def("gemm_rans_cpu_with_caps", &gemm_rans, py::arg("caps"), py::arg("A"), py::arg("words"),
        py::arg("word_offsets"), py::arg("states"), py::arg("freqs"), py::arg("scales"), py::arg("zeros"),
        py::arg("offsets"), py::arg("format"), py::arg("K"), py::arg("N"), py::arg("group_size"),
        py::arg("channels_per_tile"), py::arg("bias") = py::none(),
        "gemm_rans on the CPU planned with these caps: avx2=False runs the portable lane decoder.");
  m.def("rans_decode_cpu_with_caps", &rans_decode, py::arg("caps"), py::arg("words"), py::arg("word_offsets"),
        py::arg("states"), py::arg("freqs"), py::arg("K"), py::arg("N"), py::arg("channels_per_tile"),
        "rans_decode on the CPU planned with these caps: avx2=False runs the portable lane decoder.");
}
