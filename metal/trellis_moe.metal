// Trellis MoE with fused SwiGLU for Apple GPUs (MSL 3.0; bfloat needs MSL 3.1).
//
//   y[t] = sum_j probs[t, j] * down_e( silu(x_t @ gate_e) * (x_t @ up_e) ),  e = expert_ids[t, j]
//
// The host (csrc/ops/trellis.cpp) routes first, with device ATen ops: a stable sort of the
// (token, slot) pairs by expert gives `sorted_token` (token of each sorted row), `expert_offsets`
// (expert e owns sorted rows [offsets[e], offsets[e+1])) and `slot_row` (sorted row of (t, j)).
// Dispatches on one encoder (planned by plan_trellis_moe; buffer order and sequence in
// csrc/mps/metal_dispatch.h, trellis_moe_dispatches):
// Expert slots: the decode grids hold min(E, T*top_k) expert slots, not E: slot s runs the s-th
// expert (in expert order) that has routed rows (tr_slot_expert), spare slots exit at once; the
// tiled grids hold min(E, T*top_k / 17) slots over the experts with more than 16 rows. At decode
// (T*top_k rows, E >> T*top_k) only the active experts get threadgroups.
//   moe_trellis_gate_up_*  grid (ceil(I/32), slots): for an expert with 1..16 routed rows, a
//                          threadgroup owns 32 intermediate columns and runs the decode core of
//                          trellis_msl.h over all its rows (gate and up together: one staging of the
//                          gathered activations), writing h = silu(g) * u to rows_h [T*top_k, I]
//                          (fp32): each index byte is read once, 16 bytes per load.
//   moe_trellis_tiled_gate_*, moe_trellis_tiled_up_*  (only when T*top_k > 16) grid
//                          (ceil(I/64), ceil(T*top_k/64), slots): experts with more than 16 rows,
//                          the tiled core (64x64 simdgroup-matrix tiles) over the expert's gathered rows; gate
//                          writes g to rows_h, up's epilogue turns it into silu(g) * u.
//   moe_trellis_down_*     grid (ceil(H/32), slots): rows_y = rows_h @ down_e, decode core, <= 16 rows.
//   moe_trellis_tiled_down_*  grid (ceil(H/64), ceil(T*top_k/64), slots): the same, > 16 rows.
//   moe_trellis_combine_*  y[t, n] = sum_j probs[t, j] * rows_y[slot_row[t, j], n], slot order:
//                          deterministic, no atomics.
// Order on the encoder: gate_up, tiled_gate, tiled_up, down, tiled_down, combine.
// Params: TrellisParams with M = tokens, K = hidden, N = intermediate (gate/up are [K, N] per
// expert, down is [N, K]); expert e's tensors start at e times one matrix's size.
// Bad routing data cannot make a kernel read out of bounds: offsets are clamped to max_rows.
#include "torch_marlin/trellis_msl.h"

using namespace metal;
using namespace torch_marlin;

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

// The expert of grid slot `slot`: the slot-th expert (in expert order) with more than `min_rows`
// routed rows, or E when fewer experts have them. Each simdgroup scans 32 experts per step (one ballot of "has rows",
// prefix counts by popcount), so E = 128 is 4 steps; every thread gets the same answer. Call in
// uniform control flow (the ballots).
inline uint tr_slot_expert(device const int* expert_offsets, constant TrellisParams& p, uint slot, uint min_rows,
                           uint lane) {
  const uint E = p.num_experts;
  uint before = 0u;  // active experts below e0
  for (uint e0 = 0u; e0 < E; e0 += 32u) {
    const uint e = e0 + lane;
    const bool active = e < E && expert_offsets[e + 1u] - expert_offsets[e] > int(min_rows);
    const uint mask = uint(ulong(simd_ballot(active)));
    const uint n = popcount(mask);
    if (slot < before + n) {  // uniform: the slot's expert is in this step
      const bool mine = active && popcount(mask & ((1u << lane) - 1u)) == slot - before;
      const uint found = uint(ulong(simd_ballot(mine)));  // one bit
      return e0 + popcount(found - 1u);
    }
    before += n;
  }
  return E;
}

