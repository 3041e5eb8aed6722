// cpu_trellis_decode_avx512: the trellis decode family (csrc/cpu/trellis_decode.cpp has the math
// and the threading) with AVX-512 (F, BW, VL, DQ). Only the functions below are compiled for
// AVX-512, through target attributes; the rest of the binary keeps the build's ISA, and this
// kernel runs only where the plan names it (caps.avx512: the running CPU executes AVX-512).
//
// One tile row (16 columns) is one zmm: one broadcast load of the row's index bits, one vpsrlvd,
// one vpermps into a 16-entry codebook held in a register (2 and 3 bits: the levels repeated to
// 16 entries, since vpermps reads the low 4 index bits and a shifted word needs no mask), then
// one FMA per activation row. AVX2 needs two vpermps and a blend per 8 columns at 4 bits.
//
// Lane order: the row's index bits are broadcast as a 64-bit word, so even dword lanes see its
// low half and odd lanes its high half. Lane 2j holds column j and lane 2j+1 column j + 8 (for 3
// bits, a word that starts 8 bits before the row puts columns 0-7 in the low half and 8-15 in the
// high half, with none straddling). Partial sums and the block's accumulators stay in this order;
// scales are permuted into it once per tile, and outputs back once per element.

// GCC 12 flags the AVX-512 intrinsics' own placeholder operands (_mm512_undefined_*) as
// maybe-uninitialized once they are inlined here; the pragma precedes the first include of them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "cpu/trellis_cpu.h"

#if defined(TM_TRELLIS_AVX512)

#include <immintrin.h>

#include <cstring>
#include <memory>

#define TM_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace torch_marlin {
namespace {

constexpr int kTile = 16;

// Lane l holds column kLaneColumn[l]; kColumnLane is its inverse.
alignas(64) constexpr int32_t kLaneColumn[kTile] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
alignas(64) constexpr int32_t kColumnLane[kTile] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

template <int BITS>
struct Codebook512 {
  __m512 table;  // entry i: grid[i mod 2^BITS]
  __m512i shift;  // per lane: where its column's bits start in the lane's half of the row word

  TM_AVX512_TARGET explicit Codebook512(const float* grid) {
    alignas(64) float t[kTile];
    alignas(64) int32_t s[kTile];
    for (int i = 0; i < kTile; ++i) t[i] = grid[i & ((1 << BITS) - 1)];
    for (int l = 0; l < kTile; ++l) {
      const int j = l / 2;  // lane 2j: column j, lane 2j+1: column j + 8
      if (BITS == 2) s[l] = 2 * j + (l % 2) * 16;  // a 32-bit row; both lanes read the same word
      if (BITS == 3) s[l] = 3 * j + (l % 2 ? 0 : 8);  // the word starts 8 bits before the row
      if (BITS == 4) s[l] = 4 * j;
    }
    table = _mm512_load_ps(t);
    shift = _mm512_load_si512(s);
  }

  // The grid values of tile row r, in lane order (r is a constant once the tile loop is unrolled).
  TM_AVX512_TARGET inline __m512 row(const uint8_t* tile, int r) const {
    __m512i word;
    if constexpr (BITS == 2) {
      int32_t v;
      std::memcpy(&v, tile + 4 * r, 4);
      word = _mm512_set1_epi32(v);
    } else if constexpr (BITS == 4) {
      int64_t v;
      std::memcpy(&v, tile + 8 * r, 8);
      word = _mm512_set1_epi64(v);
    } else {
      // 3 bits: row r is bytes 6r..6r+5; the 8 bytes from 6r - 1 stay inside the tile except for
      // the first and last rows, which load inside it and shift the word into place.
      int64_t v;
      if (r == 0) {
        std::memcpy(&v, tile, 8);
        word = _mm512_slli_epi64(_mm512_set1_epi64(v), 8);
      } else if (r == kTile - 1) {
        std::memcpy(&v, tile + 6 * r - 2, 8);
        word = _mm512_srli_epi64(_mm512_set1_epi64(v), 8);
      } else {
        std::memcpy(&v, tile + 6 * r - 1, 8);
        word = _mm512_set1_epi64(v);
      }
    }
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(word, shift), table);
  }
};

// Partial sums per activation row: M = 1 splits the tile rows over 4 sums and M <= 8 over 2, so
// that the FMA chains (4 cycles of latency) keep pace with the decode (3 zmm ops per tile row
// over two vector ports at M = 1).
template <int M>
constexpr int kSums = M == 1 ? 4 : M <= 8 ? 2 : 1;

