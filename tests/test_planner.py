"""The planner's policy and plans (torch_marlin.plan_gemm / plan_trellis), for every backend.

Plans for CUDA and Metal pass the capabilities they assume (``caps=``), so these tests hold on any
machine, with or without the GPU they describe.
"""

import pytest
import torch

import torch_marlin
from torch_marlin import _C

# A 132-SM H100 with an sm_90a build: wgmma kernels and thread-block clusters.
H100 = dict(compute_units=132, wgmma=True, thread_block_clusters=True)
# A 132-SM device planned with the portable kernels only (no sm_90a build, no clusters).
SM132_PORTABLE = dict(compute_units=132, wgmma=False, thread_block_clusters=False)
# An M1-class GPU (what default_metal_caps describes).
M1 = dict(compute_units=8, max_shared_memory=32768)

PLAN_KEYS = {
    "family", "kernel", "format", "dtype", "reduce", "reduce_kernel", "grid", "threads", "reduce_grid",
    "reduce_threads", "workspace_bytes", "counters_offset", "tile_m", "tile_n", "tile_k", "m_tiles", "n_tiles", "k_parallel",
    "k_slice_len", "num_groups", "consumers", "vector_loads", "scale_group_sums", "padded_n", "tail_n_tiles",
    "tail_k_parallel", "tail_k_slice_len", "launches",
    "dependent_launch", "backend", "compute_units", "max_shared_memory", "wgmma", "thread_block_clusters", "avx2",
    "avx512",
}


# ---- policy (decode crossovers, families by shape) -------------------------------------------------

# Decode up to the backend's measured crossover: the CPU decode kernel is compute bound and loses
# to dequant + BLAS from 9 rows; Metal keeps the design's 16.
@pytest.mark.parametrize("device, caps, decode_max", [("cpu", dict(compute_units=4), 8), ("metal", M1, 16)])
def test_policy_selects_decode_for_small_m(device, caps, decode_max):
    for M in range(1, decode_max + 1):
        assert torch_marlin.plan_gemm("fp4", M, 4096, 4096, device=device, caps=caps)["family"] == "decode"
    assert torch_marlin.plan_gemm("u4", decode_max + 1, 4096, 4096, device=device, caps=caps)["family"] != "decode"
    # The decode kernels still run up to 16 rows when asked for (tests force them).
    forced = torch_marlin.plan_gemm("fp4", 16, 4096, 4096, device=device, caps=caps, family="decode")
    assert forced["family"] == "decode"


def test_policy_cpu_kernels():
    dec = torch_marlin.plan_gemm("fp4", 3, 4096, 4096, caps=dict(compute_units=4))
    assert (dec["family"], dec["kernel"], dec["tile_m"], dec["tile_n"]) == ("decode", "cpu_decode", 16, 256)
    assert torch_marlin.plan_gemm("fp4", 3, 4096, 4096, caps=dict(compute_units=16))["tile_n"] == 64
    big = torch_marlin.plan_gemm("u4", 40, 4096, 300, caps=dict(compute_units=4))
    assert (big["family"], big["kernel"], big["tile_m"], big["tile_n"]) == ("dequant_blas", "cpu_dequant_blas", 40, 128)
    assert big["grid"] == (3, 1, 1) and big["k_parallel"] == 1 and big["reduce"] == "none"
    forced = torch_marlin.plan_gemm("fp4", 3, 256, 64, family="dequant_blas", caps=dict(compute_units=4))
    assert forced["kernel"] == "cpu_dequant_blas"


def test_policy_metal_kernels_by_shape():
    big = torch_marlin.plan_gemm("fp4", 512, 4096, 4096, device="metal", caps=M1)
    assert big["kernel"] == "marlin_gemm_fused_fp4_half" and big["family"] == "fused_tiles"
    assert big["k_parallel"] == 1 and big["reduce"] == "none" and big["reduce_kernel"] == ""
    # 1 x 2 output tiles on an 8-core GPU with K = 8192: stripes with K-parallel slices.
    small = torch_marlin.plan_gemm("u4", 64, 8192, 128, dtype=torch.bfloat16, device="metal", caps=M1)
    assert small["family"] == "striped" and small["k_parallel"] > 1
    assert small["kernel"] == "marlin_gemm_striped_u4_bfloat"
    assert small["workspace_bytes"] == small["k_parallel"] * 64 * 128 * 4
    assert small["reduce"] == "second_dispatch" and small["reduce_kernel"] == "marlin_reduce_partials_bfloat"
    assert small["reduce_grid"] == ((64 * 128 + 255) // 256, 1, 1) and small["reduce_threads"] == (256, 1, 1)
    # The same shape on a 64-core GPU: more slices; on a 1-core GPU the output fills it already.
    assert torch_marlin.plan_gemm("u4", 64, 8192, 128, device="metal", caps=dict(compute_units=64))["k_parallel"] \
        > small["k_parallel"]
    assert torch_marlin.plan_gemm("u4", 64, 8192, 128, device="metal", caps=dict(compute_units=1))["family"] \
        == "fused_tiles"
    dec = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="metal", caps=M1)
    assert dec["kernel"] == "marlin_gemv_m1_fp4_half"
    staged = torch_marlin.plan_gemm("fp4", 100, 4096, 4096, device="metal", caps=M1, family="staged_tiles")
    assert staged["kernel"] == "marlin_gemm_fp4_half" and staged["grid"] == (64, 2, 1)
    with pytest.raises(ValueError, match="below 2\\^32"):
        torch_marlin.plan_gemm("fp4", 1 << 20, 8192, 64, device="metal", caps=M1)


# The striped family only where it shortens the critical path (K rows one core walks, one tile
# threadgroup per core) by a quarter: the fused kernel walks ceil(tiles / cores) tiles of K rows,
# the striped one ceil(tiles * slices / cores) slices of K / slices rows.
M2_MAX = dict(compute_units=38, max_shared_memory=32768)


@pytest.mark.parametrize("M", [17, 33, 48, 64])
def test_policy_metal_no_stripes_when_tiles_fill_a_large_gpu(M):
    # 64 tiles on 38 cores: fused walks 2 K (two tiles per core); 2 slices of 128 items walk
    # ceil(128 / 38) = 4 halves = 2 K too, plus a reduction. The old rule (tiles < 2 x cores) striped.
    plan = torch_marlin.plan_gemm("fp4", M, 4096, 4096, device="metal", caps=M2_MAX)
    assert plan["family"] == "fused_tiles" and plan["k_parallel"] == 1 and plan["reduce"] == "none"


