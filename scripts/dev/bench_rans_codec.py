"""Throughput of the C++ rANS coder (rans_encode, rans_decode) on one layer's codes.

    python scripts/dev/bench_rans_codec.py                       # 4096 x 4096, one thread
    python scripts/dev/bench_rans_codec.py --shape 11008x4096 --threads 2

The codes are those of quantizing Gaussian weights (FP4, group 128), so the entropy is a real
layer's. Prints the median CPU time of the process per call (all threads; on a machine shared with
other busy processes the wall time would measure the others too) and the codes (symbols) per
second, the code bits per
weight of the coded layer, and the numpy reference encoder's throughput on the same codes (one
call) as the baseline.
"""

import argparse
import statistics
import time

import torch

import torch_marlin  # noqa: F401  (registers torch.ops.marlin)
from torch_marlin.formats import quantize_fp4, rans, unpack_int4


def median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x4096", help="K x N")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    K, N = (int(v) for v in args.shape.split("x"))
    B, _ = quantize_fp4(torch.randn(K, N, generator=torch.Generator().manual_seed(0)), 128, search=False)
    C = rans.default_channels_per_tile(K)
    symbols = K * N
    words, offsets, states, freqs = torch.ops.marlin.rans_encode(B, C)
    print(f"# {K} x {N} FP4 codes, {args.threads} thread(s), channels_per_tile {C}: "
          f"{rans.code_bits(words.numel(), states.shape[0]) / symbols:.3f} code bits per weight "
          f"(order-0 entropy {rans.order0_entropy(unpack_int4(B).numpy()):.3f})")
    t_enc = median_time(lambda: torch.ops.marlin.rans_encode(B, C), args.reps)
    t_dec = median_time(lambda: torch.ops.marlin.rans_decode(words, offsets, states, freqs, K, N, C), args.reps)
    codes = unpack_int4(B).numpy()
    t0 = time.process_time()
    rans.encode(codes, C)
    t_ref = time.process_time() - t0
    print(f"rans_encode      {t_enc * 1e3:8.1f} ms  {symbols / t_enc / 1e6:8.1f} M symbols/s  "
          f"({t_ref / t_enc:.0f}x the numpy reference encoder, {symbols / t_ref / 1e6:.1f} M symbols/s)")
    print(f"rans_decode      {t_dec * 1e3:8.1f} ms  {symbols / t_dec / 1e6:8.1f} M symbols/s  (with the integrity check)")


if __name__ == "__main__":
    main()
