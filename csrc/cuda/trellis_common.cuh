// Pieces shared by the CUDA trellis kernels: the activation read of every stage of the GEMM kernels
// (trellis_mma.cu, trellis_simt.cu: plain rows, gathered MoE rows, or the MoE's SwiGLU of the gate
// and up K-slice partials), the per-block operand selection, a lane's tile bits in the lane layout,
// and the launchers' bit-width dispatch.
#pragma once

#include "cuda/common.cuh"
#include "cuda/trellis_kernels.h"

namespace torch_marlin {
namespace {

// The block's matrix (MoE: gate for blockIdx.z < E, up above) and its expert e, offset to e.
// An expert id clamped into [0, experts): GPUs do not sync to reject bad ids, so every index they
// lead to stays in bounds (the routing kernel and the MoE row slots alike).
__device__ __forceinline__ u32 clamped_expert(int64_t e, u32 experts) {
  return u32(e < 0 ? 0 : (e >= int64_t(experts) ? int64_t(experts) - 1 : e));
}

// The MoE's SwiGLU of one intermediate element from its gate and up sums.
__device__ __forceinline__ float swiglu(float gate, float up) { return gate / (1.f + __expf(-gate)) * up; }

struct TrellisBlockOperand {
  cuda_backend::TrellisMatrixPtrs w;
  u32 which;   // index into args.w / args.out
  u32 slot;    // the expert slot (grid.z within the matrix)
  u32 e;
  bool valid;  // false: an expert slot the routing left empty (the block exits)
};

__device__ __forceinline__ TrellisBlockOperand trellis_block_operand(const cuda_backend::TrellisKernelArgs& a) {
  TrellisBlockOperand o;
  o.which = blockIdx.z >= a.experts ? 1u : 0u;
  o.slot = o.e = blockIdx.z - o.which * a.experts;
  o.valid = true;
  if (a.row_experts != nullptr) {
    o.e = clamped_expert(a.row_experts_int64 ? static_cast<const int64_t*>(a.row_experts)[o.slot]
                                             : int64_t(static_cast<const int32_t*>(a.row_experts)[o.slot]),
                         a.num_experts);
  } else if (a.active_experts != nullptr) {
    const int32_t v = a.active_experts[o.e];
    o.valid = v >= 0;
    o.e = o.valid ? u32(v) : 0u;
  }
  o.w = o.which ? a.w[1] : a.w[0];
  o.w.packed += o.e * o.w.packed_stride;
  o.w.scales += o.e * o.w.scales_stride;
  o.w.grid += o.e * o.w.grid_stride;
  o.w.su += o.e * o.w.su_stride;
  o.w.sv += o.e * o.w.sv_stride;
  return o;
}

// One activation of sorted row `row` (gathered through row_map), column k, in fp32. TA is the
// stored type of A (T or float); with SWIGLU, A and A2 are the gate and up partials.
template <typename TA, bool SWIGLU>
__device__ __forceinline__ float trellis_load_act(const cuda_backend::TrellisKernelArgs& a, u32 row, u32 k) {
  const uint64_t src = a.row_map != nullptr ? uint64_t(a.row_map[row]) : uint64_t(row);
  if constexpr (SWIGLU) {
    const float* gp = static_cast<const float*>(a.A) + src * a.lda + k;
    const float* up = a.A2 + src * a.lda + k;
    float gs = 0.f, us = 0.f;
    for (u32 p = 0; p < a.a_parts; ++p) {  // K slices in order: deterministic
      gs += gp[p * a.a_part_stride];
      us += up[p * a.a_part_stride];
    }
    return swiglu(gs, us);
  } else if constexpr (std::is_same<TA, float>::value) {
    return static_cast<const float*>(a.A)[src * a.lda + k];
  } else {
    return Tr<TA>::to_f(static_cast<const TA*>(a.A)[src * a.lda + k]);
  }
}

// A lane's 8 x bits bytes of a CUDA lane-layout chunk in shared memory (8-byte aligned; 16 at 2
// and 4 bits) as words: the streaming decode and the wgmma prefill.
template <u32 BITS>
__device__ __forceinline__ void load_lane_words(const unsigned char* src, u32 (&v)[2 * BITS]) {
  if constexpr (BITS == 3) {
#pragma unroll
    for (u32 i = 0; i < 3; ++i) {
      const uint2 q = *reinterpret_cast<const uint2*>(src + 8u * i);
      v[2 * i] = q.x;
      v[2 * i + 1] = q.y;
    }
  } else {
#pragma unroll
    for (u32 i = 0; i < BITS / 2; ++i) {
      const uint4 q = *reinterpret_cast<const uint4*>(src + 16u * i);
      v[4 * i] = q.x;
      v[4 * i + 1] = q.y;
      v[4 * i + 2] = q.z;
      v[4 * i + 3] = q.w;
    }
  }
}

// The 8 x bits bits of tile row j in a lane's words v of a CUDA lane-layout chunk (its 4 fields,
// lowest first; docs/trellis.md, "CUDA lane layout"): the streaming decode and the lane dequant.
template <u32 BITS>
__device__ __forceinline__ u32 lane_tile_bits(const u32 (&v)[2 * BITS], u32 j) {
  const u32 bit = j * 8u * BITS, word = bit / 32u, shift = bit % 32u;
  if (shift + 8u * BITS <= 32u) return v[word] >> shift;
  return __funnelshift_r(v[word], v[word + 1u], shift);
}

// Calls f(std::integral_constant<u32, B>{}) with the bit width B = bits (2, 3 or 4): the launchers'
// one step from the plan's runtime value to a kernel's template parameter.
template <class F>
void with_trellis_bits(u32 bits, F&& f) {
  switch (bits) {
    case 2: return f(std::integral_constant<u32, 2>{});
    case 3: return f(std::integral_constant<u32, 3>{});
    case 4: return f(std::integral_constant<u32, 4>{});
    default: TORCH_CHECK(false, "torch_marlin: trellis bits must be 2, 3 or 4, got ", bits);
  }
}

}  // namespace
}  // namespace torch_marlin
