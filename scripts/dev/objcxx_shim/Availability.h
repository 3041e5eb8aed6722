// Declarations for a syntax check only (scripts/dev/check_objcxx_syntax.sh), written from Apple's
// public documentation of the availability macros; not Apple's SDK header. The SDK defines
// __MAC_OS_X_VERSION_MAX_ALLOWED as its own macOS version (major * 10000 + minor * 100): code
// guards declarations that older SDKs lack with it. The check compiles with the newest value
// below and again with -D__MAC_OS_X_VERSION_MAX_ALLOWED=130000 (the macOS 13 SDK), and the Metal
// shim declares only what that SDK version has.
#pragma once

#ifndef __MAC_OS_X_VERSION_MAX_ALLOWED
#define __MAC_OS_X_VERSION_MAX_ALLOWED 150000
#endif

#define __MAC_13_0 130000
#define __MAC_14_0 140000
#define __MAC_15_0 150000

// API_AVAILABLE(macos(15.0), ...) marks a declaration's first OS release; @available(...) guards
// its use. The check compiles for Linux, where clang ignores the macOS platform: kept as a no-op.
#define API_AVAILABLE(...)
