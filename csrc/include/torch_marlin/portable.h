// The few macros that let one header compile as MSL (Apple's metal compiler and the project's
// Metal-on-CPU shim), CUDA and plain C++.
#pragma once

#if defined(__METAL_VERSION__)
// MSL (or the Metal-on-CPU harness, which defines __METAL_VERSION__ over its shim).
#define TM_HOST_CXX 0
#define TM_FN inline
typedef uint tm_u32;
#elif defined(__CUDACC__)
#define TM_HOST_CXX 1
#include <stdint.h>
#define TM_FN __host__ __device__ inline
typedef uint32_t tm_u32;
#else
#define TM_HOST_CXX 1
#include <stdint.h>
#define TM_FN inline
typedef uint32_t tm_u32;
#endif

#define TM_NAMESPACE_BEGIN namespace torch_marlin {
#define TM_NAMESPACE_END }

#define TM_CEIL_DIV(a, b) (((a) + (b) - 1u) / (b))
