"""Benchmarks of the torch_marlin ops against dense F.linear (nn.Linear's layout) in the same process.

    python scripts/bench.py                      # CPU, Llama-7B shapes, M in {1, 16, 64, 256}
    python scripts/bench.py --device cuda        # on a GPU (CUDA-event timing)
    python scripts/bench.py --shapes 4096x4096 --m 1,16 --formats fp4
    python scripts/bench.py --formats trellis2,trellis3,trellis4 --m 1,64 --threads 2   # trellis on CPU
    python scripts/bench.py --rans --shapes 4096x4096 --m 1 --threads 1   # gemm_rans vs gemm_fp4 / gemm_u4

The full CUDA suite of docs/benchmarks.md (L2 flushed between repetitions, cuBLAS fp16 and
torch._weight_int4pack_mm baselines, % of measured copy bandwidth) is scripts/dev/bench_cuda.py.

For every (K x N, M, format) it prints the median time (the dense baseline and every format's call
interleaved, one call each per round, so a load change on a shared machine hits all alike), the effective weight bandwidth (bytes of
packed weights + scales (+ zero points) read once, divided by the time) and the speed ratio
against F.linear with dense weights of the activation dtype (> 1 means torch_marlin is faster).
On CPU a dense fp32 baseline is printed too, whatever the activation dtype.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import torch_marlin  # noqa: F401
from torch_marlin.formats import quantize_fp4, quantize_u4
from torch_marlin.selfcheck import chip_name

# q/k/v/o, gate/up, down, and q/k/v fused into one GEMM.
LLAMA7B_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288)]


def parse_shapes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def bench_interleaved(fns, device, reps, min_time=0.2, clock=time.perf_counter):
    """Median time in seconds of each fn in fns, timed in rounds of one call each (after one
    warm-up call each); at least `reps` rounds, more for fast calls until min_time has passed.
    CPU: `clock` is wall time, or time.process_time (CPU time of this process, all threads)."""
    for fn in fns:
        fn()
    sync(device)
    times = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < reps or (time.perf_counter() - start < min_time and len(times[0]) < 1000):
        for fn, ts in zip(fns, times):
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(begin.elapsed_time(end) / 1e3)
            else:
                t0 = clock()
                fn()
                sync(device)
                ts.append(clock() - t0)
    return [statistics.median(ts) for ts in times]


def bench(fn, device, reps, min_time=0.2):
    """Median wall time in seconds of fn() alone (see bench_interleaved)."""
    return bench_interleaved([fn], device, reps, min_time)[0]


def random_trellis(K, N, bits, group_size, experts=()):
    """Random trellis tensors (timing does not depend on the values; quantizing 45M weights would)."""
    from torch_marlin.formats import trellis as tfmt

    lead = tuple(experts)
    packed = torch.randint(0, 256, (*lead, (K + 15) // 16, (N + 15) // 16, 32 * bits), dtype=torch.uint8)
    return (packed, torch.rand(*lead, tfmt.num_groups(K, group_size), N) * 0.01, torch.randn(*lead, 1 << bits),
            torch.ones(*lead, K), torch.ones(*lead, N))


def trellis_case(bits, K, N, group_size, device):
    t = tuple(x.to(device) for x in random_trellis(K, N, bits, group_size))
    return (lambda A, *w: torch.ops.marlin.gemm_trellis(A, *w, K, N, bits, group_size)), t


def last_level_cache_bytes():
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 64 * 2**20


def rotating(op, weights, copies):
    """A -> op(A, *weights) cycling over `copies` copies of the weights, so that on CPU no call finds
    its weights in the last-level cache (as in real inference, where a model's layers stream from
    DRAM); copies = 1 times the hot-cache case."""
    sets = [weights] + [tuple(w.clone() for w in weights) for _ in range(copies - 1)]
    state = {"i": 0}

    def call(A):
        state["i"] = (state["i"] + 1) % len(sets)
        return op(A, *sets[state["i"]])

    return call


def bench_moe(args, device, dtype):
    """MoE rows: moe_trellis vs a dense torch MoE (per-expert index_select + matmuls) in the same dtype."""

    H, I, E = (int(v) for v in args.moe_shape.split("x"))
    top_k = args.moe_top_k
    print(f"\n# MoE hidden {H}, intermediate {I}, {E} experts, top_k {top_k}, group {args.group_size}")
    cols = ["format", "tokens", "marlin_us", "weight_GB/s", f"dense_{str(dtype)[6:]}_us", "speedup"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    Wg = (torch.randn(E, H, I) * 0.02).to(device=device, dtype=dtype)
    Wu = (torch.randn(E, H, I) * 0.02).to(device=device, dtype=dtype)
    Wd = (torch.randn(E, I, H) * 0.02).to(device=device, dtype=dtype)

    def dense(x, ids, p):
        y = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x.index_select(0, tok)
            h = F.silu(xe @ Wg[e]) * (xe @ Wu[e])
            y.index_add_(0, tok, (h @ Wd[e]) * p[tok, slot].unsqueeze(1).to(x.dtype))
        return y

    for bits in (2, 3, 4):
        g = tuple(x.to(device) for x in random_trellis(H, I, bits, args.group_size, (E,)))
        u = tuple(x.to(device) for x in random_trellis(H, I, bits, args.group_size, (E,)))
        d = tuple(x.to(device) for x in random_trellis(I, H, bits, args.group_size, (E,)))
        nbytes = sum(x.numel() * x.element_size() for x in g + u + d)
        for T in (int(t) for t in args.moe_tokens.split(",")):
            x = torch.randn(T, H, device=device).to(dtype)
            ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(device)
            p = torch.softmax(torch.randn(T, top_k, device=device), -1)
            # Weight bytes actually touched: only the experts that received tokens.
            used = ids.unique().numel()
            t = bench(lambda: torch.ops.marlin.moe_trellis(x, *g, *u, *d, ids, p, I, bits, args.group_size),
                      device, args.reps)
            t_dense = bench(lambda: dense(x, ids, p), device, args.reps)
            row = [f"trellis{bits}", T, f"{t * 1e6:.1f}", f"{nbytes * used / E / t / 1e9:.1f}", f"{t_dense * 1e6:.1f}",
                   f"{t_dense / t:.2f}x"]
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)


def quantized_case(fmt, K, N, group_size, dtype, device):
    """Returns (op(A, *weights) -> C, weights): the op and the tensors it reads."""
    if fmt.startswith("trellis"):  # trellis2 / trellis3 / trellis4: codebook bits
        return trellis_case(int(fmt[len("trellis"):]), K, N, group_size, device)
    w = torch.randn(K, N) * 0.02
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype, search=False)
        return (lambda A, B, s: torch.ops.marlin.gemm_fp4(A, B, s, group_size)), (B.to(device), s.to(device))
    B, s, z = quantize_u4(w, group_size, scale_dtype=dtype, search=False)
    return (lambda A, B, s, z: torch.ops.marlin.gemm_u4(A, B, s, z, group_size)), (B.to(device), s.to(device),
                                                                                      z.to(device))


def bench_rans(args, device, dtype, copies):
    """gemm_rans against the uncoded op of the same format (gemm_fp4, gemm_u4) on the same weights,
    interleaved. The codes come from quantizing Gaussian weights, so their entropy is a real layer's."""
    from torch_marlin.formats import rans

    print(f"\n# rANS-coded codes: gemm_rans vs the uncoded op, group {args.group_size}")
    cols = ["format", "K", "N", "M", "code_bits/weight", "rans_us", "uncoded_us", "rans/uncoded"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    gs = args.group_size
    for K, N in parse_shapes(args.shapes):
        for fmt in ("fp4", "u4"):
            uncoded, weights = quantized_case(fmt, K, N, gs, dtype, torch.device("cpu"))
            C = rans.default_channels_per_tile(K)
            words, offsets, states, freqs = torch.ops.marlin.rans_encode(weights[0], C)
            bits = rans.code_bits(words.numel(), states.shape[0]) / (K * N)
            coded = (words, offsets, states, freqs, weights[1], weights[2] if fmt == "u4" else None)
            coded = tuple(t.to(device) if t is not None else None for t in coded)
            weights = tuple(t.to(device) for t in weights)

            def rans_op(A, words, offsets, states, freqs, scales, zeros=None, fmt=fmt, C=C, K=K, N=N):
                return torch.ops.marlin.gemm_rans(A, words, offsets, states, freqs, scales, zeros, None, fmt, K, N,
                                                  gs, C)

            coded_fn = rotating(rans_op, tuple(t for t in coded if t is not None), copies(coded[:5]))
            uncoded_fn = rotating(uncoded, weights, copies(weights))
            for M in (int(m) for m in args.m.split(",")):
                A = torch.randn(M, K, device=device).to(dtype)
                t_rans, t_plain = bench_interleaved([lambda: coded_fn(A), lambda: uncoded_fn(A)], device, args.reps,
                                                    clock=time.process_time if args.cpu_time else time.perf_counter)
                row = [fmt, K, N, M, f"{bits:.3f}", f"{t_rans * 1e6:.1f}", f"{t_plain * 1e6:.1f}",
                       f"{t_rans / t_plain:.2f}x"]
                print("| " + " | ".join(str(c) for c in row) + " |", flush=True)


def nbytes_of(weights):
    return sum(w.numel() * w.element_size() for w in weights)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                    help="activation dtype (default: float32 on CPU, float16 elsewhere)")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in LLAMA7B_SHAPES), help="KxN,KxN,...")
    ap.add_argument("--m", default="1,16,64,256")
    ap.add_argument("--formats", default="fp4,u4,trellis2,trellis3,trellis4")
    ap.add_argument("--moe", action="store_true", help="also time moe_trellis (trellis bits 2/3/4)")
    ap.add_argument("--rans", action="store_true",
                    help="time gemm_rans against gemm_fp4 / gemm_u4 instead of the formats against F.linear")
    ap.add_argument("--moe-shape", default="2048x1408x8", help="hidden x intermediate x experts")
    ap.add_argument("--moe-tokens", default="1,16,64")
    ap.add_argument("--moe-top-k", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU: time by the process's CPU clock instead of wall time (steadier on a machine shared "
                         "with other busy processes; with --threads 1, as idle threads may spin)")
    ap.add_argument("--hot", action="store_true",
                    help="CPU: reuse one weight copy (L3-resident); default rotates copies totalling 2x the LLC")
    args = ap.parse_args()

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    torch.manual_seed(0)
    if device.type == "cpu":
        machine = f"{chip_name('cpu')}, {torch.get_num_threads()} threads"
    else:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"# torch {torch.__version__}, device {device} ({machine}), activations {dtype}, group {args.group_size}")
    cols = ["format", "K", "N", "M", "marlin_us", "weight_GB/s", f"dense_{str(dtype)[6:]}_us", "speedup"]
    fp32_baseline = device.type == "cpu" and dtype != torch.float32
    if fp32_baseline:
        cols += ["dense_float32_us", "speedup_vs_fp32"]
    cold_bytes = 0 if (args.hot or device.type != "cpu") else 2 * last_level_cache_bytes()
    print(f"# weights: {'hot (one copy)' if not cold_bytes else f'cold (copies rotating over {cold_bytes >> 20} MiB)'}"
          f"; {'process CPU time' if args.cpu_time else 'wall time'}, medians of interleaved calls")
    copies = lambda weights: max(1, min(64, -(-cold_bytes // nbytes_of(weights))))  # noqa: E731
    if args.rans:
        bench_rans(args, device, dtype, copies)
        return
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for K, N in parse_shapes(args.shapes):
        W = ((torch.randn(N, K) * 0.02).to(device=device, dtype=dtype),)  # nn.Linear.weight: [out, in]
        dense = rotating(F.linear, W, copies(W))
        dense32 = rotating(F.linear, (W[0].float(),), copies(W)) if fp32_baseline else None
        # Trellis kernels exist for CPU and MPS only.
        fmts = [f for f in args.formats.split(",") if device.type != "cuda" or not f.startswith("trellis")]
        kernels = {}
        for fmt in fmts:
            op, weights = quantized_case(fmt, K, N, args.group_size, dtype, device)
            kernels[fmt] = (rotating(op, weights, copies(weights)), nbytes_of(weights))
        for M in (int(m) for m in args.m.split(",")):
            A = torch.randn(M, K, device=device).to(dtype)
            fns = [lambda: dense(A)] + ([lambda: dense32(A.float())] if fp32_baseline else [])
            fns += [lambda fn=fn: fn(A) for fn, _ in kernels.values()]
            times = bench_interleaved(fns, device, args.reps,
                                      clock=time.process_time if args.cpu_time else time.perf_counter)
            t_dense = times[0]
            t_dense32 = times[1] if fp32_baseline else None
            for (fmt, (fn, nbytes)), t in zip(kernels.items(), times[len(times) - len(kernels):]):
                row = [fmt, K, N, M, f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.1f}", f"{t_dense * 1e6:.1f}",
                       f"{t_dense / t:.2f}x"]
                if fp32_baseline:
                    row += [f"{t_dense32 * 1e6:.1f}", f"{t_dense32 / t:.2f}x"]
                print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    if args.moe:
        bench_moe(args, device, dtype)


if __name__ == "__main__":
    main()