@pytest.mark.parametrize("family", ["fused_tiles", "striped"])
def test_policy_metal_32_row_tile_up_to_32_rows(family):
    # M = 17..32 on the 32-row tile (at most 2x the rows it keeps, not 3.8x); from 33 the 64-row tile
    # (two 32-row tiles would dequantize each B word twice). The staged family keeps 64.
    for M, tile_m, stem in ((17, 32, "_m32"), (32, 32, "_m32"), (33, 64, ""), (64, 64, "")):
        plan = torch_marlin.plan_gemm("u4", M, 4096, 512, device="metal", caps=M2_MAX, family=family)
        assert (plan["tile_m"], plan["m_tiles"]) == (tile_m, -(-M // tile_m))
        assert plan["kernel"] == f"marlin_gemm_{'fused' if family == 'fused_tiles' else 'striped'}{stem}_u4_half"
    staged = torch_marlin.plan_gemm("u4", 17, 4096, 512, device="metal", caps=M2_MAX, family="staged_tiles")
    assert (staged["tile_m"], staged["kernel"]) == (64, "marlin_gemm_u4_half")


def test_policy_metal_stripes_where_they_shorten_the_critical_path():
    # 8 tiles on 38 cores: fused walks K; 10 slices of 80 items walk ceil(80 / 38) = 3 tenths of K.
    few = torch_marlin.plan_gemm("fp4", 64, 4096, 512, device="metal", caps=M2_MAX)
    assert few["family"] == "striped" and few["k_parallel"] == 10
    # 64 tiles on 64 cores: fused walks K once; stripes would walk ceil(128 / 64) halves = K.
    assert torch_marlin.plan_gemm("fp4", 64, 4096, 4096, device="metal",
                                  caps=dict(compute_units=64))["family"] == "fused_tiles"
    # Short K never splits (slices of >= 128 rows, at least 4 of them).
    assert torch_marlin.plan_gemm("fp4", 64, 256, 128, device="metal", caps=M2_MAX)["family"] == "fused_tiles"


# A Metal MoE gives threadgroups only to expert slots that can have rows: min(E, T * top_k) for the
# decode stages (the slot's expert is found on the GPU from expert_offsets), min(E, T * top_k / 17)
# for the tiled stages (experts with more than 16 rows), not one per expert.
def test_plan_trellis_moe_metal_dispatches_only_active_experts():
    decode = torch_marlin.plan_trellis_moe(1, 2048, 1024, 128, 8, 3, 128, device="metal", caps=M1)
    assert decode["grid"] == (32, 8, 1) and decode["down"]["grid"] == (64, 8, 1)
    assert "tiled_gate" not in decode
    prefill = torch_marlin.plan_trellis_moe(64, 2048, 1024, 128, 8, 3, 128, device="metal", caps=M1)
    assert prefill["grid"] == (32, 128, 1)  # 512 routed rows can reach every expert
    assert prefill["tiled_gate"]["grid"] == (16, 8, 30) and prefill["tiled_down"]["grid"] == (32, 8, 30)
    few = torch_marlin.plan_trellis_moe(3, 2048, 1024, 128, 8, 3, 128, device="metal", caps=M1)
    assert few["grid"][1] == 24 and few["tiled_gate"]["grid"][2] == 1


# K rows per iteration of the Metal prefill kernels (TM_METAL_PIPELINED_TILE_K /
# TM_METAL_STAGED_TILE_K): two pipelined stages of fp32 A and B must fit in 28 KiB, so the fused
# and striped kernels step 16 rows in fp32 and 32 in fp16 / bf16; the one-stage staged kernel
# steps 32 in every dtype. K slices are whole steps.
@pytest.mark.parametrize("family, dtype, tile_k", [
    ("fused_tiles", torch.float16, 32), ("fused_tiles", torch.bfloat16, 32), ("fused_tiles", torch.float32, 16),
    ("striped", torch.float16, 32), ("striped", torch.float32, 16),
    ("staged_tiles", torch.float16, 32), ("staged_tiles", torch.float32, 32)])
def test_metal_prefill_k_step(family, dtype, tile_k):
    p = torch_marlin.plan_gemm("fp4", 64, 8192, 128, dtype=dtype, device="metal", caps=M1, family=family)
    assert p["tile_k"] == tile_k
    assert p["k_slice_len"] % tile_k == 0
    if family == "striped":
        assert p["k_parallel"] > 1 and p["k_slice_len"] >= 128  # at least 128 K rows per slice
    assert torch_marlin.plan_gemm("fp4", 64, 8192, 128, dtype=dtype, device="cpu")["tile_k"] == 0


def test_policy_cuda_kernels_by_m():
    # Decode up to 128 rows, dequantized panels + cuBLAS above, the plain fp32 kernel for fp32
    # activations (no sm_90a build).
    def plan(M, K=28672, N=8192, dtype=torch.float16, family="auto"):
        return torch_marlin.plan_gemm("fp4", M, K, N, dtype=dtype, device="cuda", caps=SM132_PORTABLE, family=family)
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
    simt = plan(200, dtype=torch.float32)
    assert simt["kernel"] == "simt_fp4_float" and simt["family"] == "simt"
    assert (simt["tile_m"], simt["tile_n"], simt["grid"], simt["threads"]) == (8, 128, (64, 25, 1), (128, 1, 1))
    with pytest.raises(ValueError, match="wgmma kernel needs an sm_90a build"):
        plan(200, family="wgmma")  # no wgmma without an sm_90a build on an H100-class device
    with pytest.raises(ValueError, match="dequant_blas family does not run on metal"):
        torch_marlin.plan_gemm("fp4", 200, 256, 64, device="metal", caps=M1, family="dequant_blas")
    with pytest.raises(ValueError, match="dequant_blas family does not run on cuda with float activations"):
        plan(200, dtype=torch.float32, family="dequant_blas")


def test_policy_cuda_wgmma():
    # An sm_90a build on a 132-SM H100 (wgmma=True), for group sizes that wgmma_ws does not take
    # (% 64 != 0): the wgmma kernel above 64 rows and up to 512 when the output has >= 64 tiles of
    # 128 x 128/256 (or K >= 8192), 256-row tiles above 256 rows only in one wave or with a last
    # wave >= 80 % full; otherwise decode (<= 128 rows) and dequant + cuBLAS.
    def plan(M, K=4096, N=12288, group_size=32, wgmma=True, **kw):
        caps = dict(compute_units=132, wgmma=wgmma, thread_block_clusters=False)
        return torch_marlin.plan_gemm("fp4", M, K, N, group_size, device="cuda", caps=caps, **kw)
    assert plan(64)["kernel"] == "decode_fp4_half"
    w = plan(65, dtype=torch.bfloat16)
    assert w["kernel"] == "wgmma_fp4_bfloat" and w["family"] == "wgmma"
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
        plan(128, K=4104, group_size=8, family="wgmma")
    # K slices (at most 4, each >= 512 rows) when the tiles leave SMs idle; always summed through a
    # thread-block cluster (no workspace).
    kp = plan(100, K=2048, N=8192)
    assert kp["kernel"] == "wgmma_fp4_half" and kp["k_parallel"] == 2 and kp["grid"] == (1, 64, 2)
    assert kp["reduce"] == "cluster" and kp["reduce_kernel"] == "" and kp["workspace_bytes"] == 0
    forced = plan(8, K=8192, N=256, family="wgmma")  # 2 tiles: the slice cap, not the SM count
    assert forced["k_parallel"] == 4 and forced["k_slice_len"] == 2048


def test_policy_cuda_decode_block_warps_and_slices():
    # The decode kernel has fewer warps a block up to 16 rows when the tiles outnumber the 264 slots of 8-warp blocks (132 SMs x 16
    # warps): the fewest blocks that fit one wave, 2-warp blocks beyond it. K slices fill the slots
    # of that block size; up to 4 sum through a cluster, more through global memory (and every
    # count through global memory without clusters).
    def plan(M, K, N, caps=H100, fmt="affine"):
        return torch_marlin.plan_gemm(fmt, M, K, N, 128, dtype=torch.float16, device="cuda", caps=caps)

    def geometry(p):
        assert p["kernel"].startswith("decode_affine"), p
        return p["threads"][0] // 32, p["grid"], p["reduce"]
    assert geometry(plan(1, 4096, 4096)) == (8, (1, 128, 2), "cluster")
    assert geometry(plan(1, 4096, 6144)) == (8, (1, 192, 1), "none")
    assert geometry(plan(1, 4096, 8448)) == (8, (1, 264, 1), "none")  # 264 tiles: one wave of 8 warps
    assert geometry(plan(1, 4096, 8480)) == (4, (1, 265, 1), "none")
    assert geometry(plan(1, 4096, 14336)) == (4, (1, 448, 1), "none")
    assert geometry(plan(16, 4096, 28672)) == (2, (1, 896, 1), "none")
    assert geometry(plan(1, 4096, 128256)) == (2, (1, 4008, 1), "none")  # past one wave of 2-warp blocks
    no_wgmma = dict(H100, wgmma=False)  # else wgmma_ws takes 17..32 rows here
    assert geometry(plan(17, 4096, 28672, caps=no_wgmma))[0] == 8  # 32-row tiles keep 8 warps
    assert geometry(plan(1, 4096, 1024)) == (8, (1, 32, 4), "cluster")
    assert geometry(plan(1, 4096, 1024, caps=SM132_PORTABLE)) == (8, (1, 32, 4), "last_block")
    assert geometry(plan(1, 8192, 1024)) == (8, (1, 32, 8), "last_block")
    two_warps = plan(1, 14336, 57344)  # 1792 tiles: 2-warp blocks, whose slices are still whole chunks
    assert geometry(two_warps) == (2, (1, 1792, 1), "none") and two_warps["k_slice_len"] == 14336
    # FP4 / U4 (scaled group sums) follow the same rule.
    assert plan(1, 4096, 28672, fmt="fp4")["threads"] == (64, 1, 1)
    assert plan(16, 4096, 14336, fmt="u4")["threads"] == (128, 1, 1)


def test_policy_cuda_wgmma_ws():
    # An sm_90a build on a 132-SM H100: the warp-specialized kernel from 33 rows on (any N, any M)
    # when K % 64 == 0 and group_size % 64 == 0 (from 17 rows where K <= 8192 and its blocks fill
    # half the SMs with at most 2 K slices); 64 / 128 / 256 activation rows a tile, 2 consumer
    # warpgroups (128 columns) or 3 (192) where that grid runs in fewer stage-waves, K slices when
    # the tiles leave SMs idle: 2 summed through a cluster, 3..4 through global memory (256-row
    # tiles: <= 3, all through clusters).
    def plan(M, K=4096, N=12288, group_size=128, wgmma=True, **kw):
        caps = dict(compute_units=132, wgmma=wgmma, thread_block_clusters=True)
        return torch_marlin.plan_gemm("fp4", M, K, N, group_size, device="cuda", caps=caps, **kw)
    assert plan(16)["kernel"] == "decode_fp4_half"
    for M in (17, 32):  # 4096 x 12288: 64 tiles x 2 slices; the others keep decode up to 32 rows
        assert plan(M)["kernel"] == "wgmma_ws_fp4_half" and plan(M)["k_parallel"] == 2
        assert plan(M, N=21504)["kernel"] == "wgmma_ws_fp4_half"
        assert plan(M, N=4096)["kernel"] == "decode_fp4_half"  # 3 slices
        assert plan(M, K=10752, N=4096)["kernel"] == "decode_fp4_half"
        assert plan(M, K=28672, N=8192)["kernel"] == "decode_fp4_half"  # K > 8192
        assert plan(M, K=512, N=96)["kernel"] == "decode_fp4_half"  # 1 tile: 1 slice, 1 SM
    w = plan(33, dtype=torch.bfloat16)
    assert w["kernel"] == "wgmma_ws_fp4_bfloat" and w["family"] == "wgmma_ws"
    assert (w["tile_m"], w["tile_n"], w["threads"], w["grid"]) == (64, 192, (512, 1, 1), (1, 64, 2))
    assert w["consumers"] == 3
    assert w["reduce"] == "cluster" and w["workspace_bytes"] == 0 and w["k_slice_len"] == 2048
    assert plan(128)["tile_m"] == 128 and (plan(129)["tile_m"], plan(129)["tile_n"]) == (256, 128)
    assert plan(129)["consumers"] == 2
    assert plan(4096)["kernel"] == "wgmma_ws_fp4_half" and plan(4096)["grid"] == (16, 96, 1)
    # 32 tiles: 4 slices in 128 SMs, summed by each tile's last block through an fp32 workspace of
    # whole tiles (32 x 4 x 64 x 128 floats); 10752 x 4096 alike; 128-row tiles too.
    for M, K in [(64, 4096), (64, 10752), (128, 4096)]:
        gw = plan(M, K=K, N=4096)
        assert (gw["grid"], gw["reduce"]) == ((1, 32, 4), "last_block"), gw
        # + one int32 arrival counter per tile (32 tiles) after the partials
        assert gw["workspace_bytes"] == 32 * 4 * gw["tile_m"] * 128 * 4 + 32 * 4 and gw["k_slice_len"] == K // 4
    # 256-row tiles keep at most 3 slices through clusters (4096 x 4096 at M = 256: 32 tiles x 3).
    w256 = plan(256, N=4096)
    assert (w256["grid"], w256["reduce"], w256["workspace_bytes"]) == ((1, 32, 3), "cluster", 0)
    # 28672 x 8192: 43 tiles of 192 columns x 3 slices through global memory (129 blocks; 43
    # clusters of 3 would not fit in one wave) beat 64 tiles of 128 x 2 through clusters.
    big = plan(64, K=28672, N=8192)
    assert (big["tile_n"], big["grid"], big["reduce"]) == (192, (1, 43, 3), "last_block")
    assert (plan(256, K=28672, N=8192)["grid"], plan(256, K=28672, N=8192)["reduce"]) == ((1, 64, 2), "cluster")
    assert (plan(64, N=21504)["tile_n"], plan(64, N=21504)["grid"]) == (192, (1, 112, 1))  # 1 wave, not 2
    assert plan(1024, group_size=64)["kernel"] == "wgmma_ws_fp4_half"
    # A partial last wave becomes a second launch with K slices: 4096 x 21504 at M = 1024 is 672
    # tiles, 5 waves + 12 tiles; the 12 (3 column tiles x 4 row tiles) run as 3-slice clusters.
    tail = plan(1024, N=21504)
    assert (tail["grid"], tail["k_parallel"], tail["n_tiles"]) == ((4, 165, 1), 1, 168)
    assert (tail["tail_n_tiles"], tail["tail_k_parallel"], tail["tail_k_slice_len"]) == (3, 3, 1408)
    assert tail["reduce"] == "none"  # the main launch; the tail's slices always meet in a cluster
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
        plan(100, group_size=32, family="wgmma_ws")
    with pytest.raises(ValueError, match="wgmma_ws kernel needs an sm_90a build"):
        plan(100, wgmma=False, family="wgmma_ws")
    with pytest.raises(ValueError, match="wgmma_ws family does not run on cpu"):
        torch_marlin.plan_gemm("fp4", 100, 256, 64, family="wgmma_ws", caps=dict(compute_units=4))
    with pytest.raises(ValueError, match="wgmma_ws family does not run on cuda with float activations"):
        plan(100, dtype=torch.float32, family="wgmma_ws")


@pytest.mark.parametrize("clusters", [False, True])
def test_policy_cuda_k_slice_reduction(clusters):
    # Up to 4 decode K slices reduce through a thread-block cluster (no workspace) where the device
    # and build have clusters; more slices, or no clusters, through the global fp32 workspace
    # [k_parallel][M][N] summed by the last block of each tile.
    def plan(M, K, N):
        caps = dict(compute_units=132, wgmma=False, thread_block_clusters=clusters)
        return torch_marlin.plan_gemm("fp4", M, K, N, device="cuda", caps=caps)
    two, four, eight, one = plan(4, 2048, 328), plan(4, 4096, 328), plan(4, 8192, 328), plan(4, 4096, 8192)
    assert [p["k_parallel"] for p in (two, four, eight, one)] == [2, 4, 8, 1]
    for p in (two, four):
        if clusters:
            assert p["reduce"] == "cluster" and p["workspace_bytes"] == 0
        else:  # the partials, then an int32 arrival counter per output tile
            assert p["reduce"] == "last_block"
            assert p["workspace_bytes"] == p["k_parallel"] * 4 * 328 * 4 + 4 * p["n_tiles"]
    assert eight["reduce"] == "last_block" and eight["workspace_bytes"] == 8 * 4 * 328 * 4 + 4 * eight["n_tiles"]
    assert eight["m_tiles"] == 1 and eight["n_tiles"] == (328 + eight["tile_n"] - 1) // eight["tile_n"]
    assert one["reduce"] == "none" and one["workspace_bytes"] == 0
    for p in (two, four, eight, one):  # CUDA sums K slices inside the kernel: no second dispatch
        assert p["reduce_kernel"] == "" and p["reduce_grid"] == (1, 1, 1)
    # dequant_blas never splits K, clusters or not.
    big = plan(300, 2048, 328)
    assert big["family"] == "dequant_blas" and big["reduce"] == "none"


@pytest.mark.parametrize("clusters", [False, True])
def test_policy_cuda_dependent_launch(clusters):
    # Programmatic dependent launch: decode where the device and build run clusters (sm_90 with
    # sm_90 PTX), wgmma_ws always (sm_90a only); never the wgmma, dequant_blas or fp32 kernels,
    # nor any backend but CUDA.
    def plan(M, group_size=128, dtype=torch.float16, device="cuda", N=4096):
        caps = dict(compute_units=132, thread_block_clusters=clusters, wgmma=clusters)
        return torch_marlin.plan_gemm("fp4", M, 4096, N, group_size, dtype=dtype, device=device, caps=caps)
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
    with pytest.raises(ValueError, match="family must be one of"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, family="fast")
    with pytest.raises(ValueError, match="family must be one of"):
        torch_marlin.plan_gemm("fp4", 100, 256, 64, family="tiled")  # not a family
    with pytest.raises(ValueError, match="decode family handles M <= 16"):
        torch_marlin.plan_gemm("fp4", 17, 256, 64, family="decode")
    with pytest.raises(ValueError, match="decode family handles M <= 16 only \\(128 on CUDA\\)"):
        torch_marlin.plan_gemm("fp4", 129, 256, 64, device="cuda", caps=SM132_PORTABLE, family="decode")
    with pytest.raises(ValueError, match="dtype must be one of"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="no torch_marlin backend for device type 'meta'"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, device="meta")


@pytest.mark.parametrize("M, K, N, g, message", [
    (1, 100, 64, 4, "K must be a positive multiple of 8, got 100"),
    (1, 256, 64, 12, "group_size must be a positive multiple of 8, got 12"),
    (1, 256, 64, 96, r"group_size \(96\) must divide K \(256\)"),
])
def test_plan_gemm_shape_errors_are_the_ops(M, K, N, g, message):
    with pytest.raises(ValueError, match="plan_quant_gemm: " + message):
        torch_marlin.plan_gemm("fp4", M, K, N, g)
    A = torch.randn(M, K, dtype=torch.float16)
    B = torch.zeros(max(K // 8, 1), N, dtype=torch.int32)
    scales = torch.ones(max(K // g, 1), N, dtype=torch.float16)
    with pytest.raises(ValueError, match="gemm_fp4: " + message):
        torch.ops.marlin.gemm_fp4(A, B, scales, g)


def test_plan_gemm_rejects_m_and_n_out_of_range():
    with pytest.raises(ValueError, match=r"plan_quant_gemm: M must be in \[0, 2\^32\), got -1"):
        torch_marlin.plan_gemm("fp4", -1, 256, 64)
    with pytest.raises(ValueError, match="plan_quant_gemm: N must be positive, got 0"):
        torch_marlin.plan_gemm("fp4", 1, 256, 0)


@pytest.mark.parametrize("M, K, N, bits, g, message", [
    (1, 256, 64, 5, 32, "bits must be 2, 3 or 4, got 5"),
    (1, 256, 64, 3, 24, "group_size must be a positive multiple of 16"),
    (1, 0, 64, 3, 32, "K and N must be positive, got K=0, N=64"),
    (-1, 256, 64, 3, 32, r"M must be in \[0, 2\^31\), got -1"),
])
def test_plan_trellis_shape_errors_name_the_argument(M, K, N, bits, g, message):
    with pytest.raises(ValueError, match="plan_trellis_gemm: " + message):
        torch_marlin.plan_trellis(M, K, N, bits, g)


# ---- forced families -------------------------------------------------------------------------

@pytest.mark.parametrize("device, caps, dtype, family, backend", [
    ("cpu", dict(compute_units=4), torch.float16, "fused_tiles", "cpu"),
    ("cpu", dict(compute_units=4), torch.float16, "simt", "cpu"),
    ("metal", M1, torch.float16, "wgmma", "metal"),
    ("metal", M1, torch.float16, "dequant_blas", "metal"),
    ("cuda", H100, torch.float16, "striped", "cuda"),
    ("cuda", H100, torch.float16, "simt", "cuda"),
    ("cuda", H100, torch.float32, "decode", "cuda"),
])
def test_forced_family_the_backend_lacks_is_refused(device, caps, dtype, family, backend):
    with pytest.raises(ValueError, match=f"the {family} family does not run on {backend}.*families there: "):
        torch_marlin.plan_gemm("fp4", 8, 256, 64, dtype=dtype, device=device, caps=caps, family=family)


@pytest.mark.parametrize("device, caps, family, kernel", [
    ("cpu", dict(compute_units=4), "decode", "cpu_decode"),
    ("cpu", dict(compute_units=4), "dequant_blas", "cpu_dequant_blas"),
    ("metal", M1, "decode", "marlin_gemv_m8_u4_half"),
    ("metal", M1, "fused_tiles", "marlin_gemm_fused_m32_u4_half"),  # 8 rows: the 32-row tile
    ("metal", M1, "staged_tiles", "marlin_gemm_u4_half"),
    ("metal", M1, "striped", "marlin_gemm_striped_m32_u4_half"),  # 8 rows: the 32-row tile
    ("cuda", H100, "decode", "decode_u4_half"),
    ("cuda", H100, "dequant_blas", "dequant_blas_u4_half"),
    ("cuda", H100, "wgmma", "wgmma_u4_half"),
    ("cuda", H100, "wgmma_ws", "wgmma_ws_u4_half"),
])
def test_forced_family_names_its_kernel(device, caps, family, kernel):
    p = torch_marlin.plan_gemm("u4", 8, 1024, 256, device=device, caps=caps, family=family)
    assert (p["family"], p["kernel"]) == (family, kernel)


def test_metal_decode_geometry():
    # Row counts: the next power of two (a fixed register array per kernel); 16-byte weight loads
    # when N % 4 == 0, else the per-column 16-row kernel. 128 columns x 128 threads per group.
    for M, rows in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)):
        p = torch_marlin.plan_gemm("u4", M, 4096, 4096, 128, device="metal", caps=M1)
        assert (p["kernel"], p["tile_m"], p["vector_loads"]) == (f"marlin_gemv_m{rows}_u4_half", rows, True)
        assert (p["tile_n"], p["n_tiles"], p["threads"], p["grid"]) == (128, 32, (128, 1, 1), (32, 1, 1))
        q = torch_marlin.plan_gemm("u4", M, 4096, 4094, 128, device="metal", caps=M1)
        assert (q["kernel"], q["tile_m"], q["vector_loads"]) == ("marlin_gemv_unaligned_u4_half", 16, False)
    # K slices only when the output has fewer than 4 threadgroups per core, of whole groups
    # (multiples of max(group_size, 64) rows), 512 rows at least.
    assert torch_marlin.plan_gemm("fp4", 1, 4096, 4096, 128, device="metal", caps=M1)["k_parallel"] == 1
    big = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, 128, device="metal", caps=dict(compute_units=32))
    assert big["k_parallel"] == 4 and big["k_slice_len"] == 1024 and big["grid"] == (32, 4, 1)
    assert big["reduce_kernel"] == "marlin_reduce_partials_half" and big["workspace_bytes"] == 4 * 4096 * 4
    for gs in (8, 40, 128, 1024):
        p = torch_marlin.plan_gemm("fp4", 2, 10240, 256, gs, device="metal", caps=M1)
        assert p["k_parallel"] > 1 and p["k_slice_len"] % gs == 0 and p["k_slice_len"] >= 512, (gs, p)
    short = torch_marlin.plan_gemm("fp4", 1, 512, 256, 128, device="metal", caps=M1)
    assert short["k_parallel"] == 1


# ---- the plan dict: kernel descriptor, padded N, caps --------------------------------------------

@pytest.mark.parametrize("device, caps", [("cpu", dict(compute_units=3)), ("metal", M1), ("cuda", H100)])
def test_plan_dict_keys_and_caps_echoed(device, caps):
    p = torch_marlin.plan_gemm("fp4", 5, 1024, 200, 64, dtype=torch.bfloat16, device=device, caps=caps)
    assert set(p) == PLAN_KEYS
    assert p["backend"] == ("metal" if device == "metal" else device)
    assert (p["format"], p["dtype"]) == ("fp4", "bfloat16")
    for key, value in caps.items():
        assert p[key] == value, key
    assert p["tile_m"] * p["m_tiles"] >= 5 and p["tile_n"] * p["n_tiles"] >= 200


def roles(plan):
    return [launch["role"] for launch in plan["launches"]]


def test_every_plan_lists_its_launches_in_execution_order():
    # One shape for every family: the launches in the order they run, each under its role; the named
    # keys (the GEMM's at the top level, reduce_*, tail_*, stage dicts) describe the same launches.
    metal = torch_marlin.plan_gemm("u4", 64, 8192, 128, device="metal", caps=M1)
    assert roles(metal) == ["main", "reduce"] and metal["k_parallel"] > 1
    main, reduce = metal["launches"]
    assert (main["kernel"], main["grid"], main["threads"]) == (metal["kernel"], metal["grid"], metal["threads"])
    assert (reduce["kernel"], reduce["grid"]) == (metal["reduce_kernel"], metal["reduce_grid"])
    assert roles(torch_marlin.plan_gemm("fp4", 3, 4096, 4096, caps=dict(compute_units=4))) == ["main"]
    # CUDA wgmma_ws with a tail: the same kernel again on the last column tiles, in K slices.
    ws = torch_marlin.plan_gemm("fp4", 256, 4096, 21504, device="cuda", caps=H100)
    assert roles(ws) == ["main", "tail"] and ws["tail_n_tiles"] > 0
    tail = ws["launches"][1]
    assert tail["kernel"] == ws["kernel"] and tail["grid"] == (ws["m_tiles"], ws["tail_n_tiles"], ws["tail_k_parallel"])
    assert ws["grid"][1] + tail["grid"][1] == ws["n_tiles"]
    # Trellis: the CUDA decode's K-slice reduction; the MoE's stages (Metal's tiled ones past 16 rows).
    dec = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="cuda", caps=H100)
    assert roles(dec) == ["main", "reduce"] and dec["launches"][1]["kernel"] == dec["reduce"]["kernel"]
    moe = torch_marlin.plan_trellis_moe(64, 2048, 768, 64, 8, 3, 128, device="metal", caps=M1)
    assert roles(moe) == ["main", "tiled_gate", "tiled_up", "down", "tiled_down", "combine"]
    assert [ln["kernel"] for ln in moe["launches"][1:]] == [moe[r]["kernel"] for r in roles(moe)[1:]]
    routed = torch_marlin.plan_trellis_moe(4, 2048, 768, 64, 8, 3, 128, device="cuda", caps=H100)
    assert roles(routed) == ["route", "main", "down", "combine"]
    # rANS: the decode, then (staged) the dense GEMM's own launches.
    assert roles(torch_marlin.plan_rans(1, 4096, 4096, device="metal", caps=M1)) == ["decode"]
    staged = torch_marlin.plan_rans(300, 4096, 128, device="metal", caps=M1)
    assert roles(staged) == ["decode"] + roles(staged["gemm"])
    assert staged["launches"][1]["kernel"] == staged["gemm"]["kernel"]


def test_plan_dict_decode_scale_group_sums_and_padded_n():
    def cuda(M, N=200, group_size=128, dtype=torch.float16):
        return torch_marlin.plan_gemm("u4", M, 4096, N, group_size, dtype=dtype, device="cuda", caps=SM132_PORTABLE)
    # Folded scales: decode tiles of 8 or 16 rows, a 32-row chunk inside one group.
    assert [cuda(M)["scale_group_sums"] for M in (1, 9, 16, 17, 33)] == [True, True, True, False, False]
    assert [cuda(M)["tile_m"] for M in (1, 9, 16, 17, 33)] == [8, 16, 16, 32, 64]
    assert not cuda(1, group_size=16)["scale_group_sums"] and not cuda(1, group_size=8)["scale_group_sums"]
    assert cuda(1, group_size=32)["scale_group_sums"] and cuda(9, group_size=64)["scale_group_sums"]
    # The CUDA fp16/bf16 kernels read N rounded up to 16 columns; nothing else pads.
    assert cuda(1)["padded_n"] == 208 and cuda(1, N=4096)["padded_n"] == 4096
    assert cuda(300, N=200)["padded_n"] == 208  # dequant_blas
    assert cuda(1, dtype=torch.float32)["padded_n"] == 0  # simt
    assert torch_marlin.plan_gemm("u4", 1, 4096, 200)["padded_n"] == 0
    assert torch_marlin.plan_gemm("u4", 1, 4096, 200, device="metal", caps=M1)["padded_n"] == 0
    # Consumers only for wgmma_ws (tile_n / 64); scale_group_sums only for CUDA decode.
    ws = torch_marlin.plan_gemm("fp4", 64, 4096, 21504, device="cuda", caps=H100)
    assert (ws["family"], ws["consumers"], ws["tile_n"], ws["scale_group_sums"]) == ("wgmma_ws", 3, 192, False)
    assert torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="metal", caps=M1)["scale_group_sums"] is False
    assert cuda(1)["consumers"] == 0


def test_metal_plan_without_caps_uses_default_metal_caps():
    p = torch_marlin.plan_gemm("fp4", 64, 8192, 128, device="metal")
    assert (p["backend"], p["compute_units"], p["max_shared_memory"]) == ("metal", 8, 32768)
    assert p == torch_marlin.plan_gemm("fp4", 64, 8192, 128, device="metal", caps=M1)
    assert _C.default_caps("metal") == dict(backend="metal", compute_units=8, max_shared_memory=32768, wgmma=False,
                                            thread_block_clusters=False, avx2=False, avx512=False)


def test_missing_caps_keys_take_the_backend_defaults():
    p = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="cuda", caps={})
    assert (p["compute_units"], p["wgmma"], p["thread_block_clusters"]) == (1, False, False)
    assert torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="metal", caps={})["compute_units"] == 8
    p = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="cuda", caps=dict(compute_units=132))
    assert (p["compute_units"], p["wgmma"], p["thread_block_clusters"]) == (132, False, False)
    # A plan's own caps keys plan the same again.
    h = torch_marlin.plan_gemm("fp4", 64, 4096, 4096, device="cuda", caps=H100)
    again = {k: h[k] for k in ("backend", "compute_units", "max_shared_memory", "wgmma", "thread_block_clusters")}
    assert torch_marlin.plan_gemm("fp4", 64, 4096, 4096, device="cuda", caps=again) == h


