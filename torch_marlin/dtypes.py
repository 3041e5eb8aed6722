"""The float dtypes a quantized layer's scales, offsets and bias may have: the one check every layer
constructor, ``patch_model`` and the checkpoint loaders use."""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_float_dtype(dtype, name: str = "dtype") -> None:
    """ValueError unless ``dtype`` is float16, bfloat16 or float32. An integer or bool dtype would
    round every scale to 0, and the layer would output only its bias."""
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
