"""Same-process A/B timing of decode-kernel variants picked at launch by an environment switch.

    python benchmarks/notes/decode-experiments/ab_switch.py VAR SHAPES MS VALUES
    python benchmarks/notes/decode-experiments/ab_switch.py TM_EXP_ABL 4096x28672,14336x4096 1 0,1,2,3,4,5

Only for a build with one of the patches beside this file applied: the tree's kernels read no such
variable. For each K x N it makes rotated copies of random FP4 weights (group size 128) totalling
about 400 MB, and for each M captures one CUDA graph per switch value (every copy called once,
back to back) plus one graph copying the same bytes device to device, as
scripts/dev/bench_cuda.py captures its graphs. It replays the graphs in
turn, 7 rounds of 10 replays, and prints the median time per call, each value's ratio to the
first, the largest difference of its outputs from the first value's, and the copy's time.
"""
import os
import statistics
import sys
import time

import torch

import torch_marlin  # noqa: F401  (registers torch.ops.marlin)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts", "dev"))
from bench_cuda import GS, capture_graph, fp4_bytes  # noqa: E402


def main():
    var = sys.argv[1]
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
    ms = [int(m) for m in sys.argv[3].split(",")]
    values = sys.argv[4].split(",")
    gemm = torch.ops.marlin.gemm_fp4.default
    for K, N in shapes:
        n = max(4, int(400e6 // (K * N // 2)))
        weights = [(torch.randint(-2**31, 2**31 - 1, (K // 8, N), device="cuda", dtype=torch.int32),
                    torch.rand(K // GS, N, device="cuda", dtype=torch.float16) * 0.01) for _ in range(n)]
        nbytes = fp4_bytes(K, N)
        copies = [torch.empty(2, nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(n)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            graphs, outs = {}, {}
            for v in values:
                os.environ[var] = v  # read by the patched launcher at every launch, so at capture
                graphs[v], outs[v] = capture_graph(lambda: [gemm(x, b, s, GS, None) for b, s in weights])
            graphs["copy"], _ = capture_graph(lambda: [c[1].copy_(c[0]) for c in copies])
            times = {v: [] for v in graphs}
            for _ in range(7):
                for v, graph in graphs.items():
                    graph.replay()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        graph.replay()
                    torch.cuda.synchronize()
                    times[v].append((time.perf_counter() - t0) / 10 / n * 1e6)
            base = statistics.median(times[values[0]])
            row = f"{K}x{N} M={M}: {values[0]} {base:.2f} us"
            for v in values[1:]:
                diff = max((outs[values[0]][i].float() - outs[v][i].float()).abs().max().item() for i in range(n))
                t = statistics.median(times[v])
                row += f" | {v} {t:.2f} ({t / base:.3f}, diff {diff:.2g})"
            t_copy = statistics.median(times["copy"])
            print(f"{row} | copy {t_copy:.2f} (tree/copy {base / t_copy:.2f})", flush=True)


if __name__ == "__main__":
    main()
