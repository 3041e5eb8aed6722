// rANS-coded 4-bit codes on CUDA (docs/formats.md "rANS-coded 4-bit codes", docs/cuda.md "rANS"):
// the fused decode GEMV (gemm_rans, M <= TM_CUDA_RANS_MAX_M) and the stream decode to B_packed
// (rans_decode, the first half of the staged path for larger M).
//
// One warp decodes one tile: its 32 lanes are the format's 32 interleaved rANS lanes. The decode
// chain of a step is serial (state -> slot -> symbol -> state -> renormalizing word -> state), so
// the kernels keep everything on it in shared memory and registers:
//  - a per-warp symbol table, one byte per slot (4096 bytes), and a 16-entry symbol table holding
//    freq, cum and the code's value (one 16-byte load), both built at tile start;
//  - a per-warp ring of the tile's words, filled 128 words at a time with 16-byte cp.async copies
//    two segments ahead of use, so no step waits on global memory;
//  - the lanes that need a word take it from the ring by ballot + popcount.
// Everything off the chain (activations, scales, the multiply-adds) overlaps it. Kernels never read
// outside the words tensor, even for corrupted tables: stream bounds, offsets and frequencies are
// clamped, so a corrupted stream gives wrong numbers, never an out-of-bounds access.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "ops/rans.h"
#include "torch_marlin/rans_params.h"

namespace torch_marlin {
namespace {

constexpr u32 kWarps = TM_CUDA_RANS_WARPS;
constexpr u32 kThreads = kWarps * 32u;
constexpr u32 kRingWords = 512u;  // per warp: 4 segments
constexpr u32 kSegWords = 128u;   // one refill: 16 lanes x 16 bytes
static_assert(kSegWords == 16u * 8u, "a segment is 16 lanes' 16-byte copies");
static_assert(TM_RANS_LANES == 32u && TM_RANS_SYMBOLS == 16u, "one warp per tile, 4-bit symbols");

struct __align__(16) WarpSmem {
  uint8_t sym[TM_RANS_PROB_SCALE];  // slot -> symbol
  uint4 info[TM_RANS_SYMBOLS];      // symbol -> (freq, cum, value bits, 0)
  uint16_t ring[kRingWords];        // the tile's words at (tile-relative index) % kRingWords
};
constexpr int kSmemBytes = int(sizeof(WarpSmem) * kWarps);

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One tile's decoder, held by one warp. The ring invariant between steps: the tile-relative words
// [base, base + 256) are in shared memory, [base + 256, base + 512) are in flight (two cp.async
// groups), and ptr < base + 128 + 32.
template <u32 FMT>
struct TileDecoder {
  WarpSmem& sm;
  const uint16_t* stream;  // the tile's first word
  u32 len;                 // words in the tile's stream (a multiple of 8 after clamping)
  u32 base, ptr, x, lane, lt_mask;
  u32 sym_a, info_a, ring_a;  // shared-window addresses of the tables and the ring

  __device__ __forceinline__ TileDecoder(WarpSmem& s, u32 tile, const RansParams& p, const uint16_t* words, u32 n_words,
                         const int* word_offsets, const u32* states, const int16_t* freqs)
      : sm(s), base(0), ptr(0) {
    lane = threadIdx.x & 31u;
    lt_mask = (1u << lane) - 1u;
    sym_a = smem_u32(sm.sym);
    info_a = smem_u32(sm.info);
    ring_a = smem_u32(sm.ring);
    // Offsets are clamped into the words tensor and down to the 16-byte alignment the format
    // guarantees, so corrupted offsets cannot send a copy out of bounds.
    const u32 w_end = n_words & ~(TM_RANS_STREAM_ALIGN_WORDS - 1u);
    const u32 o0 = min(u32(max(word_offsets[tile], 0)), w_end) & ~(TM_RANS_STREAM_ALIGN_WORDS - 1u);
    const u32 o1 = min(u32(max(word_offsets[tile + 1], 0)), w_end) & ~(TM_RANS_STREAM_ALIGN_WORDS - 1u);
    stream = words + o0;
    len = o1 > o0 ? o1 - o0 : 0u;
    fetch(0u);
    fetch(kSegWords);
    commit();
    fetch(2u * kSegWords);
    commit();
    fetch(3u * kSegWords);
    commit();
    build_tables(freqs + size_t(tile) * TM_RANS_SYMBOLS);
    x = states[size_t(tile) * 32u + lane];
    cp_async_wait<2>();
    __syncwarp();
  }

