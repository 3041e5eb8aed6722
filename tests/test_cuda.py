"""CUDA-specific tests of the FP4 / INT4 ops: each kernel family's shapes and the plan it gets on a
GPU, K-slice reductions, determinism, large shapes, streams, CUDA graphs, programmatic dependent
launch chains, alignment. Checked against torch.matmul on weights dequantized by the pure-torch
references in torch_marlin.formats, computed in fp32. The backend-independent matrix (formats x
dtypes x group sizes x M, dequant) runs on CUDA from tests/test_gemm.py.

Skips cleanly when torch has no CUDA device. On an H100 the whole file takes about a minute,
most of it in the 28672 x 8192 reference matmuls.

Tolerances (relative to max|ref|, the largest reference output of the case):
- The kernels dequantize each weight to the activation dtype (one rounding: 2^-11 relative in fp16,
  2^-8 in bf16), multiply on tensor cores with fp32 accumulation, and round C once to the
  activation dtype. The reference keeps the weights in fp32. Per output the error is a sum of K
  roughly independent roundings (~sqrt(K) * eps * typical |a*w|) plus the final rounding, well under
  1e-2 (fp16) / 4e-2 (bf16) of max|ref| for these sizes; a wrong column, row or group is O(1).
- fp32 activations run a plain fp32 kernel: only the summation order differs from torch.matmul.
"""

import re

import pytest
import torch
from torch._inductor import config as inductor_config

import torch_marlin  # noqa: F401  (registers torch.ops.marlin)
from torch_marlin.formats import (dequant_affine_reference, dequant_fp4_reference, dequant_u4_reference,
                                  quantize_affine, quantize_fp4, quantize_u4)

from backends import assert_chain_matches_synchronized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_ERR = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4}


def make_weights(fmt, K, N, group_size, dtype, device="cuda", seed=0, on_gpu=False):
    # on_gpu: draw and quantize on the GPU (large shapes; the CPU path takes seconds there).
    gen_device = "cuda" if on_gpu else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(seed)
    w = torch.randn(K, N, generator=g, device=gen_device)
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype)
        z = None
    elif fmt == "affine":  # z: the offsets
        B, s, z = quantize_affine(w + 0.5, group_size, scale_dtype=dtype)
        z = z.to(device)
    else:
        B, s, z = quantize_u4(w, group_size, symmetric=False, scale_dtype=dtype)
        z = z.to(device)
    return B.to(device), s.to(device), z


def reference_weight(fmt, B, s, z, group_size):
    if fmt == "fp4":
        return dequant_fp4_reference(B, s, group_size)
    if fmt == "affine":
        return dequant_affine_reference(B, s, z, group_size)
    return dequant_u4_reference(B, s, z, group_size)


def run_op(fmt, A, B, s, z, group_size, bias):
    if fmt == "fp4":
        return torch.ops.marlin.gemm_fp4(A, B, s, group_size, bias)
    if fmt == "affine":
        return torch.ops.marlin.gemm_affine(A, B, s, z, group_size, bias)
    return torch.ops.marlin.gemm_u4(A, B, s, z, group_size, bias)


def check_close(C, ref, dtype):
    assert C.dtype == dtype and C.shape == ref.shape
    if ref.numel() == 0:
        return
    Cf = C.float()
    assert torch.isfinite(Cf).all(), "non-finite output"
    scale = ref.abs().max().clamp_min(1e-6)
    err = ((Cf - ref).abs().max() / scale).item()
    assert err <= MAX_ERR[dtype], f"max error {err:.3e} of max|ref| exceeds {MAX_ERR[dtype]:.0e}"


