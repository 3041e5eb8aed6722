"""Metal-on-CPU harness for the trellis kernels (test-time only; see tests/metal_emu.py and docs/metal.md).

``load()`` JIT-builds (cached under build/trellis_metal_emu/) a module that compiles
metal/trellis_gemm.metal and metal/trellis_moe.metal as C++ over the shim in csrc/metal_emu/ (one
translation unit per file), links the executor (csrc/metal_emu/runtime.cpp), the planner
(csrc/plan/*.cpp) and csrc/metal_emu/trellis_bindings.cpp, and exposes

  gemm(A, weights, K, N, bits, group_size, family="auto", schedule="forward", seed=0, workers=0, prefix="")
      -> (C, plan dict)
  dequant(weights, K, N, bits, group_size, ...) -> W (f32)
  moe(x, gate, up, down, expert_ids, expert_probs, intermediate_size, bits, group_size, ...) -> (y, plan dict)
  describe_gemm / describe_dequant / describe_moe(...) -> the dispatch list with buffers as names
  kernel_names(), set_dropped_barrier(name), last_stats()

``weights`` are 5-tuples (packed_indices, scales, grid, su, sv). gemm, dequant and moe run exactly
the dispatch list (csrc/plan/metal_dispatch.h) the MPS backend encodes. Beside the pristine kernels
the module holds a barrier-switch copy (names prefixed ``barrier_switch:``), as tests/metal_emu.py.
"""

import os

import metal_emu

ROOT = metal_emu.ROOT
SOURCES = [os.path.join(metal_emu.METAL_DIR, "trellis_gemm.metal"), os.path.join(metal_emu.METAL_DIR, "trellis_moe.metal")]
BARRIER_SWITCH_PREFIX = metal_emu.BARRIER_SWITCH_PREFIX

_modules = {}


def barrier_tags():
    return metal_emu.barrier_tags(SOURCES)


def load(verbose=False):
    if "mod" in _modules:
        return _modules["mod"]
    build_dir = os.path.join(ROOT, metal_emu.HARNESS_MODULES["tm_trellis_metal_emu"])

    def build():
        units = metal_emu.kernel_units(SOURCES, build_dir, "tests/trellis_metal_emu.py")
        return metal_emu.build_module("tm_trellis_metal_emu", ["trellis_bindings.cpp", "runtime.cpp"],
                                      metal_emu.PLAN_SOURCES + units, build_dir, verbose)

    mod = metal_emu.build_with_notice("tm_trellis_metal_emu", build)
    _modules["mod"] = mod
    return mod


# ---- the ops "as Metal": same signatures as torch_marlin.ops.*, CPU tensors in and out ------------
# Extra keywords: family ("auto" = the planner's policy; gemm only), schedule / seed (thread order
# of the executor). Pass return_plan=True for (result, plan).

def gemm_trellis(A, packed_indices, scales, grid, su, sv, K, N, bits, group_size, *, family="auto",
                 schedule="forward", seed=0, return_plan=False):
    C, plan = load().gemm(A, [packed_indices, scales, grid, su, sv], K, N, bits, group_size, family, schedule, seed)
    return (C, plan) if return_plan else C


def dequant_trellis(packed_indices, scales, grid, su, sv, K, N, bits, group_size, *, schedule="forward", seed=0):
    return load().dequant([packed_indices, scales, grid, su, sv], K, N, bits, group_size, schedule, seed)


def moe_trellis(x, gate, up, down, expert_ids, expert_probs, intermediate_size, bits, group_size, *,
                schedule="forward", seed=0, return_plan=False):
    y, plan = load().moe(x, list(gate), list(up), list(down), expert_ids, expert_probs, intermediate_size, bits,
                         group_size, schedule, seed)
    return (y, plan) if return_plan else y
