"""Session 8 experiment: the warp-specialized wgmma kernel (wgmma_ws) forced through the
experiment switch TM_EXP_FORCE (plan.cpp, work in progress only), checked against the reference,
then timed against cuBLAS fp16 and whatever the planner picks without the switch.

    python docs/cuda_results/session8/scripts/exp_ws.py check [FORCE]
    python docs/cuda_results/session8/scripts/exp_ws.py time TAG [M,M,...] [FORCE,FORCE,...]
FORCE: auto, or KERNEL[+kpN][+ncN] (set_force).
"""
import os
import sys
import traceback

import torch
import torch.nn.functional as F

import torch_marlin

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "session7", "scripts"))  # session 7's timing helper
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "tests"))
from timing import memset_flush, shape_rows, timed  # noqa: E402

SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]
CHECKS = [(1, 512, 256, 64), (17, 1024, 1000, 32), (70, 1536, 2000, 96), (64, 4096, 4096, 128), (100, 2048, 8192, 128),
          (200, 1024, 2000, 64), (256, 4096, 4096, 128), (300, 8192, 1024, 128), (1024, 4096, 4096, 128),
          (129, 512, 8200, 256), (64, 8192, 200, 128)]


def set_force(force):
    """auto, or KERNEL[+kpN][+ncN]: TM_EXP_FORCE=KERNEL, TM_EXP_KP=N (K slices), TM_EXP_NC=N
    (wgmma_ws consumer warpgroups)."""
    for k in ("TM_EXP_FORCE", "TM_EXP_KP", "TM_EXP_NC"):
        os.environ.pop(k, None)
    if force == "auto":
        return
    kernel, *opts = force.split("+")
    os.environ["TM_EXP_FORCE"] = kernel
    for o in opts:
        if o.startswith("nc"):
            os.environ["TM_EXP_NC"] = o[2:]
        elif o.startswith("kp"):
            os.environ["TM_EXP_KP"] = o[2:]


def check(force="ws"):
    import test_cuda  # noqa: E402  (the tests' reference and tolerances)
    set_force(force)
    bad = 0
    for fmt in ("fp4", "u4"):
        for dtype in (torch.float16, torch.bfloat16):
            for M, K, N, gs in CHECKS:
                plan = torch_marlin.plan_gemm(fmt, M, K, N, gs, dtype=dtype, device="cuda")
                try:
                    test_cuda.case(fmt, M, K, N, gs, dtype, with_bias=True)
                    ok = "ok"
                except Exception as e:  # noqa: BLE001
                    ok = "FAIL " + str(e).splitlines()[0][:200]
                    bad += 1
                print(f"{fmt} {str(dtype)[6:]} M={M} K={K} N={N} gs={gs} {plan['kernel']} tm={plan['tile_m']} "
                      f"kp={plan['k_parallel']}: {ok}", flush=True)
    print("ALL OK" if bad == 0 else f"{bad} FAILED")


def time_shapes(tag, ms, forces):
    flush = memset_flush()
    for K, N, M, A, B, s, W16 in shape_rows(SHAPES, ms):
        tc = timed(lambda: F.linear(A, W16), flush)
        parts = [f"{tag} K={K} N={N} M={M}: cublas {tc:.1f}"]
        for force in forces:
            set_force(force)
            try:
                plan = torch_marlin.plan_gemm("fp4", M, K, N, 128, dtype=torch.float16, device="cuda")
                tf = timed(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), flush)
                parts.append(f"{force}[{plan['kernel'].split('_fp4')[0]} tm={plan['tile_m']} "
                             f"kp={plan['k_parallel']}] {tf:.1f} ({tc / tf:.2f}x)")
            except Exception as e:  # noqa: BLE001
                parts.append(f"{force} ERR {str(e)[:80]}")
        set_force("auto")
        print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    try:
        if sys.argv[1] == "check":
            check(sys.argv[2] if len(sys.argv) > 2 else "ws")
        else:
            ms = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "16,32,64,128,256,1024").split(",")]
            forces = (sys.argv[4] if len(sys.argv) > 4 else "auto,ws").split(",")
            time_shapes(sys.argv[2], ms, forces)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
