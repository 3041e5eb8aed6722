// Decode family of the FP4 / INT4 / affine INT4 GEMM (M <= 16): marlin_gemv_m<R>_<fmt>_<dtype> (R = 1, 2, 4, 8,
// 16 rows, N % 4 == 0) and marlin_gemv_unaligned_<fmt>_<dtype> (16 rows, any N).
//
// Bandwidth layout. B_packed is [K/8, N], so the 4 packed words of columns c..c+3 for 8 K rows
// are 16 adjacent bytes: a lane owns 4 columns and reads one uint4 per 8 K rows, the 32 lanes of a
// simdgroup one 512-byte row of B (128 columns). Each weight is read once and used for all R rows
// (R x 4 fp32 accumulators per lane, a constant count so they stay in registers).
// The 4 simdgroups of a threadgroup take contiguous shares of the threadgroup's K slice (whole
// groups when a group fits in a share). A simdgroup walks its share in pieces: it stages the
// piece's activations A[0:M, piece] into its own threadgroup area (vector loads, converted to
// fp32 once), then reads them back as broadcasts for every column. Group scales (and zero points or
// offsets) sit on the outer loop: one half4 (uchar4, half4) load per group and lane, nothing divides in
// the loop.
// The simdgroups meet at the end in threadgroup memory, summed in a fixed order.
// Grid (n_tiles, k_parallel): with k_parallel > 1 each slice writes fp32 partials to the
// workspace and marlin_reduce_partials (metal/reduce.metal) sums them.
#include "torch_marlin/quant_gemm_msl.h"

using namespace metal;
using namespace torch_marlin;

constant constexpr uint kGemvLaneCols = TM_METAL_DECODE_LANE_COLS;
constant constexpr uint kGemvTileN = TM_METAL_DECODE_TILE_N;
constant constexpr uint kGemvSimdgroups = TM_METAL_DECODE_SIMDGROUPS;
// Packed-word rows (16-byte loads) in flight per lane: 4, or 2 for 8 and 16 rows, where the
// ROWS x 4 fp32 accumulators already hold 32 to 64 registers.
template <uint ROWS>
constexpr uint gemv_unroll() {
  return ROWS >= 8u ? 2u : 4u;
}

// K rows one simdgroup stages per piece: at least 8 words per lane between two stagings, at most
// 256 staged fp32 values per row count below 8 (1 KiB per simdgroup).
template <uint ROWS>
constexpr uint gemv_piece_rows() {
  return ROWS <= 4u ? 256u / ROWS : 64u;
}
// Threadgroup floats: the 4 staging areas, reused by the final meeting (2 x ROWS x 128 partials).
template <uint ROWS>
constexpr uint gemv_tg_floats() {
  return kGemvSimdgroups * ROWS * gemv_piece_rows<ROWS>() > 2u * ROWS * kGemvTileN
             ? kGemvSimdgroups * ROWS * gemv_piece_rows<ROWS>()
             : 2u * ROWS * kGemvTileN;
}

// 4 consecutive activations / scales as fp32: one vector load.
inline float4 gemv_load4(device const half* p) {
  const half4 v = *(device const half4*)p;
  return float4(float(v.x), float(v.y), float(v.z), float(v.w));
}
inline float4 gemv_load4(device const float* p) { return *(device const float4*)p; }
#if __METAL_VERSION__ >= 310
inline float4 gemv_load4(device const bfloat* p) {
  const ushort4 u = *(device const ushort4*)p;  // bfloat = the high half of an fp32
  return float4(as_type<float>(uint(u.x) << 16), as_type<float>(uint(u.y) << 16), as_type<float>(uint(u.z) << 16),
                as_type<float>(uint(u.w) << 16));
}
#endif

