"""Performance gates of the Metal kernels, from the two tools of docs/metal.md ("Performance
report"): the static IR report (scripts/dev/metal_ir_report.py) and the harness load tracer
(tests/metal_load_trace.py).

Gates (each a test per kernel):
  wide_weight_load       a decode kernel has a weight load of >= 16 bytes (static)
  no_main_loop_division  no main loop of a default-path kernel divides (static: udiv/sdiv/urem/srem
                         by a non-constant)
  threadgroup_memory     a default-path kernel uses <= 28 KiB of threadgroup memory (static)
  thread_arrays_in_registers
                         no address into a per-thread array of a default-path kernel (accumulators,
                         simdgroup_matrix fragments) has a run-time index (static: such an array
                         cannot stay in registers)
  weight_fetched_once    a decode kernel fetches no weight byte more than once (traced, M = 1 and
                         M = 16)
  weight_coalescing      a decode kernel's weight loads use >= 90 % of the 64-byte segments they
                         touch (traced, M = 1 and M = 16)
  loads_per_weight_byte  a decode kernel needs <= 0.5 load instructions per weight byte at M = 1
                         (traced)

Which kernels: the planner's (the harness's describe_* functions, i.e. the dispatch description
the MPS backend encodes). Decode kernels are those planned at M = 1 and M = 16 (FP4 / INT4 / affine INT4,
rANS-coded and trellis GEMM; the MoE at one token) that read a weight buffer; default-path kernels are every
kernel any plan over the shape sweep below picks (GEMM, dequant, the MoE's dispatches, K-slice
reductions).

EXPECTED_FAILURES lists the (kernel, gate) pairs that fail today; each is a strict xfail, so a
kernel that starts passing fails CI until its entry is removed. Nothing else is skipped.

The tools' own tests run them on tests/metal/perf_probes.metal, kernels built to have exactly one
property each (16- vs 4-byte loads, a division in the loop, every byte read twice, one segment per
lane, 30 KiB of threadgroup memory).

Needs clang++ (CI installs Debian's clang) and the harness builds; the traced builds are cached
under build/*_trace/ (about 2 minutes the first time).
"""

import functools
import importlib.util
import os

import pytest
import torch

import metal_emu
import metal_load_trace as lt
import trellis_metal_emu

ROOT = metal_emu.ROOT
KIB = 1024
TG_LIMIT = 28 * KIB

# ---- today's failures: (kernel, gate) -> reason. Remove an entry when its kernel is fixed. -----
EXPECTED_FAILURES = {
    # The rANS GEMV refills its ring with 512 bytes on whole 64-byte segments, but lanes whose
    # 16 bytes lie before the tile's stream (which starts 16-byte aligned) skip the first refill's
    # load; the tracer groups each lane's n-th execution of a load site, so those lanes' loads are
    # grouped one refill late for the rest of the tile: 9 segments per 512 bytes (0.89) in the
    # trace, where the GPU issues 8 per refill. Which kernels show it depends on where their traced
    # problem's tile streams start (seeded data: the same every run).
    **{(k, "weight_coalescing"): "lanes skipping the first refill shift the tracer's per-lane grouping of the "
       "refill loads" for k in (
           "rans_gemv_m16_affine_bfloat", "rans_gemv_m16_affine_half", "rans_gemv_m16_fp4_bfloat",
           "rans_gemv_m16_fp4_float", "rans_gemv_m16_fp4_half", "rans_gemv_m16_u4_bfloat", "rans_gemv_m16_u4_float",
           "rans_gemv_m16_u4_half", "rans_gemv_m1_affine_bfloat", "rans_gemv_m1_affine_float",
           "rans_gemv_m1_affine_half", "rans_gemv_m1_fp4_float", "rans_gemv_m1_fp4_half")},
    # fp32 activations: 8 values are two 16-byte loads, and the format walks all of K once per
    # channel of the tile, so A is re-read per channel (0.61 to 0.66 loads per code byte at M = 1).
    **{(f"rans_gemv_m1_{fmt}_float", "loads_per_weight_byte"): "fp32 activations re-read per channel, two 16-byte "
       "loads per 8 values" for fmt in ("fp4", "u4", "affine")},
}


# ---- the kernels the planner picks -----------------------------------------------------------------
DTYPES = {"float16": "half", "bfloat16": "bfloat", "float32": "float"}
GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 256), (256, 2048)]
GEMM_M = [1, 8, 16, 17, 64, 128, 512, 4096]
MOE = dict(hidden=2048, intermediate=1024, num_experts=8, top_k=2)


