// MSL-only helpers shared by metal/trellis_gemm.metal and metal/trellis_moe.metal: tuning
// constants, the geometry of one trellis matrix, the decode (GEMV) core and the tiled
// (simdgroup-matrix) core. Not for host C++. Names carry a tr_ / kTr prefix: every .metal file
// must also compile as part of one concatenated library (csrc/include/torch_marlin/msl_kernel.h).
#pragma once

#include "torch_marlin/msl_kernel.h"
#include "torch_marlin/trellis_params.h"

using namespace metal;  // MSL-only header: min/max and the address-space types

namespace torch_marlin {

// Geometry shared with the planner (trellis_params.h).
constant constexpr uint kTrThreads = TM_TRELLIS_THREADS;
constant constexpr uint kTrSimdgroups = TM_TRELLIS_THREADS / 32u;
constant constexpr uint kTrDecodeRows = 16;  // kDecodeMaxM: rows per decode pass
constant constexpr uint kTrDecodeCols = TM_TRELLIS_DECODE_COLS;
constant constexpr uint kTrDecodeKTiles = TM_TRELLIS_DECODE_K_TILES;
constant constexpr uint kTrDecodeK = TM_TRELLIS_DECODE_K_TILES * TM_TRELLIS_TILE;
constant constexpr uint kTrDecodeTilesPerSg = TM_TRELLIS_DECODE_K_TILES / (TM_TRELLIS_THREADS / 32u);
// Staged index bytes of one decode block: per tile row of K, the run of the threadgroup's two
// tiles (at most 2 x 128 bytes), plus one spare uint4 so the two-word window of the last index
// never leaves the array.
constant constexpr uint kTrRawRowWords = 2u * 32u * TM_TRELLIS_MAX_BITS / 4u;
constant constexpr uint kTrRawWords = TM_TRELLIS_DECODE_K_TILES * kTrRawRowWords + 4u;
constant constexpr uint kTrTileM = TM_TRELLIS_PREFILL_TILE;
constant constexpr uint kTrTileN = TM_TRELLIS_PREFILL_TILE;
constant constexpr uint kTrTileK = TM_TRELLIS_PREFILL_TILE_K;
// Row strides of the tiled kernels' threadgroup tiles, padded by 8 elements so the 8x8 fragment
// loads of consecutive rows start in different banks.
constant constexpr uint kTrAStride = TM_TRELLIS_PREFILL_TILE_K + 8u;
constant constexpr uint kTrBStride = TM_TRELLIS_PREFILL_TILE + 8u;
constant constexpr uint kTrStageElems = TM_TRELLIS_PREFILL_TILE * kTrAStride + TM_TRELLIS_PREFILL_TILE_K * kTrBStride;
constant constexpr uint kTrCombineThreads = TM_TRELLIS_COMBINE_THREADS;

// Geometry of one trellis matrix W[K, N]. The MoE's down projection has K and N swapped
// relative to the params (it maps intermediate -> hidden). vec4: rows of the activations (stride
// K) and su may be read 4 elements at a time (K % 4 == 0, decided by the planner).
struct TrMat {
  uint K, N, tiles_k, tiles_n, packed_bytes, bits, group_size, n_groups, vec4;
};

inline TrMat tr_mat(constant TrellisParams& p) {
  TrMat m = {p.K, p.N, p.tiles_k, p.tiles_n, p.packed_bytes, p.bits, p.group_size, p.n_groups, p.k_vec4};
  return m;
}

inline TrMat tr_down_mat(constant TrellisParams& p) {
  TrMat m = {p.N,           p.K,  p.down_tiles_k, p.down_tiles_n, p.packed_bytes, p.bits, p.group_size,
             p.down_n_groups, p.down_k_vec4};
  return m;
}

// Four activations in one load.
template <typename T>
struct TrVec4 {};
template <>
struct TrVec4<float> {
  typedef float4 type;
};
template <>
struct TrVec4<half> {
  typedef half4 type;
};
#if __METAL_VERSION__ >= 310
template <>
struct TrVec4<bfloat> {
  typedef bfloat4 type;
};
#endif

// dst[0..3] = src[0..3] (element k of the row is src[0]); elements at or past K are 0. One vector
// load when all four are inside and the row is 16-byte aligned (vec).
template <typename TS, typename TD>
inline void tr_copy4(device const TS* src, bool vec, uint k, uint K, threadgroup TD* dst) {
  if (vec && k + 3u < K) {
    const typename TrVec4<TS>::type v = *(device const typename TrVec4<TS>::type*)src;
    dst[0] = TD(float(v.x));
    dst[1] = TD(float(v.y));
    dst[2] = TD(float(v.z));
    dst[3] = TD(float(v.w));
  } else {
    for (uint i = 0; i < 4u; ++i) dst[i] = TD(k + i < K ? float(src[i]) : 0.0f);
  }
}

// Index at bit `bit` of a staged bit stream (little-endian words): a two-word window, so 3-bit
// indices that cross a word boundary need no second pass.
inline uint tr_index(threadgroup const uint* words, uint bit, uint mask) {
  const uint i = bit >> 5u;
  const uint sh = bit & 31u;
  return ((words[i] >> sh) | ((words[i + 1u] << 1u) << (31u - sh))) & mask;
}

// The BITS-bit index at bit `bit` (a multiple of BITS from a word-aligned stream start): 2- and
// 4-bit indices never cross a word, so one word and one shift; 3-bit ones take the two-word window.
template <uint BITS>
inline uint tr_index_bits(threadgroup const uint* words, uint bit) {
  constexpr uint kMask = (1u << BITS) - 1u;
  if (32u % BITS == 0u) return (words[bit >> 5u] >> (bit & 31u)) & kMask;
  return tr_index(words, bit, kMask);
}


// ---- decode core (M <= 16 rows, one column per lane) ----------------------------------------------
// One matrix of the decode core (an expert's slice for the MoE).
struct TrDecodeMat {
  device const uchar* packed;
  device const float* scales;
  device const float* grid;
  device const float* su;
};

// acc[j * 16 + m] += sum_k X[row(m), k] * w_j[k, col0 + lane] (without sv) for m < rows <= 16
// and the NMAT matrices w_j (gate and up share the activations). row(m) is row_base + m, or
// gather[row_base + m] when GATHER (the MoE's expert-sorted token list); X rows have stride w.K.
//
// K goes in blocks of 8 tile rows (128 rows), double-buffered in threadgroup memory, one barrier
// per block. Per block and matrix, the threadgroup's index bytes (the contiguous run of its two
// 16x16 tiles per tile row) arrive with one 16-byte load per thread, adjacent threads reading
// adjacent bytes, each byte once; the activation rows (as fp32) and su come with 4-wide loads,
// once per threadgroup. Simdgroup s then takes tile rows 2s and 2s+1 of the block: lane l decodes
// the index of column col0 + l in each of the 16 rows from the staged bits, looks it up in the
// codebook held one level per lane (simd_shuffle: the codebook never leaves registers), scales it
// (group scale in a register, reloaded only when the group changes) and applies it to all rows.
// Partials stay per simdgroup; the kernel meets them in a fixed order.
//
// Threadgroup memory: a_s [2][16][128] floats, raw_s [2][NMAT][kTrRawWords], su_s [2][NMAT][128].
template <typename TX, bool GATHER, uint NMAT, uint BITS>
inline void tr_decode_core_bits(device const TX* X, device const int* gather, uint row_base, uint rows,
                           thread const TrDecodeMat* mats, thread const TrMat& w, uint col0, threadgroup float* a_s,
                           threadgroup uint* raw_s, threadgroup float* su_s, uint lid, uint sgid, uint lane,
                           thread float* acc) {
  constexpr uint mask = (1u << BITS) - 1u;
  constexpr uint kPackedBytes = 32u * BITS;  // one 16x16 tile (= w.packed_bytes)
  float cb[NMAT];
  TM_UNROLL
  for (uint j = 0; j < NMAT; ++j) cb[j] = mats[j].grid[lane & mask];

  // Index staging: thread lid copies 16-byte chunk my_chunk of tile row my_tk of each block.
  const uint tn0 = col0 / TM_TRELLIS_TILE;
  const uint run_chunks = min(2u, w.tiles_n - tn0) * 2u * BITS;  // 16-byte chunks per tile row
  const uint my_tk = lid / run_chunks;
  const uint my_chunk = lid - my_tk * run_chunks;
  const uint block_bytes = kTrDecodeKTiles * w.tiles_n * kPackedBytes;
  uint src_off = (my_tk * w.tiles_n + tn0) * kPackedBytes + my_chunk * 16u;
  const uint dst_word = my_tk * kTrRawRowWords + my_chunk * 4u;

  // Activation staging: thread lid copies columns q4..q4+3 of rows (lid >> 5) + 4j.
  const uint q4 = (lid & 31u) * 4u;
  device const TX* xrow[4];
  TM_UNROLL
  for (uint j = 0; j < 4u; ++j) {
    const uint m = (lid >> 5u) + 4u * j;
    xrow[j] = X;
    if (m < rows) xrow[j] = X + (GATHER ? uint(gather[row_base + m]) : row_base + m) * w.K;
  }

  // Scale group of this simdgroup's tile rows, advanced incrementally (no division in the loop).
  const uint col = col0 + lane;
  const bool col_ok = col < w.N;
  const uint tiles_per_group = w.group_size / TM_TRELLIS_TILE;
  const uint first_group = (sgid * kTrDecodeTilesPerSg) / tiles_per_group;
  uint group_end = (first_group + 1u) * tiles_per_group;  // first tile row of the next group
  uint scale_off = first_group * w.N + col;
  float sc[NMAT];
  TM_UNROLL
  for (uint j = 0; j < NMAT; ++j) sc[j] = col_ok ? mats[j].scales[scale_off] : 0.0f;

  const uint lane_bit = (lane / TM_TRELLIS_TILE) * kPackedBytes * 8u + (lane % TM_TRELLIS_TILE) * BITS;
  constexpr uint row_bits = TM_TRELLIS_TILE * BITS;

  for (uint tk0 = 0, buf = 0; tk0 < w.tiles_k + kTrDecodeKTiles; tk0 += kTrDecodeKTiles, buf ^= 1u) {
    // Stage block tk0 into buf (the first iteration only stages), then compute block tk0 - 8.
    if (tk0 < w.tiles_k) {
      const uint k0 = tk0 * TM_TRELLIS_TILE;
      if (my_tk < kTrDecodeKTiles && tk0 + my_tk < w.tiles_k) {
        TM_UNROLL
        for (uint j = 0; j < NMAT; ++j) {
          const uint4 v = *(device const uint4*)(mats[j].packed + src_off);
          threadgroup uint* d = raw_s + (buf * NMAT + j) * kTrRawWords + dst_word;
          d[0] = v.x;
          d[1] = v.y;
          d[2] = v.z;
          d[3] = v.w;
        }
      }
      src_off += block_bytes;
      threadgroup float* a_dst = a_s + buf * (kTrDecodeRows * kTrDecodeK);
      TM_UNROLL
      for (uint j = 0; j < 4u; ++j) {
        const uint m = (lid >> 5u) + 4u * j;
        if (m < rows) tr_copy4<TX, float>(xrow[j] + k0 + q4, w.vec4 != 0u, k0 + q4, w.K, a_dst + m * kTrDecodeK + q4);
      }
      if (lid < 32u) {
        TM_UNROLL
        for (uint j = 0; j < NMAT; ++j) {
          tr_copy4<float, float>(mats[j].su + k0 + q4, w.vec4 != 0u, k0 + q4, w.K,
                                 su_s + (buf * NMAT + j) * kTrDecodeK + q4);
        }
      }
    }
    if (tk0 > 0u) {
      const uint cbuf = buf ^ 1u;
      threadgroup const float* a = a_s + cbuf * (kTrDecodeRows * kTrDecodeK);
      threadgroup const uint* raw = raw_s + cbuf * NMAT * kTrRawWords;
      threadgroup const float* sus = su_s + cbuf * NMAT * kTrDecodeK;
      for (uint t = 0; t < kTrDecodeTilesPerSg; ++t) {
        const uint tkl = sgid * kTrDecodeTilesPerSg + t;
        const uint tk = tk0 - kTrDecodeKTiles + tkl;
        if (tk >= w.tiles_k) break;  // uniform across the simdgroup
        if (tk >= group_end) {
          while (tk >= group_end) {
            group_end += tiles_per_group;
            scale_off += w.N;
          }
          TM_UNROLL
          for (uint j = 0; j < NMAT; ++j) sc[j] = col_ok ? mats[j].scales[scale_off] : 0.0f;
        }
        // Row r's index of this lane is at bit + r * row_bits: with BITS = 2 or 4 every row's
        // shift within its word is the same, so the unrolled rows differ only in a constant word.
        const uint bit = tkl * kTrRawRowWords * 32u + lane_bit;
        TM_UNROLL
        for (uint r = 0; r < TM_TRELLIS_TILE; ++r) {
          const uint k = tkl * TM_TRELLIS_TILE + r;
          float wv[NMAT];
          TM_UNROLL
          for (uint j = 0; j < NMAT; ++j) {
            const uint idx = tr_index_bits<BITS>(raw + j * kTrRawWords, bit + r * row_bits);
            wv[j] = simd_shuffle(cb[j], ushort(idx)) * sc[j] * sus[j * kTrDecodeK + k];
          }
          // Constant trip count keeps acc[] in registers; rows >= `rows` are skipped uniformly.
          TM_UNROLL
          for (uint m = 0; m < kTrDecodeRows; ++m) {
            if (m < rows) {
              const float av = a[m * kTrDecodeK + k];  // one address for all lanes: a broadcast
              TM_UNROLL
              for (uint j = 0; j < NMAT; ++j) acc[j * kTrDecodeRows + m] = fma(av, wv[j], acc[j * kTrDecodeRows + m]);
            }
          }
        }
      }
    }
    // Block tk0 is staged, and nobody reads the buffer the next iteration stages into.
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_decode_swap]
  }
}

