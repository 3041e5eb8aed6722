// CPU decode family of the trellis GEMM (M <= 16 rows):
//   C[m, n] = sv[n] * sum_tk s[g(tk), n] * sum_{r < 16} X[m, 16 tk + r] * grid[idx[16 tk + r, n]],
//   X = A * su (once per call, fp32, zero-padded to whole tiles of K).
//
// Threads own contiguous column blocks (the plan's tile_n, a multiple of 16) and walk K tile row
// by tile row; inside a block, one tile row of the packed tensor is a contiguous run of bytes, so
// every thread streams its weights front to back. A column-strip order (all of K for 16 columns,
// then the next 16) touches 1.5 cache lines per 24 KiB stride and is bound by memory latency.
// Each 16x16 tile is summed into registers without its scale; the tile's 16 column scales are
// applied once per tile into the block's fp32 accumulators (M x tile_n floats, at most 16 KiB,
// sized by the planner so they stay in L1), sv once per output.
//
// Kernels, as the plan names them: cpu_trellis_decode_avx512 (csrc/cpu/trellis_decode_avx512.cpp),
// cpu_trellis_decode_avx2 (codebook in registers, lane permutes), cpu_trellis_decode (portable C++).
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_TRELLIS_AVX2 1
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#include "cpu/trellis_cpu.h"

namespace torch_marlin {
namespace {

constexpr int kTile = 16;
constexpr int64_t kMaxRowsPerPass = 4;  // AVX2: 4 rows x 2 vectors of accumulators, + lookups, in 16 registers

// Portable: the 256 grid values of one tile, row-major.
template <int BITS>
void decode_tile_portable(const uint8_t* tile, const float* grid, float* __restrict vals) {
  constexpr uint32_t kMask = (1u << BITS) - 1;
  for (int r = 0; r < kTile; ++r) {
    // A tile row is 2*BITS bytes: its 16 indices are one little-endian integer of 32..64 bits.
    uint64_t bits = 0;
    std::memcpy(&bits, tile + r * 2 * BITS, 2 * BITS);
    for (int j = 0; j < kTile; ++j) vals[r * kTile + j] = grid[(bits >> (j * BITS)) & kMask];
  }
}

template <int BITS>
void decode_block_portable(const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0, int64_t c1, float* C,
                           int64_t ldc) {
  const int64_t tn0 = c0 / kTile, nt = (c1 - c0 + kTile - 1) / kTile, width = nt * kTile;
  std::unique_ptr<float[]> acc(new float[M * width]());
  alignas(64) float vals[kTile * kTile];
  float part[kTile], s[kTile];
  for (int64_t tk = 0; tk < w.tiles_k; ++tk) {
    const int64_t k0 = tk * kTile;
    const float* srow = w.scales + (k0 / w.group_size) * w.N;
    const uint8_t* tile = w.packed + (tk * w.tiles_n + tn0) * w.packed_bytes;
    for (int64_t j = 0; j < nt; ++j, tile += w.packed_bytes) {
      const int64_t n0 = c0 + j * kTile, cols = std::min<int64_t>(kTile, w.N - n0);
      decode_tile_portable<BITS>(tile, w.grid, vals);
      for (int n = 0; n < kTile; ++n) s[n] = n < cols ? srow[n0 + n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float* x = X + m * ldx + k0;
        std::fill(part, part + kTile, 0.f);
        for (int r = 0; r < kTile; ++r)
          for (int n = 0; n < kTile; ++n) part[n] += x[r] * vals[r * kTile + n];
        float* a = acc.get() + m * width + j * kTile;
        for (int n = 0; n < kTile; ++n) a[n] += part[n] * s[n];
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = c0; n < c1; ++n) C[m * ldc + (n - c0)] = acc[m * width + (n - c0)] * w.sv[n];
}

#if defined(TM_TRELLIS_AVX2)
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The codebook in registers. 2 bits: 4 levels in each 128-bit lane, looked up with vpermilps
// (in-lane, reads index bits 1:0). 3 bits: 8 levels, vpermps (reads bits 2:0). 4 bits: levels
// 0-7 and 8-15, two vpermps and a blend on bit 3. The permutes ignore the higher index bits, so
// a shifted word needs no mask.
template <int BITS>
struct Codebook {
  __m256 lo, hi;
  explicit Codebook(const float* grid) {
    float t[16] = {};
    for (int i = 0; i < (1 << BITS); ++i) t[i] = grid[i];
    if (BITS == 2) std::memcpy(t + 4, t, 4 * sizeof(float));
    lo = _mm256_loadu_ps(t);
    hi = _mm256_loadu_ps(t + 8);
  }

  // Grid values of columns 8*HALF .. 8*HALF+7 of tile row r.
  template <int HALF>
  __m256 row(const uint8_t* tile, int r) const {
    if (BITS == 2) {
      // Row r: bytes 4r..4r+3, columns 0-7 in bits 0-15, 8-15 in bits 16-31.
      const __m256i sh = HALF == 0 ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                                   : _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
      const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32(tile + 4 * r))), sh);
      return _mm256_permutevar_ps(lo, idx);
    } else if (BITS == 3) {
      // Row r: bytes 6r..6r+5. Columns 0-7 are bits 0-23 of the word at 6r; columns 8-15 bits
      // 8-31 of the word at 6r+2 (a load inside the tile, unlike one at 6r+3 for the last row).
      const __m256i sh = HALF == 0 ? _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)
                                   : _mm256_setr_epi32(8, 11, 14, 17, 20, 23, 26, 29);
      const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32(tile + 6 * r + 2 * HALF))), sh);
      return _mm256_permutevar8x32_ps(lo, idx);
    } else {
      const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(int(load_u32(tile + 8 * r + 4 * HALF))), sh);
      // Bit 3 to the sign bit selects the upper half.
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                              _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
  }
};

