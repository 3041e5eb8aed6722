"""Trellis Metal kernels (metal/trellis_gemm.metal, metal/trellis_moe.metal) vs torch references,
run in the Metal-on-CPU harness (tests/trellis_metal_emu.py over csrc/metal_emu/) through the same
planner entries (plan_trellis_* with Backend::Metal) and dispatch description
(csrc/mps/metal_dispatch.h) the MPS backend uses. The GEMM over bits x group size x M x dtype runs
on the harness as one backend of the op tests; here: forced families, thread orders, the MoE paths,
barrier removal.

References: ``torch.matmul`` in fp64 on weights from ``dequant_trellis_reference`` (pure torch).
Tolerance, elementwise: |C - ref| <= TOL[dtype] * (|A| @ |W|) + 1e-6. The prefill kernel rounds
each dequantized weight to the activation dtype (its simdgroup tiles hold T) and C once; the decode
and MoE kernels keep weights in fp32 and round C once. Two roundings of eps(T) per term
(2^-11 fp16, 2^-8 bf16) plus fp32 summation (K * 2^-24, K <= 1040 here):
fp16 ~1.04e-3 -> 2e-3; bf16 ~7.9e-3 -> 1.6e-2; fp32 -> 1e-4 (as tests/test_metal_harness.py).
Runtime: ~1-2 min for the first harness build (cached in build/trellis_metal_emu/), then ~1 min.
"""

import zlib

import pytest
import torch

import torch_marlin
from torch_marlin.formats import trellis as fmt

import trellis_metal_emu
from test_trellis import moe_case, moe_reference, random_trellis

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_NAME = {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}
SCHEDULES = ["forward", "reverse", "random", "simd_ahead", "simd_ahead_reverse"]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def emu():
    mod = trellis_metal_emu.load()
    yield mod
    mod.set_dropped_barrier("")


def schedule_for(*key):
    return SCHEDULES[zlib.crc32(repr(key).encode()) % len(SCHEDULES)]


def dense(w, K, N, bits, gs):
    return fmt.dequant_trellis_reference(*w, K, N, bits, gs).double()


def check_close(C, A, W, dtype):
    assert C.dtype == dtype
    assert not torch.isnan(C).any(), "NaN in output (unwritten element or race)"
    ref = A.double() @ W
    mag = A.double().abs() @ W.abs()
    err = (C.double() - ref).abs()
    bad = err > TOL[dtype] * mag + 1e-6
    assert not bad.any(), f"{int(bad.sum())} elements off; max err {err.max():.3e}, max ref {ref.abs().max():.3e}"


@pytest.mark.parametrize("family,M", [("decode", 9), ("staged_tiles", 1), ("staged_tiles", 65)])
def test_gemm_longer_k_and_forced_families(emu, family, M):
    K, N, bits, gs = 1040, 130, 3, 128  # 65 tiled K blocks, 9 decode K blocks: many double-buffer swaps
    w = random_trellis(K, N, bits, gs, seed=5)
    A = torch.randn(M, K).half()
    C, plan = emu.gemm(A, list(w), K, N, bits, gs, family, "random", 3)
    assert plan["family"] == family
    check_close(C, A, dense(w, K, N, bits, gs), torch.float16)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequant_bitwise(emu, bits):
    # ((grid * scale) * su) * sv in fp32, the reference's order: bitwise equal.
    K, N, gs = 200, 77, 32
    w = random_trellis(K, N, bits, gs, seed=bits)
    out = emu.dequant(list(w), K, N, bits, gs, "random", 1)
    assert out.dtype == torch.float32 and torch.equal(out, fmt.dequant_trellis_reference(*w, K, N, bits, gs))


@pytest.mark.parametrize("M", [1, 16, 17, 80])
def test_harness_runs_the_policy_plan(emu, M):
    K, N, bits, gs = 256, 96, 4, 32
    w = random_trellis(K, N, bits, gs)
    A = torch.randn(M, K).half()
    C, plan = emu.gemm(A, list(w), K, N, bits, gs, "auto", "simd_ahead", 0)
    policy = torch_marlin.plan_trellis(M, K, N, bits, gs, torch.float16, device="metal")
    for key in ("family", "kernel", "grid", "threads", "tile_m", "tile_n"):
        assert plan[key] == policy[key], key
    check_close(C, A, dense(w, K, N, bits, gs), torch.float16)


@pytest.mark.parametrize("family", ["decode", "staged_tiles"])
def test_results_independent_of_thread_order(emu, family):
    M = 5 if family == "decode" else 70
    K, N, bits, gs = 160, 90, 3, 32
    w = random_trellis(K, N, bits, gs, seed=9)
    A = torch.randn(M, K).to(torch.bfloat16)
    outs = [emu.gemm(A, list(w), K, N, bits, gs, family, s, 99, 2)[0] for s in SCHEDULES]
    for o in outs[1:]:
        assert torch.equal(outs[0], o)