// p[i][r % kSums] += xt[16 i + r] * W(r) over the 16 tile rows r, for the M activation rows of
// the tile row block in xt, in lane order.
template <int BITS, int M>
TM_AVX512_TARGET inline void tile_rows(const Codebook512<BITS>& cb, const uint8_t* tile, const float* xt,
                                       __m512 (&p)[M][kSums<M>]) {
#pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) {
    const __m512 v = cb.row(tile, r);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      __m512& q = p[i][r % kSums<M>];
      q = _mm512_fmadd_ps(_mm512_set1_ps(xt[i * kTile + r]), v, q);
    }
  }
}

template <int BITS, int M>
TM_AVX512_TARGET void decode_block(const TView& w, const float* X, int64_t ldx, int64_t c0, int64_t c1, float* C,
                                   int64_t ldc) {
  const Codebook512<BITS> cb(w.grid);
  const __m512i to_lanes = _mm512_load_si512(kLaneColumn), to_columns = _mm512_load_si512(kColumnLane);
  const int64_t tn0 = c0 / kTile, nt = (c1 - c0 + kTile - 1) / kTile, width = nt * kTile;
  std::unique_ptr<float[]> acc(new float[M * width]());
  // The activations of one tile row block, copied together: the FMAs then broadcast them from
  // fixed offsets of one register (M row pointers would not fit in registers at M = 16). The
  // barrier per tile keeps them in memory: without it the compiler forwards the copied vectors
  // into lane permutes (the codebook lookups' port) or hoists all 16 M of them into stack spills.
  alignas(64) float xt[M * kTile];
  TileAheadPrefetcher ahead(w, tn0, nt);
  for (int64_t tk = 0; tk < w.tiles_k; ++tk) {
    ahead.start_row(tk);
    const int64_t k0 = tk * kTile;
    const float* srow = w.scales + (k0 / w.group_size) * w.N;
    const uint8_t* tile = w.packed + (tk * w.tiles_n + tn0) * w.packed_bytes;
    for (int i = 0; i < M; ++i) _mm512_store_ps(xt + i * kTile, _mm512_loadu_ps(X + i * ldx + k0));
    for (int64_t j = 0; j < nt; ++j, tile += w.packed_bytes) {
      asm volatile("" : : "r"(xt) : "memory");
      ahead.next();
      const int64_t n0 = c0 + j * kTile;
      // The matrix's last, partial tile column: no scale reads past N, zero scales beyond it.
      const __mmask16 cols = n0 + kTile > w.N ? __mmask16((1u << (w.N - n0)) - 1) : __mmask16(0xffff);
      const __m512 s = _mm512_permutexvar_ps(to_lanes, _mm512_maskz_loadu_ps(cols, srow + n0));
      __m512 p[M][kSums<M>];
      for (int i = 0; i < M; ++i)
        for (int q = 0; q < kSums<M>; ++q) p[i][q] = _mm512_setzero_ps();
      tile_rows<BITS, M>(cb, tile, xt, p);
      float* a = acc.get() + j * kTile;
      for (int i = 0; i < M; ++i) {
        __m512 t = p[i][0];
        for (int q = 1; q < kSums<M>; ++q) t = _mm512_add_ps(t, p[i][q]);
        _mm512_storeu_ps(a + i * width, _mm512_fmadd_ps(t, s, _mm512_loadu_ps(a + i * width)));
      }
    }
  }
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t n0 = c0 + j * kTile;
    const __mmask16 cols = n0 + kTile > c1 ? __mmask16((1u << (c1 - n0)) - 1) : __mmask16(0xffff);
    const __m512 sv = _mm512_maskz_loadu_ps(cols, w.sv + n0);
    for (int i = 0; i < M; ++i) {
      const __m512 a = _mm512_permutexvar_ps(to_columns, _mm512_loadu_ps(acc.get() + i * width + j * kTile));
      _mm512_mask_storeu_ps(C + i * ldc + (n0 - c0), cols, _mm512_mul_ps(a, sv));
    }
  }
}

template <int BITS, int M = 1>
void decode_rows(int64_t rows, const TView& w, const float* X, int64_t ldx, int64_t c0, int64_t c1, float* C,
                 int64_t ldc) {
  if constexpr (M < kDecodeMaxM) {
    if (rows != M) return decode_rows<BITS, M + 1>(rows, w, X, ldx, c0, c1, C, ldc);
  }
  decode_block<BITS, M>(w, X, ldx, c0, c1, C, ldc);
}

}  // namespace

bool cpu_runs_trellis_avx512() {
  static const bool runs = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return runs;
}

void trellis_decode_columns_avx512(int64_t bits, const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0,
                                   int64_t c1, float* C, int64_t ldc) {
  if (M <= 0) return;
  switch (bits) {
    case 2: decode_rows<2>(M, w, X, ldx, c0, c1, C, ldc); break;
    case 3: decode_rows<3>(M, w, X, ldx, c0, c1, C, ldc); break;
    default: decode_rows<4>(M, w, X, ldx, c0, c1, C, ldc); break;
  }
}

}  // namespace torch_marlin

#endif  // TM_TRELLIS_AVX512
