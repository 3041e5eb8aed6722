"""Self-check of an installed torch_marlin on one device: correctness of every kernel family, then speed.

    python -m torch_marlin.selfcheck [--device mps|cuda|cpu] [--quick] [--no-bench] [--json FILE]

1. Correctness: every op (gemm_fp4/u4/affine, dequant_fp4/u4/affine, gemm_trellis,
   dequant_trellis, moe_trellis, gemm_rans, rans_decode) in fp16, bf16 and fp32 on the device,
   against plain torch on weights dequantized on the CPU by ``torch_marlin.formats``. The shapes
   are chosen by asking the planner (``plan_gemm`` / ``plan_trellis`` / ``plan_rans`` with the
   device's own caps) which kernel family and K-slice reduction each candidate shape gets, and
   keeping the cheapest shape for each one the backend has, so every planner path of the device
   runs. One row per case: PASS, FAIL, or on mps FALLBACK (the Metal kernel could not run; the
   plain-torch path of torch_marlin/metal_fallback.py gave a correct answer). bfloat16 needs
   macOS 14 on mps: skipped on macOS 13, saying so. A table then lists, per op, the families that
   ran natively and those that fell back, with the reason.
2. Bandwidth (M = 1, Llama-3-8B layer shapes, FP4 and U4 g128, fp16): GB/s of weight bytes read
   (packed codes + scales + zeros), timed on the device's own clock (GPU events: many calls between
   two timestamps) with the weights rotated over copies larger than any system-level cache, as a
   fraction of a reference: Apple's published bandwidth of the chip on MPS, a measured
   device-to-device copy elsewhere.
3. Prefill (M = 128, 512): the quantized op against ``torch.matmul`` on the dense weight.

Exit status: 0 when every row passes, 1 on any FAIL or FALLBACK, 2 on bad usage or a missing device.
"""

import argparse
import json
import os
import platform
import subprocess
import sys

import torch
import torch.nn.functional as F

import torch_marlin
from torch_marlin import metal_fallback, ops
from torch_marlin.formats import dequant_affine_reference, dequant_fp4_reference, dequant_u4_reference
from torch_marlin.formats import quantize_affine, quantize_fp4, quantize_u4
from torch_marlin.formats import rans as rans_format
from torch_marlin.formats import trellis as trellis_format
from torch_marlin.planner import plan_gemm, plan_rans, plan_trellis
from torch_marlin.selfcheck_bench import (LLAMA3_8B_SHAPES, ROTATE_BYTES, ROTATE_BYTES_QUICK_CPU, bandwidth_table,
                                          copy_bandwidth_gbps, prefill_table, run_gemm, to_device)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMATS = ("fp4", "u4", "affine")

# ---- tolerances --------------------------------------------------------------------------------------
# Elementwise bound for C = A @ W against the fp64 product on the same dequantized weights, with
# mag = |A| @ |W| and u the unit roundoff of the activation dtype:
# * every backend rounds the result once to the activation dtype (2u |ref| covers that rounding
#   and the reference's own) and sums K fp32 terms in its own order (K 2^-24 mag, the worst-case
#   bound of a K-term fp32 sum);
# * GPU kernels (MPS, CUDA) round each dequantized weight to the activation dtype before the
#   multiply and may reduce one level of partial sums in that dtype (2u mag); tensor-core fp32
#   accumulation truncates, doubling the sum term (K 2^-23 mag). The CPU multiplies by the exact
#   fp32 weight.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
# A trellis weight is grid * scale * su * sv in fp32: three roundings, in any order.
TRELLIS_WEIGHT_ROUNDING = 3 * 2.0**-24
# MoE outputs, relative to the output's scale: fp32 work, y rounded once to the activation dtype
# (eps = 2u); GPU tiles also round x, the SwiGLU activations and the weights to that dtype, which
# costs eps relative to the largest outputs (1.5 eps max|ref|; 0.125 eps on the CPU).
MOE_EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}

