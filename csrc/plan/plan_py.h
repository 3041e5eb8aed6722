// Python-facing helpers of the planner, shared by torch_marlin._C (csrc/ops/library.cpp) and the
// Metal-on-CPU harness (csrc/metal_emu/): names <-> enums, caps <-> dicts, plans as dicts.
#pragma once

// ATen and torch's pybind11 casters, not <torch/extension.h> (all of libtorch's C++ API): half the
// compile time of the Metal-on-CPU harness modules, which the tests build on first use.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "plan/plan.h"
#include "plan/rans_plan.h"
#include "plan/trellis_plan.h"

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
  return parse_name<QuantFormat>(s, {{"fp4", QuantFormat::FP4}, {"u4", QuantFormat::U4}, {"affine", QuantFormat::Affine}}, "format");
}

inline Backend parse_backend(const std::string& s) {
  return parse_name<Backend>(s, {{"cpu", Backend::CPU}, {"metal", Backend::Metal}, {"cuda", Backend::CUDA}},
                             "backend");
}

inline DType parse_dtype(const std::string& s) {
  return parse_name<DType>(s, {{"float16", DType::F16}, {"bfloat16", DType::BF16}, {"float32", DType::F32}},
                           "dtype");
}

// The torch name of an activation dtype (what parse_dtype reads).
inline const char* dtype_arg_name(DType d) {
  switch (d) {
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F32: return "float32";
  }
  return "?";
}

inline KernelFamily parse_family(const std::string& s) {
  return parse_name<KernelFamily>(s,
                                  {{"auto", KernelFamily::Auto},
                                   {"decode", KernelFamily::Decode},
                                   {"dequant_blas", KernelFamily::DequantBlas},
                                   {"fused_tiles", KernelFamily::FusedTiles},
                                   {"staged_tiles", KernelFamily::StagedTiles},
                                   {"striped", KernelFamily::Striped},
                                   {"simt", KernelFamily::Simt},
                                   {"wgmma", KernelFamily::Wgmma},
                                   {"wgmma_ws", KernelFamily::WgmmaWs}},
                                  "family");
}

inline py::dict caps_to_dict(const DeviceCaps& c) {
  py::dict d;
  d["backend"] = backend_name(c.backend);
  d["compute_units"] = c.compute_units;
  d["max_shared_memory"] = c.max_shared_memory;
  d["wgmma"] = c.wgmma != 0;
  d["thread_block_clusters"] = c.thread_block_clusters != 0;
  d["avx2"] = c.avx2 != 0;
  d["avx512"] = c.avx512 != 0;
  return d;
}

// `backend`'s defaults (default_caps) with the keys `caps` names replaced. A "backend" key must
// agree with `backend`; other keys are refused.
inline DeviceCaps caps_from_dict(Backend backend, const py::dict& caps) {
  DeviceCaps c = default_caps(backend);
  for (const auto& kv : caps) {
    const std::string key = py::str(kv.first);
    const py::handle v = kv.second;
    if (key == "backend") {
      TORCH_CHECK_VALUE(parse_backend(py::str(v)) == backend, "caps['backend'] is '", std::string(py::str(v)),
                        "' but the plan is for ", backend_name(backend));
    } else if (key == "compute_units") {
      c.compute_units = v.cast<int>();
      TORCH_CHECK_VALUE(c.compute_units > 0, "caps['compute_units'] must be positive, got ", c.compute_units);
    } else if (key == "max_shared_memory") {
      c.max_shared_memory = v.cast<int>();
      TORCH_CHECK_VALUE(c.max_shared_memory > 0, "caps['max_shared_memory'] must be positive, got ",
                        c.max_shared_memory);
    } else if (key == "wgmma") {
      c.wgmma = v.cast<bool>() ? 1 : 0;
    } else if (key == "thread_block_clusters") {
      c.thread_block_clusters = v.cast<bool>() ? 1 : 0;
    } else if (key == "avx2") {
      c.avx2 = v.cast<bool>() ? 1 : 0;
    } else if (key == "avx512") {
      c.avx512 = v.cast<bool>() ? 1 : 0;
    } else {
      TORCH_CHECK_VALUE(false, "caps: unknown key '", key,
                        "' (keys: backend, compute_units, max_shared_memory, wgmma, thread_block_clusters, avx2, "
                        "avx512)");
    }
  }
  return c;
}

inline void add_caps(py::dict& d, const DeviceCaps& c) {
  for (const auto& kv : caps_to_dict(c)) d[kv.first] = kv.second;
}

inline py::tuple dims(const uint32_t v[3]) { return py::make_tuple(v[0], v[1], v[2]); }

inline py::dict launch_to_dict(const KernelLaunch& l) {
  py::dict d;
  d["kernel"] = l.kernel;
  d["grid"] = dims(l.grid);
  d["threads"] = dims(l.threads);
  d["k_parallel"] = l.k_parallel;
  d["k_slice_tiles"] = l.k_slice_tiles;
  d["dependent_launch"] = l.dependent_launch;
  return d;
}

// The plan's launches in execution order, each a launch_to_dict with its "role".
inline py::list launches_to_list(const LaunchList& launches) {
  py::list out;
  for (const auto& [role, launch] : launches) {
    py::dict d;
    d["role"] = launch_role_name(role);
    for (const auto& kv : launch_to_dict(launch)) d[kv.first] = kv.second;
    out.append(d);
  }
  return out;
}

