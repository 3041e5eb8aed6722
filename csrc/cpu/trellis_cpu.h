// Shared pieces of the CPU trellis kernels (csrc/cpu/trellis.cpp: prefill, dequant, MoE;
// csrc/cpu/trellis_decode.cpp: the decode family, csrc/cpu/trellis_decode_avx512.cpp: its AVX-512
// kernel).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ops/trellis.h"

// x86-64 GCC / Clang builds carry the AVX-512 decode kernel whatever the build's -m flags (its
// functions carry target attributes); the planner names it only where the CPU runs AVX-512.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TM_TRELLIS_AVX512 1
#endif

namespace torch_marlin {

// One trellis matrix W[K, N] (one expert's slice for the MoE), raw pointers.
struct TView {
  const uint8_t* packed;
  const float* scales;
  const float* grid;
  const float* su;
  const float* sv;
  int64_t K, N, group_size, tiles_k, tiles_n, packed_bytes, n_groups;
};

// Software prefetch for the decode kernels' walk over a column block: the block's tiles of one
// tile row are one run of a few KiB, the next run a whole tile row of the matrix further on. The
// hardware prefetchers stop at 4 KiB pages and restart on every run, which left the AVX-512 decode
// waiting on DRAM for about half its time with cold weights. Prefetching the tile 64 tiles ahead in
// the walk's order (into the next run at a run's end) took 3 and 4 bits from 1.0x..1.8x to
// 2.0x..2.5x of dense fp32 on a Xeon at 2 threads (benchmarks/notes/cuda-tuning.md TRELLIS-CPU-PREFETCH).
class TileAheadPrefetcher {
 public:
  static constexpr int64_t kAhead = 64;  // tiles

  TileAheadPrefetcher(const TView& w, int64_t tn0, int64_t nt) : w_(w), tn0_(tn0), nt_(nt > 0 ? nt : 1) {}
  // Before the walk of tile row tk.
  void start_row(int64_t tk) {
    row_ = tk + kAhead / nt_;
    col_ = kAhead % nt_;
  }
  // Once per tile of the walk.
  void next() {
    if (row_ < w_.tiles_k) {
      const uint8_t* p = w_.packed + (row_ * w_.tiles_n + tn0_ + col_) * w_.packed_bytes;
      __builtin_prefetch(p, 0, 3);
      __builtin_prefetch(p + w_.packed_bytes - 1, 0, 3);  // a 96-byte tile may span three lines
    }
    if (++col_ == nt_) {
      col_ = 0;
      ++row_;
    }
  }

 private:
  const TView& w_;
  int64_t tn0_, nt_, row_ = 0, col_ = 0;
};

inline TView make_view(const TrellisWeights& w, int64_t K, int64_t N, int64_t bits, int64_t group_size,
                       int64_t expert) {
  TView v;
  v.K = K;
  v.N = N;
  v.group_size = group_size;
  v.tiles_k = (K + 15) / 16;
  v.tiles_n = (N + 15) / 16;
  v.packed_bytes = 32 * bits;
  v.n_groups = (K + group_size - 1) / group_size;
  v.packed = w.packed.data_ptr<uint8_t>() + expert * v.tiles_k * v.tiles_n * v.packed_bytes;
  v.scales = w.scales.data_ptr<float>() + expert * v.n_groups * N;
  v.grid = w.grid.data_ptr<float>() + expert * (int64_t(1) << bits);
  v.su = w.su.data_ptr<float>() + expert * K;
  v.sv = w.sv.data_ptr<float>() + expert * N;
  return v;
}

// The decode family's GEMM (M <= kDecodeMaxM rows), the plan's column blocks split over threads.
void trellis_decode_gemm(const TrellisPlan& plan, const TrellisGemmArgs& args, float* C);

// X = A * su in fp32 [M, tiles_k * 16], zero past K: the decode kernels' activation operand.
at::Tensor trellis_decode_activations(const at::Tensor& A, const at::Tensor& su, int64_t K);

// The decode kernel a plan names (TrellisPlan::cpu_avx512, cpu_avx2).
enum class DecodeKernel { Portable, Avx2, Avx512 };
inline DecodeKernel decode_kernel(const TrellisPlan& plan) {
  return plan.cpu_avx512 ? DecodeKernel::Avx512 : plan.cpu_avx2 ? DecodeKernel::Avx2 : DecodeKernel::Portable;
}

// C[m * ldc + n - c0] = (X @ W)[m, n] for m < M <= kDecodeMaxM, n in [c0, c1), c0 a multiple of 16,
// X from trellis_decode_activations (row stride ldx); one thread, the plan's `kernel` (refused
// where this build lacks it).
void trellis_decode_columns(DecodeKernel kernel, int64_t bits, const TView& w, const float* X, int64_t ldx,
                            int64_t M, int64_t c0, int64_t c1, float* C, int64_t ldc);

#if defined(TM_TRELLIS_AVX512)
// The running CPU executes AVX-512 F, BW, VL and DQ (and the OS saves their registers).
bool cpu_runs_trellis_avx512();

// trellis_decode_columns with the AVX-512 kernel; only where cpu_runs_trellis_avx512().
void trellis_decode_columns_avx512(int64_t bits, const TView& w, const float* X, int64_t ldx, int64_t M, int64_t c0,
                                   int64_t c1, float* C, int64_t ldc);
#endif

}  // namespace torch_marlin
