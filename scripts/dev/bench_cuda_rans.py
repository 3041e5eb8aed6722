"""CUDA benchmark of the rANS-coded GEMM (gemm_rans) against the uncoded FP4 / INT4 GEMMs and cuBLAS fp16.

    python scripts/dev/bench_cuda_rans.py [--reps 15] [--out DIR] [--shapes 4096x4096,...] [--ms 1,4,16]
                                          [--channels 0,1] [--no-graph] [--no-rotate]

The weights are Gaussian, quantized by the project's FP4 and asymmetric INT4 quantizers (group
size 128, plain absmax scales) and then rANS-coded by rans_encode, so the codes and their
compression are those of a real layer, not of uniform random nibbles. `--channels` lists the
channels per tile to code with (0: the format's default, ceil(32768 / K)); fewer channels per tile
mean more tiles, so more warps decode at once, at the price of more lane states.

Timing is scripts/dev/bench_cuda.py's, in one process: CUDA-graph replays (unless --no-graph) with
cold weights from rotating over copies totalling 4x the L2, calls back to back (unless
--no-rotate: then the L2 is flushed before each timed call). Every row also times the uncoded GEMM
of its format and cuBLAS fp16 on the same shape.

Reported per row: time (us); the coded layer's bytes (words, lane states, frequencies, offsets,
scales, zero points) and their rate over the time (GB/s); bits per weight of the codes; the ratio
t_uncoded / t_rans (> 1: the coded layer is faster) and t_cublas / t_rans.
"""
import argparse
import csv
import os

import torch
import torch.nn.functional as F

import torch_marlin  # noqa: F401  (registers torch.ops.marlin)
from bench_cuda import copies, copy_bandwidth, rotate_timer, timer
from torch_marlin.formats.fp4 import quantize_fp4
from torch_marlin.formats.u4 import quantize_u4

SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]
MS = [1, 4, 16]
GS = 128