  __device__ __forceinline__ void commit() { cp_async_commit(); }

  // Copies the segment of tile-relative words [w0, w0 + 128) into the ring; zeros past the stream.
  __device__ __forceinline__ void fetch(u32 w0) {
    if (lane < 16u) {
      const u32 w = w0 + 8u * lane;
      const bool ok = w < len;  // len % 8 == 0: a 16-byte chunk is wholly inside or outside
      cp_async16(smem_u32(&sm.ring[w % kRingWords]), ok ? stream + w : stream, ok ? 16u : 0u);
    }
  }

  // Slot -> symbol bytes and the symbol entries. Frequencies are read as unsigned 16-bit values and
  // each symbol's slot range is clamped to the table, so any table leaves every slot a symbol in
  // 0..15: the ranges of frequencies summing to 4096 cover it exactly; otherwise it is zeroed
  // first, and slots a corrupted table leaves uncovered decode as symbol 0.
  __device__ void build_tables(const int16_t* f16) {
    u32* sym_words = reinterpret_cast<u32*>(sm.sym);
    const u32 f = lane < 16u ? u32(uint16_t(f16[lane])) : 0u;
    u32 incl = f;  // inclusive prefix sum over lanes 0..15
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= u32(o)) incl += v;
    }
    if (__shfl_sync(0xffffffffu, incl, 15) != TM_RANS_PROB_SCALE) {  // warp-uniform
      for (u32 i = lane; i < TM_RANS_PROB_SCALE / 4u; i += 32u) sym_words[i] = 0u;
    }
    const u32 cum = incl - f;
    if (lane < 16u) {
      float value;
      if constexpr (FMT == TM_FORMAT_FP4) value = fp4_e2m1_to_float(lane);
      else value = float(lane);
      sm.info[lane] = make_uint4(f, cum, __float_as_uint(value), 0u);
    }
    __syncwarp();
    for (u32 s = 0; s < 16u; ++s) {
      const u32 a = min(__shfl_sync(0xffffffffu, cum, s), TM_RANS_PROB_SCALE);
      const u32 b = min(__shfl_sync(0xffffffffu, incl, s), TM_RANS_PROB_SCALE);
      if (a >= b) continue;
      const u32 wa = (a + 3u) / 4u, wb = b / 4u;  // whole words [wa, wb)
      const u32 fill = s * 0x01010101u;
      for (u32 w = wa + lane; w < wb; w += 32u) sym_words[w] = fill;
      // The bytes of the partial words at either end.
      if (lane < 4u) {
        const u32 i = a + lane;
        if (i < min(b, 4u * wa)) sm.sym[i] = uint8_t(s);
      } else if (lane < 8u) {
        const u32 i = 4u * wb + (lane - 4u);
        if (i >= max(a, 4u * wa) && i < b) sm.sym[i] = uint8_t(s);
      }
    }
    __syncwarp();
  }

  // Keeps the ring invariant: once a whole segment is consumed, wait for the older group in flight
  // and reuse the consumed segment's slot for the words 512 further on.
  __device__ __forceinline__ void refill() {
    if (ptr >= base + kSegWords) {
      cp_async_wait<1>();
      __syncwarp();  // the segment's reads and the finished copies, warp-wide
      fetch(base + kRingWords);
      commit();
      base += kSegWords;
    }
  }

