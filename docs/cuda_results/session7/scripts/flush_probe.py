"""Session 7: does the L2 flush itself cost the timed call? One call per flush kind, M = 1.

    python docs/cuda_results/session7/scripts/flush_probe.py [--ncu]

Times cuBLAS fp16 and gemm_fp4 after: no flush (L2 warm), a 256 MB memset (dirty lines), a 256 MB
read (clean lines), a memset followed by a read. With --ncu it runs each flush + one gemm_fp4 call
once, for `ncu --cache-control none` to count the GEMM kernel's DRAM bytes read and written.
"""
import os
import sys

import torch
import torch.nn.functional as F


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import memset_flush, read_flush, timed, weights  # noqa: E402

SHAPES = [(4096, 4096), (4096, 12288), (28672, 8192)]




def main():
    memset, read = memset_flush(), read_flush()
    flushes = {"none": lambda: None, "memset": memset, "read": read,
               "memset+read": lambda: (memset(), read())}
    if "--ncu" in sys.argv:
        K, N = 4096, 12288
        B, s, W16 = weights(K, N)
        A = torch.randn(1, K, device="cuda", dtype=torch.float16)
        for name in ("memset", "read"):
            for _ in range(2):
                flushes[name]()
                torch.ops.marlin.gemm_fp4(A, B, s, 128)
                torch.cuda.synchronize()
        return
    print(f"{'K x N':>12} {'flush':>12} {'cuBLAS us':>10} {'fp4 us':>8} {'ratio':>6}")
    for K, N in SHAPES:
        B, s, W16 = weights(K, N)
        A = torch.randn(1, K, device="cuda", dtype=torch.float16)
        for name, fl in flushes.items():
            tc = timed(lambda: F.linear(A, W16), fl, reps=21)
            tf = timed(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), fl, reps=21)
            print(f"{K:>5}x{N:<6} {name:>12} {tc:10.2f} {tf:8.2f} {tc / tf:6.2f}x", flush=True)
        del B, s, W16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
