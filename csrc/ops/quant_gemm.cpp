// FP4 E2M1 / INT4 / affine INT4 op family: schema, argument checks, plan, backend call, registration.
//
//   gemm_fp4(A, B_packed, scales, group_size, bias=None) -> C
//   gemm_u4(A, B_packed, scales, zeros, group_size, bias=None) -> C
//   dequant_fp4(B_packed, scales, group_size) -> W
//   dequant_u4(B_packed, scales, zeros, group_size) -> W
//   gemm_affine(A, B_packed, scales, offsets, group_size, bias=None) -> C
//   dequant_affine(B_packed, scales, offsets, group_size) -> W
//
// Fake (meta) kernels live in torch_marlin/ops.py (register_fake handles symbolic shapes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/trellis_cpu.h"
#include "ops/quant_gemm.h"
#include "ops/vector_aligned.h"
#include "plan/plan_cache.h"

namespace torch_marlin {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat: return DType::F32;
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", t);
  }
}

DeviceCaps device_caps(const at::Device& dev) {
  switch (dev.type()) {
    case at::kCPU: {
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
#ifdef TM_WITH_MPS
    case at::kMPS: return mps_device_caps();
#endif
#ifdef TM_WITH_CUDA
    case at::kCUDA: return cuda_device_caps(dev.index());
#endif
    default: TORCH_CHECK_VALUE(false, "torch_marlin: this build has no kernels for device ", dev);
  }
}

namespace {

void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, ": ", name,
                   " must be float16, bfloat16 or float32, got ", s);
}

void check_same_device(const at::Tensor& t, const at::Device& dev, const char* op, const char* name,
                       const char* ref) {
  TORCH_CHECK_VALUE(t.device() == dev, op, ": ", name, " is on ", t.device(), " but ", ref, " is on ",
                    dev, "; all tensors must be on one device");
}

void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* op, const char* name,
                 const char* what) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ", expected, " (", what,
                    "), got ", t.sizes());
}

// Checks the weight-side tensors shared by gemm and dequant; fills K, N, group_size, B, scales,
// and `aux`: zeros (U4) or offsets (Affine). `ref_device`/`ref_name` is the tensor everything must sit beside; K is A's column count
// for a gemm (a mismatch names A) and B_packed's row count times 8 for a dequant.
void check_weights(QuantGemmArgs& a, const at::Tensor& B, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& aux, int64_t group_size, int64_t K,
                   const at::Device& dev, const char* ref_name, const char* op) {
  TORCH_CHECK_VALUE(B.dim() == 2, op, ": B_packed must be 2-D [K/8, N], got ", B.dim(), "-D");
  TORCH_CHECK_TYPE(B.scalar_type() == at::kInt, op, ": B_packed must be int32 (8 four-bit codes per word), got ",
                   B.scalar_type());
  check_same_device(B, dev, op, "B_packed", ref_name);
  TORCH_CHECK_VALUE(K > 0 && K % TM_PACK_FACTOR == 0, op, ": K must be a positive multiple of 8, got ", K);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % TM_PACK_FACTOR == 0, op,
                    ": group_size must be a positive multiple of 8, got ", group_size);
  TORCH_CHECK_VALUE(K % group_size == 0, op, ": group_size (", group_size, ") must divide K (", K, ")");
  TORCH_CHECK_VALUE(B.size(0) * TM_PACK_FACTOR == K, op, ": A must have K = 8 * B_packed.size(0) = ",
                    B.size(0) * TM_PACK_FACTOR, " columns (A is [M, K], B_packed [K/8, N]), got ", K);
  const int64_t N = B.size(1);  // N = 0 is allowed: the ops return empty results without planning
  TORCH_CHECK_VALUE(N <= INT32_MAX && K <= INT32_MAX, op, ": K and N must fit in 31 bits");
  check_float_dtype(scales, op, "scales");
  check_same_device(scales, dev, op, "scales", ref_name);
  check_shape(scales, {K / group_size, N}, op, "scales", "[K/group_size, N]");
  a.K = K;
  a.N = N;
  a.group_size = group_size;
  a.B = contiguous_aligned(B);
  a.scales = contiguous_aligned(scales);
  if (a.format == QuantFormat::U4) {
    TORCH_CHECK_VALUE(aux.has_value(), op, ": zeros is required");
    const at::Tensor& z = *aux;
    TORCH_CHECK_TYPE(z.scalar_type() == at::kByte, op, ": zeros must be uint8 (values 0..15), got ",
                     z.scalar_type());
    check_same_device(z, dev, op, "zeros", ref_name);
    check_shape(z, {K / group_size, N}, op, "zeros", "[K/group_size, N]");
    a.zeros = contiguous_aligned(z);
  }
  if (a.format == QuantFormat::Affine) {
    TORCH_CHECK_VALUE(aux.has_value(), op, ": offsets is required");
    const at::Tensor& b = *aux;
    TORCH_CHECK_TYPE(b.scalar_type() == scales.scalar_type(), op, ": offsets must have the dtype of scales (",
                     scales.scalar_type(), "), got ", b.scalar_type());
    check_same_device(b, dev, op, "offsets", ref_name);
    check_shape(b, {K / group_size, N}, op, "offsets", "[K/group_size, N]");
    a.offsets = contiguous_aligned(b);
  }
}