def test_op_functions(emu):
    # The op-shaped functions other test modules run the harness through (same signatures as
    # torch_marlin.ops.*): the same dispatches as the module functions.
    K, N, bits, gs = 96, 40, 3, 32
    w = random_trellis(K, N, bits, gs, seed=4)
    for M in (3, 20):
        A = torch.randn(M, K).half()
        C, plan = trellis_metal_emu.gemm_trellis(A, *w, K, N, bits, gs, return_plan=True)
        assert torch.equal(C, emu.gemm(A, list(w), K, N, bits, gs)[0]) and plan["kernel"].endswith("_half")
        check_close(C, A, dense(w, K, N, bits, gs), torch.float16)
    assert torch.equal(trellis_metal_emu.dequant_trellis(*w, K, N, bits, gs),
                       fmt.dequant_trellis_reference(*w, K, N, bits, gs))
    gate, up, down, ids, probs = moe_case(6, 64, 48, 3, 2, bits, gs, "random", seed=1)
    x = torch.randn(6, 64) * 0.5
    y = trellis_metal_emu.moe_trellis(x, gate, up, down, ids, probs, 48, bits, gs)
    ref = moe_reference(x, gate, up, down, ids, probs, 64, 48, bits, gs)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


def test_every_planned_kernel_is_instantiated(emu):
    names = set(emu.kernel_names())
    for dt in DTYPES:
        for M in (1, 64):
            assert torch_marlin.plan_trellis(M, 4096, 4096, 3, 128, dt, device="metal")["kernel"] in names
    assert "dequant_trellis" in names
    for dt in DTYPE_NAME.values():
        for stem in ("moe_trellis_gate_up", "moe_trellis_down", "moe_trellis_combine", "moe_trellis_tiled_gate",
                     "moe_trellis_tiled_up", "moe_trellis_tiled_down"):
            assert f"{stem}_{dt}" in names


# ---- decode / tiled edge paths -------------------------------------------------------------------
# The decode kernel stages K in blocks of 128 rows (8 tile rows) and two tile columns per
# threadgroup; K = 272 is two full blocks plus one of a single tile row (and a partial tile), and
# N = 80 leaves a threadgroup with one tile column. Group size 48 puts a scale group boundary
# inside a tile-row pair of one simdgroup; 16 changes the group at every tile row.

