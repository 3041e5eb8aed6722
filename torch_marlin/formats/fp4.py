"""FP4 E2M1 weights: ``w[k, n] = e2m1(code[k, n]) * scales[k // group_size, n]``.

E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit) codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the same magnitudes negated.
"""

from typing import Optional

import torch

from .gptq_solver import quantize_weight
from .group_quant import ScaleQuantizer
from .int4_packing import pack_int4, unpack_int4

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)


def _nearest_magnitude_table() -> torch.Tensor:
    """Code of the nearest E2M1 magnitude (ties to the smaller one) of ``x >= 0``, indexed by
    ``ceil(4 x)`` clamped to 0..21. Every midpoint between magnitudes (0.25, 0.75, ..., 3.5, 5) is
    a multiple of 1/4, so ``x`` lies above midpoint ``m`` exactly when ``ceil(4 x) > 4 m``: the
    code is the number of midpoints below that index. One lookup in place of a binary search."""
    mags = E2M1_VALUES[:8]
    mids4 = (mags[1:] + mags[:-1]) * 2  # 4 * midpoint: 1, 3, 5, 7, 10, 14, 20
    return (torch.arange(22, dtype=torch.float32).unsqueeze(1) > mids4).sum(1)


class Fp4Quantizer(ScaleQuantizer):
    """E2M1 codes: nearest magnitude (ties to the smaller one), sign in bit 3."""

    def __init__(self, scale_dtype: torch.dtype = torch.float16, search: bool = True):
        super().__init__(scale_dtype, search)
        self._vals = E2M1_VALUES
        self._codes = _nearest_magnitude_table()
        self._mags = E2M1_VALUES[:8][self._codes]

    def _on(self, device) -> None:
        if self._mags.device != device:
            self._vals, self._codes, self._mags = (t.to(device) for t in (self._vals, self._codes, self._mags))

    @staticmethod
    def _index(x: torch.Tensor) -> torch.Tensor:
        """``ceil(4 x)`` in 0..21 (4x is exact in float32; x <= 0 gives 0, magnitude 0)."""
        return torch.mul(x, 4).ceil_().clamp_(0, 21).to(torch.int32)

    def levels(self, x: torch.Tensor):
        self._on(x.device)
        code = self._codes[self._index(x.abs())]
        code = code + 8 * (x < 0).to(code.dtype)
        return code, self._vals[code]

    def fit_view(self, g: torch.Tensor) -> torch.Tensor:
        return g.abs()

    def fit_levels(self, x: torch.Tensor) -> torch.Tensor:
        self._on(x.device)
        return self._mags[self._index(x)]

    def base_scales(self, g: torch.Tensor):
        return (g.abs().amax(dim=-2) / 6.0,)


def pack_fp4_weights(codes: torch.Tensor) -> torch.Tensor:
    """Packs E2M1 codes ``[K, N]`` (0..15) into the int32 ``[K/8, N]`` container."""
    return pack_int4(codes)


def quantize_fp4(w: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float16,
                 search: bool = True, hessian: Optional[torch.Tensor] = None, **gptq_options):
    """Quantizes a ``[K, N]`` float weight (the transpose of ``nn.Linear.weight``) to FP4 E2M1.

    Per group of ``group_size`` rows along K and per column, a scale; each value then rounds to the
    nearest E2M1 magnitude (ties to the smaller) with its sign. ``search=True`` (default) picks
    each scale by a least-squares search around ``absmax / 6`` (torch_marlin/formats/group_quant.py);
    ``search=False`` is plain ``absmax / 6``. ``hessian`` ``[K, K]`` (the layer's input second
    moment ``X^T X``) switches to GPTQ error feedback (torch_marlin/formats/gptq_solver.py;
    ``gptq_options``: ``act_order``, ``damp``, ``block_size``; ``progress``: a tqdm bar, also without ``hessian``).
    Returns ``(B_packed int32 [K/8, N], scales [K/group_size, N] of scale_dtype)``.
    """
    code, params = quantize_weight(w, group_size, Fp4Quantizer(scale_dtype, search), hessian, **gptq_options)
    return pack_int4(code), params["scales"].to(scale_dtype)


def dequant_fp4_reference(B_packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]`` weight from packed FP4 codes and per-group scales."""
    codes = unpack_int4(B_packed).to(torch.int64)
    vals = E2M1_VALUES.to(B_packed.device)[codes]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return vals * s
