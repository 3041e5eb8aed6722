"""FP4 / INT4 ops on CPU against torch.matmul on plain-torch dequantized weights, plus argument
checking and the dispatch policy."""

import pytest
import torch

import torch_marlin
from torch_marlin.formats import (dequant_fp4_reference, dequant_u4_reference, pack_int4, quantize_fp4,
                                  quantize_u4, unpack_int4)
from torch_marlin.formats.fp4 import E2M1_VALUES

from reference import assert_gemm_close, make_weights

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
MS = [0, 1, 3, 16, 17, 64, 257]


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
    assert torch.equal(torch.ops.marlin.dequant_fp4(B, s, 128)[::8, 0], E2M1_VALUES)


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


# ---- ops vs torch.matmul ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M", MS)
def test_gemm_matches_matmul(fmt, dtype, group_size, M):
    K, N = 256, 200  # N not a multiple of 64 (nor of the CPU block)
    w = make_weights(fmt, K, N, group_size, dtype)
    A = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if M % 2 else None
    out = run_gemm(fmt, A, w, group_size, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert_gemm_close(out, A, w["ref"], bias)


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16, 40])  # decode row chunks of 4 + remainders, tiled
@pytest.mark.parametrize("N", [1, 7, 65, 300])
def test_gemm_odd_n(fmt, M, N):
    K, g = 64, 8
    w = make_weights(fmt, K, N, g, torch.float16)
    A = torch.randn(M, K).half()
    assert_gemm_close(run_gemm(fmt, A, w, g), A, w["ref"])


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_op_matches_reference(fmt, dtype):
    w = make_weights(fmt, 128, 72, 32, dtype)
    if fmt == "fp4":
        W = torch.ops.marlin.dequant_fp4(w["B"], w["scales"], 32)
    else:
        W = torch.ops.marlin.dequant_u4(w["B"], w["scales"], w["zeros"], 32)
    assert W.dtype == dtype and W.shape == (128, 72)
    # One rounding of an exact product (code value x scale) to the scales' dtype.
    torch.testing.assert_close(W, w["ref"].to(dtype), rtol=0, atol=0)


def test_non_contiguous_inputs_are_handled():
    K, N, g = 128, 96, 64
    w = make_weights("u4", K, N, g, torch.float32)
    A = torch.randn(K, 5).t()  # [5, K] transposed view
    B_nc = torch.stack([w["B"], -w["B"]], dim=2).reshape(K // 8, 2 * N)[:, ::2]  # stride-2 view of B
    assert not A.is_contiguous() and not B_nc.is_contiguous()
    out = torch.ops.marlin.gemm_u4(A, B_nc, w["scales"], w["zeros"], g)
    assert_gemm_close(out, A, w["ref"])


@pytest.mark.parametrize("M", [3, 40])  # decode, and the dequantize-chunk + BLAS path
def test_u4_zero_points_masked_cpu(M):
    # Zero points are 0..15 (docs/formats.md): every backend uses the byte's low 4 bits (the CUDA
    # and Metal-harness tests check theirs), so bytes 240..255 give the same result as 0..15.
    K, N, g = 256, 96, 64
    w = make_weights("u4", K, N, g, torch.float16)
    A = torch.randn(M, K, dtype=torch.float16)
    high = w["zeros"] | 0xF0
    assert torch.equal(torch.ops.marlin.gemm_u4(A, w["B"], w["scales"], high, g),
                       torch.ops.marlin.gemm_u4(A, w["B"], w["scales"], w["zeros"], g))
    assert torch.equal(torch.ops.marlin.dequant_u4(w["B"], w["scales"], high, g),
                       torch.ops.marlin.dequant_u4(w["B"], w["scales"], w["zeros"], g))


def test_gemm_is_deterministic():
    w = make_weights("fp4", 1024, 300, 128, torch.float16)
    for M in (1, 40):
        A = torch.randn(M, 1024).half()
        first = torch.ops.marlin.gemm_fp4(A, w["B"], w["scales"], 128)
        for _ in range(3):
            assert torch.equal(torch.ops.marlin.gemm_fp4(A, w["B"], w["scales"], 128), first)


# ---- argument checks ----------------------------------------------------------------------------

def _args(fmt="u4", K=64, N=16, g=32, dtype=torch.float16):
    w = make_weights(fmt, K, N, g, dtype)
    return torch.randn(4, K).to(dtype), w


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda a: a.update(A=a["A"].to(torch.int32)), TypeError, "A must be float16, bfloat16 or float32"),
    (lambda a: a.update(A=a["A"][None]), ValueError, "A must be 2-D"),
    (lambda a: a.update(A=a["A"][:, :32]), ValueError, "B_packed must have K/8 = 4 rows"),
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


