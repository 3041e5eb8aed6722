"""The 4-bit container shared by FP4 and INT4: int32 ``[K/8, N]``, 8 codes along K per word,
LSB first (bits 0-3 hold row k+0, bits 28-31 row k+7). This is GPTQ's ``qweight`` layout."""

from typing import Optional

import torch

PACK_FACTOR = 8


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packs 4-bit codes ``[K, N]`` (any integer dtype, values 0..15) into int32 ``[K/8, N]``."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [K, N], got shape {tuple(codes.shape)}")
    K, N = codes.shape
    if K % PACK_FACTOR != 0:
        raise ValueError(f"K (codes.shape[0]) must be a multiple of 8, got {K}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise ValueError("codes must be in 0..15")
    c = c.reshape(K // PACK_FACTOR, PACK_FACTOR, N)
    shifts = (4 * torch.arange(PACK_FACTOR, dtype=torch.int64, device=codes.device)).view(1, PACK_FACTOR, 1)
    words = (c << shifts).sum(dim=1)
    # Reinterpret as two's-complement int32 (torch has no uint32 arithmetic on every backend).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[K/8, N]`` -> uint8 codes ``[K, N]``."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    KW, N = packed.shape
    shifts = (4 * torch.arange(PACK_FACTOR, dtype=torch.int32, device=packed.device)).view(1, PACK_FACTOR, 1)
    codes = (packed.unsqueeze(1) >> shifts) & 15  # arithmetic shift is fine: the mask drops sign bits
    return codes.reshape(KW * PACK_FACTOR, N).to(torch.uint8)


def check_group_size(group_size: int, in_features: Optional[int] = None) -> None:
    """The 4-bit container's group rule, the one Python check of it: ``group_size`` a positive
    multiple of 8 and, for a layer, ``in_features`` (K) a positive multiple of it."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or \
            group_size % PACK_FACTOR != 0:
        raise ValueError(f"group_size must be a positive multiple of {PACK_FACTOR}, got {group_size!r}")
    if in_features is None:
        return
    if in_features <= 0 or in_features % PACK_FACTOR != 0:
        raise ValueError(f"in_features must be a positive multiple of {PACK_FACTOR}, got {in_features}")
    if in_features % group_size != 0:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")


def group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[K, N]`` -> ``[K/group_size, group_size, N]`` (a view, groups along K)."""
    K, N = w.shape
    check_group_size(group_size, K)
    return w.reshape(K // group_size, group_size, N)