# Apple's published unified-memory bandwidth in GB/s, by chip name (sysctl machdep.cpu.brand_string
# without "Apple "). Binned Max chips have less: M3 Max with a 30-core GPU 300, M4 Max with a
# 32-core GPU 410 (picked by the GPU core count the IOKit registry reports).
APPLE_RATED_GBPS = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
    "M5": 153, "M5 Pro": 307, "M5 Max": 614,
}
APPLE_BINNED_GBPS = {("M3 Max", 30): 300, ("M4 Max", 32): 410}


class CheckFailed(Exception):
    pass


# ---- device ------------------------------------------------------------------------------------------

def device_present(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return torch.cuda.is_available()
    return device == "mps" and torch.backends.mps.is_available()


def default_device() -> str:
    return next(d for d in ("mps", "cuda", "cpu") if device_present(d))


def chip_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or "unknown"
        except OSError:
            return "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def registry_gpu_cores():
    """The Apple GPU's core count from the IOKit registry (``gpu-core-count`` of AGXAccelerator,
    what the MPS backend reads too), or None off macOS or when the registry has none."""
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["ioreg", "-r", "-d", "1", "-c", "AGXAccelerator"], capture_output=True, text=True,
                             timeout=10).stdout
    except OSError:
        return None
    for line in out.splitlines():
        if '"gpu-core-count"' in line:
            value = line.split("=", 1)[-1].strip()
            return int(value) if value.isdigit() else None
    return None


def macos_version():
    """(major, minor) of macOS, or None elsewhere."""
    release = platform.mac_ver()[0]
    return tuple(int(p) for p in (release.split(".") + ["0"])[:2]) if release else None


def skipped_dtypes(device: str) -> dict:
    """{dtype: why} of the activation dtypes this device cannot run: bfloat16 on MPS before macOS 14
    (neither torch's MPS backend nor MSL 3.0 has it)."""
    mac = macos_version()
    if device == "mps" and mac is not None and mac < (14, 0):
        return {torch.bfloat16: f"bfloat16 on mps needs macOS 14 or later (this is macOS {mac[0]}.{mac[1]})"}
    return {}


def apple_rated_gbps(chip: str, gpu_cores: int):
    name = chip.removeprefix("Apple ").strip()
    return APPLE_BINNED_GBPS.get((name, gpu_cores), APPLE_RATED_GBPS.get(name))


# ---- comparison --------------------------------------------------------------------------------------

def compare(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor):
    """(max |out - ref|, max of |out - ref| / tol); the case passes when the ratio is <= 1."""
    out = out.detach().cpu().double()
    if out.shape != ref.shape:
        raise CheckFailed(f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        raise CheckFailed("non-finite output")
    if out.numel() == 0:
        return 0.0, 0.0
    err = (out - ref).abs()
    return err.max().item(), (err / tol).max().item()


def gemm_tolerance(A: torch.Tensor, W: torch.Tensor, ref: torch.Tensor, exact_products: bool, weight_rounding=0.0):
    u = UNIT_ROUNDOFF[A.dtype]
    K = A.shape[1]
    mag = A.double().abs() @ W.double().abs()
    per_term = (K * 2.0**-24 if exact_products else 2 * u + K * 2.0**-23) + weight_rounding
    return ref.abs() * 2 * u + mag * per_term + 1e-6


# ---- weights -----------------------------------------------------------------------------------------

def quantized_weights(fmt: str, K: int, N: int, group_size: int, dtype, gen: torch.Generator):
    """(CPU tensors B / scales / zeros, fp32 dense reference [K, N]) for FP4 or U4."""
    w = torch.randn(K, N, generator=gen)
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype, search=False)
        return {"B": B, "scales": s, "zeros": None, "offsets": None}, dequant_fp4_reference(B, s, group_size)
    if fmt == "affine":
        B, s, b = quantize_affine(w, group_size, scale_dtype=dtype, search=False)
        return {"B": B, "scales": s, "zeros": None, "offsets": b}, dequant_affine_reference(B, s, b, group_size)
    B, s, z = quantize_u4(w, group_size, scale_dtype=dtype, search=False)
    return {"B": B, "scales": s, "zeros": z, "offsets": None}, dequant_u4_reference(B, s, z, group_size)


