"""Session-5: why gemm_fp4 (dequant_blas) at M = 4096 takes longer under events than its kernels sum to."""
import statistics, time
import torch
import torch.nn.functional as F
import torch_marlin  # noqa: F401
from torch_marlin.formats import pack_int4
from torch.profiler import profile, ProfilerActivity
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for K, N in [(28672, 8192), (4096, 21504)]:
    torch.manual_seed(0)
    B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
    s = (torch.rand(K // 128, N, device="cuda") * 0.02 + 0.001).half()
    W = torch.randn(N, K, device="cuda", dtype=torch.float16)
    for M in (1024, 4096):
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        fns = {"op": lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), "cublas": lambda: F.linear(A, W)}
        for name, fn in fns.items():
            for _ in range(3): fn()
            torch.cuda.synchronize()
            ev, host = [], []
            for _ in range(7):
                flush.zero_(); a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
                a.record(); t0 = time.perf_counter(); fn(); host.append((time.perf_counter() - t0) * 1e6); b.record(); ev.append((a, b))
            torch.cuda.synchronize()
            t_ev = statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    flush.zero_(); fn()
                torch.cuda.synchronize()
            ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA)
            # per call: kernels after each fill
            calls, cur = [], None
            for st, en, nm in ks:
                if "FillFunctor" in nm:
                    cur = [en]; calls.append(cur)
                elif cur is not None:
                    cur.append((st, en, nm[:40]))
            desc = []
            for c in calls:
                fill_end, parts = c[0], c[1:]
                if not parts: continue
                busy = sum(en - st for st, en, _ in parts)
                desc.append(f"gap0 {parts[0][0]-fill_end:.0f} busy {busy:.0f} span {parts[-1][1]-fill_end:.0f}")
            print(f"{K}x{N} M={M} {name:6s} events {t_ev:8.1f} us, host enqueue {statistics.median(host):7.1f} us | " + " ; ".join(desc), flush=True)
