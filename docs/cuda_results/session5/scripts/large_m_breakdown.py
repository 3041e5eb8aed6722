"""Session-5: where dequant_blas's time goes at M = 4096 (dequant alone, GEMM on dequantized vs random weights)."""
import statistics
import torch
import torch.nn.functional as F
import torch_marlin  # noqa: F401
from torch_marlin.formats import pack_int4
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def timer(fn, reps=7):
    for _ in range(2): fn()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_(); st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(st, en)) * 1e3
for K, N in [(28672, 8192), (4096, 12288), (4096, 4096)]:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    Wdq = torch.ops.marlin.dequant_fp4(B, s, 128)  # [K, N] fp16
    Wr = torch.randn(K, N, device="cuda", dtype=torch.float16) * Wdq.float().std().half()
    for M in (1024, 4096):
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        t_dq = timer(lambda: torch.ops.marlin.dequant_fp4(B, s, 128))
        t_mm_dq = timer(lambda: A @ Wdq)
        t_mm_r = timer(lambda: A @ Wr)
        t_lin = timer(lambda: F.linear(A, Wr.t().contiguous()) if False else A @ Wr)
        t_op = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128))
        print(f"{K}x{N} M={M}: dequant op {t_dq:.1f} us | A@W_dequantized {t_mm_dq:.1f} | A@W_random(same std) {t_mm_r:.1f} | gemm_fp4 {t_op:.1f} | op - mm_dq = {t_op - t_mm_dq:.1f}", flush=True)