def test_bad_caps_are_refused():
    with pytest.raises(ValueError, match="caps: unknown key 'sms'"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, device="cuda", caps=dict(sms=132))
    with pytest.raises(ValueError, match="caps\\['compute_units'\\] must be positive"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, device="cuda", caps=dict(compute_units=0))
    with pytest.raises(ValueError, match="caps\\['backend'\\] is 'metal' but the plan is for cuda"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, device="cuda", caps=dict(backend="metal"))
    with pytest.raises(TypeError, match="caps must be a dict"):
        torch_marlin.plan_gemm("fp4", 1, 256, 64, device="cuda", caps=132)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_plan_without_a_gpu_needs_caps():
    with pytest.raises(ValueError, match="no cuda device here.*caps=dict\\("):
        torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="cuda")
    with pytest.raises(ValueError, match="no cuda device here.*caps=dict\\("):
        torch_marlin.plan_trellis(1, 4096, 4096, device="cuda")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_mps_plan_without_a_gpu_needs_caps():
    with pytest.raises(ValueError, match="no mps device here.*caps=dict\\("):
        torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="mps")
    assert torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="mps", caps=M1)["kernel"] == "marlin_gemv_m1_fp4_half"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plan_without_caps_reads_the_device():
    caps = _C.device_caps("cuda")
    assert caps["backend"] == "cuda"
    assert caps["compute_units"] == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    p = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, device="cuda")
    assert all(p[k] == v for k, v in caps.items())


