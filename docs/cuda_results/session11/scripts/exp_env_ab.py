"""Session 11 experiments: one op timed with an experiment switch (an environment variable read by
the launcher, work in progress only) off and on, alternately, in one process. FP4 / INT4, fp16,
group 128, timed like bench_cuda.py (one call after the 256 MB flush, median of 11).

    python docs/cuda_results/session11/scripts/exp_env_ab.py VAR M,M,... [KxN,...|all] [fp4,u4]

Prints per row cuBLAS, the planner's kernel, off and on (us, ratio to cuBLAS) and the largest
difference between the two outputs (the switch must not change the result).
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
    var = sys.argv[1]
    ms = [int(v) for v in sys.argv[2].split(",")]
    shapes = SHAPES if len(sys.argv) <= 3 or sys.argv[3] == "all" else \
        [tuple(int(x) for x in v.split("x")) for v in sys.argv[3].split(",")]
    fmts = (sys.argv[4] if len(sys.argv) > 4 else "fp4").split(",")
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(shapes, ms):
        z = torch.randint(0, 16, (K // 128, N), dtype=torch.uint8, device="cuda")
        tc = timed(lambda: F.linear(A, W16), flush)
        for fmt in fmts:
            def op():
                if fmt == "fp4":
                    return torch.ops.marlin.gemm_fp4(A, B, s, 128)
                return torch.ops.marlin.gemm_u4(A, B, s, z, 128)
            plan = torch_marlin.plan_gemm(fmt, M, K, N, 128, dtype=torch.float16, device="cuda")
            res = {}
            for val in ("0", "1", "0", "1"):  # alternate, keep the later of each
                os.environ[var] = val
                out = op()
                res[val] = (timed(op, flush), out)
            os.environ.pop(var)
            (t0, o0), (t1, o1) = res["0"], res["1"]
            d = (o0.float() - o1.float()).abs().max().item()
            print(f"{fmt} K={K} N={N} M={M} [{plan['kernel']} tn={plan['tile_n']} kp={plan['k_parallel']}]: "
                  f"cublas {tc:.1f} | off {t0:.1f} ({tc / t0:.2f}x) | on {t1:.1f} ({tc / t1:.2f}x) | "
                  f"on/off {t1 / t0:.3f} | d={d:.2g}", flush=True)


if __name__ == "__main__":
    main()
