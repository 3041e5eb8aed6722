// The MPS encoder shared by every op family's MPS unit (quant_gemm_mps.mm, trellis_mps.mm): the
// Metal libraries, the pipeline cache, tensor -> MTLBuffer binding, the encoding of a dispatch
// list on PyTorch's current MPS stream, and the device caps the planner reads.
//
// Rules (docs/metal.md, "Host side"):
//  - buffers: the tensor storage's MTLBuffer with storage_offset() * element_size() as offset;
//  - encode on the stream's own compute encoder inside dispatch_sync on the stream's queue; never
//    end the encoder, commit, wait, or open a second encoder (PyTorch owns all of that);
//  - one Metal library per metal/*.metal file, loaded when one of its kernels is first asked for:
//    the prebuilt <stem>-<hash>.metallib in metallib/ beside this extension (setup.py, macOS 14+),
//    else the file's source embedded at build time, compiled here (MSL 3.1 on macOS 14+, 3.0 on
//    macOS 13, IEEE math either way). The generated table (csrc/mps/embed_metal.py) names the file
//    of every kernel, so a file that fails to load disables only its own kernels, and asking for
//    one of them raises an error naming the file with the compiler's log;
//  - no C++ exception leaves an @autoreleasepool or a dispatch block: errors are recorded inside
//    and raised after it ends (the pool is drained, the queue's block returns normally);
//  - what this Mac cannot run (a library or pipeline that fails, a GPU that is not an Apple GPU
//    with 32-wide simdgroups, a kernel needing a newer macOS) raises NotImplementedError, and
//    nothing else does: on that error the Python layer runs the op's plain-torch path
//    (torch_marlin/metal_fallback.py).
//
// Compiled only on macOS (setup.py), without ARC: the libraries and pipeline states live for the
// process; everything else is autoreleased inside the pools below.
#ifdef TM_WITH_MPS

#import <Foundation/Foundation.h>
#import <IOKit/IOKitLib.h>
#import <Metal/Metal.h>

#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <Availability.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "metal_library_sources.h"  // generated: metal_source_files(), metal_kernel_files()
#include "mps/mps_encoder.h"
#include "ops/quant_gemm.h"  // mps_device_caps

// What the SDK the extension is compiled against declares (the run-time checks are @available):
// MTLLanguageVersion3_1 from the macOS 14 SDK, MTLCompileOptions.mathMode from the macOS 15 SDK.
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 140000
#define TM_SDK_HAS_MSL_3_1 1
#else
#define TM_SDK_HAS_MSL_3_1 0
#endif
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
#define TM_SDK_HAS_MATH_MODE 1
#else
#define TM_SDK_HAS_MATH_MODE 0
#endif

namespace torch_marlin {
namespace {

id<MTLDevice> mps_device() { return at::mps::MPSDevice::getInstance()->device(); }

std::string describe(NSError* err) {
  return err != nil && err.localizedDescription != nil ? err.localizedDescription.UTF8String : "no message";
}

// The MSL version this process compiles embedded sources with: 3.1 (bfloat kernels) needs
// macOS 14 at run time and the macOS 14 SDK at build time.
int runtime_msl_version() {
#if TM_SDK_HAS_MSL_3_1
  if (@available(macOS 14.0, *)) return 310;
#endif
  return 300;
}

MTLCompileOptions* new_compile_options() {
  MTLCompileOptions* opts = [MTLCompileOptions new];
#if TM_SDK_HAS_MSL_3_1
  opts.languageVersion = runtime_msl_version() >= 310 ? MTLLanguageVersion3_1 : MTLLanguageVersion3_0;
#else
  opts.languageVersion = MTLLanguageVersion3_0;
#endif
  // IEEE semantics: the kernels are checked bit-for-bit against CPU references (dequant), and
  // the prebuilt libraries are compiled with -fno-fast-math.
#if TM_SDK_HAS_MATH_MODE
  if (@available(macOS 15.0, *)) {
    opts.mathMode = MTLMathModeSafe;
    opts.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    return opts;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // superseded by mathMode on macOS 15
  opts.fastMathEnabled = NO;
#pragma clang diagnostic pop
  return opts;
}

// The folder of this extension's file (dladdr of one of its functions): setup.py installs the
// prebuilt libraries in metallib/ there.
std::string metallib_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&mps_device_caps), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return (slash == std::string::npos ? std::string(".") : path.substr(0, slash)) + "/metallib";
}

// One .metal file's library: the prebuilt one when it exists and loads (macOS 14+: it is built
// for MSL 3.1), else its embedded source compiled now. Never throws; nil + *error on failure.
id<MTLLibrary> load_library(const MetalSourceFile& file, std::string* error) {
  id<MTLLibrary> lib = nil;
  std::string prebuilt_error;
  @autoreleasepool {
    if (@available(macOS 14.0, *)) {
      const std::string dir = metallib_dir();
      const std::string path = dir + "/" + file.metallib;
      if (!dir.empty() && access(path.c_str(), R_OK) == 0) {
        NSError* err = nil;
        NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()] isDirectory:NO];
        lib = [mps_device() newLibraryWithURL:url error:&err];
        if (lib == nil) prebuilt_error = "loading " + path + " failed (" + describe(err) + "); ";
      }
    }
    if (lib == nil) {
      MTLCompileOptions* opts = [new_compile_options() autorelease];
      NSError* err = nil;
      NSString* src = [NSString stringWithUTF8String:file.source];
      lib = [mps_device() newLibraryWithSource:src options:opts error:&err];
      if (lib == nil) *error = prebuilt_error + "compiling its source failed:\n" + describe(err);
    }
  }
  return lib;
}

