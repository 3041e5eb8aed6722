"""FP4 / INT4 Metal kernels (metal/decode.metal, fused_tiles.metal, staged_tiles.metal,
striped.metal, reduce.metal, dequant.metal) vs torch.matmul on weights dequantized by the
pure-torch references in torch_marlin.formats: every plan path forced, adversarial thread orders,
K-parallel slices, the planner's Metal policy.

On Linux (CI) the kernels run in the Metal-on-CPU harness (tests/metal_emu.py, docs/metal.md),
through the same planner (csrc/plan/plan.cpp, Backend::Metal) and the same dispatch description
(csrc/mps/metal_dispatch.h) the MPS backend encodes. The op matrix over dtype x group size x M
runs on the harness as one backend of the op tests. On a Mac with MPS, TestMPS runs the
registered ops on the GPU over the same shapes.

Runtime on the shared 2-core dev machine: ~2 min for the first harness build (cached under
build/metal_emu/, shared with test_metal_barriers.py), then ~60-70 s of tests.
"""

import itertools
import multiprocessing
import os
import time
import zlib

import pytest
import torch

import torch_marlin
from torch_marlin.formats import dequant_fp4_reference, dequant_u4_reference, quantize_fp4, quantize_u4

import metal_emu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SCHEDULES = ["forward", "reverse", "random", "simd_ahead", "simd_ahead_reverse"]

# Error bound, elementwise: |C - ref| <= TOL[dtype] * (|A| @ |W| + |bias|).
# The kernels round each dequantized weight to the activation dtype (the simdgroup tiles hold T)
# and round C once; everything else is fp32. That is two roundings of relative size eps(T) per
# term (2^-11 for fp16, 2^-8 for bf16), plus fp32 summation error K * 2^-24 (K <= 1024 here):
# fp16 2 * 4.9e-4 + 6e-5 ~ 1.04e-3 -> 2e-3; bf16 2 * 3.9e-3 -> 1.6e-2; fp32 -> 1e-4.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def emu():
    return metal_emu.load()


def make_problem(fmt, M, K, N, group_size, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(K, N, generator=g)
    A = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype)
        z = None
        W = dequant_fp4_reference(B, s, group_size)
    else:
        B, s, z = quantize_u4(w, group_size, scale_dtype=dtype)
        W = dequant_u4_reference(B, s, z, group_size)
    return A, B, s, z, b, W


def check_close(C, A, W, bias, dtype):
    assert C.dtype == dtype
    ref = A.float() @ W
    mag = A.float().abs() @ W.abs()
    if bias is not None:
        ref = ref + bias.float()
        mag = mag + bias.float().abs()
    err = (C.float() - ref).abs()
    bad = err > TOL[dtype] * mag + 1e-6
    assert not torch.isnan(C).any(), "NaN in output (unwritten element or race)"
    assert not bad.any(), f"{int(bad.sum())} elements off; max err {err.max():.3e}, max ref {ref.abs().max():.3e}"


def schedule_for(*key):
    """Spreads the executor's thread orders over the matrix (each case gets one, reproducibly)."""
    return SCHEDULES[zlib.crc32(repr(key).encode()) % len(SCHEDULES)]


# (M, K, N, group_size): edges on purpose. N not a multiple of the 32 / 64 tile, M not a multiple
# of 8 / 64, K not a multiple of TILE_K = 32 (K = 200 with group 8), groups smaller than a K tile.
DECODE_SHAPES = [(1, 256, 72, 32), (3, 128, 100, 64), (16, 384, 40, 128), (7, 200, 33, 8)]
TILE_SHAPES = [(17, 256, 100, 64), (64, 128, 64, 32), (130, 256, 72, 128), (33, 200, 50, 8)]
FAMILY_KERNEL = {"fused_tiles": "marlin_gemm_fused", "staged_tiles": "marlin_gemm", "striped": "marlin_gemm_striped"}
DTYPE_NAME = {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}


