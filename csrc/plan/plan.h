// The planner: the single place that turns (op, shape, dtype, device caps) into a kernel choice
// and its launch geometry. The CPU kernels, the MPS encoder, the CUDA launcher and the
// Metal-on-CPU harness all execute the plan they are given; none of them re-decides.
//
// Portable C++17: no torch, no Objective-C, so the harness and the Python policy function
// (torch_marlin.dispatch) reach exactly the same code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "torch_marlin/quant_gemm_params.h"

namespace torch_marlin {

enum class Backend : int { CPU = 0, Metal = 1, CUDA = 2 };
enum class DType : int { F16 = 0, BF16 = 1, F32 = 2 };
enum class QuantFormat : int { FP4 = 0, U4 = 1 };

// What the planner needs to know about the device. Metal: compute_units = GPU cores;
// CUDA: SM count; CPU: worker threads.
struct DeviceCaps {
  Backend backend = Backend::CPU;
  int compute_units = 1;
  int max_shared_memory = 32768;  // threadgroup / shared memory per group, bytes
  // CUDA: 1 when the device runs thread-block clusters (sm_90+) and the loaded kernels were
  // compiled for them (sm_90+ PTX); the decode plan then reduces 2 K slices through a cluster.
  int thread_block_clusters = 0;
  // CUDA: 1 when the device is compute capability 9.0 and the loaded kernels were built for
  // sm_90a; the planner may then pick the wgmma kernels (plan.cpp cuda_wgmma_ws_pays,
  // cuda_wgmma_pays).
  int wgmma = 0;
};

// Kernel families of the FP4/INT4 GEMM. Every backend implements each family it plans.
enum class GemmVariant : int {
  Auto = 0,     // let the planner choose (the only value production code passes)
  Decode,       // small M (<= kDecodeMaxM): GEMV-style, each packed weight read once for all rows
  Tiled,        // 2-D grid of output tiles, fused dequant in registers (marlin_gemm_fused_*)
  TiledStaged,  // 2-D grid, double-buffered A and dequantized-B tiles in threadgroup memory
                // (marlin_gemm_fp4 / marlin_gemm_u4 of the seed)
  Striped,      // 1-D grid, column-major stripes over the tile space, K-parallel slices
  DequantBlas,  // CUDA, large M: dequantize column panels of B into a workspace and multiply each
                // with cuBLAS (the CPU's Tiled variant is the same idea with MKL)
  WarpSpecialized,  // CUDA sm_90a: a TMA producer warpgroup and 2 or 3 consumer warpgroups that
                    // dequantize into wgmma's register A operand (wgmma_ws)
};

constexpr int64_t kDecodeMaxM = 16;

const char* variant_name(GemmVariant v);
const char* backend_name(Backend b);
const char* dtype_name(DType d);  // "half", "bfloat", "float": the suffix of Metal kernel names
const char* format_name(QuantFormat f);  // "fp4", "u4"

struct GemmPlan {
  GemmVariant variant = GemmVariant::Decode;
  std::string kernel;         // backend kernel name (Metal function name / CUDA kernel tag)
  std::string reduce_kernel;  // how K slices are summed when params.k_parallel > 1, else empty:
                              // a second dispatch (Metal, CPU) or an in-kernel epilogue (CUDA)
  uint32_t grid[3] = {1, 1, 1};     // threadgroups (Metal) / blocks (CUDA) / tasks (CPU)
  uint32_t threads[3] = {1, 1, 1};  // threads per threadgroup / block
  uint32_t reduce_grid[3] = {1, 1, 1};
  uint32_t reduce_threads[3] = {1, 1, 1};
  size_t workspace_bytes = 0;       // fp32 partials [k_parallel][M][N] when k_parallel > 1 (CUDA
                                    // wgmma_ws: whole tiles in fragment order, quant_gemm.cu)
  QuantGemmParams params{};
  // CUDA wgmma_ws only: the last tail_n_tiles column tiles (all row tiles of them) are left out of
  // grid (grid[1] = n_tiles - tail_n_tiles, k_parallel 1) and run as a second launch split into
  // tail_k_parallel K slices of tail_k_slice_len rows, summed through a cluster, so that the main
  // grid's last, mostly empty wave becomes a short full one (plan.cpp cuda_wgmma_ws_geometry).
  // 0: one launch.
  uint32_t tail_n_tiles = 0;
  uint32_t tail_k_parallel = 1;
  uint32_t tail_k_slice_len = 0;
  // CUDA decode and wgmma_ws on sm_90: launched with programmatic dependent launch (the kernel may
  // start while the previous one on the stream still runs and waits for it before its first load).
  bool dependent_launch = false;
};

// Plans C[M,N] = A[M,K] @ dequant(B)[K,N] (+ bias). Shapes must already be validated by the op.
// `force` lets tests run a specific variant; Auto is the policy.
GemmPlan plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                         DType dtype, bool has_bias, const DeviceCaps& caps,
                         GemmVariant force = GemmVariant::Auto);

// Caps the Metal plans assume when no real device is queried (the harness, CPU-side policy
// tests): an M1-class GPU with 8 cores and 32 KiB of threadgroup memory.
DeviceCaps default_metal_caps();

// Standalone dequant on Metal (kernel dequant_<format>_<dtype> in metal/quant_gemm.metal): one
// thread per packed word, 256 threads per threadgroup, 1-D grid. Shared by the MPS encoder and
// the Metal-on-CPU harness. params carries K, N and group_size (M = 0).
GemmPlan plan_quant_dequant_metal(QuantFormat format, int64_t K, int64_t N, int64_t group_size, DType dtype);

}  // namespace torch_marlin
