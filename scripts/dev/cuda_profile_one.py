"""Runs one gemm a few times (for ncu): python scripts/dev/cuda_profile_one.py fp4|u4 M K N [float16|bfloat16]"""
import sys

import torch

import torch_marlin  # noqa: F401
from torch_marlin.formats import pack_int4

fmt, M, K, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dt = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.float16
B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
s = (torch.rand(K // 128, N, device="cuda") * 0.02).to(dt)
z = torch.randint(0, 16, (K // 128, N), device="cuda", dtype=torch.uint8)
A = torch.randn(M, K, device="cuda", dtype=dt)
for _ in range(3):
    C = torch.ops.marlin.gemm_fp4(A, B, s, 128) if fmt == "fp4" else torch.ops.marlin.gemm_u4(A, B, s, z, 128)
torch.cuda.synchronize()
print(torch_marlin.plan_gemm(fmt, M, K, N, 128, dtype=dt, device="cuda"))