inline float tr_silu(float g) { return g / (1.0f + exp(-g)); }

inline TrDecodeMat tr_decode_mat(thread const TrExpert& x) {
  TrDecodeMat m = {x.packed, x.scales, x.grid, x.su};
  return m;
}

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
  // 16 KiB of activations (the gate and up meets reuse it) + 8 KiB of index bytes + 2 KiB of su.
  TM_THREADGROUP_ARRAY(float, a_s, [2 * kTrDecodeRows * kTrDecodeK]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * 2 * kTrRawWords]);
  TM_THREADGROUP_ARRAY(float, su_s, [2 * 2 * kTrDecodeK]);
  constexpr uint kPart = kTrSimdgroups * kTrDecodeRows * kTrDecodeCols;
  const TrMat w = tr_mat(p);
  const uint e = tr_slot_expert(expert_offsets, p, tgid.y, 0u, lane);
  if (e >= p.num_experts) return;  // a spare slot: uniform across the threadgroup
  const TrExpert g = tr_expert(g_packed, g_scales, g_grid, g_su, g_sv, w, p.n_levels, e);
  const TrExpert u = tr_expert(u_packed, u_scales, u_grid, u_su, u_sv, w, p.n_levels, e);
  uint r_begin, r_end;
  tr_expert_rows(expert_offsets, p, e, r_begin, r_end);
  // Experts with more than 16 rows belong to moe_trellis_tiled_*: one decode pass covers the rest.
  if (r_end == r_begin || r_end - r_begin > kTrDecodeRows) return;  // uniform across the threadgroup
  const uint rows = r_end - r_begin;
  const uint col0 = tgid.x * kTrDecodeCols;
  const TrDecodeMat mats[2] = {tr_decode_mat(g), tr_decode_mat(u)};
  float acc[2 * kTrDecodeRows];
  TM_UNROLL
  for (uint m = 0; m < 2u * kTrDecodeRows; ++m) acc[m] = 0.0f;
  tr_decode_core<T, true, 2>(x, sorted_token, r_begin, rows, mats, w, col0, a_s, raw_s, su_s, lid, sgid, lane, acc);
  TM_UNROLL
  for (uint m = 0; m < kTrDecodeRows; ++m) {
    a_s[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[m];
    a_s[kPart + (sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[kTrDecodeRows + m];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_gate_up_meet]
  for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
    const uint m = i / kTrDecodeCols;
    const uint c = i % kTrDecodeCols;
    const uint col = col0 + c;
    if (m < rows && col < p.N) {
      const float gv = tr_meet(a_s, m, c) * g.sv[col];
      const float uv = tr_meet(a_s + kPart, m, c) * u.sv[col];
      rows_h[(r_begin + m) * p.N + col] = tr_silu(gv) * uv;
    }
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
  TM_THREADGROUP_ARRAY(float, a_s, [2 * kTrDecodeRows * kTrDecodeK]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * kTrRawWords]);
  TM_THREADGROUP_ARRAY(float, su_s, [2 * kTrDecodeK]);
  const TrMat w = tr_down_mat(p);  // [intermediate, hidden]
  const uint e = tr_slot_expert(expert_offsets, p, tgid.y, 0u, lane);
  if (e >= p.num_experts) return;  // a spare slot: uniform across the threadgroup
  const TrExpert d = tr_expert(d_packed, d_scales, d_grid, d_su, d_sv, w, p.n_levels, e);
  uint r_begin, r_end;
  tr_expert_rows(expert_offsets, p, e, r_begin, r_end);
  if (r_end == r_begin || r_end - r_begin > kTrDecodeRows) return;  // tiled_down owns big experts
  const uint rows = r_end - r_begin;
  const uint col0 = tgid.x * kTrDecodeCols;
  const TrDecodeMat mats[1] = {tr_decode_mat(d)};
  float acc[kTrDecodeRows];
  TM_UNROLL
  for (uint m = 0; m < kTrDecodeRows; ++m) acc[m] = 0.0f;
  tr_decode_core<float, false, 1>(rows_h, nullptr, r_begin, rows, mats, w, col0, a_s, raw_s, su_s, lid, sgid, lane,
                                  acc);
  TM_UNROLL
  for (uint m = 0; m < kTrDecodeRows; ++m) a_s[(sgid * kTrDecodeRows + m) * kTrDecodeCols + lane] = acc[m];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_down_meet]
  for (uint i = lid; i < kTrDecodeRows * kTrDecodeCols; i += kTrThreads) {
    const uint m = i / kTrDecodeCols;
    const uint c = i % kTrDecodeCols;
    const uint col = col0 + c;
    if (m < rows && col < w.N) rows_y[(r_begin + m) * w.N + col] = tr_meet(a_s, m, c) * d.sv[col];
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

// ---- tiled path for experts with more than 16 routed rows ------------------------------------------
// The tiled core of trellis_msl.h (as gemm_trellis_packed) over one expert's rows: grid
// (ceil(N_out/64), ceil(T*top_k/64), slots of the experts with more than 16 rows); a threadgroup whose row
// tile lies past the expert's rows, exits at once (the host cannot size the grid per expert
// without a sync). Three dispatches: gate (out = rows_h holds g), up with SWIGLU (rows_h =
// silu(g) * u in the epilogue, reading the g the previous dispatch wrote), down (out = rows_y).
// X is x (type T, rows gathered through sorted_token) for gate/up and rows_h (fp32) for down.
template <typename TX, bool GATHER, bool SWIGLU, bool DOWN>
inline void tr_moe_tiled(device const TX* X, device const int* sorted_token, device const int* expert_offsets,
                         device const uchar* packed, device const float* scales, device const float* grid,
                         device const float* su, device const float* sv, device float* out,
                         constant TrellisParams& p, threadgroup TX* smem, threadgroup uint* raw_s, uint3 tgid,
                         uint lid, uint sgid, uint lane) {
  const TrMat w = DOWN ? tr_down_mat(p) : tr_mat(p);
  const uint e = tr_slot_expert(expert_offsets, p, tgid.z, kTrDecodeRows, lane);
  if (e >= p.num_experts) return;  // a spare slot: uniform across the threadgroup
  uint r_begin, r_end;
  tr_expert_rows(expert_offsets, p, e, r_begin, r_end);
  const uint rows = r_end - r_begin;
  const uint row0 = tgid.y * kTrTileM;
  if (rows <= kTrDecodeRows || row0 >= rows) return;  // uniform across the threadgroup
  const TrExpert ex = tr_expert(packed, scales, grid, su, sv, w, p.n_levels, e);
  const uint col0 = tgid.x * kTrTileN;
  simdgroup_matrix<float, 8, 8> acc[16];
  tr_tiled_core<TX, GATHER>(X, sorted_token, r_begin, rows, ex.packed, ex.scales, ex.grid, ex.su, w, row0, col0, smem,
                            raw_s, lid, sgid, lane, acc);

  const uint sg_first_row = row0 + (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  const uint mi_count = sg_first_row >= rows ? 0u : min(4u, (rows - sg_first_row + 7u) / 8u);
  threadgroup float* stage = (threadgroup float*)smem + sgid * 64u;
  // A constant trip count with the row guard inside: every acc[] index is a constant.
  TM_UNROLL
  for (uint f = 0; f < 16u; ++f) {
    const uint mi = f / 4u, ni = f % 4u;
    if (mi < mi_count) {  // uniform across the simdgroup
      simdgroup_store(acc[f], stage, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_tiled_epilogue_ready]
      for (uint i = lane; i < 64u; i += 32u) {
        const uint m = sg_first_row + mi * 8u + i / 8u;
        const uint n = col0 + sg_col + ni * 8u + i % 8u;
        if (m < rows && n < w.N) {
          const float v = stage[i] * ex.sv[n];
          device float* o = out + (r_begin + m) * w.N + n;
          *o = SWIGLU ? tr_silu(*o) * v : v;
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_moe_tiled_epilogue_free]
    }
  }
}

// Buffers (all three): X, sorted_token, expert_offsets, packed, scales, grid, su, sv, out, params.
template <typename T>
[[kernel]] void moe_trellis_tiled_gate(device const T* x [[buffer(0)]], device const int* sorted_token [[buffer(1)]],
                                       device const int* expert_offsets [[buffer(2)]],
                                       device const uchar* packed [[buffer(3)]], device const float* scales [[buffer(4)]],
                                       device const float* grid [[buffer(5)]], device const float* su [[buffer(6)]],
                                       device const float* sv [[buffer(7)]], device float* rows_h [[buffer(8)]],
                                       constant TrellisParams& p [[buffer(9)]],
                                       uint3 tgid [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]],
                                       uint sgid [[simdgroup_index_in_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(T, smem, [2 * kTrStageElems]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * (kTrRawRowWords + 4)]);
  tr_moe_tiled<T, true, false, false>(x, sorted_token, expert_offsets, packed, scales, grid, su, sv, rows_h, p, smem,
                                      raw_s, tgid, lid, sgid, lane);
}

template <typename T>
[[kernel]] void moe_trellis_tiled_up(device const T* x [[buffer(0)]], device const int* sorted_token [[buffer(1)]],
                                     device const int* expert_offsets [[buffer(2)]],
                                     device const uchar* packed [[buffer(3)]], device const float* scales [[buffer(4)]],
                                     device const float* grid [[buffer(5)]], device const float* su [[buffer(6)]],
                                     device const float* sv [[buffer(7)]], device float* rows_h [[buffer(8)]],
                                     constant TrellisParams& p [[buffer(9)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     uint lid [[thread_index_in_threadgroup]],
                                     uint sgid [[simdgroup_index_in_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(T, smem, [2 * kTrStageElems]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * (kTrRawRowWords + 4)]);
  tr_moe_tiled<T, true, true, false>(x, sorted_token, expert_offsets, packed, scales, grid, su, sv, rows_h, p, smem,
                                     raw_s, tgid, lid, sgid, lane);
}

template <typename T>
[[kernel]] void moe_trellis_tiled_down(device const float* rows_h [[buffer(0)]],
                                       device const int* sorted_token [[buffer(1)]],
                                       device const int* expert_offsets [[buffer(2)]],
                                       device const uchar* packed [[buffer(3)]], device const float* scales [[buffer(4)]],
                                       device const float* grid [[buffer(5)]], device const float* su [[buffer(6)]],
                                       device const float* sv [[buffer(7)]], device float* rows_y [[buffer(8)]],
                                       constant TrellisParams& p [[buffer(9)]],
                                       uint3 tgid [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]],
                                       uint sgid [[simdgroup_index_in_threadgroup]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  // fp32 A and B tiles (rows_h is fp32 scratch): 21.5 KiB.
  TM_THREADGROUP_ARRAY(float, smem, [2 * kTrStageElems]);
  TM_THREADGROUP_ARRAY(uint, raw_s, [2 * (kTrRawRowWords + 4)]);
  tr_moe_tiled<float, false, false, true>(rows_h, sorted_token, expert_offsets, packed, scales, grid, su, sv, rows_y,
                                          p, smem, raw_s, tgid, lid, sgid, lane);
}

#define TM_TRELLIS_MOE_INSTANTIATE_DTYPE(tname, T)                               \
  TM_INSTANTIATE("moe_trellis_gate_up_" #tname, moe_trellis_gate_up<T>)          \
  TM_INSTANTIATE("moe_trellis_down_" #tname, moe_trellis_down<T>)                \
  TM_INSTANTIATE("moe_trellis_combine_" #tname, moe_trellis_combine<T>)          \
  TM_INSTANTIATE("moe_trellis_tiled_gate_" #tname, moe_trellis_tiled_gate<T>)    \
  TM_INSTANTIATE("moe_trellis_tiled_up_" #tname, moe_trellis_tiled_up<T>)        \
  TM_INSTANTIATE("moe_trellis_tiled_down_" #tname, moe_trellis_tiled_down<T>)

TM_TRELLIS_MOE_INSTANTIATE_DTYPE(half, half)
TM_TRELLIS_MOE_INSTANTIATE_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_TRELLIS_MOE_INSTANTIATE_DTYPE(bfloat, bfloat)
#endif