def decode_stem(M, N):
    """The decode kernel the planner names (docs/metal.md): 16-byte weight loads when N % 4 == 0,
    one kernel per row count 1, 2, 4, 8, 16 (the next power of two >= M); else the per-column one."""
    if N % 4:
        return "marlin_gemv_unaligned"
    rows = 1
    while rows < M:
        rows *= 2
    return f"marlin_gemv_m{rows}"


def kernel_stem(family, M, N):
    """The fused and striped families run a 32-row tile up to 32 rows (`_m32`)."""
    if family == "decode":
        return decode_stem(M, N)
    return FAMILY_KERNEL[family] + ("_m32" if family in ("fused_tiles", "striped") and M <= 32 else "")

CASES = [("decode", s) for s in DECODE_SHAPES] + [
    (v, s) for v in ("fused_tiles", "staged_tiles", "striped") for s in TILE_SHAPES]


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("family,shape", CASES, ids=[f"{v}-{'x'.join(map(str, s))}" for v, s in CASES])
def test_gemm_matches_matmul(emu, fmt, dtype, family, shape):
    M, K, N, gs = shape
    bias = (M + N) % 2 == 0  # half the cases with bias, half without
    A, B, s, z, b, W = make_problem(fmt, M, K, N, gs, dtype, bias=bias, seed=M * 131 + N)
    sched = schedule_for(fmt, dtype, family, shape)
    C, plan = emu.gemm(fmt, A, B, s, z, b, gs, family, 0, sched, 7)
    assert plan["family"] == family
    assert plan["kernel"] == f"{kernel_stem(family, M, N)}_{fmt}_{DTYPE_NAME[dtype]}"
    check_close(C, A, W, b, dtype)


