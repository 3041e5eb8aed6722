"""Session 8 experiment: where the time of one gemm_fp4 call goes, per kernel choice
(TM_EXP_FORCE): the benchmark's eager timing (events around one call after the flush), the same
call replayed from a CUDA graph (no host work between the events), and the GPU kernels' own
durations from torch.profiler (mean per call).

    python docs/cuda_results/session8/scripts/exp_overhead.py [M,M,...] [FORCE,FORCE,...]
"""
import os
import sys

import torch


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "session7", "scripts"))  # session 7's timing helper
from timing import memset_flush, shape_rows, timed  # noqa: E402

SHAPES = [(4096, 4096), (10752, 4096), (4096, 12288), (28672, 8192)]


def kernel_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    names = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name[:40]] = names.get(e.name[:40], 0.0) + e.device_time / reps
    return names


def main():
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "16,64").split(",")]
    forces = (sys.argv[2] if len(sys.argv) > 2 else "decode,ws").split(",")
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(SHAPES, ms):
        for force in forces:
            os.environ["TM_EXP_FORCE"] = force
            fn = lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128)  # noqa: E731
            try:
                eager = timed(fn, flush)
                fn()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                graph = timed(g.replay, flush)
                ks = kernel_us(fn)
                print(f"K={K} N={N} M={M} {force}: eager {eager:.1f} graph {graph:.1f} kernels "
                      + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()), flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"K={K} N={N} M={M} {force}: ERR {str(e)[:100]}", flush=True)
    os.environ.pop("TM_EXP_FORCE", None)


if __name__ == "__main__":
    main()
