// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public documentation of libdispatch (dispatch_object(3), dispatch_sync(3)); not Apple's SDK
// header. As there, dispatch objects are Objective-C objects when compiled as Objective-C(++):
// a dispatch_queue_t is an NSObject conforming to OS_dispatch_queue.
#pragma once

#ifdef __OBJC__
#include <objc/NSObject.h>
@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_object>* dispatch_object_t;
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
#else
typedef struct dispatch_queue_s* dispatch_queue_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef void (^dispatch_block_t)(void);

// Runs `block` on `queue` and returns after it has finished; the block does not escape the call.
void dispatch_sync(dispatch_queue_t _Nonnull queue, __attribute__((noescape)) dispatch_block_t _Nonnull block);

#ifdef __cplusplus
}
#endif
