"""Loaders for quantized checkpoints made by other tools, without requantizing: each maps one
source format's tensors onto :class:`torch_marlin.MarlinLinear` (docs/formats.md says how).

One module per source format; :func:`from_pretrained` loads a whole model directory or file.
"""

from .common import CheckpointError, build_marlin_linear

__all__ = ["CheckpointError", "build_marlin_linear"]