def run_dequant(fmt, w, group_size):
    if fmt == "fp4":
        return ops.dequant_fp4(w["B"], w["scales"], group_size)
    if fmt == "affine":
        return ops.dequant_affine(w["B"], w["scales"], w["offsets"], group_size)
    return ops.dequant_u4(w["B"], w["scales"], w["zeros"], group_size)


def random_trellis(K, N, bits, group_size, gen, experts=None):
    """(packed_indices, scales, grid, su, sv) with random indices, scales, codebook and signs."""
    def one():
        idx = torch.randint(0, 1 << bits, (K, N), generator=gen)
        return (trellis_format.pack_indices(idx, bits),
                torch.rand(trellis_format.num_groups(K, group_size), N, generator=gen) * 0.2 + 0.01,
                torch.randn(1 << bits, generator=gen),
                torch.randn(K, generator=gen).sign() * (1 + 0.1 * torch.rand(K, generator=gen)),
                torch.randn(N, generator=gen).sign() * (1 + 0.1 * torch.rand(N, generator=gen)))

    if experts is None:
        return one()
    parts = [one() for _ in range(experts)]
    return tuple(torch.stack([p[i] for p in parts]) for i in range(5))


def trellis_dense(t, K, N, bits, group_size):
    return trellis_format.dequant_trellis_reference(*t, K, N, bits, group_size).double()


# ---- correctness cases -------------------------------------------------------------------------------

# Candidate GEMM shapes (M, K, N, group_size) for the planner to sort into families. N = 200 and
# 1000 cut the 16 / 64 / 128-column tiles; K = 4096 with few columns is where Metal splits K
# (striped, second-dispatch reduction); group size 32 is what CUDA's wgmma (not wgmma_ws) takes,
# on enough output tiles (N = 8192).
GEMM_MS = (1, 4, 9, 16, 17, 33, 64, 65, 100, 129, 257, 520)
GEMM_KN = ((384, 200), (1024, 1000), (4096, 256), (4096, 2048), (1024, 8192))
GEMM_GROUPS = (128, 32)
TRELLIS_MS = (1, 5, 16, 17, 40)
TRELLIS_KN = ((256, 200), (1040, 1000))
RANS_MS = (1, 16, 17, 64)
RANS_KN = ((256, 200), (1024, 1000))


def gemm_cases(fmt, dtype, device):
    """The cheapest candidate shape for each (family, reduce, tile rows) the planner picks on this
    device."""
    chosen = {}
    for M in GEMM_MS:
        for K, N in GEMM_KN:
            for gs in GEMM_GROUPS:
                try:
                    plan = plan_gemm(fmt, M, K, N, gs, dtype, device=device)
                except ValueError:
                    continue
                # Metal's prefill families have a 32- and a 64-row tile: both run.
                tile = plan.get("tile_m") if plan.get("backend") == "metal" and plan["family"] != "decode" else None
                key = (plan["family"], plan.get("reduce", "none"), tile)
                cost = M * K * N
                if key not in chosen or cost < chosen[key][0]:
                    chosen[key] = (cost, (M, K, N, gs), plan)
    return [v[1:] for _, v in sorted(chosen.items(), key=lambda kv: kv[1][0])]


def trellis_cases(dtype, device, bits):
    chosen = {}
    for M in TRELLIS_MS:
        for K, N in TRELLIS_KN:
            plan = plan_trellis(M, K, N, bits, 128, dtype, device=device)
            cost = M * K * N
            if plan["family"] not in chosen or cost < chosen[plan["family"]][0]:
                chosen[plan["family"]] = (cost, (M, K, N), plan)
    return [v[1:] for _, v in sorted(chosen.items(), key=lambda kv: kv[1][0])]


