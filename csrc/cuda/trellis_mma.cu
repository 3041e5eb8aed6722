// The fp16/bf16 trellis GEMM on tensor cores (mma.sync m16n8k16): decode (one m16 tile of rows),
// fused tiles (four), and the MoE's gate/up and down stages over expert-sorted rows.
//
// Block: 8 warps, warp w owns tile column tn0 + w (16 output columns). K advances in stages of
// 8 tile rows (128 rows), double-buffered in shared memory:
//  - index bytes: for one tile row the block's 8 tiles are one contiguous run, copied with 16-byte
//    cp.async (each byte once, adjacent threads adjacent chunks);
//  - activations: [rows][128] in T with su[k] applied in fp32 before the one rounding (zero past
//    K and past the block's rows), loaded into registers during the previous stage's MMAs.
// The K order inside an mma is free as long as A and B use the same one: lane (g, t) takes the
// physical rows 4t..4t+3 of a tile as its logical k {2t, 2t+1, 2t+8, 2t+9}, so its activation
// fragment is one 8-byte load per row and its weights are 4 consecutive tile rows. Its two n8
// tiles are the adjacent columns 2g and 2g+1, whose indices are adjacent bits of each tile row:
// one shared word (two where a 3-bit pair crosses a word) per row gives both. Pairs of indices
// (rows 4t, 4t+1 or 4t+2, 4t+3 of one column) go through a shared table of 4^bits packed T2
// codebook pairs, one lookup per B register. Codebook values are rounded to T once; the group
// scales multiply fp32 partial sums once per group (the MMAs of a group accumulate unscaled), and
// sv multiplies each output once, so a weight sees one rounding (the codebook's) plus su's.
#include <atomic>

#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

using cuda_backend::TrellisKernelArgs;

constexpr u32 kWarps = TM_TRELLIS_CUDA_WARPS;
constexpr u32 kThreads = TM_TRELLIS_CUDA_THREADS;
constexpr u32 kStageTiles = TM_TRELLIS_CUDA_STAGE_K_TILES;
constexpr u32 kBK = kStageTiles * TM_TRELLIS_TILE;  // K rows per stage
// Row stride of the staged activations: 144 T = 72 words, 8 banks apart, so the 8-byte fragment
// loads of rows g = 0..3 and t = 0..3 (one half-warp) hit 32 distinct banks.
constexpr u32 kAStride = kBK + 16;
static_assert(kThreads == kWarps * 32, "one warp per tile column");
static_assert(TM_TRELLIS_CUDA_TILE_N == kWarps * TM_TRELLIS_TILE, "a block covers kWarps tile columns");

template <typename T, u32 BITS, u32 MT>
struct MmaLayout {
  static constexpr u32 kRows = 16 * MT;
  static constexpr u32 kTable = 1u << (2 * BITS);                  // u32 pairs
  static constexpr u32 kAStage = kRows * kAStride;                 // T elements
  static constexpr u32 kTileBytes = 32 * BITS;
  static constexpr u32 kBRow = kWarps * kTileBytes;                // one tile row of the block
  static constexpr u32 kBStage = kStageTiles * kBRow;
  static constexpr u32 kAOffset = kTable * 4;
  static constexpr u32 kBOffset = kAOffset + 2 * kAStage * sizeof(T);
  // + 16: a 3-bit pair in the last word of the last tile reads one word past it.
  static constexpr u32 kBytes = kBOffset + 2 * kBStage + 16;
  static constexpr u32 kAPerThread = kRows * kBK / kThreads;       // activations a thread stages
};