# ---- dispatch policy ---------------------------------------------------------------------------

# Decode up to the backend's measured crossover (csrc/plan/plan.cpp decode_policy_max_m): the CPU
# decode kernel is compute bound and loses to dequant + BLAS from 9 rows; Metal keeps the seed's 16.
@pytest.mark.parametrize("device, decode_max", [("cpu", 8), ("metal", 16)])
def test_policy_selects_decode_for_small_m(device, decode_max):
    for M in range(1, decode_max + 1):
        assert torch_marlin.plan_gemm("fp4", M, 4096, 4096, device=device)["variant"] == "decode"
    assert torch_marlin.plan_gemm("u4", decode_max + 1, 4096, 4096, device=device)["variant"] != "decode"
    # The decode kernels still run up to 16 rows when asked for (tests force them).
    assert torch_marlin.plan_gemm("fp4", 16, 4096, 4096, device=device, variant="decode")["variant"] == "decode"


def test_policy_metal_kernels_by_shape():
    big = torch_marlin.plan_gemm("fp4", 512, 4096, 4096, device="metal")
    assert big["kernel"] == "marlin_gemm_fused_fp4_half" and big["k_parallel"] == 1
    # 1 x 2 output tiles on an 8-core GPU with K = 8192: stripes with K-parallel slices.
    small = torch_marlin.plan_gemm("u4", 64, 8192, 128, dtype=torch.bfloat16, device="metal")
    assert small["variant"] == "striped" and small["k_parallel"] > 1
    assert small["kernel"] == "marlin_gemm_striped_u4_bfloat"
    assert small["workspace_bytes"] == small["k_parallel"] * 64 * 128 * 4
    dec = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="metal")
    assert dec["kernel"] == "marlin_gemv_fp4_half"


def test_policy_cuda_kernels_by_m():
    # Planned without a GPU: decode up to 128 rows, dequantized panels + cuBLAS above, the plain
    # fp32 kernel for fp32 activations.
    def plan(M, K=28672, N=8192, dtype=torch.float16, variant="auto"):
        return torch_marlin.plan_gemm("fp4", M, K, N, dtype=dtype, device="cuda", compute_units=132,
                                      variant=variant)
    assert plan(64)["kernel"] == "decode_fp4_half" and plan(64)["tile_m"] == 64
    two = plan(100)  # two 64-row decode tiles along grid.x
    assert two["kernel"] == "decode_fp4_half" and two["m_tiles"] == 2 and two["grid"][:2] == (2, 256)
    big = plan(129, dtype=torch.bfloat16)
    assert big["kernel"] == "dequant_blas_fp4_bfloat" and big["k_parallel"] == 1
    # One panel of all of N (28672 x 8192 x 2 B = 448 MiB); past the 1 GiB cap N is split evenly
    # in 128-column multiples: 53248 x 16384 x 2 B = 1.6 GiB -> two panels of 8192 columns.
    assert big["tile_n"] == 8192 and big["n_tiles"] == 1 and big["workspace_bytes"] == 28672 * 8192 * 2
    huge = plan(4096, K=53248, N=16384)
    assert huge["tile_n"] == 8192 and huge["n_tiles"] == 2
    assert plan(1024, K=256, N=200)["tile_n"] == 208  # all of N, padded to 16 columns
    assert plan(200, dtype=torch.float32)["kernel"] == "simt_fp4_float"
    with pytest.raises(ValueError, match="tiled \\(wgmma\\) kernel needs an sm_90a build"):
        plan(200, variant="tiled")  # no wgmma without an sm_90a build on an H100-class device
    with pytest.raises(ValueError, match="dequant_blas variant is CUDA fp16/bf16 only"):
        torch_marlin.plan_gemm("fp4", 200, 256, 64, variant="dequant_blas")