// The decode core with w.bits (2, 3 or 4, what the planner accepts) as a compile-time constant:
// masks, shifts and bit offsets fold, and each kernel keeps one host name for every bit width.
// The branch is uniform across the grid.
template <typename TX, bool GATHER, uint NMAT>
inline void tr_decode_core(device const TX* X, device const int* gather, uint row_base, uint rows,
                           thread const TrDecodeMat* mats, thread const TrMat& w, uint col0, threadgroup float* a_s,
                           threadgroup uint* raw_s, threadgroup float* su_s, uint lid, uint sgid, uint lane,
                           thread float* acc) {
  if (w.bits == 2u) {
    tr_decode_core_bits<TX, GATHER, NMAT, 2u>(X, gather, row_base, rows, mats, w, col0, a_s, raw_s, su_s, lid, sgid,
                                              lane, acc);
  } else if (w.bits == 3u) {
    tr_decode_core_bits<TX, GATHER, NMAT, 3u>(X, gather, row_base, rows, mats, w, col0, a_s, raw_s, su_s, lid, sgid,
                                              lane, acc);
  } else {
    tr_decode_core_bits<TX, GATHER, NMAT, 4u>(X, gather, row_base, rows, mats, w, col0, a_s, raw_s, su_s, lid, sgid,
                                              lane, acc);
  }
}

