// The Metal dispatch description: the ordered dispatches every op of the Metal backend encodes
// for a plan, one per launch of the plan's LaunchList in its order (kernel, grid, threadgroup size),
// with the buffers of the launch's role in the kernel's [[buffer(i)]] order and the bytes of its
// params struct (the last buffer slot).
//
// csrc/mps/*.mm encodes this list on the MPS stream; the Metal-on-CPU harness
// (csrc/metal_emu/*bindings.cpp) runs the same list on its CPU executor. Both go through the
// functions below, so the harness tests exercise the binding a Mac runs: a buffer in the wrong
// slot or a missing dispatch fails them (tests/test_metal_dispatch.py also compares every buffer
// list with the kernels' declarations).
//
// Portable C++17: no torch, no Objective-C. A buffer is a handle of the caller's choosing (the
// template parameter Buffer): an MTLBuffer with its offset on the Mac, a host pointer in the
// harness, a name in the tests. Slots a kernel declares but does not read for this call get a
// stand-in (Metal wants every declared buffer bound); the buffer structs document which.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/plan.h"
#include "plan/rans_plan.h"
#include "plan/trellis_plan.h"
#include "torch_marlin/quant_gemm_params.h"
#include "torch_marlin/trellis_params.h"

namespace torch_marlin {

template <class Buffer>
struct MetalDispatch {
  std::string kernel;                   // host name of the kernel in the Metal library
  uint32_t grid[3] = {1, 1, 1};         // threadgroups per grid (dispatchThreadgroups)
  uint32_t threads[3] = {1, 1, 1};      // threads per threadgroup
  std::vector<Buffer> buffers;          // [[buffer(0)]] .. [[buffer(n - 1)]]
  const char* params_type = "";         // MSL name of the struct bound at [[buffer(n)]]
  std::vector<unsigned char> params;    // its bytes (setBytes)
};

template <class Buffer>
using MetalDispatches = std::vector<MetalDispatch<Buffer>>;

// ---- FP4 / INT4 / affine INT4 -----------------------------------------------------------------------------

template <class Buffer>
struct QuantGemmBuffers {
  Buffer A;                         // [M, K] activations (buffers start 16-byte aligned: ops/vector_aligned.h)
  Buffer B;                         // int32 [K/8, N] packed weights
  Buffer scales;                    // [K/group_size, N]
  std::optional<Buffer> zeros_or_offsets;  // uint8 zero points (INT4) or offsets in the scales' dtype
                                           // (affine); absent (FP4): scales stands in
  std::optional<Buffer> bias;       // [N]; absent: C stands in (params.has_bias = 0, never read)
  Buffer C;                         // [M, N] output
  std::optional<Buffer> workspace;  // fp32 [k_parallel, M, N] partials; needed when the plan splits
                                    // K, else absent and C stands in
};

template <class Buffer>
struct QuantDequantBuffers {
  Buffer B;                     // int32 [K/8, N]
  Buffer scales;                // [K/group_size, N]
  std::optional<Buffer> zeros_or_offsets;  // as in QuantGemmBuffers
  Buffer W;                     // [K, N] output, dtype of scales
};

// ---- trellis ------------------------------------------------------------------------------------

template <class Buffer>
struct TrellisWeightBuffers {
  Buffer packed, scales, grid, su, sv;  // docs/formats.md; a leading expert dim for the MoE
};

template <class Buffer>
struct TrellisGemmBuffers {
  Buffer A;  // [M, K]
  TrellisWeightBuffers<Buffer> w;
  Buffer C;  // [M, N]
};

template <class Buffer>
struct TrellisDequantBuffers {
  TrellisWeightBuffers<Buffer> w;
  Buffer W;  // f32 [K, N]
};

// The routed MoE (csrc/ops/trellis.h, TrellisMoeArgs, documents the routing tensors).
template <class Buffer>
struct TrellisMoeBuffers {
  Buffer x;                                       // [T, hidden]
  Buffer sorted_token, expert_offsets, slot_row;  // int32 routing
  Buffer probs;                                   // f32 [T, top_k]
  TrellisWeightBuffers<Buffer> gate, up, down;
  Buffer rows_h;                                  // f32 [T*top_k, intermediate] scratch
  Buffer rows_y;                                  // f32 [T*top_k, hidden] scratch
  Buffer y;                                       // [T, hidden] output
};

// ---- rANS-coded 4-bit codes ----------------------------------------------------------------------

template <class Buffer>
struct RansCodeBuffers {
  Buffer words;         // int16 [W] (read as 16-byte vectors: starts 16-byte aligned)
  Buffer word_offsets;  // int32 [T + 1]
  Buffer states;        // int32 [T, 32]
  Buffer freqs;         // int16 [T, 16] (32 bytes per tile, read as two 16-byte vectors)
};

template <class Buffer>
struct RansGemmBuffers {
  Buffer A;                                // [M, K]
  RansCodeBuffers<Buffer> code;
  Buffer scales;                           // [K/group_size, N]
  std::optional<Buffer> zeros_or_offsets;  // as in QuantGemmBuffers
  std::optional<Buffer> bias;              // [N]; absent: C stands in
  Buffer C;                                // [M, N]
  std::optional<Buffer> decoded;           // int32 [K/8, N] scratch of the staged family
  std::optional<Buffer> workspace;         // the staged GEMM's K-parallel partials, as in QuantGemmBuffers
};

template <class Buffer>
struct RansDecodeBuffers {
  RansCodeBuffers<Buffer> code;
  Buffer B_packed;  // int32 [K/8, N] output
};

namespace metal_dispatch_detail {

[[noreturn]] inline void unexpected_launch(LaunchRole role, const char* op) {
  throw std::logic_error(std::string("Metal dispatch: ") + op + " has no " + launch_role_name(role) + " stage");
}

template <class Buffer, class Params>
MetalDispatch<Buffer> make(const KernelLaunch& l, std::vector<Buffer> buffers, const char* params_type,
                           const Params& params) {
  if (l.kernel.empty()) throw std::logic_error("Metal dispatch: the plan names no kernel");
  MetalDispatch<Buffer> d;
  d.kernel = l.kernel;
  for (int i = 0; i < 3; ++i) {
    d.grid[i] = l.grid[i];
    d.threads[i] = l.threads[i];
  }
  d.buffers = std::move(buffers);
  d.params_type = params_type;
  d.params.resize(sizeof(Params));
  std::memcpy(d.params.data(), &params, sizeof(Params));
  return d;
}

template <class Buffer>
MetalDispatch<Buffer> make(const KernelLaunch& l, std::vector<Buffer> buffers, const TrellisParams& p) {
  return make<Buffer>(l, std::move(buffers), "TrellisParams", p);
}

// The params of a rANS plan with the word count of the call: every kernel clamps the tiles'
// streams to it (the planner does not see the data).
template <class Buffer>
MetalDispatch<Buffer> make(const RansPlan& plan, std::vector<Buffer> buffers, uint32_t n_words) {
  RansParams p = plan.params;
  p.n_words = n_words;
  return make<Buffer>(plan.launches.at(LaunchRole::Decode), std::move(buffers), "RansParams", p);
}

}  // namespace metal_dispatch_detail

// C = A @ dequant(B) (+ bias): the plan's kernel (marlin_gemv_* / marlin_gemm_fused_* /
// marlin_gemm_* / marlin_gemm_striped_*), then, when the plan splits K, the reduction of the
// partials (marlin_reduce_partials_*) on the same serial encoder, so it sees every partial.
template <class Buffer>
MetalDispatches<Buffer> quant_gemm_dispatches(const GemmPlan& plan, const QuantGemmBuffers<Buffer>& b) {
  using metal_dispatch_detail::make;
  const QuantGemmParams& p = plan.params;
  const bool split_k = p.k_parallel > 1u || plan.launches.find(LaunchRole::Reduce) != nullptr;
  if (split_k && !b.workspace) throw std::logic_error("Metal dispatch: K-parallel plan without a workspace");
  const Buffer zeros_or_offsets = b.zeros_or_offsets ? *b.zeros_or_offsets : b.scales;
  const Buffer bias = b.bias ? *b.bias : b.C;
  const Buffer workspace = b.workspace ? *b.workspace : b.C;
  const QuantReduceParams rp{p.M, p.N, p.k_parallel, p.has_bias};
  MetalDispatches<Buffer> out;
  for (const auto& [role, l] : plan.launches) {
    if (role == LaunchRole::Main) {
      out.push_back(
          make<Buffer>(l, {b.A, b.B, b.scales, zeros_or_offsets, bias, b.C, workspace}, "QuantGemmParams", p));
    } else if (role == LaunchRole::Reduce) {
      out.push_back(make<Buffer>(l, {workspace, bias, b.C}, "QuantReduceParams", rp));
    } else {
      metal_dispatch_detail::unexpected_launch(role, "quant_gemm");
    }
  }
  return out;
}

// W = dequant(B) (plan_quant_dequant_metal): dequant_<format>_<dtype>.
template <class Buffer>
MetalDispatches<Buffer> quant_dequant_dispatches(const GemmPlan& plan, const QuantDequantBuffers<Buffer>& b) {
  using metal_dispatch_detail::make;
  const Buffer zeros_or_offsets = b.zeros_or_offsets ? *b.zeros_or_offsets : b.scales;
  return {make<Buffer>(plan.launches.at(LaunchRole::Main), {b.B, b.scales, zeros_or_offsets, b.W}, "QuantGemmParams",
                       plan.params)};
}

// C = A @ W (plan_trellis_gemm): gemm_trellis_packed_decode_* or gemm_trellis_packed_*.
template <class Buffer>
MetalDispatches<Buffer> trellis_gemm_dispatches(const TrellisPlan& plan, const TrellisGemmBuffers<Buffer>& b) {
  using metal_dispatch_detail::make;
  const TrellisWeightBuffers<Buffer>& w = b.w;
  return {make<Buffer>(plan.launches.at(LaunchRole::Main), {b.A, w.packed, w.scales, w.grid, w.su, w.sv, b.C},
                       plan.params)};
}

// W = dequant(packed) (plan_trellis_dequant): dequant_trellis.
template <class Buffer>
MetalDispatches<Buffer> trellis_dequant_dispatches(const TrellisPlan& plan, const TrellisDequantBuffers<Buffer>& b) {
  using metal_dispatch_detail::make;
  const TrellisWeightBuffers<Buffer>& w = b.w;
  return {make<Buffer>(plan.launches.at(LaunchRole::Main), {w.packed, w.scales, w.grid, w.su, w.sv, b.W}, plan.params)};
}

// The MoE (plan_trellis_moe), in the plan's order: gate/up + SwiGLU for experts with <= 16 rows
// (Main), the tiled gate and up (with SwiGLU) for larger experts when planned, the down projection
// (GEMV, then tiled when planned), and the probability-weighted combine. One serial encoder:
// each dispatch sees the previous ones' writes (tiled_up reads the g that tiled_gate wrote).
template <class Buffer>
MetalDispatches<Buffer> trellis_moe_dispatches(const TrellisPlan& plan, const TrellisMoeBuffers<Buffer>& b) {
  using metal_dispatch_detail::make;
  const TrellisParams& p = plan.params;
  const TrellisWeightBuffers<Buffer>& g = b.gate;
  const TrellisWeightBuffers<Buffer>& u = b.up;
  const TrellisWeightBuffers<Buffer>& d = b.down;
  auto tiled = [&](const KernelLaunch& l, const Buffer& X, const TrellisWeightBuffers<Buffer>& w, const Buffer& o) {
    return make<Buffer>(l, {X, b.sorted_token, b.expert_offsets, w.packed, w.scales, w.grid, w.su, w.sv, o}, p);
  };
  MetalDispatches<Buffer> out;
  for (const auto& [role, l] : plan.launches) {
    switch (role) {
      case LaunchRole::Main:
        out.push_back(make<Buffer>(l,
                                   {b.x, b.sorted_token, b.expert_offsets, g.packed, g.scales, g.grid, g.su, g.sv,
                                    u.packed, u.scales, u.grid, u.su, u.sv, b.rows_h},
                                   p));
        break;
      case LaunchRole::TiledGate: out.push_back(tiled(l, b.x, g, b.rows_h)); break;
      case LaunchRole::TiledUp: out.push_back(tiled(l, b.x, u, b.rows_h)); break;
      case LaunchRole::Down:
        out.push_back(
            make<Buffer>(l, {b.rows_h, b.expert_offsets, d.packed, d.scales, d.grid, d.su, d.sv, b.rows_y}, p));
        break;
      case LaunchRole::TiledDown: out.push_back(tiled(l, b.rows_h, d, b.rows_y)); break;
      case LaunchRole::Combine: out.push_back(make<Buffer>(l, {b.rows_y, b.slot_row, b.probs, b.y}, p)); break;
      default: metal_dispatch_detail::unexpected_launch(role, "moe_trellis");
    }
  }
  return out;
}

// C = A @ dequant(decode(words)) (+ bias) (plan_rans_gemm). Fused: rans_gemv_*, the decode fused
// with the GEMV. Staged: rans_decode_packed into the scratch B_packed, then the dispatches of the
// plan's FP4 / INT4 GEMM on it (same serial encoder: the GEMM sees every decoded word).
// n_words = len(words).
template <class Buffer>
MetalDispatches<Buffer> rans_gemm_dispatches(const RansPlan& plan, const RansGemmBuffers<Buffer>& b, uint32_t n_words) {
  using metal_dispatch_detail::make;
  const RansCodeBuffers<Buffer>& c = b.code;
  const Buffer zeros_or_offsets = b.zeros_or_offsets ? *b.zeros_or_offsets : b.scales;
  const Buffer bias = b.bias ? *b.bias : b.C;
  if (plan.family == RansFamily::Fused) {
    return {make<Buffer>(plan, {b.A, c.words, c.word_offsets, c.states, c.freqs, b.scales, zeros_or_offsets, bias, b.C},
                         n_words)};
  }
  if (!b.decoded) throw std::logic_error("Metal dispatch: staged rANS plan without the decoded scratch buffer");
  MetalDispatches<Buffer> out;
  out.push_back(make<Buffer>(plan, {c.words, c.word_offsets, c.states, c.freqs, *b.decoded}, n_words));
  QuantGemmBuffers<Buffer> q{b.A, *b.decoded, b.scales, b.zeros_or_offsets, b.bias, b.C, b.workspace};
  for (MetalDispatch<Buffer>& d : quant_gemm_dispatches(plan.gemm, q)) out.push_back(std::move(d));
  return out;
}

// B_packed = decode(words) (plan_rans_decode): rans_decode_packed.
template <class Buffer>
MetalDispatches<Buffer> rans_decode_dispatches(const RansPlan& plan, const RansDecodeBuffers<Buffer>& b, uint32_t n_words) {
  using metal_dispatch_detail::make;
  const RansCodeBuffers<Buffer>& c = b.code;
  return {make<Buffer>(plan, {c.words, c.word_offsets, c.states, c.freqs, b.B_packed}, n_words)};
}

}  // namespace torch_marlin
