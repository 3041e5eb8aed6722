"""The dispatch policy, as a plain function tests and users can call.

It asks the C++ planner (csrc/plan/plan.cpp) — the same code every op runs through — which kernel
variant and launch geometry a shape gets on a backend. Modules do not decide anything themselves:
they call the op, and the op plans. Small M (16 rows on Metal, 8 on CPU, 128 on CUDA: measured
crossovers) selects the decode (GEMV-style) kernels; larger M the tiled (prefill) kernels, stripes
with K-parallel slices where the output is too small to fill the GPU, or on CUDA dequantized
weights + cuBLAS (``dequant_blas``).
"""

import torch

from . import _C

DECODE_MAX_M = 16

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_BACKENDS = {"cpu": "cpu", "mps": "metal", "metal": "metal", "cuda": "cuda"}


def backend_of(device) -> str:
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type not in _BACKENDS:
        raise ValueError(f"no torch_marlin backend for device type '{dev.type}'")
    return _BACKENDS[dev.type]


def plan_gemm(format: str, M: int, K: int, N: int, group_size: int = 128, dtype=torch.float16,
              device="cpu", compute_units: int = 0, variant: str = "auto", has_bias: bool = False) -> dict:
    """Returns the plan (``variant``, ``kernel``, ``grid``, ``threads``, ``k_parallel``, ...) the
    op would execute for this problem. ``device`` may be a torch device or ``"metal"``;
    ``compute_units`` overrides the device's core/SM/thread count (0 = the backend's default)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend = device if device == "metal" else backend_of(device)
    if compute_units == 0 and backend == "cpu":
        compute_units = torch.get_num_threads()
    if compute_units == 0 and backend == "cuda" and torch.cuda.is_available():
        dev = torch.device(device)
        compute_units = torch.cuda.get_device_properties(dev.index or 0).multi_processor_count
    return _C.plan_quant_gemm(format, M, K, N, group_size, _DTYPES[dtype], backend, compute_units, has_bias, variant)


def plan_trellis(M: int, K: int, N: int, bits: int = 3, group_size: int = 128, dtype=torch.float16,
                 device="cpu", variant: str = "auto") -> dict:
    """The plan ``gemm_trellis`` would execute: M <= 16 -> ``gemm_trellis_packed_decode`` (GEMV
    layout), else ``gemm_trellis_packed`` (64x64 tiles) on Metal; ``cpu_trellis_decode`` /
    ``cpu_trellis_prefill`` on the CPU. Keys: ``variant, kernel, grid, threads, tile_m, tile_n, ...``."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend = device if device == "metal" else backend_of(device)
    return _C.plan_trellis_gemm(M, K, N, bits, group_size, _DTYPES[dtype], backend, variant)
