// The CUDA entry points of the FP4 E2M1 / INT4 op family (docs/cuda.md explains the design).
//
// Every launch executes a GemmPlan from the planner (csrc/plan/): plan.desc names the kernel family
// and its template parameters, plan.params carries the geometry. This file checks that the plan
// belongs to this call, pads the weights to plan.padded_n columns, zeroes the K-slice arrival
// counters and switches on plan.desc.family; each family's file (kernels.h) instantiates the
// kernel the descriptor names. Nothing here chooses a kernel or a geometry.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "cuda/kernels.h"

namespace torch_marlin {
namespace cuda_backend {

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  TORCH_CHECK(e == cudaSuccess, "torch_marlin: CUDA launch of ", what, " failed: ", cudaGetErrorString(e));
}

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The fast kernels read 16-byte chunks of B (4 columns), scales and offsets (8) and zeros (16): they need the
// column count padded to a multiple of 16 and 16-byte aligned bases. Real models satisfy this;
// other shapes get a zero-padded copy (correct, one extra pass over the weights).
at::Tensor pad_cols(const at::Tensor& t, int64_t Np) {
  if (t.size(1) == Np && aligned16(t)) return t;
  at::Tensor out = at::zeros({t.size(0), Np}, t.options());
  out.narrow(1, 0, t.size(1)).copy_(t);
  return out;
}

// B, scales and (U4) zeros or (affine) offsets with Np columns.
PaddedWeights padded_weights(const QuantGemmArgs& a, int64_t Np) {
  return {pad_cols(a.B, Np), pad_cols(a.scales, Np), a.zeros.defined() ? pad_cols(a.zeros, Np) : at::Tensor(),
          a.offsets.defined() ? pad_cols(a.offsets, Np) : at::Tensor()};
}

// Per-tile arrival counters of the in-kernel K-slice reduction: the plan's slot in this call's
// workspace (plan.counters_offset), zeroed on the stream before the launch. Per call rather than
// one cached buffer per stream so that CUDA graphs stay correct: a buffer made during capture (or
// during torch.compile's cudagraph warmup, which allocates from the graph's pool) would outlive
// the call inside the graph's memory, and one buffer shared by graphs replayed on different
// streams would mix their counts. The memset is one small node in a graph, and on eager calls
// costs one driver call (only K-parallel plans without a cluster reach it).
int* zeroed_tile_counters(const GemmPlan& plan, at::Tensor& ws, cudaStream_t stream) {
  const size_t bytes = size_t(plan.params.m_tiles) * plan.params.n_tiles * sizeof(int);
  TORCH_CHECK(ws.defined() && plan.counters_offset % sizeof(int) == 0 &&
                  plan.counters_offset + bytes <= size_t(ws.numel()) * sizeof(float),
              "torch_marlin: the K-parallel plan '", plan.launches.at(LaunchRole::Main).kernel,
              "' has no room for its tile counters");
  int* counters = reinterpret_cast<int*>(static_cast<char*>(ws.data_ptr()) + plan.counters_offset);
  C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, bytes, stream));
  return counters;
}

// The fp16/bf16 families.
template <typename T, uint32_t FMT>
void launch_fast(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& ws, cudaStream_t stream) {
  const KernelFamily family = plan.desc.family;
  TORCH_CHECK(family == KernelFamily::Decode || family == KernelFamily::DequantBlas || family == KernelFamily::Wgmma ||
                  family == KernelFamily::WgmmaWs,
              "torch_marlin: no CUDA fp16/bf16 kernel for the plan '", plan.launches.at(LaunchRole::Main).kernel, "'");
  TORCH_CHECK(plan.padded_n >= a.N && plan.padded_n % 16u == 0, "torch_marlin: bad padded_n ", plan.padded_n,
              " in the CUDA plan for N = ", a.N);
  const PaddedWeights w = padded_weights(a, int64_t(plan.padded_n));
  if (family == KernelFamily::DequantBlas) return launch_dequant_blas<T, FMT>(plan, a, w, C, ws, stream);
  const at::Tensor A = aligned16(a.A) ? a.A : a.A.clone();
  GemmOperands<T> o;
  o.A = reinterpret_cast<const T*>(A.data_ptr());
  o.B = reinterpret_cast<const uint32_t*>(w.B.data_ptr());
  o.scales = reinterpret_cast<const T*>(w.scales.data_ptr());
  o.zeros = w.zeros.defined() ? w.zeros.data_ptr<uint8_t>() : nullptr;
  o.offsets = w.offsets.defined() ? reinterpret_cast<const T*>(w.offsets.data_ptr()) : nullptr;
  o.bias = a.bias.defined() ? reinterpret_cast<const T*>(a.bias.data_ptr()) : nullptr;
  o.C = reinterpret_cast<T*>(C.data_ptr());
  o.Np = plan.padded_n;
  o.ws = ws.defined() ? ws.data_ptr<float>() : nullptr;
  o.counters = nullptr;
  o.stream = stream;
  if (plan.desc.reduce == ReduceKind::LastBlock) {
    TORCH_CHECK(o.ws != nullptr, "torch_marlin: K-parallel plan without workspace");
    o.counters = zeroed_tile_counters(plan, ws, stream);
  }
  switch (family) {
    case KernelFamily::Decode: return launch_decode<T, FMT>(plan, o);
    case KernelFamily::Wgmma: return launch_wgmma<T, FMT>(plan, o);
    case KernelFamily::WgmmaWs: return launch_wgmma_ws<T, FMT>(plan, o);
    default: return;  // excluded above
  }
}

