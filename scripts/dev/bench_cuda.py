"""CUDA benchmark of the FP4 / INT4 GEMMs against cuBLAS fp16 and torch._weight_int4pack_mm.

    python scripts/dev/bench_cuda.py [--reps 15] [--out DIR] [--shapes 4096x4096,...] [--ms 1,16,...] [--graph]
                                 [--rotate] [--affine]
    python scripts/dev/bench_cuda.py --trellis [--reps 15] [--out DIR] [--shapes ...] [--ms 1,1024,4096] [--graph]
                                 [--rotate]

Timing: CUDA events around each call, the 50 MB L2 flushed (a 256 MB memset) before every timed
repetition, median of --reps repetitions after 3 warm-ups. With --graph every call (ours and the
baselines) is captured once in a CUDA graph and the replays are timed, which takes the host-side
launch overhead (dispatcher, planner, allocations) out of the numbers, as a serving engine would.
With --rotate the weights are cold because there are many of them, not because of a flush
(weights larger than L2; scripts/bench.py does the same on the CPU): every kernel gets
copies of its weights totalling at least 4x the L2, one repetition calls it once on each copy back
to back, and the time is that repetition's over the number of calls. This is how a model's layers
run (each layer's weights cold, the next launch queued behind the last), so the per-call costs a
single timed call pays alone (launch latency, the first DRAM requests' ramp, the tail) overlap
with the neighbouring calls. Shapes are K x N (the weight
[K, N] = nn.Linear(K, N)); activations are fp16 (bf16 for _weight_int4pack_mm, which only takes
bf16 on CUDA). FP4 and INT4 (gemm_u4, asymmetric, zero points) use group size 128. --affine adds
affine INT4 (gemm_affine: the same codes and scales with fp16 offsets) and its time over INT4's.

--trellis times gemm_trellis instead (bench_trellis.md / .csv): at every M, 2, 3 and 4 bits (group
128), the indices in the canonical tiles and in the CUDA lane layout (the one TrellisLinear keeps on
CUDA), against the project's FP4 GEMM (gemm_fp4, group 128) and cuBLAS fp16 on the same shape and
activations, as time ratios (> 1: trellis is faster), each timed as above (--rotate: every one on
its own copies); then moe_trellis (always after a flush) with 64 experts of
hidden 2048 x intermediate 1024, 8 active per token, at 1 token, against the time to read the
active experts' bytes (packed indices + scales + su/sv) at the measured copy bandwidth (< 1.5 is
the goal).

Reported per row: time (us), effective weight bandwidth (bytes of the stored weight: packed codes +
scales (+ zeros) for ours, fp16 for cuBLAS, over the time), that bandwidth as % of the measured
device-to-device copy bandwidth (bytes read + written), and speed-up over cuBLAS fp16
(t_cublas / t_ours; > 1 is faster).
"""
import argparse
import csv
import os
import statistics

import torch
import torch.nn.functional as F

import torch_marlin
from torch_marlin.formats import pack_int4
from torch_marlin.formats import trellis as tr

SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
GS = 128