def test_policy_cuda_wgmma():
    # Planned without a GPU, as for an sm_90a build on a 132-SM H100 (wgmma=True), for group sizes
    # that wgmma_ws does not take (% 64 != 0): the wgmma kernel above 64 rows and up to 512 when the
    # output has >= 64 tiles of 128 x 128/256 (or K >= 8192), 256-row tiles above 256 rows only in
    # one wave or with a last wave >= 80 % full; otherwise decode (<= 128 rows) and dequant + cuBLAS.
    def plan(M, K=4096, N=12288, group_size=32, wgmma=True, **kw):
        return torch_marlin.plan_gemm("fp4", M, K, N, group_size, device="cuda", compute_units=132, wgmma=wgmma,
                                      **kw)
    assert plan(64)["kernel"] == "decode_fp4_half"
    w = plan(65, dtype=torch.bfloat16)
    assert w["kernel"] == "wgmma_fp4_bfloat" and w["variant"] == "tiled"
    assert w["tile_m"] == 128 and w["tile_n"] == 128 and w["threads"] == (256, 1, 1)
    assert w["grid"] == (1, 96, 1) and w["k_parallel"] == 1 and w["workspace_bytes"] == 0
    assert plan(200)["tile_m"] == 256 and plan(512, N=8192)["kernel"] == "wgmma_fp4_half"
    assert plan(384)["kernel"] == "dequant_blas_fp4_half"  # 2 x 96 tiles: a second wave 73 % full
    assert plan(384, N=21504)["kernel"] == "wgmma_fp4_half"  # 2 x 168 tiles: 3 waves, 85 % full
    assert plan(512, N=21504)["grid"] == (2, 168, 1)
    assert plan(513, N=8192)["kernel"] == "dequant_blas_fp4_half"
    assert plan(128, N=4096)["kernel"] == "decode_fp4_half"  # 32 tiles: too few
    assert plan(200, N=4096)["kernel"] == "dequant_blas_fp4_half"
    long_k = plan(200, K=10752, N=4096)  # 32 tiles, but 4 slices of 2688 k each
    assert long_k["kernel"] == "wgmma_fp4_half" and long_k["grid"] == (1, 32, 4) and long_k["k_slice_len"] == 2688
    assert plan(100, K=4096, N=4096)["kernel"] == "decode_fp4_half"  # 32 tiles, short K: decode
    # 128-row tiles are 256 columns wide unless half as many tiles would need more K slices.
    wide = plan(128, K=10752, N=4096)  # 16 wide tiles, 4 slices (as 32 narrow ones would need)
    assert wide["kernel"] == "wgmma_fp4_half" and wide["tile_n"] == 256 and wide["grid"] == (1, 16, 4)
    assert plan(100, N=21504)["tile_n"] == 256 and plan(100, N=21504)["grid"] == (1, 84, 1)
    narrow = plan(100, K=28672, N=8192)  # 32 wide tiles would need 4 slices, 64 narrow ones 2
    assert narrow["tile_n"] == 128 and narrow["grid"] == (1, 64, 2)
    assert plan(65)["tile_n"] == 128  # 48 wide tiles would need 2 slices, 96 narrow ones 1
    four = plan(300, N=4096)  # 2 row tiles x 32 column tiles, 2 K slices
    assert four["kernel"] == "wgmma_fp4_half" and four["grid"] == (2, 32, 2)
    assert plan(128, wgmma=False)["kernel"] == "decode_fp4_half"
    assert plan(128, K=6144, group_size=96)["kernel"] == "wgmma_fp4_half"
    # Shapes the kernel does not take: K % 64, group_size % 32, fp32 activations.
    assert plan(128, K=4104, group_size=8)["kernel"] == "decode_fp4_half"
    assert plan(128, group_size=16)["kernel"] == "decode_fp4_half"
    assert plan(128, dtype=torch.float32)["kernel"] == "simt_fp4_float"
    with pytest.raises(ValueError, match="needs K % 64 == 0 and group_size % 32 == 0"):
        plan(128, K=4104, group_size=8, variant="tiled")
    # K slices (at most 4, each >= 512 rows) when the tiles leave SMs idle; always summed through a
    # thread-block cluster (no workspace).
    kp = plan(100, K=2048, N=8192)
    assert kp["kernel"] == "wgmma_fp4_half" and kp["k_parallel"] == 2 and kp["grid"] == (1, 64, 2)
    assert kp["reduce_kernel"] == "cluster_reduce" and kp["workspace_bytes"] == 0
    forced = plan(8, K=8192, N=256, variant="tiled")  # 2 tiles: the slice cap, not the SM count
    assert forced["k_parallel"] == 4 and forced["k_slice_len"] == 2048