const MetalKernelFile* find_kernel(const std::string& name) {
  static const std::unordered_map<std::string, const MetalKernelFile*>* index = [] {
    auto* m = new std::unordered_map<std::string, const MetalKernelFile*>();
    for (int i = 0; i < kMetalKernelCount; ++i) m->emplace(metal_kernel_files()[i].kernel, &metal_kernel_files()[i]);
    return m;
  }();
  auto it = index->find(name);
  return it == index->end() ? nullptr : it->second;
}

// A kernel whose threadgroup arrays do not fit this GPU would fail at dispatch time, far from
// its cause. The dispatch description sets no dynamic threadgroup memory (every kernel declares
// its arrays), so the pipeline's static length is the whole demand. Empty when it fits.
std::string threadgroup_memory_error(const std::string& name, id<MTLComputePipelineState> pso) {
  constexpr NSUInteger kDynamicBytes = 0;
  const NSUInteger need = pso.staticThreadgroupMemoryLength + kDynamicBytes;
  const NSUInteger have = mps_device().maxThreadgroupMemoryLength;
  if (need <= have) return "";
  return "torch_marlin: Metal kernel '" + name + "' needs " + std::to_string((unsigned long)need) +
         " bytes of threadgroup memory; this GPU allows " + std::to_string((unsigned long)have);
}

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
    const MetalKernelFile* k = find_kernel(name);
    const std::string& not_apple = apple_gpu_error();
    TORCH_CHECK_NOT_IMPLEMENTED(not_apple.empty(), not_apple);
    TORCH_CHECK_NOT_IMPLEMENTED(k != nullptr, "torch_marlin: no metal/*.metal file of this build defines the Metal "
                                "kernel '", name, "'");
    TORCH_CHECK_NOT_IMPLEMENTED(k->msl_version <= runtime_msl_version(), "torch_marlin: Metal kernel '", name,
                                "' needs MSL 3.1: macOS 14 or later, and an extension built with the macOS 14 SDK or "
                                "newer");
    const MetalSourceFile& file = metal_source_files()[k->file];
    id<MTLLibrary> lib = library_locked(k->file);
    TORCH_CHECK_NOT_IMPLEMENTED(lib != nil, "torch_marlin: Metal kernel '", name, "' is unavailable: metal/",
                                file.name, " did not load: ", libraries_[k->file].error);
    id<MTLComputePipelineState> pso = nil;
    std::string error;
    @autoreleasepool {
      id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (fn == nil) {
        error = std::string("metal/") + file.name + " has no function '" + name + "'";
      } else {
        NSError* err = nil;
        pso = [mps_device() newComputePipelineStateWithFunction:fn error:&err];
        [fn release];
        if (pso == nil) error = "pipeline creation failed: " + describe(err);
      }
    }
    TORCH_CHECK_NOT_IMPLEMENTED(pso != nil, "torch_marlin: Metal kernel '", name, "' (metal/", file.name, "): ",
                                error);
    std::string unfit = threadgroup_memory_error(name, pso);
    // Every kernel's lane arithmetic (shuffles, fragment ownership) assumes 32-wide simdgroups.
    if (unfit.empty() && pso.threadExecutionWidth != kAppleSimdWidth) {
      unfit = "torch_marlin: Metal kernel '" + name + "' runs " + std::to_string((unsigned long)pso.threadExecutionWidth) +
              "-wide SIMD groups on this GPU; the kernels need 32";
    }
    if (!unfit.empty()) [pso release];
    TORCH_CHECK_NOT_IMPLEMENTED(unfit.empty(), unfit);
    pipelines_.emplace(name, pso);
    return pso;
  }

 private:
  struct Library {
    bool tried = false;
    id<MTLLibrary> library = nil;
    std::string error;  // why library is nil
  };

  id<MTLLibrary> library_locked(int file) {
    Library& l = libraries_[file];
    if (!l.tried) {
      l.tried = true;
      l.library = load_library(metal_source_files()[file], &l.error);
    }
    return l.library;
  }

  // Empty on an Apple GPU (Apple7 family: M1 / A14 and later, what the kernels' simdgroup matrices
  // and 32-wide simdgroups are written for), else why the kernels cannot run on this one.
  static const std::string& apple_gpu_error() {
    static const std::string error = [] {
      id<MTLDevice> dev = mps_device();
      if ([dev supportsFamily:MTLGPUFamilyApple7]) return std::string();
      std::string gpu;
      @autoreleasepool {
        gpu = dev.name.UTF8String;
      }
      return "torch_marlin: the Metal kernels need an Apple GPU (M1 or later); this Mac's GPU is " + gpu;
    }();
    return error;
  }

  static constexpr NSUInteger kAppleSimdWidth = 32;
  std::mutex mu_;
  std::vector<Library> libraries_ = std::vector<Library>(kMetalSourceFileCount);
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