def test_cpu_plan_uses_the_ops_thread_count():
    # caps=None reads _C.device_caps, the function the op plans with: torch's intra-op threads.
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert _C.device_caps("cpu") == dict(backend="cpu", compute_units=n, max_shared_memory=32768,
                                                 wgmma=False, thread_block_clusters=False,
                                                 avx2=_C.device_caps("cpu")["avx2"],
                                                 avx512=_C.device_caps("cpu")["avx512"])
            assert torch_marlin.plan_gemm("fp4", 1, 256, 64)["compute_units"] == n
            assert torch_marlin.plan_trellis(1, 256, 64)["compute_units"] == n
        # The decode tile width depends on it: 256 columns only when every thread gets two tiles.
        torch.set_num_threads(2)
        assert torch_marlin.plan_gemm("fp4", 1, 256, 1024)["tile_n"] == 256
        torch.set_num_threads(3)
        assert torch_marlin.plan_gemm("fp4", 1, 256, 1024)["tile_n"] == 64
    finally:
        torch.set_num_threads(threads)


# ---- trellis -----------------------------------------------------------------------------------

def test_plan_trellis_policy_metal_and_cpu():
    for M in (1, 16):
        p = torch_marlin.plan_trellis(M, 4096, 4096, 3, 128, torch.float16, device="metal", caps=M1)
        assert p["family"] == "decode" and p["kernel"] == "gemm_trellis_packed_decode_half"
        assert p["grid"] == (128, 1, 1) and p["threads"] == (128, 1, 1) and p["tile_n"] == 32
    p = torch_marlin.plan_trellis(17, 4096, 1000, 4, 128, torch.bfloat16, device="metal", caps=M1)
    assert p["family"] == "staged_tiles" and p["kernel"] == "gemm_trellis_packed_bfloat"
    assert p["grid"] == (16, 1, 1) and p["threads"] == (128, 1, 1) and (p["tile_m"], p["tile_n"]) == (64, 64)
    cpu = torch_marlin.plan_trellis(100, 64, 64, 2, 32, torch.float32, family="dequant_blas")
    assert cpu["kernel"] == "cpu_trellis_prefill" and cpu["family"] == "dequant_blas" and cpu["k_chunk"] == 16384
    assert torch_marlin.plan_trellis(3, 64, 64, 2, 32, torch.float32, family="dequant_blas")["kernel"] == \
        "cpu_trellis_prefill"
    dec = torch_marlin.plan_trellis(3, 64, 64, 2, 32, torch.float32, caps=dict(compute_units=1))
    assert (dec["family"], dec["kernel"], dec["tile_m"], dec["tile_n"]) == ("decode", "cpu_trellis_decode", 16, 64)
    assert torch_marlin.plan_trellis(17, 64, 64, 2, 32, torch.float32)["family"] == "dequant_blas"
    with pytest.raises(ValueError, match="M <= 16"):
        torch_marlin.plan_trellis(17, 64, 64, 2, 32, torch.float32, family="decode")
    with pytest.raises(ValueError, match="32-bit indices"):
        torch_marlin.plan_trellis(1 << 20, 8192, 64, 2, 32, torch.float16, device="metal", caps=M1)  # M*K = 2^33


