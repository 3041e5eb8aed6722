"""rANS-coded 4-bit codes: the C++ encoder (``rans_encode``, CPU) bit for bit against the numpy
reference coder (torch_marlin/formats/rans.py), and ``rans_decode`` / ``gemm_rans`` on every backend
of tests/backends.py against independent references: the numpy decoder, and plain torch matmuls on
the weight dequantized from the numpy-decoded codes (tests/reference.py, error bounds there).

Shapes are small: N is never a multiple of channels_per_tile (a partial last tile), and the tile
widths give several tiles per layer.
"""

import functools
import itertools

import numpy as np
import pytest
import torch

import cpu_with_caps
from backends import BACKENDS, cases
from reference import assert_gemm_close, make_weights
from torch_marlin.formats import (dequant_affine_reference, dequant_fp4_reference, dequant_u4_reference, pack_int4,
                                  unpack_int4)
from torch_marlin.formats import rans

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FORMATS = ["fp4", "u4", "affine"]


def codes_of(kind: str, K: int, N: int, seed: int = 0) -> torch.Tensor:
    """Codes [K, N] uint8 of one of the distributions the encoder must handle."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.randint(0, 16, (K, N), generator=g).to(torch.uint8)
    if kind == "peaked":  # a quantized Gaussian: a few symbols hold most of the mass, some are rare
        return (torch.randn(K, N, generator=g) * 1.5 + 7.5).round().clamp(0, 15).to(torch.uint8)
    if kind == "single":  # every tile codes one symbol only (frequency 4096)
        return torch.full((K, N), 9, dtype=torch.uint8)
    if kind == "mixed":  # a single-symbol first channel block beside peaked ones
        c = codes_of("peaked", K, N, seed)
        c[:, :4] = 3
        return c
    raise ValueError(kind)


def encode_both(codes: torch.Tensor, C):
    ref = rans.encode(codes.numpy(), C)
    out = torch.ops.marlin.rans_encode(pack_int4(codes), 0 if C is None else C)
    return ref, out


@pytest.mark.parametrize("kind, K, N, C", [
    ("uniform", 64, 1, None),     # N = 1: one tile of one channel
    ("peaked", 96, 13, 4),        # partial last tile (13 = 3 * 4 + 1)
    ("single", 32, 5, 2),
    ("mixed", 128, 37, 4),
    ("peaked", 1024, 3, None),    # the default width (32 channels) is wider than N
    ("peaked", 64, 600, None),    # the default width (512 channels): two tiles, the second partial
])
def test_encode_matches_reference(kind, K, N, C):
    codes = codes_of(kind, K, N, seed=K + N)
    ref, (words, offsets, states, freqs) = encode_both(codes, C)
    assert words.dtype == torch.int16 and offsets.dtype == torch.int32
    assert states.dtype == torch.int32 and freqs.dtype == torch.int16
    np.testing.assert_array_equal(freqs.numpy(), ref["freqs"])
    np.testing.assert_array_equal(states.numpy(), ref["states"])
    np.testing.assert_array_equal(offsets.numpy(), ref["word_offsets"])
    np.testing.assert_array_equal(words.numpy(), ref["words"])


def test_encode_is_independent_of_threads():
    codes = codes_of("peaked", 256, 70, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.marlin.rans_encode(pack_int4(codes), 3)
        torch.set_num_threads(max(2, before))
        many = torch.ops.marlin.rans_encode(pack_int4(codes), 3)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, 4, dtype=torch.int32), 0), "K must be a positive multiple of 32"),  # K = 24
    ((torch.zeros(4, 0, dtype=torch.int32), 0), "N must be positive"),
    ((torch.zeros(4, 4, dtype=torch.int16), 0), "B_packed must be int32"),
    ((torch.zeros(16, dtype=torch.int32), 0), "B_packed must be 2-D"),
])
def test_encode_bad_input(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.marlin.rans_encode(*args)


# ---- rans_decode -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def coded(kind: str, K: int, N: int, C: int, seed: int = 0):
    codes = codes_of(kind, K, N, seed)
    e = rans.encode(codes.numpy(), C)
    return codes, tuple(torch.from_numpy(np.ascontiguousarray(e[k])) for k in ("words", "word_offsets", "states", "freqs"))


@pytest.mark.parametrize("backend, kind, K, N, C", cases([
    ("peaked", 96, 13, 4), ("single", 32, 5, 2), ("uniform", 64, 1, 1), ("mixed", 128, 37, 8)]))
def test_decode(backend, kind, K, N, C):
    codes, t = coded(kind, K, N, C)
    B = backend.rans_decode(*t, K, N, C)
    assert B.dtype == torch.int32 and B.shape == (K // 8, N)
    assert torch.equal(unpack_int4(B), codes)


def corrupted(t, tile, word=0x5A5A):
    """The coded layer with one word of `tile`'s stream changed."""
    words = t[0].clone()
    words[int(t[1][tile]) + 1] ^= word
    return (words, *t[1:])


