"""Session 11 experiment: per-block timeline of one wgmma_ws launch (%globaltimer written by an
instrumented build, read back by the temporary op marlin::exp_timeline; work in progress only).
One call after the 256 MB flush, as bench_cuda.py times it.

    python docs/cuda_results/session11/scripts/exp_ws_timeline.py M KxN [fp4|u4] [reps]
"""
import sys

import torch

import torch_marlin
from torch_marlin.formats import pack_int4

M = int(sys.argv[1])
K, N = (int(x) for x in sys.argv[2].split("x"))
fmt = sys.argv[3] if len(sys.argv) > 3 else "fp4"
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
s = (torch.rand(K // 128, N, device="cuda") * 0.02).half()
z = torch.randint(0, 16, (K // 128, N), device="cuda", dtype=torch.uint8)
A = torch.randn(M, K, device="cuda", dtype=torch.float16)
plan = torch_marlin.plan_gemm(fmt, M, K, N, 128, dtype=torch.float16, device="cuda")
blocks = plan["grid"][0] * plan["grid"][1] * plan["grid"][2]
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def op():
    if fmt == "fp4":
        return torch.ops.marlin.gemm_fp4(A, B, s, 128)
    return torch.ops.marlin.gemm_u4(A, B, s, z, 128)


print(f"{fmt} M={M} K={K} N={N} {plan['kernel']} grid={plan['grid']} kp={plan['k_parallel']}")
for _ in range(3):
    op()
for r in range(reps):
    flush.zero_()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    op()
    e1.record()
    torch.cuda.synchronize()
    tl = torch.ops.marlin.exp_timeline()[:blocks]
    t0, t1 = tl[:, 0].double(), tl[:, 1].double()
    last = (tl[:, 2] >> 62) & 1
    t2 = (tl[:, 2] & ((1 << 62) - 1)).double()
    base = t0.min()
    t0, t1, t2 = (t0 - base) / 1e3, (t1 - base) / 1e3, (t2 - base) / 1e3
    loop = t1 - t0
    red = t2 - t1
    q = lambda x: f"{x.min():.2f}/{x.median():.2f}/{x.max():.2f}" if x.numel() else "-"  # noqa: E731
    print(f"rep {r}: event {e0.elapsed_time(e1) * 1e3:.1f} us, span {t2.max():.2f} us | start {q(t0)} | "
          f"main loop {q(loop)} | loop end {q(t1)} | non-last store+arrive {q(red[last == 0])} | "
          f"last reduce+store {q(red[last == 1])} | end {q(t2)}")
    if r == reps - 1:
        order = torch.argsort(t0)
        for i in order[:: max(1, blocks // 16)].tolist():
            print(f"   block {i:4d} sm {int(tl[i, 3]):3d} last {int(last[i])}: start {t0[i]:.2f} loop_end {t1[i]:.2f} "
                  f"end {t2[i]:.2f}")
