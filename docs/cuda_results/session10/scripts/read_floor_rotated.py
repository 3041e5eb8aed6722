"""Session 10: the floor under the M <= 16 targets with cold weights by rotation (the timing of
`bench_cuda.py --graph --rotate`): copies of a weight totalling >= 4x the L2, one call per copy back
to back inside one CUDA graph, time per call. Times session 7's streaming-read kernel (best of
several grids) over (a) the FP4 weight's bytes (codes + group-128 scales) and (b) the fp16
weight's bytes, against cuBLAS fp16 and gemm_fp4 at M = 1 under the same timing.
t_cuBLAS / t_read(FP4 bytes) bounds the speed-up any FP4 kernel can show at M = 1 here.

    python docs/cuda_results/session10/scripts/read_floor_rotated.py
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "session7", "scripts"))
from bench_cuda import copies, rotate_timer  # noqa: E402
from read_floor import CPP, SRC, best_grid, shape_reads  # noqa: E402
from timing import weights  # noqa: E402

import torch_marlin  # noqa: E402,F401


def main():
    ext = load_inline("read_floor", CPP, cuda_sources=SRC, functions=["read_bytes", "empty"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    reps = 11
    print(f"{props.name}, {sms} SMs, L2 {l2 >> 20} MB; empty kernel x 64 in a graph: "
          f"{rotate_timer([ext.empty] * 64, reps, True):.2f} us a call")

    def read_time(nbytes):
        srcs = copies(lambda: torch.randint(0, 256, (nbytes // 16 * 16,), dtype=torch.uint8, device="cuda"), nbytes, l2)
        return best_grid(lambda bps, thr: rotate_timer([lambda s=s: ext.read_bytes(s, out, sms * bps, thr) for s in srcs],
                                                       reps, True))

    print(f"{'K x N':>12} {'FP4 MB':>7} {'read us (grid)':>16} {'TB/s':>5} {'fp16 MB':>8} {'read us':>8} {'TB/s':>5} "
          f"{'cuBLAS':>7} {'fp4':>7} {'cuBLAS/read4':>12} {'fp4/read4':>9} {'fp4 vs cuBLAS':>13}")
    for K, N, b4, b16, (r4, bps, thr), r16 in shape_reads(read_time):
        A = torch.randn(1, K, device="cuda", dtype=torch.float16)
        W16s = copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), b16, l2)
        tc = rotate_timer([lambda w=w: F.linear(A, w) for w in W16s], reps, True)
        del W16s
        packs = copies(lambda: weights(K, N)[:2], b4, l2)
        tf = rotate_timer([lambda b=b, s=s: torch.ops.marlin.gemm_fp4(A, b, s, 128) for b, s in packs], reps, True)
        del packs
        torch.cuda.empty_cache()
        print(f"{K:>5}x{N:<6} {b4 / 1e6:7.1f} {r4:8.2f} ({bps}x{thr:4d}) {b4 / r4 / 1e6:5.2f} {b16 / 1e6:8.1f} "
              f"{r16:8.2f} {b16 / r16 / 1e6:5.2f} {tc:7.2f} {tf:7.2f} {tc / r4:11.2f}x {tf / r4:8.2f}x "
              f"{tc / tf:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
