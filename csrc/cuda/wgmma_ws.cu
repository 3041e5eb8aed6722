// The wgmma_ws kernel (sm_90a): warp-specialized, for M > 32 with group_size % 64 == 0
// (benchmarks/notes/cuda-tuning.md WS-MIN-M, WS-SMALL-M). A TMA producer warpgroup feeds 2 or 3 consumer
// warpgroups that dequantize straight into wgmma's register A operand (weights = the m64 rows,
// activations = n); up to 4 K slices: 2 (3 for 256-row tiles) summed through a thread-block
// cluster, 3..4 by each tile's last block through global memory (benchmarks/notes/cuda-tuning.md
// WS-CLUSTER-SLICES, WS-GLOBAL-SLICES). A partial last wave of column tiles may run as a second,
// K-sliced launch (the plan's Tail launch; benchmarks/notes/cuda-tuning.md WS-TAIL). Launched with
// programmatic dependent launch, like decode on sm_90.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

#include <cudaTypedefs.h>

// The kernel's helpers are referenced only from its body, which compiles for sm_90a alone
// (__CUDA_ARCH_FEAT_SM90_ALL); nvcc's other passes would warn they are unused.
#pragma nv_diag_suppress 177

namespace torch_marlin {
namespace {

// C^T = W^T A^T: the dequantized weights are wgmma's A operand straight from registers (64 weight
// columns = the m64 rows of one warpgroup), the activations its B operand from shared memory (the
// n dimension: BN = 64, 128 or 256 rows of A). A block is one producer warpgroup and NC = 2 or 3
// consumer warpgroups over a 64 NC-column x BN-row output tile, one block per SM.
//  - One producer thread keeps a kStages-deep ring of 64-k stages full by TMA: the activation box
//    (BN rows x 64 k, 128-byte swizzle: wgmma's canonical K-major layout), the packed-weight box
//    (8 packed rows x 64 NC columns) and the stage's scale (and U4 zero-point or affine offset) row, all completing
//    on the slot's "full" mbarrier; it refills a slot once every consumer warp has arrived on its
//    "empty" mbarrier.
//  - A consumer lane (g, t) of warp w holds the A rows 16 w + g and 16 w + g + 8 of its warpgroup.
//    The order of the m64 rows is free (it only decides where each output lands), so those two rows
//    are the adjacent weight columns 2 g and 2 g + 1 of the warp's 16: one 8-byte shared load per
//    packed row gives both. A k16 step needs k = {2t, 2t+1} (a0, a1) and {2t+8, 2t+9} (a2, a3): byte
//    t of packed rows 2 ks and 2 ks + 1. Three byte permutes gather the 4 bytes (2 columns x 2 rows)
//    into one word that the FP4 table lookup / INT4 magic numbers turn into the 4 A registers.
//  - No shared-memory store of dequantized weights, no fence and no block barrier per stage: the
//    consumers dequantize stage s + 1 into the other of two register fragment sets while stage s's
//    wgmmas run, and wait only for the full barrier and their own wgmma groups.
// K slices sum through wgmma_cluster_reduce (cluster dims (1, 1, k_parallel)) or, without a
// cluster, by the last block of each tile from fragment-order partials in ws. group_size % 64 == 0:
// one scale row a stage (a second row for group sizes of 32 or 96 cost 10 % at M = 64..128,
// benchmarks/notes/cuda-tuning.md WS-MIN-M; the wgmma kernel serves them).
constexpr int kWsMaxConsumers = int(TM_CUDA_WGMMA_WS_MAX_TILE_N) / 64;
// setmaxnreg moves registers between the warpgroups of a block: the block starts with
// ws_launch_regs a thread (__launch_bounds__ (128 (NC + 1), 1): the 64 K registers of an SM in
// multiples of 8), the producer gives all but 40 back and the consumers share what it gave. They
// must not ask for more: setmaxnreg.inc waits for registers the block's pool does not have (a
// deadlock; launch_wgmma_ws_as checks the compiled count this assumes).
constexpr u32 kWsProducerRegs = 40;
template <int NC>
constexpr u32 ws_launch_regs() {
  return 65536u / (128u * (NC + 1)) / 8u * 8u;
}
template <int NC>
constexpr u32 ws_consumer_regs() {
  return ws_launch_regs<NC>() + (ws_launch_regs<NC>() - kWsProducerRegs) / NC / 8u * 8u;
}
static_assert(ws_consumer_regs<2>() == 232u && ws_consumer_regs<3>() == 152u, "consumer register budgets");
template <int BN, int NC>
struct WsSmem {
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma n of 64, 128 or 256 activation rows");
  static_assert(NC >= 2 && NC <= kWsMaxConsumers && (BN < 256 || NC == 2),
                "consumer registers (ws_consumer_regs) for BN / 2 accumulators");
  static constexpr int kTN = 64 * NC;                      // weight columns of a block
  static constexpr int kA = BN * kWgKStep * 2;             // activation box: BN rows of 128 bytes
  static constexpr int kW = (kWgKStep / 8) * kTN * 4;      // 8 packed rows x kTN columns
  static constexpr int kScaleRow = kTN * 2;                // one scale row
  static constexpr int kZeroRow = kTN * 2;                 // one zero-point row (U4: kTN bytes) or offset row
                                                           // (affine: kTN * 2 bytes, the scales' dtype)
  static constexpr int kStage = (kA + kW + kScaleRow + kZeroRow + 1023) / 1024 * 1024;  // 1024-aligned swizzle atoms
  // The TMA ring: as many stages as 200 KiB hold, at most 8 (benchmarks/notes/cuda-tuning.md WS-RING).
  static constexpr int kStages = (200 * 1024) / kStage < 8 ? (200 * 1024) / kStage : 8;
  static constexpr int kPart = BN * kTN * 4;               // fp32 partial tile of the K-slice epilogue
  static constexpr int kBytes = (kStages * kStage > kPart ? kStages * kStage : kPart) + 1024;
  static_assert(kStages >= 4 && kBytes <= 227 * 1024, "shared-memory budget");
};


// 4 bytes (columns e = 0, 1 x packed rows 2 ks, 2 ks + 1) -> the A fragment of one k16 step:
// a0 = (col 0, k 2t, 2t+1), a1 = (col 1, same k), a2 = (col 0, k 2t+8, 2t+9), a3 = (col 1, same k).
// x = [row 2ks col 0, row 2ks+1 col 0, row 2ks col 1, row 2ks+1 col 1] (bytes, low first), so x's
// natural k order is (a0, a2, a1, a3). s0 / s1: the columns' scales (duplicated); U4 / affine: qp
// holds the pair (col 0, col 1) of scales and magic + zero points or offsets (nibbles p and p + 4
// are the two columns).
template <typename T, u32 FMT>
__device__ __forceinline__ void rs_fragment(u32 (&a)[4], u32 x, typename Tr<T>::T2 s0, typename Tr<T>::T2 s1,
                                            const ColQ<T>& qp) {
  using T2 = typename Tr<T>::T2;
  if constexpr (FMT == TM_FORMAT_FP4) {
    u32 h[4];
    fp4_natural<T>(x, h);
    a[0] = as_u32(__hmul2(as_t2<T2>(h[0]), s0));
    a[2] = as_u32(__hmul2(as_t2<T2>(h[1]), s0));
    a[1] = as_u32(__hmul2(as_t2<T2>(h[2]), s1));
    a[3] = as_u32(__hmul2(as_t2<T2>(h[3]), s1));
  } else {
    const uint4 v = int4_natural<T, FMT>(x, qp);
    a[0] = v.x;
    a[2] = v.y;
    a[1] = v.z;
    a[3] = v.w;
  }
}

template <typename T, u32 FMT, int BN, int NC, bool kCluster>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    wgmma_ws_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                    const __grid_constant__ CUtensorMap tmap_s, const __grid_constant__ CUtensorMap tmap_z,
                    QuantGemmParams p, u32 n_tile0, const T* bias, T* __restrict__ C,
                    float* __restrict__ ws, int* __restrict__ counters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WsSmem<BN, NC>;
  using T2 = typename Tr<T>::T2;
  constexpr int kStages = L::kStages, kTN = L::kTN, kConsumers = 128 * NC;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 m0 = blockIdx.x * u32(BN), n0 = (blockIdx.y + n_tile0) * u32(kTN);  // n_tile0: where a Tail launch starts
  const u32 k_begin = blockIdx.z * p.k_slice_len;
  const u32 k_end = min(p.K, k_begin + p.k_slice_len);
  const int n_stages = int((k_end - k_begin) / u32(kWgKStep));  // multiples of 64 (planner)
  const u32 smem_raw = u32(__cvta_generic_to_shared(smem));
  const u32 align_pad = (1024u - (smem_raw & 1023u)) & 1023u;
  unsigned char* const sm = smem + align_pad;
  const u32 smem_base = smem_raw + align_pad;
  __shared__ __align__(8) uint64_t full_bar[kStages], empty_bar[kStages];
  const u32 full_base = u32(__cvta_generic_to_shared(full_bar)), empty_base = u32(__cvta_generic_to_shared(empty_bar));
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full_base + 8u * i, 1u);
      mbar_init(empty_base + 8u * i, u32(kConsumers / 32));  // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Launched early behind the previous kernel (PDL), the producer brings the first ring's weights,
  // scales and zero points into L2 while that kernel finishes (they are usually the layer's own;
  // a prefetch only warms L2, so a weight that kernel writes is still read fresh), and every
  // thread waits for it before any other global access (it may write A, the weights, bias or C).
  if (tid == kConsumers) {
    for (int s = 0; s < min(n_stages, kStages); ++s) {
      const u32 k0 = k_begin + u32(s) * u32(kWgKStep), grp = k0 / p.group_size;
      tma_prefetch_l2_2d(&tmap_b, n0, k0 / 8u);
      tma_prefetch_l2_2d(&tmap_s, n0, grp);
      if constexpr (FMT != TM_FORMAT_FP4) tma_prefetch_l2_2d(&tmap_z, n0, grp);
    }
  }
  pdl_wait();
  // The next kernel may launch now unless the last-block K-slice reduction will still use this
  // call's workspace (common.cuh, PDL protocol): then at exit.
  if (kCluster || p.k_parallel == 1) pdl_launch_dependents();
  __syncthreads();

