"""The quantized ``nn.Module`` layers: :class:`MarlinLinear` (FP4 / INT4 weights) and the trellis
codebook layers :class:`TrellisLinear` and :class:`TrellisMoE`."""

from .marlin import MarlinLinear
from .trellis import TrellisLinear, TrellisMoE

__all__ = ["MarlinLinear", "TrellisLinear", "TrellisMoE"]
