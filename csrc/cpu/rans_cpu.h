// CPU rANS lane decoder shared by rans_decode (rans_codec.cpp) and the fused GEMM (rans_gemm.cpp):
// one tile's 32 lane states, its symbol table and its word stream (docs/formats.md, "rANS-coded
// 4-bit codes"). The same code serves the checked decode and the GEMM: a read past the tile's
// stream returns a zero word and is remembered (`overrun`), so nothing is ever read outside the
// stream and the checked decode can name the tile afterwards.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "torch_marlin/rans_params.h"

namespace torch_marlin {

// One 4096-entry decode table: entry = freq | (slot - cum) << 13 | symbol << 25 (freq <= 4096 needs
// 13 bits, slot - cum < freq 12 bits), so a step is one load, one multiply and one add.
constexpr uint32_t kRansFreqMask = 0x1FFFu;
constexpr uint32_t kRansBiasShift = 13u;
constexpr uint32_t kRansSymbolShift = 25u;

// The table of frequencies f[16]. Frequencies are clamped to what remains of the 4096 slots and
// slots past the sum stay unused, so a table that does not sum to 4096 (refused before any CPU
// kernel runs) could not write out of bounds either.
inline void build_rans_table(const int16_t* freqs, uint32_t* table) {
  uint32_t cum = 0;
  for (uint32_t s = 0; s < TM_RANS_SYMBOLS; ++s) {
    const uint32_t f = std::min<uint32_t>(uint32_t(std::max<int>(freqs[s], 0)), TM_RANS_PROB_SCALE - cum);
    for (uint32_t i = 0; i < f; ++i) table[cum + i] = f | (i << kRansBiasShift) | (s << kRansSymbolShift);
    cum += f;
  }
  for (uint32_t i = cum; i < TM_RANS_PROB_SCALE; ++i) table[i] = 1u | (15u << kRansSymbolShift);
}

struct RansTileDecoder {
  alignas(64) uint32_t table[TM_RANS_PROB_SCALE];
  alignas(32) uint32_t x[TM_RANS_LANES];
  const uint16_t* stream = nullptr;  // the tile's words (a zero word when it has none)
  int64_t len = 0;                   // words in the stream
  int64_t last = 0;                  // max(len - 1, 0): every read is clamped to it
  int64_t ptr = 0;                   // words consumed, may pass len on a corrupted stream

  void init(const int16_t* words, const int32_t* offsets, const int32_t* states, const int16_t* freqs, int64_t t) {
    static const uint16_t kZeroWord = 0;
    build_rans_table(freqs + t * TM_RANS_SYMBOLS, table);
    for (uint32_t l = 0; l < TM_RANS_LANES; ++l) x[l] = uint32_t(states[t * TM_RANS_LANES + l]);
    len = int64_t(offsets[t + 1]) - offsets[t];
    stream = len > 0 ? reinterpret_cast<const uint16_t*>(words) + offsets[t] : &kZeroWord;
    last = std::max<int64_t>(len - 1, 0);
    ptr = 0;
  }

  // The stream's word `p`, 0 past its end.
  uint32_t word(int64_t p) const { return p < len ? uint32_t(stream[std::min(p, last)]) : 0u; }

  // One decode step: the 32 lanes' symbols, lanes in increasing order taking the next words.
  inline void step(uint8_t* __restrict sym) {
    for (uint32_t l = 0; l < TM_RANS_LANES; ++l) {
      uint32_t v = x[l];
      const uint32_t e = table[v & TM_RANS_PROB_MASK];
      v = (e & kRansFreqMask) * (v >> TM_RANS_PROB_BITS) + ((e >> kRansBiasShift) & TM_RANS_PROB_MASK);
      sym[l] = uint8_t(e >> kRansSymbolShift);
      const bool need = v < TM_RANS_STATE_LOW;
      const uint32_t w = word(ptr);
      x[l] = need ? (v << TM_RANS_WORD_BITS) | w : v;
      ptr += need ? 1 : 0;
    }
  }

