"""Session 10 experiment: wgmma_ws with its K slices summed through global memory
(last_block_reduce) instead of a cluster, forced to k_parallel = 2..6 through the experiment
switches TM_EXP_WS_KP / TM_EXP_WS_NC (plan.cpp, work in progress only), against the planner's
choice. FP4, fp16, group 128, timed like bench_cuda.py (one call after the 256 MB flush, median of
11) in one process.

    python docs/cuda_results/session10/scripts/exp_ws_kp.py [M,M,...] [KxN,KxN,...] [kp|policy] [fp4|u4]

"kp" forces 2..6 slices (and 3 consumers); "policy" compares session 9's rule (TM_EXP_WS_OLD)
with the planner's, 3 consumers x 3 slices and 2 slices through global memory.
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
# name -> (TM_EXP_WS_KP, TM_EXP_WS_NC, TM_EXP_WS_OLD)
CONFIGS = {
    "kp": [("plan", None, None, None), ("kp2", "2", None, None), ("kp3", "3", None, None), ("kp4", "4", None, None),
           ("kp6", "6", None, None), ("nc3kp4", "4", "3", None), ("nc3kp6", "6", "3", None)],
    "policy": [("old", None, None, "1"), ("new", None, None, None), ("nc3kp3", "3", "3", None),
               ("kp2g", "2", None, None)],
}


def main():
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "32,64,128,256").split(",")]
    shapes = SHAPES if len(sys.argv) <= 2 or sys.argv[2] == "all" else \
        [tuple(int(x) for x in v.split("x")) for v in sys.argv[2].split(",")]
    configs = CONFIGS[sys.argv[3] if len(sys.argv) > 3 else "kp"]
    fmt = sys.argv[4] if len(sys.argv) > 4 else "fp4"
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(shapes, ms):
        z = torch.randint(0, 16, (K // 128, N), dtype=torch.uint8, device="cuda")

        def op():
            if fmt == "fp4":
                return torch.ops.marlin.gemm_fp4(A, B, s, 128)
            return torch.ops.marlin.gemm_u4(A, B, s, z, 128)
        tc = timed(lambda: F.linear(A, W16), flush)
        ref = None
        parts = [f"{fmt} K={K} N={N} M={M}: cublas {tc:.1f}"]
        for name, kp, nc, old in configs:
            for var, val in (("TM_EXP_WS_KP", kp), ("TM_EXP_WS_NC", nc), ("TM_EXP_WS_OLD", old)):
                os.environ.pop(var, None)
                if val is not None:
                    os.environ[var] = val
            plan = torch_marlin.plan_gemm(fmt, M, K, N, 128, dtype=torch.float16, device="cuda")
            if not plan["kernel"].startswith("wgmma_ws"):
                parts.append(f"{name}[{plan['kernel']}] -")
                continue
            out = op()
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            tf = timed(op, flush)
            parts.append(f"{name}[tn={plan['tile_n']} kp={plan['k_parallel']} {plan['reduce_kernel'] or '-'}"
                         f"{' tail' if plan.get('tail_n_tiles') else ''}] {tf:.1f} ({tc / tf:.2f}x, d={err:.2g})")
        for var in ("TM_EXP_WS_KP", "TM_EXP_WS_NC", "TM_EXP_WS_OLD"):
            os.environ.pop(var, None)
        print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
