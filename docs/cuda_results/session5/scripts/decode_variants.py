"""Session-5 experiment: decode variants (TORCH_MARLIN_DECODE_EXP) at M = 17..128, one process."""
import os, statistics, sys
import torch
import torch.nn.functional as F
import torch_marlin  # noqa: F401
from torch_marlin.formats import pack_int4

exps = [int(v) for v in os.environ.get("EXPS", "0,1,2").split(",")]
ms = [int(v) for v in os.environ.get("MS", "32,64,128").split(",")]
shapes = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

def timer(fn, reps=9):
    for _ in range(2): fn()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_(); st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(st, en)) * 1e3

print("K N M cublas | " + " | ".join(f"exp{e} fp4 u4" for e in exps))
for K, N in shapes:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    z = torch.randint(0, 16, (K // 128, N), device="cuda", dtype=torch.uint8)
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    for M in ms:
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        tc = timer(lambda: F.linear(A, W))
        cells = []
        ref = None
        for e in exps:
            os.environ["TORCH_MARLIN_DECODE_EXP"] = str(e)
            c4 = torch.ops.marlin.gemm_fp4(A, B, s, 128); cu = torch.ops.marlin.gemm_u4(A, B, s, z, 128)
            if ref is None: ref = (c4, cu)
            same = torch.equal(c4, ref[0]) and torch.equal(cu, ref[1])
            t4 = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
            tu = timer(lambda: torch.ops.marlin.gemm_u4(A, B, s, z, 128))
            cells.append(f"{t4:7.1f} {tc/t4:4.2f}x {tu:7.1f} {tc/tu:4.2f}x{'' if same else ' DIFF'}")
        os.environ["TORCH_MARLIN_DECODE_EXP"] = "0"
        print(f"{K}x{N} M={M:3d} cublas {tc:7.1f} | " + " | ".join(cells), flush=True)
