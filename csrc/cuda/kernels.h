// Host-side interface between the CUDA launcher (launch.cu) and the kernel families, one file
// each: decode.cu, simt.cu, dequant.cu (dequant and dequant_blas), wgmma.cu, wgmma_ws.cu.
//
// launch.cu validates the call, pads the weights and switches on plan.desc.family; each family's
// launch entry checks the plan against its kernel's fixed geometry and instantiates exactly the
// kernel template the plan's KernelDesc names. Entries are templates over the activation type T
// (__half, __nv_bfloat16) and the weight format FMT (TM_FORMAT_FP4, TM_FORMAT_U4, TM_FORMAT_AFFINE), instantiated
// explicitly in their family's file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_backend.h"
#include "torch_marlin/quant_gemm_params.h"

namespace torch_marlin {
namespace cuda_backend {

// B, scales and (U4) zeros or (affine) offsets padded to plan.padded_n columns (B.size(1)) with
// 16-byte aligned bases: the fast kernels read 16-byte chunks of B (4 columns), scales and offsets
// (8) and zeros (16).
struct PaddedWeights {
  at::Tensor B, scales, zeros, offsets;
};

// The operands of one fp16/bf16 GEMM after launch.cu's checks: A 16-byte aligned, the weights
// padded to Np columns (PaddedWeights).
template <typename T>
struct GemmOperands {
  const T* A;
  const uint32_t* B;
  const T* scales;
  const uint8_t* zeros;  // U4 zero points, else nullptr
  const T* offsets;      // affine offsets, else nullptr
  const T* bias;         // nullptr when the plan has no bias
  T* C;
  uint32_t Np;           // plan.padded_n
  float* ws;             // fp32 workspace (plan.workspace_bytes), else nullptr
  int* counters;         // per-tile arrival counters when desc.reduce == ReduceKind::LastBlock
  cudaStream_t stream;
};

// ---- Launch entries, one per family ----
template <typename T, uint32_t FMT>
void launch_decode(const GemmPlan& plan, const GemmOperands<T>& o);
template <typename T, uint32_t FMT>
void launch_wgmma(const GemmPlan& plan, const GemmOperands<T>& o);
template <typename T, uint32_t FMT>
void launch_wgmma_ws(const GemmPlan& plan, const GemmOperands<T>& o);
template <typename T, uint32_t FMT>
void launch_dequant_blas(const GemmPlan& plan, const QuantGemmArgs& a, const PaddedWeights& w, at::Tensor& C,
                         at::Tensor& ws, cudaStream_t stream);
template <uint32_t FMT>
void launch_simt(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, cudaStream_t stream);
// Columns [n0, n0 + cols) of B into W[K][ldw] in T (__half, __nv_bfloat16 or float): the standalone
// dequant op and dequant_blas's panels.
template <typename T, uint32_t FMT>
void launch_dequant(const QuantGemmArgs& a, const PaddedWeights& w, uint32_t n0, uint32_t cols, uint32_t ldw, T* W,
                    cudaStream_t stream);

// The attributes of one decode kernel instantiation: CudaBackend::caps reads the PTX version the
// loaded kernels were compiled from (every kernel file is compiled for the same targets).
cudaFuncAttributes decode_kernel_attributes();

// ---- Shared host helpers ----
// Throws naming `what` when the last launch failed.
void check_launch(const char* what);

// Calls f(std::true_type) when the plan sums K slices through a thread-block cluster, else
// f(std::false_type): the kernels' kCluster template argument.
template <typename F>
void with_cluster(const GemmPlan& plan, F&& f) {
  if (plan.desc.reduce == ReduceKind::Cluster) f(std::true_type{});
  else f(std::false_type{});
}

// Appends the programmatic-dependent-launch attribute to cfg (cfg.attrs has room for it): the
// kernel may start before the previous one on the stream has finished; its pdl_wait() orders them.
inline void add_dependent_launch(cudaLaunchConfig_t& cfg) {
  cudaLaunchAttribute& attr = cfg.attrs[cfg.numAttrs++];
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
}

// Launches kernel over grid x block with smem_bytes of dynamic shared memory; with dependent it may
// start before the previous kernel on the stream has finished (its pdl_wait() orders them).
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   bool dependent, const char* name, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  if (dependent) add_dependent_launch(cfg);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
  check_launch(name);
}

// Launches a tile kernel (decode, wgmma, wgmma_ws) over the plan's grid; with kCluster the K slices
// of an output tile (grid.z == k_parallel) run as one thread-block cluster; with the Main launch's
// dependent_launch the kernel may start before the previous one on the stream has finished (its
// pdl_wait() orders them).
template <bool kCluster, typename... KArgs, typename... Args>
void launch_tile_kernel(const GemmPlan& plan, void (*kernel)(KArgs...), uint32_t threads, int smem_bytes,
                        cudaStream_t stream, Args... args) {
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(main.grid[0], main.grid[1], main.grid[2]);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = size_t(smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (kCluster) {  // no cluster attribute at all otherwise (sm_80 has none)
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = 1;
    attr[cfg.numAttrs].val.clusterDim.y = 1;
    attr[cfg.numAttrs].val.clusterDim.z = plan.params.k_parallel;
    ++cfg.numAttrs;
  }
  if (main.dependent_launch) add_dependent_launch(cfg);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
  check_launch(main.kernel.c_str());
}

// Opts a kernel in to more than 48 KiB of dynamic shared memory, once per device.
template <typename Kernel>
void opt_in_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& opted_in) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(opted_in.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted_in.fetch_or(bit);
  }
}