// acc[i][0..16) += s * sum_r x[i][r] * V(r), for R <= 4 rows, V(r) two 8-lane halves from
// `half(r, h)`. One row alone keeps even and odd tile rows in separate sums: four FMA chains
// instead of two, so the loop is not bound by FMA latency.
template <int R, class Half>
inline void tile_fma(const Half& half, const float* x, int64_t ldx, __m256 s0, __m256 s1, float* acc, int64_t lda) {
  constexpr int P = R == 1 ? 2 : 1;
  __m256 p[R][P][2];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < P; ++q) p[i][q][0] = p[i][q][1] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) {
    const __m256 v0 = half(r, std::integral_constant<int, 0>());
    const __m256 v1 = half(r, std::integral_constant<int, 1>());
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + r);
      p[i][r % P][0] = _mm256_fmadd_ps(a, v0, p[i][r % P][0]);
      p[i][r % P][1] = _mm256_fmadd_ps(a, v1, p[i][r % P][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    __m256 t0 = p[i][0][0], t1 = p[i][0][1];
    if (P == 2) {
      t0 = _mm256_add_ps(t0, p[i][P - 1][0]);
      t1 = _mm256_add_ps(t1, p[i][P - 1][1]);
    }
    float* a = acc + i * lda;
    _mm256_storeu_ps(a, _mm256_fmadd_ps(t0, s0, _mm256_loadu_ps(a)));
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(t1, s1, _mm256_loadu_ps(a + 8)));
  }
}

