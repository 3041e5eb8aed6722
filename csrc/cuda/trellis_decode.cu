// The trellis decode GEMM (M <= 16, fp16 / bf16, K % 8 == 0): one pass over the packed indices
// with many bytes in flight per SM, so the layer streams at memory speed.
//
// Block: 8 warps; warp w owns tile column tn0 + w (16 output columns). The indices are the mma's
// A operand (m16n8k16, C^T = W^T A^T) and the activations its B operand, so M <= 8 pads to one n8
// tile instead of a 16-row one.
//  - Activations: the block's K slice (TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m) tile rows,
//    the planner's bound) is multiplied by su and rounded to T once, at the start, into shared
//    memory (rows below M, zero past K); every warp reads its B fragments from there (8 bytes per
//    n8 tile and tile row). The per-stage work is then only the index copies and the tiles.
//  - Indices: K runs in stages of 8 tile rows through a ring of 4 stages in shared memory, filled
//    with 16-byte cp.async copies 3 stages ahead, each byte copied once: for one tile row the
//    block's tiles are one contiguous run; in the CUDA lane layout (LANES) the stage is one lane
//    chunk per tile column, all one run. Each thread copies the same chunks of every stage, so its
//    source pointers are computed once and advance by a stage. One barrier per stage.
// Lane (g, t) takes tile rows 4t..4t+3 as its logical k {2t, 2t+1, 2t+8, 2t+9} and columns 2g,
// 2g+1 as A rows g, g+8: the pair of indices of one A register (two tile rows of one column) is
// 2 x bits bits of two row words, and its B fragment is 4 consecutive activations of row g. A
// shared table of the 4^bits codebook pairs (packed T2; at 3 and 4 bits in a copy per lane or
// pair of lanes, against bank conflicts) turns each pair into one register with one lookup. In
// the lane layout the pair of every A register is already one field of the lane's own 8 x bits
// bytes of the chunk: a mask and a shift-add give its table address (docs/trellis.md, "CUDA lane
// layout").
// Group scales multiply fp32 partial sums once per group, sv each output once, as in
// trellis_mma.cu. Measurements behind the geometry: benchmarks/notes/cuda-tuning.md TRELLIS-CUDA-STREAM.
// The MoE's decode stages (every expert's routed rows fit one 8- or 16-row tile) run the same
// kernel (EXPERTS) with grid.z over expert slots: gate/up gathers its expert's token rows, down
// (a.A2 set) builds silu(sum gate) * sum up from the gate/up slices' fp32 partials while staging,
// after its index copies are in flight (it may start behind gate/up: dependent launch).
#include <atomic>

