"""FP4 / INT4 formats (packing, quantization), the CPU ops' argument checks and the CPU decode
kernel's wide tiles. The ops' correctness on every backend is in tests/test_gemm.py."""

import pytest
import torch

import torch_marlin
from torch_marlin.formats import (dequant_fp4_reference, dequant_u4_reference, pack_int4, quantize_fp4,
                                  quantize_u4, unpack_int4)
from torch_marlin.formats.fp4 import E2M1_VALUES

from reference import assert_gemm_close, make_weights


def run_gemm(fmt, A, w, group_size, bias=None):
    if fmt == "fp4":
        return torch.ops.marlin.gemm_fp4(A, w["B"], w["scales"], group_size, bias)
    return torch.ops.marlin.gemm_u4(A, w["B"], w["scales"], w["zeros"], group_size, bias)


# ---- formats -----------------------------------------------------------------------------------

def test_pack_unpack_roundtrip_and_bit_layout():
    codes = torch.randint(0, 16, (64, 9), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (8, 9)
    assert torch.equal(unpack_int4(packed), codes)
    # LSB first: row k+j of a word sits in bits 4j..4j+3.
    one = torch.zeros(8, 1, dtype=torch.uint8)
    one[7, 0] = 0xF
    one[0, 0] = 0x3
    assert pack_int4(one).item() == torch.tensor(0xF0000003 - 2**32, dtype=torch.int64).item()


def test_fp4_codes_decode_to_e2m1_grid():
    codes = torch.arange(16, dtype=torch.uint8).repeat(8, 1).t().reshape(128, 1)  # each code, 8 times
    B = pack_int4(codes)
    s = torch.ones(1, 1)
    W = dequant_fp4_reference(B, s, 128)
    assert torch.equal(W[::8, 0], E2M1_VALUES)


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
def test_quantize_is_exact_on_representable_weights(fmt):
    # Weights already on the format's grid must survive quantize -> dequant exactly.
    K, N, g = 64, 24, 32
    if fmt == "fp4":
        w = E2M1_VALUES[torch.randint(0, 16, (K, N))] * 0.25
        w[0] = 6 * 0.25  # every group/column attains the max magnitude -> scale = 0.25 exactly
        w[32] = -6 * 0.25
        B, s = quantize_fp4(w, g, scale_dtype=torch.float32)
        assert torch.equal(dequant_fp4_reference(B, s, g), w)
    else:
        q = torch.randint(0, 16, (K, N)).float()
        q[0], q[1], q[32], q[33] = 0, 15, 0, 15
        w = (q - 3) * 0.5
        B, s, z = quantize_u4(w, g, scale_dtype=torch.float32)
        assert torch.equal(dequant_u4_reference(B, s, z, g), w)


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
def test_quantization_error_is_bounded(fmt):
    # RTN error on Gaussian weights: FP4 E2M1 with absmax/6 scales has relative RMS error ~0.09-0.10
    # at g=128; asymmetric INT4 ~0.08. Bounds leave ~30% margin over the measured values.
    w = torch.randn(512, 256)
    if fmt == "fp4":
        W = dequant_fp4_reference(*quantize_fp4(w, 128, scale_dtype=torch.float32), 128)
    else:
        W = dequant_u4_reference(*quantize_u4(w, 128, scale_dtype=torch.float32), 128)
    rel = ((W - w).norm() / w.norm()).item()
    assert rel < {"fp4": 0.13, "u4": 0.11}[fmt]


def test_zero_group_does_not_produce_nan():
    w = torch.zeros(128, 8)
    B, s = quantize_fp4(w, 64)
    assert torch.equal(dequant_fp4_reference(B, s, 64), w)
    B, s, z = quantize_u4(w, 64)
    assert torch.equal(dequant_u4_reference(B, s, z, 64), w)


# ---- argument checks ----------------------------------------------------------------------------

def _args(fmt="u4", K=64, N=16, g=32, dtype=torch.float16):
    w = make_weights(fmt, K, N, g, dtype)
    return torch.randn(4, K).to(dtype), w


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(A=a["A"].to(torch.int32)), TypeError, "A must be float16, bfloat16 or float32"),
    (lambda a: a.update(A=a["A"][None]), ValueError, "A must be 2-D"),
    (lambda a: a.update(A=a["A"][:, :32]), ValueError, r"A must have K = 8 \* B_packed.size\(0\) = 64 columns"),
    (lambda a: a.update(A=a["A"][:, :60]), ValueError, "K must be a positive multiple of 8"),
    (lambda a: a.update(B=a["B"].to(torch.int64)), TypeError, "B_packed must be int32"),
    (lambda a: a.update(B=a["B"][:, :8]), ValueError, r"scales must have shape \[2, 8\]"),
    (lambda a: a.update(scales=a["scales"].float()), TypeError, "scales must have A's dtype"),
    (lambda a: a.update(scales=a["scales"][:1]), ValueError, r"scales must have shape \[2, 16\]"),
    (lambda a: a.update(zeros=a["zeros"].to(torch.int32)), TypeError, "zeros must be uint8"),
    (lambda a: a.update(zeros=a["zeros"][:, :3]), ValueError, r"zeros must have shape \[2, 16\]"),
    (lambda a: a.update(g=12), ValueError, "group_size must be a positive multiple of 8"),
    (lambda a: a.update(g=48), ValueError, r"group_size \(48\) must divide K \(64\)"),
    (lambda a: a.update(g=0), ValueError, "group_size must be a positive multiple of 8"),
    (lambda a: a.update(bias=torch.zeros(15, dtype=torch.float16)), ValueError, r"bias must have shape \[16\]"),
    (lambda a: a.update(bias=torch.zeros(16)), TypeError, "bias must have A's dtype"),
    (lambda a: a.update(scales=a["scales"].to("meta")), ValueError, "scales is on meta but A is on cpu"),
])
def test_gemm_u4_rejects_bad_arguments(mutate, exc, pattern):
    A, w = _args()
    a = {"A": A, "B": w["B"], "scales": w["scales"], "zeros": w["zeros"], "g": 32, "bias": None}
    mutate(a)
    with pytest.raises(exc, match=pattern):
        torch.ops.marlin.gemm_u4(a["A"], a["B"], a["scales"], a["zeros"], a["g"], a["bias"])