template <typename T, u32 BITS, u32 MT, bool SWIGLU>
__global__ void __launch_bounds__(kThreads) trellis_mma_kernel(const TrellisKernelArgs a) {
  using L = MmaLayout<T, BITS, MT>;
  using T2 = typename Tr<T>::T2;
  constexpr u32 kMask = (1u << BITS) - 1u;
  extern __shared__ __align__(16) unsigned char smem[];
  u32* table = reinterpret_cast<u32*>(smem);
  T* a_s = reinterpret_cast<T*>(smem + L::kAOffset);
  unsigned char* b_s = smem + L::kBOffset;

  // Launched without PDL (the kernels before it have finished), it lets the K-slice reduction, which
  // waits for it, or the next op's kernel launch now (common.cuh, PDL protocol).
  pdl_launch_dependents();
  const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u, g = lane / 4u, t = lane % 4u;
  const TrellisBlockOperand op = trellis_block_operand(a);
  const u32 which = op.which, e = op.e;
  const uint8_t* packed = op.w.packed;
  const float* scales = op.w.scales;
  const float* grid = op.w.grid;
  const float* su = op.w.su;
  const float* sv = op.w.sv;

  if (!op.valid) return;  // uniform: an empty expert slot
  u32 row_begin = 0, row_end = a.M;
  if (a.offsets != nullptr) {
    row_begin = u32(a.offsets[e]);
    row_end = u32(a.offsets[e + 1]);
  }
  const u32 slice = blockIdx.y % a.k_parallel, m_idx = blockIdx.y / a.k_parallel;
  if (row_begin + m_idx * L::kRows >= row_end) return;  // uniform: no row chunk for this block

  for (u32 i = tid; i < L::kTable; i += kThreads) {
    T2 v;
    v.x = Tr<T>::from_f(grid[i & kMask]);
    v.y = Tr<T>::from_f(grid[i >> BITS]);
    table[i] = as_u32(v);
  }

  const u32 tn0 = blockIdx.x * kWarps;
  const u32 block_tiles = min(kWarps, a.tiles_n - tn0);
  const bool active = warp < block_tiles;
  const u32 col0 = (tn0 + warp) * TM_TRELLIS_TILE + 4u * t;  // the lane's 4 output columns
  const u32 kb = slice * a.k_slice_tiles, ke = min(a.tiles_k, kb + a.k_slice_tiles);
  const u32 n_stages = ke > kb ? (ke - kb + kStageTiles - 1) / kStageTiles : 0u;
  const u32 tiles_per_group = a.group_size / TM_TRELLIS_TILE;
  const u32 chunks_per_row = block_tiles * L::kTileBytes / 16u;
  // Shared word and shift of the lane's column pair in tile rows 4t + r.
  u32 f_word[4], f_shift[4];
#pragma unroll
  for (u32 r = 0; r < 4; ++r) {
    const u32 bit = (4u * t + r) * TM_TRELLIS_TILE * BITS + 2u * g * BITS;
    f_word[r] = bit / 32u;
    f_shift[r] = bit % 32u;
  }
  const u32 a_kk = tid % kBK, a_r0 = tid / kBK;  // this thread stages rows a_r0 + 2i, column a_kk

  auto load_scales = [&](float (&s)[4], u32 gi) {
#pragma unroll
    for (u32 q = 0; q < 4; ++q) {
      const u32 c = col0 + q;
      s[q] = active && c < a.N ? scales[uint64_t(gi) * a.N + c] : 0.f;
    }
  };

  __syncthreads();  // the pair table
  for (u32 r0 = row_begin + m_idx * L::kRows; r0 < row_end; r0 += L::kRows * a.m_tiles) {
    float areg[L::kAPerThread];
    auto fetch_a = [&](u32 tk) {
      const u32 k = tk * TM_TRELLIS_TILE + a_kk;
      const float s = k < a.K ? su[k] : 0.f;
#pragma unroll
      for (u32 i = 0; i < L::kAPerThread; ++i) {
        const u32 row = r0 + a_r0 + 2u * i;
        float v = 0.f;
        if (k < a.K && row < row_end) v = trellis_load_act<T, SWIGLU>(a, row, k) * s;
        areg[i] = v;
      }
    };
    auto store_a = [&](u32 buf) {
      T* dst = a_s + buf * L::kAStage + a_r0 * kAStride + a_kk;
#pragma unroll
      for (u32 i = 0; i < L::kAPerThread; ++i) dst[2u * i * kAStride] = Tr<T>::from_f(areg[i]);
    };
    auto copy_b = [&](u32 tk, u32 buf) {
      const u32 rows = min(kStageTiles, ke - tk);
      const u32 total = rows * chunks_per_row;
      const u32 dst0 = static_cast<u32>(__cvta_generic_to_shared(b_s + buf * L::kBStage));
      for (u32 i = tid; i < total; i += kThreads) {
        const u32 r = i / chunks_per_row, c = i - r * chunks_per_row;
        const uint8_t* src = packed + (uint64_t(tk + r) * a.tiles_n + tn0) * L::kTileBytes + c * 16u;
        cp_async16(dst0 + r * L::kBRow + c * 16u, src);
      }
    };

    float acc[MT][2][4], part[MT][2][4];
#pragma unroll
    for (u32 m = 0; m < MT; ++m)
#pragma unroll
      for (u32 j = 0; j < 2; ++j)
#pragma unroll
        for (u32 i = 0; i < 4; ++i) acc[m][j][i] = part[m][j][i] = 0.f;
    // Accumulator i of n8 tile j holds column 4t + 2 (i & 1) + j: scale index 2 (i & 1) + j.
    auto fold = [&](const float (&s)[4]) {
#pragma unroll
      for (u32 m = 0; m < MT; ++m)
#pragma unroll
        for (u32 j = 0; j < 2; ++j)
#pragma unroll
          for (u32 i = 0; i < 4; ++i) {
            acc[m][j][i] = fmaf(part[m][j][i], s[2u * (i & 1u) + j], acc[m][j][i]);
            part[m][j][i] = 0.f;
          }
    };
    u32 gi = kb * TM_TRELLIS_TILE / a.group_size;
    u32 group_end = (gi + 1u) * tiles_per_group;  // first tile row of the next group
    float s_cur[4], s_next[4];
    load_scales(s_cur, gi);
    load_scales(s_next, min(gi + 1u, a.n_groups - 1u));

    if (n_stages > 0) {  // the index copies first: their latency overlaps the activations' loads
      copy_b(kb, 0);
      cp_async_commit();
      fetch_a(kb);
      store_a(0);
    }
    for (u32 st = 0; st < n_stages; ++st) {
      const u32 buf = st & 1u, tk0 = kb + st * kStageTiles;
      const u32 rows = min(kStageTiles, ke - tk0);
      const bool more = st + 1u < n_stages;
      if (more) {
        copy_b(tk0 + kStageTiles, buf ^ 1u);
        fetch_a(tk0 + kStageTiles);
      }
      cp_async_commit();  // possibly empty: stage st's group is then the only one waited for
      cp_async_wait<1>();
      __syncthreads();
      if (active) {
        const unsigned char* bt = b_s + buf * L::kBStage + warp * L::kTileBytes;
        const T* at = a_s + buf * L::kAStage + g * kAStride + 4u * t;
        for (u32 j = 0; j < rows; ++j) {
          if (tk0 + j == group_end) {
            fold(s_cur);
#pragma unroll
            for (u32 q = 0; q < 4; ++q) s_cur[q] = s_next[q];
            ++gi;
            group_end += tiles_per_group;
            load_scales(s_next, min(gi + 1u, a.n_groups - 1u));
          }
          const u32* words = reinterpret_cast<const u32*>(bt + j * L::kBRow);
          u32 f[4];
#pragma unroll
          for (u32 r = 0; r < 4; ++r) {
            if constexpr (BITS == 3) f[r] = __funnelshift_r(words[f_word[r]], words[f_word[r] + 1u], f_shift[r]);
            else f[r] = words[f_word[r]] >> f_shift[r];
          }
          // Column 2g: the low index of each row's pair; column 2g + 1: the high one.
          const u32 b00 = table[(f[0] & kMask) | ((f[1] & kMask) << BITS)];
          const u32 b01 = table[(f[2] & kMask) | ((f[3] & kMask) << BITS)];
          const u32 b10 = table[((f[0] >> BITS) & kMask) | (f[1] & (kMask << BITS))];
          const u32 b11 = table[((f[2] >> BITS) & kMask) | (f[3] & (kMask << BITS))];
#pragma unroll
          for (u32 m = 0; m < MT; ++m) {
            const T* ar = at + m * 16u * kAStride + j * TM_TRELLIS_TILE;
            const uint2 lo = *reinterpret_cast<const uint2*>(ar);
            const uint2 hi = *reinterpret_cast<const uint2*>(ar + 8u * kAStride);
            const u32 af[4] = {lo.x, hi.x, lo.y, hi.y};
            Tr<T>::mma(part[m][0], af, b00, b01);
            Tr<T>::mma(part[m][1], af, b10, b11);
          }
        }
      }
      if (more) store_a(buf ^ 1u);
      __syncthreads();
    }
    fold(s_cur);

    if (active) {
      float svq[4];
#pragma unroll
      for (u32 q = 0; q < 4; ++q) svq[q] = col0 + q < a.N ? sv[col0 + q] : 0.f;
#pragma unroll
      for (u32 m = 0; m < MT; ++m)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
          const u32 row = r0 + m * 16u + g + 8u * h;
          if (row >= row_end) continue;
#pragma unroll
          for (u32 q = 0; q < 4; ++q) {
            const u32 c = col0 + q;
            if (c >= a.N) continue;
            const float v = acc[m][q & 1u][2u * h + (q >> 1)] * svq[q];
            if (a.out_f32) {
              static_cast<float*>(which ? a.out[1] : a.out[0])[slice * a.out_part_stride + uint64_t(row) * a.ldc + c] = v;
            } else {
              static_cast<T*>(a.out[0])[uint64_t(row) * a.ldc + c] = Tr<T>::from_f(v);
            }
          }
        }
    }
  }
}

