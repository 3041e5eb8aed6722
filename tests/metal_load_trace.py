"""Device-memory load traces of the Metal kernels in the Metal-on-CPU harness (test-time only).

The traced harness modules are the normal ones (tests/metal_emu.py, tests/trellis_metal_emu.py)
rebuilt with the kernel translation units compiled by clang with
``-fsanitize-coverage=inline-8bit-counters,trace-loads``: every load instruction of a kernel calls
csrc/metal_emu/load_trace.cpp first, which keeps the loads whose address lies in a tensor the
bindings bound for the dispatch (attributed by name: A, B, scales, zeros_or_offsets, ...; packed, grid, su,
sv, ...; the params struct as "params"). The executor (g++) is not instrumented. Separate modules
(cached under build/metal_emu_trace/ and build/trellis_metal_emu_trace/), so the normal harness
tests never pay for tracing.

  load_quant() / load_trellis() -> module: the harness API plus trace_start / trace_stop
  trace(module, fn, max_threadgroups=0) -> [dispatch record]: runs fn() (which calls the module's
      gemm / moe / dispatch_raw) with tracing on; sites get a source location ("where")
  summarize(record) -> the per-kernel metrics (docs/metal.md, "Performance report")

TraceUnavailable is raised (with the reason) when no clang++ with the needed flags is found
(Debian: apt-get install -y clang).

Why clang, and how it differs from the g++ harness: clang 14 on x86-64 has no _Float16, so
`half` is clang's __fp16 there (storage in binary16, arithmetic in fp32); vectors (uint4, half4,
...) come from csrc/metal_emu/msl_vectors_clang.h so a vector load stays one load, and
-mllvm -disable-vector-combine keeps the optimizer from splitting it into scalar loads.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile

import metal_emu
import trellis_metal_emu

ROOT = metal_emu.ROOT
PROBE_SOURCE = os.path.join(ROOT, "tests", "metal", "perf_probes.metal")
SEGMENT_BYTES = 64

CLANG_FLAGS = [
    "-std=c++17", "-O2", "-g", "-fPIC", "-fdeclspec", "-fno-strict-aliasing",
    "-Wno-unknown-attributes", "-Wno-attributes",
    "-Xclang", "-fallow-half-arguments-and-returns",
    "-mllvm", "-disable-vector-combine",
    "-fsanitize-coverage=inline-8bit-counters,trace-loads",
    "-DTM_EMU_CLANG_VECTORS",
]


class TraceUnavailable(RuntimeError):
    """No compiler that can build the traced kernels (the message says why)."""


def is_weight(buffer_name):
    """The quantized weight tensors: B (FP4 / INT4), packed / g_packed / u_packed / d_packed
    (trellis), words (the rANS word stream). Their bytes are the denominator of "load instructions
    per weight byte"."""
    return buffer_name in ("B", "words") or buffer_name.endswith("packed")


