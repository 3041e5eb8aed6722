"""Session 9 experiment: decode against wgmma_ws at 1..32 rows (FP4, fp16, group 128), both timed
like bench_cuda.py (one call after the 256 MB flush, median of 11) in one process. wgmma_ws is
forced below its policy threshold through the experiment switch TM_EXP_WS_MIN_M (plan.cpp, work
in progress only).

    python docs/cuda_results/session9/scripts/exp_ws_small_m.py [M,M,...]
"""
import os
import sys

import torch
import torch.nn.functional as F

import torch_marlin

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "session7", "scripts"))  # session 7's timing helper
from timing import memset_flush, shape_rows, timed  # noqa: E402

SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]


def main():
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8,16,17,24,32").split(",")]
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(SHAPES, ms):
        tc = timed(lambda: F.linear(A, W16), flush)
        parts = [f"K={K} N={N} M={M}: cublas {tc:.1f}"]
        for force, env in (("decode", None), ("ws", "0")):
            os.environ.pop("TM_EXP_WS_MIN_M", None)
            if env is not None:
                os.environ["TM_EXP_WS_MIN_M"] = env
            plan = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda")
            tf = timed(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), flush)
            parts.append(f"{force}[{plan['kernel'].split('_fp4')[0]} tm={plan['tile_m']} tn={plan['tile_n']} "
                         f"kp={plan['k_parallel']}] {tf:.1f} ({tc / tf:.2f}x)")
        os.environ.pop("TM_EXP_WS_MIN_M", None)
        print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