def case(fmt, M, K, N, group_size, dtype, with_bias, seed=0):
    B, s, z = make_weights(fmt, K, N, group_size, dtype, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    A = torch.randn(M, K, generator=g).to(dtype).cuda()
    bias = torch.randn(N, generator=g).to(dtype).cuda() if with_bias else None
    C = run_op(fmt, A, B, s, z, group_size, bias)
    ref = A.float() @ reference_weight(fmt, B, s, z, group_size)
    if bias is not None:
        ref = ref + bias.float()
    torch.cuda.synchronize()
    check_close(C, ref, dtype)
    return C


def gpu_case(fmt, M, K, N, dtype, with_bias, seed, group_size=128):
    """case() for large shapes: weights drawn and quantized on the GPU, reference in fp32 there."""
    B, s, z = make_weights(fmt, K, N, group_size, dtype, seed=seed, on_gpu=True)
    torch.manual_seed(seed)
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype) if with_bias else None
    C = run_op(fmt, A, B, s, z, group_size, bias)
    W = reference_weight(fmt, B, s, z, group_size)
    ref = A.float() @ W
    del W
    if bias is not None:
        ref = ref + bias.float()
    check_close(C, ref, dtype)


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M", [1, 16, 40, 130])
def test_n_multiple_of_16_not_64(fmt, dtype, M):
    # N = 144: the fast path without padding, but a partial 128-column tile.
    case(fmt, M, 512, 144, 128, dtype, True)


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("group_size", [16, 96])
@pytest.mark.parametrize("M", [1, 9, 20, 100])
def test_other_group_sizes(fmt, dtype, group_size, M):
    # group_size 16 (not a multiple of 32) takes the per-weight-scale decode path, 96 the folded-scale
    # one with 3 chunks per group (the matrix above: 32/64/128); M = 100 runs two 64-row tiles.
    case(fmt, M, 1536, 200, group_size, dtype, True)


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("K,group_size", [(264, 24), (2072, 56)])
@pytest.mark.parametrize("M", [1, 9, 20, 40])
def test_k_not_multiple_of_32(fmt, dtype, K, group_size, M):
    # The decode kernel's last 32-row K chunk is partial (its predicated path); 2072 also splits K.
    if K == 2072:
        assert torch_marlin.plan_gemm(fmt, M, K, 200, group_size, dtype=dtype, device="cuda")["k_parallel"] > 1
    case(fmt, M, K, 200, group_size, dtype, True)


# ---- K-parallel (stripes + deterministic reduction) ----------------------------------------------
def plan_for(M, K, N, dtype):
    return torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=dtype, device="cuda")


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,K,k_parallel", [(M, K, kp) for K, kp in [(4096, 4), (2048, 2)] for M in [1, 5, 16, 48, 100]] +
                         # above 64 rows with K >= 8192 an sm_90a build takes the wgmma kernel
                         [(M, 8192, 8) for M in [1, 5, 16, 48]])
