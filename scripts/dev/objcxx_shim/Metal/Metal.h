// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public Metal documentation (developer.apple.com/documentation/metal); not Apple's SDK header.
// Only the protocols, classes, members, types and constants that csrc/mps/*.mm and torch's
// ATen/mps headers use, with their documented Objective-C signatures; a call that is not declared
// here fails the check, so a new Metal call needs its documented declaration added here.
#pragma once

#include <Foundation/Foundation.h>

NS_ASSUME_NONNULL_BEGIN

// MSL versions: major << 16 | minor. 3.0 ships with macOS 13, 3.1 (bfloat) with macOS 14; an SDK
// declares the versions up to its own (__MAC_OS_X_VERSION_MAX_ALLOWED, <Availability.h>).
typedef NS_ENUM(NSUInteger, MTLLanguageVersion){
    MTLLanguageVersion3_0 API_AVAILABLE(macos(13.0)) = (3 << 16) + 0,
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 140000
    MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0)) = (3 << 16) + 1,
#endif
};

#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
// Floating-point optimizations the compiler may make (macOS 15 SDK; replaces fastMathEnabled).
typedef NS_ENUM(NSInteger, MTLMathMode){
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
} API_AVAILABLE(macos(15.0));

// Which FP32 math function variants the library uses (macOS 15 SDK).
typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions){
    MTLMathFloatingPointFunctionsFast = 0,
    MTLMathFloatingPointFunctionsPrecise = 1,
} API_AVAILABLE(macos(15.0));
#endif

// GPU feature families (MTLDevice supportsFamily:); Apple7 = A14 / M1.
typedef NS_ENUM(NSInteger, MTLGPUFamily){
    MTLGPUFamilyApple7 API_AVAILABLE(macos(11.0)) = 1007,
    MTLGPUFamilyApple8 API_AVAILABLE(macos(13.0)) = 1008,
    MTLGPUFamilyMac2 API_AVAILABLE(macos(10.15)) = 2002,
};

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

@protocol MTLDevice;
@protocol MTLCommandBuffer;

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
@end

@protocol MTLFunction <NSObject>
@end

@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
// The SIMD-group width the pipeline runs with on this device.
@property(readonly) NSUInteger threadExecutionWidth;
// Bytes of threadgroup memory the function declares itself (its threadgroup arrays).
@property(readonly) NSUInteger staticThreadgroupMemoryLength API_AVAILABLE(macos(11.0));
@end

@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property(readwrite, nonatomic) BOOL fastMathEnabled;  // superseded by mathMode from macOS 15
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE(macos(15.0));
#endif
@end

@protocol MTLCommandEncoder <NSObject>
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandBuffer <NSObject>
@end

@protocol MTLCommandQueue <NSObject>
@end

@protocol MTLEvent <NSObject>
@end

@protocol MTLSharedEvent <MTLEvent>
@end

@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily API_AVAILABLE(macos(10.15));
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError**)error;
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError**)error;
@end

NS_ASSUME_NONNULL_END