// setmaxnreg hands a warp-specialized kernel's warpgroups exactly the registers its launch bound
// left: before its first launch (opted_in still empty), the compiled count must be that one.
template <typename Kernel>
void check_launch_registers(Kernel kernel, int expected, const char* what, const std::atomic<uint64_t>& opted_in) {
  if (opted_in.load() != 0) return;
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  TORCH_CHECK(attr.numRegs == expected, "torch_marlin: ", what, " compiled with ", attr.numRegs,
              " registers a thread, expected ", expected);
}

// A 2-D TMA descriptor: rows x cols elements (cols contiguous, row stride in bytes), box_rows x
// box_cols boxes; out-of-range elements of a box read as zero (wgmma_ws.cu).
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int64_t rows, int64_t cols, int64_t row_bytes,
                          int box_rows, int box_cols, CUtensorMapSwizzle swizzle);

// The activations A [M, K] in rows x 64 boxes with the 128-byte swizzle (wgmma's K-major SW128).
template <typename T>
CUtensorMap activation_tensor_map(const T* A, int64_t M, int64_t K, int rows) {
  const CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return tensor_map_2d(A, type, M, K, K * int64_t(sizeof(T)), rows, int(TM_CUDA_WGMMA_K_STEP),
                       CU_TENSOR_MAP_SWIZZLE_128B);
}

}  // namespace cuda_backend
}  // namespace torch_marlin

// Explicit instantiations of a family's entry for both activation types and every format.
#define TM_CUDA_INSTANTIATE_ENTRY(ENTRY)                                          \
  template void ENTRY<__half, TM_FORMAT_FP4>(const GemmPlan&, const GemmOperands<__half>&); \
  template void ENTRY<__half, TM_FORMAT_U4>(const GemmPlan&, const GemmOperands<__half>&);  \
  template void ENTRY<__nv_bfloat16, TM_FORMAT_FP4>(const GemmPlan&, const GemmOperands<__nv_bfloat16>&); \
  template void ENTRY<__nv_bfloat16, TM_FORMAT_U4>(const GemmPlan&, const GemmOperands<__nv_bfloat16>&); \
  template void ENTRY<__half, TM_FORMAT_AFFINE>(const GemmPlan&, const GemmOperands<__half>&); \
  template void ENTRY<__nv_bfloat16, TM_FORMAT_AFFINE>(const GemmPlan&, const GemmOperands<__nv_bfloat16>&);
