"""GGUF (llama.cpp) 4-bit tensors to MarlinLinear, block by block, without dequantizing.

A GGUF weight of shape ``(N, K)`` is ``N`` rows of ``K / block`` blocks; gguf-py's reader gives
its bytes as uint8 ``[N, K / block * bytes_per_block]``. Within a 32-value block of Q4_0 / Q4_1,
byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high nibble (ours
hold eight consecutive elements per word), so codes are unpacked here and repacked.

* Q4_0 (18 bytes: fp16 ``d``, 16 code bytes): ``w = d * (q - 8)``: ``u4``, group 32, zero 8.
* Q4_1 (20 bytes: fp16 ``d``, fp16 ``m``, 16 code bytes): ``w = d * q + m``: ``affine``, group 32.
* Q4_K (144 bytes per 256 values: fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit sub-scales
  ``sc`` and sub-mins ``m``, 128 code bytes): ``w = (d * sc) * q - dmin * m`` per 32-value
  sub-block: ``affine``, group 32, ``scale = d * sc`` and ``offset = -dmin * m`` (computed in
  float32, then rounded once to the layer's dtype). Its codes come in 4 chunks of 64 values, byte
  ``j`` of a chunk holding element ``j`` (low nibble) and ``j + 32`` (high nibble).
* MXFP4 (17 bytes: E8M0 ``e``, 16 code bytes, Q4_0's nibble order): ``fp4``, group 32.
"""

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .common import CheckpointError, build_marlin_linear
from .mxfp4 import e8m0_to_float

QK = 32
QK_K = 256
# ggml type name -> (values per block, bytes per block)
BLOCKS = {"Q4_0": (QK, 18), "Q4_1": (QK, 20), "Q4_K": (QK_K, 144), "MXFP4": (QK, 17)}
TYPES = tuple(BLOCKS)


def type_name(ggml_type) -> str:
    """``GGMLQuantizationType`` member, its name or its integer value -> the name."""
    name = getattr(ggml_type, "name", None)
    if name is None and isinstance(ggml_type, int):
        import gguf

        name = gguf.GGMLQuantizationType(ggml_type).name
    if name is None:
        name = str(ggml_type)
    return name.upper()


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` little-endian fp16 -> float32 ``[...]``."""
    return b.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., B]`` -> ``[..., 2B]``: all low nibbles (elements 0..B-1), then all high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def q4k_scale_min(sm: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K block -> (sub-scales, sub-mins), each uint8 ``[..., 8]``:
    sub-block ``j < 4`` is the low 6 bits of bytes ``j`` / ``j + 4``; ``j >= 4`` takes its low 4
    bits from byte ``j + 4`` (low / high nibble) and its top 2 from bytes ``j - 4`` / ``j``."""
    d, m, md = sm[..., 0:4], sm[..., 4:8], sm[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def gguf_unpack(data, ggml_type, shape: Sequence[int], name: str = "weight"):
    """Decodes the blocks into ``(format, codes uint8 [N, K], scales float32 [N, K/32],
    zeros or offsets or None)`` without dequantizing."""
    t = type_name(ggml_type)
    if t not in BLOCKS:
        raise ValueError(f"{name}: GGUF type {t} is not supported; supported: {', '.join(TYPES)}")
    if len(tuple(shape)) != 2:
        raise ValueError(f"{name}: shape must be (N, K), got {tuple(shape)}")
    N, K = (int(v) for v in shape)
    per_block, nbytes = BLOCKS[t]
    if N <= 0 or K <= 0 or K % per_block != 0:
        raise CheckpointError(f"{name}: {t} needs K (shape[1]) a positive multiple of {per_block}, got shape {(N, K)}")
    raw = torch.from_numpy(np.array(data)) if not isinstance(data, torch.Tensor) else data  # gguf-py gives a read-only memmap
    if raw.dtype != torch.uint8:
        raise CheckpointError(f"{name}: data must be the raw uint8 blocks, got {raw.dtype}")
    nb = K // per_block
    if raw.numel() != N * nb * nbytes:
        raise CheckpointError(f"{name}: {t} of shape {(N, K)} needs {N * nb * nbytes} bytes ({N} rows of {nb} blocks "
                              f"of {nbytes} bytes), got {raw.numel()} (truncated or wrong type?)")
    # Data that has rows (gguf-py gives [N, bytes per row]) must have this shape's rows: the same
    # byte count in other rows would be read as another layer.
    if raw.dim() > 1 and tuple(raw.shape) != (N, nb * nbytes):
        raise CheckpointError(f"{name}: {t} data of shape {tuple(raw.shape)} is not the {N} rows of {nb * nbytes} bytes "
                              f"that shape {(N, K)} needs")
    b = raw.reshape(N, nb, nbytes)
    if t == "Q4_0":
        d, qs = _f16(b[..., 0:2]), b[..., 2:]
        return "u4", _split_nibbles(qs).reshape(N, K), d, torch.full((N, nb), 8, dtype=torch.uint8)
    if t == "Q4_1":
        d, m, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:]
        return "affine", _split_nibbles(qs).reshape(N, K), d, m
    if t == "MXFP4":
        return "fp4", _split_nibbles(b[..., 1:]).reshape(N, K), e8m0_to_float(b[..., 0].contiguous(), name), None
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = q4k_scale_min(b[..., 4:16])
    codes = _split_nibbles(b[..., 16:].reshape(N, nb, 4, 32)).reshape(N, K)
    scales = (d.unsqueeze(-1) * sc.to(torch.float32)).reshape(N, nb * 8)
    offsets = -(dmin.unsqueeze(-1) * mn.to(torch.float32)).reshape(N, nb * 8)
    return "affine", codes, scales, offsets


def from_gguf(data, ggml_type, shape: Sequence[int], bias: Optional[torch.Tensor] = None,
              dtype: Optional[torch.dtype] = None, name: str = "weight"):
    """MarlinLinear from one GGUF tensor: ``data`` its raw blocks (uint8 numpy array or tensor, as
    ``gguf.GGUFReader`` gives ``tensor.data``), ``ggml_type`` a ``gguf.GGMLQuantizationType``, its
    name or value, ``shape`` ``(N, K)`` = (out_features, in_features) (the reverse of GGUF's
    ``ne`` order). ``dtype``: float16 by default (bfloat16 for MXFP4, whose power-of-two scales
    can leave fp16's range)."""
    fmt, codes, scales, extra = gguf_unpack(data, ggml_type, shape, name)
    if dtype is None:
        dtype = torch.bfloat16 if fmt == "fp4" else torch.float16
    kw = {"zeros": extra} if fmt == "u4" else {"offsets": extra} if fmt == "affine" else {}
    return build_marlin_linear(fmt, codes, scales, bias=bias, dtype=dtype, name=name, **kw)


def dequantize(data, ggml_type, shape: Sequence[int], name: str = "weight") -> torch.Tensor:
    """float32 ``[N, K]`` from the same decoding (for checks; the loaders never call it)."""
    fmt, codes, scales, extra = gguf_unpack(data, ggml_type, shape, name)
    G = scales.shape[1]
    g = codes.shape[1] // G
    if fmt == "fp4":
        from ..formats.fp4 import E2M1_VALUES
        vals = E2M1_VALUES[codes.long()]
    else:
        vals = codes.to(torch.float32)
    w = vals.reshape(codes.shape[0], G, g)
    if fmt == "u4":
        w = w - extra.to(torch.float32).unsqueeze(-1)
    w = w * scales.unsqueeze(-1)
    if fmt == "affine":
        w = w + extra.unsqueeze(-1)
    return w.reshape(codes.shape)