  if (tid >= kConsumers) {
    // Producer warpgroup: one thread puts stage s into slot s % kStages once the consumers released the
    // slot's previous stage.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
    if (tid == kConsumers) {
      // The zero-point row is kTN bytes, the offset row kTN values of T.
      constexpr u32 kTx = u32(L::kA + L::kW + L::kScaleRow + (FMT == TM_FORMAT_U4 ? kTN : 0) +
                              (FMT == TM_FORMAT_AFFINE ? kTN * int(sizeof(T)) : 0));
      for (int s = 0; s < n_stages; ++s) {
        const int slot = s % kStages;
        if (s >= kStages) mbar_wait(empty_base + 8u * slot, u32(s / kStages - 1) & 1u);
        const u32 bar = full_base + 8u * slot, dst = smem_base + u32(slot * L::kStage);
        const u32 k0 = k_begin + u32(s) * u32(kWgKStep), grp = k0 / p.group_size;
        mbar_expect_tx(bar, kTx);
        tma_load_2d(dst, &tmap_a, k0, m0, bar);
        tma_load_2d(dst + L::kA, &tmap_b, n0, k0 / 8u, bar);
        tma_load_2d(dst + L::kA + L::kW, &tmap_s, n0, grp, bar);
        if constexpr (FMT != TM_FORMAT_FP4) tma_load_2d(dst + L::kA + L::kW + L::kScaleRow, &tmap_z, n0, grp, bar);
      }
    }
    if constexpr (kCluster) {  // the two cluster barriers of the consumers' wgmma_cluster_reduce
      namespace cg = cooperative_groups;
      cg::this_cluster().sync();
      cg::this_cluster().sync();
    }
  } else {
    // Consumer warpgroup wg, warp w: A rows 16 w + g (+ 8) = tile columns 64 wg + 16 w + 2 g (+ 1).
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_consumer_regs<NC>()));
    const int wg = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
    const int col = 64 * wg + 16 * w + 2 * g;  // this lane's column pair within the tile
    const u32 sel = u32(t) | (u32(t + 4) << 4);  // byte t of each of two words
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    u32 frag[2][4][4];
    // Waits for stage s and dequantizes it into fragment set fr.
    auto load_stage = [&](int s, u32 (&fr)[4][4]) {
      const int slot = s % kStages;
      mbar_wait(full_base + 8u * slot, u32(s / kStages) & 1u);
      const unsigned char* st = sm + slot * L::kStage;
      uint2 wd[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) wd[r] = *reinterpret_cast<const uint2*>(st + L::kA + (r * kTN + col) * 4);
      const u32 sp = *reinterpret_cast<const u32*>(st + L::kA + L::kW + col * 2);
      const T2 s0 = as_t2<T2>(prmt(sp, sp, 0x1010)), s1 = as_t2<T2>(prmt(sp, sp, 0x3232));
      ColQ<T> qp;
      if constexpr (FMT == TM_FORMAT_U4) {
        const u32 zp = *reinterpret_cast<const unsigned short*>(st + L::kA + L::kW + L::kScaleRow + col);
        qp.s2 = as_t2<T2>(sp);
        qp.z2.x = magic_zero<T>(zp);
        qp.z2.y = magic_zero<T>(zp >> 8);
      } else if constexpr (FMT == TM_FORMAT_AFFINE) {
        qp.s2 = as_t2<T2>(sp);
        qp.z2 = as_t2<T2>(*reinterpret_cast<const u32*>(st + L::kA + L::kW + L::kScaleRow + col * 2));
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const u32 c0 = prmt(wd[2 * ks].x, wd[2 * ks + 1].x, sel), c1 = prmt(wd[2 * ks].y, wd[2 * ks + 1].y, sel);
        rs_fragment<T, FMT>(fr[ks], prmt(c0, c1, 0x5410), s0, s1, qp);
      }
    };
    // SW128 K-major B descriptor of slot 0 (8-row atoms 1024 bytes apart); k16 step ks starts 32 ks
    // bytes into the 128-byte rows.
    const uint64_t desc0 = wg_desc(smem_base, 16u, 1024u) | (uint64_t(1) << 62);
    auto issue_stage = [&](int s, const u32 (&fr)[4][4]) {
      const uint64_t ds = desc0 + ((u32(s % kStages) * u32(L::kStage)) >> 4);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_rs<T, BN>(acc, fr[ks], ds + ((32u * u32(ks)) >> 4));
      wg_commit();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);
    };
    // Stage s runs on fragment set s & 1; the set of s + 1 was read by stage s - 1, retired by the
    // wait below before it is overwritten.
    auto step = [&](int s, u32 (&cur)[4][4], u32 (&next)[4][4]) {
      issue_stage(s, cur);
      wg_wait<1>();  // stage s - 1 retired: its slot and fragment set are free
      if (s > 0 && lane == 0) mbar_arrive(empty_base + 8u * u32((s - 1) % kStages));
      if (s + 1 < n_stages) load_stage(s + 1, next);
    };
    if (n_stages > 0) load_stage(0, frag[0]);
    for (int s = 0; s < n_stages; s += 2) {
      step(s, frag[0], frag[1]);
      if (s + 1 < n_stages) step(s + 1, frag[1], frag[0]);
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) wg_pin(acc[i]);

    // acc[4 j + 2 e + f]: tile column col + e, activation row m0 + 8 j + 2 t + f.
    if constexpr (kCluster) {
      // The partial tile goes where the ring was: every consumer warpgroup must be done with it.
      named_barrier(1u, u32(kConsumers));
      float* part = reinterpret_cast<float*>(sm);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int f = 0; f < 2; ++f)
          *reinterpret_cast<float2*>(part + (8 * j + 2 * t + f) * kTN + col) =
              make_float2(acc[4 * j + f], acc[4 * j + 2 + f]);
      wgmma_cluster_reduce<T, kTN>(p, part, u32(BN), m0, n0, bias, C, u32(tid), u32(kConsumers));
    } else {
      if (p.k_parallel > 1) {
        // K slices without a cluster (ReduceKind::LastBlock): every block leaves its accumulators
        // in ws, fragment by fragment ([tile][slice][BN / 4][threads] float2: coalesced, and the
        // last block reads back exactly its own fragments' elements); the last block sums the
        // slices in slice order (the cluster path's sums), into acc (benchmarks/notes/cuda-tuning.md
        // WS-EPILOGUE).
        const u32 tile = (blockIdx.y + n_tile0) * gridDim.x + blockIdx.x;
        float2* tws = reinterpret_cast<float2*>(ws) + size_t(tile) * p.k_parallel * (BN / 4) * kConsumers + tid;
        float2* mine = tws + size_t(blockIdx.z) * (BN / 4) * kConsumers;
#pragma unroll
        for (int i = 0; i < BN / 4; ++i) __stcg(mine + i * kConsumers, make_float2(acc[2 * i], acc[2 * i + 1]));
        if (!last_arrival(p.k_parallel, counters, tile, u32(tid), u32(kConsumers), 1u)) return;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
        for (u32 sl = 0; sl < p.k_parallel; ++sl) {
          const float2* src = tws + size_t(sl) * (BN / 4) * kConsumers;
#pragma unroll
          for (int i = 0; i < BN / 4; ++i) {
            const float2 v = __ldcg(src + i * kConsumers);
            acc[2 * i] += v.x;
            acc[2 * i + 1] += v.y;
          }
        }
      }
      const u32 c = n0 + u32(col);
      if (c >= p.N) return;
      const bool pair = c + 1u < p.N;
      const float b0 = p.has_bias ? Tr<T>::to_f(bias[c]) : 0.f;
      const float b1 = p.has_bias && pair ? Tr<T>::to_f(bias[c + 1u]) : 0.f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const u32 row = m0 + u32(8 * j + 2 * t + f);
          if (row >= p.M) continue;
          const float v0 = acc[4 * j + f] + b0, v1 = acc[4 * j + 2 + f] + b1;
          store_c_pair<T>(C + size_t(row) * p.N + c, v0, v1, pair, p.N);
        }
    }
  }
