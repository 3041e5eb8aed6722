"""Session 8 experiment: wgmma_ws with the K-slice count forced (TM_EXP_KP, plan.cpp, work in
progress only), kernel time from torch.profiler (warm L2) and the benchmark's eager timing.

    python docs/cuda_results/session8/scripts/exp_kp.py [M,M,...] [KP,KP,...]
"""
import os
import sys

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_overhead import kernel_us, memset_flush, shape_rows, timed  # noqa: E402

SHAPES = [(4096, 4096), (10752, 4096), (4096, 21504)]


def main():
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "64").split(",")]
    kps = (sys.argv[2] if len(sys.argv) > 2 else "1,2,3,4").split(",")
    flush = memset_flush()
    os.environ["TM_EXP_FORCE"] = "ws"
    for K, N, M, A, B, s, W16 in shape_rows(SHAPES, ms):
        for kp in kps:
            os.environ["TM_EXP_KP"] = kp
            fn = lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128)  # noqa: E731
            eager = timed(fn, flush)
            ks = kernel_us(fn)
            print(f"K={K} N={N} M={M} kp={kp}: eager {eager:.1f} kernel {sum(ks.values()):.1f}", flush=True)


if __name__ == "__main__":
    main()
