// MPS backend of the FP4 / INT4 op family: encodes the planner's dispatches (csrc/plan/plan.cpp,
// plan_metal) of the kernels in metal/quant_gemm.metal on PyTorch's current MPS stream.
//
// Rules (docs/metal.md, DESIGN.md "MPS integration"):
//  - buffers: the tensor storage's MTLBuffer with storage_offset() * element_size() as offset;
//  - encode on the stream's own compute encoder inside dispatch_sync on the stream's queue; never
//    end the encoder, commit, wait, or open a second encoder (PyTorch owns all of that);
//  - the Metal library is compiled once from the source embedded at build time
//    (scripts/embed_metal.py); pipeline states are cached by kernel name; compiler errors are
//    raised with the compiler's log.
// Buffer order is the kernels' [[buffer(i)]] order and the Metal-on-CPU harness binds the same
// (csrc/metal_emu/bindings.cpp), so the harness tests exercise this binding too.
//
// Compiled only on macOS (setup.py), without ARC: the library and pipeline states live for the
// process; everything else is autoreleased inside the encoding block.
#ifdef TM_WITH_MPS

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "metal_library_source.h"  // generated: torch_marlin::metal_library_source()
#include "ops/quant_gemm.h"
#include "ops/trellis.h"  // mps_encode_tensors, TrellisParams

namespace torch_marlin {
namespace {

// The MTLBuffer behind an MPS tensor's storage (PyTorch's MPS allocator hands out the buffer
// object itself as the storage's data pointer).
id<MTLBuffer> mtl_buffer(const at::Tensor& t) { return __builtin_bit_cast(id<MTLBuffer>, t.storage().data()); }

struct BufferArg {
  id<MTLBuffer> buffer;
  NSUInteger offset;
};

BufferArg arg(const at::Tensor& t) {
  return BufferArg{mtl_buffer(t), NSUInteger(t.storage_offset() * t.element_size())};
}

id<MTLDevice> mps_device() { return at::mps::MPSDevice::getInstance()->device(); }

class PipelineCache {
 public:
  static PipelineCache& instance() {
    static PipelineCache* cache = new PipelineCache();  // never destroyed: lives with the process
    return *cache;
  }

  id<MTLComputePipelineState> get(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    id<MTLLibrary> lib = library_locked();
    id<MTLComputePipelineState> pso = nil;
    @autoreleasepool {
      id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      TORCH_CHECK(fn != nil, "torch_marlin: Metal kernel '", name, "' is not in the library",
                  name.find("bfloat") != std::string::npos ? " (bfloat16 kernels need macOS 14 / MSL 3.1)" : "");
      NSError* err = nil;
      pso = [mps_device() newComputePipelineStateWithFunction:fn error:&err];
      [fn release];
      TORCH_CHECK(pso != nil, "torch_marlin: pipeline for Metal kernel '", name,
                  "' failed: ", err ? err.localizedDescription.UTF8String : "unknown error");
    }
    pipelines_.emplace(name, pso);
    return pso;
  }

 private:
  id<MTLLibrary> library_locked() {
    if (library_ != nil) return library_;
    @autoreleasepool {
      MTLCompileOptions* opts = [[MTLCompileOptions new] autorelease];
      if (@available(macOS 14.0, *)) {
        opts.languageVersion = MTLLanguageVersion3_1;  // bfloat
      } else {
        opts.languageVersion = MTLLanguageVersion3_0;
      }
      // IEEE semantics: the kernels are checked bit-for-bit against CPU references (dequant).
      opts.fastMathEnabled = NO;
      NSError* err = nil;
      NSString* src = [NSString stringWithUTF8String:metal_library_source()];
      library_ = [mps_device() newLibraryWithSource:src options:opts error:&err];
      TORCH_CHECK(library_ != nil, "torch_marlin: the Metal kernels failed to compile:\n",
                  err ? err.localizedDescription.UTF8String : "(no compiler log)");
    }
    return library_;
  }

