"""The rANS kernels (metal/rans.metal) in the Metal-on-CPU harness: what the op tests
(tests/test_rans_ops.py, metal_emu backend) do not reach.

- rans_decode_packed reproduces the codes bit for bit on streams that refill the threadgroup ring
  many times, on a tile with no words at all (one symbol), on N = 1 and on a partial last tile,
  under every thread order of the executor;
- the fused GEMV (M <= 16) and the staged path (decode, then the prefill GEMM) against plain torch
  on the reference dequantization, every format and dtype;
- corrupted streams, states, frequencies and offsets give numbers, never a read past the word
  stream (the harness puts an inaccessible page right after it: such a read kills the process);
- the plan (kernel per row count, one 32-thread threadgroup per tile) and the threadgroup memory.

The decode reference is torch_marlin/formats/rans.py; weights and GEMM references are tests/reference.py's.
"""

import numpy as np
import pytest
import torch

from torch_marlin.formats import rans, unpack_int4

import metal_emu
from reference import assert_gemm_close, make_weights

SCHEDULES = ("forward", "reverse", "random", "simd_ahead", "simd_ahead_reverse")


@pytest.fixture(scope="module")
def emu():
    return metal_emu.load()


def coded(codes, channels_per_tile=None):
    enc = rans.encode(codes, channels_per_tile)
    t = {k: torch.from_numpy(np.ascontiguousarray(enc[k])) for k in ("words", "word_offsets", "states", "freqs")}
    return (t["words"], t["word_offsets"], t["states"], t["freqs"]), enc["channels_per_tile"]


