"""Metal-on-CPU harness, Python side (test-time only; never imported by ``import torch_marlin``).

``load()`` JIT-builds (torch.utils.cpp_extension.load, cached under build/metal_emu/) a module
that compiles the FP4 / INT4 kernel files (``QUANT_SOURCES``) as C++ over the shim in
csrc/metal_emu/metal_stdlib, one translation unit per .metal file (each file is a library of its
own), links the executor and the planner (csrc/plan/*.cpp), and exposes:

  gemm(format, A, B_packed, scales, zeros_or_offsets, bias, group_size, family="auto", compute_units=0,
       schedule="forward", seed=0, workers=0, prefix="", swap_buffers=[]) -> (C, plan dict)
  dequant(format, B_packed, scales, zeros_or_offsets, group_size, ...) -> W
  gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N, group_size,
            channels_per_tile, bias=None, ...) -> (C, plan dict)
  rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile, ...) -> B_packed
  describe_gemm(format, M, K, N, group_size, ...), describe_dequant(...), describe_gemm_rans(...),
  describe_rans_decode(...) -> the dispatch list
      (csrc/plan/metal_dispatch.h, the one the MPS backend encodes) with buffers as names
  dispatch_raw(kernel, grid, threads, buffers, ...), kernel_names(), last_stats()

gemm and dequant run exactly the dispatch list the MPS backend encodes for the same plan.
The same module also holds a "barrier-switch" copy of every kernel (names prefixed with
``barrier_switch:``) in which each tagged barrier can be dropped at run time; the
barrier-removal tests use it to show the harness catches a missing barrier.
tests/metal_load_trace.py builds a separate, load-traced copy of these modules (clang).
See docs/metal.md.
"""

import contextlib
import fcntl
import glob
import importlib.util
import os
import platform
import re
import sys
import time

from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METAL_DIR = os.path.join(ROOT, "metal")
INCLUDE_DIR = os.path.join(ROOT, "csrc", "include")
EMU_DIR = os.path.join(ROOT, "csrc", "metal_emu")
QUANT_SOURCES = [os.path.join(METAL_DIR, f) for f in
                 ("decode.metal", "fused_tiles.metal", "staged_tiles.metal", "striped.metal", "reduce.metal",
                  "dequant.metal", "rans.metal")]
SELFTEST_SOURCE = os.path.join(ROOT, "tests", "metal", "emu_selftest.metal")
PLAN_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "plan", "*.cpp")))

_spec = importlib.util.spec_from_file_location("embed_metal", os.path.join(ROOT, "csrc", "mps", "embed_metal.py"))
embed_metal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(embed_metal)

_modules = {}

#: The JIT-built harness modules and their build folders (tests/conftest.py reports which exist).
HARNESS_MODULES = {"tm_metal_emu": "build/metal_emu", "tm_trellis_metal_emu": "build/trellis_metal_emu",
                   "tm_metal_emu_trace": "build/metal_emu_trace",
                   "tm_trellis_metal_emu_trace": "build/trellis_metal_emu_trace"}
# What the modules are compiled from, for telling whether a build will compile anything.
_BUILD_INPUTS = [os.path.join(ROOT, d, "**", "*") for d in ("metal", "tests/metal", "csrc/metal_emu", "csrc/include",
                                                          "csrc/plan")]


def announce(message):
    """Build messages; tests/conftest.py replaces this to print past pytest's output capture."""
    print(message, file=sys.stderr, flush=True)


def built_module(name):
    """The harness module's shared library, or None when it has not been built."""
    found = glob.glob(os.path.join(ROOT, HARNESS_MODULES[name], name + "*.so"))
    return found[0] if found else None