def test_plan_trellis_forced_families_and_keys():
    with pytest.raises(ValueError, match="staged_tiles family does not run trellis on cpu"):
        torch_marlin.plan_trellis(20, 64, 64, 2, 32, family="staged_tiles")
    with pytest.raises(ValueError, match="dequant_blas family does not run trellis on metal"):
        torch_marlin.plan_trellis(20, 64, 64, 2, 32, device="metal", caps=M1, family="dequant_blas")
    with pytest.raises(ValueError, match="family must be one of"):
        torch_marlin.plan_trellis(20, 64, 64, 2, 32, family="tiled")
    p = torch_marlin.plan_trellis(20, 64, 64, 2, 32, device="metal", caps=dict(compute_units=10))
    assert set(p) == {"family", "kernel", "grid", "threads", "tile_m", "tile_n", "m_tiles", "n_tiles", "k_chunk",
                      "tile_k", "k_vec4", "cpu_avx2", "cpu_avx512", "cuda_stream_decode", "cuda_stream_stage_groups",
                      "index_layout", "k_parallel", "k_slice_tiles", "dependent_launch", "launches", "backend",
                      "compute_units", "max_shared_memory", "wgmma", "thread_block_clusters", "avx2", "avx512"}
    assert (p["backend"], p["compute_units"], p["m_tiles"], p["n_tiles"]) == ("metal", 10, 1, 1)


