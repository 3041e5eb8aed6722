"""The CPU decode kernels of gemm_trellis (M <= 16): the AVX-512 kernel, the AVX2 kernel and the
portable one (run on any machine through the test module tests/cpu_with_caps.py, which plans with caps
``avx2=False, avx512=False``), the planner's choice among them and its CPU decode geometry. Reference and error bounds: tests/reference.py (fp64 matmul on
the plain-torch dense weight)."""

import pytest
import torch

import torch_marlin
from torch_marlin import _C
import cpu_with_caps
from reference import assert_trellis_gemm_close, dequant_ref, random_trellis

HAS_AVX2 = _C.device_caps("cpu")["avx2"]
HAS_AVX512 = _C.device_caps("cpu")["avx512"]
NO_AVX2 = "this build or CPU has no AVX2 kernels"
NO_AVX512 = "this CPU lacks AVX-512 F/BW/VL/DQ (or this build is not x86-64 GCC/Clang): no AVX-512 kernel to run"
KERNELS = ["portable",
           pytest.param("avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason=NO_AVX2)),
           pytest.param("avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason=NO_AVX512))]


def caps_for(kernel, threads):
    return dict(compute_units=threads, avx2=kernel == "avx2", avx512=kernel == "avx512")


def gemm(kernel, A, t, K, N, bits, gs, threads=2):
    return cpu_with_caps.load().gemm_trellis_cpu_with_caps(caps_for(kernel, threads), A, *t, K, N, bits, gs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_every_decode_row_count(kernel, bits):
    # AVX2: M = 1..4 run register strips, M > 4 the decoded-tile passes of up to 4 rows; AVX-512:
    # one instantiation per M. K = 200 (a partial tile row and, with group 128, a partial group),
    # N = 77 (a partial tile column).
    K, N, gs = 200, 77, 128
    t = random_trellis(K, N, bits, gs, seed=bits)
    W = dequant_ref(t, K, N, bits, gs)
    for M in range(1, 17):
        A = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        C = gemm(kernel, A, t, K, N, bits, gs)
        assert C.shape == (M, N) and C.dtype == torch.float32
        assert_trellis_gemm_close(C, A, W)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 7])
def test_dtypes_and_column_blocks(kernel, dtype, M):
    # 3 threads' worth of tasks over N = 1000: several column blocks, the last one partial.
    K, N, bits, gs = 96, 1000, 3, 32
    plan = torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, caps=caps_for(kernel, 3))
    assert plan["n_tiles"] >= 3 and plan["n_tiles"] * plan["tile_n"] >= N
    t = random_trellis(K, N, bits, gs, seed=M)
    A = torch.randn(M, K).to(dtype)
    C = gemm(kernel, A, t, K, N, bits, gs, threads=3)
    assert C.dtype == dtype
    assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("K,N", [(16, 16), (16, 1), (33, 17), (48, 31)])
def test_small_and_odd_shapes(kernel, K, N):
    for bits in (2, 3, 4):
        t = random_trellis(K, N, bits, 16, seed=K + N)
        A = torch.randn(2, K)
        assert_trellis_gemm_close(gemm(kernel, A, t, K, N, bits, 16), A, dequant_ref(t, K, N, bits, 16))


@pytest.mark.skipif(not HAS_AVX2, reason=NO_AVX2)
def test_avx2_matches_portable():
    K, N, bits, gs = 512, 272, 4, 128
    t = random_trellis(K, N, bits, gs, seed=1)
    A = torch.randn(1, K)
    # Same sum order (per tile, scale per tile), so the two agree to a few ulp of the sums.
    torch.testing.assert_close(gemm("avx2", A, t, K, N, bits, gs), gemm("portable", A, t, K, N, bits, gs),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_AVX512, reason=NO_AVX512)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_avx512_matches_portable(bits):
    # N = 280: 17 full tile columns and a partial one over 2 threads' blocks; every M, since the
    # kernel is instantiated per row count.
    K, N, gs = 512, 280, 128
    t = random_trellis(K, N, bits, gs, seed=bits)
    for M in range(1, 17):
        A = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        # Same sums per tile (tile rows split over up to 4 partial sums, scale per tile), so the two
        # agree to a few ulp of the sums.
        torch.testing.assert_close(gemm("avx512", A, t, K, N, bits, gs), gemm("portable", A, t, K, N, bits, gs),
                                   rtol=1e-5, atol=1e-5)


def test_op_runs_the_planned_kernel():
    plan = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, torch.float32)
    expected = ("cpu_trellis_decode_avx512" if HAS_AVX512 else
                "cpu_trellis_decode_avx2" if HAS_AVX2 else "cpu_trellis_decode")
    assert plan["kernel"] == expected
    assert plan["cpu_avx512"] == HAS_AVX512 and plan["cpu_avx2"] == (HAS_AVX2 and not HAS_AVX512)
    assert torch_marlin.plan_trellis(1, 64, 64, caps=dict(avx2=False))["kernel"] == "cpu_trellis_decode"
    assert torch_marlin.plan_trellis(17, 64, 64, caps=dict(avx2=True))["kernel"] == "cpu_trellis_prefill"
    assert torch_marlin.plan_trellis(17, 64, 64, caps=dict(avx512=True))["kernel"] == "cpu_trellis_prefill"


