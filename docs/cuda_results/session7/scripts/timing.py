"""Shared by the session-7 and session-8 experiment scripts: the random FP4 layer they time (and the shape x M rows over it), and one CUDA-event-timed call after an L2 flush, median
of `reps` after 3 warm-ups (the same timing as scripts/bench_cuda.py)."""
import statistics

import torch

from torch_marlin.formats import pack_int4


def weights(K, N):
    """An FP4 layer of random codes (group size 128) and the dense fp16 weight cuBLAS multiplies
    ([N, K], as F.linear takes it)."""
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    return B, s, torch.randn(N, K, device="cuda", dtype=torch.float16)


def shape_rows(shapes, ms):
    """(K, N, M, A, B, s, W16) over shapes x ms: weights(K, N) once per shape (freed after its rows)
    and fp16 activations A [M, K] per row."""
    for K, N in shapes:
        B, s, W16 = weights(K, N)
        for M in ms:
            yield K, N, M, torch.randn(M, K, device="cuda", dtype=torch.float16), B, s, W16
        del B, s, W16
        torch.cuda.empty_cache()


def memset_flush():
    """The benchmark's flush: write 256 MB (evicts the 50 MB L2)."""
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return buf.zero_


def read_flush():
    """Evict the L2 by reading 256 MB instead, leaving clean lines behind."""
    words = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    return words.amax


def timed(fn, flush, reps=11):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)  # us