  // One decode step: returns the symbol entry's value bits (info.z) and stores the symbol.
  __device__ __forceinline__ u32 step(u32& sym) {
    refill();
    const u32 slot = x & TM_RANS_PROB_MASK;
    sym = lds_u8(sym_a + slot);
    const uint4 in = lds_v4(info_a + 16u * sym);
    x = in.x * (x >> TM_RANS_PROB_BITS) + slot - in.y;
    const bool need = x < TM_RANS_STATE_LOW;
    const u32 ballot = __ballot_sync(0xffffffffu, need);
    const u32 w = lds_u16(ring_a + 2u * ((ptr + __popc(ballot & lt_mask)) % kRingWords));
    if (need) x = (x << TM_RANS_WORD_BITS) | w;
    ptr += __popc(ballot);
    return in.z;
  }

  // Outstanding copies must land before the warp's shared memory is reused or the warp exits.
  __device__ __forceinline__ void finish() {
    cp_async_wait<0>();
    __syncwarp();
  }
};

// The scale (and zero point or offset) of group gi of column n, one group per lane, as floats.
template <typename T, u32 FMT>
struct GroupQ {
  float s, a;  // a: zero point (U4) or offset (affine)
};
template <typename T, u32 FMT>
__device__ __forceinline__ GroupQ<T, FMT> load_group(const RansParams& p, u32 gi, u32 n, const T* scales,
                                                     const uint8_t* zeros, const T* offsets) {
  GroupQ<T, FMT> q{0.f, 0.f};
  if (gi < p.n_groups) {
    const size_t o = size_t(gi) * p.N + n;
    q.s = to_float(scales[o]);
    if constexpr (FMT == TM_FORMAT_U4) q.a = float(zeros[o] & 0xFu);
    if constexpr (FMT == TM_FORMAT_AFFINE) q.a = to_float(offsets[o]);
  }
  return q;
}

// The weight of a code whose value (E2M1 value for fp4, the code for u4 / affine) is v: the same
// fp32 value as the reference dequant (exact products).
template <u32 FMT>
__device__ __forceinline__ float weight(float v, float s, float a) {
  if constexpr (FMT == TM_FORMAT_FP4) return v * s;
  else if constexpr (FMT == TM_FORMAT_AFFINE) return fmaf(v, s, a);
  else return (v - a) * s;
}

// ---------------------------------------------------------------------------------------------
// gemm_rans, fused: C[m, n] = sum_k A[m, k] w[k, n] (+ bias) for M <= MR rows, one tile per warp.
// Step j of channel c: lane l multiplies w[32 j + l, n] by A[m, 32 j + l] (coalesced row reads,
// loaded two steps ahead); fp32 sums per lane, a fixed-order warp reduction at each channel's end.
// Scales: lane l holds group q * 32 + l of the channel (one load per lane per 32 groups, the next
// batch loaded one batch ahead); each group broadcasts its own by shuffle.
// ---------------------------------------------------------------------------------------------
// Resident blocks per SM the register budget must allow (shared memory allows 10): ptxas otherwise
// squeezes the small kernels into 32 registers and spills.
constexpr int gemm_min_blocks(int rows) { return rows <= 4 ? 8 : 4; }

