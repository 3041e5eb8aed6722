"""Runs every CUDA rANS kernel (gemm_rans fused and staged, rans_decode) on small shapes, for
compute-sanitizer, and checks each result against plain torch on the numpy reference decoder's codes:

    compute-sanitizer --tool memcheck  python scripts/dev/cuda_rans_subset.py
    compute-sanitizer --tool racecheck python scripts/dev/cuda_rans_subset.py

Covers the fused kernel's row counts 1, 2, 4, 8 and 16 (M = 1, 2, 3, 7, 16), fp16 / bf16 / fp32,
fp4 / u4 / affine, group sizes 32..256, one and several channels per tile with a partial last tile,
bias, a single-symbol layer (no words at all), the staged path (M = 17, 40), and corrupted inputs
the CUDA ops do not check (stream words, offsets past the end, unaligned and decreasing offsets,
frequencies that do not sum to 4096, states below L): those must run without a memory error.

    python scripts/dev/cuda_rans_subset.py --profile FMT M K N [C]

runs one gemm_rans a few times on a Gaussian layer instead (for ncu).
"""
import sys

import numpy as np
import torch

import torch_marlin  # noqa: F401
from torch_marlin.formats import (dequant_affine_reference, dequant_fp4_reference, dequant_u4_reference,
                                  pack_int4, quantize_affine, quantize_fp4, quantize_u4, rans, unpack_int4)


def layer(fmt, K, N, gs, dt, C, single=False):
    w = torch.randn(K, N)
    if fmt == "fp4":
        B, s = quantize_fp4(w, gs, scale_dtype=dt, search=False)
        aux, W = None, None
    elif fmt == "u4":
        B, s, aux = quantize_u4(w, gs, scale_dtype=dt, search=False)
    else:
        B, s, aux = quantize_affine(w, gs, scale_dtype=dt)
    if single:
        B = pack_int4(torch.full((K, N), 5, dtype=torch.uint8))
    codes = unpack_int4(B).numpy()
    e = rans.encode(codes, C)
    coded = [torch.from_numpy(np.ascontiguousarray(e[k])) for k in ("words", "word_offsets", "states", "freqs")]
    if fmt == "fp4":
        W = dequant_fp4_reference(B, s, gs)
    elif fmt == "u4":
        W = dequant_u4_reference(B, s, aux, gs)
    else:
        W = dequant_affine_reference(B, s, aux, gs)
    return B, s, aux, coded, W, e["channels_per_tile"]


def gemm(fmt, A, coded, s, aux, K, N, gs, C, bias=None):
    return torch.ops.marlin.gemm_rans(A, *coded, s, aux if fmt == "u4" else None, aux if fmt == "affine" else None,
                                      fmt, K, N, gs, C, bias)


def profile(fmt, M, K, N, C=0):
    B, s, aux, coded, _, C = layer(fmt, K, N, 128, torch.float16, C or None)
    cuda = [t.cuda() for t in coded]
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    for _ in range(3):
        gemm(fmt, A, cuda, s.cuda(), aux.cuda() if aux is not None else None, K, N, 128, C)
    torch.cuda.synchronize()
    print(torch_marlin.plan_rans(M, K, N, 128, fmt, C, device="cuda"))


CASES = [  # fmt, M, K, N, group_size, dtype, channels per tile (None: default)
    ("fp4", 1, 512, 37, 128, torch.float16, 5),
    ("u4", 2, 256, 70, 64, torch.bfloat16, 3),
    ("affine", 3, 1024, 33, 256, torch.float32, None),
    ("fp4", 7, 128, 19, 32, torch.bfloat16, 1),
    ("u4", 16, 2048, 45, 128, torch.float16, 4),
    ("affine", 16, 96, 10, 32, torch.float16, 3),
    ("u4", 17, 512, 72, 128, torch.float16, 8),     # staged: decode, then the dense GEMM
    ("fp4", 40, 256, 40, 64, torch.float32, 3),     # staged, simt
    ("fp4", 1, 8192, 300, 128, torch.float16, None),  # many refills per tile, 4 channels per tile
]


def main():
    if sys.argv[1:2] == ["--profile"]:
        a = sys.argv[2:]
        return profile(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]) if len(a) > 4 else 0)
    torch.manual_seed(0)
    worst = 0.0
    for fmt, M, K, N, gs, dt, C in CASES:
        B, s, aux, coded, W, C = layer(fmt, K, N, gs, dt, C)
        A = torch.randn(M, K).to(dt)
        bias = torch.randn(N).to(dt) if M % 2 else None
        cuda = [t.cuda() for t in coded]
        out = gemm(fmt, A.cuda(), cuda, s.cuda(), aux.cuda() if aux is not None else None, K, N, gs, C,
                   bias.cuda() if bias is not None else None).cpu().float()
        ref = A.float() @ W + (bias.float() if bias is not None else 0)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        ok = err < (2e-2 if dt == torch.bfloat16 else 5e-3)
        print(f"{fmt:6s} M={M:3d} K={K:5d} N={N:4d} gs={gs:3d} {str(dt):15s} C={C:3d}  rel err {err:.2e}"
              f"{'' if ok else '  FAIL'}")
        if not ok:
            sys.exit(1)
        decoded = torch.ops.marlin.rans_decode(*cuda, K, N, C).cpu()
        if not torch.equal(decoded, B):
            print("rans_decode differs from the encoded B_packed  FAIL")
            sys.exit(1)
    # A layer of one symbol codes no words at all.
    B, s, _, coded, W, C = layer("fp4", 256, 9, 64, torch.float16, 2, single=True)
    out = gemm("fp4", torch.ones(1, 256, device="cuda", dtype=torch.float16), [t.cuda() for t in coded], s.cuda(),
               None, 256, 9, 64, C).cpu().float()
    assert torch.allclose(out, W.sum(0, keepdim=True), rtol=5e-3, atol=1e-3), "single-symbol layer"
    # Corrupted inputs: wrong numbers allowed, memory errors not.
    K, N, gs = 512, 37, 128
    _, s, _, coded, _, C = layer("fp4", K, N, gs, torch.float16, 5)
    words, offsets, states, freqs = coded
    corrupt = []
    w = words.clone()
    w[:] = -1  # every stream reads a word each step and runs past its end
    corrupt.append((w, offsets, states, freqs))
    o = offsets.clone()
    o[3] = 1 << 30
    o[5] = -8
    o[6] += 3
    o[-1] = len(words) + 800
    corrupt.append((words, o, states, freqs))
    f = freqs.clone()
    f[1] = 4095
    f[2, 0] = -1
    corrupt.append((words, offsets, states, f))
    st = states.clone()
    st[0] = 0
    st[4] = -1
    corrupt.append((words, offsets, st, freqs))
    for bad in corrupt:
        for M in (1, 20):
            gemm("fp4", torch.randn(M, K, device="cuda", dtype=torch.float16), [t.cuda() for t in bad], s.cuda(),
                 None, K, N, gs, C)
        torch.ops.marlin.rans_decode(*[t.cuda() for t in bad], K, N, C)
    torch.cuda.synchronize()
    print(f"all {len(CASES)} cases and {len(corrupt)} corrupted layers ran; worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
