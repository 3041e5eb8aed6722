"""Session 11 experiment: programmatic dependent launch (PDL) of the decode kernel, switched by
TM_EXP_PDL (read at launch, so at graph capture; work in progress only), timed as
`bench_cuda.py --graph --rotate` times (one CUDA graph calls the op once on each of >= 4x L2 of
weight copies, back to back; us a call, median of --reps), off and on alternately in one process.
Also checks a chain y = gemm(gemm(x, W1), W2) (the second call reads the first one's output)
eagerly and in a graph against the same chain without PDL.

    python docs/cuda_results/session11/scripts/exp_pdl_rotate.py [M,M,...] [KxN,...|all] [reps] [VAR]

VAR (default TM_EXP_PDL, the decode kernel's switch; TM_EXP_PDL_WS for wgmma_ws) names the switch.
"""
import os
import sys

import torch
import torch.nn.functional as F

import torch_marlin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "scripts"))
from bench_cuda import GS, SHAPES, copies, rotate_timer  # noqa: E402
from torch_marlin.formats import pack_int4  # noqa: E402


def chain_check():
    torch.manual_seed(0)
    K = 2048
    W = [(pack_int4(torch.randint(0, 16, (K, K), device="cuda")),
          (torch.rand(K // GS, K, device="cuda") * 0.002 + 0.001).half()) for _ in range(8)]
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)

    def chain():
        y = x
        for B, s in W:
            y = torch.ops.marlin.gemm_fp4(y, B, s, GS)
        return y
    res = {}
    for val in ("0", "1"):
        os.environ["TM_EXP_PDL"] = val
        eager = chain()
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g, stream=side):
            out = chain()
        g.replay()
        torch.cuda.synchronize()
        res[val] = (eager.clone(), out.clone())
    os.environ.pop("TM_EXP_PDL")
    (e0, g0), (e1, g1) = res["0"], res["1"]
    print(f"chain of 8 gemm_fp4 (M = 1, 2048 x 2048): eager off/on equal {torch.equal(e0, e1)}, "
          f"graph off/on equal {torch.equal(g0, g1)}, eager == graph {torch.equal(e0, g0)}", flush=True)


def main():
    ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,32").split(",")]
    shapes = SHAPES if len(sys.argv) <= 2 or sys.argv[2] == "all" else \
        [tuple(int(x) for x in v.split("x")) for v in sys.argv[2].split(",")]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 11
    var = sys.argv[4] if len(sys.argv) > 4 else "TM_EXP_PDL"
    if var == "TM_EXP_PDL":
        chain_check()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for K, N in shapes:
        bytes_fp4 = (K // 8) * N * 4 + (K // GS) * N * 2

        def quantized():
            B = pack_int4(torch.randint(0, 16, (K, N), device="cuda"))
            s16 = (torch.rand(K // GS, N, device="cuda") * 0.02 + 0.001).half()
            z = torch.randint(0, 16, (K // GS, N), device="cuda", dtype=torch.uint8)
            return B, s16, z
        Q = copies(quantized, bytes_fp4, l2)
        W16 = copies(lambda: torch.randn(N, K, device="cuda", dtype=torch.float16), K * N * 2, l2)
        for M in ms:
            A = torch.randn(M, K, device="cuda", dtype=torch.float16)
            t_c = rotate_timer([lambda w=w: F.linear(A, w) for w in W16], reps, True)
            plan = torch_marlin.plan_gemm("fp4", M, K, N, GS, dtype=torch.float16, device="cuda")
            parts = [f"K={K} N={N} M={M} [{plan['kernel']} kp={plan['k_parallel']}] cublas {t_c:.2f}"]
            for fmt in ("fp4", "u4"):
                if fmt == "fp4":
                    calls = [lambda q=q: torch.ops.marlin.gemm_fp4(A, q[0], q[1], GS) for q in Q]
                else:
                    calls = [lambda q=q: torch.ops.marlin.gemm_u4(A, q[0], q[1], q[2], GS) for q in Q]
                t = {}
                for val in ("0", "1", "0", "1"):
                    os.environ[var] = val
                    t[val] = rotate_timer(calls, reps, True)
                os.environ.pop(var)
                parts.append(f"{fmt} off {t['0']:.2f} ({t_c / t['0']:.2f}x) on {t['1']:.2f} ({t_c / t['1']:.2f}x) "
                             f"on/off {t['1'] / t['0']:.3f}")
            print(" | ".join(parts), flush=True)
        del Q, W16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
