// MPS backend of the rANS op family: binds the op's tensors to the dispatch description
// (csrc/plan/metal_dispatch.h, the same one the Metal-on-CPU harness runs) and encodes it
// (csrc/mps/mps_encoder.mm). The staged family's scratch B_packed and workspace are allocated here,
// on the op's device, and released by the caching allocator after the encoded work.
#ifdef TM_WITH_MPS

#include "mps/mps_backend.h"
#include "mps/mps_encoder.h"

namespace torch_marlin {
namespace {

// A layer whose tiles all hold one symbol has no words: its stream buffer may have no storage,
// so word_offsets stands in (the kernels read no word of an empty stream).
RansCodeBuffers<MpsBuffer> code_buffers(const RansCodes& c) {
  const MpsBuffer offsets = mps_buffer(c.word_offsets);
  return RansCodeBuffers<MpsBuffer>{c.words.numel() > 0 ? mps_buffer(c.words) : offsets, offsets,
                                    mps_buffer(c.states), mps_buffer(c.freqs)};
}

}  // namespace

void MpsBackend::rans_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  RansGemmBuffers<MpsBuffer> b;
  b.A = mps_buffer(a.A);
  b.code = code_buffers(a.codes);
  b.scales = mps_buffer(a.scales);
  if (a.zeros.defined()) b.zeros_or_offsets = mps_buffer(a.zeros);
  if (a.offsets.defined()) b.zeros_or_offsets = mps_buffer(a.offsets);
  if (a.bias.defined()) b.bias = mps_buffer(a.bias);
  b.C = mps_buffer(C);
  at::Tensor decoded, workspace;
  if (plan.family == RansFamily::Staged) {
    decoded = at::empty({a.K / 8, a.N}, a.A.options().dtype(at::kInt));
    b.decoded = mps_buffer(decoded);
    if (plan.gemm.workspace_bytes > 0) {
      workspace = at::empty({int64_t(plan.gemm.workspace_bytes / sizeof(float))}, a.A.options().dtype(at::kFloat));
      b.workspace = mps_buffer(workspace);
    }
  }
  const uint32_t n_words = uint32_t(a.codes.words.numel());
  mps_encode(mps_describe([&] { return rans_gemm_dispatches(plan, b, n_words); }));
}

void MpsBackend::rans_decode(const RansPlan& plan, const RansCodes& c, at::Tensor& B_packed) {
  const RansDecodeBuffers<MpsBuffer> b{code_buffers(c), mps_buffer(B_packed)};
  const uint32_t n_words = uint32_t(c.words.numel());
  mps_encode(mps_describe([&] { return rans_decode_dispatches(plan, b, n_words); }));
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
