"""compressed-tensors ``pack-quantized`` 4-bit integer weights (llm-compressor W4A16) to MarlinLinear u4.

Per quantized Linear ``X``: ``X.weight_packed`` int32 ``[N, K/8]`` (eight 4-bit values along K per
word, least significant first), ``X.weight_scale`` ``[N, K/g]`` (``[N, 1]`` for the channel
strategy), ``X.weight_shape`` ``[N, K]``, optionally ``X.weight_zero_point`` and ``X.weight_g_idx``.
The quantized values ``q`` are signed (-8..7) and stored offset by 8 (``q + 8``), and the weight is
``w = (q - zp) * scale``. So the stored nibble ``u = q + 8`` is our code and ``zp + 8`` our zero
point: ``w = (u - (zp + 8)) * scale``. Symmetric schemes have no zero point (``zp = 0``: zero 8).
Asymmetric ones store it packed the same way but along N: int32 ``[N/8, K/g]``, nibble ``i`` of
row ``j`` holding row ``8j + i``, offset by 8 (older files: unpacked int8 ``[N, K/g]``, signed).
``weight_g_idx`` ``[K]`` (activation ordering) maps each input column to its group.
"""

from typing import Mapping, Optional

import torch

from .common import CheckpointError, build_marlin_linear, group_permutation, unpack_words

FORMAT = "pack-quantized"
CT_OFFSET = 8


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_zero_point: Optional[torch.Tensor] = None,
                            weight_shape: Optional[torch.Tensor] = None, weight_g_idx: Optional[torch.Tensor] = None,
                            bias: Optional[torch.Tensor] = None, num_bits: int = 4,
                            dtype: Optional[torch.dtype] = None, name: str = "weight"):
    """u4 MarlinLinear from one ``pack-quantized`` layer's tensors (names as in the file)."""
    if num_bits != 4:
        raise ValueError(f"{name}: num_bits must be 4, got {num_bits}")
    if not isinstance(weight_packed, torch.Tensor) or weight_packed.dim() != 2 or weight_packed.dtype != torch.int32:
        raise CheckpointError(f"{name}.weight_packed: expected a 2-D int32 tensor [N, K/8], got "
                              f"{getattr(weight_packed, 'dtype', None)} {tuple(getattr(weight_packed, 'shape', ()))}")
    codes = unpack_words(weight_packed)
    N, K = codes.shape
    if weight_shape is not None:
        shape = tuple(int(v) for v in torch.as_tensor(weight_shape).reshape(-1).tolist())
        if shape != (N, K):
            raise CheckpointError(f"{name}.weight_shape: {shape} disagrees with weight_packed {tuple(weight_packed.shape)}"
                                  f" (unpacks to {(N, K)}; K must be a multiple of 8)")
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dim() != 2 or weight_scale.shape[0] != N \
            or weight_scale.shape[1] == 0 or K % weight_scale.shape[1] != 0:
        raise CheckpointError(f"{name}.weight_scale: expected [N={N}, K/group_size] with K={K}, got "
                              f"{tuple(getattr(weight_scale, 'shape', ()))}")
    G = weight_scale.shape[1]
    zp = weight_zero_point
    if zp is None or zp.numel() == 0:
        zeros = torch.full((N, G), CT_OFFSET, dtype=torch.uint8, device=codes.device)
    elif zp.dtype == torch.int32 and tuple(zp.shape) == ((N + 7) // 8, G):
        zeros = unpack_words(zp.t().contiguous()).t()[:N]
    elif not zp.is_floating_point() and tuple(zp.shape) == (N, G):
        zeros = zp.to(torch.int32) + CT_OFFSET
    else:
        raise CheckpointError(f"{name}.weight_zero_point: expected int32 [{(N + 7) // 8}, {G}] (packed) or integer "
                              f"[{N}, {G}], got {zp.dtype} {tuple(zp.shape)}")
    perm = None
    if weight_g_idx is not None and weight_g_idx.numel():
        perm = group_permutation(weight_g_idx, K, G, f"{name}.weight_g_idx")
    if perm is not None:
        codes = codes[:, perm]
    return build_marlin_linear("u4", codes, weight_scale, zeros=zeros, bias=bias,
                               dtype=dtype or weight_scale.dtype, input_perm=perm, device=codes.device, name=name)


def check_scheme(quantization_config: Mapping) -> Mapping:
    """The ``config_groups`` weight scheme if this loader handles it (``pack-quantized``, 4-bit
    integer weights, unquantized activations), else a ``ValueError`` saying what is not."""
    fmt = quantization_config.get("format")
    if fmt != FORMAT:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {FORMAT!r}")
    groups = quantization_config.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, Mapping)]
    if not schemes:
        raise ValueError("compressed-tensors quantization_config has no config_groups with weights")
    for s in schemes:
        if s is None or s.get("num_bits") != 4 or s.get("type", "int") != "int":
            raise ValueError(f"compressed-tensors weights must be 4-bit int (W4A16), got {s!r}")
    for g in groups.values():
        if g.get("input_activations"):
            raise ValueError("compressed-tensors schemes with quantized activations are not supported (W4A16 only)")
    return schemes[0]
