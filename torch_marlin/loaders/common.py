"""The one constructor every checkpoint loader ends in: unpacked 4-bit codes and per-group
parameters in the source's own orientation (``[N, K]``, one row per output feature) to a
:class:`MarlinLinear`, with every tensor checked first.

Formats (``w`` the weight of output ``n`` and input ``k``, ``g = k // group_size``):

* ``fp4``:    ``w = e2m1(codes) * scales``;
* ``u4``:     ``w = (codes - zeros) * scales``, ``zeros`` integers 0..15;
* ``affine``: ``w = codes * scales + offsets``, ``offsets`` floats.
"""

from typing import Optional

import torch

from ..dtypes import check_float_dtype
from ..formats.int4_packing import PACK_FACTOR, pack_int4
from ..modules import MarlinLinear


class CheckpointError(ValueError):
    """A checkpoint tensor does not have the shape, dtype or values its format requires."""


def _check_float(t: torch.Tensor, name: str, shape) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise CheckpointError(f"{name}: expected a float tensor of shape {tuple(shape)}, got "
                              f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{name}: contains inf or NaN")


def _to_dtype(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    out = t.to(dtype)
    if t.numel() and not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"{name}: values up to {float(t.abs().max()):g} overflow {dtype}; load with "
                              "dtype=torch.bfloat16 or torch.float32")
    return out


def default_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """The first 16-bit float dtype among ``tensors``, else float16 (the kernels' usual scale dtype)."""
    for t in tensors:
        if t is not None and t.dtype in (torch.float16, torch.bfloat16):
            return t.dtype
    return torch.float16


def group_permutation(g_idx: torch.Tensor, K: int, num_groups: int, name: str = "g_idx") -> Optional[torch.Tensor]:
    """For ``g_idx[k]`` (the group of input row ``k``): None when the groups are already consecutive
    rows (``k // group_size``), else the stable order of K that makes them so (int64 ``[K]``)."""
    if not isinstance(g_idx, torch.Tensor) or g_idx.dim() != 1 or g_idx.numel() != K or \
            g_idx.is_floating_point() or g_idx.is_complex():
        raise CheckpointError(f"{name}: expected an integer tensor of shape ({K},), got "
                              f"{getattr(g_idx, 'dtype', type(g_idx).__name__)} {tuple(getattr(g_idx, 'shape', ()))}")
    g = g_idx.to(torch.int64)
    if K and (int(g.min()) < 0 or int(g.max()) >= num_groups):
        raise CheckpointError(f"{name}: group indices must be in 0..{num_groups - 1}, got {int(g.min())}..{int(g.max())}")
    group_size = K // num_groups
    counts = torch.bincount(g, minlength=num_groups)
    if not bool((counts == group_size).all()):
        raise CheckpointError(f"{name}: every group must hold group_size={group_size} rows of K, got counts from "
                              f"{int(counts.min())} to {int(counts.max())}")
    if torch.equal(g, torch.arange(K, device=g.device) // group_size):
        return None
    return torch.sort(g, stable=True).indices


def build_marlin_linear(format: str, codes: torch.Tensor, scales: torch.Tensor, *,
                        zeros: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                        input_perm: Optional[torch.Tensor] = None, device=None,
                        name: str = "weight") -> MarlinLinear:
    """A :class:`MarlinLinear` holding exactly these codes and group parameters (no requantizing).

    ``codes`` integer ``[N, K]`` in 0..15 (``N`` outputs, ``K`` inputs); ``scales`` float
    ``[N, K/group_size]``; ``zeros`` integer ``[N, K/group_size]`` in 0..15 (``u4`` only);
    ``offsets`` float ``[N, K/group_size]`` (``affine`` only); ``bias`` ``[N]``. The group size is
    ``K / scales.shape[1]``. ``input_perm`` int64 ``[K]``: the codes' columns are the inputs in this
    order (act-order checkpoints, see :func:`group_permutation`). ``dtype``: scales, offsets and
    bias (default: the scales' dtype when 16-bit, else float16); values that overflow it raise.
    ``name`` prefixes every error message (the checkpoint's tensor name).
    """
    wanted = {"fp4": (), "u4": ("zeros",), "affine": ("offsets",)}
    if format not in wanted:
        raise ValueError(f"{name}: format must be one of {tuple(wanted)}, got {format!r}")
    given = {"zeros": zeros, "offsets": offsets}
    for key, t in given.items():
        if (t is not None) != (key in wanted[format]):
            raise ValueError(f"{name}: format {format!r} takes {' and '.join(wanted[format]) or 'no zeros or offsets'}"
                             f", got {key}={'a tensor' if t is not None else None}")

    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.is_floating_point():
        raise CheckpointError(f"{name}: codes must be a 2-D integer tensor [N, K], got "
                              f"{getattr(codes, 'dtype', type(codes).__name__)} {tuple(getattr(codes, 'shape', ()))}")
    N, K = codes.shape
    if N == 0 or K == 0 or K % PACK_FACTOR != 0:
        raise CheckpointError(f"{name}: in_features K={K} must be a positive multiple of 8 and out_features "
                              f"N={N} positive")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise CheckpointError(f"{name}: 4-bit codes must be in 0..15, got {int(codes.min())}..{int(codes.max())}")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[0] != N or scales.shape[1] == 0:
        raise CheckpointError(f"{name}: scales must be [N={N}, K/group_size], got "
                              f"{tuple(getattr(scales, 'shape', ()))}")
    G = scales.shape[1]
    if K % G != 0 or (K // G) % PACK_FACTOR != 0:
        raise CheckpointError(f"{name}: scales has {G} groups per row, which gives group size K/{G} = {K / G:g}; "
                              "it must be a whole multiple of 8")
    _check_float(scales, f"{name}: scales", (N, G))
    if zeros is not None:
        if not isinstance(zeros, torch.Tensor) or zeros.is_floating_point() or tuple(zeros.shape) != (N, G):
            raise CheckpointError(f"{name}: zeros must be an integer tensor of shape ({N}, {G}), got "
                                  f"{getattr(zeros, 'dtype', None)} {tuple(getattr(zeros, 'shape', ()))}")
        if int(zeros.min()) < 0 or int(zeros.max()) > 15:
            raise CheckpointError(f"{name}: zero points must be in 0..15, got {int(zeros.min())}..{int(zeros.max())}")
    if offsets is not None:
        _check_float(offsets, f"{name}: offsets", (N, G))
    if bias is not None:
        _check_float(bias, f"{name}: bias", (N,))
    if input_perm is not None:
        if tuple(input_perm.shape) != (K,) or not torch.equal(torch.sort(input_perm.to(torch.int64)).values,
                                                              torch.arange(K, device=input_perm.device)):
            raise CheckpointError(f"{name}: input_perm must be a permutation of 0..{K - 1}")

    dtype = dtype if dtype is not None else default_dtype(scales, offsets, bias)
    check_float_dtype(dtype)
    device = torch.device(device) if device is not None else codes.device
    mod = MarlinLinear(K, N, bias=bias is not None, format=format, group_size=K // G, dtype=dtype, device=device,
                       act_order=input_perm is not None)
    with torch.no_grad():
        mod.B_packed.copy_(pack_int4(codes.to(device).t()))
        mod.scales.copy_(_to_dtype(scales, dtype, f"{name}: scales").t())
        if zeros is not None:
            mod.zeros.copy_(zeros.t().to(torch.uint8))
        if offsets is not None:
            mod.offsets.copy_(_to_dtype(offsets, dtype, f"{name}: offsets").t())
        if bias is not None:
            mod.bias.copy_(_to_dtype(bias, dtype, f"{name}: bias"))
        if input_perm is not None:
            mod.input_perm.copy_(input_perm.to(torch.int64))
    return mod


def unpack_words(words: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 ``[..., C]`` of eight 4-bit fields each -> uint8 ``[..., 8*C]``: field ``order[i]`` of
    word ``j`` (bits ``4*order[i]`` .. ``4*order[i]+3``) becomes element ``8*j + i``."""
    if words.dtype != torch.int32:
        raise CheckpointError(f"expected int32 words (uint32 viewed as int32), got {words.dtype}")
    w = words
    shifts = 4 * torch.tensor(order, dtype=torch.int32, device=w.device)
    nib = (w.unsqueeze(-1) >> shifts) & 15
    return nib.reshape(*w.shape[:-1], w.shape[-1] * 8).to(torch.uint8)
