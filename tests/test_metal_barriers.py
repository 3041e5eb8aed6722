"""The Metal-on-CPU harness catches a missing barrier.

tests/metal_emu.py builds, beside the pristine kernels, a copy of every FP4 / INT4 kernel file (with
its MSL headers inlined) in which every tagged barrier (``threadgroup_barrier(...);  // [barrier:name]``) is rewritten into
``if (!metal_emu::barrier_dropped("name")) threadgroup_barrier(...);``. With no barrier dropped
the copy must match torch.matmul under every thread order; with one needed barrier dropped, the
adversarial executor (thread orders between barriers, NaN-poisoned threadgroup memory at
threadgroup start, per-lane simdgroup_matrix elements) must make it fail.

Why more than one thread order: the lockstep orders (forward / reverse / random) let every
simdgroup reach its next simdgroup-level sync before any is released, which hides races
*between* simdgroups whose reads and writes are separated by a simdgroup collective; the
"simd_ahead" orders let one simdgroup run as far as it can first and expose them.
Runtime: a few seconds (the harness build is shared with test_metal_harness.py).
"""

import pytest
import torch

from torch_marlin.formats import dequant_fp4_reference, quantize_fp4

import metal_emu

SCHEDULES = ["forward", "reverse", "random", "simd_ahead", "simd_ahead_reverse"]

# barrier tag -> (family that runs the kernel holding it, M, K, schedules that must catch its loss).
# The decode kernel at M = 5 (8 rows) stages 64-row pieces: K = 512 gives each simdgroup two, so a
# piece is restaged; its meeting goes 2,3 -> 0,1 -> 0, and each step's loss shows under the
# schedules that run the writer before the reader. fused_swap is the one barrier per K step of the
# two-stage pipeline (fused and striped); without it the simdgroups multiply a stage that is still
# being written (NaN poison) under every order. staged_free orders the MMAs before the single stage
# is overwritten: only a simdgroup running ahead of the others overwrites the stage they still read.
# K = 128: four K tiles, so the prefill stages are reused.
NEEDED = {
    "gemv_stage_free": ("decode", 5, 512, SCHEDULES),
    "gemv_stage_ready": ("decode", 5, 128, SCHEDULES),
    "gemv_stages_done": ("decode", 5, 128, SCHEDULES),
    "gemv_meet": ("decode", 5, 128, ["forward", "simd_ahead"]),
    "gemv_meet_read": ("decode", 5, 128, ["reverse", "simd_ahead_reverse"]),
    "gemv_meet_last": ("decode", 5, 128, ["forward", "simd_ahead"]),
    "fused_swap": ("fused_tiles", 64, 128, SCHEDULES),
    "staged_ready": ("staged_tiles", 64, 128, SCHEDULES),
    "staged_free": ("staged_tiles", 64, 128, ["simd_ahead", "simd_ahead_reverse"]),
}

K, N, GS = 128, 64, 32

# rANS (metal/rans.metal, one simdgroup per tile): tag -> schedules that must catch its loss in
# rans_decode_packed. rans_tile_ready orders the slot table and the first ring fill before the
# first step (lanes look up slots other lanes wrote); rans_ring_free orders a refill after the last
# reads of the words it overwrites, which only the last lanes of a step can still be reading: the
# orders that run high lanes first catch it. K = 1024, 2 channels per tile, uniform codes: about
# 1000 words per tile, so the ring (512 words) is refilled several times.
# rans_a_free orders the GEMV's reads of staged activations (gemm_rans, M = 3) before the next
# piece overwrites them (K = 1024: four pieces); the last lanes of a piece's last step are the
# late readers, so the orders that run high lanes first catch it.
RANS_NEEDED = {
    "rans_tile_ready": SCHEDULES,
    "rans_ring_free": ["reverse", "random"],
    "rans_a_free": ["reverse", "random"],
}


@pytest.fixture(scope="module")
def emu():
    mod = metal_emu.load()
    yield mod
    mod.set_dropped_barrier("")


def problem(M, K=K):
    g = torch.Generator().manual_seed(M)
    B, s = quantize_fp4(torch.randn(K, N, generator=g), GS, scale_dtype=torch.float16)
    A = torch.randn(M, K, generator=g).half()
    return A, B, s, A.float() @ dequant_fp4_reference(B, s, GS)