template <typename T, u32 FMT, int MR>
__global__ void __launch_bounds__(kThreads, gemm_min_blocks(MR))
    gemm_rans_kernel(RansParams p, const T* __restrict__ A, const uint16_t* __restrict__ words, u32 n_words,
                     const int* __restrict__ word_offsets, const u32* __restrict__ states,
                     const int16_t* __restrict__ freqs, const T* __restrict__ scales, const uint8_t* __restrict__ zeros,
                     const T* __restrict__ offsets, const T* __restrict__ bias, T* __restrict__ C) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 warp = threadIdx.x >> 5;
  const u32 tile = blockIdx.x * kWarps + warp;
  if (tile >= p.tiles) return;  // warps are independent: no block-wide barrier below
  WarpSmem& sm = reinterpret_cast<WarpSmem*>(smem)[warp];
  TileDecoder<FMT> dec(sm, tile, p, words, n_words, word_offsets, states, freqs);
  const u32 lane = dec.lane;
  const u32 n0 = tile * p.channels_per_tile;
  const u32 channels = min(p.channels_per_tile, p.N - n0);
  const u32 spg = p.group_size / 32u;  // steps per group
  const u32 batches = (p.n_groups + 31u) / 32u;

  const T* arow[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) arow[m] = A + size_t(min(u32(m), p.M - 1u)) * p.K + lane;
  // Activations two steps ahead, kept raw (converted at use, so no instruction waits on a load
  // issued less than two steps earlier); k2 is the k offset of step i + 2, wrapping to the next
  // channel's first steps.
  T x0[MR], x1[MR];
  const u32 k1 = 32u % p.K;
  u32 k2 = 64u % p.K;
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    x0[m] = arow[m][0];
    x1[m] = arow[m][k1];
  }

  // Group batches in (channel, batch) order: the current one and the next.
  GroupQ<T, FMT> qcur = load_group<T, FMT>(p, lane, n0, scales, zeros, offsets);
  u32 nc = batches > 1u ? 0u : 1u, nq = batches > 1u ? 1u : 0u;  // the next batch's (channel, batch)
  GroupQ<T, FMT> qnext = nc < channels ? load_group<T, FMT>(p, nq * 32u + lane, n0 + nc, scales, zeros, offsets) : qcur;

  for (u32 c = 0; c < channels; ++c) {
    float acc[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[m] = 0.f;
    for (u32 g = 0; g < p.n_groups; ++g) {
      if (g % 32u == 0u && (c | g) != 0u) {  // warp-uniform: the next batch of groups
        qcur = qnext;
        if (++nq == batches) nq = 0u, ++nc;
        if (nc < channels) qnext = load_group<T, FMT>(p, nq * 32u + lane, n0 + nc, scales, zeros, offsets);
      }
      const float s = __shfl_sync(0xffffffffu, qcur.s, g % 32u);
      const float a = FMT == TM_FORMAT_FP4 ? 0.f : __shfl_sync(0xffffffffu, qcur.a, g % 32u);
      for (u32 e = 0; e < spg; ++e) {
        T x2[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) x2[m] = arow[m][k2];
        k2 = k2 + 32u < p.K ? k2 + 32u : k2 + 32u - p.K;
        u32 sym;
        const float w = weight<FMT>(__uint_as_float(dec.step(sym)), s, a);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          acc[m] = fmaf(w, to_float(x0[m]), acc[m]);
          x0[m] = x1[m];
          x1[m] = x2[m];
        }
      }
    }
    const u32 n = n0 + c;
    const float b = p.has_bias ? to_float(bias[n]) : 0.f;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const float sum = warp_sum(acc[m]);
      if (lane == 0u && u32(m) < p.M) C[size_t(m) * p.N + n] = from_float<T>(sum + b);
    }
  }
  dec.finish();
}

// ---------------------------------------------------------------------------------------------
// rans_decode: the codes to B_packed int32 [K/8, N] (8 codes along k per word, code k % 8 in bits
// 4 (k % 8)). Lanes 8 r .. 8 r + 7 of step j hold the codes of word 4 j + r of the channel's
// column; three xor-shuffles OR them together and the group's first lane stores the word.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 8)
    rans_decode_kernel(RansParams p, const uint16_t* __restrict__ words, u32 n_words,
                       const int* __restrict__ word_offsets, const u32* __restrict__ states,
                       const int16_t* __restrict__ freqs, u32* __restrict__ B) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 warp = threadIdx.x >> 5;
  const u32 tile = blockIdx.x * kWarps + warp;
  if (tile >= p.tiles) return;
  WarpSmem& sm = reinterpret_cast<WarpSmem*>(smem)[warp];
  TileDecoder<TM_FORMAT_U4> dec(sm, tile, p, words, n_words, word_offsets, states, freqs);
  const u32 lane = dec.lane;
  const u32 n0 = tile * p.channels_per_tile;
  const u32 channels = min(p.channels_per_tile, p.N - n0);
  for (u32 c = 0; c < channels; ++c) {
    u32* col = B + n0 + c + size_t(lane >> 3) * p.N;
    for (u32 j = 0; j < p.steps_per_channel; ++j) {
      u32 sym;
      dec.step(sym);
      u32 v = sym << (4u * (lane & 7u));
      v |= __shfl_xor_sync(0xffffffffu, v, 1);
      v |= __shfl_xor_sync(0xffffffffu, v, 2);
      v |= __shfl_xor_sync(0xffffffffu, v, 4);
      if ((lane & 7u) == 0u) col[size_t(4u * j) * p.N] = v;
    }
  }
  dec.finish();
}