def rans_cases(fmt, dtype, device):
    chosen = {}
    for M in RANS_MS:
        for K, N in RANS_KN:
            plan = plan_rans(M, K, N, 128, fmt, dtype=dtype, device=device)
            family = plan["family"] + (f"/{plan['gemm']['family']}" if "gemm" in plan else "")
            cost = M * K * N
            if family not in chosen or cost < chosen[family][0]:
                chosen[family] = (cost, (M, K, N), family, plan["kernel"])
    return [v[1:] for _, v in sorted(chosen.items(), key=lambda kv: kv[1][0])]


def trellis_supported(device) -> bool:
    try:
        plan_trellis(1, 256, 256, 3, 128, torch.float16, device=device)
        return True
    except ValueError:  # the planner has no trellis kernels for this backend
        return False


def moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs):
    E = gate[0].shape[0]
    Wg = [trellis_dense(tuple(p[e] for p in gate), H, I, bits, gs) for e in range(E)]
    Wu = [trellis_dense(tuple(p[e] for p in up), H, I, bits, gs) for e in range(E)]
    Wd = [trellis_dense(tuple(p[e] for p in down), I, H, bits, gs) for e in range(E)]
    xd = x.double()
    y = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y[t] += float(probs[t, j]) * ((F.silu(xd[t] @ Wg[e]) * (xd[t] @ Wu[e])) @ Wd[e])
    return y