def coded_layer(fmt, K, N, channels):
    """(uncoded args, coded args, coded bytes, uncoded bytes, code bits per weight) of one Gaussian layer."""
    w = torch.randn(K, N, device="cuda")
    if fmt == "fp4":
        B, s = quantize_fp4(w, GS, search=False)
        aux = None
    else:
        B, s, aux = quantize_u4(w, GS, search=False)
    words, offsets, states, freqs = torch.ops.marlin.rans_encode(B.cpu(), channels)
    C = channels if channels > 0 else -(-32 * 1024 // K)
    coded = [t.cuda() for t in (words, offsets, states, freqs)]
    side = s.numel() * s.element_size() + (aux.numel() if aux is not None else 0)
    code_bytes = sum(t.numel() * t.element_size() for t in coded)
    bits = 8 * code_bytes / (K * N)
    return (B, s, aux), (coded, s, aux, C), code_bytes + side, B.numel() * 4 + side, bits


def clone(layer):
    """A copy of a layer's tensors in fresh memory (cold weights for --rotate)."""
    (B, s, aux), (coded, s2, aux2, C), *rest = layer
    c = lambda t: t.clone() if t is not None else None  # noqa: E731
    return ((c(B), c(s), c(aux)), ([c(t) for t in coded], c(s2), c(aux2), C), *rest)


def rans_plan(M, K, N, fmt, C):
    """The planner's choice for the timed call."""
    return torch_marlin.plan_rans(M, K, N, GS, fmt, C, dtype=torch.float16, device="cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--formats", default="fp4,u4")
    ap.add_argument("--channels", default="0,1", help="channels per tile to code with (0: the format's default)")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-rotate", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    graph, rotate = not args.no_graph, not args.no_rotate

    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    l2 = dev.L2_cache_size
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, L2 {l2 >> 20} MB, torch {torch.__version__}")
    print(f"# measured copy bandwidth (read+write): {bw:.0f} GB/s; "
          f"{'CUDA graphs' if graph else 'eager'}, {'rotated cold weights' if rotate else 'L2 flushed'}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []

    def timed(calls):
        return rotate_timer(calls, args.reps, graph) if rotate else timer(calls[0], args.reps, flush, graph)

    for K, N in shapes:
        W16 = copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), K * N * 2, l2) if rotate else \
            [torch.randn(N, K, device="cuda", dtype=torch.float16)]
        for fmt in args.formats.split(","):
            for channels in (int(c) for c in args.channels.split(",")):
                torch.manual_seed(0)
                layer = coded_layer(fmt, K, N, channels)
                n_copies = max(2, -(-4 * l2 // layer[2])) if rotate else 1
                layers = [layer] + [clone(layer) for _ in range(n_copies - 1)]
                _, _, coded_bytes, plain_bytes, bits = layer
                C = layer[1][3]
                for M in ms:
                    A = torch.randn(M, K, device="cuda", dtype=torch.float16)

                    def rans_call(lay):
                        (words, offsets, states, freqs), s, aux, _ = lay[1]
                        return lambda: torch.ops.marlin.gemm_rans(A, words, offsets, states, freqs, s,
                                                                  aux if fmt == "u4" else None, None, fmt, K, N, GS,
                                                                  C)

                    def plain_call(lay):
                        B, s, aux = lay[0]
                        if fmt == "fp4":
                            return lambda: torch.ops.marlin.gemm_fp4(A, B, s, GS)
                        return lambda: torch.ops.marlin.gemm_u4(A, B, s, aux, GS)

                    # Correctness of what is timed: the coded GEMM equals the uncoded one up to fp32 sum order.
                    ref, out = plain_call(layer)(), rans_call(layer)()
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
                    t_rans = timed([rans_call(lay) for lay in layers])
                    t_plain = timed([plain_call(lay) for lay in layers])
                    t_cublas = timed([lambda w=w: F.linear(A, w) for w in W16])
                    plan = rans_plan(M, K, N, fmt, C)
                    row = dict(K=K, N=N, M=M, format=fmt, channels_per_tile=C, code_bits_per_weight=round(bits, 3),
                               rans_us=round(t_rans, 2), plain_us=round(t_plain, 2), cublas_us=round(t_cublas, 2),
                               rans_GBps=round(coded_bytes / (t_rans * 1e-6) / 1e9, 1),
                               plain_GBps=round(plain_bytes / (t_plain * 1e-6) / 1e9, 1),
                               plain_over_rans=round(t_plain / t_rans, 3), cublas_over_rans=round(t_cublas / t_rans, 3),
                               max_rel_diff=f"{err:.1e}", plan=plan.get("kernel", ""))
                    rows.append(row)
                    print(f"K={K:6d} N={N:6d} M={M:3d} {fmt:3s} C={C:3d} {bits:.3f} b/w | rans {t_rans:8.1f} us "
                          f"({row['rans_GBps']:7.1f} GB/s) | {fmt} {t_plain:8.1f} us ({row['plain_GBps']:7.1f} GB/s) "
                          f"| cublas {t_cublas:8.1f} us | {fmt}/rans {t_plain / t_rans:5.2f}x "
                          f"cublas/rans {t_cublas / t_rans:5.2f}x | diff {err:.1e}", flush=True)
                del layers, layer
                torch.cuda.empty_cache()
        del W16

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cuda_rans.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    md = [f"GPU: {dev.name} ({dev.multi_processor_count} SMs), torch {torch.__version__}; copy bandwidth {bw:.0f} "
          f"GB/s; median of {args.reps}, {'CUDA-graph replays' if graph else 'eager'}, "
          f"{'weights rotated over copies of >= 4x L2' if rotate else 'L2 flushed'}.", "",
          "| K x N | M | format | C | code bits/w | gemm_rans us (GB/s) | uncoded us (GB/s) | uncoded / rans "
          "| cuBLAS fp16 us | cuBLAS / rans |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['format']} | {r['channels_per_tile']} | "
                  f"{r['code_bits_per_weight']} | {r['rans_us']} ({r['rans_GBps']}) | {r['plain_us']} "
                  f"({r['plain_GBps']}) | {r['plain_over_rans']}x | {r['cublas_us']} | {r['cublas_over_rans']}x |")
    with open(os.path.join(args.out, "bench_cuda_rans.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