def matches(C, ref):
    # fp16 tolerance as in test_metal_harness.py; a race gives NaN (poison) or stale tiles.
    return bool(torch.allclose(C.float(), ref, rtol=2e-3, atol=2e-2))


def run(emu, family, M, K, schedule):
    A, B, s, ref = problem(M, K)
    C, plan = emu.gemm("fp4", A, B, s, None, None, GS, family, 0, schedule, 3, 1, metal_emu.BARRIER_SWITCH_PREFIX)
    assert plan["family"] == family
    return matches(C, ref)


def test_every_tagged_barrier_is_covered():
    assert set(NEEDED) | set(RANS_NEEDED) == set(metal_emu.barrier_tags())


def test_striped_needs_the_pipeline_barrier(emu):
    # The striped kernel runs the same pipelined tile once per work unit.
    emu.set_dropped_barrier("")
    assert all(run(emu, "striped", 64, K, sch) for sch in SCHEDULES)
    emu.set_dropped_barrier("fused_swap")
    try:
        assert not any(run(emu, "striped", 64, K, sch) for sch in SCHEDULES)
    finally:
        emu.set_dropped_barrier("")


@pytest.mark.parametrize("tag", sorted(NEEDED))
def test_removed_barrier_is_detected(emu, tag):
    family, M, k, catching = NEEDED[tag]
    emu.set_dropped_barrier("")
    for sch in SCHEDULES:
        assert run(emu, family, M, k, sch), f"intact kernel failed under {sch}"
    emu.set_dropped_barrier(tag)
    try:
        caught = [sch for sch in SCHEDULES if not run(emu, family, M, k, sch)]
    finally:
        emu.set_dropped_barrier("")
    assert set(catching) <= set(caught), f"dropping {tag}: caught only under {caught}"


def run_rans(emu, schedule):
    """rans_decode and the fused gemm_rans (fp4, M = 3) against the reference codes and matmul."""
    import numpy as np

    from torch_marlin.formats import rans

    K_R, N_R, C_R, GS_R = 1024, 4, 2, 64
    g = torch.Generator().manual_seed(5)
    B, s = quantize_fp4(torch.randn(K_R, N_R, generator=g), GS_R, scale_dtype=torch.float16)
    codes = np.stack([(B.numpy().view(np.uint32) >> (4 * i)) & 15 for i in range(8)], 1).reshape(K_R, N_R)
    enc = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rans.encode(codes, C_R).items()
           if k != "channels_per_tile"}
    code = (enc["words"], enc["word_offsets"], enc["states"], enc["freqs"])
    decoded = emu.rans_decode(*code, K_R, N_R, C_R, schedule, 3, 1, metal_emu.BARRIER_SWITCH_PREFIX)
    A = torch.randn(3, K_R, generator=g).half()
    C, plan = emu.gemm_rans(A, *code, s, None, None, "fp4", K_R, N_R, GS_R, C_R, None, schedule, 3, 1,
                            metal_emu.BARRIER_SWITCH_PREFIX)
    assert plan["family"] == "decode"
    return torch.equal(decoded, B) and matches(C, A.float() @ dequant_fp4_reference(B, s, GS_R))


@pytest.mark.parametrize("tag", sorted(RANS_NEEDED))
def test_removed_rans_barrier_is_detected(emu, tag):
    emu.set_dropped_barrier("")
    for sch in SCHEDULES:
        assert run_rans(emu, sch), f"intact kernel failed under {sch}"
    emu.set_dropped_barrier(tag)
    try:
        caught = [sch for sch in SCHEDULES if not run_rans(emu, sch)]
    finally:
        emu.set_dropped_barrier("")
    assert set(RANS_NEEDED[tag]) <= set(caught), f"dropping {tag}: caught only under {caught}"


# ---- the executor itself (tests/metal/emu_selftest.metal) --------------------------------------

