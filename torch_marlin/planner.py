"""The planner's policy, as plain functions tests and users can call.

They ask the C++ planner (csrc/plan/) — the same code every op runs through — which kernel family,
kernel and launch geometry a shape gets on a backend. Modules decide nothing themselves: they call
the op, and the op plans with its device's caps (``_C.device_caps``, which ``caps=None`` reads too).

Families (``family``): small M runs ``decode`` (GEMV-style) kernels, up to measured crossovers
(8 rows on the CPU, 16 on Metal, 128 on CUDA). Above, the CPU runs ``dequant_blas`` (dequantized
column chunks + BLAS); Metal ``fused_tiles`` (64x64 tiles), or ``striped`` (stripes with K-parallel
slices) where the output is too small to fill the GPU (``staged_tiles`` runs only when forced);
CUDA the sm_90a ``wgmma_ws`` kernel (every M > 32, and 17..32 where it beats decode, when
group_size % 64 == 0), ``wgmma`` (other group sizes, 64 < M <= 512 with enough output tiles),
else ``dequant_blas`` (dequantized panels + cuBLAS); fp32 activations on CUDA run ``simt``.
"""

import torch

from . import _C

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_BACKENDS = {"cpu": "cpu", "mps": "metal", "metal": "metal", "cuda": "cuda"}


def backend_of(device) -> str:
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type not in _BACKENDS:
        raise ValueError(f"no torch_marlin backend for device type '{dev.type}'")
    return _BACKENDS[dev.type]


def _hardware_present(dev: torch.device) -> bool:
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return dev.type == "mps" and torch.backends.mps.is_available()


def _backend_and_caps(device, caps):
    """(backend, caps dict) for the planner: an explicit ``caps`` dict over the backend's defaults,
    else the real device's caps (the op's own source), else, for ``"metal"``, the default Metal
    caps."""
    if device == "metal":
        backend = "metal"
        if caps is None:
            return backend, _C.default_caps("metal")
    else:
        backend = backend_of(device)
        if caps is None:
            dev = torch.device(device) if not isinstance(device, torch.device) else device
            if not _hardware_present(dev):
                raise ValueError(f"no {dev.type} device here to read caps from: pass the capabilities to plan for, "
                                 f"e.g. caps=dict(compute_units=132, wgmma=True, thread_block_clusters=True)")
            return backend, _C.device_caps(str(dev))
    if not isinstance(caps, dict):
        raise TypeError(f"caps must be a dict or None, got {type(caps).__name__}")
    return backend, caps


def plan_gemm(format: str, M: int, K: int, N: int, group_size: int = 128, dtype=torch.float16,
              device="cpu", family: str = "auto", has_bias: bool = False, caps=None) -> dict:
    """The plan the FP4 / INT4 / affine op (``format`` ``"fp4"``, ``"u4"``, ``"affine"``) would execute
    for this problem: ``family``, ``kernel``, ``reduce``,
    ``grid``, ``threads``, tiles, K slices, ... and the caps it was made for (``backend``,
    ``compute_units``, ``wgmma``, ``thread_block_clusters``, ``max_shared_memory``, ``avx2``, ``avx512``).
    ``launches``: every kernel launch in execution order, each a dict with its ``role`` (``"main"``: the
    GEMM, whose launch the top-level ``kernel``, ``grid``, ``threads`` describe; ``"tail"``: CUDA
    wgmma_ws's last column tiles, ``tail_*``; ``"reduce"``: Metal's K-slice reduction, ``reduce_*``),
    ``kernel``, ``grid``, ``threads``, ``dependent_launch``. Every plan family lists its launches so.

    ``device``: a torch device or ``"metal"`` (Metal planned without a device, default Metal caps).
    ``caps``: a dict of the capabilities to plan for (keys ``compute_units``, ``max_shared_memory``,
    ``wgmma``, ``thread_block_clusters``, ``avx2``: the CPU's AVX2+FMA kernels, ``avx512``: the CPU's
    AVX-512 kernel (trellis decode); missing keys take the backend's defaults, which have neither).
    None reads the
    real device's caps, as the op does; planning for a CUDA or MPS device this machine lacks needs
    ``caps``. ``family`` forces a kernel family (tests); ``"auto"`` is the policy."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend, caps = _backend_and_caps(device, caps)
    return _C.plan_quant_gemm(format, M, K, N, group_size, _DTYPES[dtype], backend, caps, has_bias, family)


def plan_trellis(M: int, K: int, N: int, bits: int = 3, group_size: int = 128, dtype=torch.float16,
                 device="cpu", family: str = "auto", caps=None, layout: str = "tiles") -> dict:
    """The plan ``gemm_trellis`` would execute: M <= 16 -> ``decode`` (``gemm_trellis_packed_decode``,
    GEMV layout, on Metal; ``cpu_trellis_decode_avx512`` with caps ``avx512``, else
    ``cpu_trellis_decode_avx2`` with caps ``avx2``, else the portable ``cpu_trellis_decode``, on the
    CPU), else ``staged_tiles`` on Metal (``gemm_trellis_packed``, 64x64
    tiles) and ``dequant_blas`` on the CPU (``cpu_trellis_prefill``).
    Keys: ``family, kernel, grid, threads, tile_m, tile_n, m_tiles, n_tiles, k_chunk, tile_k, k_vec4,
    cpu_avx2, cpu_avx512`` and the caps (``tile_k``: K rows per block of the Metal kernel; ``k_vec4``: activation rows
    read 4 elements at a time; ``tile_n``, ``n_tiles``: the CPU decode's column block and task count;
    ``cpu_avx512``, ``cpu_avx2``: the CPU decode runs the AVX-512 or the AVX2 kernel; ``dependent_launch``,
    also in each other launch's dict such as ``reduce``: the CUDA launch starts behind the previous kernel
    (programmatic dependent launch), as the streaming decode and its K-slice reduction do on sm_90).
    Every launch other than the GEMM's is a dict under its role (``reduce``: the CUDA K-slice reduction;
    ``activations``: the CUDA wgmma prefill's activation rewrite), and ``launches`` lists all of them
    in execution order, as for :func:`plan_gemm`.
    ``device``, ``caps`` and ``family`` as for :func:`plan_gemm`. ``layout``: how the indices are laid
    out, ``"tiles"`` (the canonical format) or ``"lanes"`` (the CUDA lane layout,
    :func:`trellis_index_layout`; CUDA only: ``gemm_trellis_decode_lanes_<dtype>`` for fp16/bf16 decode
    with K % 8 == 0, ``gemm_trellis_wgmma_lanes_<dtype>`` (family ``wgmma``, caps ``wgmma``) for
    fp16/bf16 prefill of 64..256 rows with at least half as many 128-column blocks as SMs, after
    the ``activations`` stage that rewrites A for it, else ``dequant_trellis_lanes_<dtype>`` and
    ``dequant_blas``); the plan's ``index_layout`` says which it was made for."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend, caps = _backend_and_caps(device, caps)
    return _C.plan_trellis_gemm(M, K, N, bits, group_size, _DTYPES[dtype], backend, caps, family, layout)