QuantGemmArgs check_gemm(QuantFormat format, const at::Tensor& A, const at::Tensor& B,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& aux,
                         int64_t group_size, const c10::optional<at::Tensor>& bias, const char* op) {
  QuantGemmArgs a;
  a.format = format;
  TORCH_CHECK_VALUE(A.dim() == 2, op, ": A must be 2-D [M, K] (MarlinLinear flattens leading dims), got ",
                    A.dim(), "-D");
  check_float_dtype(A, op, "A");
  check_weights(a, B, scales, aux, group_size, A.size(1), A.device(), "A", op);
  TORCH_CHECK_TYPE(scales.scalar_type() == A.scalar_type(), op, ": scales must have A's dtype ",
                   A.scalar_type(), ", got ", scales.scalar_type());
  a.M = A.size(0);
  a.dtype = to_dtype(A.scalar_type());
  a.A = contiguous_aligned(A);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_TYPE(b.scalar_type() == A.scalar_type(), op, ": bias must have A's dtype ", A.scalar_type(),
                     ", got ", b.scalar_type());
    check_same_device(b, A.device(), op, "bias", "A");
    check_shape(b, {a.N}, op, "bias", "[N]");
    a.bias = b.contiguous();
  }
  return a;
}

at::Tensor run_gemm(const QuantGemmArgs& a) {
  // The op has no autograd formula (its Autograd kernel falls through); the ATen calls the kernels
  // make (BLAS on dequantized panels) must not record autograd either, or an input that requires
  // grad makes them raise (the modules give the input its gradient, torch_marlin/ops.py).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor C = at::empty({a.M, a.N}, a.A.options());
  if (a.M == 0 || a.N == 0) return C;
  const DeviceCaps caps = device_caps(a.A.device());
  const std::shared_ptr<const GemmPlan> planned =
      cached_plan_quant_gemm(a.format, a.M, a.K, a.N, a.group_size, a.dtype, a.bias.defined(), caps);
  const GemmPlan& plan = *planned;
  // The workspace (K-slice partials, CUDA tile arrival counters, dequantized panels) lives for
  // this call only, from the caching allocator: under CUDA-graph capture it comes from the graph's
  // pool and is captured with the kernels, so nothing allocated here outlives the call.
  at::Tensor workspace;
  if (plan.workspace_bytes > 0) {
    workspace = at::empty({int64_t((plan.workspace_bytes + sizeof(float) - 1) / sizeof(float))},
                          a.A.options().dtype(at::kFloat));
  }
  switch (caps.backend) {
    case Backend::CPU: quant_gemm_cpu(plan, a, C); break;
#ifdef TM_WITH_MPS
    case Backend::Metal: quant_gemm_mps(plan, a, C, workspace); break;
#endif
#ifdef TM_WITH_CUDA
    case Backend::CUDA: quant_gemm_cuda(plan, a, C, workspace); break;
#endif
    default: TORCH_CHECK(false, "torch_marlin: backend not built");
  }
  return C;
}

at::Tensor run_dequant(const QuantGemmArgs& a) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in run_gemm
  at::Tensor W = at::empty({a.K, a.N}, a.scales.options());
  if (a.N == 0) return W;
  switch (a.B.device().type()) {
    case at::kCPU: quant_dequant_cpu(a, W); break;
#ifdef TM_WITH_MPS
    case at::kMPS: quant_dequant_mps(a, W); break;
#endif
#ifdef TM_WITH_CUDA
    case at::kCUDA: quant_dequant_cuda(a, W); break;
#endif
    default: TORCH_CHECK(false, "torch_marlin: no kernels for device ", a.B.device());
  }
  return W;
}

