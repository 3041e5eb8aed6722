// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public MetalPerformanceShaders documentation; not Apple's SDK header. torch's ATen/mps/MPSStream.h
// names MPSCommandBuffer (a command buffer wrapper conforming to MTLCommandBuffer); nothing more
// of the framework is used.
#pragma once

#include <Metal/Metal.h>

NS_ASSUME_NONNULL_BEGIN

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end

NS_ASSUME_NONNULL_END
