// Python-facing helpers of the planner, shared by torch_marlin._C (csrc/ops/library.cpp) and the
// Metal-on-CPU harness (csrc/metal_emu/bindings.cpp): names <-> enums and a plan as a dict.
#pragma once

#include <torch/extension.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "plan/plan.h"

namespace torch_marlin {

template <class E>
E parse_name(const std::string& s, std::initializer_list<std::pair<const char*, E>> table, const char* what) {
  for (const auto& kv : table) {
    if (s == kv.first) return kv.second;
  }
  std::string allowed;
  for (const auto& kv : table) allowed += std::string(allowed.empty() ? "" : ", ") + kv.first;
  TORCH_CHECK_VALUE(false, what, " must be one of {", allowed, "}, got '", s, "'");
}

inline QuantFormat parse_format(const std::string& s) {
  return parse_name<QuantFormat>(s, {{"fp4", QuantFormat::FP4}, {"u4", QuantFormat::U4}}, "format");
}

inline Backend parse_backend(const std::string& s) {
  return parse_name<Backend>(s, {{"cpu", Backend::CPU}, {"metal", Backend::Metal}, {"cuda", Backend::CUDA}},
                             "backend");
}

inline DType parse_dtype(const std::string& s) {
  return parse_name<DType>(s, {{"float16", DType::F16}, {"bfloat16", DType::BF16}, {"float32", DType::F32}},
                           "dtype");
}

inline GemmVariant parse_variant(const std::string& s) {
  return parse_name<GemmVariant>(s,
                                 {{"auto", GemmVariant::Auto},
                                  {"decode", GemmVariant::Decode},
                                  {"tiled", GemmVariant::Tiled},
                                  {"tiled_staged", GemmVariant::TiledStaged},
                                  {"striped", GemmVariant::Striped},
                                  {"dequant_blas", GemmVariant::DequantBlas},
                                  {"warp_specialized", GemmVariant::WarpSpecialized}},
                                 "variant");
}

inline py::dict plan_to_dict(const GemmPlan& p) {
  const QuantGemmParams& q = p.params;
  py::dict d;
  d["variant"] = variant_name(p.variant);
  d["kernel"] = p.kernel;
  d["reduce_kernel"] = p.reduce_kernel;
  d["grid"] = py::make_tuple(p.grid[0], p.grid[1], p.grid[2]);
  d["threads"] = py::make_tuple(p.threads[0], p.threads[1], p.threads[2]);
  d["reduce_grid"] = py::make_tuple(p.reduce_grid[0], p.reduce_grid[1], p.reduce_grid[2]);
  d["workspace_bytes"] = p.workspace_bytes;
  d["tile_m"] = q.tile_m;
  d["tile_n"] = q.tile_n;
  d["m_tiles"] = q.m_tiles;
  d["n_tiles"] = q.n_tiles;
  d["k_parallel"] = q.k_parallel;
  d["k_slice_len"] = q.k_slice_len;
  d["num_groups"] = q.num_groups;
  d["tail_n_tiles"] = p.tail_n_tiles;
  d["tail_k_parallel"] = p.tail_k_parallel;
  d["tail_k_slice_len"] = p.tail_k_slice_len;
  d["dependent_launch"] = p.dependent_launch;
  return d;
}

}  // namespace torch_marlin