@pytest.mark.parametrize("M", [1, 16])
def test_planner_picks_the_avx512_kernel_from_caps(M):
    # caps avx512 names the AVX-512 kernel over the AVX2 one, with the same geometry; avx512=False
    # plans exactly as without the key.
    for avx2 in (False, True):
        base = dict(compute_units=2, avx2=avx2)
        plain = torch_marlin.plan_trellis(M, 4096, 11008, 3, 128, torch.float16, caps=base)
        off = torch_marlin.plan_trellis(M, 4096, 11008, 3, 128, torch.float16, caps=dict(base, avx512=False))
        on = torch_marlin.plan_trellis(M, 4096, 11008, 3, 128, torch.float16, caps=dict(base, avx512=True))
        assert off == plain and plain["avx512"] is False and plain["cpu_avx512"] is False
        assert plain["kernel"] == ("cpu_trellis_decode_avx2" if avx2 else "cpu_trellis_decode")
        assert plain["cpu_avx2"] == avx2
        assert on["kernel"] == "cpu_trellis_decode_avx512"
        assert on["cpu_avx512"] is True and on["cpu_avx2"] is False and on["avx512"] is True
        differ = {k for k in on if on[k] != plain[k]}
        assert differ == {"kernel", "launches", "avx512", "cpu_avx512"} | ({"cpu_avx2"} if avx2 else set())
    # The plan cache keys on the cap: a cached AVX-512 plan is not served to avx512=False caps.
    cached_on = _C.cached_plan_trellis_gemm(M, 256, 64, 3, 128, "float32", "cpu", dict(avx512=True))
    cached_off = _C.cached_plan_trellis_gemm(M, 256, 64, 3, 128, "float32", "cpu", dict(avx512=False))
    assert cached_on["kernel"] == "cpu_trellis_decode_avx512" and cached_off["kernel"] == "cpu_trellis_decode"


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N", [16, 4096, 11008, 12288])
def test_cpu_decode_geometry(threads, M, N):
    # Column blocks of whole tiles, fp32 accumulators M x tile_n within 16 KiB, every thread busy,
    # and no thread's share of the columns more than one block above an equal share.
    p = torch_marlin.plan_trellis(M, 4096, N, 3, 128, caps=dict(compute_units=threads))
    tile_n, n_tiles = p["tile_n"], p["n_tiles"]
    assert tile_n % 16 == 0 and (n_tiles - 1) * tile_n < N <= n_tiles * tile_n
    assert M * tile_n * 4 <= 16384 or tile_n == 16
    assert n_tiles >= min(threads, -(-N // 16))
    assert -(-n_tiles // threads) * tile_n - N / threads <= tile_n


def test_with_caps_refuses_bad_caps():
    t = random_trellis(32, 32, 2, 32)
    if not HAS_AVX512:
        with pytest.raises(ValueError, match="no AVX-512 kernels"):
            cpu_with_caps.load().gemm_trellis_cpu_with_caps(dict(avx512=True), torch.randn(1, 32), *t, 32, 32, 2, 32)
    with pytest.raises(ValueError, match="unknown key"):
        cpu_with_caps.load().gemm_trellis_cpu_with_caps(dict(simd=1), torch.randn(1, 32), *t, 32, 32, 2, 32)
    with pytest.raises(ValueError, match="packed_indices must have shape"):
        cpu_with_caps.load().gemm_trellis_cpu_with_caps(dict(avx2=False), torch.randn(1, 32), t[0][:, :1], *t[1:], 32, 32,
                                                        2, 32)
