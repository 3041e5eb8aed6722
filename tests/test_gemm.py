"""FP4 / INT4 / affine INT4 ops (gemm_fp4, gemm_u4, gemm_affine, dequant_*) on every backend of tests/backends.py
against torch.matmul on weights dequantized by plain torch (tests/reference.py, error bounds there).

The Metal harness runs the kernels as emulated threads (a 257-row prefill case takes about a
second), so in the main matrix it runs M up to two prefill tiles (100 rows), half the cases with
bias; the other backends run all of it. Shapes are chosen for the kernels' edges, not read from
the planner: decode rows (M <= 8 on CPU, 16 on Metal, 128 on CUDA), prefill rows, partial tiles.
Affine runs the same kernels as u4 with a float offset in place of the zero point, so it runs half
of the main matrix (bias on odd M only; on the harness one K and group size and M <= 64, elsewhere
M <= 16).
"""

import itertools

import pytest
import torch

from backends import BACKENDS, METAL_EMU, cases
from reference import assert_gemm_close, make_weights
from torch_marlin.formats import dequant_fp4_reference, pack_int4
from torch_marlin.formats.fp4 import E2M1_VALUES

FORMATS = ["fp4", "u4", "affine"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def run_gemm(backend, fmt, A, w, group_size, bias=None):
    if fmt == "fp4":
        return backend.gemm_fp4(A, w["B"], w["scales"], group_size, bias)
    if fmt == "affine":
        return backend.gemm_affine(A, w["B"], w["scales"], w["offsets"], group_size, bias)
    return backend.gemm_u4(A, w["B"], w["scales"], w["zeros"], group_size, bias)


def run_dequant(backend, fmt, w, group_size):
    if fmt == "fp4":
        return backend.dequant_fp4(w["B"], w["scales"], group_size)
    if fmt == "affine":
        return backend.dequant_affine(w["B"], w["scales"], w["offsets"], group_size)
    return backend.dequant_u4(w["B"], w["scales"], w["zeros"], group_size)


def assert_close(out, A, w, bias, backend):
    assert_gemm_close(out, A, w["ref"], bias, exact_products=backend.exact_products, W_mag=w.get("mag"))


def skip_main(backend, f, d, K, g, M, b):
    if backend is METAL_EMU and (M not in EMU_MS or b != (M % 2 == 1)):
        return True
    return f == "affine" and (b != (M % 2 == 1) or (backend is METAL_EMU and (K != 288 or M > 64)))


def skip_affine_emu_long(backend, f, *shape):
    """Affine on the harness: the small-M shapes only (its kernels are u4's; this keeps the time)."""
    return f == "affine" and backend is METAL_EMU and shape[-2] > 16


# (K, group_size): K = 288 is not a multiple of a 64-row K tile (partial last tile), each group
# size a different number of groups per tile. M: empty, decode rows (4-row chunks and remainders
# on CPU, 1..16 on Metal, 64-row decode tiles up to 128 on CUDA, two of them at 100) and prefill
# rows (17: a partial first tile; 257: a partial fifth 64-row tile). N = 200 is not a multiple of
# 16 or 64 (edge tiles, the padded-weight path on CUDA).
K_GROUP = [(288, 32), (256, 64), (384, 128)]
MS = [0, 1, 3, 16, 17, 64, 100, 257]
EMU_MS = (0, 1, 3, 16, 17, 64, 100)


@pytest.mark.parametrize("backend, fmt, dtype, K, group_size, M, with_bias", cases(
    [(f, d, K, g, M, b) for f, d, (K, g), M, b in itertools.product(FORMATS, DTYPES, K_GROUP, MS, [False, True])],
    skip=skip_main))
def test_gemm_matches_matmul(backend, fmt, dtype, K, group_size, M, with_bias):
    N = 200
    w = make_weights(fmt, K, N, group_size, dtype)
    A = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if with_bias else None
    out = run_gemm(backend, fmt, A, w, group_size, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert_close(out, A, w, bias, backend)


@pytest.mark.parametrize("backend, fmt, M, N", cases(list(itertools.product(
    FORMATS, [1, 2, 5, 8, 16, 40, 257], [1, 7, 65, 300])), skip=skip_affine_emu_long))
def test_gemm_odd_n(backend, fmt, M, N):
    # N below a tile, not a multiple of 8, 16 or 64, and above one CPU block; group size 8.
    K, g = 64, 8
    w = make_weights(fmt, K, N, g, torch.float16)
    A = torch.randn(M, K).half()
    assert_close(run_gemm(backend, fmt, A, w, g), A, w, None, backend)


@pytest.mark.parametrize("backend, fmt, dtype, M, N", cases(list(itertools.product(
    FORMATS, [torch.float16, torch.bfloat16], [1, 9, 40], [64, 100])), skip=skip_affine_emu_long))
def test_gemm_long_k_small_n(backend, fmt, dtype, M, N):
    # Few output columns and a long K: Metal and CUDA split K over parallel slices (decode rows,
    # and Metal's striped kernel at 40 rows) and sum them in a fixed order.
    K, g = 2048, 128
    w = make_weights(fmt, K, N, g, dtype)
    A = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype)
    assert_close(run_gemm(backend, fmt, A, w, g, bias), A, w, bias, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_non_contiguous_inputs(backend):
    K, N, g = 128, 96, 64
    w = make_weights("u4", K, N, g, torch.float32)
    A = torch.randn(K, 5).t()  # [5, K] transposed view
    B_nc = torch.stack([w["B"], -w["B"]], dim=2).reshape(K // 8, 2 * N)[:, ::2]  # stride-2 view of B
    assert not A.is_contiguous() and not B_nc.is_contiguous()
    out = backend.gemm_u4(A, B_nc, w["scales"], w["zeros"], g)
    assert_gemm_close(out, A, w["ref"], exact_products=backend.exact_products)


@pytest.mark.parametrize("backend, M", cases([3, 40]))
def test_u4_zero_points_use_low_4_bits(backend, M):
    # Zero points are 0..15 (docs/formats.md): every backend reads the byte's low 4 bits, so bytes
    # 240..255 give the same result as 0..15.
    K, N, g = 256, 96, 64
    w = make_weights("u4", K, N, g, torch.float16)
    A = torch.randn(M, K, dtype=torch.float16)
    high = w["zeros"] | 0xF0
    assert torch.equal(backend.gemm_u4(A, w["B"], w["scales"], high, g),
                       backend.gemm_u4(A, w["B"], w["scales"], w["zeros"], g))
    assert torch.equal(backend.dequant_u4(w["B"], w["scales"], high, g),
                       backend.dequant_u4(w["B"], w["scales"], w["zeros"], g))


# N = 0 returns an empty result before any planning or launch; the harness runs planned kernels only.
@pytest.mark.parametrize("backend, fmt, M", cases(list(itertools.product(FORMATS, [0, 1, 40])),
                                                  skip=lambda backend, f, M: backend is METAL_EMU))
def test_gemm_and_dequant_with_n_zero(backend, fmt, M):
    K, g = 128, 64
    w = {"B": torch.zeros(K // 8, 0, dtype=torch.int32), "scales": torch.zeros(K // g, 0, dtype=torch.float16),
         "zeros": torch.zeros(K // g, 0, dtype=torch.uint8), "offsets": torch.zeros(K // g, 0, dtype=torch.float16)}
    A = torch.randn(M, K, dtype=torch.float16)
    out = run_gemm(backend, fmt, A, w, g, torch.zeros(0, dtype=torch.float16))
    assert out.shape == (M, 0) and out.dtype == torch.float16
    W = run_dequant(backend, fmt, w, g)
    assert W.shape == (K, 0) and W.dtype == torch.float16


# The harness repeats one thread order per call; its own tests vary the order (test_metal_harness.py).
@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] is not METAL_EMU])
def test_gemm_is_deterministic(backend):
    w = make_weights("fp4", 1024, 300, 128, torch.float16)
    for M in (1, 40):
        A = torch.randn(M, 1024).half()
        first = backend.gemm_fp4(A, w["B"], w["scales"], 128)
        for _ in range(3):
            assert torch.equal(backend.gemm_fp4(A, w["B"], w["scales"], 128), first)


# ---- dequant -----------------------------------------------------------------------------------

# (K, N, group_size): N = 72 and 100 below a 128-column tile, 203 with a scalar tail (N % 8 != 0).
DEQUANT_SHAPES = [(128, 72, 32), (192, 100, 32), (512, 200, 64), (512, 203, 64)]


@pytest.mark.parametrize("backend, fmt, dtype, K, N, group_size", cases(
    [(f, d, *s) for f, d, s in itertools.product(FORMATS, DTYPES, DEQUANT_SHAPES)]))
def test_dequant_matches_reference(backend, fmt, dtype, K, N, group_size):
    w = make_weights(fmt, K, N, group_size, dtype)
    W = run_dequant(backend, fmt, w, group_size)
    assert W.dtype == dtype and W.shape == (K, N)
    # Code value x scale (affine: + offset, one fused rounding) in fp32, rounded once to the
    # scales' dtype, as the reference: bitwise.
    assert torch.equal(W, w["ref"].to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequant_fp4_codes_are_e2m1_grid(backend):
    codes = torch.arange(16, dtype=torch.uint8).repeat(8, 1).t().reshape(128, 1)  # each code, 8 times
    B = pack_int4(codes)
    s = torch.ones(1, 1)
    assert torch.equal(backend.dequant_fp4(B, s, 128)[::8, 0], E2M1_VALUES)
    assert torch.equal(dequant_fp4_reference(B, s, 128)[::8, 0], E2M1_VALUES)


@pytest.mark.parametrize("backend, M", cases([3, 40]))
def test_affine_offsets_are_not_zero_points(backend, M):
    # The same codes and scales with offsets b = -z * s give u4's weights (s * (q - z)).
    K, N, g = 256, 96, 64
    w = make_weights("u4", K, N, g, torch.float32)
    offsets = -w["zeros"].float() * w["scales"]
    A = torch.randn(M, K)
    out = backend.gemm_affine(A, w["B"], w["scales"], offsets, g)
    assert_gemm_close(out, A, w["ref"], exact_products=backend.exact_products)
    assert torch.allclose(backend.dequant_affine(w["B"], w["scales"], offsets, g), w["ref"], rtol=0, atol=1e-5)
