// CPU kernels of the trellis family: the fallback users get, so real kernels, not a reference.
//
// Every kernel works on column blocks whose start is a multiple of 16, so one block covers whole
// trellis tiles; one tile row (16 indices) is 2*bits contiguous bytes, read as one little-endian
// 64-bit load and split with constant shifts (the bit width is a template parameter).
//   Decode (<= 16 rows, the GEMM and the MoE's small experts): csrc/cpu/trellis_decode.cpp.
//   blas_rows (the dequant_blas family, > 16 rows): column chunks (<= k_chunk * 128 floats) of the full w
//     (grid*scale*su*sv) are decoded once by all threads, then one BLAS call multiplies every row
//     against the chunk; the dense weight never exists beyond one chunk.
//   MoE: x rows are gathered in expert order once; stage 1 computes silu(gate)*up, stage 2 the
//     down projection (the decode kernel per (expert, column block) for experts with <= 16 rows, the
//     BLAS path per expert above) — so each expert's weights are decoded once per call — and
//     stage 3 sums the top_k rows per token in slot order (deterministic, no atomics).
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/panel_buffer.h"
#include "cpu/trellis_cpu.h"

namespace torch_marlin {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "tile rows are read as little-endian 64-bit words");

constexpr int64_t kMaxDecodeRows = kDecodeMaxM;  // 16
constexpr int64_t kMaxDecodeCols = 64;

#if defined(__AVX2__)
// The codebook in registers: levels 0-7 and 8-15 (4-bit) as two 8-lane vectors, looked up with a
// lane permute, so decoding 8 indices costs a shift, a mask and one or two permutes.
struct GridRegs {
  __m256 lo, hi;
};

template <int BITS>
inline GridRegs load_grid(const float* grid) {
  float tmp[16] = {};
  for (int i = 0; i < (1 << BITS); ++i) tmp[i] = grid[i];
  return GridRegs{_mm256_loadu_ps(tmp), _mm256_loadu_ps(tmp + 8)};
}