u32 grid_for(const RansParams& p) { return (p.tiles + kWarps - 1u) / kWarps; }

// Words must be 16-byte aligned for the cp.async copies (every tile starts on 16 bytes), and a
// layer of empty streams still gets a valid source address.
at::Tensor aligned_words(const at::Tensor& words) {
  if (words.numel() == 0) return at::zeros({8}, words.options());
  if (reinterpret_cast<uintptr_t>(words.data_ptr()) % 16u == 0u) return words;
  at::Tensor w = at::empty({words.numel() + 8}, words.options());
  const int64_t shift = (16 - int64_t(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16u)) % 16 / 2;
  at::Tensor view = w.narrow(0, shift, words.numel());
  view.copy_(words);
  return view;
}

template <typename T, u32 FMT, int MR>
void launch_gemm_as(const RansParams& p, const RansGemmArgs& a, const at::Tensor& words, at::Tensor& C,
                    cudaStream_t stream) {
  const RansCodes& c = a.codes;
  gemm_rans_kernel<T, FMT, MR><<<grid_for(p), kThreads, kSmemBytes, stream>>>(
      p, reinterpret_cast<const T*>(a.A.data_ptr()), reinterpret_cast<const uint16_t*>(words.data_ptr()),
      u32(words.numel()), c.word_offsets.data_ptr<int>(), reinterpret_cast<const u32*>(c.states.data_ptr()),
      reinterpret_cast<const int16_t*>(c.freqs.data_ptr()), reinterpret_cast<const T*>(a.scales.data_ptr()),
      a.zeros.defined() ? a.zeros.data_ptr<uint8_t>() : nullptr,
      a.offsets.defined() ? reinterpret_cast<const T*>(a.offsets.data_ptr()) : nullptr,
      a.bias.defined() ? reinterpret_cast<const T*>(a.bias.data_ptr()) : nullptr, reinterpret_cast<T*>(C.data_ptr()));
  cuda_backend::check_launch("gemm_rans");
}

template <typename T, u32 FMT>
void launch_gemm_rows(const RansParams& p, u32 rows, const RansGemmArgs& t, const at::Tensor& words, at::Tensor& C,
                      cudaStream_t stream) {
  switch (rows) {
    case 1: return launch_gemm_as<T, FMT, 1>(p, t, words, C, stream);
    case 2: return launch_gemm_as<T, FMT, 2>(p, t, words, C, stream);
    case 4: return launch_gemm_as<T, FMT, 4>(p, t, words, C, stream);
    case 8: return launch_gemm_as<T, FMT, 8>(p, t, words, C, stream);
    case 16: return launch_gemm_as<T, FMT, 16>(p, t, words, C, stream);
    default: TORCH_CHECK(false, "torch_marlin: gemm_rans has no CUDA kernel for ", rows, " rows");
  }
}

template <typename T>
void launch_gemm_format(const RansParams& p, u32 rows, const RansGemmArgs& t, const at::Tensor& words, at::Tensor& C,
                        cudaStream_t stream) {
  switch (p.format) {
    case TM_FORMAT_FP4: return launch_gemm_rows<T, TM_FORMAT_FP4>(p, rows, t, words, C, stream);
    case TM_FORMAT_U4: return launch_gemm_rows<T, TM_FORMAT_U4>(p, rows, t, words, C, stream);
    case TM_FORMAT_AFFINE: return launch_gemm_rows<T, TM_FORMAT_AFFINE>(p, rows, t, words, C, stream);
    default: TORCH_CHECK(false, "torch_marlin: gemm_rans: unknown format ", p.format);
  }
}

}  // namespace

