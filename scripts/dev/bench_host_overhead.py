#!/usr/bin/env python
"""Host overhead of one quantized-layer call against ``F.linear``, on shapes so small that the
kernel time is negligible: what a decode step pays per layer beyond the weight reads.

  python scripts/dev/bench_host_overhead.py            # CPU, fp32, 64 x 64, M = 1
  python scripts/dev/bench_host_overhead.py --device cuda --dtype float16

Prints microseconds per call and the ratio to ``F.linear`` for the raw op and the module, both
measured in this process (the fastest of --repeats timings of --calls calls each).
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

if not os.environ.get("TORCH_MARLIN_FROM_PATH"):  # else: the torch_marlin on PYTHONPATH (another build)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_marlin import MarlinLinear  # noqa: E402


def per_call_us(fn, device, calls, repeats):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(calls // 10 + 1):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)  # the least disturbed repeat: other processes only ever add time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--features", type=int, default=64, help="in = out features")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: no thread start-up in the timings)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    n = args.features
    lin = torch.nn.Linear(n, n, bias=True, device=dev, dtype=dtype)
    x = torch.randn(args.rows, n, device=dev, dtype=dtype)
    rows = []
    with torch.inference_mode():
        base = per_call_us(lambda: F.linear(x, lin.weight, lin.bias), dev, args.calls, args.repeats)
        rows.append(("F.linear", base))
        for fmt in ("fp4", "u4"):
            m = MarlinLinear.from_linear(lin, format=fmt, group_size=32, dtype=dtype)
            if fmt == "fp4":
                def op(m=m):
                    return torch.ops.marlin.gemm_fp4(x, m.B_packed, m.scales, m.group_size, m.bias)
            else:
                def op(m=m):
                    return torch.ops.marlin.gemm_u4(x, m.B_packed, m.scales, m.zeros, m.group_size, m.bias)
            rows.append((f"torch.ops.marlin.gemm_{fmt}", per_call_us(op, dev, args.calls, args.repeats)))
            rows.append((f"MarlinLinear({fmt})", per_call_us(lambda: m(x), dev, args.calls, args.repeats)))
    print(f"{args.device} {args.dtype}, [{args.rows}, {n}] x [{n}, {n}], torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'call':<28} {'us/call':>9} {'vs F.linear':>12}")
    for name, us in rows:
        print(f"{name:<28} {us:9.2f} {us / base:11.2f}x")


if __name__ == "__main__":
    main()
