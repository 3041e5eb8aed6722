// CPU entry of the FP4 / INT4 / affine INT4 GEMM: fp32 operands, then the family the plan names.
#include "cpu/quant_gemm_cpu.h"

namespace torch_marlin {

void CpuBackend::quant_gemm(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor&) {
  CpuGemmOperands o;
  o.A = a.A.to(at::kFloat).contiguous();
  o.scales = a.scales.to(at::kFloat).contiguous();
  if (a.offsets.defined()) o.offsets = a.offsets.to(at::kFloat).contiguous();
  if (a.bias.defined()) o.bias = a.bias.to(at::kFloat).contiguous();
  const bool direct = C.scalar_type() == at::kFloat;
  o.C = direct ? C : at::empty({a.M, a.N}, C.options().dtype(at::kFloat));
  switch (plan.desc.family) {
    case KernelFamily::Decode: decode_gemm_cpu(plan, a, o); break;
    case KernelFamily::DequantBlas: dequant_blas_gemm_cpu(plan, a, o); break;
    default: TORCH_CHECK(false, "torch_marlin: the CPU has no '", family_name(plan.desc.family), "' kernels");
  }
  if (!direct) C.copy_(o.C);
}

}  // namespace torch_marlin
