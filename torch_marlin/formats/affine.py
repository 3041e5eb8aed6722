"""The ``affine`` format, INT4 with per-group float offsets:
``w[k, n] = scales[g, n] * q[k, n] + offsets[g, n]``, ``g = k // group_size``, ``q`` in 0..15
packed as for INT4 (torch_marlin/formats/int4_packing.py), ``scales`` and ``offsets``
``[K/group_size, N]`` floats of one dtype. The format of MLX's 4-bit affine quantization, HQQ,
GGUF Q4_1, and GPTQ / AWQ with ``offset = -zero * scale``.
"""

from typing import Optional

import torch

from .gptq_solver import quantize_weight
from .group_quant import (RANGE_STEPS, Params, keep_better, least_squares_affine, nonzero_scale, range_step_codes,
                          row_weights, weighted_error)
from .int4_packing import pack_int4, unpack_int4


class AffineQuantizer:
    """``w = scale * q + offset``, ``q`` an integer in 0..15, ``scale`` and ``offset`` floats stored in
    the scale dtype (the offset need not be a multiple of the scale, unlike INT4's zero point).

    Range fit: ``scale = (max - min) / 15``, ``offset = min``. The search tries the inverse steps
    ``(15 + d) / (max - min)`` of :class:`torch_marlin.formats.u4.ZeroPointQuantizer`; for each, the codes
    ``q = round((w - min) * step)`` get a least-squares fit of ``w ~ scale * q + offset`` and a
    second fit on the codes the first one's (stored) parameters give; a candidate replaces the range
    fit where its squared error, measured with the parameters as stored, is smaller.
    """

    STEPS = RANGE_STEPS

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        self.scale_dtype, self.search = scale_dtype, search

    def _stored(self, s):
        return s.to(self.scale_dtype).to(torch.float32)

    @staticmethod
    def _codes(g, s, b):
        return torch.round((g - b.unsqueeze(-2)) / nonzero_scale(s).unsqueeze(-2)).clamp(0, 15)

    def _deq(self, g, s, b):
        return self._codes(g, s, b) * s.unsqueeze(-2) + b.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        lo, hi = g.amin(dim=-2), g.amax(dim=-2)
        best_s, best_b = self._stored((hi - lo) / 15.0), self._stored(lo)
        if not self.search:
            return {"scales": best_s, "offsets": best_b}
        best_err = weighted_error(g, self._deq(g, best_s, best_b), wt)
        rows, n, sw = row_weights(g, wt)
        for d in self.STEPS:
            q = range_step_codes(g, lo, hi - lo, d)
            for _ in range(2):
                s, off, ok = least_squares_affine(g, q, rows, n, sw)
                s, b = self._stored(torch.where(ok, s, best_s)), self._stored(torch.where(ok, off, best_b))
                q = self._codes(g, s, b)
                e = weighted_error(g, q * s.unsqueeze(-2) + b.unsqueeze(-2), wt)
                best_s, best_b, best_err = keep_better(ok & (e < best_err), (best_s, best_b, best_err), (s, b, e))
        return {"scales": best_s, "offsets": best_b}

    def quantize(self, x: torch.Tensor, params: Params):
        s, b = params["scales"], params["offsets"]
        q = self._codes(x.to(torch.float32), s, b)
        return q.to(torch.int64), q * s.unsqueeze(-2) + b.unsqueeze(-2)

    def row_params(self, params: Params):
        s = params["scales"]
        return s, 1.0 / nonzero_scale(s), params["offsets"]

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv, b = ready
        q = (x - b).mul_(inv).round_().clamp_(0, 15)
        return q, torch.addcmul(b, q, s)


def quantize_affine(w: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float16,
                    search: bool = True, hessian: Optional[torch.Tensor] = None, **gptq_options):
    """Affine INT4 of a ``[K, N]`` float weight (the transpose of ``nn.Linear.weight``), per group
    along K.

    ``search=False``: the group's range, ``scale = (max - min) / 15``, ``offset = min``;
    ``search=True`` (default) refines ``(scale, offset)`` by least squares over candidate steps
    (:class:`AffineQuantizer`). ``hessian`` ``[K, K]`` switches to
    GPTQ error feedback (torch_marlin/formats/gptq_solver.py; ``gptq_options``: ``act_order``,
    ``damp``, ``block_size``; ``progress``: a tqdm bar, also without ``hessian``).
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