@pytest.mark.parametrize("M", range(1, 17))
def test_decode_every_row_count(emu, M):
    dtype, bits = DTYPES[(M // 3) % 3], (2, 3, 4)[M % 3]  # every (dtype, bits) pair over M = 1..16
    K, N, gs = 272, 80, 48
    w = random_trellis(K, N, bits, gs, seed=M)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    C, plan = emu.gemm(A, list(w), K, N, bits, gs, "auto", schedule_for("rows", M), M)
    assert plan["family"] == "decode" and plan["tile_k"] == 128 and plan["k_vec4"]
    check_close(C, A, dense(w, K, N, bits, gs), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("M,K,N,gs", [(1, 37, 16, 16), (16, 201, 77, 32), (3, 160, 200, 128)])
def test_decode_shapes(emu, dtype, bits, M, K, N, gs):
    # K = 37 / 201: rows not 16-byte aligned (element-wise activation reads), partial tiles; N = 16:
    # one tile column in the whole matrix; N = 77 / 200: partial last tiles.
    w = random_trellis(K, N, bits, gs, seed=K + bits)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).to(dtype)
    C, plan = emu.gemm(A, list(w), K, N, bits, gs, "auto", schedule_for(dtype, bits, K), 1)
    assert plan["family"] == "decode" and plan["k_vec4"] == (K % 4 == 0)
    check_close(C, A, dense(w, K, N, bits, gs), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tiled_shapes(emu, dtype, bits):
    # Row tail (M = 70), column tail and a single-tile last column block (N = 150), K not a
    # multiple of 4 with a partial tile and group size 48 (group changes between K blocks).
    M, K, N, gs = 70, 203, 150, 48
    w = random_trellis(K, N, bits, gs, seed=bits)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(bits)).to(dtype)
    C, plan = emu.gemm(A, list(w), K, N, bits, gs, "auto", schedule_for("tiled", dtype, bits), 2)
    assert plan["family"] == "staged_tiles" and plan["tile_k"] == 16 and not plan["k_vec4"]
    check_close(C, A, dense(w, K, N, bits, gs), dtype)


# ---- MoE ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("routing", ["random", "some_empty", "all_to_one"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_moe_matches_reference(emu, top_k, routing, T):
    H, I, E, bits, gs = 72, 112, 6, 3, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, routing, seed=T + top_k)
    x = torch.randn(T, H) * 0.5
    y, plan = emu.moe(x, list(gate), list(up), list(down), ids, probs, I, bits, gs,
                      schedule_for(top_k, routing, T), 3)
    # Expert slots, not experts: at most T * top_k experts have rows, T * top_k / 17 more than 16;
    # each slot finds its expert on the GPU ("some_empty" leaves experts without rows between them).
    R = T * top_k
    assert plan["kernel"] == "moe_trellis_gate_up_float" and plan["grid"] == ((I + 31) // 32, min(E, R), 1)
    if R > 16:  # experts with > 16 rows go through the 64x64 tiled kernels
        assert plan["tiled_up"]["kernel"] == "moe_trellis_tiled_up_float"
        assert plan["tiled_down"]["grid"] == ((H + 63) // 64, (R + 63) // 64, min(E, R // 17))
    else:
        assert "tiled_up" not in plan
    ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
    assert not torch.isnan(y).any()
    # fp32 everywhere (rows_h / rows_y are fp32): only summation-order differences.
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("T,experts", [(5, (3, 33, 39)), (20, (1, 35))])
def test_moe_slots_find_scattered_experts(emu, T, experts):
    # 40 experts (two 32-expert ballot steps in tr_slot_expert), rows only for a few scattered ones,
    # idle experts between and after them. T = 20: both experts get 20 rows, the tiled path, on
    # min(40, 40 // 17) = 2 slots.
    H, I, E, top_k, bits, gs = 48, 40, 40, 2, 2, 16
    gate, up, down, _, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=T)
    pick = torch.tensor(experts)
    ids = torch.stack([pick[(torch.arange(top_k) + t) % len(experts)] for t in range(T)])
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)) * 0.5
    y, plan = emu.moe(x, list(gate), list(up), list(down), ids, probs, I, bits, gs, "reverse", 1)
    R = T * top_k
    assert plan["grid"][1] == min(E, R)
    if R > 16:
        assert plan["tiled_gate"]["grid"][2] == R // 17 < E
    ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_moe_dtypes_and_cpu_agreement(emu, dtype):
    T, H, I, E, top_k, bits, gs = 20, 64, 48, 4, 2, 4, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=2)
    ids = torch.stack([torch.full((T,), E - 1), torch.arange(T) % 3], 1)  # expert 3 tiled, 0..2 GEMV
    x = (torch.randn(T, H) * 0.5).to(dtype)
    y, plan = emu.moe(x, list(gate), list(up), list(down), ids, probs, I, bits, gs, "random", 1)
    assert y.dtype == dtype and plan["combine"]["kernel"] == f"moe_trellis_combine_{DTYPE_NAME[dtype]}"
    ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
    # One rounding of y to dtype on top of fp32 work, plus (tiled path) the weights and x rounded
    # to dtype in the simdgroup tiles: errors of eps(T) relative, mostly cancelling over K.
    eps = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}[dtype]
    assert float((y.double() - ref).abs().max()) <= eps * float(ref.abs().max()) * 1.5
    # The CPU op computes the same thing.
    y_cpu = torch_marlin.ops.moe_trellis(x, gate, up, down, ids, probs, I, bits, gs)
    assert float((y.double() - y_cpu.double()).abs().max()) <= 2 * eps * float(ref.abs().max())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("T,top_k", [(1, 1), (1, 4), (3, 3), (4, 4), (2, 8)])
def test_moe_decode_experts_top_k(emu, bits, T, top_k):
    # T * top_k <= 16: every expert takes the decode kernels (gate_up, down); several experts with
    # one or more rows each, and H / I not multiples of 4 (element-wise activation reads) or of 32.
    H, I, E, gs = 130 if bits == 3 else 128, 90 if bits == 2 else 96, 8, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=T * 10 + top_k + bits)
    x = torch.randn(T, H) * 0.5
    y, plan = emu.moe(x, list(gate), list(up), list(down), ids, probs, I, bits, gs,
                      schedule_for("moe", bits, T, top_k), 4)
    assert plan["family"] == "decode" and "tiled_up" not in plan
    assert plan["k_vec4"] == (H % 4 == 0) and plan["down_k_vec4"] == (I % 4 == 0)
    ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


# ---- the harness catches a missing barrier ----------------------------------------------------------