  std::mutex mu_;
  id<MTLLibrary> library_ = nil;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

// One dispatch: buffers in [[buffer(i)]] order, then the params struct as the last argument.
template <class Params>
void encode(const std::string& kernel, const uint32_t grid[3], uint32_t threads, const std::vector<BufferArg>& buffers,
            const Params& params) {
  id<MTLComputePipelineState> pso = PipelineCache::instance().get(kernel);
  TORCH_CHECK(threads <= pso.maxTotalThreadsPerThreadgroup, "torch_marlin: kernel '", kernel, "' allows ",
              (unsigned long)pso.maxTotalThreadsPerThreadgroup, " threads per threadgroup on this GPU, the plan asks ",
              threads);
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  const std::vector<BufferArg>* bufs = &buffers;  // dispatch_sync: the stack outlives the block
  const Params* prm = &params;
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
      [enc setComputePipelineState:pso];
      NSUInteger i = 0;
      for (const BufferArg& b : *bufs) [enc setBuffer:b.buffer offset:b.offset atIndex:i++];
      [enc setBytes:prm length:sizeof(Params) atIndex:i];
      [enc dispatchThreadgroups:MTLSizeMake(grid[0], grid[1], grid[2])
          threadsPerThreadgroup:MTLSizeMake(threads, 1, 1)];
    }
  });
}

// GPU cores: Metal does not report them. Known Apple chips by name, TORCH_MARLIN_METAL_CORES to
// override, else the planner's default (8, an M1).
int gpu_cores(id<MTLDevice> dev) {
  if (const char* env = std::getenv("TORCH_MARLIN_METAL_CORES")) {
    const int v = std::atoi(env);
    if (v > 0) return v;
  }
  const std::string name = dev.name.UTF8String;
  struct Chip {
    const char* gen;
    int base, pro, max, ultra;
  };
  static const Chip chips[] = {{"M1", 8, 16, 32, 64}, {"M2", 10, 19, 38, 76}, {"M3", 10, 18, 40, 80},
                               {"M4", 10, 20, 40, 80}};
  for (const Chip& c : chips) {
    if (name.find(std::string("Apple ") + c.gen) == std::string::npos) continue;
    if (name.find("Ultra") != std::string::npos) return c.ultra;
    if (name.find("Max") != std::string::npos) return c.max;
    if (name.find("Pro") != std::string::npos) return c.pro;
    return c.base;
  }
  return default_metal_caps().compute_units;
}

}  // namespace

DeviceCaps mps_device_caps() {
  static const DeviceCaps caps = [] {
    DeviceCaps c = default_metal_caps();
    id<MTLDevice> dev = mps_device();
    c.compute_units = gpu_cores(dev);
    c.max_shared_memory = int(dev.maxThreadgroupMemoryLength);
    return c;
  }();
  return caps;
}

// For the other op families' MPS units (csrc/mps/trellis_mps.mm): one dispatch through this
// file's library, pipeline cache and stream encoder. Declared in ops/trellis.h.
void mps_encode_tensors(const std::string& kernel, const uint32_t grid[3], uint32_t threads,
                        const std::vector<at::Tensor>& tensors, const TrellisParams& params) {
  std::vector<BufferArg> buffers;
  buffers.reserve(tensors.size());
  for (const at::Tensor& t : tensors) buffers.push_back(arg(t));
  encode(kernel, grid, threads, buffers, params);
}

void quant_gemm_mps(const GemmPlan& plan, const QuantGemmArgs& a, at::Tensor& C, at::Tensor& workspace) {
  // Every declared buffer is bound; slots a kernel does not read get a harmless stand-in.
  const BufferArg c = arg(C);
  const BufferArg zeros = a.zeros.defined() ? arg(a.zeros) : arg(a.scales);
  const BufferArg bias = a.bias.defined() ? arg(a.bias) : c;
  const BufferArg ws = workspace.defined() ? arg(workspace) : c;
  TORCH_CHECK(plan.params.k_parallel <= 1 || workspace.defined(), "torch_marlin: K-parallel plan without workspace");
  const QuantGemmParams params = plan.params;
  encode(plan.kernel, plan.grid, plan.threads[0], {arg(a.A), arg(a.B), arg(a.scales), zeros, bias, c, ws}, params);
  if (!plan.reduce_kernel.empty()) {
    // Same serial compute encoder: the reduction sees every partial of the first dispatch.
    const QuantReduceParams rp{params.M, params.N, params.k_parallel, params.has_bias};
    encode(plan.reduce_kernel, plan.reduce_grid, plan.reduce_threads[0], {ws, bias, c}, rp);
  }
}

void quant_dequant_mps(const QuantGemmArgs& a, at::Tensor& W) {
  GemmPlan plan;
  try {
    plan = plan_quant_dequant_metal(a.format, a.K, a.N, a.group_size, a.dtype);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  const BufferArg zeros = a.zeros.defined() ? arg(a.zeros) : arg(a.scales);
  encode(plan.kernel, plan.grid, plan.threads[0], {arg(a.B), arg(a.scales), zeros, arg(W)}, plan.params);
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