// The GPU's core count as the registry reports it (the AGXAccelerator entry's gpu-core-count: the
// binned chips' real count, which no name tells), 0 when it does not.
int registry_gpu_cores() {
  int cores = 0;
  // MACH_PORT_NULL: IOKit's default main port on every macOS version.
  io_service_t gpu = IOServiceGetMatchingService(MACH_PORT_NULL, IOServiceMatching("AGXAccelerator"));
  if (gpu == IO_OBJECT_NULL) return 0;
  CFTypeRef value = IORegistryEntryCreateCFProperty(gpu, CFSTR("gpu-core-count"), kCFAllocatorDefault, 0);
  if (value != nullptr) {
    if (CFGetTypeID(value) == CFNumberGetTypeID() && !CFNumberGetValue((CFNumberRef)value, kCFNumberIntType, &cores))
      cores = 0;
    CFRelease(value);
  }
  IOObjectRelease(gpu);
  return cores > 0 ? cores : 0;
}

// GPU cores: Metal does not report them. TORCH_MARLIN_METAL_CORES overrides; else the registry;
// else the full chip of the name (a binned chip has fewer), else the planner's default (8, an M1).
int gpu_cores(id<MTLDevice> dev) {
  if (const char* env = std::getenv("TORCH_MARLIN_METAL_CORES")) {
    const int v = std::atoi(env);
    if (v > 0) return v;
  }
  if (const int cores = registry_gpu_cores()) return cores;
  std::string name;
  @autoreleasepool {
    name = dev.name.UTF8String;
  }
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
    TORCH_CHECK_NOT_IMPLEMENTED(threads <= pso.maxTotalThreadsPerThreadgroup, "torch_marlin: kernel '", d.kernel,
                                "' allows ", (unsigned long)pso.maxTotalThreadsPerThreadgroup,
                                " threads per threadgroup on this GPU, the plan asks ", threads);
    pipelines.push_back(pso);
  }
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  const MetalDispatches<MpsBuffer>* list = &dispatches;  // dispatch_sync: the caller's stack outlives the block
  const std::vector<id<MTLComputePipelineState>>* psos = &pipelines;
  std::exception_ptr error;  // an exception must not unwind through the queue's block
  std::exception_ptr* error_out = &error;
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      try {
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
      } catch (...) {
        *error_out = std::current_exception();
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace torch_marlin

#endif  // TM_WITH_MPS
