// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public documentation of the Objective-C runtime; not Apple's SDK header. Holds the root class,
// the NSObject protocol and the scalar types that Foundation, Metal and libdispatch build on, as
// much as csrc/mps/*.mm and torch's ATen/mps headers use.
#pragma once

typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef bool BOOL;  // arm64 macOS: BOOL is the C/C++ bool
#define YES true
#define NO false
#define nil nullptr

#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
#define NS_ENUM(type, name) enum name : type name; enum name : type
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))

NS_ASSUME_NONNULL_BEGIN

@protocol NSObject
- (oneway void)release;
- (instancetype)autorelease;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)new;
@end

NS_ASSUME_NONNULL_END
