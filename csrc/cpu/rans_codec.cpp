// CPU rANS coder of 4-bit codes (docs/formats.md, "rANS-coded 4-bit codes"): the encoder
// (bit for bit torch_marlin/formats/rans.py `encode`) and the decoder to B_packed with the
// integrity check. Tiles are independent: both run one task per tile range and the encoder joins
// the streams in tile order, so the result does not depend on the thread count.
#include <ATen/Parallel.h>

#include <atomic>
#include <memory>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/rans_cpu.h"

namespace torch_marlin {
namespace {

constexpr int64_t kPrefetchRows = 8;

// Codes of one tile in decode order: sym[c * K + k] = code[k, n0 + c] (step c * K/32 + k / 32,
// lane k % 32). Returns the tile's symbol counts.
void gather_tile_codes(const int32_t* B, int64_t K, int64_t N, int64_t n0, int64_t channels, uint8_t* sym,
                       int64_t* counts) {
  for (int64_t kw = 0; kw < K / 8; ++kw) {
    const int32_t* row = B + kw * N + n0;
    // Rows are N words apart: too far for the hardware prefetchers, fetch a few rows ahead.
    __builtin_prefetch(row + kPrefetchRows * N);
    for (int64_t c = 0; c < channels; ++c) {
      const uint32_t w = uint32_t(row[c]);
      uint8_t* dst = sym + c * K + kw * 8;
      for (int r = 0; r < 8; ++r) {
        const uint32_t s = (w >> (4 * r)) & 15u;
        dst[r] = uint8_t(s);
        ++counts[s];
      }
    }
  }
}

// freq[s] = max(1, floor(4096 n_s / n)) for present symbols, 0 for absent ones; the most frequent
// symbol (lowest index on ties) absorbs the difference.
void tile_frequencies(const int64_t* counts, int64_t* freq) {
  int64_t total = 0, sum = 0;
  int top = 0;
  for (int s = 0; s < int(TM_RANS_SYMBOLS); ++s) {
    total += counts[s];
    if (counts[s] > counts[top]) top = s;
  }
  for (int s = 0; s < int(TM_RANS_SYMBOLS); ++s) {
    freq[s] = counts[s] > 0 ? std::max<int64_t>(1, counts[s] * int64_t(TM_RANS_PROB_SCALE) / total) : 0;
    sum += freq[s];
  }
  freq[top] += int64_t(TM_RANS_PROB_SCALE) - sum;
}

// Encodes symbols [0, n) (n a multiple of 32, lane = index % 32) in reverse decode order; returns
// the words in decode order and the final lane states. Branch-free: the emitted word is stored
// unconditionally and kept when the lane emits. x / freq is floor(x * (1 / freq) + 2^-14) in
// double: after emission x / freq < 2^20, so the product is within 2^-31 of the quotient, whose
// fractional part is 0 or in [2^-12, 1 - 2^-12]; the offset makes the floor exact.
void encode_tile(const uint8_t* sym, int64_t n, const int64_t* freq, std::vector<uint16_t>& out, uint32_t* states) {
  uint32_t f32[TM_RANS_SYMBOLS], cum[TM_RANS_SYMBOLS];
  uint64_t emit_at[TM_RANS_SYMBOLS];
  double inv[TM_RANS_SYMBOLS];
  uint32_t c = 0;
  for (uint32_t s = 0; s < TM_RANS_SYMBOLS; ++s) {
    f32[s] = uint32_t(freq[s]);
    cum[s] = c;
    c += f32[s];
    // x >= 2^20 * freq: after encoding, x would leave [L, 2^32).
    emit_at[s] = uint64_t(f32[s]) << (32 - TM_RANS_PROB_BITS);
    inv[s] = f32[s] > 0 ? 1.0 / double(f32[s]) : 0.0;
  }
  uint32_t x[TM_RANS_LANES];
  for (uint32_t l = 0; l < TM_RANS_LANES; ++l) x[l] = TM_RANS_STATE_LOW;
  out.resize(size_t(n));  // at most one word per symbol
  uint16_t* o = out.data();
  size_t emitted = 0;
  for (int64_t i = n - int64_t(TM_RANS_LANES); i >= 0; i -= TM_RANS_LANES) {
    for (int l = int(TM_RANS_LANES) - 1; l >= 0; --l) {
      const uint32_t s = sym[i + l];
      uint32_t v = x[l];
      const bool emit = v >= emit_at[s];
      o[emitted] = uint16_t(v);
      emitted += emit ? 1 : 0;
      v >>= uint32_t(emit) * TM_RANS_WORD_BITS;  // a shift, not a branch the predictor would miss
      const uint32_t f = f32[s], q = uint32_t(double(v) * inv[s] + 0x1p-14);
      x[l] = (q << TM_RANS_PROB_BITS) + (v - q * f) + cum[s];
    }
  }
  out.resize(emitted);
  std::reverse(out.begin(), out.end());
  for (uint32_t l = 0; l < TM_RANS_LANES; ++l) states[l] = x[l];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rans_encode_cpu(const at::Tensor& B_packed,
                                                                         int64_t channels_per_tile) {
  const int64_t K = B_packed.size(0) * 8, N = B_packed.size(1), C = channels_per_tile;
  const int64_t T = (N + C - 1) / C;
  const int32_t* B = B_packed.data_ptr<int32_t>();
  at::Tensor states = at::empty({T, int64_t(TM_RANS_LANES)}, B_packed.options().dtype(at::kInt));
  at::Tensor freqs = at::empty({T, int64_t(TM_RANS_SYMBOLS)}, B_packed.options().dtype(at::kShort));
  int32_t* st = states.data_ptr<int32_t>();
  int16_t* fr = freqs.data_ptr<int16_t>();
  std::vector<std::vector<uint16_t>> streams(static_cast<size_t>(T));
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> sym(size_t(std::min(C, N) * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * C, channels = std::min(C, N - n0);
      int64_t counts[TM_RANS_SYMBOLS] = {}, freq[TM_RANS_SYMBOLS];
      gather_tile_codes(B, K, N, n0, channels, sym.data(), counts);
      tile_frequencies(counts, freq);
      for (uint32_t s = 0; s < TM_RANS_SYMBOLS; ++s) fr[t * TM_RANS_SYMBOLS + s] = int16_t(freq[s]);
      encode_tile(sym.data(), channels * K, freq, streams[size_t(t)],
                  reinterpret_cast<uint32_t*>(st + t * TM_RANS_LANES));
    }
  });
  at::Tensor offsets = at::empty({T + 1}, B_packed.options().dtype(at::kInt));
  int32_t* off = offsets.data_ptr<int32_t>();
  int64_t total = 0;
  off[0] = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = int64_t(streams[size_t(t)].size());
    total += (len + TM_RANS_STREAM_ALIGN_WORDS - 1) / TM_RANS_STREAM_ALIGN_WORDS * TM_RANS_STREAM_ALIGN_WORDS;
    TORCH_CHECK_VALUE(total < (int64_t(1) << 31), "rans_encode: the coded layer needs more than 2^31 words; split it");
    off[t + 1] = int32_t(total);
  }
  at::Tensor words = at::zeros({total}, B_packed.options().dtype(at::kShort));
  uint16_t* w = reinterpret_cast<uint16_t*>(words.data_ptr<int16_t>());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::copy(streams[size_t(t)].begin(), streams[size_t(t)].end(), w + off[t]);
  });
  return {words, offsets, states, freqs};
}

