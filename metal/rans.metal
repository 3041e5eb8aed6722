// rANS-coded 4-bit codes (docs/formats.md, "rANS-coded 4-bit codes"): rans_gemv_m<R>_<fmt>_<dtype>,
// the fused decode + GEMV for M <= 16 (R = 1, 2, 4, 8, 16 rows), and rans_decode_packed, the
// decode of the codes back into B_packed [K/8, N] (the prefill path then runs the FP4 / INT4
// prefill GEMM on it).
//
// One threadgroup = one simdgroup = one tile: the format gives a tile exactly 32 interleaved lane
// states, so lane l decodes code[32 j + l, n] at step j of channel n. Per step each lane updates its
// state from a per-tile slot table, the lanes that must renormalize vote (simd_ballot) and take the
// next words of the tile's stream in lane order (popcount of the lower lanes' votes). The stream is
// staged into a threadgroup ring with 16-byte loads, 256 words (512 bytes on whole 64-byte
// segments: one uint4 per lane) whenever fewer than 257 staged words are left, so the ring always
// holds the next step's words (at most 32) and is refilled once per 8 or more steps.
//
// Bounds: every device read of the stream is a whole uint4 inside the tile's stream (offsets taken
// down to 8 words and clamped to the word count), and every ring and table index is masked, so a
// corrupted stream, state or frequency table gives wrong numbers, never a read outside the tile.
#include "torch_marlin/quant_gemm_msl.h"
#include "torch_marlin/rans_params.h"

using namespace metal;
using namespace torch_marlin;

constant constexpr uint kRansRingWords = TM_METAL_RANS_RING_WORDS;  // 512: two refills
constant constexpr uint kRansRefillWords = kRansRingWords / 2u;    // one uint4 per lane
constant constexpr uint kRansSlotsPerLane = TM_RANS_PROB_SCALE / TM_RANS_LANES;
// The ring's element: 8 stream words. A name of its own because the load-tracing build spells
// MSL's vector constructors as function-like macros, which a declarator `uint4(&ring)` would call.
typedef uint4 RansChunk;

// The decoder of one tile, held by the 32 lanes of a simdgroup.
//  table: 4096 slots, entry = (slot - cum[s]) << 4 | s (12 + 4 bits); freq[s] comes from lane s
//         by a shuffle, so the table is 8 KiB (a 32-bit entry with the frequency would be 16).
//  ring:  kRansRingWords stream words; `staged` words of the stream have been stored, `ptr` taken.
struct RansLane {
  uint x;          // this lane's state
  uint freq;       // freq[lane & 15]
  uint ptr;        // stream words taken by the simdgroup, counted from `base`
  uint staged;     // words from `base` stored into the ring (zeros outside the stream)
  uint base;       // begin taken down to 32 words: every refill is 8 whole 64-byte segments
  uint begin, end; // the tile's stream, in words, 8-aligned, inside the words buffer
};

// Stores words [base + staged, base + staged + 256) into the ring: one 16-byte load per lane,
// zeros outside the tile's stream (the words before `begin` are skipped by ptr, those past `end`
// are never read).
inline void rans_refill(device const uint4* words, threadgroup uint4* ring4, thread RansLane& d, uint lane) {
  const uint at = d.base + d.staged + lane * 8u;  // a multiple of 8
  const uint4 v = at >= d.begin && at + 8u <= d.end ? words[at / 8u] : uint4(0u, 0u, 0u, 0u);
  ring4[((d.staged / 8u) + lane) & (kRansRingWords / 8u - 1u)] = v;
  d.staged += kRansRefillWords;
}