def plan_trellis_moe(tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, bits: int = 3,
                     group_size: int = 128, dtype=torch.float16, device="cpu", caps=None) -> dict:
    """The plan ``moe_trellis`` would execute for ``tokens`` tokens routed to ``top_k`` of
    ``num_experts`` experts (gate/up ``hidden x intermediate``, down ``intermediate x hidden``): the
    gate/up stage's launch at the top level (``kernel``, ``grid``, ``k_parallel``, ...), then
    ``down``, ``combine``, (CUDA, one-launch routing) ``route`` and (Metal, more than 16 routed rows)
    ``tiled_gate``, ``tiled_up``, ``tiled_down`` as stage dicts, all in ``launches`` in execution
    order, with the keys of
    :func:`plan_trellis` (``family``: ``decode`` when every expert's rows fit one decode tile,
    tokens * top_k <= 16; ``cuda_stream_decode``: the CUDA streaming kernel runs both stages;
    ``dependent_launch`` per stage). ``device`` and ``caps`` as for :func:`plan_gemm`."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend, caps = _backend_and_caps(device, caps)
    return _C.plan_trellis_moe(tokens, hidden, intermediate, num_experts, top_k, bits, group_size, _DTYPES[dtype],
                               backend, caps)


def trellis_index_layout(K: int, N: int, bits: int = 3, device="cpu", caps=None) -> str:
    """The layout a trellis ``K x N`` matrix's indices are kept in on ``device``: ``"lanes"`` (the
    CUDA lane layout, docs/trellis.md, made by :func:`torch_marlin.formats.trellis.tiles_to_lanes`)
    where the CUDA decode kernel reads it (K % 8 == 0), else ``"tiles"``. ``TrellisLinear`` follows
    it when it moves to a device. ``device`` and ``caps`` as for :func:`plan_gemm`."""
    backend, caps = _backend_and_caps(device, caps)
    return _C.trellis_index_layout(K, N, bits, backend, caps)


def plan_rans(M: int, K: int, N: int, group_size: int = 128, format: str = "fp4", channels_per_tile: int = 0,
              dtype=torch.float16, device="cpu", has_bias: bool = False, caps=None) -> dict:
    """The plan ``gemm_rans`` would execute: ``family`` ``"decode"`` for M <= ``fused_max_m`` (16: each
    tile's codes decoded and multiplied in one pass, kernel ``cpu_rans_gemm`` on the CPU), else
    ``"staged"`` (the layer decoded to ``B_packed`` by ``kernel``, then the dense GEMM of ``format``,
    whose own plan is under ``"gemm"``). Keys: ``family, kernel, grid, threads, cpu_avx2,
    channels_per_tile, tiles, steps_per_channel, n_groups, format, has_bias, fused_max_m`` and the caps;
    ``launches``: the ``decode`` launch, then the staged GEMM's, in execution order.
    ``channels_per_tile <= 0``: the format's default. ``device`` and ``caps`` as for :func:`plan_gemm`."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
    backend, caps = _backend_and_caps(device, caps)
    return _C.plan_rans_gemm(M, K, N, group_size, format, channels_per_tile, _DTYPES[dtype], backend, caps,
                             has_bias)
