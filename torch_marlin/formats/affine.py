"""Affine INT4: ``w[k, n] = scales[g, n] * q[k, n] + offsets[g, n]``, ``g = k // group_size``,
``q`` in 0..15 packed as for INT4 (torch_marlin/formats/int4_packing.py), ``scales`` and ``offsets``
``[K/group_size, N]`` floats of one dtype. The format of MLX's 4-bit affine quantization, HQQ,
GGUF Q4_1, and GPTQ / AWQ with ``offset = -zero * scale``.
"""

from typing import Optional

import torch

from .gptq_solver import quantize_weight
from .group_quant import AffineQuantizer
from .int4_packing import pack_int4, unpack_int4


def quantize_affine(w: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float16,
                    search: bool = True, hessian: Optional[torch.Tensor] = None, **gptq_options):
    """Affine INT4 of a ``[K, N]`` float weight (the transpose of ``nn.Linear.weight``), per group
    along K.

    ``search=False``: the group's range, ``scale = (max - min) / 15``, ``offset = min``;
    ``search=True`` (default) refines ``(scale, offset)`` by least squares over candidate steps
    (:class:`torch_marlin.formats.group_quant.AffineQuantizer`). ``hessian`` ``[K, K]`` switches to
    GPTQ error feedback (torch_marlin/formats/gptq_solver.py; ``gptq_options``: ``act_order``,
    ``damp``, ``block_size``).
    Returns ``(B_packed int32 [K/8, N], scales [K/group_size, N], offsets [K/group_size, N])``,
    scales and offsets in ``scale_dtype``.
    """
    q, params = quantize_weight(w, group_size, AffineQuantizer(scale_dtype, search), hessian, **gptq_options)
    return pack_int4(q), params["scales"].to(scale_dtype), params["offsets"].to(scale_dtype)


def dequant_affine_reference(B_packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                             group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]`` weight: ``q * scale + offset`` formed exactly (float64) and rounded once
    to fp32, the value of the kernels' fused multiply-add."""
    q = unpack_int4(B_packed).to(torch.float64)
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=0)
    b = offsets.to(torch.float64).repeat_interleave(group_size, dim=0)
    return (q * s + b).to(torch.float32)
