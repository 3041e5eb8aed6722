"""The timed part of ``python -m torch_marlin.selfcheck``: bandwidth at M = 1 and prefill against
``torch.matmul``, timed on the device's own clock (torch_marlin/selfcheck.py says what it prints)."""

import math
import statistics
import time

import torch

from torch_marlin import ops
from torch_marlin.planner import plan_gemm

BENCH_FORMATS = ("fp4", "u4")

# Llama-3-8B layer shapes (K x N): q/o projections, k/v projections, MLP up/gate, MLP down.
LLAMA3_8B_SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))

# The weights of one bandwidth row rotate over copies of at least this many bytes, so every call
# reads them from DRAM: above twice the largest system-level cache of an Apple chip (96 MiB on an
# Ultra) and far above a CPU's last-level cache. --quick on a CPU uses less (its caches are smaller).
ROTATE_BYTES = 256 << 20
ROTATE_BYTES_QUICK_CPU = 32 << 20
# Calls between two GPU timestamps: enough that the encoding of the first is hidden behind the
# device's work and one timestamp's own cost is amortised.
TIMED_CALLS_MIN = 32


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def run_gemm(fmt, A, w, group_size):
    if fmt == "fp4":
        return ops.gemm_fp4(A, w["B"], w["scales"], group_size)
    if fmt == "affine":
        return ops.gemm_affine(A, w["B"], w["scales"], w["offsets"], group_size)
    return ops.gemm_u4(A, w["B"], w["scales"], w["zeros"], group_size)


def to_device(w: dict, device: str) -> dict:
    return {k: (v.to(device) if v is not None else None) for k, v in w.items()}


# ---- timing ------------------------------------------------------------------------------------------

def _device_event(device: str):
    if device == "cuda":
        return torch.cuda.Event(enable_timing=True)
    if device == "mps":
        return torch.mps.event.Event(enable_timing=True)
    return None


def median_time(fn, calls: int, device: str, warmup: int, repeats: int) -> float:
    """Median over ``repeats`` rounds of the time per call of ``fn(i)``, i = 0..calls-1 per round.

    On a GPU each round is timed between two events recorded on the device's stream, so the
    time is the device's own from the first call's start to the last one's end: the host's
    encoding of the calls overlaps the device's work (the rounds hold many calls) and no
    synchronisation round trip is counted. On the CPU, wall time around the calls."""
    for _ in range(warmup):
        for i in range(calls):
            fn(i)
    synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = _device_event(device), _device_event(device)
        if start is None:
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            times.append((time.perf_counter() - t0) / calls)
            continue
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)  # elapsed_time: milliseconds
    return statistics.median(times)


def bench_weights(fmt, K, N, gs, device, gen):
    """Random packed codes and scales (decoding cost does not depend on the values)."""
    B = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=gen)
    s = (torch.rand(K // gs, N, generator=gen) * 0.01 + 0.01).half()
    z = torch.randint(0, 16, (K // gs, N), dtype=torch.uint8, generator=gen) if fmt == "u4" else None
    return to_device({"B": B, "scales": s, "zeros": z, "offsets": None}, device)


def weight_bytes(w: dict) -> int:
    return sum(v.numel() * v.element_size() for v in w.values() if v is not None)


def copy_bandwidth_gbps(device: str, nbytes: int, repeats: int) -> float:
    """Device-to-device copy of a large tensor: bytes read + written per second."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = median_time(lambda i: dst.copy_(src), 4, device, 1, max(repeats, 3))
    return 2 * nbytes / t / 1e9


def bandwidth_table(device, shapes, rotate_bytes, repeats, reference_gbps):
    gen = torch.Generator().manual_seed(1)
    rows = []
    for fmt in BENCH_FORMATS:
        for K, N in shapes:
            w = bench_weights(fmt, K, N, 128, device, gen)
            nbytes = weight_bytes(w)
            # Enough copies that the rotation exceeds every cache: each call reads cold weights.
            copies = [w] + [{k: (v.clone() if v is not None else None) for k, v in w.items()}
                            for _ in range(max(1, math.ceil(rotate_bytes / nbytes)) - 1)]
            A = torch.randn(1, K, generator=gen).half().to(device)
            # Whole rotations per timed round, on a GPU at least TIMED_CALLS_MIN calls.
            min_calls = 1 if device == "cpu" else TIMED_CALLS_MIN
            calls = len(copies) * max(1, math.ceil(min_calls / len(copies)))
            t = median_time(lambda i: run_gemm(fmt, A, copies[i % len(copies)], 128), calls, device, 1, repeats)
            gbps = nbytes / t / 1e9
            plan = plan_gemm(fmt, 1, K, N, 128, torch.float16, device=device)
            rows.append({"format": f"{fmt} g128", "K": K, "N": N, "M": 1, "kernel": plan["kernel"],
                         "weight_mb": nbytes / 1e6, "copies": len(copies), "us": t * 1e6, "gbps": gbps,
                         "reference_gbps": reference_gbps,
                         "fraction": gbps / reference_gbps if reference_gbps else None})
            del copies, w
    return rows


def prefill_table(device, shapes, Ms, repeats):
    # torch.matmul in fp16 on a CPU without fp16 BLAS is tens of times slower than in fp32 (44x on
    # 128x1024x3584, 2-core x86-64): fp32 is the CPU's fast dense baseline.
    base_dtype = torch.float32 if device == "cpu" else torch.float16
    gen = torch.Generator().manual_seed(2)
    rows = []
    for fmt in BENCH_FORMATS:
        for K, N in shapes:
            w = bench_weights(fmt, K, N, 128, device, gen)
            W = torch.randn(K, N, generator=gen).to(base_dtype).to(device)
            for M in Ms:
                A = torch.randn(M, K, generator=gen).half().to(device)
                A_base = A.to(base_dtype)
                calls = 1 if device == "cpu" else 8
                ours = median_time(lambda i: run_gemm(fmt, A, w, 128), calls, device, 1, repeats)
                base = median_time(lambda i: torch.matmul(A_base, W), calls, device, 1, repeats)
                plan = plan_gemm(fmt, M, K, N, 128, torch.float16, device=device)
                rows.append({"format": f"{fmt} g128", "K": K, "N": N, "M": M, "kernel": plan["kernel"],
                             "ours_ms": ours * 1e3, "matmul_ms": base * 1e3,
                             "matmul_dtype": str(base_dtype).removeprefix("torch."), "ratio": base / ours})
    return rows