def test_policy_cuda_wgmma_ws():
    # Planned without a GPU, as for an sm_90a build on a 132-SM H100: the warp-specialized kernel
    # from 33 rows on (any N, any M) when K % 64 == 0 and group_size % 64 == 0 (from 17 rows where
    # K <= 8192 and its blocks fill half the SMs with at most 2 K slices); 64 / 128 / 256
    # activation rows a tile, 2 consumer warpgroups (128 columns) or 3 (192) where that grid runs in
    # fewer stage-waves, K slices when the tiles leave SMs idle: 2 summed through a cluster, 3..4
    # through global memory (256-row tiles: <= 3, all through clusters).
    def plan(M, K=4096, N=12288, group_size=128, wgmma=True, **kw):
        return torch_marlin.plan_gemm("fp4", M, K, N, group_size, device="cuda", compute_units=132, wgmma=wgmma,
                                      thread_block_clusters=True, **kw)
    assert plan(16)["kernel"] == "decode_fp4_half"
    for M in (17, 32):  # 4096 x 12288: 64 tiles x 2 slices; the others keep decode up to 32 rows
        assert plan(M)["kernel"] == "wgmma_ws_fp4_half" and plan(M)["k_parallel"] == 2
        assert plan(M, N=21504)["kernel"] == "wgmma_ws_fp4_half"
        assert plan(M, N=4096)["kernel"] == "decode_fp4_half"  # 3 slices
        assert plan(M, K=10752, N=4096)["kernel"] == "decode_fp4_half"
        assert plan(M, K=28672, N=8192)["kernel"] == "decode_fp4_half"  # K > 8192
        assert plan(M, K=512, N=96)["kernel"] == "decode_fp4_half"  # 1 tile: 1 slice, 1 SM
    w = plan(33, dtype=torch.bfloat16)
    assert w["kernel"] == "wgmma_ws_fp4_bfloat" and w["variant"] == "warp_specialized"
    assert (w["tile_m"], w["tile_n"], w["threads"], w["grid"]) == (64, 192, (512, 1, 1), (1, 64, 2))
    assert w["reduce_kernel"] == "cluster_reduce" and w["workspace_bytes"] == 0 and w["k_slice_len"] == 2048
    assert plan(128)["tile_m"] == 128 and (plan(129)["tile_m"], plan(129)["tile_n"]) == (256, 128)
    assert plan(4096)["kernel"] == "wgmma_ws_fp4_half" and plan(4096)["grid"] == (16, 96, 1)
    # 32 tiles: 4 slices in 128 SMs, summed by each tile's last block through an fp32 workspace of
    # whole tiles (32 x 4 x 64 x 128 floats); 10752 x 4096 alike; 128-row tiles too.
    for M, K in [(64, 4096), (64, 10752), (128, 4096)]:
        gw = plan(M, K=K, N=4096)
        assert (gw["grid"], gw["reduce_kernel"]) == ((1, 32, 4), "last_block_reduce"), gw
        assert gw["workspace_bytes"] == 32 * 4 * gw["tile_m"] * 128 * 4 and gw["k_slice_len"] == K // 4
    # 256-row tiles keep at most 3 slices through clusters (4096 x 4096 at M = 256: 32 tiles x 3).
    w256 = plan(256, N=4096)
    assert (w256["grid"], w256["reduce_kernel"], w256["workspace_bytes"]) == ((1, 32, 3), "cluster_reduce", 0)
    # 28672 x 8192: 43 tiles of 192 columns x 3 slices through global memory (129 blocks; 43
    # clusters of 3 would not fit in one wave) beat 64 tiles of 128 x 2 through clusters.
    big = plan(64, K=28672, N=8192)
    assert (big["tile_n"], big["grid"], big["reduce_kernel"]) == (192, (1, 43, 3), "last_block_reduce")
    assert (plan(256, K=28672, N=8192)["grid"], plan(256, K=28672, N=8192)["reduce_kernel"]) == \
        ((1, 64, 2), "cluster_reduce")
    assert (plan(64, N=21504)["tile_n"], plan(64, N=21504)["grid"]) == (192, (1, 112, 1))  # 1 wave, not 2
    assert plan(1024, group_size=64)["kernel"] == "wgmma_ws_fp4_half"
    # A partial last wave becomes a second launch with K slices: 4096 x 21504 at M = 1024 is 672
    # tiles, 5 waves + 12 tiles; the 12 (3 column tiles x 4 row tiles) run as 3-slice clusters.
    tail = plan(1024, N=21504)
    assert (tail["grid"], tail["k_parallel"], tail["n_tiles"]) == ((4, 165, 1), 1, 168)
    assert (tail["tail_n_tiles"], tail["tail_k_parallel"], tail["tail_k_slice_len"]) == (3, 3, 1408)
    # 168 tiles at M = 256: 36 in the tail, 2 slices (3 would take more than 3/4 of the SMs).
    assert (plan(256, N=21504)["grid"], plan(256, N=21504)["tail_n_tiles"], plan(256, N=21504)["tail_k_parallel"]) \
        == ((1, 132, 1), 36, 2)
    # No tail: one wave, a last wave too full for K slices (4096 x 12288 at M = 4096: 96 tiles), or
    # more than 10 whole waves (4096 x 21504 at M = 4096: 20 waves + 48 tiles).
    for M, N in [(4096, 12288), (64, 4096), (1024, 4096), (4096, 21504)]:
        assert plan(M, N=N)["tail_n_tiles"] == 0 and plan(M, N=N)["tail_k_parallel"] == 1
    # Shapes it does not take: group_size % 64 != 0, K % 64 != 0, no sm_90a build, fp32 activations.
    assert plan(100, group_size=32)["kernel"] == "wgmma_fp4_half"
    assert plan(100, K=4104, group_size=8)["kernel"] == "decode_fp4_half"
    assert plan(100, wgmma=False)["kernel"] == "decode_fp4_half"
    assert plan(300, wgmma=False)["kernel"] == "dequant_blas_fp4_half"
    assert plan(100, dtype=torch.float32)["kernel"] == "simt_fp4_float"
    with pytest.raises(ValueError, match="needs K % 64 == 0 and group_size % 64 == 0"):
        plan(100, group_size=32, variant="warp_specialized")
    with pytest.raises(ValueError, match="warp_specialized.*needs an sm_90a"):
        plan(100, wgmma=False, variant="warp_specialized")
    with pytest.raises(ValueError, match="warp_specialized variant is CUDA fp16/bf16 only"):
        torch_marlin.plan_gemm("fp4", 100, 256, 64, variant="warp_specialized")
    with pytest.raises(ValueError, match="warp_specialized variant is CUDA fp16/bf16 only"):
        plan(100, dtype=torch.float32, variant="warp_specialized")