def test_threadgroup_memory_is_poisoned(emu):
    out = torch.zeros(2 * 128)
    emu.dispatch_raw("selftest_poison", [2, 1, 1], 128, [out])
    assert torch.isnan(out).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_barrier_really_waits(emu, schedule):
    out = torch.zeros(128)
    emu.dispatch_raw("selftest_share", [1, 1, 1], 128, [out], schedule, 1)
    assert torch.equal(out, torch.arange(127, -1, -1, dtype=torch.float32))


def test_divergent_barrier_is_an_error(emu):
    out = torch.zeros(128)
    with pytest.raises(RuntimeError, match="threadgroup_barrier not reached by all threads"):
        emu.dispatch_raw("selftest_divergent", [1, 1, 1], 128, [out])


@pytest.mark.parametrize("schedule", ["forward", "random", "simd_ahead_reverse"])
def test_simd_collectives(emu, schedule):
    x = torch.randn(64)
    out = torch.zeros(64 * 4)
    emu.dispatch_raw("selftest_simd", [1, 1, 1], 64, [x, out], schedule, 2)
    out = out.view(64, 4)
    for sg in range(2):
        lanes = x[32 * sg: 32 * sg + 32]
        got = out[32 * sg: 32 * sg + 32]
        # simd_sum adds lanes 0..31 in order in the harness (hardware order is unspecified).
        total = torch.tensor(0.0)
        for v in lanes:
            total = total + v
        assert torch.equal(got[:, 0], total.expand(32))
        assert torch.equal(got[:, 1], lanes[(torch.arange(32) + 5) % 32])
        down = torch.cat([lanes[1:], lanes[31:]])  # lane 31 keeps its own value
        assert torch.equal(got[:, 2], down)
        assert torch.equal(got[:, 3], lanes[7].expand(32))


def test_device_atomics_across_os_threads(emu):
    counter = torch.zeros(1, dtype=torch.int32)
    emu.dispatch_raw("selftest_atomic", [16, 1, 1], 128, [counter], "random", 0, 2)
    assert int(counter) == 16 * 128


def test_threadgroup_memory_limit_is_enforced(emu):
    out = torch.zeros(128)
    with pytest.raises(RuntimeError, match="threadgroup memory over 32768 bytes"):
        emu.dispatch_raw("selftest_too_much_tg", [1, 1, 1], 128, [out])


# benchmarks/notes/metal-kernels.md: decode fp32 activations staged per simdgroup, 4 x rows x piece (256 / rows up to
# 4 rows, else 64), reused by the meeting's 2 x rows x 128 partials: 1 row 4 KiB, 5 (8) rows
# 8 KiB, 16 rows 16 KiB. The prefill tiles hold stages of A [64][k_step + pad] and transposed
# B [64][k_step + pad] (16 bytes of padding per row) plus the fp32 epilogue stage 4x64: fused two
# stages with k_step 32 (fp16) or 16 (fp32), 2 x 2 x 64 x 80 bytes either way; staged one stage
# with k_step 32 (fp16: 80-byte rows, fp32: 144-byte rows). Every one <= 28 KiB.
@pytest.mark.parametrize("family,M,dtype,expected", [
    ("decode", 1, torch.float16, 4096), ("decode", 5, torch.float16, 8192), ("decode", 16, torch.float16, 16384),
    ("fused_tiles", 64, torch.float16, 2 * 2 * 64 * 80 + 1024),
    ("fused_tiles", 64, torch.float32, 2 * 2 * 64 * 80 + 1024),
    ("striped", 64, torch.float32, 2 * 2 * 64 * 80 + 1024),
    ("staged_tiles", 64, torch.float16, 2 * 64 * 80 + 1024), ("staged_tiles", 64, torch.float32, 2 * 64 * 144 + 1024)])
def test_threadgroup_memory_budget(emu, family, M, dtype, expected):
    A, B, s, _ = problem(M)
    emu.gemm("fp4", A.to(dtype), B, s.to(dtype), None, None, GS, family, 0, "forward", 0, 1)
    assert emu.last_stats()["max_threadgroup_bytes"] == expected
    assert expected <= 28 * 1024


def test_unknown_kernel_is_an_error(emu):
    with pytest.raises(RuntimeError, match="no kernel named"):
        emu.dispatch_raw("nonexistent", [1, 1, 1], 32, [])