def correctness_rows(device: str):
    """Yields one result dict per case."""
    exact = device == "cpu"
    gen = torch.Generator().manual_seed(0)
    skipped = skipped_dtypes(device)
    dtypes = tuple(d for d in DTYPES if d not in skipped)
    for why in skipped.values():
        print(f"SKIP  {why}")

    def row(op, fmt, dtype, M, K, N, family, kernel, check):
        r = {"op": op, "format": fmt, "dtype": str(dtype).removeprefix("torch."), "M": M, "K": K, "N": N,
             "family": family, "kernel": kernel, "path": "native"}
        fallbacks_before = metal_fallback.fallback_calls()[0]
        try:
            r["max_err"], r["err_over_tol"] = check()
            r["status"] = "PASS" if r["err_over_tol"] <= 1.0 else "FAIL"
        except Exception as e:  # a kernel error is a failed check, reported on its row
            r["max_err"], r["err_over_tol"], r["status"] = float("nan"), float("nan"), "FAIL"
            r["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        count, why = metal_fallback.fallback_calls()
        if count != fallbacks_before:  # the Metal kernel could not run: the plain-torch path answered
            r["path"] = "fallback"
            r["fallback_reason"] = why
            if r["status"] == "PASS":
                r["status"] = "FALLBACK"
        return r

    for fmt in FORMATS:
        for dtype in dtypes:
            for (M, K, N, gs), plan in gemm_cases(fmt, dtype, device):
                def check(M=M, K=K, N=N, gs=gs):
                    w, W = quantized_weights(fmt, K, N, gs, dtype, gen)
                    A = torch.randn(M, K, generator=gen).to(dtype)
                    out = run_gemm(fmt, A.to(device), to_device(w, device), gs)
                    if out.dtype != dtype:
                        raise CheckFailed(f"output dtype {out.dtype}")
                    ref = A.double() @ W.double()
                    return compare(out, ref, gemm_tolerance(A, W, ref, exact))
                yield row(f"gemm_{fmt}", f"{fmt} g{gs}", dtype, M, K, N,
                          plan["family"] + ("" if plan.get("reduce", "none") == "none" else f"/{plan['reduce']}"),
                          plan["kernel"], check)
            K, N, gs = 384, 200, 128

            def check_dequant(K=K, N=N, gs=gs):
                w, W = quantized_weights(fmt, K, N, gs, dtype, gen)
                out = run_dequant(fmt, to_device(w, device), gs)
                if out.dtype != dtype:
                    raise CheckFailed(f"output dtype {out.dtype}")
                # Code x scale in fp32 rounded once to the scales' dtype, as the reference: bitwise
                # (the 1e-300 keeps the ratio finite where both are exactly equal).
                return compare(out, W.to(dtype).double(), torch.full_like(W, 1e-300, dtype=torch.float64))
            yield row(f"dequant_{fmt}", f"{fmt} g{gs}", dtype, "-", K, N, "-", "-", check_dequant)

    for fmt in FORMATS:
        for dtype in dtypes:
            for (M, K, N), family, kernel in rans_cases(fmt, dtype, device):
                def check_rans(M=M, K=K, N=N, fmt=fmt, dtype=dtype):
                    w, W = quantized_weights(fmt, K, N, 128, dtype, gen)
                    codes = ops.rans_encode(w["B"])
                    A = torch.randn(M, K, generator=gen).to(dtype)
                    on = to_device(w, device)
                    out = ops.gemm_rans(A.to(device), *(c.to(device) for c in codes), on["scales"], on["zeros"],
                                        on["offsets"], fmt, K, N, 128, rans_format.default_channels_per_tile(K))
                    if out.dtype != dtype:
                        raise CheckFailed(f"output dtype {out.dtype}")
                    ref = A.double() @ W.double()
                    return compare(out, ref, gemm_tolerance(A, W, ref, exact))
                yield row("gemm_rans", f"{fmt} g128 rANS", dtype, M, K, N, family, kernel, check_rans)

    def check_rans_decode(K=1024, N=200):
        B = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=gen)
        codes = ops.rans_encode(B)
        out = ops.rans_decode(*(c.to(device) for c in codes), K, N, rans_format.default_channels_per_tile(K))
        # Lossless: bit for bit (the 1e-300 keeps the ratio finite where both are exactly equal).
        return compare(out, B.double(), torch.full(B.shape, 1e-300, dtype=torch.float64))
    yield row("rans_decode", "4-bit codes", torch.int32, "-", 1024, 200, "-", "-", check_rans_decode)

    if not trellis_supported(device):
        print(f"gemm_trellis, dequant_trellis, moe_trellis: the planner has no trellis kernels for {device}; skipped")
        return
    bits, gs = 3, 128
    for dtype in dtypes:
        for (M, K, N), plan in trellis_cases(dtype, device, bits):
            def check(M=M, K=K, N=N, dtype=dtype):
                t = random_trellis(K, N, bits, gs, gen)
                A = torch.randn(M, K, generator=gen).to(dtype)
                out = ops.gemm_trellis(A.to(device), *(p.to(device) for p in t), K, N, bits, gs)
                if out.dtype != dtype:
                    raise CheckFailed(f"output dtype {out.dtype}")
                W = trellis_dense(t, K, N, bits, gs)
                ref = A.double() @ W
                return compare(out, ref, gemm_tolerance(A, W, ref, exact, TRELLIS_WEIGHT_ROUNDING))
            yield row("gemm_trellis", f"trellis {bits}b g{gs}", dtype, M, K, N, plan["family"], plan["kernel"], check)

    for b in (2, 3, 4):
        K, N = 200, 77

        def check_dequant_trellis(b=b, K=K, N=N):
            t = random_trellis(K, N, b, 32, gen)
            out = ops.dequant_trellis(*(p.to(device) for p in t), K, N, b, 32)
            ref = trellis_dense(t, K, N, b, 32)
            # The kernel's fp32 product and the reference's each round three times.
            return compare(out, ref, ref.abs() * 2 * TRELLIS_WEIGHT_ROUNDING + 1e-9)
        yield row("dequant_trellis", f"trellis {b}b g32", torch.float32, "-", K, N, "-", "-", check_dequant_trellis)

    # MoE: 5 tokens x top-2 = 10 routed rows (every expert on the GEMV path), and 24 tokens all
    # routed to one expert (48 rows: the prefill family for that expert).
    H, I, E, top_k = 200, 136, 5, 2
    for dtype in dtypes:
        for T in (5, 24):
            plan = plan_trellis(T * top_k, H, I, bits, gs, dtype, device=device)

            def check_moe(T=T, dtype=dtype):
                gate, up, down = (random_trellis(k, n, bits, gs, gen, experts=E) for k, n in ((H, I), (H, I), (I, H)))
                if T > 16 // top_k:
                    ids = torch.stack([torch.full((T,), E - 1), torch.arange(T) % (E - 1)], 1)
                else:
                    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
                probs = torch.softmax(torch.randn(T, top_k, generator=gen), -1)
                x = (torch.randn(T, H, generator=gen) * 0.5).to(dtype)
                on = lambda ts: tuple(p.to(device) for p in ts)  # noqa: E731
                y = ops.moe_trellis(x.to(device), on(gate), on(up), on(down), ids.to(device), probs.to(device),
                                    I, bits, gs)
                if y.dtype != dtype:
                    raise CheckFailed(f"output dtype {y.dtype}")
                ref = moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs)
                eps = MOE_EPS[dtype]
                tol = eps * (ref.abs() + ref.abs().max() * (0.125 if exact else 1.5)) + 1e-6
                return compare(y, ref, tol)
            yield row("moe_trellis", f"trellis {bits}b g{gs} E{E} top{top_k}", dtype, f"{T}x{top_k}", H, I,
                      plan["family"], "-", check_moe)


