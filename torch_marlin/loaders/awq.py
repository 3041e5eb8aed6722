"""AWQ 4-bit checkpoints (AutoAWQ / HF ``quant_method: "awq"``, ``version: "gemm"``) to MarlinLinear u4.

AWQ stores ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[K/g, N/8]``: eight 4-bit values
along N per word, interleaved: nibble ``i`` (bits ``4i .. 4i+3``) of word ``j`` holds column
``8j + AWQ_ORDER[i]``, ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``. ``scales`` ``[K/g, N]``. The weight
is ``w = (q - z) * s`` (AWQ's ``b = -z * s`` with an integer ``z`` in 0..15), which is our ``u4``
exactly: codes and zero points are unpacked, de-interleaved and repacked along K.
"""

from typing import Optional

import torch

from .common import CheckpointError, build_marlin_linear, unpack_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Element 8j + i of a word is in nibble AWQ_UNPACK[i] (the inverse permutation of AWQ_ORDER).
AWQ_UNPACK = tuple(AWQ_ORDER.index(i) for i in range(8))


def awq_unpack(packed: torch.Tensor, name: str) -> torch.Tensor:
    """int32 ``[R, C/8]`` AWQ-interleaved -> uint8 ``[R, C]`` in column order."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.int32:
        raise CheckpointError(f"{name}: expected a 2-D int32 tensor, got {getattr(packed, 'dtype', None)} "
                              f"{tuple(getattr(packed, 'shape', ()))}")
    return unpack_words(packed, AWQ_UNPACK)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None,
             bits: int = 4, group_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
             name: str = "weight"):
    """u4 MarlinLinear from one AWQ GEMM layer: ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32
    ``[K/g, N/8]``, ``scales`` ``[K/g, N]``, ``bias`` ``[N]``. ``group_size`` (optional) is checked
    against ``K / scales.shape[0]``."""
    if bits != 4:
        raise ValueError(f"{name}: bits must be 4, got {bits}")
    q = awq_unpack(qweight, f"{name}: qweight")  # [K, N]
    K, N = q.shape
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[1] != N or scales.shape[0] == 0 \
            or K % scales.shape[0] != 0:
        raise CheckpointError(f"{name}: scales must be [K/group_size, N={N}] with K={K}, got "
                              f"{tuple(getattr(scales, 'shape', ()))}")
    G = scales.shape[0]
    if group_size not in (None, -1) and group_size * G != K:
        raise CheckpointError(f"{name}: group_size={group_size} disagrees with scales: K={K} / {G} groups")
    z = awq_unpack(qzeros, f"{name}: qzeros")
    if tuple(z.shape) != (G, N):
        raise CheckpointError(f"{name}: qzeros must have shape ({G}, {N // 8}), got {tuple(qzeros.shape)}")
    return build_marlin_linear("u4", q.t(), scales.t(), zeros=z.t(), bias=bias, dtype=dtype or scales.dtype,
                               device=qweight.device, name=name)
