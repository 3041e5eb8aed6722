// Conventions every metal/*.metal file follows, so that one source compiles with Apple's
// compiler, in the Metal-on-CPU harness (as C++ over csrc/metal_emu/metal_stdlib) and in the
// address-space check (clang over scripts/dev/metal_ascheck/metal_stdlib). MSL only.
//
//  - Threadgroup arrays are declared with TM_THREADGROUP_ARRAY(T, name, [dims]): a plain MSL
//    declaration here; the harness gives each threadgroup a shared, NaN-poisoned arena instead.
//  - Every [[kernel]] takes its buffers first, in [[buffer(i)]] order (the params struct last),
//    then the four thread ids (tgid, lid, sgid, lane). The harness binds buffers by position.
//  - Kernels are templates instantiated under their host name with TM_INSTANTIATE("name",
//    kernel<args>); the planner builds the same name strings. The harness and the check define
//    TM_EMU_REGISTER_KERNEL to register / type-check the instantiation instead.
//  - Loops over simdgroup_matrix arrays (and other per-thread arrays that must stay in registers)
//    have a constant trip count with any run-time bound as a guard inside, and are marked
//    TM_UNROLL: fully unrolled, every index is a compile-time constant (a run-time index into a
//    thread array puts it in memory). Apple's compiler is clang, as is the IR report's; the
//    harness's g++ ignores the hint.
//  - Each .metal file is self-contained (it includes what it uses) and is a Metal library of its
//    own (csrc/mps/embed_metal.py); host names are unique across files, since the MPS backend
//    finds a kernel's library by its name.
#pragma once

#include <metal_stdlib>

#if defined(__clang__) || defined(__METAL_MACOS__) || !defined(__GNUC__)
#define TM_UNROLL _Pragma("clang loop unroll(full)")
#else
#define TM_UNROLL
#endif

#ifndef TM_THREADGROUP_ARRAY
#define TM_THREADGROUP_ARRAY(T, name, dims) threadgroup T name dims
#endif

#ifndef TM_INSTANTIATE
#if defined(TM_EMU_REGISTER_KERNEL)
#define TM_INSTANTIATE(name, ...) TM_EMU_REGISTER_KERNEL(name, __VA_ARGS__)
#else
#define TM_INSTANTIATE(name, ...) \
  template [[host_name(name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
#endif
#endif