// The 4 simdgroups' partials partial[s][m][c] summed in a fixed order (deterministic).
inline float tr_meet(threadgroup const float* partial, uint m, uint c) {
  const uint stride = kTrDecodeRows * kTrDecodeCols;
  const uint i = m * kTrDecodeCols + c;
  return ((partial[i] + partial[stride + i]) + partial[2u * stride + i]) + partial[3u * stride + i];
}

// ---- tiled core (64x64 output tile, 4 simdgroups as 2x2 of 32x32) --------------------------------
// acc[mi * 4 + ni] (8x8 fp32 fragments of simdgroup sgid's 32x32 sub-tile) = X[rows row0..+63] @
// W[:, col0..col0+63] without sv, over the rows r_begin + row0 + i (< rows; gathered through
// `gather` when GATHER) of X (stride w.K).
//
// K goes one trellis tile row (16 rows) per block, double-buffered, one barrier per block.
// Simdgroups 0-1 stage A: thread t copies row t of the block (16 elements, 4-wide loads).
// Simdgroups 2-3 decode B: simdgroup 2 + h copies the contiguous index bytes of tile columns 2h,
// 2h+1 of the block with 16-byte loads (each byte once) into its raw words; then thread 64 + u
// decodes tile row u % 16 of tile column u / 16 (16 indices from two 32-bit windows, codebook by
// simd_shuffle, group scales held in 16 registers and reloaded when the group changes, su once
// per row) into the padded B tile, so each weight is decoded once per threadgroup. Tile offsets
// and the group advance incrementally.
// smem: [2][kTrStageElems] of TX; raw_s: [2][kTrRawRowWords + 4] words.
template <typename TX, bool GATHER, uint BITS>
inline void tr_tiled_core_bits(device const TX* X, device const int* gather, uint r_begin, uint rows,
                          device const uchar* packed, device const float* scales, device const float* grid,
                          device const float* su, thread const TrMat& w, uint row0, uint col0, threadgroup TX* smem,
                          threadgroup uint* raw_s, uint lid, uint sgid, uint lane,
                          thread simdgroup_matrix<float, 8, 8>* acc) {
  const uint sg_row = (sgid / 2u) * 32u;
  const uint sg_col = (sgid % 2u) * 32u;
  const uint sg_first_row = row0 + sg_row;
  // 8-row fragments of this simdgroup that hold real rows (uniform across the simdgroup).
  const uint mi_count = sg_first_row >= rows ? 0u : min(4u, (rows - sg_first_row + 7u) / 8u);
  TM_UNROLL
  for (uint i = 0; i < 16u; ++i) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  const bool a_thread = lid < kTrTileM;  // simdgroups 0-1
  // A: row lid of the tile.
  const bool a_row_ok = a_thread && row0 + lid < rows;
  device const TX* xrow = X;
  if (a_row_ok) xrow = X + (GATHER ? uint(gather[r_begin + row0 + lid]) : r_begin + row0 + lid) * w.K;
  // B: tile row br of tile column bt.
  const uint u = lid - kTrTileM;
  const uint br = u % TM_TRELLIS_TILE;
  const uint bt = u / TM_TRELLIS_TILE;
  const uint tn = col0 / TM_TRELLIS_TILE + bt;
  const bool b_tile_ok = !a_thread && tn < w.tiles_n;
  constexpr uint mask = (1u << BITS) - 1u;
  constexpr uint kPackedBytes = 32u * BITS;  // one 16x16 tile (= w.packed_bytes)
  const float cb = a_thread ? 0.0f : grid[lane & mask];
  // The B simdgroup's two tiles of a block are one contiguous run: lane c < run_chunks copies its
  // 16-byte chunk into the simdgroup's raw words, then every lane decodes its row from there.
  const uint pair_tn = col0 / TM_TRELLIS_TILE + (bt & ~1u);
  const uint run_chunks = pair_tn < w.tiles_n ? min(2u, w.tiles_n - pair_tn) * 2u * BITS : 0u;
  uint b_off = pair_tn * kPackedBytes + lane * 16u;  // advances by one tile row of K per block
  const uint b_step = w.tiles_n * kPackedBytes;
  threadgroup uint* raw = raw_s + (sgid & 1u) * (kTrRawRowWords + 4u);
  const uint row_bit = (bt & 1u) * kPackedBytes * 8u + br * TM_TRELLIS_TILE * BITS;
  const uint tiles_per_group = w.group_size / TM_TRELLIS_TILE;
  uint group_end = tiles_per_group;
  uint scale_row = 0;
  const uint bcol = tn * TM_TRELLIS_TILE;
  float sc[TM_TRELLIS_TILE];
  TM_UNROLL
  for (uint j = 0; j < TM_TRELLIS_TILE; ++j) sc[j] = (b_tile_ok && bcol + j < w.N) ? scales[bcol + j] : 0.0f;

  for (uint tk = 0, buf = 0; tk < w.tiles_k + 1u; ++tk, buf ^= 1u) {
    // Stage block tk into buf (the first iteration only stages), then multiply block tk - 1.
    if (tk < w.tiles_k) {
      threadgroup TX* As = smem + buf * kTrStageElems;
      threadgroup TX* Bs = As + kTrTileM * kTrAStride;
      const uint k0 = tk * TM_TRELLIS_TILE;
      if (a_thread) {
        for (uint q = 0; q < TM_TRELLIS_TILE; q += 4u) {
          threadgroup TX* d = As + lid * kTrAStride + q;
          if (a_row_ok) {
            tr_copy4<TX, TX>(xrow + k0 + q, w.vec4 != 0u, k0 + q, w.K, d);
          } else {
            for (uint i = 0; i < 4u; ++i) d[i] = TX(0.0f);
          }
        }
      } else {
        if (tk == group_end) {
          group_end += tiles_per_group;
          scale_row += w.N;
          TM_UNROLL
          for (uint j = 0; j < TM_TRELLIS_TILE; ++j) {
            sc[j] = (b_tile_ok && bcol + j < w.N) ? scales[scale_row + bcol + j] : 0.0f;
          }
        }
        if (lane < run_chunks) {
          const uint4 v = *(device const uint4*)(packed + b_off);
          raw[lane * 4u] = v.x;
          raw[lane * 4u + 1u] = v.y;
          raw[lane * 4u + 2u] = v.z;
          raw[lane * 4u + 3u] = v.w;
        }
        b_off += b_step;
        const float suk = (b_tile_ok && k0 + br < w.K) ? su[k0 + br] : 0.0f;
        simdgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_tiled_b_staged]
        // The row's 16 indices (<= 64 bits) from two 32-bit windows; padded tiles give idx 0,
        // which the zero scale or su turns into 0.
        const ulong bits_row = ulong(tr_index(raw, row_bit, 0xffffffffu)) |
                               (ulong(tr_index(raw, row_bit + 32u, 0xffffffffu)) << 32u);
        threadgroup TX* d = Bs + br * kTrBStride + bt * TM_TRELLIS_TILE;
        TM_UNROLL
        for (uint j = 0; j < TM_TRELLIS_TILE; ++j) {
          const uint idx = uint(bits_row >> (j * BITS)) & mask;  // a constant shift once unrolled
          d[j] = TX(simd_shuffle(cb, ushort(idx)) * sc[j] * suk);
        }
      }
    }
    if (tk > 0u) {
      threadgroup const TX* As = smem + (buf ^ 1u) * kTrStageElems;
      threadgroup const TX* Bs = As + kTrTileM * kTrAStride;
      TM_UNROLL
      for (uint kt = 0; kt < kTrTileK / 8u; ++kt) {
        simdgroup_matrix<TX, 8, 8> b_frag[4];
        TM_UNROLL
        for (uint ni = 0; ni < 4u; ++ni) {
          simdgroup_load(b_frag[ni], Bs + kt * 8u * kTrBStride + sg_col + ni * 8u, kTrBStride);
        }
        // A constant trip count with the row guard inside: every acc[] index is a constant.
        TM_UNROLL
        for (uint mi = 0; mi < 4u; ++mi) {
          if (mi < mi_count) {  // uniform across the simdgroup
            simdgroup_matrix<TX, 8, 8> a_frag;
            simdgroup_load(a_frag, As + (sg_row + mi * 8u) * kTrAStride + kt * 8u, kTrAStride);
            TM_UNROLL
            for (uint ni = 0; ni < 4u; ++ni) {
              simdgroup_multiply_accumulate(acc[mi * 4u + ni], a_frag, b_frag[ni], acc[mi * 4u + ni]);
            }
          }
        }
      }
    }
    // Block tk is staged, and nobody reads the buffer the next iteration stages into.
    threadgroup_barrier(mem_flags::mem_threadgroup);  // [barrier:tr_tiled_swap]
  }
}