// The packed words of the lane's columns for 8 K rows. VEC: one 16-byte load (N % 4 == 0 keeps it
// aligned). Otherwise one load per column, columns past N read as code 0 and never stored.
template <bool VEC>
inline uint4 gemv_load_words(device const uint* b, uint cols_left) {
  if (VEC) return *(device const uint4*)b;
  return uint4(b[0], cols_left > 1u ? b[1] : 0u, cols_left > 2u ? b[2] : 0u, cols_left > 3u ? b[3] : 0u);
}

// The group terms of the lane's 4 columns (dequant_word_bits' group_term). INT4: one uchar4 of
// zero points (the low 4 bits: zero points are 0..15, docs/formats.md) -> 1024 + z.
template <bool VEC>
inline float4 gemv_group_terms(device const uchar* zeros, uint at, uint cols_left) {
  uchar4 z;
  if (VEC) {
    z = *(device const uchar4*)(zeros + at);
  } else {
    z = uchar4(zeros[at], cols_left > 1u ? zeros[at + 1u] : uchar(0), cols_left > 2u ? zeros[at + 2u] : uchar(0),
               cols_left > 3u ? zeros[at + 3u] : uchar(0));
  }
  return float4(kU4BitsBias + float(z.x & 15u), kU4BitsBias + float(z.y & 15u), kU4BitsBias + float(z.z & 15u),
                kU4BitsBias + float(z.w & 15u));
}
// Affine: the 4 offsets, one vector load of the scales' dtype as for the scales.
template <bool VEC, typename T>
inline float4 gemv_group_terms(device const T* offsets, uint at, uint cols_left) {
  if (VEC) return gemv_load4(offsets + at);
  return float4(float(offsets[at]), cols_left > 1u ? float(offsets[at + 1u]) : 0.0f,
                cols_left > 2u ? float(offsets[at + 2u]) : 0.0f, cols_left > 3u ? float(offsets[at + 3u]) : 0.0f);
}

// One group's scales of the lane's columns, with the dequantization constants folded in
// (dequant_word_bits): FP4 scale * 2^14; INT4 the zero bias 1024 + z; affine the offset.
template <uint FMT, typename T, bool VEC>
inline void gemv_load_group(device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets, uint at,
                            uint cols_left, thread float4& s, thread float4& zb) {
  if (VEC) {
    s = gemv_load4(scales + at);
  } else {
    s = float4(float(scales[at]), cols_left > 1u ? float(scales[at + 1u]) : 0.0f,
               cols_left > 2u ? float(scales[at + 2u]) : 0.0f, cols_left > 3u ? float(scales[at + 3u]) : 0.0f);
  }
  if (FMT == TM_FORMAT_FP4) {
    s = float4(s.x * kFp4BitsScale, s.y * kFp4BitsScale, s.z * kFp4BitsScale, s.w * kFp4BitsScale);
    zb = float4(0.0f, 0.0f, 0.0f, 0.0f);
  } else {
    zb = gemv_group_terms<VEC>(zeros_or_offsets, at, cols_left);
  }
}

// The 8-term dot product of two float4 pairs with 8 weights, as explicit fused multiply-adds (the
// same rounding whatever the compiler's contraction setting).
inline float gemv_dot8(float4 a0, float4 a1, thread const float* w) {
  float d = a0.x * w[0];
  d = fma(a0.y, w[1], d);
  d = fma(a0.z, w[2], d);
  d = fma(a0.w, w[3], d);
  d = fma(a1.x, w[4], d);
  d = fma(a1.y, w[5], d);
  d = fma(a1.z, w[6], d);
  return fma(a1.w, w[7], d);
}

inline uint gemv_word(uint4 q, uint c) { return c == 0u ? q.x : c == 1u ? q.y : c == 2u ? q.z : q.w; }
inline float gemv_col(float4 v, uint c) { return c == 0u ? v.x : c == 1u ? v.y : c == 2u ? v.z : v.w; }