def capture_graph(fn):
    """A CUDA graph of fn (and fn's result at capture), warmed on its capture stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm the per-stream state (K-slice counters) outside capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        out = fn()
    return g, out


def timer(fn, reps, flush, graph=False):
    """fn timed alone after a flush (flush None: no flush), median in us."""
    for _ in range(3):
        fn()
    if graph:
        fn = capture_graph(fn)[0].replay
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3  # us


def rotate_timer(fns, reps, graph):
    """Callables on distinct weight copies (--rotate), timed back to back without a flush: us a call."""
    def one_pass():
        for f in fns:
            f()
    return timer(one_pass, reps, None, graph) / len(fns)


def copies(make, nbytes, l2_bytes):
    """Enough copies of a weight (make() builds one of nbytes) to total at least 4x the L2."""
    return [make() for _ in range(max(2, -(-4 * l2_bytes // nbytes)))]


def weight_copies(make, nbytes, rotate):
    """The copies a kernel is timed on: enough to total 4x the L2 with --rotate, otherwise one."""
    return copies(make, nbytes, torch.cuda.get_device_properties(0).L2_cache_size) if rotate else [make()]


def fp4_bytes(K, N):
    """Bytes of one FP4 weight: packed codes and fp16 group scales (group GS)."""
    return (K // 8) * N * 4 + (K // GS) * N * 2


def copy_bandwidth():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        dst.copy_(src)
    e.record()
    torch.cuda.synchronize()
    return 2 * n * 10 / (s.elapsed_time(e) * 1e-3) / 1e9  # GB/s, read + write


def make_int4pack(K, N):
    """Random weights in torch's tinygemm layout (timing only; values do not matter)."""
    w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
    packed = torch._convert_weight_to_int4pack(w, 8)
    sz = torch.rand(K // GS, N, 2, device="cuda", dtype=torch.bfloat16)
    return packed, sz


def trellis_bytes(K, N, bits):
    """Bytes of one trellis matrix: packed indices, fp32 scales, su, sv and the grid."""
    tiles = ((K + tr.TILE - 1) // tr.TILE) * ((N + tr.TILE - 1) // tr.TILE)
    return tiles * tr.packed_bytes_per_tile(bits) + 4 * (tr.num_groups(K, GS) * N + K + N + (1 << bits))


def trellis_weights(K, N, bits, experts=None):
    """Random trellis tensors on the GPU (timing only)."""
    lead = () if experts is None else (experts,)
    g = tr.num_groups(K, GS)
    packed = torch.randint(0, 256, (*lead, (K + 15) // 16, (N + 15) // 16, 32 * bits), dtype=torch.uint8, device="cuda")
    scales = torch.rand(*lead, g, N, device="cuda") * 0.02 + 0.001
    grid = torch.randn(*lead, 1 << bits, device="cuda")
    su = torch.randn(*lead, K, device="cuda").sign()
    sv = torch.randn(*lead, N, device="cuda").sign()
    return packed, scales, grid, su, sv


def bench_trellis(args, shapes, ms, bw, flush):
    def timed(calls):  # one call per weight copy (a single copy without --rotate)
        if args.rotate:
            return rotate_timer(calls, args.reps, args.graph)
        return timer(calls[0], args.reps, flush, args.graph)

    rows = []
    for K, N in shapes:
        torch.manual_seed(0)
        Q = weight_copies(lambda: (pack_int4(torch.randint(0, 16, (K, N), device="cuda")),
                                   (torch.rand(K // GS, N, device="cuda") * 0.02 + 0.001).half()),
                          fp4_bytes(K, N), args.rotate)
        W16 = weight_copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), K * N * 2, args.rotate)
        tw, lanes, nbytes = {}, {}, {}
        for bits in (2, 3, 4):
            nbytes[bits] = trellis_bytes(K, N, bits)
            tw[bits] = weight_copies(lambda bits=bits: trellis_weights(K, N, bits), nbytes[bits], args.rotate)
            lanes[bits] = [(tr.tiles_to_lanes(w[0], K, N, bits),) + w[1:] for w in tw[bits]]
        for M in ms:
            A = torch.randn(M, K, device="cuda", dtype=torch.float16)
            t_cublas = timed([lambda w=w: F.linear(A, w) for w in W16])
            t_fp4 = timed([lambda q=q: torch.ops.marlin.gemm_fp4(A, q[0], q[1], GS) for q in Q])
            line = f"K={K:6d} N={N:6d} M={M:5d}  cublas {t_cublas:8.1f} us | fp4 {t_fp4:8.1f} us"
            for bits in (2, 3, 4):
                t = timed([lambda w=w, bits=bits: torch.ops.marlin.gemm_trellis(A, *w, K, N, bits, GS)
                           for w in tw[bits]])
                plan = torch_marlin.plan_trellis(M, K, N, bits, GS, torch.float16, device="cuda")
                t_l = timed([lambda w=w, bits=bits: torch.ops.marlin.gemm_trellis(A, *w, K, N, bits, GS)
                             for w in lanes[bits]])
                plan_l = torch_marlin.plan_trellis(M, K, N, bits, GS, torch.float16, device="cuda", layout="lanes")
                gbs = nbytes[bits] / (t_l * 1e-6) / 1e9
                rows.append(dict(K=K, N=N, M=M, bits=bits, us=round(t_l, 2), weight_GBps=round(gbs, 1),
                                 pct_copy_bw=round(100 * gbs / bw, 1), vs_fp4=round(t_fp4 / t_l, 3),
                                 vs_cublas=round(t_cublas / t_l, 3), tiles_us=round(t, 2), fp4_us=round(t_fp4, 2),
                                 cublas_us=round(t_cublas, 2), plan=f"{plan_l['kernel']} kp={plan_l['k_parallel']}",
                                 tiles_plan=plan["kernel"]))
                line += (f" | {bits}b lanes {t_l:7.1f} us ({t_fp4 / t_l:5.2f}x fp4, {t_cublas / t_l:5.2f}x cublas),"
                         f" tiles {t:7.1f}")
            print(line, flush=True)
        del Q, W16, tw, lanes
        torch.cuda.empty_cache()
    # MoE: 64 experts, 8 active, 1 token.
    H, I, E, top_k = 2048, 1024, 64, 8
    moe_rows = []
    for bits in (2, 3, 4):
        gate, up, down = trellis_weights(H, I, bits, E), trellis_weights(H, I, bits, E), trellis_weights(I, H, bits, E)
        x = torch.randn(1, H, device="cuda", dtype=torch.float16)
        ids = torch.randperm(E, device="cuda")[:top_k].view(1, top_k)
        probs = torch.softmax(torch.randn(1, top_k, device="cuda"), -1)
        t = timer(lambda: torch.ops.marlin.moe_trellis(x, *gate, *up, *down, ids, probs, I, bits, GS), args.reps,
                  flush, args.graph)
        active = top_k * (2 * trellis_bytes(H, I, bits) + trellis_bytes(I, H, bits))
        t_read = active / (bw * 1e9) * 1e6
        moe_rows.append((bits, t, t_read, active))
        print(f"moe_trellis E={E} top_k={top_k} H={H} I={I} bits={bits}: {t:8.1f} us, active weights "
              f"{active / 1e6:.1f} MB read at copy bandwidth {t_read:6.1f} us -> {t / t_read:5.2f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_trellis.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    md = ["| K x N | M | bits | lanes us | GB/s (% copy) | vs FP4 (time ratio) | vs cuBLAS fp16 | tiles us | plan |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    md += [f"| {r['K']}x{r['N']} | {r['M']} | {r['bits']} | {r['us']} | {r['weight_GBps']} ({r['pct_copy_bw']}%) | "
           f"{r['vs_fp4']}x | {r['vs_cublas']}x | {r['tiles_us']} | {r['plan']} |" for r in rows]
    md += ["", f"moe_trellis, {E} experts of {H}x{I}, top {top_k}, 1 token (fp16):", "",
           "| bits | us | active bytes (MB) | read time at copy bandwidth (us) | ratio |", "|---:|---:|---:|---:|---:|"]
    md += [f"| {b} | {t:.1f} | {a / 1e6:.1f} | {tr:.1f} | {t / tr:.2f} |" for b, t, tr, a in moe_rows]
    with open(os.path.join(args.out, "bench_trellis.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host overhead)")
    ap.add_argument("--rotate", action="store_true",
                    help="cold weights by rotating over copies totalling 4x L2, calls back to back (no flush)")
    ap.add_argument("--affine", action="store_true", help="also time gemm_affine, reported against gemm_u4")
    ap.add_argument("--trellis", action="store_true", help="time gemm_trellis / moe_trellis (see the docstring)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]

    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, L2 {dev.L2_cache_size >> 20} MB, torch {torch.__version__}")
    print(f"# measured copy bandwidth (read+write): {bw:.0f} GB/s")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if args.trellis:
        return bench_trellis(args, shapes, ms, bw, flush)
    rows = []
    for K, N in shapes:
        torch.manual_seed(0)
        bytes_fp4 = fp4_bytes(K, N)
        bytes_u4 = bytes_fp4 + (K // GS) * N
        bytes_affine = bytes_fp4 + (K // GS) * N * 2
        bytes_16 = K * N * 2

        def quantized():
            B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
            s16 = (torch.rand(K // GS, N, device="cuda") * 0.02 + 0.001).half()
            z = torch.randint(0, 16, (K // GS, N), device="cuda", dtype=torch.uint8)
            b16 = (torch.rand(K // GS, N, device="cuda") * -0.2).half()
            return B, s16, z, b16

        Q = weight_copies(quantized, bytes_fp4, args.rotate)
        C = weight_copies(lambda: torch.empty(2, bytes_fp4 // 2, dtype=torch.uint8, device="cuda"), bytes_fp4,
                          args.rotate)
        W16 = weight_copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), bytes_16, args.rotate)
        try:
            I4 = weight_copies(lambda: make_int4pack(K, N), bytes_u4, args.rotate)
        except Exception as exc:  # noqa: BLE001  (report, keep benchmarking the rest)
            print(f"# _weight_int4pack_mm unavailable: {exc}")
            I4 = None
        for M in ms:
            A = torch.randn(M, K, device="cuda", dtype=torch.float16)
            Ab = A.bfloat16()

            def timed(calls):  # one call per weight copy (a single copy without --rotate)
                if args.rotate:
                    return rotate_timer(calls, args.reps, args.graph)
                return timer(calls[0], args.reps, flush, args.graph)

            t_cublas = timed([lambda w=w: F.linear(A, w) for w in W16])
            t_fp4 = timed([lambda q=q: torch.ops.marlin.gemm_fp4(A, q[0], q[1], GS) for q in Q])
            t_copy = timed([lambda c=c: c[1].copy_(c[0]) for c in C])
            t_u4 = timed([lambda q=q: torch.ops.marlin.gemm_u4(A, q[0], q[1], q[2], GS) for q in Q])
            t_i4 = timed([lambda w=w: torch._weight_int4pack_mm(Ab, w[0], GS, w[1]) for w in I4]) if I4 else float("nan")
            t_affine = (timed([lambda q=q: torch.ops.marlin.gemm_affine(A, q[0], q[1], q[3], GS) for q in Q])
                        if args.affine else float("nan"))
            plan = torch_marlin.plan_gemm("fp4", M, K, N, GS, dtype=torch.float16, device="cuda")
            for name, t, nbytes in [("cublas_fp16", t_cublas, bytes_16), ("fp4", t_fp4, bytes_fp4),
                                    ("copy_fp4_bytes", t_copy, bytes_fp4),
                                    ("u4", t_u4, bytes_u4), ("int4pack_mm", t_i4, bytes_u4)] + \
                    ([("affine", t_affine, bytes_affine)] if args.affine else []):
                gbs = nbytes / (t * 1e-6) / 1e9
                rows.append(dict(K=K, N=N, M=M, kernel=name, us=round(t, 2), weight_GBps=round(gbs, 1),
                                 pct_copy_bw=round(100 * gbs / bw, 1), speedup_vs_cublas=round(t_cublas / t, 3),
                                 plan=f"{plan['kernel']} kp={plan['k_parallel']}" if name in ("fp4", "u4") else ""))
            affine = f" | affine {t_affine:9.1f} us ({t_affine / t_u4:5.2f}x u4's time)" if args.affine else ""
            print(f"K={K:6d} N={N:6d} M={M:5d}  cublas {t_cublas:9.1f} us | fp4 {t_fp4:9.1f} us "
                  f"({t_cublas / t_fp4:5.2f}x) | u4 {t_u4:9.1f} us ({t_cublas / t_u4:5.2f}x) | "
                  f"int4pack_mm {t_i4:9.1f} us ({t_cublas / t_i4:5.2f}x) | {plan['kernel']} kp={plan['k_parallel']}"
                  f"{affine}", flush=True)
        del Q, C, W16, I4
        torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_cuda.csv")
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    # Markdown: one row per (shape, M), ours vs the baselines.
    md = [f"GPU: {dev.name} ({dev.multi_processor_count} SMs), torch {torch.__version__}; "
          f"copy bandwidth {bw:.0f} GB/s (read+write); median of {args.reps}, "
          f"{'weights rotated over copies of >= 4x L2, back to back' if args.rotate else 'L2 flushed'}"
          f"{', CUDA-graph replays' if args.graph else ''}.", "",
          "| K x N | M | cuBLAS fp16 us | FP4 us | FP4 GB/s (% copy) | FP4 vs cuBLAS | INT4 us | INT4 GB/s (% copy) "
          "| INT4 vs cuBLAS | int4pack_mm us (vs cuBLAS) | copy of the FP4 bytes us (% copy) | FP4 / copy time |" + (" affine us | affine / INT4 time |" if args.affine else ""),
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.affine else "")]
    by = {(r["K"], r["N"], r["M"], r["kernel"]): r for r in rows}
    for K, N in shapes:
        for M in ms:
            c, a, u, i, cp = (by[(K, N, M, k)] for k in ("cublas_fp16", "fp4", "u4", "int4pack_mm", "copy_fp4_bytes"))
            md.append(f"| {K}x{N} | {M} | {c['us']} | {a['us']} | {a['weight_GBps']} ({a['pct_copy_bw']}%) | "
                      f"{a['speedup_vs_cublas']}x | {u['us']} | {u['weight_GBps']} ({u['pct_copy_bw']}%) | "
                      f"{u['speedup_vs_cublas']}x | {i['us']} ({i['speedup_vs_cublas']}x) | {cp['us']} ({cp['pct_copy_bw']}%) | "
                      f"{a['us'] / cp['us']:.2f} |" +
                      (f" {by[(K, N, M, 'affine')]['us']} | {by[(K, N, M, 'affine')]['us'] / u['us']:.3f} |"
                       if args.affine else ""))
    with open(os.path.join(args.out, "bench_cuda.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
