// Probe kernels for the performance tools (scripts/dev/metal_ir_report.py, the harness load
// tracer in tests/metal_load_trace.py): each one has exactly the property one metric must detect,
// and tests/test_metal_perf_gates.py checks that it does. Never shipped.
//
// Every probe: threadgroups of 32 threads (one simdgroup), B is the "weight" buffer; threadgroup g
// owns the block B[g][rows][32] (lane = column, coalesced) unless the probe says otherwise, and
// writes one sum per lane to out.
#include "torch_marlin/msl_kernel.h"

using namespace metal;

struct ProbeParams {
  uint rows;   // rows of B per threadgroup
  uint group;  // divisor of probe_divide_in_loop (a runtime value, as a group size is)
};

// 16-byte weight loads: each lane reads one uint4 per row.
template <typename T>
[[kernel]] void probe_vector_loads(device const uint4* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                   constant ProbeParams& p [[buffer(2)]],
                                   uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                   uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  uint acc = 0;
  for (uint r = 0; r < p.rows; ++r) {
    const uint4 v = B[(tgid.x * p.rows + r) * 32u + lane];
    acc += (v.x ^ v.y) + (v.z ^ v.w);
  }
  out[tgid.x * 32u + lane] = acc;
}

// 4-byte weight loads over the same layout.
template <typename T>
[[kernel]] void probe_scalar_loads(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                   constant ProbeParams& p [[buffer(2)]],
                                   uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                   uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  uint acc = 0;
  for (uint r = 0; r < p.rows; ++r) acc += B[(tgid.x * p.rows + r) * 32u + lane];
  out[tgid.x * 32u + lane] = acc;
}

// An integer division by a runtime value in the loop (as k / group_size).
template <typename T>
[[kernel]] void probe_divide_in_loop(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                     constant ProbeParams& p [[buffer(2)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     uint lid [[thread_index_in_threadgroup]],
                                     uint sgid [[simdgroup_index_in_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  uint acc = 0;
  for (uint r = 0; r < p.rows; ++r) acc += B[(tgid.x * p.rows + r) * 32u + lane] * (r / p.group + 1u);
  out[tgid.x * 32u + lane] = acc;
}

// Every weight byte read twice: two passes over the block.
template <typename T>
[[kernel]] void probe_read_twice(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                 constant ProbeParams& p [[buffer(2)]],
                                 uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                                 uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  uint acc = 0;
  for (uint pass = 0; pass < 2u; ++pass)
    for (uint r = 0; r < p.rows; ++r) acc = acc * 3u + B[(tgid.x * p.rows + r) * 32u + lane];
  out[tgid.x * 32u + lane] = acc;
}

// Uncoalesced: lane l reads word 16 l of a 16x wider row, one 64-byte segment per lane.
template <typename T>
[[kernel]] void probe_strided(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                              constant ProbeParams& p [[buffer(2)]],
                              uint3 tgid [[threadgroup_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                              uint sgid [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  uint acc = 0;
  for (uint r = 0; r < p.rows; ++r) acc += B[((tgid.x * p.rows + r) * 32u + lane) * 16u];
  out[tgid.x * 32u + lane] = acc;
}

// 30 KiB of threadgroup memory and two threadgroup barriers per row.
template <typename T>
[[kernel]] void probe_threadgroup_memory(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                         constant ProbeParams& p [[buffer(2)]],
                                         uint3 tgid [[threadgroup_position_in_grid]],
                                         uint lid [[thread_index_in_threadgroup]],
                                         uint sgid [[simdgroup_index_in_threadgroup]],
                                         uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(uint, stage, [7680]);  // 30 KiB
  uint acc = 0;
  for (uint r = 0; r < p.rows; ++r) {
    stage[(r % 240u) * 32u + lid] = B[(tgid.x * p.rows + r) * 32u + lane];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += stage[(r % 240u) * 32u + (lid + 1u) % 32u];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tgid.x * 32u + lane] = acc;
}

// Per-lane accumulators over a run-time number of slots: the loop bound is p.group, so the
// accumulator array is indexed at run time (it cannot stay in registers). The _unrolled probe has
// the same arithmetic with a constant trip count and the bound as a guard inside.
template <typename T>
[[kernel]] void probe_dynamic_thread_index(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                           constant ProbeParams& p [[buffer(2)]],
                                           uint3 tgid [[threadgroup_position_in_grid]],
                                           uint lid [[thread_index_in_threadgroup]],
                                           uint sgid [[simdgroup_index_in_threadgroup]],
                                           uint lane [[thread_index_in_simdgroup]]) {
  uint acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint slots = min(8u, p.group);
  for (uint r = 0; r < p.rows; ++r) {
    for (uint i = 0; i < slots; ++i) acc[i] += B[(tgid.x * p.rows + r) * 32u + lane] >> i;
  }
  out[tgid.x * 32u + lane] = acc[0] ^ acc[lane & 7u];
}

template <typename T>
[[kernel]] void probe_constant_thread_index(device const uint* B [[buffer(0)]], device uint* out [[buffer(1)]],
                                            constant ProbeParams& p [[buffer(2)]],
                                            uint3 tgid [[threadgroup_position_in_grid]],
                                            uint lid [[thread_index_in_threadgroup]],
                                            uint sgid [[simdgroup_index_in_threadgroup]],
                                            uint lane [[thread_index_in_simdgroup]]) {
  uint acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint slots = min(8u, p.group);
  for (uint r = 0; r < p.rows; ++r) {
    const uint b = B[(tgid.x * p.rows + r) * 32u + lane];
    TM_UNROLL
    for (uint i = 0; i < 8u; ++i) {
      if (i < slots) acc[i] += b >> i;
    }
  }
  uint x = 0;
  TM_UNROLL
  for (uint i = 0; i < 8u; ++i) x ^= (i == 0u || i == (lane & 7u)) ? acc[i] : 0u;
  out[tgid.x * 32u + lane] = x;
}

TM_INSTANTIATE("probe_vector_loads", probe_vector_loads<uint>)
TM_INSTANTIATE("probe_dynamic_thread_index", probe_dynamic_thread_index<uint>)
TM_INSTANTIATE("probe_constant_thread_index", probe_constant_thread_index<uint>)
TM_INSTANTIATE("probe_scalar_loads", probe_scalar_loads<uint>)
TM_INSTANTIATE("probe_divide_in_loop", probe_divide_in_loop<uint>)
TM_INSTANTIATE("probe_read_twice", probe_read_twice<uint>)
TM_INSTANTIATE("probe_strided", probe_strided<uint>)
TM_INSTANTIATE("probe_threadgroup_memory", probe_threadgroup_memory<uint>)