#include "cuda/kernels.h"
#include "cuda/trellis_common.cuh"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {
namespace {

using cuda_backend::TrellisKernelArgs;

constexpr u32 kWarps = TM_TRELLIS_CUDA_WARPS;
constexpr u32 kThreads = TM_TRELLIS_CUDA_THREADS;
constexpr u32 kStageTiles = TM_TRELLIS_CUDA_STREAM_STAGE_TILES;
constexpr u32 kDepth = TM_TRELLIS_CUDA_STREAM_STAGES;
constexpr u32 kStageK = kStageTiles * TM_TRELLIS_TILE;  // K rows per stage
static_assert(kDepth >= 2, "copies run ahead of the stage in use");
static_assert(kThreads == kWarps * 32 && TM_TRELLIS_CUDA_TILE_N == kWarps * TM_TRELLIS_TILE, "one warp per tile column");
static_assert(kStageTiles == TM_TRELLIS_LANE_CHUNK_TILES, "a stage of the lane layout is one chunk per tile column");

// Keeps a value in a register: the compiler may not rematerialize it from its inputs.
__device__ __forceinline__ void pin_u32(u32& v) { asm volatile("" : "+r"(v)); }

template <typename T, u32 BITS, u32 NT>
struct StreamLayout {
  static constexpr u32 kChunkBytes = kStageTiles * 32 * BITS;   // a lane chunk: 8 tiles
  static constexpr u32 kLaneBytes = kChunkBytes / 32;           // a lane's part of it
  static constexpr u32 kTable = 1u << (2 * BITS);               // packed codebook pairs
  // Copies of the pair table, interleaved word by word; lane l reads copy l % kCopies. 3 bits: 32
  // copies (8 KiB), lane l always in bank l, so a warp's 32 lookups into the 64 pairs cost one
  // pass instead of about two. 4 bits: 16 copies (16 KiB; 32 would cost a block per SM), at most
  // two lanes a bank: two passes instead of three to four (benchmarks/notes/cuda-tuning.md
  // TRELLIS-CUDA-TABLE-COPIES). The 16 pairs of 2 bits already sit in 16 distinct banks.
  static constexpr u32 kCopies = BITS == 2 ? 1u : BITS == 3 ? 32u : 16u;
  static constexpr u32 kCopyShift = BITS == 2 ? 0u : BITS == 3 ? 5u : 4u;  // log2(kCopies)
  static constexpr u32 kTableBytes = kTable * kCopies * 4u;
  static constexpr u32 kTileBytes = 32 * BITS;
  // The converted activations of a slice: rows of kXStride T, kMaxSliceK + 16 (2064 or 1040 T:
  // 8 words mod 32, so the 8-byte B loads of rows g = 0..3, one half-warp, fall in 32 banks).
  static constexpr u32 kMaxSliceK = TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(8u * NT) * TM_TRELLIS_TILE;
  static constexpr u32 kXStride = kMaxSliceK + 16;
  static_assert(kMaxSliceK % kStageK == 0 && (kXStride / 2u) % 32u == 8u, "whole stages, conflict-free B rows");
  static constexpr u32 kXUnits = kMaxSliceK / 8u;               // 16-byte units of a row
  static_assert(kThreads % kXUnits == 0 && (8u * NT) % (kThreads / kXUnits) == 0, "whole rows per pass");
  static constexpr u32 kXRowStep = kThreads / kXUnits;          // rows a pass of the block covers
  static constexpr u32 kBRow = kWarps * kTileBytes;             // one tile row of the block
  // A ring slot: the stage's indices, + 16 bytes: a 3-bit pair in the last word of a tile row
  // reads one word past it (canonical tiles), which must not be the next slot's, being copied.
  static constexpr u32 kStage = kStageTiles * kBRow + 16u;
  // The pair table opens the dynamic shared memory (a lookup's address is the shared base plus
  // the pair's copy offset and the lane's word in it), then the ring, then the converted
  // activations: M rows of kXStride T.
  static constexpr u32 kRingOffset = kTableBytes;
  static constexpr u32 kXOffset = kRingOffset + kDepth * kStage;
  static constexpr u32 bytes(u32 rows) { return kXOffset + rows * kXStride * u32(sizeof(T)); }
  static_assert(kStage % 16 == 0 && kXOffset % 16 == 0, "16-byte copies and stores");
  static constexpr u32 kBCopies = (kStage / 16u + kThreads - 1) / kThreads;  // index chunks a thread copies
};

// The shared address of the pair of field p of a tile's lane bits x in the table copy at
// table_lane: the field is masked in place and then shifted into place while it is added (a mask
// and one shift-add: LOP3 + IMAD or LEA.HI).
template <u32 BITS, u32 COPY_SHIFT>
__device__ __forceinline__ u32 lane_pair_address(u32 x, u32 p, u32 table_lane) {
  constexpr u32 kAt = 2u + COPY_SHIFT;
  const u32 s = 2u * BITS * p;
  u32 f;  // opaque, so the compiler does not turn mask-then-shift-add back into shift, mask, add
  asm("and.b32 %0, %1, %2;" : "=r"(f) : "r"(x), "r"(((1u << (2u * BITS)) - 1u) << s));
  return s >= kAt ? (f >> (s - kAt)) + table_lane : f * (1u << (kAt - s)) + table_lane;
}

template <typename T, u32 BITS, u32 NT, bool LANES, bool EXPERTS>
__global__ void __launch_bounds__(kThreads, EXPERTS ? TM_TRELLIS_CUDA_STREAM_EXPERT_BLOCKS_PER_SM : 0)
    trellis_stream_kernel(const TrellisKernelArgs a) {
  using L = StreamLayout<T, BITS, NT>;
  using T2 = typename Tr<T>::T2;
  constexpr u32 kMask = (1u << BITS) - 1u;
  extern __shared__ __align__(16) unsigned char smem[];
  u32* table = reinterpret_cast<u32*>(smem);
  const u32 table_s = smem_u32(smem);
  unsigned char* ring = smem + L::kRingOffset;
  T* x_s = reinterpret_cast<T*>(smem + L::kXOffset);

  // The experts' stages let their dependents launch now (common.cuh, PDL protocol): gate/up launches
  // without PDL, so the kernels before it have finished, and down is followed by the combine,
  // which waits for it before it reads.
  if constexpr (EXPERTS) pdl_launch_dependents();
  const u32 tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u, g = lane / 4u, t = lane % 4u;
  // The block's rows: [0, M) of A, or its expert's routed rows [row0, row0 + m) of the sorted row
  // space (at most the tile's; the planner checks tokens * top_k against it).
  u32 row0 = 0, m = a.M, which = 0;
  cuda_backend::TrellisMatrixPtrs w = a.w[0];
  if constexpr (EXPERTS) {
    const TrellisBlockOperand op = trellis_block_operand(a);
    if (!op.valid) return;  // uniform: an expert slot the routing left empty
    if (a.row_experts != nullptr) {  // row slots: the slot's one routed row
      row0 = op.slot;
      m = 1u;
    } else {
      row0 = u32(a.offsets[op.e]);
      m = u32(a.offsets[op.e + 1u]) - row0;
    }
    if (m == 0u) return;
    w = op.w;
    which = op.which;
  }
  const u32 slice = blockIdx.y;
  const u32 tn0 = blockIdx.x * kWarps;
  const u32 block_tiles = min(kWarps, a.tiles_n - tn0);
  const bool active = warp < block_tiles;
  const u32 col0 = (tn0 + warp) * TM_TRELLIS_TILE + 2u * g;  // the lane's columns col0, col0 + 1
  const u32 kb = slice * a.k_slice_tiles, ke = min(a.tiles_k, kb + a.k_slice_tiles);
  const u32 n_stages = ke > kb ? (ke - kb + kStageTiles - 1) / kStageTiles : 0u;
  const u32 tiles_per_group = a.group_size / TM_TRELLIS_TILE;
  const u32 chunks_per_row = block_tiles * L::kTileBytes / 16u;

  // This thread's index copies, the same in every stage (tile rows kb + 8s .. of stage s, ring
  // slot s % kDepth): chunk c of tile row r (the block's tiles of a tile row are one contiguous
  // run), or in the lane layout chunk c of the stage's one run, whose tile rows past K are zero.
  // The stages are copied in order, so the source pointers advance by one stage per copy.
  const u32 ring_s = static_cast<u32>(__cvta_generic_to_shared(ring));
  const uint64_t b_step = uint64_t(kStageTiles) * a.tiles_n * L::kTileBytes;
  const uint8_t* b_src[L::kBCopies];
  u32 b_dst[L::kBCopies], b_rows_left[L::kBCopies];  // tile rows of the slice from this chunk's row on
#pragma unroll
  for (u32 q = 0; q < L::kBCopies; ++q) {
    if constexpr (LANES) {
      // Warp w copies the chunk of its own tile column, the only one it reads, so a stage needs no
      // block barrier (below).
      static_assert(L::kBCopies * 32u >= L::kChunkBytes / 16u, "a warp's lanes copy its whole chunk");
      const u32 unit = lane + q * 32u;
      const bool copier = active && unit < L::kChunkBytes / 16u;
      b_rows_left[q] = copier ? ke - kb : 0u;
      b_dst[q] = warp * L::kChunkBytes + unit * 16u;
      b_src[q] = w.packed + (uint64_t(kb / kStageTiles) * a.tiles_n + tn0 + warp) * L::kChunkBytes + unit * 16u;
    } else {
      const u32 i = tid + q * kThreads;
      const bool copier = i < kStageTiles * chunks_per_row;
      const u32 r = copier ? i / chunks_per_row : 0u, c = copier ? i - r * chunks_per_row : 0u;
      b_rows_left[q] = copier ? ke - kb - r : 0u;
      b_dst[q] = r * L::kBRow + c * 16u;
      b_src[q] = w.packed + (uint64_t(kb + r) * a.tiles_n + tn0) * L::kTileBytes + c * 16u;
    }
  }
  // Launched behind the previous kernel on the stream (KernelLaunch::dependent_launch), the block
  // brings its first stages' indices into L2 while that kernel finishes, then waits for it before
  // it reads anything: that kernel may write A, the weights or C. A prefetch only warms L2, the
  // point of coherence, so indices written by that kernel are still read fresh after the wait. Of
  // the experts' stages only down launches dependent, on gate/up, and waits below for its partials.
  if constexpr (!EXPERTS) {
#pragma unroll
    for (u32 s = 0; s < kDepth; ++s)
#pragma unroll
      for (u32 q = 0; q < L::kBCopies; ++q)
        if (s < n_stages && s * kStageTiles < b_rows_left[q]) prefetch_l2(b_src[q] + s * b_step);
    pdl_wait();
    // The K-slice reduction (which waits for this grid) or the next op's kernel may launch now.
    pdl_launch_dependents();
  }

  // Unrolled, so a thread's grid loads are all in flight at once.
  constexpr u32 kTableStores = L::kCopies == 1u ? L::kTable : L::kTableBytes / 16u;  // one word / four copies
#pragma unroll
  for (u32 it = 0; it < (kTableStores + kThreads - 1) / kThreads; ++it) {
    const u32 q = tid + it * kThreads;
    if (kTableStores % kThreads != 0 && q >= kTableStores) break;
    const u32 i = L::kCopies == 1u ? q : q / (L::kCopies / 4u);
    T2 v;
    v.x = Tr<T>::from_f(w.grid[i & kMask]);
    v.y = Tr<T>::from_f(w.grid[i >> BITS]);
    const u32 word = as_u32(v);
    if constexpr (L::kCopies == 1u) table[q] = word;
    else reinterpret_cast<uint4*>(table)[q] = make_uint4(word, word, word, word);
  }
  const u32 lane_copy = (lane % L::kCopies) * 4u;  // the lane's byte in each pair's copies
  const u32 table_lane = table_s + lane_copy;

  u32 copied = 0;  // stages copied so far
  auto copy_next_stage = [&]() {
    if (copied >= n_stages) return;
    const u32 slot = ring_s + (copied % kDepth) * L::kStage;
    const u32 row0 = copied * kStageTiles;
#pragma unroll
    for (u32 q = 0; q < L::kBCopies; ++q) {
      if (row0 < b_rows_left[q]) cp_async16(slot + b_dst[q], b_src[q]);
      b_src[q] += b_step;
    }
    ++copied;
  };
  // The lane's column pair in tile rows 4t + r: the byte offset, within a stage slot, of its word
  // in the warp's tile of tile row 0, and its shift. Pinned in registers: recomputed per stage
  // they would cost more than the stage's copies.
  u32 f_off[4], f_shift[4];
#pragma unroll
  for (u32 r = 0; r < 4; ++r) {
    const u32 bit = (4u * t + r) * TM_TRELLIS_TILE * BITS + 2u * g * BITS;
    f_off[r] = warp * L::kTileBytes + (bit / 32u) * 4u;
    f_shift[r] = bit % 32u;
    if constexpr (!LANES) {
      pin_u32(f_off[r]);
      pin_u32(f_shift[r]);
    }
  }
  const u32 lane_off = warp * L::kChunkBytes + lane * L::kLaneBytes;  // the lane's bytes of a chunk slot
  // The lane's B rows 8 nt + g, padding rows read as row M - 1 (at M = 1 the warp's B loads are
  // one broadcast row).
  u32 x_row[NT];
#pragma unroll
  for (u32 nt = 0; nt < NT; ++nt) x_row[nt] = min(8u * nt + g, m - 1u) * L::kXStride;
  auto load_scales = [&](float2& s, u32 gi) {
    const float* sp = w.scales + uint64_t(gi) * a.N + col0;
    s.x = active && col0 < a.N ? sp[0] : 0.f;
    s.y = active && col0 + 1u < a.N ? sp[1] : 0.f;
  };

  // part: the current group's unscaled sums; acc: the scaled ones. d0, d1: column col0, rows
  // 8nt + 2t + {0, 1}; d2, d3: column col0 + 1, the same rows.
  float acc[NT][4], part[NT][4];
#pragma unroll
  for (u32 nt = 0; nt < NT; ++nt)
#pragma unroll
    for (u32 c = 0; c < 4; ++c) acc[nt][c] = part[nt][c] = 0.f;
  auto fold = [&](const float2& s) {
#pragma unroll
    for (u32 nt = 0; nt < NT; ++nt)
#pragma unroll
      for (u32 c = 0; c < 4; ++c) {
        acc[nt][c] = fmaf(part[nt][c], c < 2 ? s.x : s.y, acc[nt][c]);
        part[nt][c] = 0.f;
      }
  };
  u32 gi = kb * TM_TRELLIS_TILE / a.group_size;
  u32 group_end = (gi + 1u) * tiles_per_group;
  float2 s_cur, s_next;
  load_scales(s_cur, gi);
  load_scales(s_next, min(gi + 1u, a.n_groups - 1u));

  // The slice's activations, rows below m: thread (r0, c) copies the 8 columns at c of rows r0,
  // r0 + kXRowStep, ... straight into x_s (16-byte cp.async, zero past K; K % 8 == 0: a unit is
  // all below K or all past it; the lane layout's padding tiles and a last tile's rows past K read
  // zero), one copy group ahead of the index stages, all in flight at once. Each thread later
  // scales the units it copied itself, so no barrier sits between. The MoE's down stage instead
  // computes its units after the index copies are issued (the group stays, empty).
  const u32 k0 = kb * TM_TRELLIS_TILE, xc = (tid % L::kXUnits) * 8u, r0 = tid / L::kXUnits;
  const bool x_unit = xc < n_stages * kStageK, x_in_k = x_unit && k0 + xc < a.K;
  const bool from_partials = EXPERTS && a.A2 != nullptr;  // the down stage (uniform)
  if (!from_partials) {
    const T* src = static_cast<const T*>(a.A) + (x_in_k ? k0 + xc : 0u);
    const u32 dst = smem_u32(x_s + xc);
    // Loops to m, not unrolled to the tile's rows: at M = 1 (most decode calls) one pass.
#pragma unroll 1
    for (u32 r = r0; x_unit && r < m; r += L::kXRowStep) {
      const uint64_t src_row = !EXPERTS             ? uint64_t(r)
                               : a.row_map != nullptr ? uint64_t(a.row_map[row0 + r])
                                                      : uint64_t((row0 + r) / a.top_k);
      cp_async16(dst + r * L::kXStride * u32(sizeof(T)), src + src_row * a.lda, x_in_k ? 16u : 0u);
    }
  }
  cp_async_commit();
#pragma unroll
  for (u32 s = 0; s + 1u < kDepth; ++s) {
    copy_next_stage();
    cp_async_commit();
  }
  if (x_unit) {
    float4 s0 = make_float4(0.f, 0.f, 0.f, 0.f), s1 = s0;
    if (x_in_k) {
      s0 = *reinterpret_cast<const float4*>(w.su + k0 + xc);
      s1 = *reinterpret_cast<const float4*>(w.su + k0 + xc + 4u);
    }
    const float su[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    auto pack = [](float lo, float hi) {
      T2 o;
      o.x = Tr<T>::from_f(lo);
      o.y = Tr<T>::from_f(hi);
      return as_u32(o);
    };
    if (from_partials) {
      // A = silu(sum gate) * sum up over the gate/up K slices in slice order (as trellis_load_act),
      // times su, rounded to T once. The partials are the previous kernel's output.
      pdl_wait();
#pragma unroll 1
      for (u32 r = r0; r < m; r += L::kXRowStep) {
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (x_in_k) {
          const uint64_t at = uint64_t(row0 + r) * a.lda + k0 + xc;
          float gs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, us[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (u32 p = 0; p < a.a_parts; ++p) {
            const float* gp = static_cast<const float*>(a.A) + p * a.a_part_stride + at;
            const float* up = a.A2 + p * a.a_part_stride + at;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
              const float4 gv = __ldcg(reinterpret_cast<const float4*>(gp) + h);
              const float4 uv = __ldcg(reinterpret_cast<const float4*>(up) + h);
              gs[4 * h] += gv.x, gs[4 * h + 1] += gv.y, gs[4 * h + 2] += gv.z, gs[4 * h + 3] += gv.w;
              us[4 * h] += uv.x, us[4 * h + 1] += uv.y, us[4 * h + 2] += uv.z, us[4 * h + 3] += uv.w;
            }
          }
#pragma unroll
          for (u32 i = 0; i < 8; ++i) v[i] = swiglu(gs[i], us[i]) * su[i];
        }
        *reinterpret_cast<uint4*>(x_s + r * L::kXStride + xc) =
            make_uint4(pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7]));
      }
    } else {
      // x su, rounded to T once, in place.
      cp_async_wait<kDepth - 1>();  // this thread's activation copies have landed
#pragma unroll 1
      for (u32 r = r0; r < m; r += L::kXRowStep) {
        uint4* x = reinterpret_cast<uint4*>(x_s + r * L::kXStride + xc);
        const uint4 q = *x;
        const u32 in[4] = {q.x, q.y, q.z, q.w};
        u32 o[4];
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
          const T2 x2 = as_t2<T2>(in[i]);
          o[i] = pack(Tr<T>::to_f(x2.x) * su[2 * i], Tr<T>::to_f(x2.y) * su[2 * i + 1]);
        }
        *x = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  }

  for (u32 st = 0; st < n_stages; ++st) {
    cp_async_wait<kDepth - 2>();  // stage st has landed (this thread's copies; the activations' group is older)
    // ... everyone's, and the table and activations; stage st - 1's slot is free. In the lane layout
    // a warp copies and reads only its own chunks, so after the first stage (whose barrier also
    // publishes the table and the activations) the warp's own barrier does.
    if (!LANES || st == 0) __syncthreads();
    else __syncwarp();
    copy_next_stage();  // stage st + kDepth - 1
    cp_async_commit();  // possibly empty: the group count stays one per stage
    if (!active) continue;
    const u32 tk0 = kb + st * kStageTiles;
    // The lane layout pads K to whole chunks (zero indices times zero activations), so its stages
    // are always whole.
    const u32 rows = LANES ? kStageTiles : min(kStageTiles, ke - tk0);
    const unsigned char* bt = ring + (st % kDepth) * L::kStage;
    u32 lv[2 * BITS];  // the lane's chunk words (lane layout)
    if constexpr (LANES) {
      load_lane_words<BITS>(bt + lane_off, lv);
    }
    const T* xt = x_s + st * kStageK + 4u * t;
    auto next_group = [&]() {
      fold(s_cur);
      s_cur = s_next;
      ++gi;
      group_end += tiles_per_group;
      load_scales(s_next, min(gi + 1u, a.n_groups - 1u));
    };
    auto tile = [&](u32 j) {
      // A rows g / g + 8 = columns col0 / col0 + 1; k-pairs (rows 4t, 4t+1) and (4t+2, 4t+3).
      u32 af[4];
      if constexpr (LANES) {
        const u32 x = lane_tile_bits<BITS>(lv, j);
#pragma unroll
        for (u32 p = 0; p < 4; ++p)
          af[p] = lds_u32(lane_pair_address<BITS, L::kCopyShift>(x, p, table_lane));
      } else {
        u32 f[4];
#pragma unroll
        for (u32 r = 0; r < 4; ++r) {
          const u32* word = reinterpret_cast<const u32*>(bt + j * L::kBRow + f_off[r]);
          if constexpr (BITS == 3) f[r] = __funnelshift_r(word[0], word[1], f_shift[r]);
          else f[r] = word[0] >> f_shift[r];
        }
        auto pair = [&](u32 i) {
          return lds_u32(table_s + ((i << (2u + L::kCopyShift)) | lane_copy));
        };
        af[0] = pair((f[0] & kMask) | ((f[1] & kMask) << BITS));
        af[1] = pair(((f[0] >> BITS) & kMask) | (f[1] & (kMask << BITS)));
        af[2] = pair((f[2] & kMask) | ((f[3] & kMask) << BITS));
        af[3] = pair(((f[2] >> BITS) & kMask) | (f[3] & (kMask << BITS)));
      }
#pragma unroll
      for (u32 nt = 0; nt < NT; ++nt) {
        const uint2 b = *reinterpret_cast<const uint2*>(xt + x_row[nt] + j * TM_TRELLIS_TILE);
        Tr<T>::mma(part[nt], af, b.x, b.y);
      }
    };
    if (a.stage_groups && rows == kStageTiles) {
      // Groups of whole stages: a group can only start at a stage's first tile row, and the
      // stage's tiles run without a branch between them (their loads overlap).
      if (tk0 == group_end) next_group();
#pragma unroll
      for (u32 j = 0; j < kStageTiles; ++j) tile(j);
    } else {
#pragma unroll
      for (u32 j = 0; j < kStageTiles; ++j) {
        if (j >= rows) break;
        if (tk0 + j == group_end) next_group();
        tile(j);
      }
    }
  }
  fold(s_cur);
  cp_async_wait<0>();  // no copy outlives the block

  if (!active) return;
  const float sv0 = col0 < a.N ? w.sv[col0] : 0.f, sv1 = col0 + 1u < a.N ? w.sv[col0 + 1u] : 0.f;
#pragma unroll
  for (u32 nt = 0; nt < NT; ++nt)
#pragma unroll
    for (u32 c = 0; c < 4; ++c) {
      const u32 row = 8u * nt + 2u * t + (c & 1u), col = col0 + (c >> 1);
      if (row >= m || col >= a.N) continue;
      const float v = acc[nt][c] * (c < 2 ? sv0 : sv1);
      const uint64_t at = uint64_t(row0 + row) * a.ldc + col;
      if (a.out_f32) static_cast<float*>(a.out[which])[slice * a.out_part_stride + at] = v;
      else static_cast<T*>(a.out[which])[at] = Tr<T>::from_f(v);
    }
}

template <typename T, u32 BITS, u32 NT, bool LANES, bool EXPERTS>
void launch_one(const KernelLaunch& l, const TrellisKernelArgs& a, cudaStream_t stream) {
  static std::atomic<uint64_t> opted_in{0};
  auto kernel = trellis_stream_kernel<T, BITS, NT, LANES, EXPERTS>;
  using L = StreamLayout<T, BITS, NT>;
  cuda_backend::opt_in_smem(kernel, int(L::bytes(8u * NT)), opted_in);
  const uint32_t rows = a.row_experts != nullptr ? 1u : a.M;  // row slots: one row a block
  cuda_backend::launch_kernel(kernel, dim3(l.grid[0], l.grid[1], l.grid[2]), dim3(kThreads), L::bytes(rows), stream,
                              l.dependent_launch, l.kernel.c_str(), a);
}

template <typename T, u32 BITS, bool EXPERTS>
void launch_rows(const KernelLaunch& l, uint32_t tile_m, bool lanes, const TrellisKernelArgs& a,
                 cudaStream_t stream) {
  if constexpr (!EXPERTS) {
    if (lanes) {
      if (tile_m == 8u) return launch_one<T, BITS, 1, true, false>(l, a, stream);
      return launch_one<T, BITS, 2, true, false>(l, a, stream);
    }
  }
  TORCH_CHECK(!lanes, "torch_marlin: the MoE's streaming decode reads the canonical tiles");
  if (tile_m == 8u) return launch_one<T, BITS, 1, false, EXPERTS>(l, a, stream);
  return launch_one<T, BITS, 2, false, EXPERTS>(l, a, stream);
}

}  // namespace