#else
  __trap();  // planned only where the loaded kernels are sm_90a (CudaBackend::caps)
#endif
}

}  // namespace

#pragma nv_diag_default 177

namespace cuda_backend {

// A 2-D TMA descriptor: rows x cols elements (cols contiguous, row stride in bytes), box_rows x
// box_cols boxes; out-of-range elements of a box read as zero. The encoder is a driver entry point
// (no link against libcuda), looked up once.
CUtensorMap tensor_map_2d(const void* base, CUtensorMapDataType type, int64_t rows, int64_t cols, int64_t row_bytes,
                          int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    TORCH_CHECK(fn != nullptr && q == cudaDriverEntryPointSuccess, "torch_marlin: cuTensorMapEncodeTiled unavailable");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "torch_marlin: cuTensorMapEncodeTiled failed (", int(r), ")");
  return map;
}

namespace {

// wgmma_ws: TMA descriptors of the activations, packed weights (8 packed rows x 64 NC columns),
// scales and zero points (one row of 64 NC columns); the padded weights are 16-byte aligned with Np
// a multiple of 16 (launch.cu padded_weights), as TMA needs.
template <typename T, u32 FMT, int BN, int NC, bool kCluster>
void launch_wgmma_ws_as(const GemmPlan& plan, const CUtensorMap (&maps)[4], u32 n_tile0, const GemmOperands<T>& o) {
  constexpr int kSmem = WsSmem<BN, NC>::kBytes;
  auto* kernel = wgmma_ws_kernel<T, FMT, BN, NC, kCluster>;
  static std::atomic<uint64_t> opted_in{0};
  check_launch_registers(kernel, int(ws_launch_regs<NC>()), "wgmma_ws", opted_in);  // ws_consumer_regs
  opt_in_smem(kernel, kSmem, opted_in);
  launch_tile_kernel<kCluster>(plan, kernel, u32(128 * (NC + 1)), kSmem, o.stream, maps[0], maps[1], maps[2], maps[3],
                               plan.params, n_tile0, o.bias, o.C, o.ws, o.counters);
}

// The Tail launch of a wgmma_ws plan as a plan of its own (its Main launch): the last column tiles,
// in K slices summed through a cluster.
GemmPlan wgmma_ws_tail_plan(const GemmPlan& plan, const KernelLaunch& tail) {
  GemmPlan t = plan;
  t.params.k_parallel = tail.grid[2];
  t.params.k_slice_len = plan.tail_k_slice_len;
  t.launches[LaunchRole::Main] = tail;
  t.launches.erase(LaunchRole::Tail);
  t.desc.reduce = ReduceKind::Cluster;
  return t;
}

template <typename T, u32 FMT, int BN, int NC>
void launch_wgmma_ws_tile(const GemmPlan& plan, const GemmOperands<T>& o) {
  const QuantGemmParams& q = plan.params;
  const int64_t Np = o.Np;
  const int64_t groups = q.K / q.group_size;
  constexpr int kTN = 64 * NC;
  const CUtensorMap scales =
      tensor_map_2d(o.scales, CU_TENSOR_MAP_DATA_TYPE_UINT16, groups, Np, Np * 2, 1, kTN, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap maps[4] = {
      activation_tensor_map<T>(o.A, q.M, q.K, BN),
      tensor_map_2d(o.B, CU_TENSOR_MAP_DATA_TYPE_UINT32, q.K / 8, Np, Np * 4, kWgKStep / 8, kTN,
                    CU_TENSOR_MAP_SWIZZLE_NONE),
      scales,
      // U4 zero points, affine offsets (a row like the scales'); FP4 has neither: the kernel never
      // reads this slot, which repeats the scales' map.
      FMT == TM_FORMAT_U4
          ? tensor_map_2d(o.zeros, CU_TENSOR_MAP_DATA_TYPE_UINT8, groups, Np, Np, 1, kTN, CU_TENSOR_MAP_SWIZZLE_NONE)
          : FMT == TM_FORMAT_AFFINE
                ? tensor_map_2d(o.offsets, CU_TENSOR_MAP_DATA_TYPE_UINT16, groups, Np, Np * 2, 1, kTN,
                                CU_TENSOR_MAP_SWIZZLE_NONE)
                : scales};
  const auto launch = [&](const GemmPlan& pl, u32 n_tile0) {
    with_cluster(pl, [&](auto cluster) {
      launch_wgmma_ws_as<T, FMT, BN, NC, decltype(cluster)::value>(pl, maps, n_tile0, o);
    });
  };
  launch(plan, 0);
  if (const KernelLaunch* tail = plan.launches.find(LaunchRole::Tail)) {
    launch(wgmma_ws_tail_plan(plan, *tail), plan.launches.at(LaunchRole::Main).grid[1]);
  }
}

}  // namespace

// BN = desc.tile_m activation rows, NC = desc.consumers consumer warpgroups (desc.tile_n = 64 NC
// weight columns), kCluster = (desc.reduce == ReduceKind::Cluster); a tail launch always sums its
// K slices through a cluster.
template <typename T, uint32_t FMT>
void launch_wgmma_ws(const GemmPlan& plan, const GemmOperands<T>& o) {
  const KernelDesc& d = plan.desc;
  const QuantGemmParams& q = plan.params;
  const u32 nc = d.consumers;
  const KernelLaunch& main = plan.launches.at(LaunchRole::Main);
  const KernelLaunch* tail = plan.launches.find(LaunchRole::Tail);
  const u32 tail_n_tiles = tail ? tail->grid[1] : 0u, tail_k_parallel = tail ? tail->grid[2] : 1u;
  TORCH_CHECK((d.tile_m == 64u || d.tile_m == 128u || d.tile_m == 256u) && nc >= 2u && nc <= u32(kWsMaxConsumers) &&
                  d.tile_n == 64u * nc && (d.tile_m < 256u || nc == 2u) && d.tile_m == q.tile_m &&
                  d.tile_n == q.tile_n && q.K % TM_CUDA_WGMMA_K_STEP == 0 &&
                  q.k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 && q.group_size % TM_CUDA_WGMMA_K_STEP == 0 &&
                  main.grid[0] == q.m_tiles && main.grid[1] + tail_n_tiles == q.n_tiles &&
                  main.grid[2] == q.k_parallel && main.threads[0] == 128u * (nc + 1u) &&
                  (q.k_parallel == 1 ||
                   (d.reduce == ReduceKind::Cluster && q.k_parallel <= TM_CUDA_WGMMA_MAX_SLICES) ||
                   (d.reduce == ReduceKind::LastBlock && tail == nullptr &&
                    plan.workspace_bytes >= size_t(q.m_tiles) * q.n_tiles * q.k_parallel * q.tile_m * q.tile_n *
                                                sizeof(float))) &&
                  (tail == nullptr ||
                   (q.k_parallel == 1 && main.grid[1] > 0 && tail->grid[0] == q.m_tiles && tail_k_parallel >= 2u &&
                    tail_k_parallel <= TM_CUDA_WGMMA_MAX_SLICES && tail->threads[0] == main.threads[0] &&
                    plan.tail_k_slice_len > 0 && plan.tail_k_slice_len % TM_CUDA_WGMMA_K_STEP == 0 &&
                    uint64_t(plan.tail_k_slice_len) * tail_k_parallel >= q.K)),
              "torch_marlin: bad wgmma_ws plan");
  if (d.tile_m == 256u) launch_wgmma_ws_tile<T, FMT, 256, 2>(plan, o);
  else if (d.tile_m == 128u && nc == 2u) launch_wgmma_ws_tile<T, FMT, 128, 2>(plan, o);
  else if (d.tile_m == 128u) launch_wgmma_ws_tile<T, FMT, 128, 3>(plan, o);
  else if (nc == 2u) launch_wgmma_ws_tile<T, FMT, 64, 2>(plan, o);
  else launch_wgmma_ws_tile<T, FMT, 64, 3>(plan, o);
}

TM_CUDA_INSTANTIATE_ENTRY(launch_wgmma_ws)

}  // namespace cuda_backend
}  // namespace torch_marlin