def test_plan_trellis_policy_cuda():
    # Decode with K % 8 == 0: the streaming kernel, M padded to 8 or 16 rows. 128-column blocks (32
    # here) are too few for 132 SMs, so K is cut into slices of whole 128-row stages until there are
    # about four blocks per SM; a reduction sums the slices in order.
    dec = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, torch.float16, device="cuda", caps=H100)
    assert (dec["family"], dec["kernel"], dec["tile_m"], dec["tile_n"]) == ("decode", "gemm_trellis_decode_half", 8, 128)
    assert dec["threads"] == (256, 1, 1) and dec["tile_k"] == 128 and dec["cuda_stream_decode"]
    assert (dec["k_parallel"], dec["k_slice_tiles"], dec["grid"]) == (16, 16, (32, 16, 1))
    assert dec["reduce"]["kernel"] == "gemm_trellis_reduce_half" and dec["reduce"]["grid"] == (16, 1, 1)
    # On devices with griddepcontrol (sm_90 PTX, caps thread_block_clusters) the reduction launches
    # behind the GEMM kernel (PDL), and the GEMM kernel behind whatever ran before it.
    assert dec["reduce"]["dependent_launch"] and dec["dependent_launch"]
    portable = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, torch.float16, device="cuda", caps=SM132_PORTABLE)
    assert portable["k_parallel"] == 16 and not portable["reduce"]["dependent_launch"]
    assert not portable["dependent_launch"]
    # A block converts its slice's activations into shared memory once, so a slice holds at most
    # 128 tile rows at 8 rows of M and 64 at 16. 17 slices wanted (32 column blocks): K = 14336
    # takes 16 of 7 stages; K = 28672 16 of 14 stages at M = 1, but 28 of 8 at M = 9.
    assert torch_marlin.plan_trellis(1, 14336, 4096, 3, 128, torch.float16, device="cuda",
                                     caps=H100)["k_slice_tiles"] == 56
    for M, k_parallel, slice_tiles in ((1, 16, 112), (9, 28, 64)):
        p = torch_marlin.plan_trellis(M, 28672, 4096, 3, 128, torch.float16, device="cuda", caps=H100)
        assert (p["k_parallel"], p["k_slice_tiles"]) == (k_parallel, slice_tiles)
    assert torch_marlin.plan_trellis(9, 4096, 4096, 3, 128, torch.float16, device="cuda", caps=H100)["tile_m"] == 16
    # 16-row blocks at 3 and 4 bits take slices of at least 3 stages where that leaves two blocks per
    # SM: 4096 x 4096 in 11 slices instead of 16 of 2 stages; 2 bits, 8-row blocks and layers of
    # too few column blocks (2048 x 2048: 16 blocks x 6 slices < 264) keep the 4-per-SM split.
    def split(M, K, N, bits):
        p = torch_marlin.plan_trellis(M, K, N, bits, 128, torch.float16, device="cuda", caps=H100, layout="lanes")
        return p["k_parallel"], p["k_slice_tiles"]
    assert split(16, 4096, 4096, 3) == split(9, 4096, 4096, 4) == (11, 24)
    assert split(16, 8192, 2048, 3) == (22, 24)
    assert split(16, 4096, 4096, 2) == split(8, 4096, 4096, 3) == (16, 16)
    assert split(16, 2048, 2048, 3) == (16, 8)
    # Scale groups of whole 128-row stages fold at stage starts only; smaller groups fold per tile row.
    assert dec["cuda_stream_stage_groups"]
    assert not torch_marlin.plan_trellis(1, 4096, 4096, 3, 64, torch.float16, device="cuda",
                                         caps=H100)["cuda_stream_stage_groups"]
    # K % 8 != 0: the tensor-core kernel at one m16 tile, K in 128-row stages. It has no wait
    # before its first reads, so it launches plainly.
    odd = torch_marlin.plan_trellis(1, 4100, 4096, 3, 128, torch.bfloat16, device="cuda", caps=H100)
    assert (odd["kernel"], odd["tile_m"], odd["tile_k"], odd["cuda_stream_decode"], odd["dependent_launch"]) == (
        "gemm_trellis_decode_mma_bfloat", 16, 128, False, False)
    # Fused tiles (forced; more than 16 rows run dequant_blas): 64-row tiles; 5 x 32 blocks are
    # short of 4 per SM, so K goes in 4 slices.
    pre = torch_marlin.plan_trellis(300, 4096, 4096, 2, 128, torch.bfloat16, device="cuda", caps=H100,
                                    family="fused_tiles")
    assert (pre["family"], pre["kernel"], pre["tile_m"], pre["m_tiles"]) == ("fused_tiles", "gemm_trellis_tiles_bfloat",
                                                                             64, 5)
    assert (pre["grid"], pre["k_parallel"], pre["k_slice_tiles"]) == ((32, 20, 1), 4, 64)
    assert pre["reduce"]["kernel"] == "gemm_trellis_reduce_bfloat"
    # More than 16 rows: the dense weight in fp16 / bf16 (one dequant launch over the tiles), then cuBLAS.
    for M in (17, 4096):
        blas = torch_marlin.plan_trellis(M, 4096, 4096, 3, 128, torch.float16, device="cuda", caps=H100)
        assert (blas["family"], blas["kernel"], blas["grid"]) == ("dequant_blas", "dequant_trellis_half", (16, 256, 1))
    # Every slice holds at least one stage and the slices cover K.
    for M, K, N, family in [(1, 200, 77, "auto"), (16, 4096, 512, "auto"), (3, 14336, 4096, "auto"),
                            (40, 1040, 1000, "fused_tiles")]:
        p = torch_marlin.plan_trellis(M, K, N, 4, 32, torch.float16, device="cuda", caps=H100, family=family)
        tiles_k = (K + 15) // 16
        assert p["k_slice_tiles"] % (p["tile_k"] // 16) == 0 and (p["k_parallel"] - 1) * p["k_slice_tiles"] < tiles_k
        assert p["k_parallel"] * p["k_slice_tiles"] >= tiles_k and p["grid"][1] == p["m_tiles"] * p["k_parallel"]
    # fp32 activations: the CUDA-core kernel at every M.
    f32 = torch_marlin.plan_trellis(5, 200, 77, 2, 32, torch.float32, device="cuda", caps=H100)
    assert (f32["family"], f32["kernel"], f32["grid"], f32["threads"]) == ("simt", "gemm_trellis_simt_float", (1, 1, 1),
                                                                           (128, 1, 1))
    forced = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="cuda", caps=H100, family="fused_tiles")
    assert forced["kernel"] == "gemm_trellis_tiles_half" and forced["tile_m"] == 64
    with pytest.raises(ValueError, match="dequant_blas family does not run trellis on cuda"):
        torch_marlin.plan_trellis(17, 64, 64, 2, 32, torch.float32, device="cuda", caps=H100, family="dequant_blas")
    with pytest.raises(ValueError, match="M <= 16"):
        torch_marlin.plan_trellis(17, 64, 64, 2, 32, device="cuda", caps=H100, family="decode")
    with pytest.raises(ValueError, match="staged_tiles family does not run trellis on cuda"):
        torch_marlin.plan_trellis(20, 64, 64, 2, 32, device="cuda", caps=H100, family="staged_tiles")
    with pytest.raises(ValueError, match="too large for the CUDA kernels' grid"):
        torch_marlin.plan_trellis(1 << 23, 64, 64, 2, 32, device="cuda", caps=H100, family="fused_tiles")


