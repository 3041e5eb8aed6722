// Metal-on-CPU harness of the rANS kernels (metal/rans.metal), part of the FP4 / INT4 harness
// module (the staged family runs rans_decode_packed, then that module's prefill GEMM). Plans as the
// MPS backend does (plan_rans_gemm with Backend::Metal), binds the tensors to the same dispatch description
// (csrc/plan/metal_dispatch.h) and runs it on the CPU executor.
//
// Bounds: the kernels must never read outside a tile's stream, even when the stream, the states,
// the frequencies or the offsets are corrupted. The harness copies `words` so that its last byte
// ends a page followed by an inaccessible page: a read past the buffer faults (the test process
// dies) instead of reading a neighbour's bytes.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <memory>

#include "emu_common.h"
#include "ops/vector_aligned.h"
#include "plan/plan_py.h"
#include "plan/rans_plan.h"
#include "runtime.h"

namespace torch_marlin {
namespace {

// A copy of a tensor's bytes whose end touches a PROT_NONE page (the start stays 16-byte aligned:
// the stream is a whole number of 16-byte vectors).
class GuardedCopy {
 public:
  explicit GuardedCopy(const at::Tensor& t) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    bytes_ = size_t(t.nbytes());
    const size_t data_pages = (bytes_ + page - 1) / page;
    map_bytes_ = (data_pages + 1) * page;
    void* m = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(m != MAP_FAILED, "metal_emu: mmap failed");
    base_ = static_cast<unsigned char*>(m);
    TORCH_CHECK(mprotect(base_ + data_pages * page, page, PROT_NONE) == 0, "metal_emu: mprotect failed");
    data_ = base_ + data_pages * page - bytes_;
    TORCH_CHECK(reinterpret_cast<uintptr_t>(data_) % 16u == 0u, "metal_emu: words must be a whole number of 16-byte vectors");
    if (bytes_ > 0) std::memcpy(data_, t.data_ptr(), bytes_);
    view_ = at::from_blob(data_, {int64_t(t.numel())}, t.options());
  }
  ~GuardedCopy() { munmap(base_, map_bytes_); }
  GuardedCopy(const GuardedCopy&) = delete;
  GuardedCopy& operator=(const GuardedCopy&) = delete;
  const at::Tensor& tensor() const { return view_; }

 private:
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0, map_bytes_ = 0;
  at::Tensor view_;
};

void check_code_tensors(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                        const at::Tensor& freqs) {
  for (const at::Tensor* t : {&words, &word_offsets, &states, &freqs})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "metal_emu: the rANS tensors must be on the CPU");
  TORCH_CHECK_VALUE(words.scalar_type() == at::kShort && words.dim() == 1, "metal_emu: words must be int16 [W]");
  TORCH_CHECK_VALUE(words.numel() % TM_RANS_STREAM_ALIGN_WORDS == 0, "metal_emu: len(words) must be a multiple of 8");
  TORCH_CHECK_VALUE(word_offsets.scalar_type() == at::kInt && states.scalar_type() == at::kInt &&
                        freqs.scalar_type() == at::kShort,
                    "metal_emu: word_offsets and states must be int32, freqs int16");
}

struct CodeTensors {
  std::unique_ptr<GuardedCopy> words;
  at::Tensor word_offsets, states, freqs;
  RansCodeBuffers<void*> buffers() const {
    return RansCodeBuffers<void*>{words->tensor().data_ptr(), word_offsets.data_ptr(), states.data_ptr(),
                                  freqs.data_ptr()};
  }
  void note() const {
    note_buffers({{"words", &words->tensor()}, {"word_offsets", &word_offsets}, {"states", &states}, {"freqs", &freqs}});
  }
};