def _why_compile(name):
    """Why loading the module will compile (no module yet, or a source newer than it); None when it will not."""
    lib = built_module(name)
    if lib is None:
        return "first build, several minutes on 2 cores"
    inputs = [f for pattern in _BUILD_INPUTS for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
    return "sources changed" if os.path.getmtime(lib) < max(map(os.path.getmtime, inputs)) else None


@contextlib.contextmanager
def build_lock(build_dir, waiting_message=None):
    """Held while one process prepares and builds the module of ``build_dir`` (a file lock beside
    it): test processes that need it at once (pytest-xdist workers, two pytest runs) build it one
    after another, the later ones reusing it. ``waiting_message`` is announced when another holds it."""
    os.makedirs(build_dir, exist_ok=True)
    with open(build_dir.rstrip(os.sep) + ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting_message:
                announce(waiting_message)
            fcntl.flock(lock, fcntl.LOCK_EX)
        # cpp_extension's own lock file, left behind by a build that was killed, would make its
        # load wait forever; no build of this folder runs while this lock is held, so it is stale.
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_with_notice(name, build):
    """Runs ``build()`` (which writes the generated sources into the module's folder and builds
    it) under the module's build lock, with a line before and after when it will compile: a first
    build takes minutes and prints nothing else."""
    waiting = f"tests: waiting for another test process to build {name} ..." if _why_compile(name) else None
    with build_lock(os.path.join(ROOT, HARNESS_MODULES[name]), waiting):
        why = _why_compile(name)
        if why is None:
            return build()
        announce(f"tests: compiling the Metal-on-CPU harness module {name} into {HARNESS_MODULES[name]}/ ({why}) ...")
        t0 = time.perf_counter()
        mod = build()
        announce(f"tests: {name} ready after {time.perf_counter() - t0:.0f} s")
        return mod


def _write_if_changed(path, text):
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


BARRIER_SWITCH_PREFIX = "barrier_switch:"
_BARRIER_RE = re.compile(r"^(\s*)((?:threadgroup|simdgroup)_barrier\(mem_flags::mem_\w+\));\s*// \[barrier:(\w+)\]",
                         re.MULTILINE)


def barrier_switch_source(src, require_tags=True):
    """Rewrites every tagged barrier ``X_barrier(...);  // [barrier:name]`` into
    ``if (!metal_emu::barrier_dropped("name")) X_barrier(...);`` so one build can run each kernel
    intact or with exactly one barrier removed (``set_dropped_barrier(name)``)."""
    out, n = _BARRIER_RE.subn(r'\1if (!::metal_emu::barrier_dropped("\3")) \2;  // [barrier:\3] (switchable)', src)
    if n == 0 and require_tags:
        raise ValueError("no tagged barriers found in the kernel source")
    return out


def inlined(path):
    """A .metal file with the MSL headers it includes inlined (tagged barriers may live there)."""
    return embed_metal.file_source(path, INCLUDE_DIR)


def barrier_tags(sources=None):
    """Tags of the barriers the kernels of ``sources`` (default QUANT_SOURCES) run, each once."""
    tags = []
    for path in QUANT_SOURCES if sources is None else sources:
        for m in _BARRIER_RE.finditer(inlined(path)):
            if m.group(3) not in tags:
                tags.append(m.group(3))
    return tags


def kernel_units(sources, build_dir, generator):
    """Generated translation units for ``sources``: per .metal file, one compiling it as it is and
    one compiling its barrier-switch copy (headers inlined, so barriers in shared headers switch
    too) inside its own namespace, kernel names prefixed with BARRIER_SWITCH_PREFIX."""
    units = []
    for path in sources:
        stem = os.path.splitext(os.path.basename(path))[0]
        pristine = os.path.join(build_dir, f"kernels_{stem}.cpp")
        _write_if_changed(pristine, f'// generated by {generator}\n#include "{path}"\n')
        copy = os.path.join(build_dir, f"{stem}_barrier_switch.metal")
        _write_if_changed(copy, barrier_switch_source(inlined(path), require_tags=False))
        switch = os.path.join(build_dir, f"kernels_{stem}_barrier_switch.cpp")
        _write_if_changed(switch, (
            f"// generated by {generator}\n"
            "#include <metal_stdlib>\n"
            "#undef TM_EMU_KERNEL_PREFIX\n"
            f'#define TM_EMU_KERNEL_PREFIX "{BARRIER_SWITCH_PREFIX}"\n'
            "namespace tm_barrier_switch {\n"
            f'#include "{copy}"\n'
            "}\n"))
        units += [pristine, switch]
    if not barrier_tags(sources):
        raise ValueError("no tagged barriers found in the kernel sources")
    return units


def build_module(name, emu_sources, other_sources, build_dir, verbose=False):
    """JIT-builds one harness module: executor + bindings from csrc/metal_emu/ (emu_sources), the
    planner and the generated kernel translation units (other_sources)."""
    cflags = ["-O2", "-std=c++17", "-Wno-attributes", "-Wno-unused-parameter", "-fno-strict-aliasing"]
    if platform.machine() in ("x86_64", "AMD64"):
        cflags.append("-mf16c")  # hardware half <-> float conversions for _Float16
    return cpp_extension.load(
        name=name,
        sources=[os.path.join(EMU_DIR, f) for f in emu_sources] + list(other_sources),
        extra_include_paths=[os.path.join(ROOT, "csrc"), INCLUDE_DIR, EMU_DIR],
        extra_cflags=cflags,
        build_directory=build_dir,
        verbose=verbose,
    )


def load(verbose=False):
    """Builds (or reuses) the harness module of QUANT_SOURCES and the executor self-test kernels."""
    if "mod" in _modules:
        return _modules["mod"]
    build_dir = os.path.join(ROOT, HARNESS_MODULES["tm_metal_emu"])

    def build():
        units = kernel_units(QUANT_SOURCES, build_dir, "tests/metal_emu.py")
        selftest_tu = os.path.join(build_dir, "kernels_selftest.cpp")
        _write_if_changed(selftest_tu, '// generated by tests/metal_emu.py\n#include "%s"\n' % SELFTEST_SOURCE)
        return build_module("tm_metal_emu", ["bindings.cpp", "rans_bindings.cpp", "runtime.cpp"],
                            PLAN_SOURCES + units + [selftest_tu], build_dir, verbose)

    mod = build_with_notice("tm_metal_emu", build)
    _modules["mod"] = mod
    return mod


# ---- the ops "as Metal": same signatures as torch.ops.marlin.*, CPU tensors in and out -----------
# Extra keywords: family ("auto" = the planner's policy), compute_units (0 = default_metal_caps),
# schedule / seed (thread order of the executor). gemm_* return C; pass return_plan=True for
# (C, plan).

def gemm_fp4(A, B_packed, scales, group_size, bias=None, *, family="auto", compute_units=0, schedule="forward",
             seed=0, return_plan=False):
    C, plan = load().gemm("fp4", A, B_packed, scales, None, bias, group_size, family, compute_units, schedule, seed)
    return (C, plan) if return_plan else C


def gemm_u4(A, B_packed, scales, zeros, group_size, bias=None, *, family="auto", compute_units=0,
            schedule="forward", seed=0, return_plan=False):
    C, plan = load().gemm("u4", A, B_packed, scales, zeros, bias, group_size, family, compute_units, schedule, seed)
    return (C, plan) if return_plan else C


def dequant_fp4(B_packed, scales, group_size, *, schedule="forward", seed=0):
    return load().dequant("fp4", B_packed, scales, None, group_size, schedule, seed)


def dequant_u4(B_packed, scales, zeros, group_size, *, schedule="forward", seed=0):
    return load().dequant("u4", B_packed, scales, zeros, group_size, schedule, seed)


def gemm_affine(A, B_packed, scales, offsets, group_size, bias=None, *, family="auto", compute_units=0,
                schedule="forward", seed=0, return_plan=False):
    C, plan = load().gemm("affine", A, B_packed, scales, offsets, bias, group_size, family, compute_units, schedule,
                          seed)
    return (C, plan) if return_plan else C


def dequant_affine(B_packed, scales, offsets, group_size, *, schedule="forward", seed=0):
    return load().dequant("affine", B_packed, scales, offsets, group_size, schedule, seed)


def gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N, group_size,
              channels_per_tile, bias=None, *, schedule="forward", seed=0, return_plan=False):
    C, plan = load().gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N, group_size,
                               channels_per_tile, bias, schedule, seed)
    return (C, plan) if return_plan else C


def rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile, *, schedule="forward", seed=0):
    return load().rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile, schedule, seed)