// Every field of a GemmPlan a backend branches on, and the caps it was made for: the Main launch at
// the top level, the Reduce launch as reduce_*, the Tail launch as tail_*; all of them under
// "launches".
inline py::dict plan_to_dict(const GemmPlan& p) {
  const QuantGemmParams& q = p.params;
  const KernelLaunch& main = p.launches.at(LaunchRole::Main);
  const KernelLaunch none;  // a launch the plan lacks reads as an empty one
  const KernelLaunch& reduce = p.launches.find(LaunchRole::Reduce) ? p.launches.at(LaunchRole::Reduce) : none;
  const KernelLaunch* tail = p.launches.find(LaunchRole::Tail);
  py::dict d;
  d["family"] = family_name(p.desc.family);
  d["kernel"] = main.kernel;
  d["format"] = format_name(p.desc.format);
  d["dtype"] = dtype_arg_name(p.desc.dtype);
  d["reduce"] = reduce_name(p.desc.reduce);
  d["reduce_kernel"] = reduce.kernel;
  d["grid"] = dims(main.grid);
  d["threads"] = dims(main.threads);
  d["reduce_grid"] = dims(reduce.grid);
  d["reduce_threads"] = dims(reduce.threads);
  d["workspace_bytes"] = p.workspace_bytes;
  d["counters_offset"] = p.counters_offset;
  d["tile_m"] = q.tile_m;
  d["tile_n"] = q.tile_n;
  d["tile_k"] = p.desc.tile_k;
  d["m_tiles"] = q.m_tiles;
  d["n_tiles"] = q.n_tiles;
  d["k_parallel"] = q.k_parallel;
  d["k_slice_len"] = q.k_slice_len;
  d["num_groups"] = q.num_groups;
  d["consumers"] = p.desc.consumers;
  d["scale_group_sums"] = p.desc.scale_group_sums;
  d["vector_loads"] = p.desc.vector_loads;
  d["padded_n"] = p.padded_n;
  d["tail_n_tiles"] = tail ? tail->grid[1] : 0u;     // the Tail launch's column tiles
  d["tail_k_parallel"] = tail ? tail->grid[2] : 1u;  // and K slices
  d["tail_k_slice_len"] = p.tail_k_slice_len;
  d["dependent_launch"] = main.dependent_launch;
  d["launches"] = launches_to_list(p.launches);
  add_caps(d, p.caps);
  return d;
}

// The Main launch's keys at the top level, every other launch as a sub-dict under its role's name
// ("reduce", "down", "combine", ...), and all of them under "launches".
inline py::dict trellis_plan_to_dict(const TrellisPlan& p) {
  py::dict d = launch_to_dict(p.launches.at(LaunchRole::Main));
  d["family"] = family_name(p.family);
  d["tile_m"] = p.params.tile_m;
  d["tile_n"] = p.params.tile_n;
  d["m_tiles"] = p.params.m_tiles;
  d["n_tiles"] = p.params.n_tiles;
  d["k_chunk"] = p.k_chunk;
  d["tile_k"] = p.params.tile_k;
  d["k_vec4"] = p.params.k_vec4 != 0;
  d["cpu_avx2"] = p.cpu_avx2;
  d["cpu_avx512"] = p.cpu_avx512;
  d["cuda_stream_decode"] = p.cuda_stream_decode;
  d["cuda_stream_stage_groups"] = p.cuda_stream_stage_groups;
  d["index_layout"] = index_layout_name(p.index_layout);
  if (p.params.num_experts != 0) {
    d["down_k_vec4"] = p.params.down_k_vec4 != 0;
    d["moe_row_slots"] = p.moe_row_slots;
  }
  for (const auto& [role, launch] : p.launches) {
    if (role != LaunchRole::Main) d[launch_role_name(role)] = launch_to_dict(launch);
  }
  d["launches"] = launches_to_list(p.launches);
  add_caps(d, p.caps);
  return d;
}

// Every field of a RansPlan a backend branches on: the family, the per-tile Decode launch, the layer
// geometry and, for the staged family, the dense GEMM's own plan under "gemm"; "launches" lists the
// Decode launch and then the staged GEMM's.
inline py::dict rans_plan_to_dict(const RansPlan& p) {
  const KernelLaunch& decode = p.launches.at(LaunchRole::Decode);
  py::dict d;
  d["family"] = rans_family_name(p.family);
  d["kernel"] = decode.kernel;
  d["grid"] = dims(decode.grid);
  d["threads"] = dims(decode.threads);
  d["cpu_avx2"] = p.cpu_avx2;
  d["channels_per_tile"] = p.params.channels_per_tile;
  d["tiles"] = p.params.tiles;
  d["steps_per_channel"] = p.params.steps_per_channel;
  d["n_groups"] = p.params.n_groups;
  d["format"] = format_name(QuantFormat(p.params.format));
  d["has_bias"] = p.params.has_bias != 0;
  d["fused_max_m"] = TM_RANS_FUSED_MAX_M;
  d["tile_m"] = p.tile_m;
  py::list launches = launches_to_list(p.launches);
  if (p.family == RansFamily::Staged && p.gemm.launches.size() > 0) {  // rans_decode plans have no GEMM
    d["gemm"] = plan_to_dict(p.gemm);
    for (const auto& l : launches_to_list(p.gemm.launches)) launches.append(l);
  }
  d["launches"] = launches;
  add_caps(d, p.caps);
  return d;
}

}  // namespace torch_marlin
