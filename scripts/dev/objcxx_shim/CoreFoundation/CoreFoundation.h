// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public Core Foundation documentation; not Apple's SDK header. Only the types and functions that
// csrc/mps/*.mm use, with their documented signatures.
#pragma once

typedef const void* CFTypeRef;
typedef unsigned long CFTypeID;
typedef long CFIndex;
typedef unsigned char Boolean;
typedef const struct __CFString* CFStringRef;
typedef const struct __CFNumber* CFNumberRef;
typedef const struct __CFAllocator* CFAllocatorRef;
typedef const struct __CFDictionary* CFDictionaryRef;
typedef struct __CFDictionary* CFMutableDictionaryRef;

typedef enum : CFIndex {
  kCFNumberSInt32Type = 3,
  kCFNumberIntType = 9,
} CFNumberType;

extern "C" {
extern const CFAllocatorRef kCFAllocatorDefault;
CFTypeID CFGetTypeID(CFTypeRef cf);
CFTypeID CFNumberGetTypeID(void);
Boolean CFNumberGetValue(CFNumberRef number, CFNumberType theType, void* valuePtr);
void CFRelease(CFTypeRef cf);
}

// A compile-time constant CFString, as the SDK defines it.
#define CFSTR(cStr) ((CFStringRef)__builtin___CFStringMakeConstantString("" cStr ""))
