// Trellis planner internals shared by trellis_plan.cpp (validation, the policy, the entries) and each
// backend's geometry (trellis_plan_cpu.cpp, trellis_plan_metal.cpp, trellis_plan_cuda.cpp).
#pragma once

#include <cstdint>

#include "plan/plan_common.h"
#include "plan/trellis_plan.h"

namespace torch_marlin {

// Output tiles of a trellis kernel: sizes and counts (M = 0 still counts one row tile).
void set_trellis_tiles(TrellisParams& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n);

// ---- per-backend geometry (the entries validated the shapes and chose p.family) ----
void plan_trellis_gemm_cpu(TrellisPlan& p, int64_t M, int64_t N, const DeviceCaps& caps);
void plan_trellis_dequant_cpu(TrellisPlan& p);
void plan_trellis_moe_cpu(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate, const DeviceCaps& caps);

void plan_trellis_gemm_metal(TrellisPlan& p, int64_t M, int64_t K, int64_t N, DType dtype);
void plan_trellis_dequant_metal(TrellisPlan& p, int64_t K, int64_t N);
void plan_trellis_moe_metal(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate, DType dtype);

void plan_trellis_gemm_cuda(TrellisPlan& p, int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype,
                            const DeviceCaps& caps);
void plan_trellis_dequant_cuda(TrellisPlan& p);
void plan_trellis_moe_cuda(TrellisPlan& p, int64_t tokens, int64_t hidden, int64_t intermediate, DType dtype,
                           const DeviceCaps& caps);
// Indices in the CUDA lane layout (CUDA only; the caller checked the backend): the GEMM with its
// own choice of family (`force` as for plan_trellis_gemm), and the dequant.
void plan_trellis_gemm_lanes(TrellisPlan& p, int64_t M, int64_t K, int64_t N, int64_t group_size, DType dtype,
                             const DeviceCaps& caps, KernelFamily force);
void plan_trellis_dequant_lanes(TrellisPlan& p);

// ---- per-backend policy inputs (trellis_plan.cpp's choice of family reads them) ----
// CUDA fp16/bf16: rows from which the dense weight + cuBLAS (dequant_blas) beats the fused tiles.
int64_t trellis_cuda_blas_min_m();

}  // namespace torch_marlin
