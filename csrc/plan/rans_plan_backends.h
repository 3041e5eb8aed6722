// rANS planner internals shared by rans_plan.cpp (validation, the family, the entries) and each
// backend's geometry (rans_plan_cpu.cpp, rans_plan_metal.cpp, rans_plan_cuda.cpp).
#pragma once

#include <string>

#include "plan/plan_common.h"
#include "plan/rans_plan.h"

namespace torch_marlin {

// One task (CPU) or one 32-thread group (a warp, a simdgroup) per tile.
KernelLaunch rans_tile_launch(const std::string& kernel, const RansParams& p, Backend b);

// The fused kernels' row count (CUDA and Metal): M rounded up to 1, 2, 4, 8 or 16 (fp32 sums per
// row in registers; the rows past M repeat row M - 1 and are not stored).
uint32_t rans_fused_rows(int64_t M);

// ---- per-backend geometry (the entries validated the shapes and chose p.family) ----
// gemm: the fused kernel, or the staged family's decode (p.gemm already planned); decode: rans_decode.
void plan_rans_gemm_cpu(RansPlan& p, const DeviceCaps& caps);
void plan_rans_decode_cpu(RansPlan& p, const DeviceCaps& caps);
void plan_rans_gemm_metal(RansPlan& p, int64_t M, int64_t K, int64_t N, QuantFormat format, DType dtype);
void plan_rans_decode_metal(RansPlan& p, int64_t K, int64_t N);
void plan_rans_gemm_cuda(RansPlan& p, int64_t M, QuantFormat format, DType dtype);
void plan_rans_decode_cuda(RansPlan& p);

}  // namespace torch_marlin
