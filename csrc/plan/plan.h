// The planner: the single place that turns (op, shape, dtype, device caps) into a kernel choice
// and its launch geometry. The CPU kernels, the MPS encoder, the CUDA launcher and the
// Metal-on-CPU harness all execute the plan they are given; none of them re-decides.
//
// Portable C++17: no torch, no Objective-C, so the harness and the Python policy function
// (torch_marlin.planner) reach exactly the same code.
//
// Every op family plans the same way: <family>_plan.cpp (plan.cpp for the FP4 / INT4 GEMM) holds the
// entries, the validation and the policy's choice of family; <family>_plan_<backend>.cpp
// (plan_<backend>.cpp for the GEMM) each backend's geometry and tuning constants; plan_common.cpp
// the tile and K-slice arithmetic they share. Every plan carries its kernels the same way: a
// LaunchList, the launches in execution order, each with its role (the GEMM, the reduction, ...);
// the Metal dispatch description (metal_dispatch.h) binds buffers to that list in its order.
// plan_cache.cpp is the ops' cache of plans.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "torch_marlin/quant_gemm_params.h"

namespace torch_marlin {

enum class Backend : int { CPU = 0, Metal = 1, CUDA = 2 };
enum class DType : int { F16 = 0, BF16 = 1, F32 = 2 };
enum class QuantFormat : int { FP4 = 0, U4 = 1, Affine = 2 };  // values = TM_FORMAT_*

// What the planner needs to know about the device. Metal: compute_units = GPU cores;
// CUDA: SM count; CPU: worker threads.
struct DeviceCaps {
  Backend backend = Backend::CPU;
  int compute_units = 1;
  int max_shared_memory = 32768;  // threadgroup / shared memory per group, bytes
  // CUDA: 1 when the device runs thread-block clusters (sm_90+) and the loaded kernels were
  // compiled for them (sm_90+ PTX); the decode plan then reduces 2 K slices through a cluster.
  int thread_block_clusters = 0;
  // CUDA: 1 when the device is compute capability 9.0 and the loaded kernels were built for
  // sm_90a; the planner may then pick the wgmma kernels (plan_cuda.cpp cuda_wgmma_ws_pays,
  // cuda_wgmma_pays).
  int wgmma = 0;
  // CPU: 1 when this build has the AVX2+FMA kernels and the running CPU executes AVX2 and FMA;
  // the planner then names the AVX2 kernels (the trellis decode family), else the portable ones.
  int avx2 = 0;
  // CPU: 1 when this build has the AVX-512 trellis decode kernel (x86-64) and the running CPU
  // executes AVX-512 F, BW, VL and DQ; the trellis decode family then runs it (over avx2).
  int avx512 = 0;
};

// What a backend is assumed to have where the caller names no value: CPU 1 thread; Metal
// default_metal_caps(); CUDA 1 SM, no thread-block clusters, no wgmma (the portable kernels only).
DeviceCaps default_caps(Backend b);

// Kernel families. A family is one kernel (template) per backend file; the planner picks the
// family and its template parameters, and every backend instantiates exactly what the plan names.
enum class KernelFamily : int {
  Auto = 0,     // a `force` value: let the policy choose; in a plan: no GEMM (standalone dequant)
  Decode,       // small M: GEMV-style, each packed weight read once for all rows (every backend)
  DequantBlas,  // CPU, CUDA: dequantize column panels of B into a buffer, then a BLAS GEMM
  FusedTiles,   // Metal: 2-D grid of 64x64 output tiles, weights dequantized in registers
  StagedTiles,  // Metal: 2-D grid, double-buffered A and dequantized-B tiles in threadgroup memory
  Striped,      // Metal: 1-D grid of column-major stripes over the tile space, K-parallel slices
  Simt,         // CUDA, fp32 activations: CUDA-core tiles
  Wgmma,        // CUDA sm_90a: both wgmma operands from shared memory (group sizes % 32)
  WgmmaWs,      // CUDA sm_90a: warp-specialized, a TMA producer warpgroup and 2..3 consumer
                // warpgroups dequantizing into wgmma's register operand (group sizes % 64)
};

// How the K slices of a K-parallel plan are summed (deterministically, in slice order).
enum class ReduceKind : int {
  None = 0,        // k_parallel == 1
  SecondDispatch,  // Metal, CPU: a reduction kernel over the fp32 workspace after the GEMM
  Cluster,         // CUDA sm_90: the slices of a tile run as one thread-block cluster (DSMEM)
  LastBlock,       // CUDA: the last block of each tile to finish sums the workspace
};

// The kernel a plan runs: family plus every template parameter a backend instantiates. Metal
// function names and CUDA instantiations are derived from it (kernel_name), never parsed back.
struct KernelDesc {
  Backend backend = Backend::CPU;
  KernelFamily family = KernelFamily::Decode;
  QuantFormat format = QuantFormat::FP4;
  DType dtype = DType::F16;
  uint32_t tile_m = 0;     // rows of the output tile (CUDA decode: the mma n extent, 8..64)
  uint32_t tile_n = 0;     // columns of the output tile
  uint32_t tile_k = 0;     // Metal prefill tiles: K rows per kernel iteration (k_slice_len is a
                           // multiple of it); 0 elsewhere
  uint32_t consumers = 0;  // WgmmaWs: consumer warpgroups (tile_n / 64); 0 otherwise
  bool vector_loads = false;  // Metal decode: 16-byte weight loads (4 adjacent columns), N % 4 == 0
  // CUDA decode with tile_m <= 16 and group_size % 32 == 0 (a 32-row chunk never straddles two
  // groups), not affine: the mmas of a group sum unscaled weights in fp32 and the group's scales
  // multiply those sums once, instead of every weight.
  bool scale_group_sums = false;
  ReduceKind reduce = ReduceKind::None;
};

constexpr int64_t kDecodeMaxM = 16;

const char* family_name(KernelFamily f);  // "decode", "dequant_blas", "fused_tiles", ...
const char* reduce_name(ReduceKind r);    // "none", "second_dispatch", "cluster", "last_block"
const char* backend_name(Backend b);
const char* dtype_name(DType d);  // "half", "bfloat", "float": the suffix of Metal kernel names
const char* format_name(QuantFormat f);  // "fp4", "u4", "affine"
// The backend's name for the kernel: the Metal function (marlin_gemv_m1_fp4_half, ...), the CUDA
// tag (decode_fp4_half, ...) or the CPU routine (cpu_decode, ...).
std::string kernel_name(const KernelDesc& k);

// One kernel launch of a plan, the same for every op family and backend: the kernel's name (the
// Metal function, the CUDA instantiation's tag or the CPU routine), its grid (threadgroups on Metal,
// blocks on CUDA, tasks on the CPU) and threads per threadgroup / block.
struct KernelLaunch {
  std::string kernel;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threads[3] = {1, 1, 1};
  // CUDA trellis tensor-core kernels: K is cut into k_parallel slices of k_slice_tiles tile rows
  // (16 rows each, a multiple of the stage); slices write fp32 partials that the next launch sums in
  // slice order. 1 / 0 where the launch does not slice K (the FP4 / INT4 GEMM keeps its K slices in
  // its params).
  uint32_t k_parallel = 1;
  uint32_t k_slice_tiles = 0;
  // CUDA: launched with programmatic dependent launch behind the previous kernel on the stream,
  // which lets it start as that kernel's blocks retire; the kernel waits (griddepcontrol.wait)
  // before it reads that kernel's output.
  bool dependent_launch = false;
};

// What a launch does in its plan. The declaration order is the execution order: a plan runs its
// launches in this order whatever order the planner added them in.
enum class LaunchRole : int {
  Route,        // CUDA MoE: the routing of the rows to their experts, in one launch
  Activations,  // CUDA trellis wgmma: the activations rewritten for the kernel's TMA
  Decode,       // rANS: the codes decoded, fused with the GEMM (Fused) or into B_packed (Staged)
  Main,         // the GEMM or the dequant; MoE: the gate/up + SwiGLU stage
  Tail,         // CUDA wgmma_ws: the last column tiles, in K slices summed through a cluster
  TiledGate,    // Metal MoE: 64x64-tile gate projection of the experts with more than 16 rows
  TiledUp,      // ... their up projection (with SwiGLU)
  Down,         // MoE: the down projection of the routed rows
  TiledDown,    // Metal MoE: the tiled down projection
  Reduce,       // the sum of the K slices' fp32 partials, in slice order
  Combine,      // MoE: the probability-weighted sum of each token's top_k rows
};

const char* launch_role_name(LaunchRole r);  // "route", "activations", "decode", "main", ...

// A plan's launches in execution order, at most one per role. operator[] adds a role's launch in its
// place (LaunchRole order); a reference to a launch stays valid while others are added.
class LaunchList {
 public:
  using Entries = std::map<LaunchRole, KernelLaunch>;
  KernelLaunch& operator[](LaunchRole role) { return launches_[role]; }
  const KernelLaunch* find(LaunchRole role) const;  // nullptr: the plan has no such launch
  const KernelLaunch& at(LaunchRole role) const;    // throws std::logic_error naming the role if absent
  void erase(LaunchRole role) { launches_.erase(role); }
  Entries::const_iterator begin() const { return launches_.begin(); }
  Entries::const_iterator end() const { return launches_.end(); }
  size_t size() const { return launches_.size(); }

