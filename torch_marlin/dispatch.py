"""The dispatch policy, as a plain function tests and users can call.

It asks the C++ planner (csrc/plan/plan.cpp) — the same code every op runs through — which kernel
variant and launch geometry a shape gets on a backend. Modules do not decide anything themselves:
they call the op, and the op plans. Small M (16 rows on Metal, 8 on CPU, 128 on CUDA: measured
crossovers) selects the decode (GEMV-style) kernels; larger M the tiled (prefill) kernels, stripes
with K-parallel slices where the output is too small to fill the GPU, or on CUDA the sm_90a
warp-specialized ``wgmma_ws`` kernel (every M > 32, and 17..32 where it beats decode, when
group_size % 64 == 0; variant ``warp_specialized``), the session-7 ``wgmma`` kernel (other group sizes, 64 < M <= 512 with
enough output tiles) and dequantized weights + cuBLAS (``dequant_blas``).
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
              device="cpu", compute_units: int = 0, variant: str = "auto", has_bias: bool = False,
              thread_block_clusters=None, wgmma=None) -> dict:
    """Returns the plan (``variant``, ``kernel``, ``grid``, ``threads``, ``k_parallel``, ...) the
    op would execute for this problem. ``device`` may be a torch device or ``"metal"``;
    ``compute_units`` overrides the device's core/SM/thread count (0 = the backend's default);
    ``thread_block_clusters`` (CUDA) overrides whether the device and this build run thread-block
    clusters, ``wgmma`` whether it runs the sm_90a wgmma kernels (None = ask the device when there
    is one, else False)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend = device if device == "metal" else backend_of(device)
    if compute_units == 0 and backend == "cpu":
        compute_units = torch.get_num_threads()
    cuda_index = None
    if backend == "cuda" and torch.cuda.is_available():
        dev = torch.device(device)
        cuda_index = dev.index if dev.index is not None else torch.cuda.current_device()
    if compute_units == 0 and cuda_index is not None:
        compute_units = torch.cuda.get_device_properties(cuda_index).multi_processor_count
    if thread_block_clusters is None:
        thread_block_clusters = cuda_index is not None and _C.cuda_thread_block_clusters(cuda_index)
    if wgmma is None:
        wgmma = cuda_index is not None and _C.cuda_wgmma(cuda_index)
    return _C.plan_quant_gemm(format, M, K, N, group_size, _DTYPES[dtype], backend, compute_units, has_bias,
                              variant, bool(thread_block_clusters), bool(wgmma))


def plan_trellis(M: int, K: int, N: int, bits: int = 3, group_size: int = 128, dtype=torch.float16,
                 device="cpu", variant: str = "auto") -> dict:
    """The plan ``gemm_trellis`` would execute: M <= 16 -> ``gemm_trellis_packed_decode`` (GEMV
    layout), else ``gemm_trellis_packed`` (64x64 tiles) on Metal; ``cpu_trellis_decode`` /
    ``cpu_trellis_prefill`` on the CPU. Keys: ``variant, kernel, grid, threads, tile_m, tile_n, ...``."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend = device if device == "metal" else backend_of(device)
    return _C.plan_trellis_gemm(M, K, N, bits, group_size, _DTYPES[dtype], backend, variant)