@pytest.mark.parametrize("clusters", [False, True])
def test_policy_cuda_k_slice_reduction(clusters):
    # Planned without a GPU: 2 decode K slices reduce through a thread-block cluster (no workspace)
    # where the device and build have clusters; more slices, or no clusters, through the global
    # fp32 workspace [k_parallel][M][N] summed by the last block of each tile.
    def plan(M, K, N):
        return torch_marlin.plan_gemm("fp4", M, K, N, device="cuda", compute_units=132,
                                      thread_block_clusters=clusters)
    two, four, one = plan(4, 2048, 328), plan(4, 4096, 328), plan(4, 4096, 8192)
    assert two["k_parallel"] == 2 and four["k_parallel"] == 4 and one["k_parallel"] == 1
    if clusters:
        assert two["reduce_kernel"] == "cluster_reduce" and two["workspace_bytes"] == 0
    else:
        assert two["reduce_kernel"] == "last_block_reduce" and two["workspace_bytes"] == 2 * 4 * 328 * 4
    assert four["reduce_kernel"] == "last_block_reduce" and four["workspace_bytes"] == 4 * 4 * 328 * 4
    assert one["reduce_kernel"] == "" and one["workspace_bytes"] == 0
    # dequant_blas never splits K, clusters or not.
    big = plan(300, 2048, 328)
    assert big["variant"] == "dequant_blas" and big["reduce_kernel"] == ""


