"""INT4 with per-group zero points: ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``,
``g = k // group_size``, ``q`` and ``zeros`` in 0..15 (zeros stored as uint8 ``[K/group_size, N]``).
Symmetric signed INT4 (S4) is the special case ``zeros == 8`` (offset binary: stored = value + 8).
"""

import torch

from .int4_packing import group_view, pack_int4, unpack_int4

U4_MAX = 15
S4_ZERO = 8


def quantize_u4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                scale_dtype: torch.dtype = torch.float16):
    """Round-to-nearest INT4 of a ``[K, N]`` float weight (the transpose of ``nn.Linear.weight``).

    Asymmetric: per group, ``scale = (max - min) / 15`` and ``zero = round(-min / scale)`` so the
    group's range maps onto 0..15. Symmetric: ``zero = 8`` and ``scale = absmax / 7``.
    Returns ``(B_packed int32 [K/8, N], scales [K/group_size, N], zeros uint8 [K/group_size, N])``.
    """
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    wf = w.detach().to(torch.float32)
    g = group_view(wf, group_size)
    if symmetric:
        scales = (g.abs().amax(dim=1) / 7.0).to(scale_dtype)
        zeros = torch.full_like(scales, S4_ZERO, dtype=torch.float32)
    else:
        lo = g.amin(dim=1).clamp(max=0.0)
        hi = g.amax(dim=1).clamp(min=0.0)
        scales = ((hi - lo) / U4_MAX).to(scale_dtype)
    s = scales.to(torch.float32)
    s = torch.where(s == 0, torch.ones_like(s), s)
    if not symmetric:
        zeros = torch.round(-lo / s).clamp(0, U4_MAX)
    q = torch.round(g / s.unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, U4_MAX)
    return pack_int4(q.reshape_as(wf).to(torch.int64)), scales, zeros.to(torch.uint8)


def dequant_u4_reference(B_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]`` weight from packed INT4 codes, scales and zero points."""
    q = unpack_int4(B_packed).to(torch.float32)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (q - z) * s
