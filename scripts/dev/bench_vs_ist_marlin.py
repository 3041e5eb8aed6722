"""The project's INT4 / FP4 CUDA GEMMs against IST-DASLab Marlin (symmetric INT4, group 128) and
cuBLAS fp16, one process, CUDA-graph replays with cold weights (copies totalling 4x the L2, called
back to back: scripts/dev/bench_cuda.py --graph --rotate).

    python scripts/dev/bench_vs_ist_marlin.py [--shapes 4096x12288,...] [--ms 1,2,4,...] [--reps 15] [--out DIR]

IST-DASLab Marlin is not a dependency: build it from its repository
(https://github.com/IST-DASLab/marlin, `python setup.py build_ext --inplace`, torch's CUDA
toolchain) and put its directory on PYTHONPATH so `import marlin` works. Its kernel needs
K % 128 == 0 and N % 256 == 0; its weights here are random (timing only). Ratios are time ratios
(> 1: ours is faster). IST Marlin picks its thread tile itself above 16 rows (64 x 256); at 16
rows and fewer its own choice (128 x 128) hits an illegal instruction with group 128 when built
by CUDA 13 for sm_90 (its test suite, which uses no groups there, passes), so those rows run its
64 x 256 tile (`IST_SMALL_M_TILE`).
"""
import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import GS, SHAPES, copies, rotate_timer  # noqa: E402

from torch_marlin.formats import pack_int4  # noqa: E402

import marlin  # noqa: E402  (IST-DASLab Marlin, see the docstring)

MS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128]
IST_SMALL_M_TILE = (64, 256)  # thread_k, thread_n for M <= 16 (see the docstring)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"GPU: {torch.cuda.get_device_name(0)}, L2 {l2 >> 20} MiB", flush=True)
    rows = []
    for K, N in shapes:
        torch.manual_seed(0)
        groups = K // GS

        def ours_weights():
            return (pack_int4(torch.randint(0, 16, (K, N), device="cuda")),
                    (torch.rand(groups, N, device="cuda") * 0.02 + 0.001).half(),
                    torch.randint(0, 16, (groups, N), device="cuda", dtype=torch.uint8))

        def ist_weights():
            return (torch.randint(-2**31, 2**31 - 1, (K // 16, N * 16 // 8), device="cuda", dtype=torch.int32),
                    (torch.rand(groups, N, device="cuda") * 0.02 + 0.001).half())

        ours = copies(ours_weights, K * N // 2 + groups * N * 3, l2)
        ist = copies(ist_weights, K * N // 2 + groups * N * 2, l2)
        dense = copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), K * N * 2, l2)
        workspace = torch.zeros(N // 128 * 16, device="cuda", dtype=torch.int32)
        for M in ms:
            A = torch.randn(M, K, device="cuda", dtype=torch.float16)
            C = torch.empty(M, N, device="cuda", dtype=torch.float16)
            t_u4 = rotate_timer([lambda w=w: torch.ops.marlin.gemm_u4(A, w[0], w[1], w[2], GS) for w in ours],
                                args.reps, True)
            t_fp4 = rotate_timer([lambda w=w: torch.ops.marlin.gemm_fp4(A, w[0], w[1], GS) for w in ours],
                                 args.reps, True)
            tk, tn = IST_SMALL_M_TILE if M <= 16 else (-1, -1)
            t_ist = rotate_timer([lambda w=w: marlin.mul(A, w[0], C, w[1], workspace, tk, tn) for w in ist],
                                 args.reps, True)
            t_cublas = rotate_timer([lambda w=w: F.linear(A, w) for w in dense], args.reps, True)
            row = dict(K=K, N=N, M=M, ist_us=round(t_ist, 2), u4_us=round(t_u4, 2), fp4_us=round(t_fp4, 2),
                       cublas_us=round(t_cublas, 2), u4_vs_ist=round(t_ist / t_u4, 3),
                       fp4_vs_ist=round(t_ist / t_fp4, 3))
            rows.append(row)
            print(f"K={K:6d} N={N:6d} M={M:4d}  IST {t_ist:7.1f} us | u4 {t_u4:7.1f} ({t_ist / t_u4:4.2f}x) | "
                  f"fp4 {t_fp4:7.1f} ({t_ist / t_fp4:4.2f}x) | cuBLAS {t_cublas:7.1f}", flush=True)
        del ours, ist, dense
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_vs_ist_marlin.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main()