namespace {

// Rows of A per fused kernel (the plan's tile_m): 1, 2, 4, 8 or 16.
void gemm_fused(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  const RansParams& p = plan.params;
  const u32 rows = plan.tile_m;
  const KernelLaunch& fused = plan.launches.at(LaunchRole::Decode);
  TORCH_CHECK(p.M >= 1u && p.M <= rows && rows <= TM_RANS_FUSED_MAX_M && p.K % 32u == 0u &&
                  p.group_size % 32u == 0u && p.n_groups * p.group_size == p.K && p.steps_per_channel * 32u == p.K &&
                  p.channels_per_tile >= 1u && p.tiles == (p.N + p.channels_per_tile - 1u) / p.channels_per_tile &&
                  fused.grid[0] == grid_for(p) && fused.threads[0] == kThreads,
              "torch_marlin: the CUDA plan '", fused.kernel, "' does not match the gemm_rans kernel");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor words = aligned_words(a.codes.words);
  switch (a.dtype) {
    case DType::F16: return launch_gemm_format<__half>(p, rows, a, words, C, stream);
    case DType::BF16: return launch_gemm_format<__nv_bfloat16>(p, rows, a, words, C, stream);
    case DType::F32: return launch_gemm_format<float>(p, rows, a, words, C, stream);
  }
}

void decode_to(const RansPlan& plan, const RansCodes& c, at::Tensor& B) {
  const RansParams& p = plan.params;
  const KernelLaunch& decode = plan.launches.at(LaunchRole::Decode);
  TORCH_CHECK(p.K % 32u == 0u && p.steps_per_channel * 32u == p.K && p.channels_per_tile >= 1u &&
                  p.tiles == (p.N + p.channels_per_tile - 1u) / p.channels_per_tile &&
                  decode.grid[0] == grid_for(p) && decode.threads[0] == kThreads,
              "torch_marlin: the CUDA plan '", decode.kernel, "' does not match the rans_decode kernel");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor words = aligned_words(c.words);
  rans_decode_kernel<<<grid_for(p), kThreads, kSmemBytes, stream>>>(
      p, reinterpret_cast<const uint16_t*>(words.data_ptr()), u32(words.numel()), c.word_offsets.data_ptr<int>(),
      reinterpret_cast<const u32*>(c.states.data_ptr()), reinterpret_cast<const int16_t*>(c.freqs.data_ptr()),
      reinterpret_cast<u32*>(B.data_ptr()));
  cuda_backend::check_launch(decode.kernel.c_str());
}

}  // namespace

// gemm_rans: fused, or staged (decode to a temporary B_packed from the caching allocator, then the
// format's CUDA GEMM with the plan's dense GEMM plan). No host synchronization, so it captures in
// a CUDA graph.
void CudaBackend::rans_gemm(const RansPlan& plan, const RansGemmArgs& a, at::Tensor& C) {
  const c10::cuda::CUDAGuard guard(a.A.device());
  if (plan.family == RansFamily::Fused) return gemm_fused(plan, a, C);
  at::Tensor B = at::empty({a.K / 8, a.N}, a.A.options().dtype(at::kInt));
  decode_to(plan, a.codes, B);
  const QuantGemmArgs q = staged_gemm_args(a, B);
  at::Tensor workspace;
  if (plan.gemm.workspace_bytes > 0) {
    workspace = at::empty({int64_t((plan.gemm.workspace_bytes + sizeof(float) - 1) / sizeof(float))},
                          a.A.options().dtype(at::kFloat));
  }
  CudaBackend::quant_gemm(plan.gemm, q, C, workspace);
}

void CudaBackend::rans_decode(const RansPlan& plan, const RansCodes& c, at::Tensor& B) {
  const c10::cuda::CUDAGuard guard(B.device());
  decode_to(plan, c, B);
}

}  // namespace torch_marlin