template <uint32_t FMT>
void gemm_for_format(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& ws,
                     cudaStream_t stream) {
  switch (plan.desc.dtype) {
    case DType::F16: launch_fast<__half, FMT>(plan, a, C, ws, stream); break;
    case DType::BF16: launch_fast<__nv_bfloat16, FMT>(plan, a, C, ws, stream); break;
    case DType::F32:
      TORCH_CHECK(plan.desc.family == KernelFamily::Simt, "torch_marlin: fp32 plan has kernel '",
                  plan.launches.at(LaunchRole::Main).kernel, "'");
      launch_simt<FMT>(plan, a, C, stream);
      break;
  }
}

// The standalone dequant has no plan: the dequant kernel's only layout need is B, scales and zeros
// (offsets) padded to a multiple of 16 columns.
template <uint32_t FMT>
void dequant_for_format(const QuantGemmArgs& a, at::Tensor& W, cudaStream_t stream) {
  const PaddedWeights w = padded_weights(a, (a.N + 15) / 16 * 16);
  const uint32_t n = uint32_t(a.N);
  switch (a.dtype) {
    case DType::F16: launch_dequant<__half, FMT>(a, w, 0, n, n, reinterpret_cast<__half*>(W.data_ptr()), stream); break;
    case DType::BF16:
      launch_dequant<__nv_bfloat16, FMT>(a, w, 0, n, n, reinterpret_cast<__nv_bfloat16*>(W.data_ptr()), stream);
      break;
    case DType::F32: launch_dequant<float, FMT>(a, w, 0, n, n, W.data_ptr<float>(), stream); break;
  }
}

}  // namespace
}  // namespace cuda_backend

DeviceCaps CudaBackend::caps(const at::Device& device) {
  const int dev = device.index() >= 0 ? device.index() : int(c10::cuda::current_device());
  // Cached per device: the planner asks on every call.
  static std::mutex mu;
  static std::vector<DeviceCaps> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (int(cache.size()) <= dev) cache.resize(dev + 1);
  if (cache[dev].backend != Backend::CUDA) {
    int sms = 0, smem = 0, major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    // Clusters need an sm_90+ device and kernels from sm_90+ PTX: a build with only compute_80 PTX,
    // JIT-compiled on an H100, has cluster_reduce compiled out. Every kernel file is compiled for
    // the same targets, so one decode instantiation speaks for them all.
    cudaFuncAttributes attr;
    {
      const c10::cuda::CUDAGuard guard(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(dev)));
      attr = cuda_backend::decode_kernel_attributes();
    }
    cache[dev].backend = Backend::CUDA;
    cache[dev].compute_units = sms;
    cache[dev].max_shared_memory = smem;
    cache[dev].thread_block_clusters = major >= 9 && attr.ptxVersion >= 90 ? 1 : 0;
    // wgmma needs the sm_90a kernels (setup.py builds them for TORCH_CUDA_ARCH_LIST "9.0a"), which
    // load only on compute capability 9.0; another build or device keeps dequant_blas.
    int minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
#ifdef TM_CUDA_SM90A
    cache[dev].wgmma = major == 9 && minor == 0 && attr.ptxVersion >= 90 ? 1 : 0;
#else
    cache[dev].wgmma = 0;
#endif
  }
  DeviceCaps caps = cache[dev];
  return caps;
}

void CudaBackend::quant_gemm(const GemmPlan& plan, const QuantGemmArgs& args, at::Tensor& C, at::Tensor& workspace) {
  const KernelDesc& d = plan.desc;
  const QuantGemmParams& q = plan.params;
  TORCH_CHECK(d.backend == Backend::CUDA && d.format == args.format && d.dtype == args.dtype &&
                  int64_t(q.M) == args.M && int64_t(q.K) == args.K && int64_t(q.N) == args.N &&
                  int64_t(q.group_size) == args.group_size && (q.has_bias != 0) == args.bias.defined() &&
                  (plan.workspace_bytes == 0 ||
                   (workspace.defined() && size_t(workspace.numel()) * sizeof(float) >= plan.workspace_bytes)),
              "torch_marlin: the CUDA plan '", plan.launches.at(LaunchRole::Main).kernel, "' does not match the call");
  const c10::cuda::CUDAGuard guard(args.A.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (d.format) {
    case QuantFormat::FP4: cuda_backend::gemm_for_format<TM_FORMAT_FP4>(plan, args, C, workspace, stream); break;
    case QuantFormat::U4: cuda_backend::gemm_for_format<TM_FORMAT_U4>(plan, args, C, workspace, stream); break;
    case QuantFormat::Affine: cuda_backend::gemm_for_format<TM_FORMAT_AFFINE>(plan, args, C, workspace, stream); break;
  }
}

void CudaBackend::quant_dequant(const QuantGemmArgs& args, at::Tensor& W) {
  const c10::cuda::CUDAGuard guard(args.B.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (args.format) {
    case QuantFormat::FP4: cuda_backend::dequant_for_format<TM_FORMAT_FP4>(args, W, stream); break;
    case QuantFormat::U4: cuda_backend::dequant_for_format<TM_FORMAT_U4>(args, W, stream); break;
    case QuantFormat::Affine: cuda_backend::dequant_for_format<TM_FORMAT_AFFINE>(args, W, stream); break;
  }
}

}  // namespace torch_marlin
