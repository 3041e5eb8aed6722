// FP4 E2M1 / INT4 / affine INT4 op family: argument checks, plan and workspace (prepare_quant_gemm,
// prepare_quant_dequant). Schemas: csrc/ops/library.cpp; each backend binds the ops in its binding unit.
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

#include "ops/plan_or_value_error.h"
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
  plan_or_value_error([&] { check_quant_group_size(K, group_size, op); });
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

}  // namespace

QuantGemmCall prepare_quant_gemm(QuantFormat format, const at::Tensor& A, const at::Tensor& B,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& aux, int64_t group_size,
                                 const c10::optional<at::Tensor>& bias, const DeviceCaps& caps, const char* op) {
  QuantGemmCall c;
  c.args = check_gemm(format, A, B, scales, aux, group_size, bias, op);
  const QuantGemmArgs& a = c.args;
  c.out = at::empty({a.M, a.N}, a.A.options());
  c.empty = a.M == 0 || a.N == 0;
  if (c.empty) return c;
  c.plan = cached_plan_quant_gemm(a.format, a.M, a.K, a.N, a.group_size, a.dtype, a.bias.defined(), caps);
  if (c.plan->workspace_bytes > 0) {
    c.workspace = at::empty({int64_t((c.plan->workspace_bytes + sizeof(float) - 1) / sizeof(float))},
                            a.A.options().dtype(at::kFloat));
  }
  return c;
}

QuantGemmCall prepare_quant_dequant(QuantFormat format, const at::Tensor& B, const at::Tensor& scales,
                                    const c10::optional<at::Tensor>& aux, int64_t group_size, const char* op) {
  QuantGemmCall c;
  c.args.format = format;
  TORCH_CHECK_VALUE(B.dim() == 2, op, ": B_packed must be 2-D [K/8, N], got ", B.dim(), "-D");
  check_weights(c.args, B, scales, aux, group_size, B.size(0) * TM_PACK_FACTOR, B.device(), "B_packed", op);
  c.args.dtype = to_dtype(scales.scalar_type());
  c.out = at::empty({c.args.K, c.args.N}, c.args.scales.options());
  c.empty = c.args.N == 0;
  return c;
}

}  // namespace torch_marlin
