// Trellis MoE with fused SwiGLU for Apple GPUs (MSL 3.0; bfloat needs MSL 3.1).
//
//   y[t] = sum_j probs[t, j] * down_e( silu(x_t @ gate_e) * (x_t @ up_e) ),  e = expert_ids[t, j]
//
// The host (csrc/ops/trellis.cpp) routes first, with device ATen ops: a stable sort of the
// (token, slot) pairs by expert gives `sorted_token` (token of each sorted row), `expert_offsets`
// (expert e owns sorted rows [offsets[e], offsets[e+1])) and `slot_row` (sorted row of (t, j)).
// Three dispatches on one encoder (csrc/plan/trellis_plan.cpp, plan_trellis_moe):
//   moe_trellis_gate_up_*  grid (ceil(I/32), E): a threadgroup owns 32 intermediate columns of one
//                          expert and walks that expert's rows in chunks of 16 with the GEMV core
//                          (gate and up together), writing h = silu(g) * u to rows_h [T*top_k, I]
//                          (fp32). Each expert's gate/up weights are read by its threadgroups only,
//                          once per 16-row chunk (a single pass in decode).
//   moe_trellis_down_*     grid (ceil(H/32), E): rows_y = rows_h @ down_e, same structure.
//   moe_trellis_combine_*  y[t, n] = sum_j probs[t, j] * rows_y[slot_row[t, j], n], slot order:
//                          deterministic, no atomics.
// Params: TrellisParams with M = tokens, K = hidden, N = intermediate (gate/up are [K, N] per
// expert, down is [N, K]); expert e's tensors start at e times one matrix's size.
// Bad routing data cannot make a kernel read out of bounds: offsets are clamped to max_rows.
#include <metal_stdlib>

#include "torch_marlin/trellis_msl.h"

using namespace metal;
using namespace torch_marlin;

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

// One expert's matrix inside the [E, ...] tensors.
struct TrExpert {
  device const uchar* packed;
  device const float* scales;
  device const float* grid;
  device const float* su;
  device const float* sv;
};

inline TrExpert tr_expert(device const uchar* packed, device const float* scales, device const float* grid,
                          device const float* su, device const float* sv, thread const TrMat& w, uint n_levels,
                          uint e) {
  TrExpert x = {packed + e * w.tiles_k * w.tiles_n * w.packed_bytes, scales + e * w.n_groups * w.N,
                grid + e * n_levels, su + e * w.K, sv + e * w.N};
  return x;
}

inline void tr_expert_rows(device const int* expert_offsets, constant TrellisParams& p, uint e, thread uint& r_begin,
                           thread uint& r_end) {
  r_end = min(uint(max(expert_offsets[e + 1u], 0)), p.max_rows);
  r_begin = min(uint(max(expert_offsets[e], 0)), r_end);
}

inline float tr_silu(float g) { return g / (1.0f + exp(-g)); }