at::Tensor gemm_fp4(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales, int64_t group_size,
                    const c10::optional<at::Tensor>& bias) {
  return run_gemm(check_gemm(QuantFormat::FP4, A, B, scales, c10::nullopt, group_size, bias, "gemm_fp4"));
}

at::Tensor gemm_u4(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales, const at::Tensor& zeros,
                   int64_t group_size, const c10::optional<at::Tensor>& bias) {
  return run_gemm(check_gemm(QuantFormat::U4, A, B, scales, zeros, group_size, bias, "gemm_u4"));
}

at::Tensor gemm_affine(const at::Tensor& A, const at::Tensor& B, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  return run_gemm(check_gemm(QuantFormat::Affine, A, B, scales, offsets, group_size, bias, "gemm_affine"));
}

QuantGemmArgs check_dequant(QuantFormat format, const at::Tensor& B, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& aux, int64_t group_size, const char* op) {
  QuantGemmArgs a;
  a.format = format;
  TORCH_CHECK_VALUE(B.dim() == 2, op, ": B_packed must be 2-D [K/8, N], got ", B.dim(), "-D");
  check_weights(a, B, scales, aux, group_size, B.size(0) * TM_PACK_FACTOR, B.device(), "B_packed", op);
  a.dtype = to_dtype(scales.scalar_type());
  return a;
}

at::Tensor dequant_fp4(const at::Tensor& B, const at::Tensor& scales, int64_t group_size) {
  return run_dequant(check_dequant(QuantFormat::FP4, B, scales, c10::nullopt, group_size, "dequant_fp4"));
}

at::Tensor dequant_u4(const at::Tensor& B, const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size) {
  return run_dequant(check_dequant(QuantFormat::U4, B, scales, zeros, group_size, "dequant_u4"));
}

at::Tensor dequant_affine(const at::Tensor& B, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t group_size) {
  return run_dequant(check_dequant(QuantFormat::Affine, B, scales, offsets, group_size, "dequant_affine"));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(marlin, m) {
  m.def("gemm_fp4(Tensor A, Tensor B_packed, Tensor scales, int group_size, Tensor? bias=None) -> Tensor");
  m.def("gemm_u4(Tensor A, Tensor B_packed, Tensor scales, Tensor zeros, int group_size, Tensor? bias=None) -> Tensor");
  m.def("dequant_fp4(Tensor B_packed, Tensor scales, int group_size) -> Tensor");
  m.def("dequant_u4(Tensor B_packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("gemm_affine(Tensor A, Tensor B_packed, Tensor scales, Tensor offsets, int group_size, Tensor? bias=None) -> Tensor");
  m.def("dequant_affine(Tensor B_packed, Tensor scales, Tensor offsets, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("gemm_fp4", &gemm_fp4);
  m.impl("gemm_u4", &gemm_u4);
  m.impl("dequant_fp4", &dequant_fp4);
  m.impl("dequant_u4", &dequant_u4);
  m.impl("gemm_affine", &gemm_affine);
  m.impl("dequant_affine", &dequant_affine);
}

#ifdef TM_WITH_MPS
TORCH_LIBRARY_IMPL(marlin, MPS, m) {
  m.impl("gemm_fp4", &gemm_fp4);
  m.impl("gemm_u4", &gemm_u4);
  m.impl("dequant_fp4", &dequant_fp4);
  m.impl("dequant_u4", &dequant_u4);
  m.impl("gemm_affine", &gemm_affine);
  m.impl("dequant_affine", &dequant_affine);
}
#endif

#ifdef TM_WITH_CUDA
TORCH_LIBRARY_IMPL(marlin, CUDA, m) {
  m.impl("gemm_fp4", &gemm_fp4);
  m.impl("gemm_u4", &gemm_u4);
  m.impl("dequant_fp4", &dequant_fp4);
  m.impl("dequant_u4", &dequant_u4);
  m.impl("gemm_affine", &gemm_affine);
  m.impl("dequant_affine", &dequant_affine);
}
#endif

}  // namespace torch_marlin