def test_plan_trellis_moe_policy_cuda():
    # One token, top 8 of 64 experts of 2048 x 1024: the streaming decode kernel for gate/up (one
    # launch, grid.z = 2 x 8 slots, one per routed row, read from expert_ids: no routing launch) and
    # down, 8-row tiles, K in slices of whole 128-row stages up to one wave of 3 blocks per SM
    # (128 blocks a slice: 3 slices; 132 SMs).
    p = torch_marlin.plan_trellis_moe(1, 2048, 1024, 64, 8, 3, 128, torch.float16, device="cuda", caps=H100)
    assert (p["family"], p["kernel"], p["tile_m"], p["tile_k"]) == ("decode", "moe_trellis_gate_up_decode_half", 8, 128)
    assert p["cuda_stream_decode"] and p["cuda_stream_stage_groups"] and p["index_layout"] == "tiles"
    assert p["moe_row_slots"] and "route" not in p
    assert (p["grid"], p["k_parallel"], p["k_slice_tiles"]) == ((8, 3, 16), 3, 48)
    assert (p["down"]["kernel"], p["down"]["grid"], p["down"]["k_parallel"]) == ("moe_trellis_down_decode_half",
                                                                             (16, 3, 8), 3)
    assert p["grid"][1] * p["grid"][2] * p["grid"][0] <= 3 * 132 and p["combine"]["kernel"] == "moe_trellis_combine_half"
    # Down starts behind gate/up and the combine behind down where griddepcontrol exists (sm_90).
    assert p["down"]["dependent_launch"] and p["combine"]["dependent_launch"] and not p["dependent_launch"]
    portable = torch_marlin.plan_trellis_moe(1, 2048, 1024, 64, 8, 3, 128, device="cuda", caps=SM132_PORTABLE)
    assert portable["cuda_stream_decode"] and not portable["down"]["dependent_launch"]
    # 9..16 routed rows: 16-row tiles, whose slices hold at most 64 tile rows.
    p16 = torch_marlin.plan_trellis_moe(2, 4096, 14336, 64, 8, 3, 128, torch.bfloat16, device="cuda", caps=H100)
    assert (p16["kernel"], p16["tile_m"]) == ("moe_trellis_gate_up_decode_bfloat", 16)
    # More than one token: experts may share rows, so the one-block routing groups them (slots =
    # min(E, rows) = 16).
    assert not p16["moe_row_slots"] and p16["route"]["kernel"] == "moe_trellis_route" and p16["grid"][2] == 32
    assert p16["k_slice_tiles"] <= 64 and p16["down"]["k_slice_tiles"] <= 64
    # hidden or intermediate % 8 != 0: the tensor-core kernel at one m16 tile; more than 16 routed
    # rows: its 64-row tiles; fp32: the CUDA-core kernel. None of them launches dependent.
    odd = torch_marlin.plan_trellis_moe(1, 2052, 1024, 64, 8, 3, 128, device="cuda", caps=H100)
    assert (odd["kernel"], odd["tile_m"], odd["cuda_stream_decode"]) == ("moe_trellis_gate_up_decode_mma_half", 16,
                                                                         False)
    tiles = torch_marlin.plan_trellis_moe(3, 2048, 1024, 64, 8, 3, 128, device="cuda", caps=H100)
    assert (tiles["family"], tiles["kernel"], tiles["tile_m"]) == ("fused_tiles", "moe_trellis_gate_up_tiles_half", 64)
    f32 = torch_marlin.plan_trellis_moe(1, 2048, 1024, 64, 8, 3, 128, torch.float32, device="cuda", caps=H100)
    assert f32["kernel"] == "moe_trellis_gate_up_simt_float"
    assert not any(q["down"]["dependent_launch"] or q["combine"]["dependent_launch"] for q in (odd, tiles, f32))
    with pytest.raises(ValueError, match="invalid tokens / num_experts / top_k"):
        torch_marlin.plan_trellis_moe(1, 2048, 1024, 4, 8, device="cuda", caps=H100)