  // The step of the plan's kernel: step_avx2 where the build has it and the plan names it.
  template <bool kAvx2>
  inline void step_as(uint8_t* __restrict sym) {
#if defined(__AVX2__)
    if constexpr (kAvx2) {
      step_avx2(sym);
      return;
    }
#endif
    step(sym);
  }

#if defined(__AVX2__)
  // step() with 8 lanes per vector: table gather, state update and the renormalization test for
  // 8 lanes at once; the lanes that need a word take the next ones of the stream in lane order
  // through a permute of the 8 words at the stream pointer (index table by the need mask).
  // `per_vector(v, symbols)` receives lanes [8v, 8v + 8) as 8 int32 symbols.
  template <class PerVector>
  inline void step_avx2(PerVector&& per_vector) {
    const __m256i slot_mask = _mm256_set1_epi32(int(TM_RANS_PROB_MASK));
    const __m256i freq_mask = _mm256_set1_epi32(int(kRansFreqMask));
    const int32_t(*const word_index)[8] = lane_word_index().idx;
    int64_t p = ptr;  // in a register across the 4 vectors (the member would go through memory)
    for (uint32_t v = 0; v < TM_RANS_LANES / 8; ++v) {
      const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 8 * v));
      const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_and_si256(xv, slot_mask), 4);
      const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(e, int(kRansBiasShift)), slot_mask);
      __m256i nx = _mm256_add_epi32(
          _mm256_mullo_epi32(_mm256_and_si256(e, freq_mask), _mm256_srli_epi32(xv, int(TM_RANS_PROB_BITS))), bias);
      const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(nx, int(TM_RANS_WORD_BITS)), _mm256_setzero_si256());
      const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
      const __m256i w = _mm256_permutevar8x32_epi32(
          _mm256_cvtepu16_epi32(next8(p)), _mm256_load_si256(reinterpret_cast<const __m256i*>(word_index[mask])));
      nx = _mm256_blendv_epi8(nx, _mm256_or_si256(_mm256_slli_epi32(nx, int(TM_RANS_WORD_BITS)), w), need);
      _mm256_store_si256(reinterpret_cast<__m256i*>(x + 8 * v), nx);
      p += __builtin_popcount(unsigned(mask));
      per_vector(v, _mm256_srli_epi32(e, int(kRansSymbolShift)));
    }
    ptr = p;
  }

  inline void step_avx2(uint8_t* __restrict sym) {
    step_avx2([sym](uint32_t v, __m256i s32) {
      const __m128i s16 = _mm_packus_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(sym + 8 * v), _mm_packus_epi16(s16, s16));
    });
  }

  // The 8 words at p, zeros past the stream's end.
  inline __m128i next8(int64_t p) const {
    if (p + 8 <= len) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(stream + p));
    alignas(16) uint16_t w[8];
    for (int i = 0; i < 8; ++i) w[i] = uint16_t(word(p + i));
    return _mm_load_si128(reinterpret_cast<const __m128i*>(w));
  }

  // idx[mask][l]: the rank of lane l among the set bits of mask (the word lane l takes).
  struct LaneWordIndex {
    alignas(32) int32_t idx[256][8];
  };
  static const LaneWordIndex& lane_word_index() {
    static const LaneWordIndex t = [] {
      LaneWordIndex r{};
      for (int m = 0; m < 256; ++m)
        for (int l = 0; l < 8; ++l) r.idx[m][l] = __builtin_popcount(unsigned(m) & ((1u << l) - 1u));
      return r;
    }();
    return t;
  }
#endif

  // A valid stream ends with every lane at L, read at most len words and left only zero padding
  // (fewer than 8 words).
  bool ended_cleanly() const {
    if (ptr > len || len - ptr >= int64_t(TM_RANS_STREAM_ALIGN_WORDS)) return false;
    for (uint32_t l = 0; l < TM_RANS_LANES; ++l)
      if (x[l] != TM_RANS_STATE_LOW) return false;
    for (int64_t p = ptr; p < len; ++p)
      if (stream[p] != 0) return false;
    return true;
  }
};

}  // namespace torch_marlin

namespace torch_marlin {

struct RansCodes;

// Decodes every tile of `codes` into B_packed int32 [K/8, N] (contiguous), with the AVX2 lane step
// when `avx2` (the plan's cpu_avx2). With `check`, raises ValueError naming the first corrupted
// tile; without, a corrupted stream decodes to some codes.
void rans_decode_to_packed(const RansCodes& codes, at::Tensor& B_packed, bool check, bool avx2);

}  // namespace torch_marlin
