// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public IOKit documentation; not Apple's SDK header. Only the registry calls csrc/mps/*.mm makes,
// with their documented signatures.
#pragma once

#include <CoreFoundation/CoreFoundation.h>

typedef unsigned int mach_port_t;
typedef mach_port_t io_object_t;
typedef io_object_t io_service_t;
typedef io_object_t io_registry_entry_t;
typedef int kern_return_t;
typedef unsigned int IOOptionBits;

#define MACH_PORT_NULL ((mach_port_t)0)
#define IO_OBJECT_NULL ((io_object_t)0)

extern "C" {
CFMutableDictionaryRef IOServiceMatching(const char* name);
io_service_t IOServiceGetMatchingService(mach_port_t mainPort, CFDictionaryRef matching);
CFTypeRef IORegistryEntryCreateCFProperty(io_registry_entry_t entry, CFStringRef key, CFAllocatorRef allocator,
                                          IOOptionBits options);
kern_return_t IOObjectRelease(io_object_t object);
}