// The tiled core with w.bits as a compile-time constant (as tr_decode_core).
template <typename TX, bool GATHER>
inline void tr_tiled_core(device const TX* X, device const int* gather, uint r_begin, uint rows,
                          device const uchar* packed, device const float* scales, device const float* grid,
                          device const float* su, thread const TrMat& w, uint row0, uint col0, threadgroup TX* smem,
                          threadgroup uint* raw_s, uint lid, uint sgid, uint lane,
                          thread simdgroup_matrix<float, 8, 8>* acc) {
  if (w.bits == 2u) {
    tr_tiled_core_bits<TX, GATHER, 2u>(X, gather, r_begin, rows, packed, scales, grid, su, w, row0, col0, smem, raw_s,
                                       lid, sgid, lane, acc);
  } else if (w.bits == 3u) {
    tr_tiled_core_bits<TX, GATHER, 3u>(X, gather, r_begin, rows, packed, scales, grid, su, w, row0, col0, smem, raw_s,
                                       lid, sgid, lane, acc);
  } else {
    tr_tiled_core_bits<TX, GATHER, 4u>(X, gather, r_begin, rows, packed, scales, grid, su, w, row0, col0, smem, raw_s,
                                       lid, sgid, lane, acc);
  }
}

}  // namespace torch_marlin