# ---- output ------------------------------------------------------------------------------------------

def path_summary(rows):
    """Per op: the families that ran their native kernel, those that ran the plain-torch fallback
    (with the first reason), and whether any row failed."""
    ops_seen = {}
    for r in rows:
        o = ops_seen.setdefault(r["op"], {"op": r["op"], "native": set(), "fallback": set(), "reason": None})
        o["fallback" if r["path"] == "fallback" else "native"].add(r["family"])
        if r["path"] == "fallback" and o["reason"] is None:
            o["reason"] = r["fallback_reason"].splitlines()[0][:160]
    return [{"op": o["op"], "native": ", ".join(sorted(o["native"])) or "-",
             "fallback": ", ".join(sorted(o["fallback"])) or "-", "reason": o["reason"] or "-"}
            for o in ops_seen.values()]


def metallib_count() -> int:
    """Prebuilt Metal libraries installed beside the extension (macOS builds with Xcode's compiler)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(torch_marlin.__file__)), "metallib")
    return len([f for f in os.listdir(folder) if f.endswith(".metallib")]) if os.path.isdir(folder) else 0


def print_table(title, rows, columns):
    print(f"\n{title}")
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def _fmt(v):
    if v is None:
        return "unknown"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 0.01 or abs(v) >= 1e7):
            return f"{v:.3g}"
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m torch_marlin.selfcheck",
                                description="Checks every torch_marlin kernel family on a device against a "
                                            "CPU reference, then measures decode bandwidth and prefill speed.")
    p.add_argument("--device", choices=("mps", "cuda", "cpu"), default=None,
                   help="device to check (default: mps if available, else cuda, else cpu)")
    p.add_argument("--quick", action="store_true", help="small benchmark shapes and few repeats (what CI runs)")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or default_device()
    if not device_present(device):
        print(f"torch_marlin.selfcheck: --device {device}: no {device} device is available to this torch "
              f"({torch.__version__}); choose one of: "
              f"{', '.join(d for d in ('mps', 'cuda', 'cpu') if device_present(d))}", file=sys.stderr)
        return 2

    chip = chip_name(device)
    caps = {k: v for k, v in plan_gemm("fp4", 1, 128, 128, 128, torch.float16, device=device).items()
            if k in ("backend", "compute_units", "max_shared_memory", "wgmma", "thread_block_clusters", "avx2",
                     "avx512")}
    header = {"torch_marlin": torch_marlin.__version__, "torch": torch.__version__, "device": device,
              "chip": chip, "caps": caps, "python": platform.python_version(),
              "os": platform.platform()}
    if device == "mps":
        header.update(gpu_cores_registry=registry_gpu_cores(), metallibs=metallib_count())
    print(f"torch_marlin {header['torch_marlin']}  torch {header['torch']}  device {device}  chip {chip}  caps "
          + " ".join(f"{k}={v}" for k, v in caps.items()))
    print(f"python {header['python']}  os {header['os']}"
          + (f"  gpu-core-count {header['gpu_cores_registry']}  prebuilt metallibs {header['metallibs']}"
             if device == "mps" else ""))

    rows = []
    for r in correctness_rows(device):
        rows.append(r)
        print(f"{r['status']:<8} {r['op']:<15} {r['format']:<24} {r['dtype']:<8} M={r['M']!s:<5} K={r['K']:<5} "
              f"N={r['N']:<5} {r['family']:<28} {r['kernel']:<28} max_err={_fmt(r['max_err'])} "
              f"err/tol={_fmt(r['err_over_tol'])}" + (f"  {r['error']}" if "error" in r else ""), flush=True)
    failures = sum(r["status"] != "PASS" for r in rows)
    fallbacks = sum(r["status"] == "FALLBACK" for r in rows)
    print(f"\ncorrectness: {len(rows) - failures}/{len(rows)} PASS"
          + (f", {fallbacks} FALLBACK (correct through the plain-torch path)" if fallbacks else ""))
    paths = path_summary(rows)
    print_table("kernel paths: families that ran natively and those that fell back to plain torch", paths,
                ["op", "native", "fallback", "reason"])
    for op, why in metal_fallback.unavailable().items():
        print(f"\n{op}: the native error in full:\n{why}")
    result = {"header": header, "correctness": rows, "paths": paths, "failures": failures,
              "skipped": [why for why in skipped_dtypes(device).values()]}

    if not args.no_bench:
        quick = args.quick
        shapes = tuple((K // 4, N // 4) for K, N in LLAMA3_8B_SHAPES) if quick else LLAMA3_8B_SHAPES
        rotate = ROTATE_BYTES_QUICK_CPU if quick and device == "cpu" else ROTATE_BYTES
        repeats = 3 if quick else 7
        if device == "mps":
            rated = apple_rated_gbps(chip, header["gpu_cores_registry"] or caps.get("compute_units", 0))
            reference, source = rated, "Apple's published bandwidth of the chip"
        else:
            reference = copy_bandwidth_gbps(device, rotate, repeats)
            source = "measured device-to-device copy (bytes read + written)"
        bw = bandwidth_table(device, shapes, rotate, repeats, reference)
        print_table(f"bandwidth at M = 1, fp16 activations (weight bytes / time; reference: {source}, "
                    f"{_fmt(reference)} GB/s)", bw,
                    ["format", "K", "N", "kernel", "weight_mb", "copies", "us", "gbps", "fraction"])
        pf = prefill_table(device, shapes, (128,) if quick else (128, 512), 3 if quick else 5)
        print_table("prefill, fp16 activations: our op vs torch.matmul on the dense weight "
                    "(ratio > 1: ours faster)", pf,
                    ["format", "K", "N", "M", "kernel", "ours_ms", "matmul_ms", "matmul_dtype", "ratio"])
        result.update(bandwidth=bw, bandwidth_reference={"gbps": reference, "source": source}, prefill=pf)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if failures:
        print(f"\nselfcheck: FAIL ({failures} of {len(rows)} rows"
              + (f"; {fallbacks} ran the plain-torch fallback: models still run, slower" if fallbacks else "")
              + f"). {metal_fallback.REPORT_HINT[0].upper()}{metal_fallback.REPORT_HINT[1:]}.")
    else:
        print("\nselfcheck: PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