template <typename T>
[[kernel]] void moe_trellis_gate_up(device const T* x [[buffer(0)]], device const int* sorted_token [[buffer(1)]],
                                    device const int* expert_offsets [[buffer(2)]],
                                    device const uchar* g_packed [[buffer(3)]],
                                    device const float* g_scales [[buffer(4)]],
                                    device const float* g_grid [[buffer(5)]], device const float* g_su [[buffer(6)]],
                                    device const float* g_sv [[buffer(7)]],
                                    device const uchar* u_packed [[buffer(8)]],
                                    device const float* u_scales [[buffer(9)]],
                                    device const float* u_grid [[buffer(10)]], device const float* u_su [[buffer(11)]],
                                    device const float* u_sv [[buffer(12)]], device float* rows_h [[buffer(13)]],
                                    constant TrellisParams& p [[buffer(14)]],
                                    uint3 tgid [[threadgroup_position_in_grid]],
                                    uint lid [[thread_index_in_threadgroup]],
                                    uint sgid [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint kPart = kTrSimdgroups * kTrDecodeRows * kTrDecodeCols;
  TM_THREADGROUP_ARRAY(float, partial, [2 * kPart]);  // gate, up: 16 KiB
  const TrMat w = tr_mat(p);
  const uint e = tgid.y;
  const TrExpert g = tr_expert(g_packed, g_scales, g_grid, g_su, g_sv, w, p.n_levels, e);
  const TrExpert u = tr_expert(u_packed, u_scales, u_grid, u_su, u_sv, w, p.n_levels, e);
  uint r_begin, r_end;
  tr_expert_rows(expert_offsets, p, e, r_begin, r_end);
  const uint n = tgid.x * kTrDecodeCols + lane;
  for (uint r0 = r_begin; r0 < r_end; r0 += kTrDecodeRows) {  // uniform across the threadgroup
    const uint rows = min(kTrDecodeRows, r_end - r0);
    float ag[kTrDecodeRows], au[kTrDecodeRows];
    for (uint m = 0; m < kTrDecodeRows; ++m) {
      ag[m] = 0.0f;
      au[m] = 0.0f;
    }
    tr_gemv_accumulate<T, true>(x, p.K, sorted_token, r0, rows, g.packed, g.scales, g.grid, g.su, w, n, sgid, ag);
    tr_gemv_accumulate<T, true>(x, p.K, sorted_token, r0, rows, u.packed, u.scales, u.grid, u.su, w, n, sgid, au);
    for (uint m = 0; m < kTrDecodeRows; ++m) {
      partial[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = ag[m];
      partial[kPart + (sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = au[m];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_gate_up_meet]
    for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
      const uint m = i / kTrDecodeCols;
      const uint c = i % kTrDecodeCols;
      const uint col = tgid.x * kTrDecodeCols + c;
      if (m < rows && col < p.N) {
        const float gv = tr_meet(partial, m, c) * g.sv[col];
        const float uv = tr_meet(partial + kPart, m, c) * u.sv[col];
        rows_h[(r0 + m) * p.N + col] = tr_silu(gv) * uv;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_gate_up_free]
  }
}

template <typename T>
[[kernel]] void moe_trellis_down(device const float* rows_h [[buffer(0)]], device const int* expert_offsets [[buffer(1)]],
                                 device const uchar* d_packed [[buffer(2)]], device const float* d_scales [[buffer(3)]],
                                 device const float* d_grid [[buffer(4)]], device const float* d_su [[buffer(5)]],
                                 device const float* d_sv [[buffer(6)]], device float* rows_y [[buffer(7)]],
                                 constant TrellisParams& p [[buffer(8)]],
                                 uint3 tgid [[threadgroup_position_in_grid]],
                                 uint lid [[thread_index_in_threadgroup]],
                                 uint sgid [[simdgroup_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, partial, [kTrSimdgroups * kTrDecodeRows * kTrDecodeCols]);  // 8 KiB
  const TrMat w = tr_down_mat(p);  // [intermediate, hidden]
  const uint e = tgid.y;
  const TrExpert d = tr_expert(d_packed, d_scales, d_grid, d_su, d_sv, w, p.n_levels, e);
  uint r_begin, r_end;
  tr_expert_rows(expert_offsets, p, e, r_begin, r_end);
  const uint n = tgid.x * kTrDecodeCols + lane;
  for (uint r0 = r_begin; r0 < r_end; r0 += kTrDecodeRows) {  // uniform across the threadgroup
    const uint rows = min(kTrDecodeRows, r_end - r0);
    float acc[kTrDecodeRows];
    for (uint m = 0; m < kTrDecodeRows; ++m) acc[m] = 0.0f;
    tr_gemv_accumulate<float, false>(rows_h, w.K, nullptr, r0, rows, d.packed, d.scales, d.grid, d.su, w, n, sgid,
                                     acc);
    for (uint m = 0; m < kTrDecodeRows; ++m) partial[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[m];
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_down_meet]
    for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
      const uint m = i / kTrDecodeCols;
      const uint c = i % kTrDecodeCols;
      const uint col = tgid.x * kTrDecodeCols + c;
      if (m < rows && col < w.N) rows_y[(r0 + m) * w.N + col] = tr_meet(partial, m, c) * d.sv[col];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_down_free]
  }
}

template <typename T>
[[kernel]] void moe_trellis_combine(device const float* rows_y [[buffer(0)]], device const int* slot_row [[buffer(1)]],
                                    device const float* probs [[buffer(2)]], device T* y [[buffer(3)]],
                                    constant TrellisParams& p [[buffer(4)]],
                                    uint3 tgid [[threadgroup_position_in_grid]],
                                    uint lid [[thread_index_in_threadgroup]],
                                    uint sgid [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  const uint i = tgid.x * kTrCombineThreads + lid;
  if (i >= p.M * p.K) return;
  const uint t = i / p.K;
  const uint n = i % p.K;
  float v = 0.0f;
  for (uint j = 0; j < p.top_k; ++j) {
    const uint r = min(uint(max(slot_row[t * p.top_k + j], 0)), p.max_rows - 1u);
    v += probs[t * p.top_k + j] * rows_y[r * p.K + n];
  }
  y[i] = T(v);
}

#define TM_TRELLIS_MOE_INSTANTIATE_DTYPE(tname, T)                               \
  TM_INSTANTIATE("moe_trellis_gate_up_" #tname, moe_trellis_gate_up<T>)          \
  TM_INSTANTIATE("moe_trellis_down_" #tname, moe_trellis_down<T>)                \
  TM_INSTANTIATE("moe_trellis_combine_" #tname, moe_trellis_combine<T>)

TM_TRELLIS_MOE_INSTANTIATE_DTYPE(half, half)
TM_TRELLIS_MOE_INSTANTIATE_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_TRELLIS_MOE_INSTANTIATE_DTYPE(bfloat, bfloat)
#endif
