// Kernels that exercise the Metal-on-CPU shim itself (tests/test_metal_barriers.py): simd
// collectives, device atomics, threadgroup-memory poisoning, and barrier divergence detection.
// Compiled only into the harness, never shipped.
#include <metal_stdlib>
using namespace metal;

#ifndef TM_THREADGROUP_ARRAY
#define TM_THREADGROUP_ARRAY(T, name, dims) threadgroup T name dims
#endif
#if defined(TM_METAL_EMULATOR)
#define TM_INSTANTIATE_PLAIN(name, fn) TM_EMU_REGISTER_KERNEL(name, fn)
#endif

// out[4 * i + {0,1,2,3}] = simd_sum, shuffle from lane + 5, shuffle_down by 1, broadcast of lane 7.
[[kernel]] void selftest_simd(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                              uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                              uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const float x = in[lid];
  out[4 * lid + 0] = simd_sum(x);
  out[4 * lid + 1] = simd_shuffle(x, ushort((lane + 5u) % 32u));
  out[4 * lid + 2] = simd_shuffle_down(x, ushort(1));
  out[4 * lid + 3] = simd_broadcast(x, ushort(7));
}

[[kernel]] void selftest_atomic(device atomic_uint* counter [[buffer(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
}

// Reads threadgroup memory nobody wrote: the harness must hand out NaN, not zeros.
[[kernel]] void selftest_poison(device float* out [[buffer(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, scratch, [128]);
  out[tgid.x * 128 + lid] = scratch[(lid + 1u) % 128u];
}

// Shares a value through threadgroup memory across simdgroups: correct only with the barrier.
[[kernel]] void selftest_share(device float* out [[buffer(0)]],
                               uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                               uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, scratch, [128]);
  scratch[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = scratch[127u - lid];
}

// Only half the threads reach the barrier: undefined on a GPU (hang or garbage); an error here.
[[kernel]] void selftest_divergent(device float* out [[buffer(0)]],
                                   uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                   uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  if (lid < 64u) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

// 40 KiB of threadgroup memory: more than any Apple GPU grants; the harness refuses it.
[[kernel]] void selftest_too_much_tg(device float* out [[buffer(0)]],
                                     uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                     uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, big, [10240]);
  big[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = big[lid];
}

TM_INSTANTIATE_PLAIN("selftest_too_much_tg", selftest_too_much_tg)
TM_INSTANTIATE_PLAIN("selftest_simd", selftest_simd)
TM_INSTANTIATE_PLAIN("selftest_atomic", selftest_atomic)
TM_INSTANTIATE_PLAIN("selftest_poison", selftest_poison)
TM_INSTANTIATE_PLAIN("selftest_share", selftest_share)
TM_INSTANTIATE_PLAIN("selftest_divergent", selftest_divergent)
