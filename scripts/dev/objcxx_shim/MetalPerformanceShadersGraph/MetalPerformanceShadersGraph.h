// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public MetalPerformanceShadersGraph documentation; not Apple's SDK header. torch's
// ATen/mps/MPSStream.h names these classes as member and parameter types; nothing more of the
// framework is used.
#pragma once

#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

NS_ASSUME_NONNULL_BEGIN

@interface MPSGraphObject : NSObject
@end

@interface MPSGraph : MPSGraphObject
@end

@interface MPSGraphExecutionDescriptor : MPSGraphObject
@end

@interface MPSGraphCompilationDescriptor : MPSGraphObject
@end

NS_ASSUME_NONNULL_END