def packed(codes):
    """B_packed int32 [K/8, N] of codes [K, N] (docs/formats.md: code k % 8 in nibble k % 8)."""
    c = torch.from_numpy(np.asarray(codes)).long()
    out = torch.zeros(c.shape[0] // 8, c.shape[1], dtype=torch.int64)
    for i in range(8):
        out |= c[i::8] << (4 * i)
    return out.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else out.to(torch.int32)


RNG = np.random.default_rng(7)
STREAMS = {
    # ~4 bits per code: each tile's stream is ~1100 words, the ring (512) refills twice per channel
    "uniform": (RNG.integers(0, 16, (1024, 9)), 4),
    "skewed_partial_tile": (np.minimum(RNG.geometric(0.5, (512, 7)) - 1, 15), 3),
    "one_symbol_no_words": (np.full((64, 5), 7), 2),
    "single_column": (RNG.integers(0, 16, (96, 1)), 8),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_decode_is_bit_exact(emu, name):
    codes, C = STREAMS[name]
    code, C = coded(codes, C)
    K, N = codes.shape
    for i, schedule in enumerate(SCHEDULES):
        B = metal_emu.rans_decode(*code, K, N, C, schedule=schedule, seed=i)
        assert torch.equal(B, packed(codes)), schedule
    assert np.array_equal(rans.decode(*[t.numpy() for t in code], K, N, C), codes)


CASES = [("fp4", torch.float16, 1, 64), ("fp4", torch.bfloat16, 5, 128), ("fp4", torch.float32, 16, 64),
         ("u4", torch.float16, 16, 128), ("u4", torch.bfloat16, 1, 64), ("u4", torch.float32, 3, 128),
         ("affine", torch.float16, 8, 64), ("affine", torch.bfloat16, 16, 128), ("affine", torch.float32, 1, 64),
         ("fp4", torch.float16, 17, 64), ("u4", torch.bfloat16, 40, 128), ("affine", torch.float32, 20, 64)]


@pytest.mark.parametrize("fmt,dtype,M,gs", CASES)
def test_gemm(emu, fmt, dtype, M, gs):
    K, N, C = 512, 13, 4  # 4 tiles, the last with one channel
    torch.manual_seed(M * 7 + gs)
    w = make_weights(fmt, K, N, gs, dtype)
    code, C = coded(unpack_int4(w["B"]).numpy(), C)
    A = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if M % 2 else None
    C_out, plan = metal_emu.gemm_rans(A, *code, w["scales"], w.get("zeros"), w.get("offsets"), fmt, K, N, gs, C, bias,
                                      schedule=SCHEDULES[M % 5], seed=M, return_plan=True)
    fused = M <= 16
    assert plan["family"] == ("decode" if fused else "staged")
    # Fused: exact fp32 weights and fp32 sums. Staged: the prefill GEMM rounds weights to the dtype.
    assert_gemm_close(C_out, A, w["ref"], bias, exact_products=fused, W_mag=w.get("mag"))


def corrupt(code, what, rng):
    words, offsets, states, freqs = (t.clone() for t in code)
    if what == "words":
        words.copy_(torch.from_numpy(rng.integers(-2**15, 2**15, words.shape).astype(np.int16)))
    elif what == "offsets":
        offsets[1:] = torch.tensor([2**31 - 8, 8] * len(offsets))[: len(offsets) - 1].int()
    elif what == "states":
        states.copy_(torch.from_numpy(rng.integers(-2**31, 2**31, states.shape).astype(np.int32)))
    elif what == "freqs":
        freqs.copy_(torch.from_numpy(rng.integers(-2**15, 2**15, freqs.shape).astype(np.int16)))
    return words, offsets, states, freqs


@pytest.mark.parametrize("what", ["words", "offsets", "states", "freqs"])
def test_corrupted_input_stays_inside_the_stream(emu, what):
    codes, C = STREAMS["uniform"]
    code, C = coded(codes[:256], C)
    bad = corrupt(code, what, np.random.default_rng(1))
    K, N = 256, codes.shape[1]
    B = metal_emu.rans_decode(*bad, K, N, C)
    assert B.shape == (K // 8, N) and not (B == -1).all(dim=0).any()  # every column written
    A = torch.randn(2, K)
    out = metal_emu.gemm_rans(A, *bad, torch.ones(K // 64, N), None, None, "fp4", K, N, 64, C)
    assert out.shape == (2, N) and not torch.isnan(out).all(dim=0).any()


def test_plan_and_threadgroup_memory(emu):
    for M, rows in ((1, 1), (3, 4), (16, 16)):
        (d,) = emu.describe_gemm_rans("u4", M, 1024, 100, 128, 8, "bfloat16")
        assert d["kernel"] == f"rans_gemv_m{rows}_u4_bfloat"
        assert d["grid"] == (13, 1, 1) and d["threads"] == (32, 1, 1)
        assert d["buffers"] == ["A", "words", "word_offsets", "states", "freqs", "scales", "zeros_or_offsets", "bias",
                                "C"]
    staged = emu.describe_gemm_rans("fp4", 64, 1024, 100, 128, 8, "float16", False, False)
    assert staged[0]["kernel"] == "rans_decode_packed" and staged[0]["grid"] == (13, 1, 1)
    assert staged[0]["buffers"] == ["words", "word_offsets", "states", "freqs", "B"]
    # then exactly what gemm_fp4 runs on B_packed
    assert staged[1:] == emu.describe_gemm("fp4", 64, 1024, 100, 128, "float16", False, False)
    codes, C = STREAMS["uniform"]
    code, C = coded(codes, C)
    # table 8 KiB + ring 1 KiB + 1 KiB of staged activations per row (16 rows: 25 KiB <= 28 KiB)
    for M, limit in ((1, 10 * 1024), (16, 25 * 1024)):
        metal_emu.gemm_rans(torch.randn(M, 1024).half(), *code, torch.ones(8, 9).half(), None, None, "fp4", 1024, 9,
                            128, C)
        assert emu.last_stats()["max_threadgroup_bytes"] == limit


def test_bad_arguments(emu):
    codes, C = STREAMS["skewed_partial_tile"]
    code, C = coded(codes, C)
    A = torch.randn(1, 512)
    s = torch.ones(8, 7)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        metal_emu.gemm_rans(A, *code, s, None, None, "fp4", 512, 7, 48, C)
    with pytest.raises(ValueError, match="K must be a positive multiple of 32"):
        metal_emu.rans_decode(*code, 500, 7, C)
    with pytest.raises(ValueError, match=r"word_offsets \[T\+1\], states \[T, 32\]"):
        metal_emu.rans_decode(*code, 512, 7, C + 1)  # tables of another tile count