# ---- decode edges: every row count, N tails, groups against the kernel's pieces and shares ------
# (K, N, group_size). N: tails of the 128-column threadgroup with 16-byte loads (132, 200, 68) and
# without (257, 30: N % 4 != 0). Groups: 32 / 64 / 128 inside a piece; 40 straddling pieces (256 /
# 128 / 64 rows); 8 (one word per group); 512 and 1024 = K larger than a piece or a simdgroup's
# share, so one group spans several pieces and simdgroups.
DECODE_EDGE = [(256, 132, 32), (320, 200, 64), (512, 68, 128), (400, 257, 40), (96, 30, 8), (1024, 136, 512),
               (1024, 72, 1024)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M", range(1, 17))
def test_decode_every_row_count(emu, dtype, M):
    for i, fmt in enumerate(("fp4", "u4")):
        K, N, gs = DECODE_EDGE[(2 * M + i) % len(DECODE_EDGE)]
        bias = (M + i) % 2 == 0
        A, B, s, z, b, W = make_problem(fmt, M, K, N, gs, dtype, bias=bias, seed=M * 7 + i)
        C, plan = emu.gemm(fmt, A, B, s, z, b, gs, "decode", 0, schedule_for(fmt, dtype, M), M)
        assert plan["kernel"] == f"{decode_stem(M, N)}_{fmt}_{DTYPE_NAME[dtype]}"
        assert plan["tile_m"] == (16 if N % 4 else int(decode_stem(M, N)[len("marlin_gemv_m"):]))
        assert plan["vector_loads"] == (N % 4 == 0)
        check_close(C, A, W, b, dtype)


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
def test_decode_row_counts_agree_bitwise(emu, fmt):
    # Rows are independent: the first rows of a 16-row call equal the same rows computed by the
    # 1-, 2-, 4- and 8-row kernels (same per-column summation order), and the per-column kernel
    # (N % 4 != 0) equals the vector one on the columns both compute.
    K, N, gs = 512, 132, 64
    A, B, s, z, b, _ = make_problem(fmt, 16, K, N, gs, torch.float16, bias=True, seed=4)
    full, plan = emu.gemm(fmt, A, B, s, z, b, gs, "decode", 0, "random", 1)
    assert plan["kernel"].startswith("marlin_gemv_m16_")
    for M in (1, 2, 3, 5, 8):
        assert torch.equal(emu.gemm(fmt, A[:M], B, s, z, b, gs, "decode", 0, "forward", 0)[0], full[:M])
    n = 130  # 130 % 4 != 0: the per-column kernel over the first 130 columns
    zn = z[:, :n].contiguous() if z is not None else None
    part, plan = emu.gemm(fmt, A, B[:, :n].contiguous(), s[:, :n].contiguous(), zn, b[:n].contiguous(), gs, "decode",
                          0, "simd_ahead", 0)
    assert plan["kernel"].startswith("marlin_gemv_unaligned_")
    assert torch.equal(part, full[:, :n])


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_dequant_exact(emu, fmt, dtype):
    # One fp32 product rounded once to the scales' dtype, as the reference: bitwise equal.
    _, B, s, z, _, W = make_problem(fmt, 1, 192, 100, 32, dtype, bias=False, seed=3)
    out = emu.dequant(fmt, B, s, z, 32, "random", 1)
    assert out.dtype == dtype and out.shape == (192, 100)
    assert torch.equal(out, W.to(dtype))


# ---- K-parallel: stripes and decode splitting K over slices, reduced in a fixed order ----------

KPAR_CASES = [
    # (family, M, K, N, gs, compute_units): small output, long K -> k_parallel > 1
    ("striped", 40, 1024, 60, 128, 64),
    ("striped", 70, 512, 130, 32, 40),
    ("decode", 1, 1024, 64, 64, 8),
    ("decode", 9, 2048, 100, 128, 16),
    ("decode", 16, 2560, 72, 40, 16),  # slices of whole 40-row groups, pieces of 64 rows
]


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("family,M,K,N,gs,cu", KPAR_CASES)
def test_k_parallel_correct_and_bitwise_deterministic(emu, fmt, family, M, K, N, gs, cu):
    dtype = torch.float16
    A, B, s, z, b, W = make_problem(fmt, M, K, N, gs, dtype, bias=True, seed=K + N)
    C1, plan = emu.gemm(fmt, A, B, s, z, b, gs, family, cu, "forward", 0, 1)
    assert plan["family"] == family
    assert plan["k_parallel"] > 1, plan
    assert plan["reduce_kernel"] == "marlin_reduce_partials_half"
    assert plan["workspace_bytes"] == plan["k_parallel"] * M * N * 4
    check_close(C1, A, W, b, dtype)
    # Another thread order, seed and number of OS threads: the fixed-order reduction makes the
    # result bitwise identical.
    C2, _ = emu.gemm(fmt, A, B, s, z, b, gs, family, cu, "random", 12345, 2)
    C3, _ = emu.gemm(fmt, A, B, s, z, b, gs, family, cu, "simd_ahead_reverse", 0, 2)
    assert torch.equal(C1, C2) and torch.equal(C1, C3)


# ---- the prefill tiles' edge paths ------------------------------------------------------------
# Steps of 32 K rows (16 for fp32 in fused / striped) with a counter per scale group: groups that
# straddle a step (48, 24), groups smaller than a step (8), one group for all of K (256); the
# last step short (K = 40, 72: masked 16-byte A chunks and words); N = 1 and odd N (every column
# tile edge); M one past a tile (65) and below one fragment row (20 rows: most fragments masked).
EDGE_SHAPES = [(65, 96, 33, 48), (33, 72, 65, 24), (20, 40, 1, 8), (64, 256, 130, 256)]
EDGE_CASES = [(v, s) for v in ("fused_tiles", "staged_tiles", "striped") for s in EDGE_SHAPES]


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("family,shape", EDGE_CASES, ids=[f"{v}-{'x'.join(map(str, s))}" for v, s in EDGE_CASES])
def test_prefill_edges(emu, fmt, dtype, family, shape):
    M, K, N, gs = shape
    bias = (M + K) % 2 == 1
    A, B, s, z, b, W = make_problem(fmt, M, K, N, gs, dtype, bias=bias, seed=M * 7 + K)
    C, plan = emu.gemm(fmt, A, B, s, z, b, gs, family, 0, schedule_for("edge", fmt, dtype, family, shape), 3)
    assert plan["family"] == family
    check_close(C, A, W, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_striped_walks_several_units_per_threadgroup(emu, dtype):
    # 3 row tiles x 1 column tile on 4 cores: 3 K slices, 9 work units over 8 threadgroups, so
    # some threadgroups run two units, crossing a K slice and a tile (the stage is reused).
    M, K, N, gs = 130, 1024, 60, 64
    A, B, s, z, b, W = make_problem("u4", M, K, N, gs, dtype, bias=True, seed=17)
    C, plan = emu.gemm("u4", A, B, s, z, b, gs, "striped", 4, "simd_ahead", 0, 2)
    assert plan["k_parallel"] == 3 and plan["num_groups"] == 8 and plan["m_tiles"] == 3
    check_close(C, A, W, b, dtype)
    C2, _ = emu.gemm("u4", A, B, s, z, b, gs, "striped", 4, "random", 5, 1)
    assert torch.equal(C, C2)


@pytest.mark.parametrize("family", ["fused_tiles", "staged_tiles", "decode"])
def test_results_independent_of_thread_order(emu, family):
    M = 5 if family == "decode" else 70
    A, B, s, z, b, W = make_problem("u4", M, 256, 90, 64, torch.bfloat16, seed=11)
    outs = [emu.gemm("u4", A, B, s, z, b, 64, family, 0, sch, 99)[0] for sch in SCHEDULES]
    for o in outs[1:]:
        assert torch.equal(outs[0], o)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_prefill_unaligned_activations(emu, dtype):
    # The prefill kernels read A in 16-byte vectors; an A starting one element into its storage is
    # copied by the bindings (as on MPS), not read misaligned.
    M, K, N, gs = 40, 128, 72, 32
    A, B, s, z, b, W = make_problem("fp4", M, K, N, gs, dtype, bias=False, seed=2)
    shifted = torch.empty(M * K + 1, dtype=dtype)[1:].view(M, K)
    shifted.copy_(A)
    assert shifted.data_ptr() % 16 != 0
    C, plan = emu.gemm("fp4", shifted, B, s, None, None, gs, "fused_tiles", 0, "random", 1)
    check_close(C, A, W, None, dtype)


@pytest.mark.parametrize("family", ["decode", "fused_tiles", "staged_tiles", "striped"])
def test_u4_zero_points_masked(emu, family):
    # Zero points are 0..15 (docs/formats.md): the kernels use the byte's low 4 bits, as the CPU
    # and CUDA kernels do, so bytes 240..255 give the same result as 0..15.
    M = 5 if family == "decode" else 70
    A, B, s, z, b, _ = make_problem("u4", M, 256, 90, 64, torch.float16, seed=5)
    high = z | 0xF0
    C = emu.gemm("u4", A, B, s, z, b, 64, family, 0, "random", 7)[0]
    assert torch.equal(emu.gemm("u4", A, B, s, high, b, 64, family, 0, "random", 7)[0], C)
    if family == "decode":
        assert torch.equal(emu.dequant("u4", B, s, high, 64, "random", 1), emu.dequant("u4", B, s, z, 64, "random", 1))


# ---- dispatch policy: which kernel each M selects on Metal -------------------------------------

def test_dispatch_policy_metal():
    K, N = 4096, 4096
    for M in (1, 2, 8, 16):
        p = torch_marlin.plan_gemm("fp4", M, K, N, 128, torch.float16, device="metal")
        assert p["family"] == "decode" and p["kernel"] == f"{decode_stem(M, N)}_fp4_half", (M, p)
        assert p["grid"][0] == N // 128 and p["threads"] == (128, 1, 1) and p["vector_loads"]
    for M in (17, 32, 33, 64, 512, 4096):
        p = torch_marlin.plan_gemm("fp4", M, K, N, 128, torch.bfloat16, device="metal")
        tile_m = 32 if M <= 32 else 64
        assert p["family"] == "fused_tiles" and p["kernel"] == f"{kernel_stem('fused_tiles', M, N)}_fp4_bfloat", (M, p)
        assert p["grid"][:2] == (N // 64, (M + tile_m - 1) // tile_m) and p["k_parallel"] == 1
    # Output too small to fill 8 GPU cores twice, long K: stripes with K-parallel slices.
    p = torch_marlin.plan_gemm("u4", 64, 8192, 256, 128, torch.float16, device="metal")
    assert p["family"] == "striped" and p["kernel"] == "marlin_gemm_striped_u4_half"
    assert p["k_parallel"] > 1 and p["reduce_kernel"] == "marlin_reduce_partials_half"
    assert p["grid"][1:] == (1, 1) and p["grid"][0] == p["num_groups"]
    # An MPS device with the default Metal caps plans exactly like "metal" (what MarlinLinear on
    # MPS runs); a real MPS device plans with its own core count through the op's caps source.
    metal_caps = {k: torch_marlin.plan_gemm("fp4", 1, K, N, 128, device="metal")[k]
                  for k in ("compute_units", "max_shared_memory")}
    for M in (1, 17, 64):
        assert torch_marlin.plan_gemm("fp4", M, K, N, 128, device="mps", caps=metal_caps) == \
            torch_marlin.plan_gemm("fp4", M, K, N, 128, device="metal")
    # Decode splits K over grid.y when N alone has too few columns for the GPU.
    p = torch_marlin.plan_gemm("fp4", 1, 8192, 256, 128, torch.float16, device="metal")
    assert p["family"] == "decode" and p["k_parallel"] > 1 and p["grid"][1] == p["k_parallel"]


def test_metal_plan_rejects_32bit_overflow():
    with pytest.raises(ValueError, match="below 2"):
        torch_marlin.plan_gemm("fp4", 70000, 65536, 64, 128, torch.float16, device="metal")


@pytest.mark.parametrize("M", [1, 16, 17, 80])
def test_harness_runs_the_policy_plan(emu, M):
    # family="auto": the harness asks the planner exactly as the MPS op does.
    K, N, gs = 512, 96, 64
    A, B, s, z, b, W = make_problem("fp4", M, K, N, gs, torch.float16, bias=False, seed=M)
    C, plan = emu.gemm("fp4", A, B, s, None, None, gs, "auto", 0, "random", 5)
    policy = torch_marlin.plan_gemm("fp4", M, K, N, gs, torch.float16, device="metal")
    for key in ("family", "kernel", "grid", "threads", "k_parallel", "workspace_bytes", "reduce_kernel"):
        assert plan[key] == policy[key], key
    check_close(C, A, W, None, torch.float16)


def test_op_functions(emu):
    # The op-shaped functions other test modules run the harness through (same signatures as
    # torch.ops.marlin.*): the policy plan, the reference result.
    for M in (3, 40):
        A, B, s, z, b, W = make_problem("u4", M, 128, 72, 32, torch.float16, bias=True, seed=M)
        C, plan = metal_emu.gemm_u4(A, B, s, z, 32, b, return_plan=True)
        assert plan["family"] == ("decode" if M <= 16 else "fused_tiles")
        check_close(C, A, W, b, torch.float16)
        assert torch.equal(metal_emu.dequant_u4(B, s, z, 32), W.half())
        A, B, s, z, b, W = make_problem("fp4", M, 128, 72, 32, torch.bfloat16, bias=False, seed=M)
        check_close(metal_emu.gemm_fp4(A, B, s, 32, schedule="random", seed=M), A, W, None, torch.bfloat16)
        assert torch.equal(metal_emu.dequant_fp4(B, s, 32), W.to(torch.bfloat16))


def test_harness_rejects_bad_shapes(emu):
    A, B, s, z, b, W = make_problem("fp4", 4, 128, 64, 32, torch.float16, bias=False)
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide K \(128\)"):
        emu.gemm("fp4", A, B, s, None, None, 48, "auto", 0)
    with pytest.raises(ValueError, match="decode family handles M <= 16"):
        emu.gemm("fp4", torch.randn(17, 128).half(), B, s, None, None, 32, "decode", 0)
    with pytest.raises(ValueError, match="schedule"):
        emu.gemm("fp4", A, B, s, None, None, 32, "auto", 0, "sideways")


def test_every_planned_kernel_is_instantiated(emu):
    names = set(emu.kernel_names())
    for fmt, dt, family in itertools.product(["fp4", "u4"], DTYPES, ["decode", *FAMILY_KERNEL]):
        for M, N in ([(m, n) for m in range(1, 17) for n in (256, 250)] if family == "decode" else [(64, 256)]):
            p = torch_marlin.plan_gemm(fmt, M, 8192, N, 128, dt, device="metal", family=family)
            assert p["kernel"] in names
            if p["reduce_kernel"]:
                assert p["reduce_kernel"] in names
    for fmt, dt in itertools.product(["fp4", "u4"], DTYPE_NAME.values()):
        assert f"dequant_{fmt}_{dt}" in names


def test_build_lock_one_process_at_a_time(tmp_path):
    # Test processes that need a module at once (pytest-xdist workers) build it in turn, and a
    # lock file cpp_extension left behind (a build killed midway) does not make the next one hang.
    build_dir = str(tmp_path / "module")
    os.makedirs(build_dir)
    open(os.path.join(build_dir, "lock"), "w").close()
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()

    def hold():
        with metal_emu.build_lock(build_dir):
            held.set()
            release.wait(30)
            time.sleep(0.3)  # a lock that let the parent in would be seen before this file
            open(os.path.join(build_dir, "built"), "w").close()

    child = fork.Process(target=hold)
    child.start()
    try:
        assert held.wait(30)
        release.set()
        with metal_emu.build_lock(build_dir):
            assert os.path.exists(os.path.join(build_dir, "built")), "the lock was shared"
            assert not os.path.exists(os.path.join(build_dir, "lock"))
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0


# ---- native MPS (only on a Mac): the registered ops on the GPU over the same shapes ---------------

@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (MPS)")
class TestMPS:
    @pytest.mark.parametrize("fmt", ["fp4", "u4"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
    @pytest.mark.parametrize("M,K,N,gs", [(1, 256, 72, 32), (16, 384, 40, 128), (17, 256, 100, 64),
                                          (130, 256, 72, 128), (64, 8192, 256, 128), (1, 8192, 256, 128)])
    def test_gemm_mps(self, fmt, dtype, M, K, N, gs):
        A, B, s, z, b, W = make_problem(fmt, M, K, N, gs, dtype, bias=True, seed=M + N)
        dev = torch.device("mps")
        if fmt == "fp4":
            C = torch.ops.marlin.gemm_fp4(A.to(dev), B.to(dev), s.to(dev), gs, b.to(dev))
        else:
            C = torch.ops.marlin.gemm_u4(A.to(dev), B.to(dev), s.to(dev), z.to(dev), gs, b.to(dev))
        check_close(C.cpu(), A, W, b, dtype)

    @pytest.mark.parametrize("fmt", ["fp4", "u4"])
    def test_dequant_mps(self, fmt):
        _, B, s, z, _, W = make_problem(fmt, 1, 192, 100, 32, torch.float16, bias=False)
        dev = torch.device("mps")
        if fmt == "fp4":
            out = torch.ops.marlin.dequant_fp4(B.to(dev), s.to(dev), 32)
        else:
            out = torch.ops.marlin.dequant_u4(B.to(dev), s.to(dev), z.to(dev), 32)
        assert torch.equal(out.cpu(), W.half())

    def test_sliced_inputs_mps(self):
        # storage_offset() must reach the MTLBuffer offset.
        A, B, s, z, b, W = make_problem("fp4", 20, 256, 64, 64, torch.float16, bias=False)
        dev = torch.device("mps")
        big = torch.zeros(25, 256, dtype=torch.float16)
        big[5:] = A
        C = torch.ops.marlin.gemm_fp4(big.to(dev)[5:], B.to(dev), s.to(dev), 64)
        check_close(C.cpu(), A, W, None, torch.float16)