def _weight_dispatches(dispatches):
    return [d["kernel"] for d in dispatches if any(lt.is_weight(b) for b in d["buffers"])]


@functools.lru_cache(maxsize=None)
def planned_kernels():
    """(decode, default_path): decode maps kernel -> [how to run it: (op, dtype, fmt, M)];
    default_path is every kernel a plan over the shape sweep picks."""
    q, t = metal_emu.load(), trellis_metal_emu.load()
    decode, default = {}, set()
    for dtype, short in DTYPES.items():
        for fmt in ("fp4", "u4", "affine"):
            for M in (1, 16):
                for k in _weight_dispatches(q.describe_gemm(fmt, M, 4096, 4096, 128, dtype)):
                    decode.setdefault(k, []).append(("quant", short, fmt, M))
            for M in GEMM_M:
                for K, N in GEMM_SHAPES:
                    for bias in (False, True):
                        default |= {d["kernel"] for d in q.describe_gemm(fmt, M, K, N, 128, dtype, bias)}
            default |= {d["kernel"] for d in q.describe_dequant(fmt, 4096, 4096, 128, dtype)}
            for M in (1, 16):
                for k in _weight_dispatches(q.describe_gemm_rans(fmt, M, 4096, 4096, 128, 8, dtype)):
                    decode.setdefault(k, []).append(("rans", short, fmt, M))
            for M in GEMM_M:
                default |= {d["kernel"] for d in q.describe_gemm_rans(fmt, M, 4096, 4096, 128, 8, dtype)}
        for M in (1, 16):
            for k in _weight_dispatches(t.describe_gemm(M, 4096, 4096, 3, 128, dtype)):
                decode.setdefault(k, []).append(("trellis", short, None, M))
        for k in _weight_dispatches(t.describe_moe(1, MOE["hidden"], MOE["intermediate"], MOE["num_experts"],
                                                   MOE["top_k"], 3, 128, dtype)):
            decode.setdefault(k, []).append(("moe", short, None, 1))
        for M in GEMM_M:
            default |= {d["kernel"] for d in t.describe_gemm(M, 4096, 4096, 3, 128, dtype)}
        for T in (1, 8, 64, 512):
            default |= {d["kernel"] for d in t.describe_moe(T, MOE["hidden"], MOE["intermediate"],
                                                            MOE["num_experts"], MOE["top_k"], 3, 128, dtype)}
    default |= {d["kernel"] for d in t.describe_dequant(4096, 4096, 3, 128)}
    return decode, sorted(default | set(decode))


