// rANS op family: argument checks and plan (prepare_rans_encode, prepare_rans_decode,
// prepare_rans_gemm). Schemas: csrc/ops/library.cpp; each backend binds the ops in its binding unit.
//
//   rans_encode(B_packed, channels_per_tile) -> (words, word_offsets, states, freqs)      CPU only
//   rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile) -> B_packed
//   gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N,
//             group_size, channels_per_tile, bias=None) -> C [M, N]
//
// Format: docs/formats.md ("rANS-coded 4-bit codes"); channels_per_tile <= 0 means the default
// ceil(32 * 1024 / K). Fake kernels live in torch_marlin/ops.py.
#include <ATen/ATen.h>

#include <string>

#include "ops/plan_or_value_error.h"
#include "ops/rans.h"
#include "ops/vector_aligned.h"
#include "plan/plan_cache.h"

namespace torch_marlin {
namespace {

void check_device(const at::Tensor& t, const at::Device& dev, const char* op, const char* name, const char* ref) {
  TORCH_CHECK_VALUE(t.device() == dev, op, ": ", name, " is on ", t.device(), " but ", ref, " is on ", dev,
                    "; all tensors must be on one device");
}

void check_tensor(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* op, const char* name,
                  const char* what) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must have shape ", shape, " (", what, "), got ", t.sizes());
}

void check_k_n(int64_t K, int64_t N, const char* op) {
  TORCH_CHECK_VALUE(K > 0 && K % TM_RANS_LANES == 0 && K < (int64_t(1) << 30), op,
                    ": K must be a positive multiple of 32 below 2^30 (32 lanes decode 32 rows a step), got ", K);
  TORCH_CHECK_VALUE(N > 0 && N < (int64_t(1) << 30), op, ": N must be positive and below 2^30, got ", N);
}

int64_t resolve_channels(int64_t channels_per_tile, int64_t K, const char* op) {
  TORCH_CHECK_VALUE(channels_per_tile < (int64_t(1) << 30), op, ": channels_per_tile must be below 2^30, got ",
                    channels_per_tile);
  return channels_per_tile > 0 ? channels_per_tile : rans_default_channels_per_tile(K);
}

// The tables' values (cheap on the host; a GPU backend would need a sync, so there only shapes).
void check_tables_cpu(const RansCodes& c, const char* op) {
  const int32_t* off = c.word_offsets.data_ptr<int32_t>();
  const int64_t W = c.words.size(0);
  TORCH_CHECK_VALUE(off[0] == 0, op, ": word_offsets[0] must be 0, got ", off[0]);
  for (int64_t t = 0; t < c.tiles; ++t) {
    TORCH_CHECK_VALUE(off[t + 1] >= off[t] && off[t + 1] % int64_t(TM_RANS_STREAM_ALIGN_WORDS) == 0, op,
                      ": word_offsets must be non-decreasing multiples of 8; word_offsets[", t + 1, "] = ", off[t + 1],
                      " after ", off[t]);
  }
  TORCH_CHECK_VALUE(off[c.tiles] == W, op, ": word_offsets[-1] must equal len(words) = ", W, ", got ", off[c.tiles]);
  const int16_t* f = c.freqs.data_ptr<int16_t>();
  const int32_t* st = c.states.data_ptr<int32_t>();
  for (int64_t t = 0; t < c.tiles; ++t) {
    int64_t sum = 0;
    bool negative = false;
    for (uint32_t s = 0; s < TM_RANS_SYMBOLS; ++s) {
      sum += f[t * TM_RANS_SYMBOLS + s];
      negative = negative || f[t * TM_RANS_SYMBOLS + s] < 0;
    }
    TORCH_CHECK_VALUE(!negative && sum == int64_t(TM_RANS_PROB_SCALE), op, ": freqs of tile ", t,
                      " must be non-negative and sum to 4096, got a sum of ", sum);
    for (uint32_t l = 0; l < TM_RANS_LANES; ++l) {
      TORCH_CHECK_VALUE(uint32_t(st[t * TM_RANS_LANES + l]) >= TM_RANS_STATE_LOW, op, ": states of tile ", t,
                        " must be at least 65536 (read as unsigned 32-bit), got ", uint32_t(st[t * TM_RANS_LANES + l]),
                        " in lane ", l);
    }
  }
}

RansCodes check_codes(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                      const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile, const at::Device& dev,
                      const char* ref, const char* op) {
  check_k_n(K, N, op);
  RansCodes c;
  c.K = K;
  c.N = N;
  c.channels_per_tile = resolve_channels(channels_per_tile, K, op);
  c.tiles = (N + c.channels_per_tile - 1) / c.channels_per_tile;
  TORCH_CHECK_TYPE(words.scalar_type() == at::kShort, op, ": words must be int16 (16-bit words), got ",
                   words.scalar_type());
  TORCH_CHECK_VALUE(words.dim() == 1 && words.size(0) < (int64_t(1) << 31), op,
                    ": words must be 1-D with fewer than 2^31 words, got shape ", words.sizes());
  check_tensor(word_offsets, at::kInt, {c.tiles + 1}, op, "word_offsets", "[T + 1], T = ceil(N / channels_per_tile)");
  check_tensor(states, at::kInt, {c.tiles, int64_t(TM_RANS_LANES)}, op, "states", "[T, 32]");
  check_tensor(freqs, at::kShort, {c.tiles, int64_t(TM_RANS_SYMBOLS)}, op, "freqs", "[T, 16]");
  check_device(words, dev, op, "words", ref);
  check_device(word_offsets, dev, op, "word_offsets", ref);
  check_device(states, dev, op, "states", ref);
  check_device(freqs, dev, op, "freqs", ref);
  c.words = contiguous_aligned(words);
  c.word_offsets = word_offsets.contiguous();
  c.states = states.contiguous();
  c.freqs = freqs.contiguous();
  if (dev.is_cpu()) check_tables_cpu(c, op);
  return c;
}

}  // namespace

