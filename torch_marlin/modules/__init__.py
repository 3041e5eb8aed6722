"""The quantized ``nn.Module`` layers: :class:`MarlinLinear` (FP4 / INT4 weights), its rANS-coded
form :class:`RansLinear`, and the trellis codebook layers :class:`TrellisLinear` and
:class:`TrellisMoE`."""

from .marlin import MarlinLinear
from .rans import RansLinear
from .trellis import TrellisLinear, TrellisMoE

__all__ = ["MarlinLinear", "RansLinear", "TrellisLinear", "TrellisMoE"]
