#!/usr/bin/env python3
"""Dynamic load report of the Metal kernels: every device-memory load they execute in the
Metal-on-CPU harness, on Llama-shaped problems (no Mac needed).

The harness's traced build (tests/metal_load_trace.py, csrc/metal_emu/load_trace.cpp) runs the
planner's kernels for each problem below and records each load of each Metal thread: load site,
address, width, attributed to the tensor it falls in. Per kernel (dispatch):

  loads/weight B    lane load instructions from all device buffers (the params struct excluded)
                    per distinct weight byte (B, or the trellis `packed` tensors)
  weight refetch    weight bytes fetched / distinct weight bytes, and the most fetches of one byte
  weight coalesced  over the weight loads' simdgroup-wide loads (the 32 lanes' n-th execution of
                    one load site): distinct bytes used / (64-byte segments touched x 64)
  other buffers     bytes fetched / distinct bytes read (the minimum: every byte once) per buffer

With --sites, per load site: source location (innermost inlined frame), buffer, width, lane loads
per weight byte, mean active lanes, coalescing.

Sampling: where a case says so, only every k-th threadgroup of a dispatch runs (at most the
number given), so ratios describe the sampled threadgroups: a byte fetched again only by a
threadgroup that did not run is not counted as refetched. "traced" shows sampled / total.
The harness runs the threads of a threadgroup one after another, not in SIMT lockstep; lanes are
grouped by the n-th execution of a load site, which is what lockstep execution would give.

  scripts/dev/metal_load_report.py                 all cases, markdown
  scripts/dev/metal_load_report.py --only decode   cases whose name contains "decode"
  scripts/dev/metal_load_report.py --sites --json

Needs clang++ (Debian: apt-get install -y clang); exit status 2 when tracing is unavailable.
Runtime: about 2-3 minutes on 2 cores, plus the traced builds the first time (~2 min).
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import metal_load_trace as lt  # noqa: E402

# (name, function, keyword arguments). max_threadgroups 0 = every threadgroup.
CASES = [
    ("decode fp4 M=1 4096x4096", lt.trace_quant_gemm, dict(fmt="fp4", M=1, K=4096, N=4096)),
    ("decode u4 M=1 4096x4096", lt.trace_quant_gemm, dict(fmt="u4", M=1, K=4096, N=4096)),
    ("decode fp4 M=1 4096x14336", lt.trace_quant_gemm, dict(fmt="fp4", M=1, K=4096, N=14336)),
    ("decode u4 M=1 4096x14336", lt.trace_quant_gemm, dict(fmt="u4", M=1, K=4096, N=14336)),
    ("decode fp4 M=16 4096x4096", lt.trace_quant_gemm, dict(fmt="fp4", M=16, K=4096, N=4096, max_threadgroups=16)),
    ("decode u4 M=16 4096x14336", lt.trace_quant_gemm, dict(fmt="u4", M=16, K=4096, N=14336, max_threadgroups=16)),
    ("prefill fp4 M=128 2048x2048", lt.trace_quant_gemm, dict(fmt="fp4", M=128, K=2048, N=2048, max_threadgroups=8)),
    ("prefill u4 M=128 2048x2048", lt.trace_quant_gemm, dict(fmt="u4", M=128, K=2048, N=2048, max_threadgroups=8)),
    ("trellis decode 3-bit M=1 4096x4096", lt.trace_trellis_gemm, dict(M=1, K=4096, N=4096)),
    ("trellis decode 3-bit M=16 4096x4096", lt.trace_trellis_gemm, dict(M=16, K=4096, N=4096, max_threadgroups=16)),
    ("trellis prefill 3-bit M=128 2048x2048", lt.trace_trellis_gemm, dict(M=128, K=2048, N=2048, max_threadgroups=8)),
    ("trellis moe decode T=1 2048/1024 E=8 top2", lt.trace_trellis_moe,
     dict(T=1, hidden=2048, intermediate=1024, experts=8, top_k=2)),
    ("trellis moe prefill T=128 2048/1024 E=8 top2", lt.trace_trellis_moe,
     dict(T=128, hidden=2048, intermediate=1024, experts=8, top_k=2, max_threadgroups=8)),
]


def fmt_ratio(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}"


def run(only=None):
    out = []
    for name, fn, kw in CASES:
        if only and only not in name:
            continue
        t = time.time()
        for rec in fn(**kw):
            s = lt.summarize(rec)
            s["case"] = name
            s["seconds"] = round(time.time() - t, 1)
            out.append(s)
    return out


def markdown(rows, sites=False):
    lines = ["| case | kernel | traced | loads/weight B | weight refetch (max) | weight coalesced | weight widths "
             "| other buffers: fetched / min |", "|" + "---|" * 8]
    for s in rows:
        others = ", ".join(f"{k} {v['refetch']:.3g}x" for k, v in sorted(s["buffers"].items()) if not lt.is_weight(k))
        widths = " ".join(f"{w}B" for w in s["weight_load_widths"]) or "-"
        refetch = "-" if s["weight_refetch"] is None else f"{s['weight_refetch']:.3g} ({s['weight_max_fetches']})"
        coal = "-" if s["weight_coalescing"] is None else f"{100 * s['weight_coalescing']:.0f} %"
        lines.append(f"| {s['case']} | {s['kernel']} | {s['traced']}/{s['threadgroups']} "
                     f"| {fmt_ratio(s['loads_per_weight_byte'])} | {refetch} | {coal} | {widths} | {others or '-'} |")
    if sites:
        for s in rows:
            lines += ["", f"**{s['case']}: {s['kernel']}**", "",
                      "| load site | buffer | width | loads/weight B | lanes | coalesced |", "|" + "---|" * 6]
            for x in s["sites"]:
                lines.append(f"| {x['where']} | {x['buffer']} | {'/'.join(map(str, x['widths']))} "
                             f"| {fmt_ratio(x['loads_per_weight_byte'])} | {x['lanes']:.3g} "
                             f"| {100 * x['coalescing']:.0f} % |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the cases whose name contains this text")
    ap.add_argument("--sites", action="store_true", help="also list every load site")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    a = ap.parse_args(argv)
    try:
        rows = run(a.only)
    except lt.TraceUnavailable as e:
        print(f"metal_load_report: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(markdown(rows, a.sites))
    return 0


if __name__ == "__main__":
    sys.exit(main())