def test_plan_trellis_lane_layout_cuda():
    # The layout policy: the CUDA lane layout where the streaming decode reads it (K % 8 == 0).
    assert torch_marlin.planner.trellis_index_layout(4096, 4096, 3, "cuda", caps=H100) == "lanes"
    assert torch_marlin.planner.trellis_index_layout(4100, 4096, 3, "cuda", caps=H100) == "tiles"
    assert torch_marlin.planner.trellis_index_layout(4096, 4096, 3, "cpu") == "tiles"
    assert torch_marlin.planner.trellis_index_layout(4096, 4096, 3, "metal", caps=M1) == "tiles"
    # Lane-layout decode: the streaming kernel's geometry and slices, its lane instantiation.
    tiles = torch_marlin.plan_trellis(1, 4096, 14336, 3, 128, torch.float16, device="cuda", caps=H100)
    lanes = torch_marlin.plan_trellis(1, 4096, 14336, 3, 128, torch.float16, device="cuda", caps=H100, layout="lanes")
    assert (tiles["index_layout"], lanes["index_layout"]) == ("tiles", "lanes")
    assert lanes["kernel"] == "gemm_trellis_decode_lanes_half" and lanes["cuda_stream_decode"]
    same = ("family", "grid", "threads", "tile_m", "tile_n", "tile_k", "k_parallel", "k_slice_tiles",
            "cuda_stream_stage_groups")
    assert {k: lanes[k] for k in same} == {k: tiles[k] for k in same}
    assert torch_marlin.plan_trellis(16, 200, 77, 2, 32, torch.bfloat16, device="cuda", caps=H100,
                                     layout="lanes")["kernel"] == "gemm_trellis_decode_lanes_bfloat"
    # Everything else dequantizes the lane chunks (a warp each, 8 tile columns a block) for cuBLAS:
    # more than 16 rows, fp32 activations (at every M) and K % 8 != 0.
    for M, K, dtype in [(17, 4096, torch.float16), (1, 4096, torch.float32), (1, 4100, torch.bfloat16)]:
        p = torch_marlin.plan_trellis(M, K, 14336, 3, 128, dtype, device="cuda", caps=H100, layout="lanes")
        suffix = {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}[dtype]
        assert (p["family"], p["kernel"]) == ("dequant_blas", "dequant_trellis_lanes_" + suffix)
        assert p["grid"] == (14336 // 16 // 8, -(-(-(-K // 16)) // 8), 1) and p["threads"] == (256, 1, 1)
    forced = torch_marlin.plan_trellis(5, 4096, 4096, 3, 128, device="cuda", caps=H100, layout="lanes",
                                       family="dequant_blas")
    assert forced["kernel"] == "dequant_trellis_lanes_half"
    with pytest.raises(ValueError, match="lane layout run decode"):
        torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="cuda", caps=H100, layout="lanes", family="fused_tiles")
    with pytest.raises(ValueError, match="lane layout run decode"):
        torch_marlin.plan_trellis(1, 4100, 4096, 3, 128, device="cuda", caps=H100, layout="lanes", family="decode")
    with pytest.raises(ValueError, match="lane layout run on CUDA only, not cpu"):
        torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, layout="lanes")
    with pytest.raises(ValueError, match="lane layout run on CUDA only, not metal"):
        torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="metal", caps=M1, layout="lanes")
    with pytest.raises(ValueError, match="index layout must be 'tiles' or 'lanes'"):
        torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="cuda", caps=H100, layout="rows")


def test_plan_trellis_wgmma_prefill_cuda():
    # Lane-layout prefill of 64..256 rows where the device runs sm_90a kernels (caps wgmma) and
    # the 128-column blocks cover at least half the SMs: the wgmma kernel, 256 rows a block
    # unless 128-row blocks take fewer waves (a 256-row block counting as two), after a launch that
    # rewrites the activations (a thread per 16 k of a row, K padded to whole lane chunks).
    def plan(M, K, N, dtype=torch.float16, caps=H100, **kw):
        return torch_marlin.plan_trellis(M, K, N, 3, 128, dtype, device="cuda", caps=caps, layout="lanes", **kw)

    p = plan(256, 4096, 14336)
    assert (p["family"], p["kernel"], p["tile_m"], p["tile_n"], p["grid"], p["threads"], p["k_parallel"]) == (
        "wgmma", "gemm_trellis_wgmma_lanes_half", 256, 128, (1, 112, 1), (384, 1, 1), 1)
    assert (p["activations"]["kernel"], p["activations"]["grid"], p["activations"]["threads"]) == (
        "trellis_wgmma_activations_half", (256, 1, 1), (256, 1, 1))
    assert plan(200, 200, 12600, torch.bfloat16)["activations"]["grid"] == (-(-200 * 16 // 256), 1, 1)  # K -> 256
    # 112 column blocks: 128-row blocks at M = 64; at 129 and 256 rows 112 256-row blocks are one
    # wave, 224 128-row ones two. At M = 200: 67 column blocks (N = 8500) the same; 133 (N = 17024):
    # 133 256-row blocks take 2 waves, 266 128-row ones 3.
    assert [plan(M, 4096, 14336)["tile_m"] for M in (64, 129, 256)] == [128, 256, 256]
    assert [(plan(200, 4096, N)["family"], plan(200, 4096, N)["tile_m"]) for N in (8500, 17024)] == [
        ("wgmma", 256), ("wgmma", 128)]
    assert plan(64, 4096, 14336, torch.bfloat16)["kernel"] == "gemm_trellis_wgmma_lanes_bfloat"
    # Otherwise the lane dequant + cuBLAS: below 64 or above 256 rows, fewer column blocks than
    # half the SMs (65 of 132, or the 32 of 4096 columns at any M), no sm_90a kernels, fp32.
    for M, N, dtype, caps in [(63, 14336, torch.float16, H100), (257, 14336, torch.float16, H100),
                              (256, 8320, torch.float16, H100), (128, 4096, torch.float16, H100),
                              (256, 14336, torch.float16, dict(compute_units=108)),
                              (256, 14336, torch.float32, H100)]:
        assert plan(M, 4096, N, dtype, caps)["family"] == "dequant_blas", (M, N, dtype, caps)
    assert plan(5, 4096, 4096, family="wgmma")["tile_m"] == 128
    with pytest.raises(ValueError, match="lane layout run decode .*wgmma .*caps wgmma"):
        plan(256, 4096, 14336, caps=dict(compute_units=108), family="wgmma")


def test_plan_trellis_metal_k_blocks_and_vector_reads():
    # Decode stages K in blocks of 8 tile rows, the tiled kernels one tile row (16) per block; the
    # activation rows are read 4 elements at a time only when their length is a multiple of 4.
    dec = torch_marlin.plan_trellis(1, 4096, 4096, 3, 128, device="metal", caps=M1)
    pre = torch_marlin.plan_trellis(64, 4096, 4096, 3, 128, device="metal", caps=M1)
    assert (dec["tile_k"], dec["k_vec4"], pre["tile_k"], pre["k_vec4"]) == (128, True, 16, True)
    assert not torch_marlin.plan_trellis(1, 4098, 4096, 3, 128, device="metal", caps=M1)["k_vec4"]
    assert not torch_marlin.plan_trellis(64, 37, 64, 3, 32, device="metal", caps=M1)["k_vec4"]
    assert torch_marlin.plan_trellis(1, 64, 64, 3, 32)["tile_k"] == 0  # the CPU kernels have no K blocks


@pytest.mark.parametrize("device, caps", [("cpu", dict(compute_units=4)), ("metal", M1), ("cuda", H100),
                                          ("cuda", SM132_PORTABLE)])
def test_affine_plans_as_u4(device, caps):
    # Affine runs u4's kernels with a float offset in place of the zero point: same family,
    # geometry and K split for every shape; only the format in the kernel name differs.
    for M, K, N, g, dtype in [(1, 4096, 4096, 128, torch.float16), (16, 4096, 14336, 64, torch.bfloat16),
                              (64, 8192, 1024, 128, torch.float16), (1024, 4096, 4096, 128, torch.bfloat16),
                              (4096, 14336, 4096, 128, torch.float16), (40, 2048, 200, 32, torch.float32)]:
        u4 = torch_marlin.plan_gemm("u4", M, K, N, g, dtype=dtype, device=device, caps=caps)
        affine = torch_marlin.plan_gemm("affine", M, K, N, g, dtype=dtype, device=device, caps=caps)
        assert affine["format"] == "affine" and affine["kernel"] == u4["kernel"].replace("_u4", "_affine")
        # CUDA decode does not scale group sums for affine (plan_cuda.cpp plan_decode says why).
        differ = ("format", "kernel", "scale_group_sums", "launches")
        assert {k: v for k, v in affine.items() if k not in differ} == {k: v for k, v in u4.items() if k not in differ}
        assert [dict(ln, kernel=ln["kernel"].replace("_affine", "_u4")) for ln in affine["launches"]] == u4["launches"]
        assert not affine["scale_group_sums"]


def test_trellis_dequant_blas_plans_empty_activations():
    # M = 0 reaches the planner only from Python (the ops return empty results unplanned); the
    # dense-weight plan still takes one-row tiles rather than dividing by a zero tile height.
    lanes = torch_marlin.plan_trellis(0, 4096, 4096, 3, 128, torch.float32, device="cuda", caps=H100, layout="lanes")
    assert (lanes["family"], lanes["kernel"], lanes["tile_m"], lanes["m_tiles"]) == \
        ("dequant_blas", "dequant_trellis_lanes_float", 1, 1)
    tiles = torch_marlin.plan_trellis(0, 4096, 4096, 3, 128, device="cuda", caps=H100, family="dequant_blas")
    assert (tiles["kernel"], tiles["tile_m"], tiles["m_tiles"]) == ("dequant_trellis_half", 1, 1)