def find_clang():
    cands = [os.environ.get("CLANGXX", "")] + ["clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]
    for c in cands:
        if c and shutil.which(c):
            return shutil.which(c)
    return None


_checked = {}


def clang_or_raise():
    """The clang++ that builds the traced kernels; TraceUnavailable when there is none that takes
    the flags (the probe compiles a vector load with them)."""
    if "clang" in _checked:
        if isinstance(_checked["clang"], Exception):
            raise _checked["clang"]
        return _checked["clang"]
    clang = find_clang()
    err = None
    if clang is None:
        err = TraceUnavailable("load tracing needs clang++ (Debian: apt-get install -y clang)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write('typedef __fp16 half;\n#include "msl_vectors_clang.h"\n'
                        "half h(half x) { return x; }\n"
                        "float4 c(const half4* p) { return float4(p[0]) + float4(1.0f); }\n"
                        "unsigned f(const uint4* p) { uint4 v = p[0]; return v.x + v.w; }\n")
            r = subprocess.run([clang, *CLANG_FLAGS, "-I", metal_emu.EMU_DIR, "-c", src, "-o",
                                os.path.join(tmp, "probe.o")], capture_output=True, text=True)
            if r.returncode != 0:
                err = TraceUnavailable(f"{clang} cannot build traced kernels "
                                       f"(-fsanitize-coverage=trace-loads and friends): {r.stderr.strip()[:400]}")
    _checked["clang"] = err if err is not None else clang
    if err is not None:
        raise err
    return clang


def _shim_text():
    text = ""
    for name in ("metal_stdlib", "msl_vectors_clang.h"):
        with open(os.path.join(metal_emu.EMU_DIR, name)) as f:
            text += f.read()
    return text


def _compile_kernels(clang, sources, build_dir):
    """One object per .metal file, named by a hash of everything it is built from, so the module
    relinks exactly when a kernel, a shared header, the shim or the flags change."""
    objs = []
    shim = _shim_text()
    for path in sources:
        stem = os.path.splitext(os.path.basename(path))[0]
        key = hashlib.sha256((metal_emu.inlined(path) + shim + " ".join(CLANG_FLAGS) + clang).encode()).hexdigest()[:16]
        obj = os.path.join(build_dir, f"traced_{stem}_{key}.o")
        if not os.path.exists(obj):
            tu = os.path.join(build_dir, f"traced_{stem}.cpp")
            with open(tu, "w") as f:
                f.write(f'// generated by tests/metal_load_trace.py\n#include "{path}"\n')
            cmd = [clang, *CLANG_FLAGS, "-I", os.path.join(ROOT, "csrc"), "-I", metal_emu.INCLUDE_DIR,
                   "-I", metal_emu.EMU_DIR, "-c", tu, "-o", obj + ".tmp"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"traced build of {path} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
            os.replace(obj + ".tmp", obj)
        objs.append(obj)
    return objs


_modules = {}


def _build(name, bindings, plan_sources, kernel_sources, build_dir, verbose=False):
    if name in _modules:
        return _modules[name]
    clang = clang_or_raise()
    os.makedirs(build_dir, exist_ok=True)

    def build():
        objs = _compile_kernels(clang, kernel_sources, build_dir)
        from torch.utils import cpp_extension
        cflags = ["-O2", "-std=c++17", "-Wno-attributes", "-Wno-unused-parameter", "-fno-strict-aliasing",
                  "-DTM_EMU_TRACE"]
        return cpp_extension.load(
            name=name,
            sources=[os.path.join(metal_emu.EMU_DIR, f) for f in (*bindings, "runtime.cpp", "load_trace.cpp")]
            + list(plan_sources),
            extra_include_paths=[os.path.join(ROOT, "csrc"), metal_emu.INCLUDE_DIR, metal_emu.EMU_DIR],
            extra_cflags=cflags,
            extra_ldflags=objs + ["-ldl"],
            build_directory=build_dir,
            verbose=verbose,
        )

    mod = metal_emu.build_with_notice(name, build)
    _modules[name] = mod
    return mod


def load_quant(verbose=False):
    """Traced module of the FP4 / INT4 kernels (metal_emu.QUANT_SOURCES) and the probe kernels of
    tests/metal/perf_probes.metal (dispatch_raw)."""
    return _build("tm_metal_emu_trace", ("bindings.cpp", "rans_bindings.cpp"), metal_emu.PLAN_SOURCES,
                  metal_emu.QUANT_SOURCES + [PROBE_SOURCE], os.path.join(ROOT, "build", "metal_emu_trace"), verbose)


def load_trellis(verbose=False):
    """Traced module of the trellis kernels (trellis_metal_emu.SOURCES)."""
    return _build("tm_trellis_metal_emu_trace", ("trellis_bindings.cpp",), metal_emu.PLAN_SOURCES,
                  trellis_metal_emu.SOURCES, os.path.join(ROOT, "build", "trellis_metal_emu_trace"), verbose)


# ---- tracing ----------------------------------------------------------------------------------

def trace(mod, fn, max_threadgroups=0):
    """Runs fn() with load tracing on; returns one record per dispatch it ran. With
    max_threadgroups > 0, at most that many threadgroups of each dispatch run (every k-th linear
    threadgroup id); the others do not run at all, so outputs are not meaningful then."""
    mod.trace_start(max_threadgroups)
    try:
        fn()
    finally:
        records = mod.trace_stop()
    symbolize(records)
    return records


def _symbolizer():
    for c in ("llvm-symbolizer", "llvm-symbolizer-14", "addr2line"):
        if shutil.which(c):
            return shutil.which(c)
    return None


def symbolize(records):
    """Adds site["where"] = "path:line function" (the innermost inlined frame of the load; paths
    relative to the checkout) to every site, when llvm-symbolizer or addr2line is installed."""
    tool = _symbolizer()
    by_module = {}
    for rec in records:
        for s in rec["sites"]:
            s["where"] = hex(s["site"])
            by_module.setdefault((rec["module_path"], rec["module_base"]), []).append(s)
    if tool is None:
        return
    for (path, base), sites in by_module.items():
        if not path:
            continue
        offsets = [hex(s["site"] - base - 1) for s in sites]
        # One block of frames per address, innermost frame first.
        try:
            if os.path.basename(tool).startswith("llvm-symbolizer"):
                out = subprocess.run([tool, "--obj=" + path, "--inlines", "--functions=short", "--demangle"] + offsets,
                                     capture_output=True, text=True, timeout=120).stdout
                blocks = [b.splitlines() for b in out.strip().split("\n\n")]
            else:
                blocks = [subprocess.run([tool, "-e", path, "-f", "-C", "-i", o], capture_output=True, text=True,
                                         timeout=60).stdout.splitlines() for o in offsets]
        except (OSError, subprocess.SubprocessError):
            continue
        for s, lines in zip(sites, blocks):
            if len(lines) < 2:
                continue
            func, loc = lines[0].strip(), lines[1].strip()
            file, _, rest = loc.partition(":")
            line = rest.split(":")[0]
            if file.startswith("/"):
                file = os.path.relpath(os.path.realpath(file), ROOT)
            s["where"] = f"{file}:{line} {func.split('<')[0].split('(')[0]}"


# ---- metrics ----------------------------------------------------------------------------------

def summarize(rec):
    """The per-kernel load metrics of one dispatch record (docs/metal.md, "Performance report"):

    loads_per_weight_byte  lane loads from every device buffer (the params struct excluded) per
                           distinct weight byte read (is_weight)
    weight_refetch         weight bytes fetched / distinct weight bytes (1.0: each byte once)
    weight_max_fetches     most fetches of a single weight byte (saturates at 255)
    weight_coalescing      over the weight loads' simdgroup-wide loads: distinct bytes used /
                           (64-byte segments touched x 64)
    buffers                per buffer: fetched, distinct (the minimum: each byte once), refetch
    sites                  per load site, most executed first
    """
    bufs = {k: v for k, v in rec["buffers"].items() if k != "params"}
    weights = {k: v for k, v in bufs.items() if is_weight(k)}
    loads = sum(v["lane_loads"] for v in bufs.values())
    w_unique = sum(v["unique_bytes"] for v in weights.values())
    w_fetched = sum(v["bytes_fetched"] for v in weights.values())
    w_sites = [s for s in rec["sites"] if is_weight(s["buffer"])]
    w_used = sum(s["used_bytes"] for s in w_sites)
    w_seg = sum(s["segments"] for s in w_sites)
    sites = []
    for s in sorted(rec["sites"], key=lambda s: -s["lane_loads"]):
        if s["buffer"] == "params":
            continue
        sites.append(dict(
            where=s.get("where", hex(s["site"])), buffer=s["buffer"], widths=s["widths"],
            lane_loads=s["lane_loads"],
            lanes=s["active_lanes"] / s["simd_loads"] if s["simd_loads"] else 0.0,
            coalescing=s["used_bytes"] / (s["segments"] * SEGMENT_BYTES) if s["segments"] else 0.0,
            loads_per_weight_byte=s["lane_loads"] / w_unique if w_unique else None))
    return dict(
        kernel=rec["kernel"], grid=tuple(rec["grid"]), threadgroups=rec["threadgroups"], traced=rec["traced"],
        weight_buffers=sorted(weights), weight_bytes=w_unique,
        lane_loads=loads,
        loads_per_weight_byte=loads / w_unique if w_unique else None,
        weight_refetch=w_fetched / w_unique if w_unique else None,
        weight_max_fetches=max((v["max_fetches"] for v in weights.values()), default=0),
        weight_coalescing=w_used / (w_seg * SEGMENT_BYTES) if w_seg else None,
        weight_load_widths=sorted({w for s in w_sites for w in s["widths"]}),
        buffers={k: dict(bytes=v["bytes"], fetched=v["bytes_fetched"], distinct=v["unique_bytes"],
                         refetch=v["bytes_fetched"] / v["unique_bytes"] if v["unique_bytes"] else 0.0,
                         max_fetches=v["max_fetches"], lane_loads=v["lane_loads"])
                 for k, v in bufs.items() if v["lane_loads"]},
        sites=sites)


# ---- problems: random tensors of a given shape, run through the op-shaped harness functions -----
# Values do not matter for the load pattern (random codes and indices are all legal); shapes,
# dtypes and the planner's choices do. Each function returns the dispatch records.

def _dtype(name):
    import torch
    return {"half": torch.float16, "float": torch.float32, "bfloat": torch.bfloat16}[name]


def trace_quant_gemm(fmt, M, K, N, group_size=128, dtype="half", max_threadgroups=0, seed=0):
    """C = A @ dequant(B) through the planner's kernel (fmt "fp4", "u4" or "affine"), traced."""
    import torch
    g = torch.Generator().manual_seed(seed)
    mod = load_quant()
    A = torch.randn(M, K, generator=g).to(_dtype(dtype))
    B = torch.randint(-2**31, 2**31 - 1, (K // 8, N), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(K // group_size, N, generator=g) * 0.1 + 0.01).to(_dtype(dtype))
    aux = None
    if fmt == "u4":
        aux = torch.randint(0, 16, (K // group_size, N), generator=g, dtype=torch.uint8)
    elif fmt == "affine":
        aux = (torch.rand(K // group_size, N, generator=g) - 0.5).to(_dtype(dtype))
    return trace(mod, lambda: mod.gemm(fmt, A, B, scales, aux, None, group_size), max_threadgroups)


def trace_rans_gemm(fmt, M, K, N, group_size=128, dtype="half", max_threadgroups=0, seed=0):
    """C = A @ dequant(decode(words)) through the planner's kernels, traced. The codes are those of
    a Gaussian weight quantized to the format (about 3.5 bits each after coding), the default
    channels per tile."""
    import numpy as np
    import torch

    from torch_marlin.formats import quantize_affine, quantize_fp4, quantize_u4, rans, unpack_int4
    g = torch.Generator().manual_seed(seed)
    mod = load_quant()
    w = torch.randn(K, N, generator=g)
    aux = zeros = offsets = None
    if fmt == "fp4":
        B, scales = quantize_fp4(w, group_size, scale_dtype=_dtype(dtype), search=False)
    elif fmt == "u4":
        B, scales, zeros = quantize_u4(w, group_size, scale_dtype=_dtype(dtype), search=False)
    else:
        B, scales, offsets = quantize_affine(w, group_size, scale_dtype=_dtype(dtype), search=False)
    enc = rans.encode(unpack_int4(B).numpy())
    code = [torch.from_numpy(np.ascontiguousarray(enc[k])) for k in ("words", "word_offsets", "states", "freqs")]
    A = torch.randn(M, K, generator=g).to(_dtype(dtype))
    return trace(mod, lambda: mod.gemm_rans(A, *code, scales, zeros, offsets, fmt, K, N, group_size,
                                            enc["channels_per_tile"]), max_threadgroups)


def _trellis_weights(K, N, bits, group_size, g, experts=None):
    import torch
    lead = () if experts is None else (experts,)
    packed = torch.randint(0, 256, lead + ((K + 15) // 16, (N + 15) // 16, 32 * bits), generator=g,
                           dtype=torch.int64).to(torch.uint8)
    scales = torch.rand(lead + ((K + group_size - 1) // group_size, N), generator=g) * 0.2 + 0.01
    grid = torch.randn(lead + (1 << bits,), generator=g)
    su = torch.randn(lead + (K,), generator=g).sign()
    sv = torch.randn(lead + (N,), generator=g).sign()
    return [packed, scales, grid, su, sv]


def trace_trellis_gemm(M, K, N, bits=3, group_size=128, dtype="half", max_threadgroups=0, seed=0):
    """C = A @ W (trellis) through the planner's kernel, traced."""
    import torch
    g = torch.Generator().manual_seed(seed)
    mod = load_trellis()
    A = torch.randn(M, K, generator=g).to(_dtype(dtype))
    w = _trellis_weights(K, N, bits, group_size, g)
    return trace(mod, lambda: mod.gemm(A, w, K, N, bits, group_size), max_threadgroups)


def trace_trellis_moe(T, hidden, intermediate, experts, top_k, bits=3, group_size=128, dtype="half",
                      max_threadgroups=0, seed=0):
    """The routed trellis MoE (every dispatch of its plan), tokens routed at random, traced."""
    import torch
    g = torch.Generator().manual_seed(seed)
    mod = load_trellis()
    x = torch.randn(T, hidden, generator=g).to(_dtype(dtype))
    gate = _trellis_weights(hidden, intermediate, bits, group_size, g, experts)
    up = _trellis_weights(hidden, intermediate, bits, group_size, g, experts)
    down = _trellis_weights(intermediate, hidden, bits, group_size, g, experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(T)])
    probs = torch.softmax(torch.randn(T, top_k, generator=g), -1)
    return trace(mod, lambda: mod.moe(x, gate, up, down, ids, probs, intermediate, bits, group_size),
                 max_threadgroups)