// 8 values from 8 consecutive BITS-bit indices in the low 8*BITS bits of `word`.
template <int BITS>
inline __m256 lookup8(uint32_t word, const GridRegs& g) {
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts),
                                       _mm256_set1_epi32((1 << BITS) - 1));
  const __m256 lo = _mm256_permutevar8x32_ps(g.lo, idx);
  if (BITS < 4) return lo;
  // Bit 3 of the index selects the upper half: move it to the sign bit for blendv.
  return _mm256_blendv_ps(lo, _mm256_permutevar8x32_ps(g.hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
#else
struct GridRegs {};
template <int BITS>
inline GridRegs load_grid(const float*) { return GridRegs{}; }
#endif

// The 2*BITS bytes of one tile row as a little-endian integer. Fixed-size loads only: a 6-byte
// memcpy (3-bit) measured ~5x slower than two loads of 4 + 2 bytes.
template <int BITS>
inline uint64_t load_row_bits(const uint8_t* row) {
  if (BITS == 2) {
    uint32_t v;
    std::memcpy(&v, row, 4);
    return v;
  } else if (BITS == 3) {
    uint32_t lo;
    uint16_t hi;
    std::memcpy(&lo, row, 4);
    std::memcpy(&hi, row + 4, 2);
    return uint64_t(lo) | (uint64_t(hi) << 32);
  } else {
    uint64_t v;
    std::memcpy(&v, row, 8);
    return v;
  }
}

// vals[n] = grid[idx[k, n0 + n]] for n < nb, k = tk * 16 + r; n0 is a multiple of 16.
template <int BITS>
inline void decode_tile_row(const TView& w, const GridRegs& g, int64_t tk, int64_t r, int64_t n0, int64_t nb,
                            float* __restrict vals) {
  constexpr int64_t kRowBytes = 2 * BITS;
  constexpr uint64_t kMask = (uint64_t(1) << BITS) - 1;
  const uint8_t* row = w.packed + (tk * w.tiles_n + n0 / 16) * w.packed_bytes + r * kRowBytes;
  for (int64_t t = 0; t * 16 < nb; ++t, row += w.packed_bytes) {
    const uint64_t bits = load_row_bits<BITS>(row);
    float* out = vals + t * 16;
    if (nb - t * 16 >= 16) {
#if defined(__AVX2__)
      _mm256_storeu_ps(out, lookup8<BITS>(uint32_t(bits), g));
      _mm256_storeu_ps(out + 8, lookup8<BITS>(uint32_t(bits >> (8 * BITS)), g));
#else
      for (int j = 0; j < 16; ++j) out[j] = w.grid[(bits >> (j * BITS)) & kMask];
#endif
    } else {
      for (int64_t j = 0; j < nb - t * 16; ++j) out[j] = w.grid[(bits >> (j * BITS)) & kMask];
    }
  }
}

// P[k - k0, n] (row stride ldp) = w[k, n0 + n] (fully dequantized) for k in [k0, k0 + kc).
template <int BITS>
void dequant_rows(const TView& w, int64_t k0, int64_t kc, int64_t n0, int64_t nb, float* __restrict P, int64_t ldp) {
  const float* __restrict sv = w.sv + n0;
  const GridRegs gr = load_grid<BITS>(w.grid);
  for (int64_t k = k0; k < k0 + kc; ++k) {
    float* __restrict row = P + (k - k0) * ldp;
    decode_tile_row<BITS>(w, gr, k / 16, k % 16, n0, nb, row);
    const float* __restrict s = w.scales + (k / w.group_size) * w.N + n0;
    const float su = w.su[k];
    for (int64_t n = 0; n < nb; ++n) row[n] *= s[n] * su * sv[n];
  }
}

// out[m, n] (row stride ldo) = sum_k X[m, k] * w[k, n] for all n < w.N, any number of rows.
// Column chunks of at most kc * 128 fp32 (the planner's k_chunk) are dequantized by all threads,
// then multiplied by one BLAS call from the calling thread (BLAS parallelizes it). Calling BLAS
// per tile from inside parallel_for oversubscribed the cores (measured 25x slower under load).
// Must not be called from inside a parallel region.
template <int BITS>
void blas_rows(const TView& w, const float* X, int64_t ldx, int64_t rows, float* out, int64_t ldo, int64_t kc) {
  const int64_t chunk_floats = kc * 128;
  const int64_t max_cols = std::max<int64_t>(16, chunk_floats / w.K / 16 * 16);
  const int64_t cols = std::min(max_cols, w.N);
  float* panel = panel_buffer(size_t(w.K * cols));
  const at::Tensor Xt = at::from_blob(const_cast<float*>(X), {rows, w.K}, {ldx, 1}, at::kFloat);
  for (int64_t c0 = 0; c0 < w.N; c0 += max_cols) {
    const int64_t cw = std::min(max_cols, w.N - c0);
    at::parallel_for(0, (cw + kMaxDecodeCols - 1) / kMaxDecodeCols, 1, [&](int64_t b0, int64_t b1) {
      const int64_t lo = b0 * kMaxDecodeCols, hi = std::min(b1 * kMaxDecodeCols, cw);
      dequant_rows<BITS>(w, 0, w.K, c0 + lo, hi - lo, panel + lo, cw);
    });
    const at::Tensor P = at::from_blob(panel, {w.K, cw}, at::kFloat);
    at::Tensor out_cols = at::from_blob(out + c0, {rows, cw}, {ldo, 1}, at::kFloat);
    if (ldo == cw) {
      at::mm_out(out_cols, Xt, P);
    } else {
      out_cols.copy_(at::mm(Xt, P));
    }
  }
}

template <int BITS>
void gemm_impl(const TrellisPlan& plan, const TrellisGemmArgs& a, at::Tensor& C) {
  const bool direct = C.scalar_type() == at::kFloat;
  at::Tensor Cf = direct ? C : at::empty({a.M, a.N}, C.options().dtype(at::kFloat));
  float* Cp = Cf.data_ptr<float>();
  switch (plan.family) {
    case KernelFamily::Decode: trellis_decode_gemm(plan, a, Cp); break;
    case KernelFamily::DequantBlas: {
      const at::Tensor Af = a.A.to(at::kFloat).contiguous();
      const TView w = make_view(a.w, a.K, a.N, a.bits, a.group_size, 0);
      blas_rows<BITS>(w, Af.data_ptr<float>(), a.K, a.M, Cp, a.N, plan.k_chunk);
      break;
    }
    default: TORCH_CHECK(false, "torch_marlin: no CPU trellis kernels of the '", family_name(plan.family), "' family");
  }
  if (!direct) C.copy_(Cf);
}

template <int BITS>
void dequant_impl(const TrellisGemmArgs& a, at::Tensor& W) {
  const TView w = make_view(a.w, a.K, a.N, a.bits, a.group_size, 0);
  float* Wp = W.data_ptr<float>();
  at::parallel_for(0, w.tiles_k, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tk = t0; tk < t1; ++tk) {
      const int64_t k0 = tk * 16;
      dequant_rows<BITS>(w, k0, std::min<int64_t>(16, a.K - k0), 0, a.N, Wp + k0 * a.N, a.N);
    }
  });
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

template <int BITS>
void moe_impl(const TrellisPlan& plan, const TrellisMoeArgs& a, at::Tensor& y) {
  const int64_t H = a.hidden, I = a.intermediate, R = a.T * a.top_k;
  const int64_t kc = plan.k_chunk;
  const at::Tensor Xs = a.x.to(at::kFloat).index_select(0, a.sorted_token.to(at::kLong)).contiguous();  // [R, H]
  at::Tensor rows_h = at::empty({R, I}, Xs.options());
  at::Tensor rows_y = at::empty({R, H}, Xs.options());
  const int32_t* off = a.expert_offsets.data_ptr<int32_t>();
  const float* X = Xs.data_ptr<float>();
  float* Hp = rows_h.data_ptr<float>();
  float* Yp = rows_y.data_ptr<float>();

  // Experts with at most 16 routed rows take the decode path, threaded over (expert, column
  // block); experts with more rows take the BLAS path one expert at a time (BLAS threads it).
  std::vector<int64_t> big;
  for (int64_t e = 0; e < a.E; ++e)
    if (off[e + 1] - off[e] > kMaxDecodeRows) big.push_back(e);

  // Stage 1: h = silu(x @ gate_e) * (x @ up_e) for the rows routed to expert e. The decode
  // kernels take x * su per matrix (trellis_decode_activations), formed once per small expert.
  std::vector<at::Tensor> xg(a.E), xu(a.E), xd(a.E);
  for (int64_t e = 0; e < a.E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0 || rows > kMaxDecodeRows) continue;
    const at::Tensor xe = Xs.narrow(0, off[e], rows);
    xg[e] = trellis_decode_activations(xe, a.gate.su[e], H);
    xu[e] = trellis_decode_activations(xe, a.up.su[e], H);
  }
  const DecodeKernel kernel = decode_kernel(plan);
  const int64_t nb1 = plan.params.tile_n, blocks1 = plan.launches.at(LaunchRole::Main).grid[0];
  TORCH_CHECK(nb1 <= kMaxDecodeCols && nb1 % 16 == 0, "trellis_moe_cpu: plan tile_n ", nb1,
              " is not a multiple of 16 up to ", kMaxDecodeCols);
  at::parallel_for(0, a.E * blocks1, 1, [&](int64_t i0, int64_t i1) {
    float g[kMaxDecodeRows * kMaxDecodeCols], u[kMaxDecodeRows * kMaxDecodeCols];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / blocks1, n0 = (i % blocks1) * nb1;
      const int64_t r0 = off[e], rows = off[e + 1] - off[e];
      if (rows == 0 || rows > kMaxDecodeRows) continue;
      const TView wg = make_view(a.gate, H, I, a.bits, a.group_size, e);
      const TView wu = make_view(a.up, H, I, a.bits, a.group_size, e);
      const int64_t n1 = std::min(n0 + nb1, I), nb = n1 - n0;
      trellis_decode_columns(kernel, a.bits, wg, xg[e].data_ptr<float>(), xg[e].size(1), rows, n0, n1, g, nb);
      trellis_decode_columns(kernel, a.bits, wu, xu[e].data_ptr<float>(), xu[e].size(1), rows, n0, n1, u, nb);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < nb; ++n) Hp[(r0 + r) * I + n0 + n] = silu(g[r * nb + n]) * u[r * nb + n];
    }
  });
  for (int64_t e : big) {
    const int64_t r0 = off[e], rows = off[e + 1] - off[e];
    at::Tensor U = at::empty({rows, I}, Xs.options());
    blas_rows<BITS>(make_view(a.gate, H, I, a.bits, a.group_size, e), X + r0 * H, H, rows, Hp + r0 * I, I, kc);
    blas_rows<BITS>(make_view(a.up, H, I, a.bits, a.group_size, e), X + r0 * H, H, rows, U.data_ptr<float>(), I, kc);
    const float* Up = U.data_ptr<float>();
    at::parallel_for(0, rows * I, 4096, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) Hp[r0 * I + j] = silu(Hp[r0 * I + j]) * Up[j];
    });
  }

  // Stage 2: y_rows = h @ down_e.
  for (int64_t e = 0; e < a.E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0 || rows > kMaxDecodeRows) continue;
    xd[e] = trellis_decode_activations(rows_h.narrow(0, off[e], rows), a.down.su[e], I);
  }
  const int64_t nb2 = nb1, blocks2 = plan.launches.at(LaunchRole::Down).grid[0];
  at::parallel_for(0, a.E * blocks2, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / blocks2, n0 = (i % blocks2) * nb2;
      const int64_t r0 = off[e], rows = off[e + 1] - off[e];
      if (rows == 0 || rows > kMaxDecodeRows) continue;
      const TView wd = make_view(a.down, I, H, a.bits, a.group_size, e);
      trellis_decode_columns(kernel, a.bits, wd, xd[e].data_ptr<float>(), xd[e].size(1), rows, n0,
                             std::min(n0 + nb2, H), Yp + r0 * H + n0, H);
    }
  });
  for (int64_t e : big) {
    const int64_t r0 = off[e], rows = off[e + 1] - off[e];
    blas_rows<BITS>(make_view(a.down, I, H, a.bits, a.group_size, e), Hp + r0 * I, I, rows, Yp + r0 * H, H, kc);
  }

  // Stage 3: y[t] = sum_j p[t, j] * y_rows[slot_row[t, j]], in slot order.
  const bool direct = y.scalar_type() == at::kFloat;
  at::Tensor yf = direct ? y : at::empty({a.T, H}, y.options().dtype(at::kFloat));
  float* out = yf.data_ptr<float>();
  const int32_t* slot_row = a.slot_row.data_ptr<int32_t>();
  const float* probs = a.probs.data_ptr<float>();
  at::parallel_for(0, a.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t j = 0; j < a.top_k; ++j) {
        const float p = probs[t * a.top_k + j];
        const float* src = Yp + int64_t(slot_row[t * a.top_k + j]) * H;
        for (int64_t n = 0; n < H; ++n) o[n] += p * src[n];
      }
    }
  });
  if (!direct) y.copy_(yf);
}

}  // namespace

void CpuBackend::trellis_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, at::Tensor& C) {
  switch (args.bits) {
    case 2: gemm_impl<2>(plan, args, C); break;
    case 3: gemm_impl<3>(plan, args, C); break;
    default: gemm_impl<4>(plan, args, C); break;
  }
}

void CpuBackend::trellis_dequant(const TrellisPlan&, const TrellisGemmArgs& args, at::Tensor& W) {
  switch (args.bits) {
    case 2: dequant_impl<2>(args, W); break;
    case 3: dequant_impl<3>(args, W); break;
    default: dequant_impl<4>(args, W); break;
  }
}

void CpuBackend::trellis_moe(const TrellisPlan& plan, const TrellisMoeArgs& args, at::Tensor& y) {
  switch (args.bits) {
    case 2: moe_impl<2>(plan, args, y); break;
    case 3: moe_impl<3>(plan, args, y); break;
    default: moe_impl<4>(plan, args, y); break;
  }
}

}  // namespace torch_marlin
