"""MLX quantized linear layers (``mx.quantize`` / ``nn.QuantizedLinear``) to MarlinLinear.

MLX stores ``weight`` as uint32 ``[N, K*bits/32]``, each word holding ``32/bits`` codes along K,
least significant first: for 4 bits that is our container's order along K, per output row.

* ``mode="affine"`` (MLX's default): ``w = scales * q + biases`` with float ``scales`` and
  ``biases`` ``[N, K/group_size]``: our ``affine`` format, ``offsets = biases``.
* ``mode="mxfp4"``: E2M1 codes (the same table as ours) and uint8 E8M0 ``scales``
  ``[N, K/32]`` (``2^(e - 127)``), no biases: our ``fp4`` format (see :mod:`.mxfp4`).
"""

from typing import Optional

import torch

from .common import CheckpointError, build_marlin_linear, unpack_words
from .mxfp4 import e8m0_to_float

MODES = ("affine", "mxfp4")


def _as_int32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if t.dtype == torch.int32:
        return t
    if getattr(torch, "uint32", None) is not None and t.dtype == torch.uint32:
        return t.view(torch.int32)
    raise CheckpointError(f"{name}: expected MLX's uint32 words as an int32 (or uint32) tensor, got {t.dtype}")


def mlx_codes(weight: torch.Tensor, bits: int = 4, name: str = "weight") -> torch.Tensor:
    """uint8 codes ``[N, K]`` from MLX's packed ``weight`` ``[N, K*bits/32]``."""
    if bits != 4:
        raise ValueError(f"{name}: bits must be 4 (MarlinLinear holds 4-bit codes), got {bits}")
    w = _as_int32(weight, name)
    if w.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D tensor [N, K*bits/32], got shape {tuple(w.shape)}")
    return unpack_words(w)


def from_mlx(weight: torch.Tensor, scales: torch.Tensor, biases: Optional[torch.Tensor], group_size: int,
             bits: int = 4, bias: Optional[torch.Tensor] = None, mode: str = "affine",
             dtype: Optional[torch.dtype] = None, name: str = "weight"):
    """MarlinLinear from one MLX quantized layer's tensors (as torch tensors; ``weight`` is MLX's
    uint32 viewed as int32 or as torch.uint32). ``bias``: the layer's own bias ``[N]``, if any.
    ``dtype``: scales/offsets/bias dtype (default: the scales' 16-bit dtype, else float16)."""
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
    codes = mlx_codes(weight, bits, name)
    N, K = codes.shape
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size != 0:
        raise ValueError(f"{name}: group_size must be a positive divisor of K={K}, got {group_size!r}")
    G = K // group_size
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (N, G):
        raise CheckpointError(f"{name}: scales must have shape ({N}, {G}) for K={K} and group_size={group_size}, "
                              f"got {tuple(getattr(scales, 'shape', ()))}")
    if mode == "mxfp4":
        if biases is not None:
            raise CheckpointError(f"{name}: mode='mxfp4' has no biases, got a tensor")
        if group_size != 32:
            raise ValueError(f"{name}: mode='mxfp4' has group_size 32, got {group_size}")
        s = e8m0_to_float(scales, f"{name}: scales")
        return build_marlin_linear("fp4", codes, s, bias=bias, dtype=dtype or torch.bfloat16, name=name)
    if biases is None:
        raise CheckpointError(f"{name}: mode='affine' needs biases [N, K/group_size], got None")
    return build_marlin_linear("affine", codes, scales, offsets=biases, bias=bias, dtype=dtype, name=name)
