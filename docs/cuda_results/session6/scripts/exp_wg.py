# EXPERIMENT (untracked): correctness + timing of the wgmma kernel vs dequant_blas / decode / cuBLAS.
import os, sys, statistics, torch, torch.nn.functional as F
import torch_marlin
from torch_marlin.formats import dequant_fp4_reference, dequant_u4_reference, quantize_fp4, quantize_u4, pack_int4
print("wgmma caps:", torch_marlin._C.cuda_wgmma(0), flush=True)

def force(v):
    if v is None: os.environ.pop("TM_EXP_FORCE", None)
    else: os.environ["TM_EXP_FORCE"] = v

def check(fmt, M, K, N, gs, dtype, bias, v="tiled"):
    g = torch.Generator(device="cpu").manual_seed(M + K + N)
    w = torch.randn(K, N, generator=g)
    if fmt == "fp4":
        B, s = quantize_fp4(w, gs, scale_dtype=dtype); z = None
    else:
        B, s, z = quantize_u4(w, gs, symmetric=False, scale_dtype=dtype)
    B, s = B.cuda(), s.cuda(); z = z.cuda() if z is not None else None
    A = torch.randn(M, K, generator=g).to(dtype).cuda()
    b = torch.randn(N, generator=g).to(dtype).cuda() if bias else None
    force(v)
    C = torch.ops.marlin.gemm_fp4(A, B, s, gs, b) if fmt == "fp4" else torch.ops.marlin.gemm_u4(A, B, s, z, gs, b)
    force(None)
    W = dequant_fp4_reference(B, s, gs) if fmt == "fp4" else dequant_u4_reference(B, s, z, gs)
    ref = A.float() @ W.float()
    if b is not None: ref = ref + b.float()
    err = ((C.float() - ref).abs().max() / ref.abs().max()).item()
    plan = torch_marlin.plan_gemm(fmt, M, K, N, gs, dtype=dtype, device="cuda", variant=v)
    ok = err < (1e-2 if dtype == torch.float16 else 4e-2) and torch.isfinite(C.float()).all().item()
    print(f"{'OK ' if ok else 'BAD'} {fmt} {str(dtype)[6:]} M={M} K={K} N={N} gs={gs} bias={bias} err={err:.2e} {plan['kernel']} tm={plan['tile_m']} kp={plan['k_parallel']}", flush=True)
    return ok

allok = True
for fmt in ("fp4", "u4"):
    for dtype in (torch.float16, torch.bfloat16):
        for (M, K, N, gs, bias) in [(1, 256, 128, 128, False), (64, 256, 128, 64, True), (100, 384, 200, 128, True),
                                    (130, 1024, 328, 32, True), (257, 256, 203, 64, False), (300, 2048, 1024, 128, True),
                                    (64, 4096, 4096, 128, False), (1024, 4096, 4096, 128, True), (40, 8192, 256, 128, True)]:
            allok &= check(fmt, M, K, N, gs, dtype, bias)
print("ALL OK" if allok else "SOME BAD", flush=True)

def timer(fn, reps=15):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "4096x4096,4096x12288,28672x8192").split(",")]
ms = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "32,64,128,256,1024,4096").split(",")]
for K, N in shapes:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s16 = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    W16 = torch.randn(N, K, device="cuda", dtype=torch.float16)
    for M in ms:
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        tc = timer(lambda: F.linear(A, W16))
        res = {}
        for v in (["tiled", "dequant_blas"] + (["decode"] if M <= 128 else [])):
            force(v)
            res[v] = timer(lambda: torch.ops.marlin.gemm_fp4(A, B, s16, 128))
            force(None)
        plan = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda", variant="tiled")
        print(f"K={K} N={N} M={M}: cublas {tc:.1f} | " + " | ".join(f"{k} {t:.1f} ({tc/t:.2f}x)" for k, t in res.items()) + f" | tiled kp={plan['k_parallel']}", flush=True)