def _load_ir_report():
    spec = importlib.util.spec_from_file_location("metal_ir_report",
                                                  os.path.join(ROOT, "scripts", "dev", "metal_ir_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ir_report = _load_ir_report()


@functools.lru_cache(maxsize=None)
def static_rows():
    if ir_report.find_clang() is None:
        pytest.skip("clang++ not installed (apt-get install -y clang)")
    return {r["kernel"]: r for r in ir_report.report()}


def static_row(kernel):
    rows = static_rows()
    assert kernel in rows, f"the planner picks {kernel}, which no metal/*.metal file instantiates"
    return rows[kernel]


# Problem sizes of the traced gates: M = 1 runs every threadgroup (exact refetch counts), M = 16
# every 4th of a smaller problem. Big enough for several K steps, K slices and threadgroups.
def _trace(op, dtype, fmt, M):
    try:
        if op == "quant":
            if M == 1:
                return lt.trace_quant_gemm(fmt, 1, 2048, 2048, dtype=dtype)
            return lt.trace_quant_gemm(fmt, M, 1024, 1024, dtype=dtype, max_threadgroups=8)
        if op == "rans":  # the stream of a 512 x 64 tile is ~14 ring refills
            if M == 1:
                return lt.trace_rans_gemm(fmt, 1, 512, 256, dtype=dtype)
            return lt.trace_rans_gemm(fmt, M, 512, 128, dtype=dtype)
        if op == "trellis":
            if M == 1:
                return lt.trace_trellis_gemm(1, 1024, 1024, dtype=dtype)
            return lt.trace_trellis_gemm(M, 1024, 1024, dtype=dtype, max_threadgroups=8)
        return lt.trace_trellis_moe(M, 1024, 512, 4, 2, dtype=dtype)
    except lt.TraceUnavailable as e:
        pytest.skip(str(e))


@functools.lru_cache(maxsize=None)
def traced(op, dtype, fmt, M):
    return tuple(lt.summarize(r) for r in _trace(op, dtype, fmt, M))


def decode_summaries(kernel, m_filter=None):
    decode, _ = planned_kernels()
    out = []
    for op, dtype, fmt, M in decode[kernel]:
        if m_filter is not None and M != m_filter:
            continue
        found = [s for s in traced(op, dtype, fmt, M) if s["kernel"] == kernel]
        assert found, f"{kernel}: not dispatched by its traced {op} problem at M = {M}"
        out += [(M, s) for s in found]
    return out


# ---- gate checks ----------------------------------------------------------------------------------

def gate_wide_weight_load(kernel):
    w = static_row(kernel)["max_weight_load"]
    assert w >= 16, f"{kernel}: widest weight load is {w} bytes (< 16)"


def gate_no_main_loop_division(kernel):
    r = static_row(kernel)
    assert r["div_main"] == 0, f"{kernel}: {r['div_main']} integer division(s) in its main loop(s)"


def gate_threadgroup_memory(kernel):
    b = static_row(kernel)["tg_bytes"]
    assert b <= TG_LIMIT, f"{kernel}: {b} bytes of threadgroup memory (> {TG_LIMIT})"


def gate_thread_arrays_in_registers(kernel):
    n = static_row(kernel)["dynamic_thread_array_index"]
    assert n == 0, f"{kernel}: {n} address(es) into a per-thread array from a run-time index"


def gate_weight_fetched_once(kernel):
    for M, s in decode_summaries(kernel):
        assert s["weight_max_fetches"] <= 1, \
            f"{kernel} M={M}: a weight byte fetched {s['weight_max_fetches']} times (refetch {s['weight_refetch']:.3g})"


def gate_weight_coalescing(kernel):
    for M, s in decode_summaries(kernel):
        c = s["weight_coalescing"]
        assert c is not None and c >= 0.9, f"{kernel} M={M}: weight loads use {c} of the segments they touch"


def gate_loads_per_weight_byte(kernel):
    for M, s in decode_summaries(kernel, m_filter=1):
        x = s["loads_per_weight_byte"]
        assert x is not None and x <= 0.5, f"{kernel} M=1: {x:.3g} load instructions per weight byte (> 0.5)"


DECODE_GATES = ["wide_weight_load", "weight_fetched_once", "weight_coalescing", "loads_per_weight_byte"]
DEFAULT_GATES = ["no_main_loop_division", "threadgroup_memory", "thread_arrays_in_registers"]


def _cases():
    decode, default = planned_kernels()
    cases = []
    for k in sorted(decode):
        for g in DECODE_GATES:
            if g == "loads_per_weight_byte" and not any(c[3] == 1 for c in decode[k]):
                continue
            cases.append((k, g))
    cases += [(k, g) for k in default for g in DEFAULT_GATES]
    out = []
    for k, g in cases:
        reason = EXPECTED_FAILURES.get((k, g))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(k, g, marks=marks, id=f"{g}-{k}"))
    return out


@pytest.mark.parametrize("kernel,gate", _cases())
def test_gate(kernel, gate):
    globals()["gate_" + gate](kernel)


def test_expected_failures_name_planned_kernels():
    """Every entry of EXPECTED_FAILURES names a gate and a kernel that gate runs on (a stale entry
    would hide nothing and never shrink)."""
    decode, default = planned_kernels()
    for (k, g) in EXPECTED_FAILURES:
        assert g in DECODE_GATES + DEFAULT_GATES, (k, g)
        assert k in (decode if g in DECODE_GATES else default), f"{k} is not a kernel gate {g} runs on"


def test_planner_sets():
    decode, default = planned_kernels()
    for stem in ("marlin_gemv_m1_fp4_", "marlin_gemv_m1_u4_", "marlin_gemv_m16_fp4_", "marlin_gemv_m16_u4_",
                 "gemm_trellis_packed_decode_", "moe_trellis_gate_up_", "moe_trellis_down_", "rans_gemv_m1_fp4_",
                 "rans_gemv_m16_affine_"):
        assert {stem + d for d in DTYPES.values()} <= set(decode), stem
    for k in ("marlin_gemm_fused_fp4_half", "marlin_reduce_partials_float", "gemm_trellis_packed_float",
              "moe_trellis_tiled_down_half", "moe_trellis_combine_half", "dequant_trellis", "rans_decode_packed"):
        assert k in default, k


# ---- the tools on the probe kernels ------------------------------------------------------------

PROBES = os.path.join(ROOT, "tests", "metal", "perf_probes.metal")


@functools.lru_cache(maxsize=None)
def probe_static():
    clang = ir_report.find_clang()
    if clang is None:
        pytest.skip("clang++ not installed (apt-get install -y clang)")
    return {r["kernel"]: r for r in ir_report.analyze_file(clang, PROBES)[0]}


def test_static_report_widths():
    r = probe_static()
    assert r["probe_vector_loads"]["max_weight_load"] == 16
    assert r["probe_vector_loads"]["device_loads"] == {"16": 1}
    assert r["probe_scalar_loads"]["max_weight_load"] == 4
    assert set(r["probe_scalar_loads"]["device_loads"]) == {"4"}  # clang may unroll: count >= 1
    assert r["probe_scalar_loads"]["weight_bytes_per_load"] == 4


def test_static_report_division():
    r = probe_static()
    assert r["probe_divide_in_loop"]["div_main"] >= 1
    assert r["probe_scalar_loads"]["div_main"] == 0 and r["probe_scalar_loads"]["div_loops"] == 0


def test_static_report_dynamic_thread_index():
    r = probe_static()
    assert r["probe_dynamic_thread_index"]["dynamic_thread_array_index"] >= 1
    assert r["probe_constant_thread_index"]["dynamic_thread_array_index"] == 0
    assert r["probe_scalar_loads"]["dynamic_thread_array_index"] == 0


def test_static_report_threadgroup_memory_and_barriers():
    r = probe_static()
    assert r["probe_threadgroup_memory"]["tg_bytes"] == 30 * KIB
    assert r["probe_threadgroup_memory"]["tg_barriers_per_step"] == 2
    assert r["probe_scalar_loads"]["tg_bytes"] == 0
    assert r["probe_scalar_loads"]["tg_barriers_per_step"] == 0


ROWS, GROUPS = 64, 4


def run_probe(kernel, words_per_row=32, max_threadgroups=0):
    mod = lt.load_quant()
    B = torch.arange(GROUPS * ROWS * words_per_row * 4, dtype=torch.int32)
    out = torch.zeros(GROUPS * 32, dtype=torch.int32)
    params = torch.tensor([ROWS, 7], dtype=torch.int32)
    recs = lt.trace(mod, lambda: mod.dispatch_raw(kernel, [GROUPS, 1, 1], 32, [B, out, params], names=["B", "out",
                                                                                                      "params"]),
                    max_threadgroups)
    assert len(recs) == 1 and recs[0]["kernel"] == kernel
    return lt.summarize(recs[0]), out


@pytest.fixture(scope="module")
def traced_probes():
    try:
        lt.load_quant()
    except lt.TraceUnavailable as e:
        pytest.skip(str(e))


def test_trace_scalar_loads(traced_probes):
    s, out = run_probe("probe_scalar_loads")
    assert s["weight_bytes"] == GROUPS * ROWS * 32 * 4
    assert s["weight_max_fetches"] == 1 and s["weight_refetch"] == 1.0
    assert s["weight_coalescing"] == 1.0
    assert s["weight_load_widths"] == [4]
    assert s["loads_per_weight_byte"] == pytest.approx(0.25)  # params and the store do not count
    assert out.tolist() == [sum(((g * ROWS + r) * 32 + l) for r in range(ROWS)) for g in range(GROUPS)
                            for l in range(32)]


def test_trace_vector_loads(traced_probes):
    s, _ = run_probe("probe_vector_loads")
    assert s["weight_load_widths"] == [16]
    assert s["loads_per_weight_byte"] == pytest.approx(1 / 16)
    assert s["weight_coalescing"] == 1.0 and s["weight_max_fetches"] == 1


def test_trace_read_twice(traced_probes):
    s, _ = run_probe("probe_read_twice")
    assert s["weight_max_fetches"] == 2 and s["weight_refetch"] == pytest.approx(2.0)


def test_trace_strided(traced_probes):
    s, _ = run_probe("probe_strided", words_per_row=32 * 16)
    assert s["weight_coalescing"] == pytest.approx(4 / 64)
    assert s["weight_max_fetches"] == 1


def test_trace_sampling(traced_probes):
    s, _ = run_probe("probe_scalar_loads", max_threadgroups=2)
    assert (s["traced"], s["threadgroups"]) == (2, GROUPS)
    assert s["weight_bytes"] == 2 * ROWS * 32 * 4


def test_traced_build_computes_the_same_gemm(traced_probes):
    """The traced kernels (clang, __fp16) compute what the g++ harness computes: the trace shows
    the loads of a working kernel."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 512, generator=g).half()
    B = torch.randint(-2**31, 2**31 - 1, (64, 96), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(4, 96, generator=g) * 0.1).half()
    ref, _ = metal_emu.load().gemm("fp4", A, B, scales, None, None, 128)
    out, _ = lt.load_quant().gemm("fp4", A, B, scales, None, None, 128)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
