"""Session-5: decode K slices (TORCH_MARLIN_KP) vs the planner's choice; waves = blocks / resident slots."""
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
kps = [0, 1, 2, 3, 4, 6, 8]
print("shape M cublas | " + " ".join(f"kp={k or 'plan'}" for k in kps))
SH = os.environ.get("SHAPES")
for K, N in ([tuple(map(int, x.split("x"))) for x in SH.split(",")] if SH else [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]):
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    for M in [int(v) for v in os.environ.get("MS", "1,16,32,64").split(",")]:
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        tc = timer(lambda: F.linear(A, W))
        cells = []
        ref = torch.ops.marlin.gemm_fp4(A, B, s, 128).float()
        for kp in kps:
            os.environ["TORCH_MARLIN_KP"] = str(kp)
            pl = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda")
            out = torch.ops.marlin.gemm_fp4(A, B, s, 128).float()
            ok = ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2
            t = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
            cells.append(f"{t:6.1f}({tc/t:4.2f}x,kp{pl['k_parallel']},{pl['grid'][1]*pl['grid'][2]}b){'' if ok else '!'}")
        os.environ["TORCH_MARLIN_KP"] = "0"
        print(f"{K}x{N} M={M:2d} {tc:6.1f} | " + " ".join(cells), flush=True)