// 8 K rows x 4 columns into the ROWS x 4 accumulators. Up to 4 rows: the word's 32 weights are
// dequantized once, then every row's 8 staged activations (two float4 broadcasts) meet all 4
// columns. 8 and 16 rows: one column's 8 weights at a time (8 live weights instead of 32 beside
// the 32 to 64 accumulators), the staged activations read once per column (threadgroup broadcasts).
template <uint FMT, uint ROWS>
inline void gemv_word_row(uint4 q, float4 s, float4 zb, threadgroup const float* a, uint a_stride, uint M,
                          thread float* acc) {
  if (ROWS <= 4u) {
    float w[4][8];
    dequant_word_bits<FMT>(q.x, s.x, zb.x, w[0]);
    dequant_word_bits<FMT>(q.y, s.y, zb.y, w[1]);
    dequant_word_bits<FMT>(q.z, s.z, zb.z, w[2]);
    dequant_word_bits<FMT>(q.w, s.w, zb.w, w[3]);
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m) {
      if (ROWS == 1u || m < M) {
        const float4 a0 = *(threadgroup const float4*)(a + m * a_stride);
        const float4 a1 = *(threadgroup const float4*)(a + m * a_stride + 4u);
        TM_UNROLL
        for (uint c = 0; c < 4u; ++c) acc[m * 4u + c] += gemv_dot8(a0, a1, w[c]);
      }
    }
    return;
  }
  TM_UNROLL
  for (uint c = 0; c < 4u; ++c) {
    float w[8];
    dequant_word_bits<FMT>(gemv_word(q, c), gemv_col(s, c), gemv_col(zb, c), w);
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m) {
      if (m < M) {  // uniform across the simdgroup
        const float4 a0 = *(threadgroup const float4*)(a + m * a_stride);
        const float4 a1 = *(threadgroup const float4*)(a + m * a_stride + 4u);
        acc[m * 4u + c] += gemv_dot8(a0, a1, w);
      }
    }
  }
}

// A[0:M, k0:k1) into stage[m][0:k1-k0] as fp32 (k1 - k0 <= the piece, a multiple of 8): the 32
// lanes read 4 consecutive activations each.
template <typename T, uint ROWS>
inline void gemv_stage_a(device const T* A, uint M, uint K, threadgroup float* stage, uint k0, uint k1, uint lane) {
  constexpr uint kPiece = gemv_piece_rows<ROWS>();
  const uint len = k1 - k0;
  for (uint e = lane * 4u; e < ROWS * kPiece; e += 32u * 4u) {
    const uint m = e / kPiece;  // constant divisor: a shift
    const uint j = e % kPiece;
    if (m < M && j < len) *(threadgroup float4*)(stage + e) = gemv_load4(A + m * K + k0 + j);
  }
}

