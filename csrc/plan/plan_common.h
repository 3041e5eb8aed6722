// Planner internals shared by every family's planner (plan.cpp, trellis_plan.cpp, rans_plan.cpp) and
// the per-backend geometry (plan_<backend>.cpp, trellis_plan_<backend>.cpp, rans_plan_<backend>.cpp):
// tile and K-slice arithmetic, index-width checks, and the GEMM's per-backend entries.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "plan/plan.h"

namespace torch_marlin {

uint32_t ceil_div(int64_t a, int64_t b);

// Output tiles of a params struct (QuantGemmParams, TrellisParams): sizes and counts.
template <class Params>
void set_param_tiles(Params& q, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n) {
  q.tile_m = tile_m;
  q.tile_n = tile_n;
  q.m_tiles = ceil_div(M, tile_m);
  q.n_tiles = ceil_div(N, tile_n);
}

// The Metal kernels index with 32-bit unsigned arithmetic: throws std::invalid_argument (naming
// `who`) where an element or byte index could wrap (the CPU kernels use 64-bit indices).
void check_metal_indices(std::initializer_list<uint64_t> extents, const char* who);

// Output tiles of a GEMM plan: tile sizes into params and desc, tile counts into params.
void set_tiles(GemmPlan& p, int64_t M, int64_t N, uint32_t tile_m, uint32_t tile_n);

// K slices: k_slice_len is a multiple of `k_step` so a slice never splits a kernel iteration;
// at most k_parallel slices, none of them empty.
void set_k_slices(QuantGemmParams& q, int64_t K, uint32_t k_parallel, uint32_t k_step);
void set_k_parallel(GemmPlan& p, int64_t K, uint32_t k_parallel, uint32_t k_step);

// A K-parallel plan's fp32 workspace: k_parallel x slice_floats (the partials one K slice leaves,
// M x N unless the kernel keeps whole tiles). No-op when k_parallel == 1.
void set_partials_workspace(GemmPlan& p, size_t slice_floats);

// A second dispatch that sums the K slices of the workspace (Metal): `threads` per group, one
// thread per output element. No-op when k_parallel == 1.
void set_second_dispatch_reduction(GemmPlan& p, const char* reduce_kernel, uint32_t threads);

// K slices that fill the machine when the output alone has too few tiles to do so: only when K is
// long enough that each slice still has work (at least min_steps_per_slice k steps).
uint32_t k_split_for(int64_t tiles, int64_t K, uint32_t k_step, int compute_units, int waves,
                     uint32_t min_steps_per_slice);

// ---- per-backend planners (the family is chosen and validated by plan_quant_gemm) ----
void plan_cpu(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps);
void plan_metal(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps);
void plan_cuda(GemmPlan& p, int64_t M, int64_t K, int64_t N, const DeviceCaps& caps);

// ---- per-backend policy inputs (plan.cpp's choose_family reads them) ----
// CPU: rows up to which decode beats dequant_blas.
int64_t cpu_decode_policy_max_m();
// CUDA: rows the decode kernel handles (and the policy gives it, fp16/bf16).
int64_t cuda_decode_max_m();
// Metal: stripes with K-parallel slices instead of 2-D tiles.
bool metal_striped_pays(int64_t M, int64_t K, int64_t N, const DeviceCaps& caps);
// CUDA fp16/bf16 on sm_90a: whether wgmma_ws / wgmma beat the other kernels for this shape.
bool cuda_wgmma_ws_pays(int64_t M, int64_t K, int64_t N, int64_t group_size, const DeviceCaps& caps);
bool cuda_wgmma_pays(int64_t M, int64_t K, int64_t N, int64_t group_size, const DeviceCaps& caps);

}  // namespace torch_marlin
