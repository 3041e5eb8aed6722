"""Loaders for quantized checkpoints made by other tools, without requantizing: each maps one
source format's tensors onto :class:`torch_marlin.MarlinLinear` (docs/formats.md says how).

One module per source format, each with a function building one layer from that source's tensors
(re-exported here); :func:`from_pretrained` loads a whole model directory or file.
"""

from .awq import from_awq
from .common import CheckpointError, build_marlin_linear
from .compressed_tensors import from_compressed_tensors
from .gguf import from_gguf
from .gptq import marlin_linear_from_gptq
from .mlx import from_mlx
from .mxfp4 import from_mxfp4

__all__ = ["CheckpointError", "build_marlin_linear", "from_awq", "from_compressed_tensors", "from_gguf",
           "from_mlx", "from_mxfp4", "marlin_linear_from_gptq"]