template <uint FMT, typename T, uint ROWS, bool VEC>
inline void gemv_impl(device const T* A, device const uint* B, device const T* scales, device const group_aux_t<FMT, T>* zeros_or_offsets,
                      device const T* bias, device T* C, device float* workspace, constant QuantGemmParams& p,
                      threadgroup float* tg, uint3 tgid, uint lid, uint sgid, uint lane) {
  constexpr uint kPiece = gemv_piece_rows<ROWS>();
  const uint M = p.M, N = p.N, K = p.K, gs = p.group_size;
  const uint col = tgid.x * kGemvTileN + lane * kGemvLaneCols;  // the first of this lane's 4 columns
  const uint cols_left = col < N ? N - col : 0u;
  const uint k_slice = tgid.y;
  const uint k_begin = k_slice * p.k_slice_len;
  const uint k_end = min(K, k_begin + p.k_slice_len);

  // This simdgroup's share of the slice: a quarter (in 8-row words), rounded up to whole groups
  // when a group fits in it, so that each group's scales are read by one simdgroup only.
  const uint quarter = (k_end - k_begin + 8u * kGemvSimdgroups - 1u) / (8u * kGemvSimdgroups) * 8u;
  const uint share = quarter >= gs ? (quarter + gs - 1u) / gs * gs : quarter;
  const uint s_begin = min(k_end, k_begin + sgid * share);
  const uint s_end = min(k_end, s_begin + share);
  uint g = s_begin / gs;                  // scale row of the next segment
  uint g_left = (g + 1u) * gs - s_begin;  // its rows from there on
  // The scales in registers belong to group g_loaded: a group longer than a piece keeps them.
  uint g_loaded = ~0u;
  float4 s = float4(0.0f, 0.0f, 0.0f, 0.0f), zb = float4(0.0f, 0.0f, 0.0f, 0.0f);

  constexpr uint kUnroll = gemv_unroll<ROWS>();
  float acc[ROWS * 4];
  TM_UNROLL
  for (uint i = 0; i < ROWS * 4u; ++i) acc[i] = 0.0f;
  threadgroup float* stage = tg + sgid * ROWS * kPiece;
  for (uint k0 = s_begin; k0 < s_end; k0 += kPiece) {
    const uint k1 = min(s_end, k0 + kPiece);
    simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_stage_free]
    gemv_stage_a<T, ROWS>(A, M, K, stage, k0, k1, lane);
    simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_stage_ready]
    if (cols_left != 0u) {
      // Segments of one group each: scales on the outer loop, 4 word rows in flight inside.
      for (uint k = k0; k < k1;) {
        const uint seg_end = min(k1, k + g_left);
        if (g != g_loaded) {
          gemv_load_group<FMT, T, VEC>(scales, zeros_or_offsets, g * N + col, cols_left, s, zb);
          g_loaded = g;
        }
        device const uint* b = B + (k / 8u) * N + col;
        threadgroup const float* a = stage + (k - k0);
        uint words = (seg_end - k) / 8u;
        for (; words >= kUnroll; words -= kUnroll) {
          uint4 q[kUnroll];  // all loads issued before the first use
          TM_UNROLL
          for (uint u = 0; u < kUnroll; ++u) q[u] = gemv_load_words<VEC>(b + u * N, cols_left);
          TM_UNROLL
          for (uint u = 0; u < kUnroll; ++u) gemv_word_row<FMT, ROWS>(q[u], s, zb, a + 8u * u, kPiece, M, acc);
          b += kUnroll * N;
          a += 8u * kUnroll;
        }
        for (; words > 0u; --words) {
          gemv_word_row<FMT, ROWS>(gemv_load_words<VEC>(b, cols_left), s, zb, a, kPiece, M, acc);
          b += N;
          a += 8u;
        }
        g_left -= seg_end - k;
        k = seg_end;
        if (g_left == 0u) {
          ++g;
          g_left = gs;
        }
      }
    }
  }

  // Meeting: simdgroups 2 and 3 hand their sums to 0 and 1, then 1 to 0, so every column is
  // (s0 + s2) + (s1 + s3), whatever the schedule.
  threadgroup float* part = tg;  // [2][ROWS][kGemvTileN], over the staging areas
  const uint at = lane * kGemvLaneCols;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_stages_done]
  if (sgid >= 2u) {
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m)
      *(threadgroup float4*)(part + ((sgid - 2u) * ROWS + m) * kGemvTileN + at) =
          float4(acc[m * 4u], acc[m * 4u + 1u], acc[m * 4u + 2u], acc[m * 4u + 3u]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_meet]
  if (sgid < 2u) {
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m) {
      const float4 o = *(threadgroup const float4*)(part + (sgid * ROWS + m) * kGemvTileN + at);
      acc[m * 4u] += o.x;
      acc[m * 4u + 1u] += o.y;
      acc[m * 4u + 2u] += o.z;
      acc[m * 4u + 3u] += o.w;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_meet_read]
  if (sgid == 1u) {
    TM_UNROLL
    for (uint m = 0; m < ROWS; ++m)
      *(threadgroup float4*)(part + m * kGemvTileN + at) =
          float4(acc[m * 4u], acc[m * 4u + 1u], acc[m * 4u + 2u], acc[m * 4u + 3u]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:gemv_meet_last]
  if (sgid != 0u) return;
  TM_UNROLL
  for (uint m = 0; m < ROWS; ++m) {
    if (m >= M) continue;  // a guard, not an exit: the loop stays fully unrolled
    const float4 o = *(threadgroup const float4*)(part + m * kGemvTileN + at);
    const float v[4] = {acc[m * 4u] + o.x, acc[m * 4u + 1u] + o.y, acc[m * 4u + 2u] + o.z, acc[m * 4u + 3u] + o.w};
    for (uint c = 0; c < 4u; ++c) {
      if (c >= cols_left) break;
      const uint n = col + c;
      if (p.k_parallel > 1u) {
        workspace[(k_slice * M + m) * N + n] = v[c];
      } else {
        C[m * N + n] = T(p.has_bias != 0u ? v[c] + float(bias[n]) : v[c]);
      }
    }
  }
}