namespace cuda_backend {

template <typename T>
void launch_trellis_stream(const KernelLaunch& l, uint32_t bits, uint32_t tile_m, bool lanes,
                           const TrellisKernelArgs& a, cudaStream_t stream) {
  const bool experts = a.offsets != nullptr || a.row_experts != nullptr;
  TORCH_CHECK(l.threads[0] == kThreads && (tile_m == 8u || tile_m == 16u) && a.M >= 1u && a.M <= tile_m &&
                  a.K % 8u == 0 && a.k_parallel == l.k_parallel && l.grid[1] == l.k_parallel &&
                  l.grid[2] == (experts ? (a.A2 != nullptr ? 1u : 2u) * a.experts : 1u) &&
                  (experts || a.A2 == nullptr) && a.k_slice_tiles % kStageTiles == 0 && a.k_slice_tiles > 0 &&
                  a.k_slice_tiles <= TM_TRELLIS_CUDA_STREAM_MAX_SLICE_TILES(tile_m),
              "torch_marlin: the trellis plan '", l.kernel, "' does not match the streaming decode kernel's geometry");
  with_trellis_bits(bits, [&](auto b) {
    if (experts) launch_rows<T, b.value, true>(l, tile_m, lanes, a, stream);
    else launch_rows<T, b.value, false>(l, tile_m, lanes, a, stream);
  });
}

template void launch_trellis_stream<__half>(const KernelLaunch&, uint32_t, uint32_t, bool, const TrellisKernelArgs&,
                                            cudaStream_t);
template void launch_trellis_stream<__nv_bfloat16>(const KernelLaunch&, uint32_t, uint32_t, bool,
                                                   const TrellisKernelArgs&, cudaStream_t);

}  // namespace cuda_backend
}  // namespace torch_marlin
