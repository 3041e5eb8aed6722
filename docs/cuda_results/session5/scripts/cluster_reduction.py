"""Session-5: K-slice reduction through a thread-block cluster (DSMEM) vs global memory, by K slices."""
import os, statistics
import torch
import torch.nn.functional as F
import torch_marlin
from torch_marlin.formats import pack_int4
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def timer(fn, reps=11):
    for _ in range(2): fn()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_(); st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(st, en)) * 1e3
kps = [0, 1, 2, 4, 8]
shapes = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192), (2048, 2048), (4096, 1024), (8192, 1024), (14336, 4096), (8192, 8192)]
print("shape M cublas | per kp (plan first): global-memory reduction / cluster reduction (x cuBLAS of the cluster one)")
for K, N in shapes:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    z = torch.randint(0, 16, (K // 128, N), device="cuda", dtype=torch.uint8)
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    for M in (1, 16, 32, 64):
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        tc = timer(lambda: F.linear(A, W))
        cells = []
        for kp in kps:
            os.environ["TORCH_MARLIN_KP"] = str(kp)
            pl = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda")
            os.environ["TORCH_MARLIN_NO_CLUSTER"] = "1"
            r4, ru = torch.ops.marlin.gemm_fp4(A, B, s, 128), torch.ops.marlin.gemm_u4(A, B, s, z, 128)
            tg = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
            os.environ["TORCH_MARLIN_NO_CLUSTER"] = "0"
            same = torch.equal(r4, torch.ops.marlin.gemm_fp4(A, B, s, 128)) and torch.equal(ru, torch.ops.marlin.gemm_u4(A, B, s, z, 128))
            tcl = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
            cells.append(f"kp{pl['k_parallel']}:{tg:6.1f}/{tcl:6.1f}({tc/tcl:4.2f}x){'' if same else ' DIFF'}")
        os.environ["TORCH_MARLIN_KP"] = "0"
        print(f"{K}x{N} M={M:2d} {tc:6.1f} | " + " ".join(cells), flush=True)
