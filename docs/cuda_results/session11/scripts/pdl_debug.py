import os, torch
import torch_marlin
from torch_marlin.formats import pack_int4
GS = 128
torch.manual_seed(0)
K = 2048
W = [(pack_int4(torch.randint(0, 16, (K, K), device="cuda")),
      (torch.rand(K // GS, K, device="cuda") * 0.002 + 0.001).half()) for _ in range(8)]
x = torch.randn(1, K, device="cuda", dtype=torch.float16)
print(torch_marlin.plan_gemm("fp4", 1, K, K, GS, dtype=torch.float16, device="cuda"))
def chain(n, keep):
    y = x; ys = []
    for B, s in W[:n]:
        y = torch.ops.marlin.gemm_fp4(y, B, s, GS)
        if keep: ys.append(y)
    return y
def graph_run(n, keep):
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): chain(n, keep)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g, stream=side): out = chain(n, keep)
    g.replay(); torch.cuda.synchronize()
    r1 = out.clone(); g.replay(); torch.cuda.synchronize()
    return r1, out.clone()
for n in (1, 2, 3, 8):
    for keep in (False, True):
        os.environ["TM_EXP_PDL"] = "0"; ref = chain(n, keep).clone(); g0, g0b = graph_run(n, keep)
        os.environ["TM_EXP_PDL"] = "1"; e1 = chain(n, keep).clone(); g1, g1b = graph_run(n, keep)
        d = lambda a, b: (a.float() - b.float()).abs().max().item()
        print(f"n={n} keep={keep}: |ref| {ref.float().abs().max().item():.3g} nan {ref.isnan().sum().item()} | g0 {d(ref,g0):.3g} g0b {d(ref,g0b):.3g} | e1 {d(ref,e1):.3g} | g1 {d(ref,g1):.3g} g1b {d(ref,g1b):.3g} nan {g1.isnan().sum().item()}", flush=True)
