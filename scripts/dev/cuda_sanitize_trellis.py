"""Runs each CUDA trellis kernel once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/dev/cuda_sanitize_trellis.py
    compute-sanitizer --tool racecheck python scripts/dev/cuda_sanitize_trellis.py --no-blas

Covers: decode (one slice and K slices with the ordered reduction, partial last stage, partial
last tile column block, K and N not multiples of 16), fused tiles (rows past M), 2 / 3 / 4 bits,
fp16 / bf16, the fp32 kernel, dequant_trellis, dequant_blas (the dense fp16 weight + cuBLAS;
racecheck skips it with --no-blas: cuBLAS's kernels are not ours), every GEMM case and
dequant_trellis again with the indices in the CUDA lane layout (the streaming decode's and the lane
dequant's instantiations; sm_90a: the wgmma prefill), and moe_trellis on the streaming decode (8- and 16-row tiles, down
launched behind gate/up), the tensor-core decode and tiles kernels (gate/up in one launch, down
with K-slice partials of gate/up) and the fp32 kernels. Each result
is checked against the fp64 reference on the dequantized weights, so a silent wrong answer fails.
"""
import sys

import torch

import torch_marlin
from torch_marlin.formats import trellis as tr

torch.manual_seed(0)
GEMM_CASES = [  # M, K, N, bits, group_size, dtype
    (1, 4096, 200, 3, 128, torch.float16),    # decode, K slices, partial column block
    (5, 200, 77, 2, 32, torch.bfloat16),      # decode, one partial stage, K % 16 != 0
    (16, 1040, 1000, 4, 128, torch.float16),  # decode, partial last group
    (12, 203, 77, 3, 32, torch.float16),      # decode where K % 8 != 0 (the tensor-core kernel)
    (100, 520, 136, 3, 32, torch.bfloat16),   # fused tiles, rows past M
    (70, 4096, 64, 2, 128, torch.float16),    # fused tiles, K slices
    (9, 200, 77, 3, 32, torch.float32),       # fp32 kernel
    (600, 200, 77, 3, 32, torch.float16),     # dequant_blas
    (40, 144, 136, 4, 32, torch.bfloat16),    # dequant_blas, 16-byte stores
    (64, 200, 12600, 3, 32, torch.float16),   # lanes: wgmma prefill, 128-row blocks, partial chunk and tiles
    (130, 264, 9000, 2, 128, torch.bfloat16), # lanes: wgmma prefill, 256-row blocks, rows past M
]
MOE_CASES = [  # T, H, I, E, top_k, bits, dtype
    (1, 256, 136, 8, 2, 3, torch.float16),    # streaming decode, 8-row tiles
    (2, 264, 200, 12, 8, 2, torch.bfloat16),  # streaming decode, 16-row tiles, several K slices
    (3, 204, 136, 6, 2, 4, torch.float16),    # decode on the tensor-core kernel (hidden % 8 != 0)
    (20, 200, 48, 4, 2, 4, torch.bfloat16),   # tiles (T * top_k > 16)
    (5, 72, 112, 6, 2, 2, torch.float32),     # fp32 kernels
]


def rand_trellis(K, N, bits, gs, experts=None):
    def one():
        idx = torch.randint(0, 1 << bits, (K, N))
        return (tr.pack_indices(idx, bits), torch.rand(tr.num_groups(K, gs), N) * 0.2 + 0.01,
                torch.randn(1 << bits), torch.randn(K).sign(), torch.randn(N).sign())
    if experts is None:
        return one()
    parts = [one() for _ in range(experts)]
    return tuple(torch.stack([p[i] for p in parts]) for i in range(5))


def check(name, out, ref, dtype):
    err = (out.double().cpu() - ref).abs().max().item()
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-4}[dtype] * max(1.0, ref.abs().max().item())
    print(f"{name}: max error {err:.3g} (tolerance {tol:.3g})")
    return err <= tol


def main():
    ok = True
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    for M, K, N, bits, gs, dtype in GEMM_CASES:
        if "--no-blas" in sys.argv and all(
                torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, device="cuda", layout=layout)["family"]
                == "dequant_blas" for layout in ("tiles", "lanes")):
            continue
        t = rand_trellis(K, N, bits, gs)
        W = tr.dequant_trellis_reference(*t, K, N, bits, gs).double()
        A = torch.randn(M, K)
        for layout in ("tiles", "lanes"):
            plan = torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, device="cuda", layout=layout)
            if "--no-blas" in sys.argv and plan["family"] == "dequant_blas":
                continue
            w = t if layout == "tiles" else (tr.tiles_to_lanes(t[0], K, N, bits),) + t[1:]
            C = torch.ops.marlin.gemm_trellis(A.to(dtype).cuda(), *cuda(w), K, N, bits, gs)
            ok &= check(f"gemm {plan['kernel']} kp={plan['k_parallel']} M={M} K={K} N={N} bits={bits}", C,
                        A.to(dtype).double() @ W, dtype)
    t = rand_trellis(200, 77, 3, 32)
    for w in (t, (tr.tiles_to_lanes(t[0], 200, 77, 3),) + t[1:]):
        Wd = torch.ops.marlin.dequant_trellis(*cuda(w), 200, 77, 3, 32)
        ok &= check(f"dequant_trellis {tuple(w[0].shape)}", Wd, tr.dequant_trellis_reference(*t, 200, 77, 3, 32).double(),
                    torch.float32)
    for T, H, I, E, top_k, bits, dtype in MOE_CASES:
        gate, up, down = rand_trellis(H, I, bits, 32, E), rand_trellis(H, I, bits, 32, E), rand_trellis(I, H, bits, 32, E)
        x = (torch.randn(T, H) * 0.5).to(dtype)
        ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
        probs = torch.softmax(torch.randn(T, top_k), -1)
        y = torch.ops.marlin.moe_trellis(x.cuda(), *cuda(gate), *cuda(up), *cuda(down), ids.cuda(), probs.cuda(), I,
                                         bits, 32)
        deq = lambda w, e, k, n: tr.dequant_trellis_reference(*(p[e] for p in w), k, n, bits, 32).double()  # noqa: E731
        ref = torch.zeros(T, H, dtype=torch.float64)
        for ti in range(T):
            for j in range(top_k):
                e = int(ids[ti, j])
                xd = x[ti].double()
                h = torch.nn.functional.silu(xd @ deq(gate, e, H, I)) * (xd @ deq(up, e, H, I))
                ref[ti] += float(probs[ti, j]) * (h @ deq(down, e, I, H))
        ok &= check(f"moe_trellis T={T} E={E} top_k={top_k} bits={bits} {dtype}", y, ref, dtype)
    torch.cuda.synchronize()
    print("OK" if ok else "WRONG RESULTS")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