def test_k_parallel(fmt, dtype, M, K, k_parallel):
    # Decode K slices: up to 4 reduce through a thread-block cluster's distributed shared memory on
    # sm_90 (cluster_reduce), through global memory before sm_90 (last_block_reduce); 8 through
    # global memory everywhere.
    # Above 32 rows group size 32 keeps the decode kernel (wgmma_ws needs group_size % 64 == 0).
    N, group_size = 328, 128 if M <= 32 else 32
    plan = torch_marlin.plan_gemm("fp4", M, K, N, group_size, dtype=dtype, device="cuda")
    assert plan["kernel"].startswith("decode_") and plan["k_parallel"] == k_parallel, plan
    case(fmt, M, K, N, group_size, dtype, True)


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N", [8480, 17024])
def test_decode_block_warps(fmt, dtype, M, N):
    # Up to 16 rows the planner gives a decode block 4 or 2 warps when its tiles outnumber the
    # slots of 8-warp blocks (16 warps an SM): 265 / 532 tiles of 32 columns on 132 SMs.
    plan = torch_marlin.plan_gemm(fmt, M, 1024, N, 128, dtype=dtype, device="cuda")
    sm_warps = 16 * torch.cuda.get_device_properties(0).multi_processor_count
    tiles = -(-N // 32)
    warps = 8 if tiles * 8 <= sm_warps else 4 if tiles * 4 <= sm_warps else 2
    assert plan["kernel"].startswith("decode_") and plan["threads"] == (32 * warps, 1, 1), plan
    case(fmt, M, 1024, N, 128, dtype, True)


def launched(fn, name):
    """Names of the kernels fn launches whose name contains `name` (CUDA profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if name in e.name]


@pytest.mark.parametrize("K,k_parallel", [(2048, 2), (4096, 4), (8192, 8)])
def test_cluster_reduction_chosen_on_sm90(K, k_parallel):
    # Up to 4 K slices reduce through a thread-block cluster on sm_90 (the kernel's last template
    # argument, kCluster, is true); more slices, or older GPUs, through global memory. Guards
    # against the cluster path silently switching off (results are the same either way).
    M, N = 4, 328
    plan = plan_for(M, K, N, torch.float16)
    assert plan["k_parallel"] == k_parallel
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    expect_cluster = sm90 and k_parallel <= 4
    assert plan["reduce"] == ("cluster" if expect_cluster else "last_block")
    # Global-memory sums: the fp32 partials, then one int32 arrival counter per output tile.
    assert plan["workspace_bytes"] == (0 if expect_cluster else
                                       k_parallel * M * N * 4 + plan["m_tiles"] * plan["n_tiles"] * 4)
    B, s, _ = make_weights("fp4", K, N, 128, torch.float16)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    names = launched(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), "decode_kernel<")
    assert len(names) == 1, names
    template_args = re.search(r"decode_kernel<(.*?)>\(", names[0]).group(1).split(",")
    cluster = template_args[-1].strip() in ("true", "(bool)1")
    assert cluster == expect_cluster, names[0]


# ---- The wgmma kernel (sm_90a): 64 < M <= 512 with >= 64 column tiles --------------------------------
def on_sm90a_build():
    return torch.cuda.get_device_capability() == (9, 0) and torch_marlin._C.device_caps("cuda")["wgmma"]


def require_wgmma():
    """Skips off compute capability 9.0 devices; on one, fails unless this build has the sm_90a
    kernels (setup.py's default TORCH_CUDA_ARCH_LIST), so the wgmma tests cannot skip silently."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs a compute capability 9.0 device")
    assert torch_marlin._C.device_caps("cuda")["wgmma"], "built without sm_90a (TORCH_CUDA_ARCH_LIST)?"


# The wgmma kernel serves group sizes that are multiples of 32 but not of 64 (wgmma_ws takes the
# others). (M, K, N, group_size, K slices, tile columns): 128-row tiles 256 columns wide, N not a
# multiple of 16 (padded weights) or of the tile; 128-row tiles 128 wide where wide ones would need
# more K slices; 256-row tiles (128 wide), one of them partial; K slices summed through a
# thread-block cluster (2 slices at K = 2048 and 8192 and for 2 row tiles of a 4096-column layer at
# K = 1024; 4 for long-K layers with few tiles, 128- and 256-row); group size 96.
WGMMA_CASES = [(65, 256, 8200, 32, 1, 256), (100, 512, 8192, 32, 1, 256), (200, 384, 8208, 32, 1, 128),
               (300, 256, 8192, 32, 1, 128), (100, 2048, 8192, 32, 2, 128), (70, 8192, 8192, 32, 2, 128),
               (300, 1024, 4096, 32, 2, 128), (160, 8192, 1000, 32, 4, 128), (96, 8192, 2000, 32, 4, 256),
               (130, 768, 8192, 96, 1, 128)]


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,K,N,group_size,k_parallel,tile_n", WGMMA_CASES)
def test_wgmma(fmt, dtype, M, K, N, group_size, k_parallel, tile_n):
    plan = torch_marlin.plan_gemm(fmt, M, K, N, group_size, dtype=dtype, device="cuda")
    if on_sm90a_build():  # elsewhere the same shapes run decode / dequant_blas (still checked)
        assert plan["kernel"].startswith("wgmma_") and not plan["kernel"].startswith("wgmma_ws_"), plan["kernel"]
        assert (plan["k_parallel"], plan["tile_n"]) == (k_parallel, tile_n) and plan["workspace_bytes"] == 0
    case(fmt, M, K, N, group_size, dtype, with_bias=True)


@pytest.mark.parametrize("group_size,kernel", [(128, "wgmma_ws_kernel<"), (32, "wgmma_kernel<")])
def test_wgmma_chosen_on_sm90a(group_size, kernel):
    # Guards against the Hopper kernels silently switching off on an H100/H200 built for sm_90a (the
    # default TORCH_CUDA_ARCH_LIST of setup.py); results would still be right through other kernels.
    require_wgmma()
    M, K, N = 128, 1024, 8192
    B, s, _ = make_weights("fp4", K, N, group_size, torch.float16, on_gpu=True)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    names = launched(lambda: torch.ops.marlin.gemm_fp4(A, B, s, group_size), kernel)
    assert len(names) == 1, names


@pytest.mark.parametrize("M,K", [(100, 2048), (300, 1024)])  # 2 K slices (cluster) / 2 row tiles
def test_wgmma_deterministic(M, K):
    N = 8192
    B, s, z = make_weights("u4", K, N, 32, torch.bfloat16, on_gpu=True)
    A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    first = run_op("u4", A, B, s, z, 32, bias)
    for _ in range(5):
        assert torch.equal(run_op("u4", A, B, s, z, 32, bias), first)


# ---- The warp-specialized wgmma kernel (sm_90a): M > 32 (> 16 on some shapes), group_size % 64 == 0 -
def on_132_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count == 132


# (M, K, N, group_size, K slices, tile rows, tile columns), plans of a 132-SM H100/H200: 64-row tiles
# (wgmma n = 64) with N not a multiple of 16 (padded weights) or of the tile, 4 K slices summed
# through global memory (4096 x 4096; N = 200 / 201: 2 column tiles, the last partial, odd N),
# 3 consumer warpgroups (192 columns, N = 21504 and 12288 with 2 slices through a cluster; N = 7000
# with 3 through global memory); 128-row tiles with 3 consumers, and with 4 global slices (N = 1000);
# 256-row tiles, partial and several (M = 300, 1024), with 3 slices through a cluster; group sizes
# 64..256; M = 40 / 129 just past the tile-size boundaries; M = 24, where wgmma_ws takes 17..32
# rows (K <= 8192, <= 2 K slices; 40 rows of the tile past M). 3 or 4 slices of 64- and 128-row
# tiles are summed through global memory, 2 (and 3 of 256-row tiles) through a cluster.
WS_CASES = [(33, 256, 8200, 64, 1, 64, 128), (64, 4096, 4096, 128, 4, 64, 128), (64, 2048, 21504, 64, 1, 64, 192),
            (40, 8192, 200, 128, 4, 64, 128), (40, 8192, 201, 128, 4, 64, 128), (50, 6144, 7000, 128, 3, 64, 192),
            (100, 8192, 1000, 128, 4, 128, 128), (100, 1024, 12288, 128, 2, 128, 192),
            (128, 1024, 8192, 128, 2, 128, 128), (129, 8192, 1000, 128, 3, 256, 128),
            (200, 8192, 2000, 256, 3, 256, 128), (300, 512, 1000, 128, 1, 256, 128),
            (1024, 1024, 4096, 128, 1, 256, 128), (24, 2048, 12290, 128, 2, 64, 192)]


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,K,N,group_size,k_parallel,tile_m,tile_n", WS_CASES)
def test_wgmma_ws(fmt, dtype, M, K, N, group_size, k_parallel, tile_m, tile_n):
    plan = torch_marlin.plan_gemm(fmt, M, K, N, group_size, dtype=dtype, device="cuda")
    if on_sm90a_build():  # elsewhere the same shapes run other kernels (still checked)
        assert plan["kernel"].startswith("wgmma_ws_"), plan
        assert plan["threads"][0] == 128 * (plan["tile_n"] // 64 + 1)
        # Global K slices keep whole fp32 tiles and a counter per tile in a workspace; a cluster needs none.
        tiles = plan["m_tiles"] * plan["n_tiles"]
        partials = tiles * plan["k_parallel"] * plan["tile_m"] * plan["tile_n"] * 4
        assert plan["workspace_bytes"] == (partials + tiles * 4 if plan["reduce"] == "last_block" else 0), plan
        if on_132_sms():
            assert (plan["k_parallel"], plan["tile_m"], plan["tile_n"]) == (k_parallel, tile_m, tile_n), plan
            expect = "last_block" if k_parallel > 2 and tile_m <= 128 else \
                "cluster" if k_parallel > 1 else "none"
            assert plan["reduce"] == expect, plan
    gpu_case(fmt, M, K, N, dtype, with_bias=True, seed=M, group_size=group_size)


# A partial last wave of tiles split off into a second launch with K slices (the plan's tail launch):
# M, K, N, group_size, tail column tiles, tail K slices. 256-row tiles; the first has rows past M
# in two row tiles and a partial last column tile (72 of 128 columns) inside the tail.
WS_TAIL_CASES = [(300, 2048, 8520, 128, 1, 3), (200, 1024, 17920, 64, 8, 2), (1024, 4096, 21504, 128, 3, 3)]


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,K,N,group_size,tail_n_tiles,tail_k_parallel", WS_TAIL_CASES)
def test_wgmma_ws_tail(fmt, dtype, M, K, N, group_size, tail_n_tiles, tail_k_parallel):
    plan = torch_marlin.plan_gemm(fmt, M, K, N, group_size, dtype=dtype, device="cuda")
    if on_sm90a_build() and on_132_sms():
        assert plan["kernel"].startswith("wgmma_ws_") and plan["k_parallel"] == 1, plan
        assert (plan["tail_n_tiles"], plan["tail_k_parallel"]) == (tail_n_tiles, tail_k_parallel), plan
        assert plan["grid"][1] + plan["tail_n_tiles"] == plan["n_tiles"]
    gpu_case(fmt, M, K, N, dtype, with_bias=True, seed=M, group_size=group_size)


@pytest.mark.parametrize("M,K,N", [(64, 4096, 4096), (50, 6144, 7000), (100, 1024, 12288), (129, 8192, 1000),
                                   (300, 2048, 8520)])
def test_wgmma_ws_deterministic(M, K, N):
    # 4 / 3 K slices summed through global memory by whichever block of a tile comes last, 2 / 3
    # through a cluster, in slice order, and a tail launch of 3 slices: repeated runs bitwise equal.
    B, s, z = make_weights("u4", K, N, 128, torch.float16, on_gpu=True)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    first = run_op("u4", A, B, s, z, 128, bias)
    for _ in range(5):
        assert torch.equal(run_op("u4", A, B, s, z, 128, bias), first)


# Zero points are 0..15 (docs/formats.md); the kernels mask the byte with 15, as the CPU kernels
# do, so the upper bits never reach the exact (magic + zero) byte permute (magic_zeros). Each
# kernel family's U4 path, fp16 and bf16: decode folded (M = 1) and per-weight (M = 24, 4 n8 tiles),
# wgmma_ws with 4 global slices (M = 64) and a 256-row tile (M = 300), the wgmma kernel
# (group 32, M = 100, K = 8192; decode / dequant_blas elsewhere), and dequant_u4.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,K,group_size", [(1, 2048, 128), (24, 2048, 128), (64, 2048, 128), (300, 2048, 128),
                                           (100, 8192, 32)])
def test_u4_zero_points_masked(dtype, M, K, group_size):
    N = 1024
    B, s, z = make_weights("u4", K, N, group_size, dtype)
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    high = z | 0xF0  # 240..255
    assert torch.equal(torch.ops.marlin.gemm_u4(A, B, s, high, group_size),
                       torch.ops.marlin.gemm_u4(A, B, s, z, group_size))
    if M == 1:
        assert torch.equal(torch.ops.marlin.dequant_u4(B, s, high, group_size),
                           torch.ops.marlin.dequant_u4(B, s, z, group_size))


# ---- Large M: dequantized panels + cuBLAS ----------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_dequant_blas_two_panels(fmt, dtype):
    # 65536 x 8208 x 2 B is over the 1 GiB panel cap: two panels (4224 + 3976 columns), and
    # N = 8200 is not a multiple of 16 (padded weights). Above the wgmma band (M <= 512), with a
    # group size wgmma_ws does not take (% 64 != 0).
    M, K, N, group_size = 600, 65536, 8200, 32
    plan = torch_marlin.plan_gemm(fmt, M, K, N, group_size, dtype=dtype, device="cuda")
    assert plan["family"] == "dequant_blas" and plan["n_tiles"] == 2 and N % plan["tile_n"] != 0
    gpu_case(fmt, M, K, N, dtype, with_bias=True, seed=0, group_size=group_size)


@pytest.mark.parametrize("M", [4, 64, 128, 300])
# M = 4: decode with 4-8 K slices (global memory) or 2 (cluster on sm_90); above 32 rows on sm_90a
# wgmma_ws with 4 slices through global memory (M = 64, 128) or 3 through a cluster (M = 300)
# (elsewhere decode / dequant_blas).
@pytest.mark.parametrize("K", [8192, 2048])
def test_deterministic(M, K):
    N = 1024
    plan = plan_for(M, K, N, torch.float16)
    assert plan["k_parallel"] > 1 or plan["family"] == "dequant_blas"
    B, s, z = make_weights("u4", K, N, 128, torch.float16)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    first = run_op("u4", A, B, s, z, 128, bias)
    for _ in range(5):
        assert torch.equal(run_op("u4", A, B, s, z, 128, bias), first)


# ---- Large shapes (a Llama-70B down projection), reference on the GPU in fp32 ---------------------
@pytest.mark.parametrize("fmt,dtype", [("fp4", torch.float16), ("u4", torch.bfloat16)])
@pytest.mark.parametrize("M", [1, 16, 4096])
def test_large(fmt, dtype, M):
    gpu_case(fmt, M, 28672, 8192, dtype, with_bias=False, seed=M)


# ---- Streams, devices, alignment -------------------------------------------------------------------
@pytest.mark.parametrize("M", [8, 256])
def test_runs_on_current_stream(M):
    B, s, _ = make_weights("fp4", 1024, 256, 128, torch.float16)
    A = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
    ref = A.float() @ dequant_fp4_reference(B, s, 128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        C = torch.ops.marlin.gemm_fp4(A, B, s, 128)
    stream.synchronize()
    check_close(C, ref, torch.float16)


@pytest.mark.parametrize("M", [5, 100])
def test_misaligned_activation_view(M):
    K, N = 256, 128
    B, s, _ = make_weights("fp4", K, N, 64, torch.float16)
    buf = torch.randn(M * K + 3, device="cuda", dtype=torch.float16)
    A = buf[3:].view(M, K)  # data pointer 6 bytes past a 16-byte boundary
    C = torch.ops.marlin.gemm_fp4(A, B, s, 64)
    check_close(C, A.float() @ dequant_fp4_reference(B, s, 64), torch.float16)


FIRST_CALL_CAPTURED = """
import sys, torch, torch_marlin
from torch_marlin.formats import dequant_fp4_reference, quantize_fp4
M, K, N, gs, kernel = 100, 1024, 8192, int(sys.argv[1]), sys.argv[2]
assert torch_marlin.plan_gemm("fp4", M, K, N, gs, dtype=torch.float16, device="cuda")["kernel"] == kernel
B, s = quantize_fp4(torch.randn(K, N), gs, scale_dtype=torch.float16)
B, s = B.cuda(), s.cuda()
A = torch.randn(M, K, device="cuda", dtype=torch.float16)
side, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.graph(g, stream=side):  # the process's first marlin call
    C = torch.ops.marlin.gemm_fp4(A, B, s, gs)
g.replay()
torch.cuda.synchronize()
ref = A.float() @ dequant_fp4_reference(B, s, gs)
err = ((C.float() - ref).abs().max() / ref.abs().max()).item()
assert err < 1e-2, err
print("first call captured: ok", err)
"""


@pytest.mark.parametrize("group_size,kernel", [(128, "wgmma_ws_fp4_half"), (32, "wgmma_fp4_half")])
def test_wgmma_first_call_inside_graph_capture(group_size, kernel):
    # A fresh process whose first marlin call is captured: the Hopper launchers' one-time host work
    # (the shared-memory opt-in, wgmma_ws's register-count check, the driver entry point for the
    # TMA descriptors) must be legal inside stream capture, and the replay must compute the product.
    import subprocess
    import sys

    require_wgmma()
    r = subprocess.run([sys.executable, "-c", FIRST_CALL_CAPTURED, str(group_size), kernel], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "first call captured: ok" in r.stdout, r.stdout + r.stderr


COUNTERS_MADE_UNDER_CAPTURE = """
import torch, torch_marlin
from torch_marlin.formats import dequant_fp4_reference, quantize_fp4
M, K, N, gs = 4, 8192, 1024, 128  # decode, 8 K slices summed through global memory (tile counters)
assert torch_marlin.plan_gemm("fp4", M, K, N, gs, dtype=torch.float16, device="cuda")["reduce"] == \\
    "last_block"
B, s = quantize_fp4(torch.randn(K, N), gs, scale_dtype=torch.float16)
B, s = B.cuda(), s.cuda()
A = torch.randn(M, K, device="cuda", dtype=torch.float16)
ref = A.float() @ dequant_fp4_reference(B, s, gs)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
g0 = torch.cuda.CUDAGraph()  # dirties a private pool: a replay fills 1 MB with ones, then it is freed
with torch.cuda.graph(g0, stream=side):
    dirt = torch.full((1 << 18,), 0x01010101, dtype=torch.int32, device="cuda")
g0.replay()
torch.cuda.synchronize()
del dirt
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, stream=side, pool=g0.pool()):  # the first marlin call: counters from that pool
    C = torch.ops.marlin.gemm_fp4(A, B, s, gs)
with torch.cuda.stream(side):  # eager, on the capturing stream, before any replay
    E = torch.ops.marlin.gemm_fp4(A, B, s, gs)
torch.cuda.synchronize()
err = lambda X: ((X.float() - ref).abs().max() / ref.abs().max()).item()
assert err(E) < 1e-2, ("eager call before the first replay", err(E))
g1.replay()
torch.cuda.synchronize()
assert err(C) < 1e-2, ("replay", err(C))
print("counters made under capture: ok")
"""


def test_k_slice_counters_made_under_capture():
    # The arrival counters of the global K-slice sum, in a call's workspace captured from a pool
    # whose memory is not zero, must be zeroed for the replay; an eager call on the capturing
    # stream before any replay gets its own zeroed counters (launch.cu zeroed_tile_counters).
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", COUNTERS_MADE_UNDER_CAPTURE], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "counters made under capture: ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M", [1, 16, 64, 200])
@pytest.mark.parametrize("dims", [[4096, 1024] * 3 + [4096], [2048] * 9], ids=["4096_1024", "2048"])
def test_chain_dependent_launch(fmt, dtype, M, dims):
    # Back-to-back calls, each reading the previous one's output: decode at M = 1 and 16
    # (4096 -> 1024 in 4 K slices summed by the last block, 1024 -> 4096 in one, 2048 -> 2048 in 2
    # through a cluster), wgmma_ws at 64 and 200 on sm_90a (decode / dequant + cuBLAS elsewhere).
    # On sm_90 decode and wgmma_ws are launched with programmatic dependent launch: a kernel starts
    # while the previous one runs and waits for it before its first load. With ld.global.nc loads
    # the graph replay of such a decode chain read stale activations (benchmarks/notes/cuda-tuning.md CUDA-PDL).
    # Eagerly and from a CUDA graph the chain must equal the same calls with the device
    # synchronized between them, bitwise.
    layers = []
    for i, (K, N) in enumerate(zip(dims[:-1], dims[1:])):
        B, s, z = make_weights(fmt, K, N, 128, dtype, seed=i)
        if fmt == "affine":  # back to zero-mean weights (make_weights shifts them by 0.5), scaled like s
            z = ((z.float() - 0.5) / K**0.5).to(dtype)
        layers.append((B, (s.float() / K**0.5).to(dtype), z))  # outputs stay O(1) along the chain
        assert M > 16 or plan_for(M, K, N, dtype)["kernel"].startswith("decode_")
    x = torch.randn(M, dims[0], device="cuda", dtype=dtype)

    def chain(sync):
        y = x
        for B, s, z in layers:
            y = run_op(fmt, y, B, s, z, 128, None)
            if sync:
                torch.cuda.synchronize()
        return y

    assert_chain_matches_synchronized(chain)


@pytest.mark.skipif(not hasattr(inductor_config.triton, "enable_pdl"), reason="inductor without dependent launch")
@pytest.mark.parametrize("M,K,N", [(1, 14336, 1024), (1, 2048, 2048), (64, 2048, 2048), (256, 4096, 4096)])
def test_inductor_dependent_launch_around_ours(M, K, N):
    # Compiled with inductor's dependent launch (as StaticDecoder compiles its step), the kernel after
    # ours may read, before its wait, what the kernel before ours writes and ours does not: here a
    # long elementwise kernel writes r (a residual) and its fp16 copy (our activations), and the
    # kernel after ours adds r to our output. Ours lets that kernel launch only once the kernel
    # before it has finished (common.cuh, PDL protocol), so every call's sum must hold that call's
    # r; a stale r (the previous call's, from other inputs) is off by O(1). out - r is our output
    # up to one fp32 rounding of |r| + |y| (2^-24 relative; 1e-5 of the largest). Plans on a
    # 132-SM sm_90a GPU: decode with 8 K slices summed by the last block, decode with 2 through a
    # cluster, wgmma_ws with 4 summed by the last block, wgmma_ws with 3 through a cluster.
    B, s, _ = make_weights("fp4", K, N, 128, torch.float16)

    def step(a):
        r = a
        for _ in range(200):  # long after its loads, where inductor's kernels trigger their dependents
            r = torch.sin(r * 1.3 + a)
        return torch.ops.marlin.gemm_fp4(r.half(), B, s, 128).float() + r[:, :N], r

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, options={"triton.enable_pdl": True})
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(50):
        out, r = compiled(torch.randn(M, K, device="cuda", generator=g))
        y = torch.ops.marlin.gemm_fp4(r.half(), B, s, 128).float()
        err = (out - r[:, :N] - y).abs().max().item()
        assert err <= 1e-5 * (r.abs().max().item() + y.abs().max().item()), (i, err)


@pytest.mark.parametrize("M,N", [(4, 384), (200, 384), (100, 8192)])
def test_cuda_graph_replay(M, N):
    # Captured once, replayed on new activations: the op allocates its workspace and launches on
    # the capturing stream (decode kernel / dequant kernel + cuBLAS / wgmma kernel with its TMA
    # descriptor and 2 K slices through a cluster on sm_90a), nothing on the host per replay.
    K = 2048
    B, s, _ = make_weights("fp4", K, N, 128, torch.float16)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (per-stream K-slice counters)
        torch.ops.marlin.gemm_fp4(A, B, s, 128)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        C = torch.ops.marlin.gemm_fp4(A, B, s, 128)
    W = dequant_fp4_reference(B, s, 128)
    for _ in range(2):
        A.copy_(torch.randn(M, K, device="cuda", dtype=torch.float16))
        g.replay()
        torch.cuda.synchronize()
        check_close(C, A.float() @ W, torch.float16)


def test_weights_on_other_device_rejected():
    B, s, _ = make_weights("fp4", 256, 64, 64, torch.float16, device="cpu")
    A = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="B_packed"):
        torch.ops.marlin.gemm_fp4(A, B, s.cuda(), 64)
