"""Session-5 experiment: dequant_blas workspace [K,N] vs transposed [N,K]; cuBLAS NN vs TN."""
import os, statistics
import torch
import torch.nn.functional as F
import torch_marlin  # noqa: F401
from torch_marlin.formats import pack_int4

ms = [int(v) for v in os.environ.get("MS", "256,1024,4096").split(",")]
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

print("shape M | cuBLAS TN (F.linear) | cuBLAS NN (A @ W_kn) | fp4 dq[K,N] | fp4 dq^T | u4 dq[K,N] | u4 dq^T | bf16 fp4 dq^T")
for K, N in shapes:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    z = torch.randint(0, 16, (K // 128, N), device="cuda", dtype=torch.uint8)
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    Wkn = W.t().contiguous()
    for M in ms:
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        Ab = A.bfloat16(); sb = s.bfloat16()
        tc = timer(lambda: F.linear(A, W)); tnn = timer(lambda: A @ Wkn)
        res = []
        outs = {}
        for tr in (0, 1):
            os.environ["TORCH_MARLIN_DQ_T"] = str(tr)
            outs[tr] = (torch.ops.marlin.gemm_fp4(A, B, s, 128), torch.ops.marlin.gemm_u4(A, B, s, z, 128),
                        torch.ops.marlin.gemm_fp4(Ab, B, sb, 128))
            t4 = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
            tu = timer(lambda: torch.ops.marlin.gemm_u4(A, B, s, z, 128))
            res.append((t4, tu))
        os.environ["TORCH_MARLIN_DQ_T"] = "1"
        tb = timer(lambda: torch.ops.marlin.gemm_fp4(Ab, B, sb, 128))
        os.environ["TORCH_MARLIN_DQ_T"] = "0"
        err = max(((outs[0][i].float() - outs[1][i].float()).abs().max() / outs[0][i].float().abs().max()).item() for i in range(3))
        print(f"{K}x{N} M={M:4d} | {tc:8.1f} | {tnn:8.1f} ({tc/tnn:4.2f}x) | {res[0][0]:8.1f} ({tc/res[0][0]:4.2f}x) | "
              f"{res[1][0]:8.1f} ({tc/res[1][0]:4.2f}x) | {res[0][1]:8.1f} ({tc/res[0][1]:4.2f}x) | {res[1][1]:8.1f} ({tc/res[1][1]:4.2f}x)"
              f" | {tb:8.1f} | rel.diff {err:.1e}", flush=True)
    del B, s, z, W, Wkn
    torch.cuda.empty_cache()