def test_decode_names_the_corrupted_tile():
    K, N, C = 128, 37, 4
    _, t = coded("peaked", K, N, C)
    bad = corrupted(t, 3)
    with pytest.raises(ValueError, match="tile 3 is corrupted"):
        rans.decode(*(x.numpy() for x in bad), K, N, C)  # the reference agrees on the tile
    with pytest.raises(ValueError, match="tile 3 is corrupted"):
        torch.ops.marlin.rans_decode(*bad, K, N, C)
    # A stream cut short reads past its end; a word of padding that is not zero is refused too.
    words, offsets, states, freqs = (x.clone() for x in t)
    words[int(offsets[5]):int(offsets[6])] = 0
    with pytest.raises(ValueError, match="tile 5 is corrupted"):
        torch.ops.marlin.rans_decode(words, offsets, states, freqs, K, N, C)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_stream_does_not_crash(backend):
    backend.require("gemm_rans")
    K, N, C, g = 128, 37, 4, 32
    _, t = coded("peaked", K, N, C)
    bad = list(corrupted(t, 2, word=0xFFFF))
    bad[0][int(t[1][4]):int(t[1][5])] = -1  # a stream of all-ones words keeps reading past its end
    scales = torch.ones(K // g, N)
    for M in (1, 20):  # both families
        C_out = backend.gemm_rans(torch.ones(M, K), *bad, scales, None, None, "fp4", K, N, g, C, None)
        assert C_out.shape == (M, N)


# ---- gemm_rans ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def coded_weights(fmt: str, K: int, N: int, gs: int, dtype: torch.dtype, C: int):
    w = make_weights(fmt, K, N, gs, dtype)
    e = rans.encode(unpack_int4(w["B"]).numpy(), C)
    t = tuple(torch.from_numpy(np.ascontiguousarray(e[k])) for k in ("words", "word_offsets", "states", "freqs"))
    # The reference weight from the numpy decoder's codes, dequantized by plain torch.
    B = pack_int4(torch.from_numpy(rans.decode(*(x.numpy() for x in t), K, N, C)))
    if fmt == "fp4":
        W = dequant_fp4_reference(B, w["scales"], gs)
    elif fmt == "u4":
        W = dequant_u4_reference(B, w["scales"], w["zeros"], gs)
    else:
        W = dequant_affine_reference(B, w["scales"], w["offsets"], gs)
    return w, t, W


def run_gemm(backend, fmt, A, w, t, K, N, gs, C, bias=None):
    zeros = w["zeros"] if fmt == "u4" else None
    offsets = w["offsets"] if fmt == "affine" else None
    return backend.gemm_rans(A, *t, w["scales"], zeros, offsets, fmt, K, N, gs, C, bias)


@pytest.mark.parametrize("backend, fmt, dtype, M", cases(list(itertools.product(FORMATS, DTYPES, [1, 3, 16, 17, 40]))))
def test_gemm_rans(backend, fmt, dtype, M):
    gs = [32, 64, 128][(M + FORMATS.index(fmt)) % 3]
    K, N, C = 128, 37, 5  # 8 tiles, the last one of 2 channels
    w, t, W = coded_weights(fmt, K, N, gs, dtype, C)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    bias = torch.randn(N).to(dtype) if M % 2 else None
    out = run_gemm(backend, fmt, A, w, t, K, N, gs, C, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert_gemm_close(out, A, W, bias, backend.exact_products, W_mag=w.get("mag"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_rans_default_width_and_empty(backend):
    backend.require("gemm_rans")
    K, N, gs = 64, 600, 32  # the default width, 512 channels: two tiles
    w, t, W = coded_weights("u4", K, N, gs, torch.float32, rans.default_channels_per_tile(K))
    A = torch.randn(2, K)
    assert_gemm_close(run_gemm(backend, "u4", A, w, t, K, N, gs, 0), A, W, None, backend.exact_products)
    assert run_gemm(backend, "u4", torch.randn(0, K), w, t, K, N, gs, 0).shape == (0, N)


def test_gemm_rans_matches_the_dense_op():
    K, N, gs, C = 128, 37, 64, 5
    w, t, _ = coded_weights("affine", K, N, gs, torch.float32, C)
    for M in (2, 30):
        A = torch.randn(M, K)
        dense = torch.ops.marlin.gemm_affine(A, w["B"], w["scales"], w["offsets"], gs)
        torch.testing.assert_close(run_gemm(BACKENDS[0].values[0], "affine", A, w, t, K, N, gs, C), dense,
                                   rtol=1e-5, atol=1e-4)


def bad_gemm_cases():
    K, N, gs, C = 64, 10, 32, 4
    w, t, _ = coded_weights("u4", K, N, gs, torch.float32, C)
    words, offsets, states, freqs = t
    A = torch.randn(2, K)
    base = dict(A=A, words=words, word_offsets=offsets, states=states, freqs=freqs, scales=w["scales"],
                zeros=w["zeros"], offsets=None, format="u4", K=K, N=N, group_size=gs, channels_per_tile=C, bias=None)
    bad_freqs = freqs.clone()
    bad_freqs[1, 0] += 1
    low_states = states.clone()
    low_states[2, 7] = 100
    odd_offsets = offsets.clone()
    odd_offsets[1] += 1
    return [
        (dict(A=A.to(torch.int32)), "A must be float16"),
        (dict(A=A[None]), "A must be 2-D"),
        (dict(A=torch.randn(2, K + 32)), "A must have K = 64"),
        (dict(words=words.to(torch.int32)), "words must be int16"),
        (dict(word_offsets=offsets[:-1]), "word_offsets must have shape"),
        (dict(states=states[:, :16]), "states must have shape"),
        (dict(freqs=freqs.to(torch.int32)), "freqs must be"),
        (dict(scales=w["scales"].half()), "scales must be"),
        (dict(scales=w["scales"][:1]), "scales must have shape"),
        (dict(zeros=None), "zeros is required for format 'u4'"),
        (dict(zeros=w["zeros"].to(torch.int32)), "zeros must be"),
        (dict(offsets=w["scales"]), "offsets is only for format 'affine'"),
        (dict(format="nf4"), "format must be one of"),
        (dict(K=48), "K must be a positive multiple of 32"),
        (dict(N=13), "word_offsets must have shape"),
        (dict(group_size=48), "group_size must be a positive multiple of 32"),
        (dict(channels_per_tile=3), "word_offsets must have shape"),
        (dict(bias=torch.randn(N + 1)), "bias must have shape"),
        (dict(freqs=bad_freqs), "freqs of tile 1 must be non-negative and sum to 4096"),
        (dict(states=low_states), "states of tile 2 must be at least 65536"),
        (dict(word_offsets=odd_offsets), "word_offsets must be non-decreasing multiples of 8"),
    ], base


@pytest.mark.parametrize("i", range(21))
def test_gemm_rans_bad_input(i):
    bad, base = bad_gemm_cases()
    change, match = bad[i]
    args = {**base, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.marlin.gemm_rans(*args.values())
    if "A" not in change and "scales" not in change and "zeros" not in change and "offsets" not in change \
            and "format" not in change and "group_size" not in change and "bias" not in change:
        # The coded layer's own arguments are rans_decode's too.
        with pytest.raises((ValueError, TypeError), match=match):
            torch.ops.marlin.rans_decode(args["words"], args["word_offsets"], args["states"], args["freqs"],
                                         args["K"], args["N"], args["channels_per_tile"])


# ---- the plan ----------------------------------------------------------------------------------

def test_plan_rans():
    from torch_marlin import _C, plan_rans

    fused = plan_rans(16, 4096, 4096, 128, "fp4", caps=dict(avx2=False))
    assert fused["family"] == "decode" and fused["kernel"] == "cpu_rans_gemm" and "gemm" not in fused
    assert plan_rans(16, 4096, 4096, 128, "fp4", caps=dict(avx2=True))["kernel"] == "cpu_rans_gemm_avx2"
    assert fused["channels_per_tile"] == 8 and fused["tiles"] == 512 and fused["grid"] == (512, 1, 1)
    staged = plan_rans(17, 4096, 4096, 128, "u4", channels_per_tile=3, has_bias=True, caps=dict(avx2=False))
    assert staged["family"] == "staged" and staged["kernel"] == "cpu_rans_decode"
    assert staged["tiles"] == 1366 and staged["gemm"]["format"] == "u4" and staged["has_bias"]
    metal = plan_rans(1, 4096, 11008, 64, "affine", device="metal")
    assert metal["threads"] == (32, 1, 1) and metal["kernel"] == "rans_gemv_m1_affine_half"
    # CUDA: 4 tiles (warps) per block; the fused kernel's row count is M rounded up to a power of two.
    h100 = dict(compute_units=132, wgmma=True, thread_block_clusters=True)
    cuda = plan_rans(3, 4096, 4096, 128, "fp4", device="cuda", caps=h100)
    assert cuda["kernel"] == "gemm_rans_fp4_half_m4" and cuda["tile_m"] == 4
    assert cuda["grid"] == (128, 1, 1) and cuda["threads"] == (128, 1, 1)
    assert plan_rans(1, 4096, 4096, 128, "u4", 1, torch.bfloat16, device="cuda", caps=h100)["grid"] == (1024, 1, 1)
    cuda_staged = plan_rans(17, 4096, 4096, 128, "u4", dtype=torch.float32, device="cuda", caps=h100)
    assert cuda_staged["kernel"] == "rans_decode" and cuda_staged["grid"] == (128, 1, 1)
    assert cuda_staged["gemm"]["kernel"].startswith("simt")
    caps = _C.device_caps("cpu")
    assert _C.cached_plan_rans_gemm(3, 256, 100, 64, "fp4", 0, "float32", "cpu", caps) == \
        _C.plan_rans_gemm(3, 256, 100, 64, "fp4", 0, "float32", "cpu", caps)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        plan_rans(1, 4096, 4096, 48)
    with pytest.raises(ValueError, match="K must be a positive multiple of 32"):
        plan_rans(1, 4020, 4096, 32)


@pytest.mark.parametrize("avx2, fmt, M", list(itertools.product([False, True], FORMATS, [3, 17])))
def test_cpu_lane_kernels(avx2, fmt, M):
    """The portable and the AVX2 lane decoders (the plan's cpu_avx2), through the same op checks."""
    from torch_marlin import _C

    if avx2 and not _C.device_caps("cpu")["avx2"]:
        pytest.skip("this build or CPU has no AVX2 kernels")
    caps = dict(avx2=avx2, compute_units=2)
    K, N, gs, C = 96, 37, 32, 5
    w, t, W = coded_weights(fmt, K, N, gs, torch.float32, C)
    hooks = cpu_with_caps.load()
    assert torch.equal(hooks.rans_decode_cpu_with_caps(caps, *t, K, N, C), pack_int4(unpack_int4(w["B"])))
    A = torch.randn(M, K)
    out = hooks.gemm_rans_cpu_with_caps(caps, A, *t, w["scales"], w["zeros"] if fmt == "u4" else None,
                                        w["offsets"] if fmt == "affine" else None, fmt, K, N, gs, C, None)
    assert_gemm_close(out, A, W, None, True, W_mag=w.get("mag"))
    with pytest.raises(ValueError, match="tile 2 is corrupted"):
        hooks.rans_decode_cpu_with_caps(caps, *corrupted(t, 2), K, N, C)