def test_every_barrier_is_needed(emu):
    """Each tagged barrier of the trellis kernels, dropped alone, breaks the result under some
    thread order (NaN-poisoned threadgroup memory, adversarial orders); with none dropped the
    barrier-switch build is correct under all of them."""
    K, N, bits, gs = 128, 80, 3, 32
    w = random_trellis(K, N, bits, gs, seed=1)
    W = dense(w, K, N, bits, gs)
    gate, up, down, ids, probs = moe_case(20, 64, 80, 4, 2, bits, gs, "random")
    # Expert 3 gets all 20 tokens (tiled path), experts 0..2 get 6-7 each (GEMV path).
    ids = torch.stack([torch.full((20,), 3), torch.arange(20) % 3], 1)
    x = torch.randn(20, 64) * 0.5
    moe_ref = moe_reference(x, gate, up, down, ids, probs, 64, 80, bits, gs)

    def ok(out, ref):
        return bool(torch.allclose(out.double(), ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max())))

    def passes(tag, schedule):
        prefix = trellis_metal_emu.BARRIER_SWITCH_PREFIX
        if tag == "" or "moe" in tag:
            y, _ = emu.moe(x, list(gate), list(up), list(down), ids, probs, 80, bits, gs, schedule, 0, 0, prefix)
            if not ok(y, moe_ref):
                return False
        if "moe" not in tag:
            for M in (5, 70):  # decode and prefill
                A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).half()
                C, _ = emu.gemm(A, list(w), K, N, bits, gs, "auto", schedule, 0, 0, prefix)
                if not ok(C, A.double() @ W):
                    return False
        return True

    tags = trellis_metal_emu.barrier_tags()
    assert len(tags) == 10, tags
    try:
        for s in SCHEDULES:
            emu.set_dropped_barrier("")
            assert passes("", s), s
        for tag in tags:
            emu.set_dropped_barrier(tag)
            assert not all(passes(tag, s) for s in SCHEDULES), f"dropping {tag} went unnoticed"
    finally:
        emu.set_dropped_barrier("")


# ---- native MPS (only on a Mac): the registered ops on the GPU against the same references ---------

@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (MPS)")
class TestMPS:
    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
    @pytest.mark.parametrize("M", [1, 16, 17, 100])
    def test_gemm_mps(self, dtype, M):
        K, N, bits, gs = 200, 77, 3, 32
        w = random_trellis(K, N, bits, gs, seed=M)
        A = torch.randn(M, K).to(dtype)
        dev = torch.device("mps")
        C = torch.ops.marlin.gemm_trellis(A.to(dev), *(t.to(dev) for t in w), K, N, bits, gs)
        check_close(C.cpu(), A, dense(w, K, N, bits, gs), dtype)

    def test_dequant_mps(self):
        K, N, bits, gs = 200, 77, 4, 32
        w = random_trellis(K, N, bits, gs)
        dev = torch.device("mps")
        out = torch.ops.marlin.dequant_trellis(*(t.to(dev) for t in w), K, N, bits, gs)
        assert torch.equal(out.cpu(), fmt.dequant_trellis_reference(*w, K, N, bits, gs))

    @pytest.mark.parametrize("T", [1, 40])
    def test_moe_mps(self, T):
        H, I, E, top_k, bits, gs = 72, 112, 6, 2, 3, 32
        gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "some_empty")
        x = torch.randn(T, H) * 0.5
        dev = torch.device("mps")
        mv = lambda ts: tuple(t.to(dev) for t in ts)  # noqa: E731
        y = torch.ops.marlin.moe_trellis(x.to(dev), *mv(gate), *mv(up), *mv(down), ids.to(dev), probs.to(dev), I,
                                         bits, gs)
        ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
        torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))

    def test_sliced_input_mps(self):
        # storage_offset() must reach the MTLBuffer offset.
        K, N, bits, gs = 64, 48, 2, 32
        w = random_trellis(K, N, bits, gs)
        A = torch.randn(20, K).half()
        big = torch.zeros(25, K, dtype=torch.float16)
        big[5:] = A
        dev = torch.device("mps")
        C = torch.ops.marlin.gemm_trellis(big.to(dev)[5:], *(t.to(dev) for t in w), K, N, bits, gs)
        check_close(C.cpu(), A, dense(w, K, N, bits, gs), torch.float16)


@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_moe_bits_group_sizes(emu, bits, gs):
    T, H, I, E, top_k = 24, 200, 136, 5, 2  # neither dim a multiple of 16 / 32; partial groups
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "all_to_one" if gs == 128 else "random",
                                          seed=bits * gs)
    x = (torch.randn(T, H) * 0.3).half()
    y, _ = emu.moe(x, list(gate), list(up), list(down), ids, probs, I, bits, gs, schedule_for(bits, gs), 5)
    ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
    assert not torch.isnan(y).any()
    # fp32 work, one rounding of y to fp16.
    assert float((y.double() - ref).abs().max()) <= 2.0 ** -10 * 1.5 * float(ref.abs().max())