CodeTensors code_tensors(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                         const at::Tensor& freqs, int64_t tiles) {
  check_code_tensors(words, word_offsets, states, freqs);
  TORCH_CHECK_VALUE(word_offsets.numel() == tiles + 1 && states.numel() == tiles * TM_RANS_LANES &&
                        freqs.numel() == tiles * TM_RANS_SYMBOLS,
                    "metal_emu: word_offsets [T+1], states [T, 32] and freqs [T, 16] for T = ", tiles);
  CodeTensors c;
  c.words = std::make_unique<GuardedCopy>(words.contiguous());
  c.word_offsets = word_offsets.contiguous();
  c.states = states.contiguous();
  c.freqs = contiguous_aligned(freqs);
  return c;
}

RansPlan plan_gemm(int64_t M, int64_t K, int64_t N, int64_t group_size, QuantFormat f, DType dtype,
                   int64_t channels_per_tile, bool has_bias) {
  return described([&] {
    return plan_rans_gemm(M, K, N, group_size, channels_per_tile, f, dtype, has_bias, default_metal_caps());
  });
}

// C = A @ dequant(decode(words)) (+ bias). C, the scratch and the workspace start as NaN.
std::tuple<at::Tensor, py::dict> gemm_rans(const at::Tensor& A_in, const at::Tensor& words, const at::Tensor& word_offsets,
                                           const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales_in,
                                           const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                                           const std::string& format, int64_t K, int64_t N, int64_t group_size,
                                           int64_t channels_per_tile, const c10::optional<at::Tensor>& bias_in,
                                           const std::string& schedule, uint64_t seed,
                                           int workers, const std::string& prefix) {
  const QuantFormat f = parse_format(format);
  TORCH_CHECK_VALUE(A_in.device().is_cpu() && A_in.dim() == 2 && A_in.size(1) == K, "metal_emu: A must be CPU [M, K]");
  TORCH_CHECK_VALUE(f != QuantFormat::U4 || zeros.has_value(), "metal_emu: u4 needs zeros");
  TORCH_CHECK_VALUE(f != QuantFormat::Affine || offsets.has_value(), "metal_emu: affine needs offsets");
  const at::Tensor A = contiguous_aligned(A_in), scales = contiguous_aligned(scales_in);
  const RansPlan plan = plan_gemm(A.size(0), K, N, group_size, f, dtype_of(A), channels_per_tile, bias_in.has_value());
  const CodeTensors code = code_tensors(words, word_offsets, states, freqs, plan.params.tiles);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor C = at::full({A.size(0), N}, nan, A.options());
  if (A.size(0) == 0) return {C, rans_plan_to_dict(plan)};  // as the op: nothing to launch
  at::Tensor aux;
  if (f == QuantFormat::U4) aux = contiguous_aligned(*zeros);
  if (f == QuantFormat::Affine) aux = contiguous_aligned(*offsets);
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  at::Tensor decoded, ws;
  const bool staged = plan.family == RansFamily::Staged;
  if (staged) decoded = at::full({K / 8, N}, -1, A.options().dtype(at::kInt));
  if (staged && plan.gemm.workspace_bytes > 0) {
    ws = at::full({int64_t(plan.gemm.workspace_bytes / sizeof(float))}, nan, A.options().dtype(at::kFloat));
  }
  RansGemmBuffers<void*> b;
  b.A = A.data_ptr();
  b.code = code.buffers();
  b.scales = scales.data_ptr();
  if (aux.defined()) b.zeros_or_offsets = aux.data_ptr();
  if (bias.defined()) b.bias = bias.data_ptr();
  b.C = C.data_ptr();
  if (decoded.defined()) b.decoded = decoded.data_ptr();
  if (ws.defined()) b.workspace = ws.data_ptr();
  code.note();
  note_buffers({{"A", &A}, {"scales", &scales}, {"zeros_or_offsets", &aux}, {"bias", &bias}, {"C", &C},
                {"B", &decoded}, {"workspace", &ws}});
  run_dispatches(described([&] { return rans_gemm_dispatches(plan, b, uint32_t(words.numel())); }),
                 RunOpts{schedule, seed, workers, prefix});
  return {C, rans_plan_to_dict(plan)};
}

