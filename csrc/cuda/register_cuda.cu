// The CUDA backend's binding unit: its device caps and its kernels for every op family, bound to the
// dispatch key CUDA through the op entry points (csrc/ops/op_entries.h).
#include <torch/library.h>

#include "cuda/cuda_backend.h"
#include "ops/op_entries.h"

namespace torch_marlin {
namespace {

struct CudaBackend {
  static DeviceCaps caps(const at::Device& device) { return cuda_device_caps(device.index()); }
  static void quant_gemm(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& workspace) {
    quant_gemm_cuda(plan, a, C, workspace);
  }
  static void quant_dequant(const QuantGemmArgs& a, at::Tensor& W) { quant_dequant_cuda(a, W); }
  static void trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& C) {
    trellis_gemm_cuda(plan, a, C);
  }
  static void trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& W) {
    trellis_dequant_cuda(plan, a, W);
  }
  static void trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& a, at::Tensor& y) {
    trellis_moe_cuda(plan, a, y);
  }
  static void rans_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) { rans_gemm_cuda(plan, a, C); }
  static void rans_decode(const RansPlan& plan, const RansCodes& c, at::Tensor& B) { rans_decode_cuda(plan, c, B); }
};

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CUDA, m) {
  m.impl("_device_caps", &device_caps_entry<CudaBackend>);
  m.impl("gemm_fp4", &gemm_fp4<CudaBackend>);
  m.impl("gemm_u4", &gemm_u4<CudaBackend>);
  m.impl("gemm_affine", &gemm_affine<CudaBackend>);
  m.impl("dequant_fp4", &dequant_fp4<CudaBackend>);
  m.impl("dequant_u4", &dequant_u4<CudaBackend>);
  m.impl("dequant_affine", &dequant_affine<CudaBackend>);
  m.impl("gemm_trellis", &gemm_trellis<CudaBackend>);
  m.impl("dequant_trellis", &dequant_trellis<CudaBackend>);
  m.impl("moe_trellis", &moe_trellis<CudaBackend>);
  m.impl("rans_decode", &rans_decode<CudaBackend>);
  m.impl("gemm_rans", &gemm_rans<CudaBackend>);
}

}  // namespace torch_marlin
