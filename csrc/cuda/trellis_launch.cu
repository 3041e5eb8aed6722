// The CUDA entry points of the trellis op family (docs/trellis.md, "CUDA"): each executes the
// TrellisPlan it is given (kernel names, grids, K slices) on the current stream, with the fp32
// workspaces of the K slices and the MoE's routed rows taken from the caching allocator for this
// call only (so CUDA graphs capture them like any other allocation). Nothing here chooses a kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/kernels.h"
#include "cuda/trellis_kernels.h"
#include "ops/trellis.h"

namespace torch_marlin {
namespace cuda_backend {
namespace {

// Expert strides are the tensors' leading-dim strides (0 for a dense matrix).
TrellisMatrixPtrs matrix_ptrs(const TrellisWeights& w, bool experts) {
  TrellisMatrixPtrs p;
  p.packed = w.packed.data_ptr<uint8_t>();
  p.scales = w.scales.data_ptr<float>();
  p.grid = w.grid.data_ptr<float>();
  p.su = w.su.data_ptr<float>();
  p.sv = w.sv.data_ptr<float>();
  p.packed_stride = experts ? uint64_t(w.packed.stride(0)) : 0;
  p.scales_stride = experts ? uint64_t(w.scales.stride(0)) : 0;
  p.grid_stride = experts ? uint32_t(w.grid.stride(0)) : 0;
  p.su_stride = experts ? uint32_t(w.su.stride(0)) : 0;
  p.sv_stride = experts ? uint32_t(w.sv.stride(0)) : 0;
  return p;
}

TrellisKernelArgs base_args(const TrellisParams& p, const KernelLaunch& l) {
  TrellisKernelArgs a{};
  a.M = p.M;
  a.K = p.K;
  a.N = p.N;
  a.group_size = p.group_size;
  a.tiles_k = p.tiles_k;
  a.tiles_n = p.tiles_n;
  a.n_groups = p.n_groups;
  a.k_slice_tiles = l.k_slice_tiles;
  a.k_parallel = l.k_parallel;
  a.m_tiles = l.grid[1] / l.k_parallel;
  a.experts = 1;
  a.a_parts = 1;
  return a;
}

// The dense weight in the activation dtype (this call only), then cuBLAS.
template <typename T>
void dequant_blas(const TrellisPlan& plan, const TrellisGemmArgs& g, at::Tensor& C, cudaStream_t stream) {
  at::Tensor W = at::empty({g.K, g.N}, g.A.options());
  T* w = reinterpret_cast<T*>(W.data_ptr());
  const TrellisMatrixPtrs ptrs = matrix_ptrs(g.w, false);
  const KernelLaunch& dequant = plan.launches.at(LaunchRole::Main);
  if (plan.index_layout == TrellisIndexLayout::Lanes) {
    launch_trellis_dequant_lanes<T>(dequant, plan.params, ptrs, w, stream);
  } else {
    launch_trellis_dequant<T>(dequant, plan.params, ptrs, w, stream);
  }
  at::mm_out(C, g.A, W);
}

// The wgmma prefill: the rewritten activations (this call only), then the kernel.
template <typename T>
void wgmma_prefill(const TrellisPlan& plan, const TrellisGemmArgs& g, at::Tensor& C, cudaStream_t stream) {
  const TrellisParams& p = plan.params;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TrellisKernelArgs a = base_args(p, main);
  a.m_tiles = p.m_tiles;  // this grid is (row tiles, column blocks), not base_args' layout
  a.w[0] = a.w[1] = matrix_ptrs(g.w, false);
  a.A = g.A.data_ptr();
  a.lda = p.K;
  a.ldc = p.N;
  a.out[0] = C.data_ptr();
  at::Tensor Ap = at::empty({g.M, int64_t(trellis_lane_padded_k(p.tiles_k))}, g.A.options());
  launch_trellis_wgmma<T>(plan.launches.at(LaunchRole::Activations), main, p.bits, p.tile_m, a,
                          reinterpret_cast<T*>(Ap.data_ptr()), stream);
}

template <typename T>
void gemm_typed(const TrellisPlan& plan, const TrellisGemmArgs& g, at::Tensor& C, cudaStream_t stream) {
  const TrellisParams& p = plan.params;
  if (plan.family == KernelFamily::DequantBlas) return dequant_blas<T>(plan, g, C, stream);
  if (plan.family == KernelFamily::Wgmma) {
    TORCH_CHECK(plan.index_layout == TrellisIndexLayout::Lanes, "torch_marlin: the trellis wgmma plan reads lanes");
    return wgmma_prefill<T>(plan, g, C, stream);
  }
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TrellisKernelArgs a = base_args(p, main);
  a.w[0] = a.w[1] = matrix_ptrs(g.w, false);
  a.stage_groups = plan.cuda_stream_stage_groups ? 1u : 0u;
  a.A = g.A.data_ptr();
  a.lda = p.K;
  a.ldc = p.N;
  at::Tensor ws;
  if (main.k_parallel > 1) {
    ws = at::empty({int64_t(main.k_parallel), g.M, g.N}, C.options().dtype(at::kFloat));
    a.out[0] = ws.data_ptr();
    a.out_f32 = 1;
    a.out_part_stride = uint64_t(g.M) * uint64_t(g.N);
  } else {
    a.out[0] = C.data_ptr();
  }
  const bool lanes = plan.index_layout == TrellisIndexLayout::Lanes;
  if (plan.cuda_stream_decode) launch_trellis_stream<T>(main, p.bits, p.tile_m, lanes, a, stream);
  else launch_trellis_mma<T>(main, p.bits, p.tile_m, false, a, stream);
  if (main.k_parallel > 1) {
    launch_trellis_reduce<T>(plan.launches.at(LaunchRole::Reduce), ws.data_ptr<float>(), main.k_parallel,
                             a.out_part_stride, reinterpret_cast<T*>(C.data_ptr()), stream);
  }
}

// Gate and up (one launch, grid.z = 2E) into fp32 partials rows_g / rows_u [kp, R, I], down
// (A = silu(gate) * up, summed over the slices while staged) into rows_y [kp_down, R, H], then the
// combine. TA: the activations' type (T, or float with the fp32 kernel).
template <typename T>
void moe_typed(const TrellisPlan& plan, const TrellisMoeArgs& m, at::Tensor& y, cudaStream_t stream) {
  const TrellisParams& p = plan.params;
  const bool simt = plan.family == KernelFamily::Simt;
  const int64_t R = m.T * m.top_k;
  const auto f32 = m.x.options().dtype(at::kFloat);
  const KernelLaunch& gate_up = plan.launches.at(LaunchRole::Main);
  const KernelLaunch& down = plan.launches.at(LaunchRole::Down);
  const KernelLaunch* route = plan.launches.find(LaunchRole::Route);
  at::Tensor rows_gu = at::empty({2, int64_t(gate_up.k_parallel), R, m.intermediate}, f32);
  at::Tensor rows_y = at::empty({int64_t(down.k_parallel), R, m.hidden}, f32);
  const uint64_t gu_part = uint64_t(R) * uint64_t(m.intermediate);
  at::Tensor routing;  // offsets [E + 1], sorted_token [R], slot_row [R], active [slots]
  const int32_t *offsets = nullptr, *sorted_token = nullptr, *slot_row = nullptr, *active = nullptr;
  const uint32_t slots = down.grid[2];
  if (plan.moe_row_slots) {
    // No routing: slot r is routed row r, its expert expert_ids[r] (the kernels clamp it).
  } else if (route != nullptr) {
    routing = at::empty({m.E + 1 + 2 * R + int64_t(slots)}, m.x.options().dtype(at::kInt));
    int32_t* r = routing.data_ptr<int32_t>();
    launch_trellis_route(*route, m.expert_ids.data_ptr(), m.expert_ids.scalar_type() == at::kLong, uint32_t(R),
                         uint32_t(m.top_k), uint32_t(m.E), r, r + m.E + 1, r + m.E + 1 + R, r + m.E + 1 + 2 * R,
                         stream);
    offsets = r;
    sorted_token = r + m.E + 1;
    slot_row = r + m.E + 1 + R;
    active = r + m.E + 1 + 2 * R;
  } else {
    offsets = m.expert_offsets.data_ptr<int32_t>();
    sorted_token = m.sorted_token.data_ptr<int32_t>();
    slot_row = m.slot_row.data_ptr<int32_t>();
  }

  TrellisKernelArgs gu = base_args(p, gate_up);
  gu.w[0] = matrix_ptrs(m.gate, true);
  gu.w[1] = matrix_ptrs(m.up, true);
  gu.A = m.x.data_ptr();
  gu.lda = uint32_t(m.hidden);
  gu.row_map = sorted_token;
  gu.offsets = offsets;
  gu.out[0] = rows_gu.data_ptr<float>();
  gu.out[1] = rows_gu.data_ptr<float>() + gu_part * gate_up.k_parallel;
  gu.out_f32 = 1;
  gu.out_part_stride = gu_part;
  gu.ldc = uint32_t(m.intermediate);
  gu.M = uint32_t(R);
  gu.experts = slots;
  gu.active_experts = active;
  if (plan.moe_row_slots) {
    gu.row_experts = m.expert_ids.data_ptr();
    gu.row_experts_int64 = m.expert_ids.scalar_type() == at::kLong ? 1u : 0u;
    gu.num_experts = uint32_t(m.E);
    gu.top_k = uint32_t(m.top_k);
  }

  TrellisKernelArgs dn = base_args(p, down);
  dn.K = uint32_t(m.intermediate);
  dn.N = uint32_t(m.hidden);
  dn.tiles_k = p.down_tiles_k;
  dn.tiles_n = p.down_tiles_n;
  dn.n_groups = p.down_n_groups;
  dn.w[0] = dn.w[1] = matrix_ptrs(m.down, true);
  dn.A = gu.out[0];
  dn.A2 = static_cast<const float*>(gu.out[1]);
  dn.a_parts = gate_up.k_parallel;
  dn.a_part_stride = gu_part;
  dn.lda = uint32_t(m.intermediate);
  dn.offsets = gu.offsets;
  dn.out[0] = dn.out[1] = rows_y.data_ptr<float>();
  dn.out_f32 = 1;
  dn.out_part_stride = uint64_t(R) * uint64_t(m.hidden);
  dn.ldc = uint32_t(m.hidden);
  dn.M = uint32_t(R);
  dn.experts = slots;
  dn.active_experts = active;
  dn.row_experts = gu.row_experts;
  dn.row_experts_int64 = gu.row_experts_int64;
  dn.num_experts = gu.num_experts;
  dn.top_k = gu.top_k;

  TORCH_CHECK(gate_up.grid[2] == 2 * slots &&
                  (plan.moe_row_slots ? plan.cuda_stream_decode && slots == uint32_t(R)
                                      : active != nullptr || slots == uint32_t(m.E)),
              "torch_marlin: the MoE plan's expert slots do not match its routing");
  constexpr bool kFloat = std::is_same<T, float>::value;
  TORCH_CHECK(simt == kFloat, "torch_marlin: the MoE plan '", gate_up.kernel,
              "' does not match the activation dtype");
  if (simt) {
    launch_trellis_simt(gate_up, p.bits, false, gu, stream);
    launch_trellis_simt(down, p.bits, true, dn, stream);
  } else if constexpr (!std::is_same<T, float>::value) {
    if (plan.cuda_stream_decode) {
      gu.stage_groups = dn.stage_groups = plan.cuda_stream_stage_groups ? 1u : 0u;
      launch_trellis_stream<T>(gate_up, p.bits, p.tile_m, false, gu, stream);
      launch_trellis_stream<T>(down, p.bits, p.tile_m, false, dn, stream);
    } else {
      launch_trellis_mma<T>(gate_up, p.bits, p.tile_m, false, gu, stream);
      launch_trellis_mma<T>(down, p.bits, p.tile_m, true, dn, stream);
    }
  }
  launch_trellis_combine<T>(plan.launches.at(LaunchRole::Combine), rows_y.data_ptr<float>(), down.k_parallel,
                            dn.out_part_stride,
                            m.probs.data_ptr<float>(), slot_row, uint32_t(m.T),
                            uint32_t(m.top_k), uint32_t(m.hidden), reinterpret_cast<T*>(y.data_ptr()), stream);
}

}  // namespace
}  // namespace cuda_backend

void CudaBackend::trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& C) {
  const c10::cuda::CUDAGuard guard(a.A.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  TORCH_CHECK(plan.caps.backend == Backend::CUDA && int64_t(plan.params.M) == a.M && int64_t(plan.params.K) == a.K &&
                  int64_t(plan.params.N) == a.N && int64_t(plan.params.bits) == a.bits,
              "torch_marlin: the CUDA trellis plan '", main.kernel, "' does not match the call");
  switch (a.dtype) {
    case DType::F32: {
      if (plan.family == KernelFamily::DequantBlas) {
        cuda_backend::dequant_blas<float>(plan, a, C, stream);
        break;
      }
      TORCH_CHECK(plan.family == KernelFamily::Simt, "torch_marlin: fp32 trellis plan has kernel '", main.kernel, "'");
      cuda_backend::TrellisKernelArgs k = cuda_backend::base_args(plan.params, main);
      k.w[0] = k.w[1] = cuda_backend::matrix_ptrs(a.w, false);
      k.A = a.A.data_ptr();
      k.lda = plan.params.K;
      k.out[0] = k.out[1] = C.data_ptr();
      k.out_f32 = 1;
      k.ldc = plan.params.N;
      cuda_backend::launch_trellis_simt(main, plan.params.bits, false, k, stream);
      break;
    }
    case DType::F16: cuda_backend::gemm_typed<__half>(plan, a, C, stream); break;
    case DType::BF16: cuda_backend::gemm_typed<__nv_bfloat16>(plan, a, C, stream); break;
  }
}

void CudaBackend::trellis_dequant(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& W) {
  const c10::cuda::CUDAGuard guard(W.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cuda_backend::TrellisMatrixPtrs w = cuda_backend::matrix_ptrs(a.w, false);
  const KernelLaunch& dequant = plan.launches.at(LaunchRole::Main);
  if (plan.index_layout == TrellisIndexLayout::Lanes) {
    cuda_backend::launch_trellis_dequant_lanes<float>(dequant, plan.params, w, W.data_ptr<float>(), stream);
  } else {
    cuda_backend::launch_trellis_dequant<float>(dequant, plan.params, w, W.data_ptr<float>(), stream);
  }
}

void CudaBackend::trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& a, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(a.x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (a.dtype) {
    case DType::F32: cuda_backend::moe_typed<float>(plan, a, y, stream); break;
    case DType::F16: cuda_backend::moe_typed<__half>(plan, a, y, stream); break;
    case DType::BF16: cuda_backend::moe_typed<__nv_bfloat16>(plan, a, y, stream); break;
  }
}

}  // namespace torch_marlin
