// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public Foundation documentation; not Apple's SDK header. Only the classes and members that
// csrc/mps/*.mm and torch's ATen/mps headers use, with their documented signatures.
#pragma once

#include <Availability.h>
#include <objc/NSObject.h>
#include <dispatch/dispatch.h>  // Foundation makes libdispatch visible, as the SDK's does

NS_ASSUME_NONNULL_BEGIN

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String NS_RETURNS_INNER_POINTER;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path isDirectory:(BOOL)isDir;
@end

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject
@end

NS_ASSUME_NONNULL_END