template <int BITS, int R>
void decode_block_avx2_rows(const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0, int64_t c1,
                            float* C, int64_t ldc) {
  const Codebook<BITS> cb(w.grid);
  const int64_t tn0 = c0 / kTile, nt = (c1 - c0 + kTile - 1) / kTile, width = nt * kTile;
  std::unique_ptr<float[]> acc(new float[M * width]());
  alignas(32) float vals[kTile * kTile];
  alignas(32) float s_edge[kTile];
  TileAheadPrefetcher ahead(w, tn0, nt);
  for (int64_t tk = 0; tk < w.tiles_k; ++tk) {
    ahead.start_row(tk);
    const int64_t k0 = tk * kTile;
    const float* srow = w.scales + (k0 / w.group_size) * w.N;
    const uint8_t* tile = w.packed + (tk * w.tiles_n + tn0) * w.packed_bytes;
    const float* x = X + k0;
    for (int64_t j = 0; j < nt; ++j, tile += w.packed_bytes) {
      ahead.next();
      const int64_t n0 = c0 + j * kTile;
      const float* s = srow + n0;
      if (n0 + kTile > w.N) {  // the matrix's last, partial tile column: no scale reads past N
        for (int n = 0; n < kTile; ++n) s_edge[n] = n0 + n < w.N ? s[n] : 0.f;
        s = s_edge;
      }
      const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
      float* a = acc.get() + j * kTile;
      if constexpr (R > 0) {
        // M = R <= 4: decode straight into the FMAs.
        auto half = [&](int r, auto h) { return cb.template row<decltype(h)::value>(tile, r); };
        tile_fma<R>(half, x, ldx, s0, s1, a, width);
      } else {
        // M > 4: decode the tile once into L1, then passes of 4 rows read it back.
        for (int r = 0; r < kTile; ++r) {
          _mm256_store_ps(vals + r * kTile, cb.template row<0>(tile, r));
          _mm256_store_ps(vals + r * kTile + 8, cb.template row<1>(tile, r));
        }
        auto half = [&](int r, auto h) { return _mm256_load_ps(vals + r * kTile + 8 * decltype(h)::value); };
        for (int64_t m = 0; m < M; m += kMaxRowsPerPass) {
          const float* xm = x + m * ldx;
          float* am = a + m * width;
          switch (std::min(kMaxRowsPerPass, M - m)) {
            case 1: tile_fma<1>(half, xm, ldx, s0, s1, am, width); break;
            case 2: tile_fma<2>(half, xm, ldx, s0, s1, am, width); break;
            case 3: tile_fma<3>(half, xm, ldx, s0, s1, am, width); break;
            default: tile_fma<4>(half, xm, ldx, s0, s1, am, width); break;
          }
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* a = acc.get() + m * width;
    int64_t n = c0;
    for (; n + 8 <= c1; n += 8)
      _mm256_storeu_ps(C + m * ldc + (n - c0),
                       _mm256_mul_ps(_mm256_loadu_ps(a + (n - c0)), _mm256_loadu_ps(w.sv + n)));
    for (; n < c1; ++n) C[m * ldc + (n - c0)] = a[n - c0] * w.sv[n];
  }
}

template <int BITS>
void decode_block_avx2(const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0, int64_t c1, float* C,
                       int64_t ldc) {
  switch (M) {
    case 1: decode_block_avx2_rows<BITS, 1>(w, X, ldx, M, c0, c1, C, ldc); break;
    case 2: decode_block_avx2_rows<BITS, 2>(w, X, ldx, M, c0, c1, C, ldc); break;
    case 3: decode_block_avx2_rows<BITS, 3>(w, X, ldx, M, c0, c1, C, ldc); break;
    case 4: decode_block_avx2_rows<BITS, 4>(w, X, ldx, M, c0, c1, C, ldc); break;
    default: decode_block_avx2_rows<BITS, 0>(w, X, ldx, M, c0, c1, C, ldc); break;
  }
}
#endif

template <int BITS>
void decode_columns(DecodeKernel kernel, const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0, int64_t c1,
                    float* C, int64_t ldc) {
#if defined(TM_TRELLIS_AVX2)
  if (kernel == DecodeKernel::Avx2) return decode_block_avx2<BITS>(w, X, ldx, M, c0, c1, C, ldc);
#endif
  decode_block_portable<BITS>(w, X, ldx, M, c0, c1, C, ldc);
}

}  // namespace

at::Tensor trellis_decode_activations(const at::Tensor& A, const at::Tensor& su, int64_t K) {
  // Padded rows multiply the tile's padding indices by zero (the grid is finite), so the tile
  // loop needs no bound on K.
  at::Tensor X = at::zeros({A.size(0), (K + kTile - 1) / kTile * kTile}, A.options().dtype(at::kFloat));
  X.narrow(1, 0, K).copy_(A.to(at::kFloat) * su);
  return X;
}

void trellis_decode_columns(DecodeKernel kernel, int64_t bits, const TView& w, const float* X, int64_t ldx,
                            int64_t M, int64_t c0, int64_t c1, float* C, int64_t ldc) {
#if !defined(TM_TRELLIS_AVX2)
  TORCH_CHECK(kernel != DecodeKernel::Avx2,
              "torch_marlin: the plan names the AVX2 trellis decode kernel but this build has none");
#endif
  TORCH_CHECK(c0 % kTile == 0 && M <= kDecodeMaxM, "trellis decode: columns must start on a tile, rows <= 16");
  if (kernel == DecodeKernel::Avx512) {
#if defined(TM_TRELLIS_AVX512)
    return trellis_decode_columns_avx512(bits, w, X, ldx, M, c0, c1, C, ldc);
#else
    TORCH_CHECK(false, "torch_marlin: the plan names the AVX-512 trellis decode kernel but this build has none");
#endif
  }
  switch (bits) {
    case 2: decode_columns<2>(kernel, w, X, ldx, M, c0, c1, C, ldc); break;
    case 3: decode_columns<3>(kernel, w, X, ldx, M, c0, c1, C, ldc); break;
    default: decode_columns<4>(kernel, w, X, ldx, M, c0, c1, C, ldc); break;
  }
}

void trellis_decode_gemm(const TrellisPlan& plan, const TrellisGemmArgs& a, float* C) {
  TORCH_CHECK(plan.params.tile_n % kTile == 0, "gemm_trellis: plan tile_n ", plan.params.tile_n,
              " is not a multiple of 16");
  const TView w = make_view(a.w, a.K, a.N, a.bits, a.group_size, 0);
  const at::Tensor X = trellis_decode_activations(a.A, a.w.su, a.K);
  const float* Xp = X.data_ptr<float>();
  const int64_t tile_n = plan.params.tile_n;
  const DecodeKernel kernel = decode_kernel(plan);
  at::parallel_for(0, plan.params.n_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * tile_n;
      trellis_decode_columns(kernel, a.bits, w, Xp, X.size(1), a.M, c0, std::min(c0 + tile_n, a.N), C + c0, a.N);
    }
  });
}

}  // namespace torch_marlin
