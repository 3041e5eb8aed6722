"""Runs each CUDA kernel of the FP4/INT4 family once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/dev/cuda_sanitize_subset.py
    compute-sanitizer --tool racecheck python scripts/dev/cuda_sanitize_subset.py --no-blas

Covers: decode with 1/2/4/8 n8 tiles and two 64-row tiles, folded and per-weight scales, a partial last K chunk
(K-parallel and not, fp16/bf16, fp4/u4), dequant_blas (padded N, N % 8 != 0; racecheck skips
these: our dequant kernel uses no shared memory and cuBLAS's kernels are not ours), the in-kernel K-slice reduction, the wgmma kernel on sm_90a (128 x 256, 128 x 128 and 256 x 128 tiles,
padded N, rows past M, 2 and 4 K slices through a cluster), the wgmma_ws kernel (64-, 128- and
256-row tiles, 2 and 3 consumer warpgroups, 2 and 3 K slices through a cluster, 3 and 4 through
global memory, a tail launch), the fp32 simt kernel and the dequant kernel
(16-byte row stores and the scalar tail). Also
checks each result against the fp32 reference so a silent wrong answer fails the run. Every u4 case
runs again as affine (same kernels and plans, float offsets instead of zero points).
"""
import sys

import torch

import torch_marlin
from torch_marlin.formats import dequant_fp4_reference, dequant_u4_reference, quantize_fp4, quantize_u4
from torch_marlin.formats import dequant_affine_reference, quantize_affine

torch.manual_seed(0)
CASES = [  # fmt, M, K, N, group_size, dtype
    ("fp4", 3, 4096, 96, 128, torch.float16),     # decode (1 n8 tile, folded scales), K-parallel
    ("u4", 16, 288, 200, 32, torch.bfloat16),     # decode (2 tiles, folded), one slice, padded N
    ("fp4", 40, 2048, 136, 32, torch.bfloat16),   # decode with 8 n8 tiles, K-parallel
    ("u4", 24, 512, 96, 128, torch.float16),      # decode with 4 n8 tiles
    ("u4", 100, 2048, 136, 32, torch.bfloat16),   # decode, two 64-row tiles, K-parallel
    ("fp4", 200, 4096, 1800, 16, torch.float16),    # dequant_blas, padded N
    ("u4", 130, 288, 203, 32, torch.bfloat16),      # dequant_blas, one panel, N % 8 != 0
    ("fp4", 5, 1536, 72, 96, torch.float16),      # decode, folded scales, 3 chunks per group
    ("u4", 12, 1536, 72, 16, torch.bfloat16),     # decode, per-weight scales, 2 n8 tiles
    ("fp4", 9, 2072, 200, 56, torch.float16),     # decode, per-weight scales, partial last chunk, K-parallel
    ("u4", 5, 256, 72, 64, torch.float32),        # simt
    ("fp4", 70, 256, 8200, 32, torch.float16),    # wgmma (sm_90a, group_size % 64 != 0): 128 x 256 tile, padded N
    ("u4", 300, 128, 8192, 32, torch.bfloat16),   # wgmma: two 256-row tiles, rows past M
    ("fp4", 100, 2048, 8192, 32, torch.bfloat16),   # wgmma: 2 K slices summed through a cluster
    ("u4", 160, 8192, 1000, 32, torch.float16),     # wgmma: 256-row tile, 4 K slices in a cluster, padded N
    ("fp4", 96, 8192, 2000, 32, torch.bfloat16),    # wgmma: 128 x 256 tiles, 4 K slices in a cluster
    ("fp4", 33, 256, 8200, 64, torch.float16),      # wgmma_ws (sm_90a): 64-row tile, padded N
    ("u4", 64, 4096, 4096, 128, torch.bfloat16),    # wgmma_ws: 4 K slices through global memory
    ("fp4", 40, 8192, 201, 128, torch.float16),     # wgmma_ws: 4 global K slices, 2 tiles, odd N, rows past M
    ("u4", 50, 6144, 7000, 128, torch.bfloat16),    # wgmma_ws: 3 consumers x 3 global K slices, padded N
    ("fp4", 100, 1024, 12288, 128, torch.float16),  # wgmma_ws: 3 consumer warpgroups, 2 K slices
    ("u4", 300, 512, 1000, 128, torch.float16),     # wgmma_ws: two 256-row tiles, rows past M, padded N
    ("fp4", 129, 8192, 1000, 256, torch.bfloat16),  # wgmma_ws: 256-row tile, 3 K slices in a cluster
    ("u4", 300, 2048, 8520, 128, torch.bfloat16),   # wgmma_ws: a tail launch (1 column tile x 3 K slices), padded N
]
CASES += [("affine",) + c[1:] for c in CASES if c[0] == "u4"]
worst = 0.0
skip_blas = "--no-blas" in sys.argv[1:]
for fmt, M, K, N, gs, dt in CASES:
    plan = torch_marlin.plan_gemm(fmt, M, K, N, gs, dtype=dt, device="cuda", has_bias=True)
    if skip_blas and plan["family"] == "dequant_blas":
        continue
    w = torch.randn(K, N)
    if fmt == "fp4":
        B, s = quantize_fp4(w, gs, scale_dtype=dt)
        B, s, z = B.cuda(), s.cuda(), None
        W = dequant_fp4_reference(B, s, gs)
    elif fmt == "affine":  # z: the offsets
        B, s, z = quantize_affine(w, gs, scale_dtype=dt)
        B, s, z = B.cuda(), s.cuda(), z.cuda()
        W = dequant_affine_reference(B, s, z, gs)
    else:
        B, s, z = quantize_u4(w, gs, scale_dtype=dt)
        B, s, z = B.cuda(), s.cuda(), z.cuda()
        W = dequant_u4_reference(B, s, z, gs)
    A = torch.randn(M, K, device="cuda").to(dt)
    bias = torch.randn(N, device="cuda").to(dt)
    gemm, dequant = getattr(torch.ops.marlin, f"gemm_{fmt}"), getattr(torch.ops.marlin, f"dequant_{fmt}")
    operands = (B, s) if fmt == "fp4" else (B, s, z)
    C = gemm(A, *operands, gs, bias)
    ref = A.float() @ W + bias.float()
    err = ((C.float() - ref).abs().max() / ref.abs().max()).item()
    worst = max(worst, err)
    print(f"{plan['kernel']:>22} k_parallel={plan['k_parallel']} M={M} K={K} N={N}: rel err {err:.2e}")
    Wk = dequant(*operands, gs)
    assert torch.equal(Wk, W.to(dt)), "dequant mismatch"
torch.cuda.synchronize()
assert worst < 4e-2, worst
print("sanitize subset OK")