namespace {

template <bool kAvx2>
void decode_to_packed(const RansCodes& codes, at::Tensor& B_packed, bool check) {
  const int64_t K = codes.K, N = codes.N, C = codes.channels_per_tile, T = codes.tiles;
  const int16_t* words = codes.words.data_ptr<int16_t>();
  const int32_t* offsets = codes.word_offsets.data_ptr<int32_t>();
  const int32_t* states = codes.states.data_ptr<int32_t>();
  const int16_t* freqs = codes.freqs.data_ptr<int16_t>();
  int32_t* B = B_packed.data_ptr<int32_t>();
  std::atomic<int64_t> first_bad{T};
  std::vector<uint8_t> overran(size_t(T), 0);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    auto dec = std::make_unique<RansTileDecoder>();
    alignas(32) uint8_t sym[TM_RANS_LANES];
    for (int64_t t = t0; t < t1; ++t) {
      dec->init(words, offsets, states, freqs, t);
      const int64_t n0 = t * C, channels = std::min(C, N - n0);
      for (int64_t c = 0; c < channels; ++c) {
        int32_t* col = B + n0 + c;
        for (int64_t j = 0; j < K / TM_RANS_LANES; ++j) {
          dec->template step_as<kAvx2>(sym);
          for (int i = 0; i < 4; ++i) {
            uint32_t w = 0;
            for (int r = 0; r < 8; ++r) w |= uint32_t(sym[8 * i + r]) << (4 * r);
            col[(4 * j + i) * N] = int32_t(w);
          }
        }
      }
      if (check && !dec->ended_cleanly()) {
        overran[size_t(t)] = dec->ptr > dec->len ? 1 : 0;
        int64_t seen = first_bad.load();
        while (t < seen && !first_bad.compare_exchange_weak(seen, t)) {
        }
      }
    }
  });
  const int64_t bad = first_bad.load();
  TORCH_CHECK_VALUE(bad >= T, "rans_decode: the rANS stream of tile ", bad, " is corrupted (",
                    bad < T && overran[size_t(bad)] ? "it reads past its end" : "it does not end in the initial state",
                    ")");
}

}  // namespace

void rans_decode_to_packed(const RansCodes& codes, at::Tensor& B_packed, bool check, bool avx2) {
  if (avx2) {
    decode_to_packed<true>(codes, B_packed, check);
  } else {
    decode_to_packed<false>(codes, B_packed, check);
  }
}

void CpuBackend::rans_decode(const RansPlan& plan, const RansCodes& codes, at::Tensor& B_packed) {
  rans_decode_to_packed(codes, B_packed, /*check=*/true, plan.cpu_avx2);
}

}  // namespace torch_marlin
