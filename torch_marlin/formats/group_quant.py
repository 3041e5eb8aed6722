"""Per-group quantizers for the 4-bit container: the least-squares scale (and zero point) search
shared by the formats' quantizers (``Fp4Quantizer`` in fp4.py, the INT4 ones in u4.py,
``AffineQuantizer`` in affine.py).

A quantizer maps a group of weights (``group_size`` rows of K, one column) to a scale (and zero
point) and every weight to a 4-bit code. Round to nearest with the range-fitted scale
(``absmax / 6`` for FP4, ``(max - min) / 15`` for INT4) wastes levels: a single outlier fixes the
step for the whole group. The search tries a set of candidate scales around the
range-fitted one, refits each candidate by least squares on the codes it produced
(``s = <w, c> / <c, c>``, the optimum for fixed codes), and keeps, per group and column, the
scale with the smallest squared error measured with the scale *as stored* (rounded to the scale
dtype). The range-fitted scale is always a candidate, so the search never does worse than it.

Each quantizer has two halves, used by round to nearest and by GPTQ (torch_marlin/formats/gptq_solver.py) alike:

* ``fit(g, weight)``: per-group parameters from ``g`` ``[G, S, N]`` (``S`` rows of a group);
  ``weight`` (broadcastable to ``g``, optional) weighs the squared error per row, e.g. the
  diagonal of the input Hessian;
* ``quantize(x, params)``: codes and dequantized values of ``x`` ``[G, S, N]`` (or ``[S, N]`` rows
  of one group with params of shape ``[N]``).
"""

from typing import Dict, Optional

import torch

Params = Dict[str, torch.Tensor]

# Candidate scales as fractions of the range-fitted one. Shrinking clips the group's extremes to the
# top level in exchange for finer steps everywhere else; growing past the range never helps.
SHRINK = tuple(0.72 + 0.04 * i for i in range(8))  # 0.72 .. 1.00
# Offsets ``d`` of the inverse steps ``(15 + d) / (max - min)`` the zero-point and affine INT4 searches try.
RANGE_STEPS = tuple(-1.0 + 0.2 * i for i in range(11))


def weighted_error(g: torch.Tensor, deq: torch.Tensor, weight) -> torch.Tensor:
    d = g - deq
    d = d * d
    return (d if weight is None else d * weight).sum(-2)


def nonzero_scale(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def least_squares_scale(g: torch.Tensor, c: torch.Tensor, weight, fallback: torch.Tensor) -> torch.Tensor:
    wc = c if weight is None else c * weight
    num, den = (wc * g).sum(-2), (wc * c).sum(-2)
    return torch.where(den > 0, num / den.clamp(min=1e-30), fallback)


def least_squares_affine(g: torch.Tensor, q: torch.Tensor, weight: Optional[torch.Tensor], n: torch.Tensor,
                         sw: torch.Tensor):
    """Least-squares ``(scale, offset, ok)`` of ``g ~ scale * q + offset`` for fixed codes ``q``,
    rows weighted by ``weight`` (None: all 1; ``n`` and ``sw``: its sum and the weighted sum of
    ``g``); ``ok`` where the fit is determined and the scale positive."""
    wq = q if weight is None else weight * q
    sq, sqq, swq = wq.sum(-2), (wq * q).sum(-2), (wq * g).sum(-2)
    det = n * sqq - sq * sq
    ok = det > 0
    detc = torch.where(ok, det, torch.ones_like(det))
    s = (n * swq - sq * sw) / detc
    off = (sqq * sw - sq * swq) / detc
    return s, off, ok & (s > 0)


def row_weights(g: torch.Tensor, weight) -> tuple:
    """``(weights broadcast to g or None when all 1, their sum, the weighted sum of g)`` over each
    group's rows: the sums :func:`least_squares_affine` takes."""
    if weight is None:
        reduced = g.shape[:-2] + g.shape[-1:]
        return None, torch.full(reduced, float(g.shape[-2]), dtype=g.dtype, device=g.device), g.sum(-2)
    w = torch.ones_like(g) * weight
    return w, w.sum(-2), (w * g).sum(-2)


def range_step_codes(g: torch.Tensor, lo: torch.Tensor, rng: torch.Tensor, d: float) -> torch.Tensor:
    """Codes ``round((g - lo) * (15 + d) / rng)`` in 0..15 of one candidate inverse step (all 0 in
    a group whose range ``rng`` is 0)."""
    inv = torch.where(rng > 0, (15.0 + d) / rng.clamp(min=1e-30), torch.zeros_like(rng))
    return torch.round((g - lo.unsqueeze(-2)) * inv.unsqueeze(-2)).clamp(0, 15)


def keep_better(better: torch.Tensor, best: tuple, candidate: tuple) -> tuple:
    """Per group and column, the ``candidate`` tensors where ``better``, else the ``best`` ones."""
    return tuple(torch.where(better, c, b) for c, b in zip(candidate, best))


class ScaleQuantizer:
    """``w = level(code) * scale``: a fixed set of levels and one scale per group and column.

    Subclasses define ``levels(x) -> (codes, level values)`` for normalized values ``x`` and
    ``base_scales(g)``: the range-fitted candidate families (each ``[G, N]``).
    """

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        self.scale_dtype, self.search = scale_dtype, search

    def levels(self, x: torch.Tensor):
        raise NotImplementedError

    def fit_view(self, g: torch.Tensor) -> torch.Tensor:
        """What the search measures the error on (FP4: magnitudes, since its levels are symmetric
        and its scales positive)."""
        return g

    def fit_levels(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest level values of ``fit_view`` inputs (no codes needed while searching)."""
        return self.levels(x)[1]

    def base_scales(self, g: torch.Tensor):
        raise NotImplementedError

    def _stored(self, s: torch.Tensor) -> torch.Tensor:
        return s.to(self.scale_dtype).to(torch.float32)

    def _deq(self, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        s = nonzero_scale(s)
        return self.fit_levels(g / s.unsqueeze(-2)) * s.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        bases = self.base_scales(g)
        g = self.fit_view(g)
        best = self._stored(bases[0])
        if not self.search:
            return {"scales": best}
        best_err = weighted_error(g, self._deq(g, best), wt)
        for base in bases:
            for f in SHRINK:
                s = self._stored(base * f)
                c = self.fit_levels(g / nonzero_scale(s).unsqueeze(-2))
                s_ls = self._stored(least_squares_scale(g, c, wt, s))
                for cand, deq in ((s, c * s.unsqueeze(-2)), (s_ls, None)):
                    e = weighted_error(g, self._deq(g, cand) if deq is None else deq, wt)
                    best, best_err = keep_better(e < best_err, (best, best_err), (cand, e))
        return {"scales": best}

    def quantize(self, x: torch.Tensor, params: Params):
        s = nonzero_scale(params["scales"]).unsqueeze(-2)
        codes, vals = self.levels(x.to(torch.float32) / s)
        return codes, vals * s

    def row_params(self, params: Params):
        s = nonzero_scale(params["scales"])
        return s, 1.0 / s

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv = ready
        codes, vals = self.levels(x * inv)
        return codes, vals * s