template <uint FMT, typename T, uint ROWS, bool VEC, typename AuxT = group_aux_t<FMT, T>>
[[kernel]] void marlin_gemv(device const T* A [[buffer(0)]], device const uint* B [[buffer(1)]],
                            device const T* scales [[buffer(2)]], device const AuxT* zeros_or_offsets [[buffer(3)]],
                            device const T* bias [[buffer(4)]], device T* C [[buffer(5)]],
                            device float* workspace [[buffer(6)]], constant QuantGemmParams& p [[buffer(7)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint lid [[thread_index_in_threadgroup]],
                            uint sgid [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  TM_THREADGROUP_ARRAY(float, tg, [gemv_tg_floats<ROWS>()]);  // 4 KiB (1-4 rows) to 16 KiB (16 rows)
  gemv_impl<FMT, T, ROWS, VEC>(A, B, scales, zeros_or_offsets, bias, C, workspace, p, tg, tgid, lid, sgid, lane);
}

// Host names: marlin_gemv_m<ROWS>_<fmt>_<dtype>, marlin_gemv_unaligned_<fmt>_<dtype>.
#define TM_INSTANTIATE_GEMV(stem, fn, ROWS, VEC, tname, T)              \
  TM_INSTANTIATE(stem "_fp4_" #tname, fn<TM_FORMAT_FP4, T, ROWS, VEC>) \
  TM_INSTANTIATE(stem "_u4_" #tname, fn<TM_FORMAT_U4, T, ROWS, VEC>)     \
  TM_INSTANTIATE(stem "_affine_" #tname, fn<TM_FORMAT_AFFINE, T, ROWS, VEC>)
#define TM_INSTANTIATE_GEMV_DTYPE(tname, T)                                   \
  TM_INSTANTIATE_GEMV("marlin_gemv_m1", marlin_gemv, 1, true, tname, T)       \
  TM_INSTANTIATE_GEMV("marlin_gemv_m2", marlin_gemv, 2, true, tname, T)       \
  TM_INSTANTIATE_GEMV("marlin_gemv_m4", marlin_gemv, 4, true, tname, T)       \
  TM_INSTANTIATE_GEMV("marlin_gemv_m8", marlin_gemv, 8, true, tname, T)       \
  TM_INSTANTIATE_GEMV("marlin_gemv_m16", marlin_gemv, 16, true, tname, T)     \
  TM_INSTANTIATE_GEMV("marlin_gemv_unaligned", marlin_gemv, 16, false, tname, T)

TM_INSTANTIATE_GEMV_DTYPE(half, half)
TM_INSTANTIATE_GEMV_DTYPE(float, float)
#if __METAL_VERSION__ >= 310
TM_INSTANTIATE_GEMV_DTYPE(bfloat, bfloat)
#endif
