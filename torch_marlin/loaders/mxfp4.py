"""OCP MXFP4 (gpt-oss checkpoints) to MarlinLinear ``fp4``.

MXFP4 is E2M1 codes (the table in torch_marlin/formats/fp4.py: codes 0..7 are 0, 0.5, 1, 1.5, 2,
3, 4, 6 and bit 3 is the sign) with one E8M0 scale per 32 values: a byte ``e`` meaning
``2^(e - 127)``. gpt-oss stores a weight ``[N, K]`` as ``<name>_blocks`` uint8
``[N, K/32, 16]`` (two codes per byte, the even element in the low nibble) and ``<name>_scales``
uint8 ``[N, K/32]``. The scales are powers of two, so they are exact in bfloat16 (the default
dtype here) for every E8M0 value but 255 (NaN); float16 holds only ``2^-24 .. 2^15`` and a
scale outside that raises instead of rounding.
"""

from typing import Optional

import torch

from .common import CheckpointError, build_marlin_linear

MXFP4_GROUP = 32
E8M0_BIAS = 127


def e8m0_to_float(e: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 ``2^(e - 127)``; 255 (NaN in E8M0) raises."""
    if not isinstance(e, torch.Tensor) or e.dtype != torch.uint8:
        raise CheckpointError(f"{name}: expected uint8 E8M0 exponents, got {getattr(e, 'dtype', type(e).__name__)}")
    if e.numel() and int(e.max()) == 255:
        raise CheckpointError(f"{name}: E8M0 value 255 is NaN")
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32) - E8M0_BIAS)


def byte_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., B]`` of two codes per byte (low nibble first) -> uint8 ``[..., 2B]``."""
    return torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = torch.bfloat16, name: str = "weight"):
    """MarlinLinear ``fp4`` (group size 32) from gpt-oss's ``blocks`` uint8 ``[N, K/32, 16]`` (or the
    flattened ``[N, K/2]``) and ``scales`` uint8 ``[N, K/32]``."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() not in (2, 3):
        raise CheckpointError(f"{name}: blocks must be uint8 [N, K/32, 16] or [N, K/2], got "
                              f"{getattr(blocks, 'dtype', type(blocks).__name__)} {tuple(getattr(blocks, 'shape', ()))}")
    if blocks.dim() == 3 and blocks.shape[2] != MXFP4_GROUP // 2:
        raise CheckpointError(f"{name}: blocks must be [N, K/32, 16], got {tuple(blocks.shape)}")
    N = blocks.shape[0]
    codes = byte_codes(blocks.reshape(N, -1))
    K = codes.shape[1]
    if K % MXFP4_GROUP != 0 or not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (N, K // MXFP4_GROUP):
        raise CheckpointError(f"{name}: scales must be uint8 ({N}, {K // MXFP4_GROUP}) for blocks of shape "
                              f"{tuple(blocks.shape)} (K={K}), got {tuple(getattr(scales, 'shape', ()))}")
    return build_marlin_linear("fp4", codes, e8m0_to_float(scales, f"{name}: scales"), bias=bias, dtype=dtype,
                               name=name)
