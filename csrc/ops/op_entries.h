// The op entry points, over one backend's kernels, and register_backend_ops, which binds them. Each
// backend's binding unit (csrc/cpu/register_cpu.cpp, csrc/cuda/register_cuda.cu, csrc/mps/register_mps.mm)
// calls register_backend_ops<ItsBackend> in its one TORCH_LIBRARY_IMPL block: the dispatcher picks the
// backend once, and every entry is the family's backend-free prepare_<family> (checks, output, plan,
// workspace) followed by the backend's kernel.
//
// `BackendImpl` is a backend's interface struct (CpuBackend, CudaBackend, MpsBackend), whose members
// TM_BACKEND_INTERFACE declares (csrc/ops/backend_interface.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops/quant_gemm.h"
#include "ops/rans.h"
#include "ops/trellis.h"

namespace torch_marlin {

// _device_caps(Tensor like) -> int[]: the caps of `like`'s device, as caps_to_ints packs them
// (torch_marlin._C.device_caps reads them through the dispatcher, so the backend that answers is the
// one whose kernels run there).
std::vector<int64_t> caps_to_ints(const DeviceCaps& caps);
DeviceCaps caps_from_ints(const std::vector<int64_t>& v);

template <class BackendImpl>
std::vector<int64_t> device_caps_entry(const at::Tensor& like) {
  return caps_to_ints(BackendImpl::caps(like.device()));
}

namespace op_entry_detail {

// The ops have no autograd formula (their Autograd kernels fall through, torch_marlin/ops.py); the
// ATen calls the kernels make (BLAS on dequantized panels, routing) must not record autograd either,
// or an input that requires grad makes them raise (the modules give the input its gradient).
template <class BackendImpl>
at::Tensor quant_gemm(QuantFormat format, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& aux, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, const char* op) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  QuantGemmCall c = prepare_quant_gemm(format, A, B, scales, aux, group_size, bias, BackendImpl::caps(A.device()), op);
  if (!c.empty) BackendImpl::quant_gemm(*c.plan, c.args, c.out, c.workspace);
  return c.out;
}

template <class BackendImpl>
at::Tensor quant_dequant(QuantFormat format, const at::Tensor& B, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& aux, int64_t group_size, const char* op) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  QuantGemmCall c = prepare_quant_dequant(format, B, scales, aux, group_size, op);
  if (!c.empty) BackendImpl::quant_dequant(c.args, c.out);
  return c.out;
}

}  // namespace op_entry_detail

// ---- FP4 / INT4 / affine INT4 (schemas: csrc/ops/library.cpp) ----

template <class BackendImpl>
at::Tensor gemm_fp4(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales, int64_t group_size,
                    const c10::optional<at::Tensor>& bias) {
  return op_entry_detail::quant_gemm<BackendImpl>(QuantFormat::FP4, A, B, scales, c10::nullopt, group_size, bias,
                                              "gemm_fp4");
}

template <class BackendImpl>
at::Tensor gemm_u4(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales, const at::Tensor& zeros,
                   int64_t group_size, const c10::optional<at::Tensor>& bias) {
  return op_entry_detail::quant_gemm<BackendImpl>(QuantFormat::U4, A, B, scales, zeros, group_size, bias, "gemm_u4");
}

template <class BackendImpl>
at::Tensor gemm_affine(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales, const at::Tensor& offsets,
                       int64_t group_size, const c10::optional<at::Tensor>& bias) {
  return op_entry_detail::quant_gemm<BackendImpl>(QuantFormat::Affine, A, B, scales, offsets, group_size, bias,
                                              "gemm_affine");
}

template <class BackendImpl>
at::Tensor dequant_fp4(const at::Tensor& B, const at::Tensor& scales, int64_t group_size) {
  return op_entry_detail::quant_dequant<BackendImpl>(QuantFormat::FP4, B, scales, c10::nullopt, group_size,
                                                     "dequant_fp4");
}

template <class BackendImpl>
at::Tensor dequant_u4(const at::Tensor& B, const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size) {
  return op_entry_detail::quant_dequant<BackendImpl>(QuantFormat::U4, B, scales, zeros, group_size, "dequant_u4");
}

template <class BackendImpl>
at::Tensor dequant_affine(const at::Tensor& B, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t group_size) {
  return op_entry_detail::quant_dequant<BackendImpl>(QuantFormat::Affine, B, scales, offsets, group_size,
                                                 "dequant_affine");
}

// ---- trellis ----