def test_gemm_fp4_and_dequant_reject_bad_arguments():
    A, w = _args("fp4")
    with pytest.raises(ValueError, match="B_packed must be 2-D"):
        torch.ops.marlin.gemm_fp4(A, w["B"].flatten(), w["scales"], 32)
    with pytest.raises(ValueError, match="B_packed is on meta but A is on cpu"):
        torch.ops.marlin.gemm_fp4(A, w["B"].to("meta"), w["scales"], 32)
    with pytest.raises(TypeError, match="scales must be float16, bfloat16 or float32"):
        torch.ops.marlin.dequant_fp4(w["B"], w["scales"].to(torch.int32), 32)
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 16\]"):
        torch.ops.marlin.dequant_fp4(w["B"], w["scales"], 16)
    with pytest.raises(ValueError, match="zeros is on meta but B_packed is on cpu"):
        torch.ops.marlin.dequant_u4(w["B"], w["scales"], torch.zeros(2, 16, dtype=torch.uint8, device="meta"), 32)


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(offsets=a["offsets"][:1]), ValueError, r"offsets must have shape \[2, 16\]"),
    (lambda a: a.update(offsets=a["offsets"].t()), ValueError, r"offsets must have shape \[2, 16\]"),
    (lambda a: a.update(offsets=a["offsets"].float()), TypeError, r"offsets must have the dtype of scales"),
    (lambda a: a.update(offsets=a["offsets"].to(torch.uint8)), TypeError, r"offsets must have the dtype of scales"),
    (lambda a: a.update(offsets=a["offsets"].to("meta")), ValueError, "offsets is on meta but A is on cpu"),
    (lambda a: a.update(scales=a["scales"].float(), offsets=a["offsets"].float()), TypeError,
     "scales must have A's dtype"),
])
def test_gemm_affine_rejects_bad_arguments(mutate, exc, pattern):
    A, w = _args("affine")
    a = {"A": A, "B": w["B"], "scales": w["scales"], "offsets": w["offsets"]}
    mutate(a)
    with pytest.raises(exc, match=pattern):
        torch.ops.marlin.gemm_affine(a["A"], a["B"], a["scales"], a["offsets"], 32)
    if "A's dtype" not in pattern:
        with pytest.raises(exc, match=pattern.replace(" A is", " B_packed is")):
            torch.ops.marlin.dequant_affine(a["B"], a["scales"], a["offsets"], 32)


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("M", [1, 5])
def test_gemm_wide_n_decode_tiles(fmt, M):
    # N >= 256 * 2 * threads gives the CPU decode 256-column tiles (16 strips per pass); 2100 is
    # not a multiple of 16, so the last tile also ends in the scalar remainder path.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        K, N, g = 256, 2100, 64
        assert torch_marlin.plan_gemm(fmt, M, K, N, g, caps=dict(compute_units=2))["tile_n"] == 256
        w = make_weights(fmt, K, N, g, torch.float32)
        A = torch.randn(M, K)
        assert_gemm_close(run_gemm(fmt, A, w, g), A, w["ref"])
    finally:
        torch.set_num_threads(threads)
