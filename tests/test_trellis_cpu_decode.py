"""The CPU decode kernels of gemm_trellis (M <= 16): the AVX2 kernel and the portable one (run on
any machine through ``_C.gemm_trellis_cpu_with_caps``, which plans with caps ``avx2=False``), and
the planner's CPU decode geometry. Reference and error bounds: tests/reference.py (fp64 matmul on
the plain-torch dense weight)."""

import pytest
import torch

import torch_marlin
from torch_marlin import _C
from reference import assert_trellis_gemm_close, dequant_ref, random_trellis

HAS_AVX2 = _C.device_caps("cpu")["avx2"]
KERNELS = ["portable"] + (["avx2"] if HAS_AVX2 else [])


def gemm(kernel, A, t, K, N, bits, gs, threads=2):
    caps = dict(compute_units=threads, avx2=kernel == "avx2")
    return _C.gemm_trellis_cpu_with_caps(caps, A, *t, K, N, bits, gs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_every_decode_row_count(kernel, bits):
    # M = 1..4 run register strips, M > 4 the decoded-tile passes of up to 4 rows; K = 200 (a
    # partial tile row and, with group 128, a partial group), N = 77 (a partial tile column).
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
    plan = torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, caps=dict(compute_units=3, avx2=kernel == "avx2"))
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


def test_avx2_matches_portable():
    if not HAS_AVX2:
        pytest.skip("this build or CPU has no AVX2 kernels")
    K, N, bits, gs = 512, 272, 4, 128
    t = random_trellis(K, N, bits, gs, seed=1)
    A = torch.randn(1, K)
    # Same sum order (per tile, scale per tile), so the two agree to a few ulp of the sums.
    torch.testing.assert_close(gemm("avx2", A, t, K, N, bits, gs), gemm("portable", A, t, K, N, bits, gs),
                               rtol=1e-5, atol=1e-5)


def test_op_runs_the_planned_kernel():
    plan = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, torch.float32)
    assert plan["kernel"] == ("cpu_trellis_decode_avx2" if HAS_AVX2 else "cpu_trellis_decode")
    assert plan["cpu_avx2"] == HAS_AVX2
    assert torch_marlin.plan_trellis(1, 64, 64, caps=dict(avx2=False))["kernel"] == "cpu_trellis_decode"
    assert torch_marlin.plan_trellis(17, 64, 64, caps=dict(avx2=True))["kernel"] == "cpu_trellis_prefill"


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
    with pytest.raises(ValueError, match="unknown key"):
        _C.gemm_trellis_cpu_with_caps(dict(simd=1), torch.randn(1, 32), *t, 32, 32, 2, 32)
    with pytest.raises(ValueError, match="packed_indices must have shape"):
        _C.gemm_trellis_cpu_with_caps(dict(avx2=False), torch.randn(1, 32), t[0][:, :1], *t[1:], 32, 32, 2, 32)