// Tile start: the lane's state and frequency, the slot table (lane l writes slots [128 l, 128 l +
// 128); symbol 15 takes every slot past cum[15], so each slot is written even when the table does
// not sum to 4096) and the first two refills of the ring.
inline RansLane rans_begin(device const uint4* words, device const uint* word_offsets, device const uint* states,
                           device const ushort* freqs, constant RansParams& p, threadgroup ushort* table,
                           threadgroup uint4* ring4, uint tile, uint lane) {
  RansLane d;
  const uint n_words = p.n_words & ~7u;
  d.end = min(word_offsets[tile + 1u] & ~7u, n_words);
  d.begin = min(word_offsets[tile] & ~7u, d.end);
  d.x = states[tile * TM_RANS_LANES + lane];
  d.freq = freqs[tile * TM_RANS_SYMBOLS + (lane & 15u)];
  d.base = d.begin & ~31u;
  d.ptr = d.begin - d.base;
  d.staged = 0u;

  device const uint4* f4 = (device const uint4*)(freqs + tile * TM_RANS_SYMBOLS);  // 32 bytes per tile
  const uint4 f0 = f4[0], f1 = f4[1];
  const uint packed[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
  const uint lo = lane * kRansSlotsPerLane, hi = lo + kRansSlotsPerLane;
  uint cum = 0u;
  TM_UNROLL
  for (uint s = 0; s < TM_RANS_SYMBOLS; ++s) {
    const uint f = (packed[s / 2u] >> (16u * (s & 1u))) & 0xFFFFu;
    const uint next = s + 1u == TM_RANS_SYMBOLS ? TM_RANS_PROB_SCALE : cum + f;
    for (uint slot = max(cum, lo); slot < min(next, hi); ++slot) table[slot] = ushort(((slot - cum) << 4) | s);
    cum = next;
  }
  rans_refill(words, ring4, d, lane);
  rans_refill(words, ring4, d, lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:rans_tile_ready]
  return d;
}

// One decode step: the lane's symbol, with the state renormalized from the ring.
inline uint rans_step(threadgroup const ushort* table, threadgroup const ushort* ring, threadgroup uint4* ring4,
                      device const uint4* words, thread RansLane& d, uint lane) {
  const uint slot = d.x & TM_RANS_PROB_MASK;
  const uint e = table[slot];
  const uint s = e & 15u;
  const uint f = simd_shuffle(d.freq, ushort(s));
  d.x = f * (d.x >> TM_RANS_PROB_BITS) + (e >> 4);
  const bool need = d.x < TM_RANS_STATE_LOW;
  const uint vote = uint(static_cast<simd_vote::vote_t>(simd_ballot(need)));
  if (need) {
    const uint rank = popcount(vote & ((1u << lane) - 1u));
    d.x = (d.x << TM_RANS_WORD_BITS) | uint(ring[(d.ptr + rank) & (kRansRingWords - 1u)]);
  }
  d.ptr += popcount(vote);
  if (d.staged - d.ptr <= kRansRefillWords) {  // uniform: ptr and staged are the simdgroup's
    simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:rans_ring_free]
    rans_refill(words, ring4, d, lane);
    // The new words are read 7 or more steps later (the ring still held more than 224), so this
    // barrier orders what lockstep execution already does; the harness cannot show its loss.
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  return s;
}

// One code as fp32 with the group's constants folded as in dequant_word_bits (quant_gemm_msl.h):
// FP4 sign and magnitude bits into an fp16 pattern (value * 2^-14, s = scale * 2^14); INT4
// (q - z) * s; affine q * s + b rounded once. Bitwise the reference dequantization.
template <uint FMT>
inline float rans_weight(uint q, float s, float zb) {
  if (FMT == TM_FORMAT_FP4) return float(as_type<half>(ushort(((q & 7u) << 9) | ((q & 8u) << 12)))) * s;
  if (FMT == TM_FORMAT_AFFINE) return fma(float(q), s, zb);
  return (float(q) - zb) * s;
}

// Activations: each piece of kRansPiece K rows (8 steps) of the rows in use is staged as fp32 into
// threadgroup memory, lane l loading the 8 values at 8 l with one 16-byte load (fp32: two), and read
// back at 32 j + lane (one bank per lane). A row starts 16-byte aligned: K is a multiple of 32.
constant constexpr uint kRansPiece = 8u * TM_RANS_LANES;

inline void rans_stage8(device const half* p, threadgroup float* d) {
  const uint4 u = *(device const uint4*)p;
  const half2 h0 = as_type<half2>(u.x), h1 = as_type<half2>(u.y), h2 = as_type<half2>(u.z), h3 = as_type<half2>(u.w);
  *(threadgroup float4*)d = float4(float(h0.x), float(h0.y), float(h1.x), float(h1.y));
  *(threadgroup float4*)(d + 4) = float4(float(h2.x), float(h2.y), float(h3.x), float(h3.y));
}
inline void rans_stage8(device const float* p, threadgroup float* d) {
  *(threadgroup float4*)d = *(device const float4*)p;
  *(threadgroup float4*)(d + 4) = *(device const float4*)(p + 4);
}
#if __METAL_VERSION__ >= 310
inline void rans_stage8(device const bfloat* p, threadgroup float* d) {
  const uint4 u = *(device const uint4*)p;  // bfloat = the high half of an fp32
  *(threadgroup float4*)d = float4(as_type<float>(u.x << 16), as_type<float>(u.x & 0xFFFF0000u),
                                   as_type<float>(u.y << 16), as_type<float>(u.y & 0xFFFF0000u));
  *(threadgroup float4*)(d + 4) = float4(as_type<float>(u.z << 16), as_type<float>(u.z & 0xFFFF0000u),
                                         as_type<float>(u.w << 16), as_type<float>(u.w & 0xFFFF0000u));
}
#endif

// Group constants: lane l holds those of group g0 + l (one load per lane per 32 groups); a step
// takes its group's from that lane by a shuffle.
template <uint FMT, typename T>
inline void rans_load_groups(device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets,
                             constant RansParams& p, uint g0, uint n, uint lane, thread float& s, thread float& zb) {
  const uint g = g0 + lane;
  s = 0.0f;
  zb = 0.0f;
  if (g < p.n_groups) {
    s = float(scales[g * p.N + n]);
    if (FMT == TM_FORMAT_FP4) s *= kFp4BitsScale;
    else zb = group_value(zeros_or_offsets[g * p.N + n]);
  }
}

template <uint FMT, typename T, uint ROWS>
inline void rans_gemv_impl(device const T* A, device const uint4* words, device const uint* word_offsets,
                           device const uint* states, device const ushort* freqs, device const T* scales,
                           device const group_aux_t<FMT, T>* zeros_or_offsets, device const T* bias, device T* C,
                           constant RansParams& p, threadgroup ushort* table, threadgroup uint4* ring4,
                           threadgroup float* a_stage, uint3 tgid, uint lane) {
  const uint tile = tgid.x;
  const uint M = p.M, K = p.K, N = p.N;
  const uint n0 = tile * p.channels_per_tile;
  const uint channels = min(p.channels_per_tile, N - n0);
  const uint steps_per_group = p.group_size / TM_RANS_LANES;
  threadgroup const ushort* ring = (threadgroup const ushort*)ring4;
  RansLane d = rans_begin(words, word_offsets, states, freqs, p, table, ring4, tile, lane);
  for (uint c = 0; c < channels; ++c) {
    const uint n = n0 + c;
    float acc[ROWS];
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m) acc[m] = 0.0f;
    float s_lane = 0.0f, zb_lane = 0.0f, s = 0.0f, zb = 0.0f;
    uint g = 0u, group_left = 0u, piece_left = 0u, at = 0u;
    for (uint k0 = 0; k0 < K; k0 += TM_RANS_LANES) {
      if (piece_left == 0u) {  // uniform: stage A[0:M, k0 : k0 + kRansPiece)
        simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:rans_a_free]
        const uint k = k0 + lane * 8u;
        if (k < K) {
          for (uint m = 0; m < ROWS; ++m) {
            if (ROWS == 1u || m < M) rans_stage8(A + m * K + k, a_stage + m * kRansPiece + lane * 8u);
          }
        }
        // The staged values are read after this step's collectives (shuffle, ballot), which lockstep
        // execution orders anyway; the harness cannot show this barrier's loss.
        simdgroup_barrier(mem_flags::mem_threadgroup);
        piece_left = kRansPiece / TM_RANS_LANES;
        at = lane;
      }
      if (group_left == 0u) {  // uniform
        if ((g & 31u) == 0u) rans_load_groups<FMT, T>(scales, zeros_or_offsets, p, g, n, lane, s_lane, zb_lane);
        s = simd_shuffle(s_lane, ushort(g & 31u));
        zb = simd_shuffle(zb_lane, ushort(g & 31u));
        ++g;
        group_left = steps_per_group;
      }
      const float w = rans_weight<FMT>(rans_step(table, ring, ring4, words, d, lane), s, zb);
      TM_UNROLL
      for (uint m = 0; m < ROWS; ++m) {
        if (ROWS == 1u || m < M) acc[m] = fma(a_stage[m * kRansPiece + at], w, acc[m]);
      }
      at += TM_RANS_LANES;
      --piece_left;
      --group_left;
    }
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m) {
      if (ROWS > 1u && m >= M) continue;  // a guard, not an exit: the loop stays fully unrolled
      const float v = simd_sum(acc[m]);
      if (lane == m) C[m * N + n] = T(p.has_bias != 0u ? v + float(bias[n]) : v);
    }
  }
}

