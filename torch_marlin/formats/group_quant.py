"""Per-group quantizers for the 4-bit container: least-squares scale (and zero point) search.

A quantizer maps a group of weights (``group_size`` rows of K, one column) to a scale (and zero
point) and every weight to a 4-bit code. Round to nearest with the range-fitted scale
(``absmax / 6`` for FP4, ``(max - min) / 15`` for INT4) wastes levels: a single outlier fixes the
step for the whole group. The search below tries a set of candidate scales around the
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


def _err(g: torch.Tensor, deq: torch.Tensor, weight) -> torch.Tensor:
    d = g - deq
    d = d * d
    return (d if weight is None else d * weight).sum(-2)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def _ls_scale(g: torch.Tensor, c: torch.Tensor, weight, fallback: torch.Tensor) -> torch.Tensor:
    wc = c if weight is None else c * weight
    num, den = (wc * g).sum(-2), (wc * c).sum(-2)
    return torch.where(den > 0, num / den.clamp(min=1e-30), fallback)


def _ls_affine(g: torch.Tensor, q: torch.Tensor, weight: torch.Tensor, n: torch.Tensor, sw: torch.Tensor):
    """Least-squares ``(scale, offset, ok)`` of ``g ~ scale * q + offset`` for fixed codes ``q``,
    rows weighted by ``weight`` (``n`` and ``sw``: its sum and the weighted sum of ``g``); ``ok``
    where the fit is determined and the scale positive."""
    sq, sqq, swq = (weight * q).sum(-2), (weight * q * q).sum(-2), (weight * q * g).sum(-2)
    det = n * sqq - sq * sq
    ok = det > 0
    detc = torch.where(ok, det, torch.ones_like(det))
    s = (n * swq - sq * sw) / detc
    off = (sqq * sw - sq * swq) / detc
    return s, off, ok & (s > 0)


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
        s = _safe(s)
        return self.fit_levels(g / s.unsqueeze(-2)) * s.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        bases = self.base_scales(g)
        g = self.fit_view(g)
        best = self._stored(bases[0])
        if not self.search:
            return {"scales": best}
        best_err = _err(g, self._deq(g, best), wt)
        for base in bases:
            for f in SHRINK:
                s = self._stored(base * f)
                c = self.fit_levels(g / _safe(s).unsqueeze(-2))
                s_ls = self._stored(_ls_scale(g, c, wt, s))
                for cand, deq in ((s, c * s.unsqueeze(-2)), (s_ls, None)):
                    e = _err(g, self._deq(g, cand) if deq is None else deq, wt)
                    better = e < best_err
                    best = torch.where(better, cand, best)
                    best_err = torch.where(better, e, best_err)
        return {"scales": best}

    def quantize(self, x: torch.Tensor, params: Params):
        s = _safe(params["scales"]).unsqueeze(-2)
        codes, vals = self.levels(x.to(torch.float32) / s)
        return codes, vals * s

    def row_params(self, params: Params):
        s = _safe(params["scales"])
        return s, 1.0 / s

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv = ready
        codes, vals = self.levels(x * inv)
        return codes, vals * s


class Fp4Quantizer(ScaleQuantizer):
    """E2M1 codes: nearest magnitude (ties to the smaller one), sign in bit 3."""

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        from .fp4 import E2M1_VALUES  # fp4.py imports this module
        super().__init__(scale_dtype, search)
        self._vals = E2M1_VALUES
        self._mags = E2M1_VALUES[:8]
        self._mids = (self._mags[1:] + self._mags[:-1]) / 2

    def _on(self, device) -> None:
        if self._mags.device != device:
            self._vals, self._mags, self._mids = (t.to(device) for t in (self._vals, self._mags, self._mids))

    def levels(self, x: torch.Tensor):
        self._on(x.device)
        # bucketize against the midpoints, right=False: a value on a midpoint goes to the lower bucket.
        code = torch.bucketize(x.abs().contiguous(), self._mids, right=False)
        code = code + 8 * (x < 0).to(code.dtype)
        return code, self._vals[code]

    def fit_view(self, g: torch.Tensor) -> torch.Tensor:
        return g.abs()

    def fit_levels(self, x: torch.Tensor) -> torch.Tensor:
        self._on(x.device)
        return self._mags[torch.bucketize(x.contiguous(), self._mids, right=False)]

    def base_scales(self, g: torch.Tensor):
        return (g.abs().amax(dim=-2) / 6.0,)


class SymmetricU4Quantizer(ScaleQuantizer):
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


class AsymmetricU4Quantizer:
    """``w = (q - zero) * scale``, ``q`` and ``zero`` integers in 0..15.

    Candidates (as in llama.cpp's k-quants): inverse steps ``(15 + d) / (max - min)`` for ``d`` in
    ``-1 .. 1``; for each, the codes ``q = round((w - min) * step)`` get a least-squares fit of
    ``w ~ scale * q + offset`` (two unknowns per group and column), rounded to the stored scale and
    integer zero point, and the group keeps the candidate with the smallest squared error.
    """

    STEPS = tuple(-1.0 + 0.2 * i for i in range(11))

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        self.scale_dtype, self.search = scale_dtype, search

    def _stored(self, s):
        return s.to(self.scale_dtype).to(torch.float32)

    def _deq(self, g, s, z):
        s = _safe(s)
        q = torch.round(g / s.unsqueeze(-2) + z.unsqueeze(-2)).clamp(0, 15)
        return (q - z.unsqueeze(-2)) * s.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        lo = g.amin(dim=-2).clamp(max=0.0)
        hi = g.amax(dim=-2).clamp(min=0.0)
        best_s = self._stored((hi - lo) / 15.0)
        best_z = torch.round(-lo / _safe(best_s)).clamp(0, 15)
        if not self.search:
            return {"scales": best_s, "zeros": best_z}
        best_err = _err(g, self._deq(g, best_s, best_z), wt)
        rng = hi - lo
        ones = torch.ones_like(g) if wt is None else torch.ones_like(g) * wt
        n = ones.sum(-2)
        sw = (ones * g).sum(-2)
        for d in self.STEPS:
            inv = torch.where(rng > 0, (15.0 + d) / rng.clamp(min=1e-30), torch.zeros_like(rng))
            q = torch.round((g - lo.unsqueeze(-2)) * inv.unsqueeze(-2)).clamp(0, 15)
            s, off, ok = _ls_affine(g, q, ones, n, sw)
            s = self._stored(torch.where(ok, s, best_s))
            z = torch.round(-off / _safe(s)).clamp(0, 15)
            e = _err(g, self._deq(g, s, z), wt)
            better = ok & (e < best_err)
            best_s = torch.where(better, s, best_s)
            best_z = torch.where(better, z, best_z)
            best_err = torch.where(better, e, best_err)
        return {"scales": best_s, "zeros": best_z}

    def quantize(self, x: torch.Tensor, params: Params):
        s = _safe(params["scales"]).unsqueeze(-2)
        z = params["zeros"].unsqueeze(-2)
        q = torch.round(x.to(torch.float32) / s + z).clamp(0, 15)
        return q.to(torch.int64), (q - z) * s

    def row_params(self, params: Params):
        s = _safe(params["scales"])
        return s, 1.0 / s, params["zeros"]

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv, z = ready
        q = torch.addcmul(z, x, inv).round_().clamp_(0, 15)
        return q, (q - z).mul_(s)


def u4_quantizer(symmetric: bool, scale_dtype: torch.dtype = torch.float16, search: bool = True):
    return (SymmetricU4Quantizer if symmetric else AsymmetricU4Quantizer)(scale_dtype, search)


class AffineQuantizer:
    """``w = scale * q + offset``, ``q`` an integer in 0..15, ``scale`` and ``offset`` floats stored in
    the scale dtype (the offset need not be a multiple of the scale, unlike INT4's zero point).

    Range fit: ``scale = (max - min) / 15``, ``offset = min``. The search tries the inverse steps
    ``(15 + d) / (max - min)`` of :class:`AsymmetricU4Quantizer`; for each, the codes
    ``q = round((w - min) * step)`` get a least-squares fit of ``w ~ scale * q + offset`` and a
    second fit on the codes the first one's (stored) parameters give; a candidate replaces the range
    fit where its squared error, measured with the parameters as stored, is smaller.
    """

    STEPS = AsymmetricU4Quantizer.STEPS

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        self.scale_dtype, self.search = scale_dtype, search

    def _stored(self, s):
        return s.to(self.scale_dtype).to(torch.float32)

    @staticmethod
    def _codes(g, s, b):
        return torch.round((g - b.unsqueeze(-2)) / _safe(s).unsqueeze(-2)).clamp(0, 15)

    def _deq(self, g, s, b):
        return self._codes(g, s, b) * s.unsqueeze(-2) + b.unsqueeze(-2)

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Params:
        g = g.to(torch.float32)
        wt = weight
        lo, hi = g.amin(dim=-2), g.amax(dim=-2)
        best_s, best_b = self._stored((hi - lo) / 15.0), self._stored(lo)
        if not self.search:
            return {"scales": best_s, "offsets": best_b}
        best_err = _err(g, self._deq(g, best_s, best_b), wt)
        rng = hi - lo
        ones = torch.ones_like(g) if wt is None else torch.ones_like(g) * wt
        n, sw = ones.sum(-2), (ones * g).sum(-2)
        for d in self.STEPS:
            inv = torch.where(rng > 0, (15.0 + d) / rng.clamp(min=1e-30), torch.zeros_like(rng))
            q = torch.round((g - lo.unsqueeze(-2)) * inv.unsqueeze(-2)).clamp(0, 15)
            for _ in range(2):
                s, off, ok = _ls_affine(g, q, ones, n, sw)
                s, b = self._stored(torch.where(ok, s, best_s)), self._stored(torch.where(ok, off, best_b))
                q = self._codes(g, s, b)
                e = _err(g, q * s.unsqueeze(-2) + b.unsqueeze(-2), wt)
                better = ok & (e < best_err)
                best_s = torch.where(better, s, best_s)
                best_b = torch.where(better, b, best_b)
                best_err = torch.where(better, e, best_err)
        return {"scales": best_s, "offsets": best_b}

    def quantize(self, x: torch.Tensor, params: Params):
        s, b = params["scales"], params["offsets"]
        q = self._codes(x.to(torch.float32), s, b)
        return q.to(torch.int64), q * s.unsqueeze(-2) + b.unsqueeze(-2)

    def row_params(self, params: Params):
        s = params["scales"]
        return s, 1.0 / _safe(s), params["offsets"]

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv, b = ready
        q = (x - b).mul_(inv).round_().clamp_(0, 15)
        return q, torch.addcmul(b, q, s)