@pytest.mark.parametrize("clusters", [False, True])
def test_policy_cuda_dependent_launch(clusters):
    # Programmatic dependent launch: decode where the device and build run clusters (sm_90 with
    # sm_90 PTX), wgmma_ws always (sm_90a only); never the wgmma, dequant_blas or fp32 kernels,
    # nor any backend but CUDA.
    def plan(M, group_size=128, dtype=torch.float16, device="cuda", N=4096):
        return torch_marlin.plan_gemm("fp4", M, 4096, N, group_size, dtype=dtype, device=device,
                                      compute_units=132, thread_block_clusters=clusters, wgmma=clusters)
    assert plan(1)["kernel"].startswith("decode_") and plan(1)["dependent_launch"] == clusters
    if clusters:
        assert plan(64)["kernel"].startswith("wgmma_ws_") and plan(64)["dependent_launch"]
        wgmma = plan(128, group_size=32, N=12288)
        assert wgmma["kernel"].startswith("wgmma_fp4") and not wgmma["dependent_launch"]
    assert not plan(1024, group_size=32)["dependent_launch"]  # dequant_blas
    assert not plan(8, dtype=torch.float32)["dependent_launch"]  # simt
    assert not plan(1, device="cpu")["dependent_launch"]


def test_policy_rejects_bad_names():
    with pytest.raises(ValueError, match="format must be one of"):
        torch_marlin.plan_gemm("int3", 1, 256, 64)
    with pytest.raises(ValueError, match="variant must be one of"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, variant="fast")
    with pytest.raises(ValueError, match="decode variant handles M <= 16"):
        torch_marlin.plan_gemm("fp4", 17, 256, 64, variant="decode")


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("M", [1, 5])
def test_gemm_wide_n_decode_tiles(fmt, M):
    # N >= 256 * 2 * threads gives the CPU decode 256-column tiles (16 strips per pass); 2100 is
    # not a multiple of 16, so the last tile also ends in the scalar remainder path.
    torch.set_num_threads(2)
    K, N, g = 256, 2100, 64
    assert torch_marlin.plan_gemm(fmt, M, K, N, g, caps=dict(compute_units=2))["tile_n"] == 256
    w = make_weights(fmt, K, N, g, torch.float32)
    A = torch.randn(M, K)
    assert_gemm_close(run_gemm(fmt, A, w, g), A, w["ref"])
