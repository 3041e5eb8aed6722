// MoE routing on the GPU in one launch (planned when tokens * top_k is small: decode batches):
// the same stable grouping of the (token, slot) rows by expert as trellis_route (csrc/ops/trellis.h),
// which costs a dozen small ATen launches. One block; row i = t * top_k + j goes to sorted position
// #{rows with a smaller expert} + #{earlier rows with the same expert}. Ids outside [0, E) are
// clamped (no host sync to reject them), so every index stays in bounds.
#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

template <typename Id>
__global__ void __launch_bounds__(TM_TRELLIS_CUDA_ROUTE_THREADS)
    trellis_route_kernel(const Id* __restrict__ ids, u32 rows, u32 top_k, u32 experts, int32_t* __restrict__ offsets,
                         int32_t* __restrict__ sorted_token, int32_t* __restrict__ slot_row,
                         int32_t* __restrict__ active) {
  __shared__ int32_t e_s[TM_TRELLIS_CUDA_ROUTE_MAX_ROWS];
  __shared__ int32_t off_s[TM_TRELLIS_CUDA_ROUTE_MAX_EXPERTS + 1];
  const u32 tid = threadIdx.x;
  for (u32 i = tid; i < rows; i += blockDim.x) {
    e_s[i] = int32_t(clamped_expert(int64_t(ids[i]), experts));
  }
  __syncthreads();
  for (u32 i = tid; i < rows; i += blockDim.x) {
    const int32_t e = e_s[i];
    u32 pos = 0;
    for (u32 j = 0; j < rows; ++j) pos += (e_s[j] < e) || (e_s[j] == e && j < i) ? 1u : 0u;
    sorted_token[pos] = int32_t(i / top_k);
    slot_row[i] = int32_t(pos);
  }
  for (u32 e = tid; e <= experts; e += blockDim.x) {
    u32 n = 0;
    for (u32 j = 0; j < rows; ++j) n += e_s[j] < int32_t(e) ? 1u : 0u;
    offsets[e] = off_s[e] = int32_t(n);
  }
  __syncthreads();
  // The experts with rows, in increasing order, fill the first slots of the GEMM grids; the slots
  // past them (min(E, rows) in all) get -1 and their blocks exit at once.
  const u32 slots = min(experts, rows);
  for (u32 i = tid; i < slots; i += blockDim.x) active[i] = -1;
  __syncthreads();
  for (u32 e = tid; e < experts; e += blockDim.x) {
    if (off_s[e + 1] == off_s[e]) continue;
    u32 rank = 0;
    for (u32 f = 0; f < e; ++f) rank += off_s[f + 1] > off_s[f] ? 1u : 0u;
    active[rank] = int32_t(e);
  }
}

}  // namespace

namespace cuda_backend {

void launch_trellis_route(const KernelLaunch& l, const void* ids, bool ids_int64, uint32_t rows, uint32_t top_k,
                          uint32_t experts, int32_t* offsets, int32_t* sorted_token, int32_t* slot_row,
                          int32_t* active, cudaStream_t stream) {
  TORCH_CHECK(rows <= TM_TRELLIS_CUDA_ROUTE_MAX_ROWS && experts <= TM_TRELLIS_CUDA_ROUTE_MAX_EXPERTS &&
                  l.threads[0] == TM_TRELLIS_CUDA_ROUTE_THREADS,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the routing kernel");
  if (ids_int64) {
    trellis_route_kernel<int64_t><<<1, TM_TRELLIS_CUDA_ROUTE_THREADS, 0, stream>>>(
        static_cast<const int64_t*>(ids), rows, top_k, experts, offsets, sorted_token, slot_row, active);
  } else {
    trellis_route_kernel<int32_t><<<1, TM_TRELLIS_CUDA_ROUTE_THREADS, 0, stream>>>(
        static_cast<const int32_t*>(ids), rows, top_k, experts, offsets, sorted_token, slot_row, active);
  }
  check_launch(l.kernel.c_str());
}

}  // namespace cuda_backend
}  // namespace torch_marlin