template <uint FMT, typename T, uint ROWS, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void rans_gemv(device const T* A [[buffer(0)]], device const uint4* words [[buffer(1)]],
                          device const uint* word_offsets [[buffer(2)]], device const uint* states [[buffer(3)]],
                          device const ushort* freqs [[buffer(4)]], device const T* scales [[buffer(5)]],
                          device const AuxT* zeros_or_offsets [[buffer(6)]], device const T* bias [[buffer(7)]],
                          device T* C [[buffer(8)]], constant RansParams& p [[buffer(9)]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint lid [[thread_index_in_threadgroup]],
                          uint sgid [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(ushort, table, [TM_RANS_PROB_SCALE]);     // 8 KiB
  TM_THREADGROUP_ARRAY(RansChunk, ring4, [kRansRingWords / 8u]);      // 1 KiB
  TM_THREADGROUP_ARRAY(float, a_stage, [ROWS * kRansPiece]);     // 1 KiB per row: 16 KiB at 16 rows
  rans_gemv_impl<FMT, T, ROWS>(A, words, word_offsets, states, freqs, scales, zeros_or_offsets, bias, C, p, table,
                               ring4, a_stage, tgid, lane);
}

// B_packed[K/8, N] from the stream: the 8 lanes of a packed word gather their nibbles with three
// xor shuffles, and lane 8 i (i = 0..3) stores word 4 j + i of the channel (Word: uint).
template <typename Word>
[[kernel]] void rans_decode_packed(device const uint4* words [[buffer(0)]],
                                   device const uint* word_offsets [[buffer(1)]],
                                   device const uint* states [[buffer(2)]], device const ushort* freqs [[buffer(3)]],
                                   device Word* B_packed [[buffer(4)]], constant RansParams& p [[buffer(5)]],
                                   uint3 tgid [[threadgroup_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]],
                                   uint sgid [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(ushort, table, [TM_RANS_PROB_SCALE]);
  TM_THREADGROUP_ARRAY(RansChunk, ring4, [kRansRingWords / 8u]);
  const uint tile = tgid.x;
  const uint N = p.N;
  const uint n0 = tile * p.channels_per_tile;
  const uint channels = min(p.channels_per_tile, N - n0);
  threadgroup const ushort* ring = (threadgroup const ushort*)ring4;
  RansLane d = rans_begin(words, word_offsets, states, freqs, p, table, ring4, tile, lane);
  for (uint c = 0; c < channels; ++c) {
    device Word* out = B_packed + (lane / 8u) * N + n0 + c;  // word 4 j + lane / 8 of the channel
    for (uint j = 0; j < p.steps_per_channel; ++j, out += 4u * N) {
      uint v = rans_step(table, ring, ring4, words, d, lane) << (4u * (lane & 7u));
      v |= simd_shuffle_xor(v, ushort(1));
      v |= simd_shuffle_xor(v, ushort(2));
      v |= simd_shuffle_xor(v, ushort(4));
      if ((lane & 7u) == 0u) *out = v;
    }
  }
}

// Host names: rans_gemv_m<ROWS>_<fmt>_<dtype>.
#define TM_INSTANTIATE_RANS_GEMV(stem, fn, ROWS, tname, T)          \
  TM_INSTANTIATE(stem "_fp4_" #tname, fn<TM_FORMAT_FP4, T, ROWS>) \
  TM_INSTANTIATE(stem "_u4_" #tname, fn<TM_FORMAT_U4, T, ROWS>)   \
  TM_INSTANTIATE(stem "_affine_" #tname, fn<TM_FORMAT_AFFINE, T, ROWS>)
#define TM_INSTANTIATE_RANS_GEMV_DTYPE(tname, T)                   \
  TM_INSTANTIATE_RANS_GEMV("rans_gemv_m1", rans_gemv, 1, tname, T)   \
  TM_INSTANTIATE_RANS_GEMV("rans_gemv_m2", rans_gemv, 2, tname, T)   \
  TM_INSTANTIATE_RANS_GEMV("rans_gemv_m4", rans_gemv, 4, tname, T)   \
  TM_INSTANTIATE_RANS_GEMV("rans_gemv_m8", rans_gemv, 8, tname, T)   \
  TM_INSTANTIATE_RANS_GEMV("rans_gemv_m16", rans_gemv, 16, tname, T)

TM_INSTANTIATE_RANS_GEMV_DTYPE(half, half)
TM_INSTANTIATE_RANS_GEMV_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_RANS_GEMV_DTYPE(bfloat, bfloat)
#endif
TM_INSTANTIATE("rans_decode_packed", rans_decode_packed<uint>)
