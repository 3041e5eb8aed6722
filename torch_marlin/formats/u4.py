"""The ``u4`` format, INT4 with per-group integer zero points:
``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``, ``g = k // group_size``, ``q`` and ``zeros``
in 0..15 (zeros stored as uint8 ``[K/group_size, N]``).
Symmetric signed INT4 (S4) is the special case ``zeros == 8`` (offset binary: stored = value + 8).
"""

from typing import Optional

import torch

from .gptq_solver import quantize_weight
from .group_quant import (RANGE_STEPS, Params, ScaleQuantizer, keep_better, least_squares_affine, nonzero_scale,
                          range_step_codes, row_weights, weighted_error)
from .int4_packing import pack_int4, unpack_int4


class SymmetricZeroPointQuantizer(ScaleQuantizer):
    """Signed INT4 as offset binary (zero point 8): levels ``-8 .. 7`` times the scale.

    The first candidate family is the 16-level rule: ``scale = m / -8`` with ``m`` the group's
    value of largest magnitude (its sign kept), so ``m`` lands exactly on level -8 and all 16 levels
    are in use; the scale is negative when ``m`` is positive. ``absmax / 7`` (15 levels) is the
    second family the search tries.
    """

    def levels(self, x: torch.Tensor):
        q = torch.round(x).clamp(-8, 7)
        return (q + 8).to(torch.int64), q

    def base_scales(self, g: torch.Tensor):
        idx = g.abs().argmax(dim=-2, keepdim=True)
        m = torch.gather(g, -2, idx).squeeze(-2)
        bases = (m / -8.0,)
        if self.search:
            bases += (g.abs().amax(dim=-2) / 7.0,)
        return bases

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        p = super().fit(g, weight)
        p["zeros"] = torch.full_like(p["scales"], 8.0)
        return p


class ZeroPointQuantizer:
    """``w = (q - zero) * scale``, ``q`` and ``zero`` integers in 0..15.

    Candidates (as in llama.cpp's k-quants): inverse steps ``(15 + d) / (max - min)`` for ``d`` in
    ``-1 .. 1``; for each, the codes ``q = round((w - min) * step)`` get a least-squares fit of
    ``w ~ scale * q + offset`` (two unknowns per group and column), rounded to the stored scale and
    integer zero point, and the group keeps the candidate with the smallest squared error.
    """

    STEPS = RANGE_STEPS

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        self.scale_dtype, self.search = scale_dtype, search

    def _stored(self, s):
        return s.to(self.scale_dtype).to(torch.float32)

    def _deq(self, g, s, z):
        s = nonzero_scale(s)
        q = torch.round(g / s.unsqueeze(-2) + z.unsqueeze(-2)).clamp(0, 15)
        return (q - z.unsqueeze(-2)) * s.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        lo = g.amin(dim=-2).clamp(max=0.0)
        hi = g.amax(dim=-2).clamp(min=0.0)
        best_s = self._stored((hi - lo) / 15.0)
        best_z = torch.round(-lo / nonzero_scale(best_s)).clamp(0, 15)
        if not self.search:
            return {"scales": best_s, "zeros": best_z}
        best_err = weighted_error(g, self._deq(g, best_s, best_z), wt)
        rows, n, sw = row_weights(g, wt)
        for d in self.STEPS:
            q = range_step_codes(g, lo, hi - lo, d)
            s, off, ok = least_squares_affine(g, q, rows, n, sw)
            s = self._stored(torch.where(ok, s, best_s))
            z = torch.round(-off / nonzero_scale(s)).clamp(0, 15)
            e = weighted_error(g, self._deq(g, s, z), wt)
            best_s, best_z, best_err = keep_better(ok & (e < best_err), (best_s, best_z, best_err), (s, z, e))
        return {"scales": best_s, "zeros": best_z}

    def quantize(self, x: torch.Tensor, params: Params):
        s = nonzero_scale(params["scales"]).unsqueeze(-2)
        z = params["zeros"].unsqueeze(-2)
        q = torch.round(x.to(torch.float32) / s + z).clamp(0, 15)
        return q.to(torch.int64), (q - z) * s

    def row_params(self, params: Params):
        s = nonzero_scale(params["scales"])
        return s, 1.0 / s, params["zeros"]

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv, z = ready
        q = torch.addcmul(z, x, inv).round_().clamp_(0, 15)
        return q, (q - z).mul_(s)


def zero_point_quantizer(symmetric: bool, scale_dtype: torch.dtype = torch.float16, search: bool = True):
    return (SymmetricZeroPointQuantizer if symmetric else ZeroPointQuantizer)(scale_dtype, search)


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
    ``gptq_options``: ``act_order``, ``damp``, ``block_size``; ``progress``: a tqdm bar, also without ``hessian``).
    Returns ``(B_packed int32 [K/8, N], scales [K/group_size, N], zeros uint8 [K/group_size, N])``.
    """
    q, params = quantize_weight(w, group_size, zero_point_quantizer(symmetric, scale_dtype, search), hessian, **gptq_options)
    return pack_int4(q), params["scales"].to(scale_dtype), params["zeros"].to(torch.uint8)


def dequant_u4_reference(B_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]`` weight from packed INT4 codes, scales and zero points."""
    q = unpack_int4(B_packed).to(torch.float32)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (q - z) * s