at::Tensor prepare_rans_encode(const at::Tensor& B, int64_t& channels_per_tile) {
  const char* op = "rans_encode";
  TORCH_CHECK_VALUE(B.device().is_cpu(), op, ": B_packed must be on the CPU (the encoder runs on the host), got ",
                    B.device());
  TORCH_CHECK_TYPE(B.scalar_type() == at::kInt, op, ": B_packed must be int32 (8 four-bit codes per word), got ",
                   B.scalar_type());
  TORCH_CHECK_VALUE(B.dim() == 2, op, ": B_packed must be 2-D [K/8, N], got ", B.dim(), "-D");
  check_k_n(B.size(0) * 8, B.size(1), op);
  channels_per_tile = resolve_channels(channels_per_tile, B.size(0) * 8, op);
  return B.contiguous();
}

RansDecodeCall prepare_rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                                   const at::Tensor& freqs, int64_t K, int64_t N, int64_t channels_per_tile,
                                   const DeviceCaps& caps) {
  const char* op = "rans_decode";
  RansDecodeCall c;
  c.args = check_codes(words, word_offsets, states, freqs, K, N, channels_per_tile, words.device(), "words", op);
  c.plan = std::make_shared<const RansPlan>(
      plan_or_value_error([&] { return plan_rans_decode(K, N, c.args.channels_per_tile, caps); }));
  c.out = at::empty({K / 8, N}, words.options().dtype(at::kInt));
  return c;
}

RansGemmCall prepare_rans_gemm(const at::Tensor& A, const RansCodeTensors& codes, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& offsets,
                               c10::string_view format, int64_t K, int64_t N, int64_t group_size,
                               int64_t channels_per_tile, const c10::optional<at::Tensor>& bias,
                               const DeviceCaps& caps) {
  const char* op = "gemm_rans";
  RansGemmCall c;
  RansGemmArgs& a = c.args;
  const std::string fmt(format.data(), format.size());
  TORCH_CHECK_VALUE(fmt == "fp4" || fmt == "u4" || fmt == "affine", op, ": format must be one of {fp4, u4, affine}, got '",
                    fmt, "'");
  a.format = fmt == "fp4" ? QuantFormat::FP4 : fmt == "u4" ? QuantFormat::U4 : QuantFormat::Affine;
  const auto s = A.scalar_type();
  TORCH_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op,
                   ": A must be float16, bfloat16 or float32, got ", s);
  TORCH_CHECK_VALUE(A.dim() == 2, op, ": A must be 2-D [M, K] (the module flattens leading dims), got ", A.dim(), "-D");
  check_k_n(K, N, op);
  TORCH_CHECK_VALUE(A.size(1) == K, op, ": A must have K = ", K, " columns, got shape ", A.sizes());
  TORCH_CHECK_VALUE(group_size > 0 && group_size % TM_RANS_LANES == 0 && K % group_size == 0, op,
                    ": group_size must be a positive multiple of 32 dividing K = ", K, " (a decode step never ",
                    "straddles two groups), got ", group_size);
  const at::Device dev = A.device();
  a.codes = check_codes(codes.words, codes.word_offsets, codes.states, codes.freqs, K, N, channels_per_tile, dev,
                        "A", op);
  const int64_t G = K / group_size;
  check_tensor(scales, s, {G, N}, op, "scales", "[K/group_size, N], A's dtype");
  check_device(scales, dev, op, "scales", "A");
  TORCH_CHECK_VALUE(zeros.has_value() == (a.format == QuantFormat::U4), op, ": zeros is ",
                    a.format == QuantFormat::U4 ? "required for format 'u4'" : "only for format 'u4'");
  TORCH_CHECK_VALUE(offsets.has_value() == (a.format == QuantFormat::Affine), op, ": offsets is ",
                    a.format == QuantFormat::Affine ? "required for format 'affine'" : "only for format 'affine'");
  if (zeros.has_value()) {
    check_tensor(*zeros, at::kByte, {G, N}, op, "zeros", "[K/group_size, N], uint8 values 0..15");
    check_device(*zeros, dev, op, "zeros", "A");
    a.zeros = zeros->contiguous();
  }
  if (offsets.has_value()) {
    check_tensor(*offsets, s, {G, N}, op, "offsets", "[K/group_size, N], A's dtype");
    check_device(*offsets, dev, op, "offsets", "A");
    a.offsets = contiguous_aligned(*offsets);
  }
  if (bias.has_value()) {
    check_tensor(*bias, s, {N}, op, "bias", "[N], A's dtype");
    check_device(*bias, dev, op, "bias", "A");
    a.bias = bias->contiguous();
  }
  a.M = A.size(0);
  a.K = K;
  a.N = N;
  a.group_size = group_size;
  a.dtype = to_dtype(s);
  a.A = contiguous_aligned(A);
  a.scales = contiguous_aligned(scales);
  c.out = at::empty({a.M, N}, A.options());
  c.empty = a.M == 0;
  if (c.empty) return c;
  c.plan = plan_or_value_error([&] {
    return cached_plan_rans_gemm(a.M, K, N, group_size, a.codes.channels_per_tile, a.format, a.dtype,
                                 a.bias.defined(), caps);
  });
  return c;
}

}  // namespace torch_marlin
