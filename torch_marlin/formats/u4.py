"""INT4 with per-group zero points: ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``,
``g = k // group_size``, ``q`` and ``zeros`` in 0..15 (zeros stored as uint8 ``[K/group_size, N]``).
Symmetric signed INT4 (S4) is the special case ``zeros == 8`` (offset binary: stored = value + 8).
"""

from typing import Optional

import torch

from .gptq_solver import quantize_weight
from .group_quant import u4_quantizer
from .int4_packing import pack_int4, unpack_int4

U4_MAX = 15
S4_ZERO = 8


def quantize_u4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                scale_dtype: torch.dtype = torch.float16, search: bool = True,
                hessian: Optional[torch.Tensor] = None, **gptq_options):
    """INT4 of a ``[K, N]`` float weight (the transpose of ``nn.Linear.weight``), per group along K.

    Asymmetric: per group a scale and an integer zero point with the group's range inside
    ``0..15``; ``search=True`` (default) fits both by least squares over candidate steps
    (torch_marlin/formats/group_quant.py), ``search=False`` is ``scale = (max - min) / 15``,
    ``zero = round(-min / scale)``. Symmetric: ``zero = 8`` and all 16 levels ``-8..7``:
    ``scale = m / -8`` with ``m`` the group's largest-magnitude value (sign kept; the scale is
    negative when ``m > 0``), refined by the same search unless ``search=False``.
    ``hessian`` ``[K, K]`` switches to GPTQ error feedback (torch_marlin/formats/gptq_solver.py;
    ``gptq_options``: ``act_order``, ``damp``, ``block_size``).
    Returns ``(B_packed int32 [K/8, N], scales [K/group_size, N], zeros uint8 [K/group_size, N])``.
    """
    q, params = quantize_weight(w, group_size, u4_quantizer(symmetric, scale_dtype, search), hessian, **gptq_options)
    return pack_int4(q), params["scales"].to(scale_dtype), params["zeros"].to(torch.uint8)


def dequant_u4_reference(B_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]`` weight from packed INT4 codes, scales and zero points."""
    q = unpack_int4(B_packed).to(torch.float32)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (q - z) * s
