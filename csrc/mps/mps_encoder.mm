// The MPS encoder shared by every op family's MPS unit (quant_gemm_mps.mm, trellis_mps.mm): the
// Metal library, the pipeline cache, tensor -> MTLBuffer binding, the encoding of a dispatch
// list on PyTorch's current MPS stream, and the device caps the planner reads.
//
// Rules (docs/metal.md, DESIGN.md "MPS integration"):
//  - buffers: the tensor storage's MTLBuffer with storage_offset() * element_size() as offset;
//  - encode on the stream's own compute encoder inside dispatch_sync on the stream's queue; never
//    end the encoder, commit, wait, or open a second encoder (PyTorch owns all of that);
//  - the Metal library is compiled once from the source embedded at build time
//    (csrc/mps/embed_metal.py); pipeline states are cached by kernel name; compiler errors are
//    raised with the compiler's log.
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
#include <string>
#include <unordered_map>
#include <vector>

#include "metal_library_source.h"  // generated: torch_marlin::metal_library_source()
#include "mps/mps_encoder.h"
#include "ops/quant_gemm.h"  // mps_device_caps

namespace torch_marlin {
namespace {

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

// PyTorch's MPS allocator hands out the MTLBuffer object itself as the storage's data pointer.
MpsBuffer mps_buffer(const at::Tensor& t) {
  return MpsBuffer{__builtin_bit_cast(id<MTLBuffer>, t.storage().data()),
                   NSUInteger(t.storage_offset() * t.element_size())};
}

void mps_encode(const MetalDispatches<MpsBuffer>& dispatches) {
  std::vector<id<MTLComputePipelineState>> pipelines;
  pipelines.reserve(dispatches.size());
  for (const MetalDispatch<MpsBuffer>& d : dispatches) {
    id<MTLComputePipelineState> pso = PipelineCache::instance().get(d.kernel);
    const unsigned long threads = (unsigned long)d.threads[0] * d.threads[1] * d.threads[2];
    TORCH_CHECK(threads <= pso.maxTotalThreadsPerThreadgroup, "torch_marlin: kernel '", d.kernel, "' allows ",
                (unsigned long)pso.maxTotalThreadsPerThreadgroup, " threads per threadgroup on this GPU, the plan asks ",
                threads);
    pipelines.push_back(pso);
  }
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  const MetalDispatches<MpsBuffer>* list = &dispatches;  // dispatch_sync: the caller's stack outlives the block
  const std::vector<id<MTLComputePipelineState>>* psos = &pipelines;
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
      for (size_t k = 0; k < list->size(); ++k) {
        const MetalDispatch<MpsBuffer>& d = (*list)[k];
        [enc setComputePipelineState:(*psos)[k]];
        NSUInteger i = 0;
        for (const MpsBuffer& b : d.buffers) [enc setBuffer:b.buffer offset:b.offset atIndex:i++];
        [enc setBytes:d.params.data() length:d.params.size() atIndex:i];
        [enc dispatchThreadgroups:MTLSizeMake(d.grid[0], d.grid[1], d.grid[2])
            threadsPerThreadgroup:MTLSizeMake(d.threads[0], d.threads[1], d.threads[2])];
      }
    }
  });
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