 private:
  Entries launches_;
};

struct GemmPlan {
  KernelDesc desc;
  DeviceCaps caps;  // what the plan was made for
  // Main: the GEMM, kernel_name(desc) (plan_quant_dequant_metal: the dequant); Tail: CUDA wgmma_ws's
  // second launch of that kernel; Reduce: Metal SecondDispatch, the reduction of the K slices.
  LaunchList launches;
  size_t workspace_bytes = 0;       // fp32 partials [k_parallel][M][N] when k_parallel > 1 (CUDA
                                    // wgmma_ws: whole tiles in fragment order); dequant_blas: the panel
  // CUDA ReduceKind::LastBlock: byte offset in the workspace of the m_tiles * n_tiles int32 arrival
  // counters, after the partials (the launcher zeroes them before the launch). 0 otherwise.
  size_t counters_offset = 0;
  QuantGemmParams params{};
  // CUDA fp16/bf16 kernels: N rounded up to 16, the column count of the weights, scales and zero
  // points the kernels read (the launcher pads them when it differs from N). 0 elsewhere.
  uint32_t padded_n = 0;
  // CUDA wgmma_ws with a Tail launch: the last column tiles (all row tiles of them) are left out of
  // the Main grid (its grid[1] = n_tiles - the tail's grid[1], k_parallel 1) and run as the Tail
  // launch, grid (m_tiles, tail column tiles, K slices), its K slices of tail_k_slice_len rows summed
  // through a cluster, so that the main grid's last, mostly empty wave becomes a short full one.
  uint32_t tail_k_slice_len = 0;
  // Main's dependent_launch: CUDA decode and wgmma_ws on sm_90.
};

// The FP4 / INT4 / affine group-size rule (docs/formats.md): group_size a positive multiple of 8 that
// divides K. The one check of it: the ops (csrc/ops/quant_gemm.cpp), plan_quant_gemm and
// plan_quant_dequant_metal call it. Throws std::invalid_argument "<who>: group_size ...".
void check_quant_group_size(int64_t K, int64_t group_size, const char* who);

// Plans C[M,N] = A[M,K] @ dequant(B)[K,N] (+ bias). Shapes must already be validated by the op.
// `force` lets tests run a specific family; Auto is the policy. Throws std::invalid_argument for
// a family the backend (and dtype, and caps) cannot run.
GemmPlan plan_quant_gemm(QuantFormat format, int64_t M, int64_t K, int64_t N, int64_t group_size,
                         DType dtype, bool has_bias, const DeviceCaps& caps,
                         KernelFamily force = KernelFamily::Auto);

// Caps the Metal plans assume when no real device is queried (the harness, CPU-side policy
// tests): an M1-class GPU with 8 cores and 32 KiB of threadgroup memory.
DeviceCaps default_metal_caps();

// Standalone dequant on Metal (kernel dequant_<format>_<dtype> in metal/dequant.metal): one
// thread per packed word, 256 threads per threadgroup, 1-D grid. Shared by the MPS encoder and
// the Metal-on-CPU harness. params carries K, N and group_size (M = 0).
GemmPlan plan_quant_dequant_metal(QuantFormat format, int64_t K, int64_t N, int64_t group_size, DType dtype);

}  // namespace torch_marlin