template <typename T, u32 BITS, u32 MT, bool SWIGLU>
void launch_one(const KernelLaunch& l, const TrellisKernelArgs& a, cudaStream_t stream) {
  static std::atomic<uint64_t> opted_in{0};
  auto kernel = trellis_mma_kernel<T, BITS, MT, SWIGLU>;
  constexpr int kSmem = int(MmaLayout<T, BITS, MT>::kBytes);
  cuda_backend::opt_in_smem(kernel, kSmem, opted_in);
  kernel<<<dim3(l.grid[0], l.grid[1], l.grid[2]), dim3(l.threads[0]), kSmem, stream>>>(a);
  cuda_backend::check_launch(l.kernel.c_str());
}

template <typename T, u32 BITS>
void launch_bits(const KernelLaunch& l, uint32_t tile_m, bool swiglu, const TrellisKernelArgs& a,
                 cudaStream_t stream) {
  const bool decode = tile_m == TM_TRELLIS_CUDA_DECODE_M;
  if (decode && !swiglu) return launch_one<T, BITS, 1, false>(l, a, stream);
  if (decode && swiglu) return launch_one<T, BITS, 1, true>(l, a, stream);
  if (!swiglu) return launch_one<T, BITS, TM_TRELLIS_CUDA_PREFILL_M / 16, false>(l, a, stream);
  return launch_one<T, BITS, TM_TRELLIS_CUDA_PREFILL_M / 16, true>(l, a, stream);
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_mma(const KernelLaunch& l, uint32_t bits, uint32_t tile_m, bool swiglu,
                        const TrellisKernelArgs& a, cudaStream_t stream) {
  TORCH_CHECK(l.threads[0] == kThreads && (tile_m == TM_TRELLIS_CUDA_DECODE_M || tile_m == TM_TRELLIS_CUDA_PREFILL_M) &&
                  a.k_parallel == l.k_parallel && a.k_slice_tiles % kStageTiles == 0 && a.k_slice_tiles > 0,
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the tensor-core kernel's geometry");
  with_trellis_bits(bits, [&](auto b) { launch_bits<T, b.value>(l, tile_m, swiglu, a, stream); });
}

template void launch_trellis_mma<__half>(const KernelLaunch&, uint32_t, uint32_t, bool, const TrellisKernelArgs&,
                                         cudaStream_t);
template void launch_trellis_mma<__nv_bfloat16>(const KernelLaunch&, uint32_t, uint32_t, bool,
                                                const TrellisKernelArgs&, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
