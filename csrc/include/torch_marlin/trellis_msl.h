// MSL-only helpers shared by metal/trellis_gemm.metal and metal/trellis_moe.metal: tuning
// constants, the geometry of one trellis matrix, the GEMV core and the simdgroups' fixed-order
// meet. Not for host C++. Names carry a tr_ / kTr prefix: every .metal file must also compile as
// part of one concatenated library (csrc/include/torch_marlin/msl_kernel.h).
#pragma once

#include "torch_marlin/msl_kernel.h"
#include "torch_marlin/trellis_params.h"

using namespace metal;  // MSL-only header: min/max and the address-space types

namespace torch_marlin {

// Tuning constants; csrc/plan/trellis_plan.cpp uses the same numbers.
constant constexpr uint kTrThreads = 128;  // 4 simdgroups of 32
constant constexpr uint kTrSimdgroups = 4;
constant constexpr uint kTrDecodeRows = 16;  // kDecodeMaxM: rows per GEMV pass
constant constexpr uint kTrDecodeCols = 32;  // one column per lane
constant constexpr uint kTrTileM = 64;
constant constexpr uint kTrTileN = 64;
constant constexpr uint kTrTileK = 32;  // two trellis tile rows
constant constexpr uint kTrDequantThreads = 256;
constant constexpr uint kTrCombineThreads = 256;

// Geometry of one trellis matrix W[K, N]. The MoE's down projection has K and N swapped
// relative to the params (it maps intermediate -> hidden).
struct TrMat {
  uint K, N, tiles_k, tiles_n, packed_bytes, bits, group_size, n_groups;
};

inline TrMat tr_mat(constant TrellisParams& p) {
  TrMat m = {p.K, p.N, p.tiles_k, p.tiles_n, p.packed_bytes, p.bits, p.group_size, p.n_groups};
  return m;
}

inline TrMat tr_down_mat(constant TrellisParams& p) {
  TrMat m = {p.N, p.K, p.down_tiles_k, p.down_tiles_n, p.packed_bytes, p.bits, p.group_size, p.down_n_groups};
  return m;
}

// w[k, n] without sv (the GEMM kernels apply sv once per output column).
inline float tr_weight_no_sv(device const uchar* packed, device const float* scales, device const float* grid,
                             device const float* su, thread const TrMat& w, uint k, uint n) {
  device const uchar* tile =
      packed + trellis_tile_offset(k / TM_TRELLIS_TILE, n / TM_TRELLIS_TILE, w.tiles_n, w.packed_bytes);
  const uint idx = trellis_unpack_index(tile, (k % TM_TRELLIS_TILE) * TM_TRELLIS_TILE + n % TM_TRELLIS_TILE, w.bits);
  return grid[idx] * scales[(k / w.group_size) * w.N + n] * su[k];
}

// GEMV core: acc[m] += sum_k X[row(m), k] * w[k, n] (without sv) for m < rows <= 16, one column n
// per lane. Simdgroup sgid takes trellis tile rows tk = sgid, sgid + 4, ...; row(m) is
// row_base + m, or gather[row_base + m] when GATHER (the MoE's expert-sorted token list).
template <typename TX, bool GATHER>
inline void tr_gemv_accumulate(device const TX* X, uint ldx, device const int* gather, uint row_base, uint rows,
                               device const uchar* packed, device const float* scales, device const float* grid,
                               device const float* su, thread const TrMat& w, uint n, uint sgid,
                               thread float* acc) {
  if (n >= w.N) return;
  for (uint tk = sgid; tk < w.tiles_k; tk += kTrSimdgroups) {
    const uint k_end = min(w.K, (tk + 1u) * TM_TRELLIS_TILE);
    for (uint k = tk * TM_TRELLIS_TILE; k < k_end; ++k) {
      const float wv = tr_weight_no_sv(packed, scales, grid, su, w, k, n);
      // Constant trip count keeps acc[] in registers; rows >= `rows` are skipped uniformly.
      for (uint m = 0; m < kTrDecodeRows; ++m) {
        if (m < rows) {
          const uint row = GATHER ? uint(gather[row_base + m]) : row_base + m;
          acc[m] += float(X[row * ldx + k]) * wv;  // same address on every lane: a broadcast load
        }
      }
    }
  }
}

// The 4 simdgroups' partials partial[s][m][c] summed in a fixed order (deterministic).
inline float tr_meet(threadgroup const float* partial, uint m, uint c) {
  const uint stride = kTrDecodeRows * kTrDecodeCols;
  const uint i = m * kTrDecodeCols + c;
  return ((partial[i] + partial[stride + i]) + partial[2u * stride + i]) + partial[3u * stride + i];
}

}  // namespace torch_marlin