// B_packed[K/8, N] = decode(words); starts as -1 so an unwritten word cannot pass.
at::Tensor rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                       const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile,
                       const std::string& schedule, uint64_t seed, int workers, const std::string& prefix) {
  const RansPlan plan = described([&] { return plan_rans_decode(K, N, channels_per_tile, default_metal_caps()); });
  const CodeTensors code = code_tensors(words, word_offsets, states, freqs, plan.params.tiles);
  at::Tensor B = at::full({K / 8, N}, -1, word_offsets.options().dtype(at::kInt));
  code.note();
  note_buffers({{"B_packed", &B}});
  const RansDecodeBuffers<void*> b{code.buffers(), B.data_ptr()};
  run_dispatches(described([&] { return rans_decode_dispatches(plan, b, uint32_t(words.numel())); }),
                 RunOpts{schedule, seed, workers, prefix});
  return B;
}

RansCodeBuffers<std::string> code_names() { return {"words", "word_offsets", "states", "freqs"}; }

py::list describe_gemm_rans(const std::string& format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                            int64_t channels_per_tile, const std::string& dtype, bool has_bias,
                            bool has_zeros_or_offsets) {
  const RansPlan plan =
      plan_gemm(M, K, N, group_size, parse_format(format), parse_dtype(dtype), channels_per_tile, has_bias);
  RansGemmBuffers<std::string> b;
  b.A = "A";
  b.code = code_names();
  b.scales = "scales";
  if (has_zeros_or_offsets) b.zeros_or_offsets = "zeros_or_offsets";
  if (has_bias) b.bias = "bias";
  b.C = "C";
  const bool staged = plan.family == RansFamily::Staged;
  if (staged) b.decoded = "B";
  if (staged && plan.gemm.workspace_bytes > 0) b.workspace = "workspace";
  return dispatches_to_py(described([&] { return rans_gemm_dispatches(plan, b, 0u); }));
}

py::list describe_rans_decode(int64_t K, int64_t N, int64_t channels_per_tile) {
  const RansPlan plan = described([&] { return plan_rans_decode(K, N, channels_per_tile, default_metal_caps()); });
  const RansDecodeBuffers<std::string> b{code_names(), "B_packed"};
  return dispatches_to_py(described([&] { return rans_decode_dispatches(plan, b, 0u); }));
}

}  // namespace

void def_rans_functions(py::module_& m) {
  m.def("gemm_rans", &gemm_rans, py::arg("A"), py::arg("words"), py::arg("word_offsets"), py::arg("states"),
        py::arg("freqs"), py::arg("scales"), py::arg("zeros"), py::arg("offsets"), py::arg("format"), py::arg("K"),
        py::arg("N"), py::arg("group_size"), py::arg("channels_per_tile"), py::arg("bias") = py::none(),
        py::arg("schedule") = "forward", py::arg("seed") = 0, py::arg("workers") = 0,
        py::arg("prefix") = "");
  m.def("rans_decode", &rans_decode, py::arg("words"), py::arg("word_offsets"), py::arg("states"), py::arg("freqs"),
        py::arg("K"), py::arg("N"), py::arg("channels_per_tile"), py::arg("schedule") = "forward",
        py::arg("seed") = 0, py::arg("workers") = 0, py::arg("prefix") = "");
  m.def("describe_gemm_rans", &describe_gemm_rans, py::arg("format"), py::arg("M"), py::arg("K"), py::arg("N"),
        py::arg("group_size"), py::arg("channels_per_tile"), py::arg("dtype") = "float16", py::arg("has_bias") = true,
        py::arg("has_zeros_or_offsets") = true);
  m.def("describe_rans_decode", &describe_rans_decode, py::arg("K"), py::arg("N"), py::arg("channels_per_tile"));
}

}  // namespace torch_marlin
