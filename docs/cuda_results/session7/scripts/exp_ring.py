"""Session 7 experiment: gemm_fp4 (whatever the build's planner picks) vs cuBLAS fp16, the issue
shapes, M given on the command line. Timing as scripts/bench_cuda.py (memset flush, median of 11).

    python docs/cuda_results/session7/scripts/exp_ring.py TAG [M,M,...]
"""
import os
import sys

import torch
import torch.nn.functional as F

import torch_marlin

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import memset_flush, shape_rows, timed  # noqa: E402

SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]




def main():
    tag = sys.argv[1]
    ms = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "64,96,128,256,512,1024").split(",")]
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(SHAPES, ms):
        tc = timed(lambda: F.linear(A, W16), flush)
        tf = timed(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), flush)
        plan = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda")
        # dequant + cuBLAS by hand (what the dequant_blas plan does), for the band's edge.
        td = timed(lambda: A @ torch.ops.marlin.dequant_fp4(B, s, 128), flush) if os.environ.get("DEQ") else float("nan")
        print(f"{tag} K={K} N={N} M={M}: cublas {tc:.1f} | fp4 {tf:.1f} ({tc / tf:.2f}x) | "
              f"{plan['kernel']} tm={plan['tile_m']} kp={plan['k_parallel']} | dequant+mm {td:.1f} ({tc / td:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