template <class BackendImpl>
at::Tensor gemm_trellis(const at::Tensor& A, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& grid, const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N,
                        int64_t bits, int64_t group_size) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in op_entry_detail::quant_gemm
  TrellisGemmCall c =
      prepare_trellis_gemm(A, packed, scales, grid, su, sv, K, N, bits, group_size, BackendImpl::caps(A.device()));
  if (!c.empty) BackendImpl::trellis_gemm(*c.plan, c.args, c.out);
  return c.out;
}

template <class BackendImpl>
at::Tensor dequant_trellis(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& grid,
                           const at::Tensor& su, const at::Tensor& sv, int64_t K, int64_t N, int64_t bits,
                           int64_t group_size) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  TrellisGemmCall c =
      prepare_trellis_dequant(packed, scales, grid, su, sv, K, N, bits, group_size, BackendImpl::caps(packed.device()));
  BackendImpl::trellis_dequant(*c.plan, c.args, c.out);
  return c.out;
}

template <class BackendImpl>
at::Tensor moe_trellis(const at::Tensor& x, const at::Tensor& gate_packed, const at::Tensor& gate_scales,
                       const at::Tensor& gate_grid, const at::Tensor& gate_su, const at::Tensor& gate_sv,
                       const at::Tensor& up_packed, const at::Tensor& up_scales, const at::Tensor& up_grid,
                       const at::Tensor& up_su, const at::Tensor& up_sv, const at::Tensor& down_packed,
                       const at::Tensor& down_scales, const at::Tensor& down_grid, const at::Tensor& down_su,
                       const at::Tensor& down_sv, const at::Tensor& expert_ids, const at::Tensor& expert_probs,
                       int64_t intermediate, int64_t bits, int64_t group_size) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const TrellisMoeWeights w{{gate_packed, gate_scales, gate_grid, gate_su, gate_sv},
                            {up_packed, up_scales, up_grid, up_su, up_sv},
                            {down_packed, down_scales, down_grid, down_su, down_sv}};
  TrellisMoeCall c = prepare_trellis_moe(x, w, expert_ids, expert_probs, intermediate, bits, group_size,
                                         BackendImpl::caps(x.device()));
  if (!c.empty) BackendImpl::trellis_moe(*c.plan, c.args, c.out);
  return c.out;
}

// ---- rANS ----

template <class BackendImpl>
at::Tensor rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                       const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile) {
  RansDecodeCall c = prepare_rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile,
                                         BackendImpl::caps(words.device()));
  BackendImpl::rans_decode(*c.plan, c.args, c.out);
  return c.out;
}

template <class BackendImpl>
at::Tensor gemm_rans(const at::Tensor& A, const at::Tensor& words, const at::Tensor& word_offsets,
                     const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                     c10::string_view format, int64_t K, int64_t N, int64_t group_size, int64_t channels_per_tile,
                     const c10::optional<at::Tensor>& bias) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  RansGemmCall c = prepare_rans_gemm(A, RansCodeTensors{words, word_offsets, states, freqs}, scales, zeros, offsets,
                                     format, K, N, group_size, channels_per_tile, bias, BackendImpl::caps(A.device()));
  if (!c.empty) BackendImpl::rans_gemm(*c.plan, c.args, c.out);
  return c.out;
}

// Binds the op entries over BackendImpl's kernels for every op all backends run (schemas:
// csrc/ops/library.cpp). An op only some backends run (rans_encode: the host encoder, CPU only) is
// bound by those backends' units next to this call.
template <class BackendImpl>
void register_backend_ops(torch::Library& m) {
  m.impl("_device_caps", &device_caps_entry<BackendImpl>);
  m.impl("gemm_fp4", &gemm_fp4<BackendImpl>);
  m.impl("gemm_u4", &gemm_u4<BackendImpl>);
  m.impl("gemm_affine", &gemm_affine<BackendImpl>);
  m.impl("dequant_fp4", &dequant_fp4<BackendImpl>);
  m.impl("dequant_u4", &dequant_u4<BackendImpl>);
  m.impl("dequant_affine", &dequant_affine<BackendImpl>);
  m.impl("gemm_trellis", &gemm_trellis<BackendImpl>);
  m.impl("dequant_trellis", &dequant_trellis<BackendImpl>);
  m.impl("moe_trellis", &moe_trellis<BackendImpl>);
  m.impl("rans_decode", &rans_decode<BackendImpl>);
  m.impl("gemm_rans", &gemm_rans<BackendImpl>);
}

}  // namespace torch_marlin
